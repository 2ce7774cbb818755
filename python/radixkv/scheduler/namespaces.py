"""Cache namespaces: names a scheduler gives requests (a tenant's cache salt,
SGLang's extra_key, vLLM's cache_salt, a LoRA adapter) mapped to the ids the
native tree keys its paths by, and to the seeds of their storage keys."""

from __future__ import annotations

import hashlib
from typing import Dict, Optional, Union

NamespaceName = Union[None, str, bytes, int]


def _encode(name) -> bytes:
    """The bytes a name stands for: its type and value, so that 5, "5" and
    b"5" are three namespaces."""
    if isinstance(name, str):
        return b"s" + name.encode("utf-8")
    if isinstance(name, (bytes, bytearray, memoryview)):
        return b"b" + bytes(name)
    return b"i" + str(name).encode("ascii")


class Namespaces:
    """Ids for namespace names, handed out in order of first use (None, the
    default namespace, is 0). Exact: two names get one id only when they are
    equal. Ids are never reused; the table grows by one entry per name seen."""

    def __init__(self) -> None:
        self._ids: Dict[bytes, int] = {}
        self._names = [b""]  # id -> encoded name; 0 is the default

    def id(self, name: NamespaceName, arg: str = "namespace") -> int:
        """The tree id of `name`: None, a str, bytes or an int. Raises
        TypeError naming `arg` for anything else (bool and float included)."""
        if name is None:
            return 0
        if isinstance(name, bool) or not isinstance(name, (str, bytes, bytearray, memoryview,
                                                           int)):
            raise TypeError(f"{arg} must be None, a str, bytes or an int, got "
                            f"{type(name).__name__}")
        key = _encode(name)
        ns = self._ids.get(key)
        if ns is None:
            ns = self._ids[key] = len(self._names)
            self._names.append(key)
        return ns

    def seed(self, ns: int, base: Optional[bytes]) -> Optional[bytes]:
        """The seed of the storage keys of namespace `ns` whose configuration
        seed is `base` (None: unseeded). The default namespace keeps `base`,
        so its keys are the configuration's (and, unseeded, SGLang's); every
        other one gets SHA-256 of `base` and its name, so two namespaces never
        read each other's pages from a shared store, across processes too."""
        if ns == 0:
            return base
        name = self._names[ns]
        return hashlib.sha256(b"radixkv-namespace-v1" + (base or b"") +
                              len(name).to_bytes(8, "little") + name).digest()

    def __len__(self) -> int:
        """Names seen, the default one included."""
        return len(self._names)
