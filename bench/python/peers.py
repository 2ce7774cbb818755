"""Adapters that put peer radix prefix caches behind one small interface.

Peers (each optional; see bench/PEERS.md for how to install them):

  sglang-radix    SGLang ``RadixCache`` (pure-Python tree)
  sglang-unified  SGLang ``UnifiedRadixCache`` with the bundled Rust TreeCore
  minisglang      mini-SGLang ``RadixPrefixCache`` (its "radix" cache manager)

Every adapter offers::

    insert(tokens, slots) -> int        # prefix length that was already cached
    match(tokens) -> (handle, indices)  # indices built the way the peer builds them
    lock(handle) / unlock(handle)
    evict(num_tokens) -> int            # tokens actually evicted
    evictable_size() -> int

``tokens`` / ``slots`` are 1-D CPU integer tensors.  Each adapter converts
them to the peer's native types (SGLang: ``array('q')`` keys and int64 slots;
mini-SGLang: int32 tokens and int32 slots); that conversion is part of the
call.  ``prepare(tokens)`` returns the native key so callers can hoist it out
of a timed region; ``insert``/``match`` accept either a tensor or a prepared key.

Paths: ``RADIXKV_PEERS_DIR`` (default ``/work/peers``) holds ``stubs/`` (the
torchvision stand-in, used only if torchvision is not installed) and
``mini-sglang/python`` (the mini-SGLang package).

SGLang's caches free KV slots through an allocator.  The adapters give them a
minimal stand-in (``SlotSink``) that only counts freed slots, so timings cover
the tree work, not a real allocator.  Note that ``UnifiedRadixCache.insert``
itself hands the duplicate part of ``slots`` back to the allocator, while
``RadixCache.insert`` and mini-SGLang leave that to their caller.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from array import array
from typing import Any, Callable, Dict, Optional, Tuple

import torch

PEERS_DIR = os.environ.get("RADIXKV_PEERS_DIR", "/work/peers")
STUBS_DIR = os.path.join(PEERS_DIR, "stubs")
MINISGLANG_DIR = os.path.join(PEERS_DIR, "mini-sglang", "python")

_CPU = torch.device("cpu")

_HOW_SGLANG = (
    "install with `pip install --no-deps sglang==0.5.23` plus the import-chain "
    "packages listed in bench/PEERS.md (all with --no-deps, torch left alone), "
    "and `python bench/python/peers.py --write-stubs` if torchvision is absent"
)
_HOW_MINISGLANG = (
    "extract mini-SGLang's python/ directory to "
    f"{os.path.dirname(MINISGLANG_DIR)} and `pip install --no-deps msgpack` "
    "(apache-tvm-ffi and a C++ compiler build its compare kernel); see bench/PEERS.md"
)

# ---------------------------------------------------------------------------
# torchvision stand-in (written to $RADIXKV_PEERS_DIR/stubs by --write-stubs)
# ---------------------------------------------------------------------------

TORCHVISION_STUB = '''\
"""radixkv import-only stand-in for torchvision; NOT the real package.

SGLang's mem_cache import chain imports torchvision for a multimodal model
config only.  Every name resolves to a placeholder that raises when called.
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+radixkv.stub"


class _Missing:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(self._name + "." + attr)

    def __call__(self, *args, **kwargs):
        raise RuntimeError(self._name + ": torchvision is not installed (radixkv stand-in)")

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(self.__name__ + "." + attr)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
'''


def write_stubs(stubs_dir: str = STUBS_DIR) -> str:
    """Write the torchvision stand-in under ``stubs_dir``; returns its path."""
    pkg = os.path.join(stubs_dir, "torchvision")
    os.makedirs(pkg, exist_ok=True)
    path = os.path.join(pkg, "__init__.py")
    with open(path, "w") as f:
        f.write(TORCHVISION_STUB)
    return path


def _ensure_torchvision_importable() -> None:
    if importlib.util.find_spec("torchvision") is None and os.path.isdir(
        os.path.join(STUBS_DIR, "torchvision")
    ):
        sys.path.insert(0, STUBS_DIR)


def _ensure_minisglang_on_path() -> None:
    if importlib.util.find_spec("minisgl") is None and os.path.isdir(MINISGLANG_DIR):
        sys.path.insert(0, MINISGLANG_DIR)


# ---------------------------------------------------------------------------
# Common base
# ---------------------------------------------------------------------------


class PeerCache:
    """Uniform adapter interface; one subclass per peer implementation."""

    name: str = "peer"

    def prepare(self, tokens: torch.Tensor) -> Any:
        """Peer-native form of ``tokens`` (what ``insert``/``match`` build internally)."""
        raise NotImplementedError

    def insert(self, tokens, slots: torch.Tensor) -> int:
        raise NotImplementedError

    def match(self, tokens) -> Tuple[Any, torch.Tensor]:
        raise NotImplementedError

    def lock(self, handle) -> None:
        raise NotImplementedError

    def unlock(self, handle) -> None:
        raise NotImplementedError

    def evict(self, num_tokens: int) -> int:
        raise NotImplementedError

    def evictable_size(self) -> int:
        raise NotImplementedError


# ---------------------------------------------------------------------------
# SGLang (RadixCache and UnifiedRadixCache)
# ---------------------------------------------------------------------------


class SlotSink:
    """Minimal token-to-KV allocator stand-in for SGLang's caches.

    The caches only hand slots back (on eviction, and for UnifiedRadixCache on
    duplicate inserts); this object counts them and owns no memory.
    """

    def __init__(self, size: int = 1 << 40, page_size: int = 1):
        self.device = _CPU
        self.page_size = page_size
        self.size = size
        self.size_full = size
        self.freed = 0

    def free(self, indices: torch.Tensor) -> None:
        self.freed += len(indices)

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        self.freed += len(indices) - start_pos

    free_full_segment = free_segment

    def available_size(self) -> int:
        return self.size

    full_available_size = available_size


class SglangHandle:
    """Matched tree node plus the lock receipts taken on it."""

    __slots__ = ("node", "prefix_len", "locks")

    def __init__(self, node: Any, prefix_len: int):
        self.node = node
        self.prefix_len = prefix_len
        self.locks: list = []


_sgl: Optional[Dict[str, Any]] = None


def _import_sglang() -> Dict[str, Any]:
    global _sgl
    if _sgl is None:
        _ensure_torchvision_importable()
        with warnings.catch_warnings():
            # The import chain warns that CPU lacks GPU quantization kernels.
            warnings.simplefilter("ignore")
            bpc = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
            cip = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
            rc = importlib.import_module("sglang.srt.mem_cache.radix_cache")
            urc = importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
            ct = importlib.import_module("sglang.srt.mem_cache.unified_cache.component_type")
        _sgl = {
            "MatchPrefixParams": bpc.MatchPrefixParams,
            "InsertParams": bpc.InsertParams,
            "EvictParams": bpc.EvictParams,
            "CacheInitParams": cip.CacheInitParams,
            "RadixKey": rc.RadixKey,
            "RadixCache": rc.RadixCache,
            "UnifiedRadixCache": urc.UnifiedRadixCache,
            "FULL": ct.ComponentType.FULL,
        }
    return _sgl


def _to_q_array(tokens: torch.Tensor) -> array:
    t = tokens.detach()
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    out = array("q")
    out.frombytes(memoryview(t.contiguous().numpy()).cast("B"))
    return out


class _SglangPeer(PeerCache):
    def __init__(self, cache: Any, allocator: SlotSink):
        s = _import_sglang()
        self.cache = cache
        self.allocator = allocator
        self._RadixKey = s["RadixKey"]
        self._MatchPrefixParams = s["MatchPrefixParams"]
        self._InsertParams = s["InsertParams"]
        self._EvictParams = s["EvictParams"]

    def prepare(self, tokens):
        return self._RadixKey(_to_q_array(tokens))

    def _key(self, tokens):
        return self.prepare(tokens) if isinstance(tokens, torch.Tensor) else tokens

    def insert(self, tokens, slots: torch.Tensor) -> int:
        if slots.dtype != torch.int64:
            slots = slots.to(torch.int64)
        res = self.cache.insert(self._InsertParams(key=self._key(tokens), value=slots))
        return int(res.prefix_len)

    def match(self, tokens):
        res = self.cache.match_prefix(self._MatchPrefixParams(key=self._key(tokens)))
        node, n = res.last_device_node, res.device_prefix_len
        # The scheduler reads prefix indices off the path to the matched node.
        indices = self.cache.path_device_indices(node)[:n]
        return SglangHandle(node, n), indices

    def lock(self, handle: SglangHandle) -> None:
        handle.locks.append(self.cache.lock(handle.node))

    def unlock(self, handle: SglangHandle) -> None:
        self.cache.unlock(handle.locks.pop())

    def evict(self, num_tokens: int) -> int:
        res = self.cache.evict(self._EvictParams(num_tokens=int(num_tokens)))
        return int(res.num_tokens_evicted)

    def evictable_size(self) -> int:
        return int(self.cache.evictable_size())


class SglangRadixPeer(_SglangPeer):
    name = "sglang-radix"

    def __init__(self, page_size: int = 1):
        s = _import_sglang()
        alloc = SlotSink(page_size=page_size)
        params = s["CacheInitParams"](
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=alloc,
            page_size=page_size,
        )
        super().__init__(s["RadixCache"](params), alloc)


class SglangUnifiedPeer(_SglangPeer):
    name = "sglang-unified"

    def __init__(self, page_size: int = 1):
        s = _import_sglang()
        alloc = SlotSink(page_size=page_size)
        params = s["CacheInitParams"](
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=alloc,
            page_size=page_size,
            tree_components=(s["FULL"],),
            tree_core_backend="rust",
        )
        cache = s["UnifiedRadixCache"](params)
        backend = getattr(cache, "_tree_core_backend", None)
        if backend != "rust":
            raise RuntimeError(
                f"UnifiedRadixCache fell back to the {backend!r} TreeCore "
                "(the Rust core needs Linux and torch 2.11-2.14)"
            )
        super().__init__(cache, alloc)


# ---------------------------------------------------------------------------
# mini-SGLang
# ---------------------------------------------------------------------------


def _minisgl_set_page_size(page_size: int) -> None:
    core = importlib.import_module("minisgl.core")
    try:
        core.get_global_ctx().page_size = page_size
    except AssertionError:  # no global context yet
        core.set_global_ctx(core.Context(page_size=page_size))


class MiniSglangPeer(PeerCache):
    name = "minisglang"

    def __init__(self, page_size: int = 1):
        _ensure_minisglang_on_path()
        kvcache = importlib.import_module("minisgl.kvcache")
        # RadixPrefixCache reads the page size from the global context once.
        _minisgl_set_page_size(page_size)
        self.cache = kvcache.create_prefix_cache(device=_CPU, type="radix")
        self._empty = torch.empty(0, dtype=torch.int32)

    def prepare(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens if tokens.dtype == torch.int32 else tokens.to(torch.int32)
        return t.contiguous()

    def insert(self, tokens, slots: torch.Tensor) -> int:
        if slots.dtype != torch.int32:
            slots = slots.to(torch.int32)
        res = self.cache.insert_prefix(self.prepare(tokens), slots)
        return int(res.cached_len)

    def match(self, tokens):
        handle = self.cache.match_prefix(self.prepare(tokens)).cuda_handle
        # Its scheduler only gathers indices when something matched.
        indices = handle.get_matched_indices() if handle.cached_len > 0 else self._empty
        return handle, indices

    def lock(self, handle) -> None:
        self.cache.lock_handle(handle)

    def unlock(self, handle) -> None:
        self.cache.lock_handle(handle, unlock=True)

    def evict(self, num_tokens: int) -> int:
        # mini-SGLang asserts when asked for more than is evictable.
        n = min(int(num_tokens), self.evictable_size())
        if n <= 0:
            return 0
        return len(self.cache.evict(n))

    def evictable_size(self) -> int:
        return int(self.cache.size_info.evictable_size)


# ---------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------


def _probe_sglang() -> None:
    _import_sglang()


def _probe_minisglang() -> None:
    _ensure_minisglang_on_path()
    if importlib.util.find_spec("minisgl") is None:
        raise ImportError(f"minisgl not found (looked in {MINISGLANG_DIR})")
    importlib.import_module("minisgl.kvcache.radix_cache")
    kernel = importlib.import_module("minisgl.kernel")
    # First call builds the tvm-ffi compare kernel; fail here, not mid-benchmark.
    kernel.fast_compare_key(
        torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32)
    )


_PEERS = [
    ("sglang-radix", SglangRadixPeer, _probe_sglang, _HOW_SGLANG),
    ("sglang-unified", SglangUnifiedPeer, _probe_sglang, _HOW_SGLANG),
    ("minisglang", MiniSglangPeer, _probe_minisglang, _HOW_MINISGLANG),
]

_available: Optional[Dict[str, Callable[..., PeerCache]]] = None


def available_peers(verbose: bool = True) -> Dict[str, Callable[..., PeerCache]]:
    """Name -> factory(page_size=1) for every peer that imports and builds here.

    Missing peers are skipped with a note on stderr saying why and how to install.
    """
    global _available
    if _available is None:
        found: Dict[str, Callable[..., PeerCache]] = {}
        for name, cls, probe, how in _PEERS:
            try:
                probe()
                cls(page_size=1)  # constructing once catches e.g. a Rust-core fallback
            except Exception as exc:  # noqa: BLE001 - report any failure and move on
                if verbose:
                    print(
                        f"[peers] skipping {name}: {type(exc).__name__}: {exc}\n"
                        f"[peers]   to enable it: {how}",
                        file=sys.stderr,
                    )
                continue
            found[name] = cls
        _available = found
    return dict(_available)


# ---------------------------------------------------------------------------
# Smoke check
# ---------------------------------------------------------------------------


def _median_us(samples_ns) -> float:
    s = sorted(samples_ns)
    n = len(s)
    mid = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return mid / 1000.0


def smoke(
    num_seqs: int = 1000,
    seq_len: int = 1024,
    shared: int = 512,
    reps: int = 200,
    evict_tokens: int = 1024,
    seed: int = 0,
) -> None:
    from time import perf_counter_ns as now

    peers = available_peers()
    if not peers:
        print("no peers available")
        return
    gen = torch.Generator().manual_seed(seed)
    vocab = 32000
    prefix = torch.randint(0, vocab, (shared,), generator=gen)

    def make_seq():
        return torch.cat([prefix, torch.randint(0, vocab, (seq_len - shared,), generator=gen)])

    seqs = [make_seq() for _ in range(num_seqs)]
    refill = [make_seq() for _ in range(reps * 2)]
    print(
        f"{num_seqs} seqs x {seq_len} tokens, {shared}-token shared prefix, "
        f"page_size=1; median us (insert over {num_seqs} calls, others over {reps})"
    )
    header = (
        f"{'peer':16s} {'insert':>9s} {'match(key)':>11s} {'match(tensor)':>14s} "
        f"{'lock+unlock':>12s} {'evict':>9s}  notes"
    )
    print(header)
    for name, factory in peers.items():
        p = factory(page_size=1)
        next_slot = 0

        def slots_for(n):
            nonlocal next_slot
            s = torch.arange(next_slot, next_slot + n, dtype=torch.int64)
            next_slot += n
            return s

        ins = []
        for tok in seqs:
            sl = slots_for(seq_len)
            t0 = now()
            p.insert(tok, sl)
            ins.append(now() - t0)

        probe = seqs[num_seqs // 2]
        handle, idx = p.match(probe)
        hit = len(idx)

        # match including the tensor -> native key conversion and the indices tensor
        m_full = []
        for _ in range(reps):
            t0 = now()
            p.match(probe)
            m_full.append(now() - t0)
        # match on a prepared key (conversion hoisted out)
        key = p.prepare(probe)
        m_key = []
        for _ in range(reps):
            t0 = now()
            p.match(key)
            m_key.append(now() - t0)

        lk = []
        for _ in range(reps):
            t0 = now()
            p.lock(handle)
            p.unlock(handle)
            lk.append(now() - t0)

        # evict from a tree kept at num_seqs sequences: each timed evict is
        # followed by untimed re-inserts of as many fresh sequences.
        ev, freed_total = [], 0
        per = max(1, evict_tokens // (seq_len - shared))
        it = iter(refill)
        for _ in range(reps):
            t0 = now()
            freed = p.evict(evict_tokens)
            ev.append(now() - t0)
            freed_total += freed
            for _ in range(per):
                p.insert(next(it), slots_for(seq_len))

        print(
            f"{name:16s} {_median_us(ins):9.1f} {_median_us(m_key):11.1f} "
            f"{_median_us(m_full):14.1f} {_median_us(lk):12.2f} {_median_us(ev):9.1f}  "
            f"hit={hit} freed/evict={freed_total / reps:.0f} "
            f"evictable={p.evictable_size()}"
        )
    print(
        "match(key): prepared native key; match(tensor): from a torch tensor, "
        "key conversion included; both build the indices tensor"
    )


if __name__ == "__main__":
    if "--write-stubs" in sys.argv[1:]:
        print("wrote", write_stubs())
    else:
        smoke()
