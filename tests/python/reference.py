"""A small, deliberately naive pure-Python model of RadixCacheManager.

Plain lists and dicts, linear scans, no heap, no torch: easy to read and check
by eye. It follows the contract of `radixkv.kvcache`'s managers (docs/api.md) plus the logical
clock of the native core, so that timestamps and eviction order can be compared
exactly:

- the clock advances by one on every successful match_prefix, insert_prefix,
  lock_handle (lock or unlock), evict and reset call, and on nothing else (a
  call that raises leaves the clock alone);
- match_prefix sets the timestamp of every node on the matched path (after a
  split) to the new clock value; insert_prefix does the same for its path and
  the new leaf;
- a split keeps the old node as the suffix (with its old timestamp, its
  children and its identity, so handles to it stay valid) and creates a new
  parent node for the prefix with the same ref_count.

Eviction removes the unlocked leaf with the smallest timestamp, one at a time,
until enough tokens are freed. Under the clock rules above no two unlocked
leaves share a timestamp, so the order is fully determined.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple


class RefOutOfCapacity(RuntimeError):
    """The model's counterpart of radixkv.OutOfCapacityError."""


class RefNode:
    __slots__ = (
        "key",
        "value",
        "parent",
        "children",
        "ref_count",
        "timestamp",
        "alive",
        "hits",
        "created",
        "priority",
        "ns",
    )

    def __init__(self, key, value, parent, timestamp, ref_count=0, ns=0):
        self.key: List[int] = list(key)
        self.value: List[int] = list(value)
        self.parent: Optional[RefNode] = parent
        self.children: Dict[Tuple[int, ...], RefNode] = {}
        self.ref_count = ref_count
        self.timestamp = timestamp
        self.alive = True
        self.hits = 0  # matches that reached it (lfu)
        self.created = timestamp  # when its tokens were first cached (fifo)
        self.priority = 0  # the highest priority an insert gave it
        self.ns = ns  # cache namespace: the root's children are keyed by it

    def depth(self) -> int:
        d, x = 0, self
        while x is not None:
            d += len(x.key)
            x = x.parent
        return d


class RefHandle:
    __slots__ = ("owner", "node", "cached_len", "lock_count")

    def __init__(self, owner, node, cached_len):
        self.owner = owner
        self.node = node
        self.cached_len = cached_len
        self.lock_count = 0


# Eviction order per policy: the unlocked leaf with the smallest key goes first.
POLICY_KEYS = {
    "lru": lambda x: x.timestamp,
    "lfu": lambda x: (min(x.hits, 2**24 - 1), x.timestamp),
    "fifo": lambda x: x.created,
    "mru": lambda x: -x.timestamp,
    "priority": lambda x: (min(max(x.priority, -(2**15)), 2**15 - 1), x.timestamp),
    "slru": lambda x: (x.hits >= 2, x.timestamp),
}
# tlru's key needs the tree's TEL-safe length: ReferenceRadixCache makes it.


class ReferenceRadixCache:
    def __init__(self, page_size: int = 1, policy: str = "lru", tel_safe: int = 0):
        assert page_size >= 1
        self.page_size = page_size
        if policy == "tlru":  # leaves of at most tel_safe tokens first
            self.key = lambda x: (len(x.key) > tel_safe, x.timestamp)
        else:
            self.key = POLICY_KEYS[policy]
        self.clock = 0
        self.root = RefNode([], [], None, 0)

    # -- helpers -----------------------------------------------------------
    def _page(self, tokens, pos=0) -> Tuple[int, ...]:
        return tuple(tokens[pos : pos + self.page_size])

    def _child_key(self, parent: RefNode, tokens, pos=0, ns=0):
        """Children are keyed by their first page, and under the root by the
        namespace too (paths of different namespaces never meet)."""
        page = self._page(tokens, pos)
        return (ns, page) if parent is self.root else page

    def _round(self, n: int) -> int:
        return n - n % self.page_size

    def _nodes(self) -> List[RefNode]:
        out, todo = [], list(self.root.children.values())
        while todo:
            x = todo.pop()
            out.append(x)
            todo.extend(x.children.values())
        return out

    def _path(self, node: RefNode) -> List[RefNode]:
        """Nodes from `node` up to (not including) the root."""
        out = []
        while node is not self.root:
            out.append(node)
            node = node.parent
        return out

    def _walk(self, tokens, n, ns=0):
        """(deepest fully matched node, partially matched child or None, its matched
        length, matched length). Changes nothing."""
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(self._child_key(node, tokens, pos, ns))
            if child is None:
                break
            m = 0
            limit = min(len(child.key), n - pos)
            while m < limit and child.key[m] == tokens[pos + m]:
                m += 1
            m = self._round(m)
            pos += m
            if m < len(child.key):
                return node, child, m, pos
            node = child
        return node, None, 0, pos

    def _split(self, node: RefNode, pos: int) -> RefNode:
        """Cut `node` after `pos` tokens; return the new prefix node."""
        assert 0 < pos < len(node.key) and pos % self.page_size == 0
        parent = node.parent
        prefix = RefNode(
            node.key[:pos], node.value[:pos], parent, node.timestamp, node.ref_count, node.ns
        )
        prefix.hits, prefix.created, prefix.priority = node.hits, node.created, node.priority
        parent.children[self._child_key(parent, node.key, 0, node.ns)] = prefix
        node.key = node.key[pos:]
        node.value = node.value[pos:]
        node.parent = prefix
        prefix.children[self._child_key(prefix, node.key, 0, node.ns)] = node
        return prefix

    def _touch(self, node: RefNode) -> None:
        for x in self._path(node):
            x.timestamp = self.clock

    def _resolve(self, handle: RefHandle) -> RefNode:
        if not isinstance(handle, RefHandle):
            raise TypeError("handle must be a RefHandle")
        if handle.owner is not self:
            raise ValueError("handle belongs to another cache manager")
        if not handle.node.alive:
            raise ValueError("handle is stale")
        return handle.node

    # -- the manager API -----------------------------------------------------
    def match_prefix(self, tokens, namespace: int = 0) -> Tuple[RefHandle, List[int]]:
        tokens = list(tokens)
        n = self._round(len(tokens))
        node, partial, partial_len, _ = self._walk(tokens, n, namespace)
        self.clock += 1
        if partial is not None:
            node = self._split(partial, partial_len)
        self._touch(node)
        for x in self._path(node):
            x.hits += 1
        slots: List[int] = []
        for x in reversed(self._path(node)):
            slots.extend(x.value)
        return RefHandle(self, node, len(slots)), slots

    def insert_prefix(self, tokens, slots, priority: int = 0, namespace: int = 0) -> int:
        tokens, slots = list(tokens), list(slots)
        if len(tokens) != len(slots):
            raise ValueError("indices has a different length than input_ids")
        n = self._round(len(tokens))
        node, partial, partial_len, pos = self._walk(tokens, n, namespace)
        if pos < n:
            new = slots[pos:n]
            stored = {s for x in self._nodes() for s in x.value}
            if any(s < 0 for s in new):
                raise ValueError("indices: negative slot")
            if len(set(new)) != len(new):
                raise ValueError("indices: slot appears twice")
            if any(s in stored for s in new):
                raise ValueError("indices: slot already stored")
        self.clock += 1
        if partial is not None:
            node = self._split(partial, partial_len)
        for x in self._path(node):
            x.priority = max(x.priority, priority)
        self._touch(node)
        if pos < n:
            leaf = RefNode(tokens[pos:n], slots[pos:n], node, self.clock, 0, namespace)
            leaf.priority = priority
            node.children[self._child_key(node, leaf.key, 0, namespace)] = leaf
        return pos

    def lock_handle(self, handle: RefHandle, unlock: bool = False) -> None:
        node = self._resolve(handle)
        if unlock and handle.lock_count == 0:
            raise ValueError("handle is not locked")
        self.clock += 1
        for x in self._path(node):
            x.ref_count += -1 if unlock else 1
            assert x.ref_count >= 0
        handle.lock_count += -1 if unlock else 1

    def evict(self, size: int) -> List[int]:
        if size < 0:
            raise ValueError("size must be >= 0")
        evictable = self.size_info()[0]
        if size > evictable:
            raise RefOutOfCapacity(f"cannot evict {size}: evictable_size is {evictable}")
        self.clock += 1
        out: List[int] = []
        freed = 0
        while freed < size:
            leaves = [x for x in self._nodes() if not x.children and x.ref_count == 0]
            victim = min(leaves, key=self.key)
            assert sum(self.key(x) == self.key(victim) for x in leaves) == 1, "eviction tie"
            out.extend(victim.value)
            freed += len(victim.key)
            del victim.parent.children[self._child_key(victim.parent, victim.key, 0, victim.ns)]
            victim.alive = False
        return out

    def reset(self) -> None:
        for x in self._nodes():
            x.alive = False
        self.root.alive = False
        self.root = RefNode([], [], None, 0)
        self.clock += 1

    def size_info(self) -> Tuple[int, int]:
        evictable = protected = 0
        for x in self._nodes():
            if x.ref_count == 0:
                evictable += len(x.key)
            else:
                protected += len(x.key)
        return evictable, protected

    @property
    def num_nodes(self) -> int:
        return len(self._nodes())

    def is_valid(self, handle: RefHandle) -> bool:
        return handle.owner is self and handle.node.alive

    def dump(self) -> List[Tuple[int, List[int], List[int], int, int]]:
        """(parent_index, key, value, ref_count, timestamp) per node.

        The native traversal (RadixTree::Dump): a stack of (node, index) starting
        at the root; popping a node appends all its children to the output at
        once, then pushes them so that the smallest key is popped next. Children
        of one node are listed in ascending lexicographic key order (the order
        documented by RadixCacheManager.dump and RadixTree::Dump)."""
        out: List[Tuple[int, List[int], List[int], int, int]] = []
        stack = [(self.root, -1)]
        while stack:
            x, index = stack.pop()
            kids = sorted(x.children.values(), key=lambda c: c.key)
            base = len(out)
            for c in kids:
                out.append((index, list(c.key), list(c.value), c.ref_count, c.timestamp))
            for j in range(len(kids) - 1, -1, -1):
                stack.append((kids[j], base + j))
        return out


def canonical(dump) -> List[Tuple[Tuple[int, ...], List[int], List[int], int, int]]:
    """A dump with sibling order factored out: each node named by the tokens from
    the root to its end (which also pins down its parent), sorted by that path.
    Two dumps of the same tree give the same canonical form whatever order they
    list siblings in."""
    paths: List[Tuple[int, ...]] = []
    out = []
    for parent, key, value, ref_count, timestamp in dump:
        path = (paths[parent] if parent >= 0 else ()) + tuple(key)
        paths.append(path)
        out.append((path, list(key), list(value), ref_count, timestamp))
    out.sort(key=lambda row: row[0])
    return out
