"""Cache namespaces: names a scheduler gives requests (a tenant's cache salt,
SGLang's extra_key, vLLM's cache_salt, a LoRA adapter) mapped to the ids the
native tree keys its paths by, and to the seeds of their storage keys."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Dict, List, Optional, Union

NamespaceName = Union[None, str, bytes, int]


def _encode(name) -> bytes:
    """The bytes a name stands for: its type and value, so that 5, "5" and
    b"5" are three namespaces."""
    if isinstance(name, str):
        # A lone surrogate (JSON's "\ud800" decodes to one) is a name too;
        # its bytes are no valid string's.
        return b"s" + name.encode("utf-8", "surrogatepass")
    if isinstance(name, (bytes, bytearray, memoryview)):
        return b"b" + bytes(name)
    return b"i" + str(name).encode("ascii")


class Namespaces:
    """Ids for namespace names (None and 0 are the default namespace, id 0),
    handed out in order of first use and never reused. Exact: two names get
    one id only when they are equal.

    At most `capacity` names are remembered; past that the least recently
    used one is forgotten, unless it is pinned (a namespace with a quota). A forgotten name's prefixes are then never found
    again (its next request gets a new id: a miss, never a wrong hit) and age
    out of the cache in its eviction order; its pages not yet written to
    storage are not written (their seed is gone with the name)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._ids: "OrderedDict[bytes, int]" = OrderedDict()  # least recently used first
        self._names: Dict[int, bytes] = {}
        self._pinned: set = set()  # ids never forgotten (a quota's namespace)
        self._next = 1

    @staticmethod
    def check(name: NamespaceName, arg: str = "namespace") -> None:
        """Raises TypeError naming `arg` unless `name` is None, a str, bytes
        or an int (bool and float are refused)."""
        if name is not None and (
            isinstance(name, bool) or not isinstance(name, (str, bytes, bytearray, memoryview, int))
        ):
            raise TypeError(
                f"{arg} must be None, a str, bytes or an int, got " f"{type(name).__name__}"
            )

    @staticmethod
    def is_default(name) -> bool:
        """None or 0: the default namespace (nothing to remember)."""
        return name is None or (type(name) is int and name == 0)

    def id(self, name: NamespaceName, arg: str = "namespace") -> int:
        """The tree id of `name` (see `check`), remembered as just used."""
        self.check(name, arg)
        if name is None or (isinstance(name, int) and name == 0):
            return 0
        key = _encode(name)
        ns = self._ids.get(key)
        if ns is not None:
            self._ids.move_to_end(key)
            return ns
        if len(self._ids) >= self.capacity:
            self._forget_one()
        ns = self._next
        self._next += 1
        self._ids[key] = ns
        self._names[ns] = key
        return ns

    def ids(self, namespace, names: Optional[list], count: int) -> List[int]:
        """The ids of a batch of `count` requests: of `names` (one each,
        `namespace[i]`), all checked before any is remembered, or else of
        `namespace` for all."""
        if names is None:
            return [self.id(namespace)] * count
        for i, x in enumerate(names):
            self.check(x, f"namespace[{i}]")
        return [self.id(x) for x in names]

    def find(self, name: NamespaceName, arg: str = "namespace") -> Optional[int]:
        """The id of `name` if it is remembered (or the default), else None;
        remembers nothing and changes no order."""
        self.check(name, arg)
        if name is None or (isinstance(name, int) and name == 0):
            return 0
        return self._ids.get(_encode(name))

    def _forget_one(self) -> None:
        """Forgets the least recently used name that is not pinned (none when
        every remembered name is: the capacity is then exceeded)."""
        for key, ns in self._ids.items():
            if ns not in self._pinned:
                del self._ids[key]
                del self._names[ns]
                return

    def pin(self, ns: int, pinned: bool = True) -> None:
        """Keeps `ns` (a remembered id; the default needs none) from being
        forgotten, or lets it be again."""
        if ns == 0:
            return
        if pinned:
            self._pinned.add(ns)
        else:
            self._pinned.discard(ns)

    def known(self, ns: int) -> bool:
        """Whether `ns` is the default or a remembered name's id."""
        return ns == 0 or ns in self._names

    def seed(self, ns: int, base: Optional[bytes]) -> Optional[bytes]:
        """The seed of the storage keys of namespace `ns` whose configuration
        seed is `base` (None: unseeded). The default namespace keeps `base`,
        so its keys are the configuration's (and, unseeded, SGLang's); every
        other one gets SHA-256 of `base` and its name, so two namespaces never
        read each other's pages from a shared store, across processes too.
        Raises KeyError for an id that is not `known`."""
        if ns == 0:
            return base
        name = self._names[ns]
        base = base or b""
        return hashlib.sha256(
            b"radixkv-namespace-v1"
            + len(base).to_bytes(8, "little")
            + base
            + len(name).to_bytes(8, "little")
            + name
        ).digest()

    def __len__(self) -> int:
        """Names remembered, the default one excluded."""
        return len(self._ids)
