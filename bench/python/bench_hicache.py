"""radixkv's host tier against SGLang's own HiCache on the Mooncake trace, in
one run: the time a request spends in the cache's calls, and the hit rates.

Both replay TRACE (the conversation trace of the Mooncake FAST'25 release,
`conversation_trace.jsonl` in github.com/kvcache-ai/Mooncake under
`FAST25-release/traces`) one request at a time with one configuration: page
512 (the trace's block size), a device pool of 5,859 pages, a host pool of
11,718 pages (5,999,616 tokens), write_through, no K/V bytes stored
(bookkeeping only), and every copy of a request finished and acknowledged
before the next one matches. Per request, the scheduler's calls:

  radixkv   CacheManager as radixkv.replay's serve() drives it: match_req;
            load_back of a host hit, else lock; make_room + allocate for the
            prefill, then for the decode tokens the last prefill page cannot
            hold; free_and_cache_finished_req; drain.
  SGLang    UnifiedRadixCache + init_hicache() (its default Rust tree core,
            its HybridCacheController and host pool): match_prefix (a
            RadixKey capped at all but the last token) and the prefix's
            indices (path_device_indices); for a host hit, init_load_back
            under the scheduler's pins of best_match_node (inc_host_lock_ref
            + lock), then lock and ready_to_load_host_cache (start_loading);
            else lock; evict_to_free_tokens + alloc of whole pages, prefill
            then decode as above (alloc is the allocator's page call: the
            pages alloc_extend hands out after a page-aligned prefix); then
            what cache_finished_req does with a FULL-only tree
            (checkpoint_into_tree + release_kv_cache): insert of the
            page-aligned prompt and output, the second insert that splits
            the leaf at the prompt, the new path's indices, the lock moved
            onto the new node, the partial last page freed, unlock; then
            check_hicache_events (start_writing of the queued backups,
            writing_check, loading_check).

Timed: those calls only. Outside the timing, the same for both: the prompts
and outputs from radixkv.replay.traces (load_mooncake, TokenMaker) and their
native form (int32 tensors for radixkv, array('q') for SGLang, as its Req
holds them). A round replays the requests through a fresh cache; systems
alternate round by round. Per request = a round's time in the calls over its
requests; the figure is the median of the rounds, with min..max. Per-op
medians pool every round's calls (evict: the calls that evicted). torch runs
one intra-op thread, as the replay does. What is built before the rounds
(the trace, the imports, the warm-up's leftovers) is frozen out of Python's
garbage collector (`gc.freeze()`, as vLLM's engine does after start-up and
SGLang's on `/freeze_gc`); each round's cache and its objects are not.

SGLang on a CPU: its device module is torch.cpu, whose streams and events
stand in for CUDA's (an event is complete once recorded, so every ack is
ready at the next check). Replaced, here only and before the cache is
built: the host pool's buffer is a plain torch.zeros (SGLang pins it with
cudaHostRegister), and the K/V copy functions pool_host.mha calls
(transfer_kv_all_layer_lf_pf and transfer_kv_per_layer_pf_lf, the
sgl_kernel kernels of the kernel io backend; transfer_kv_direct of the
direct one) do nothing: no bytes move. The tree, the host pool's slot
accounting, the controller's queues, its index handling and its acks are
SGLang's own. io backend kernel with layout page_first (SGLang's defaults;
`--sglang-io direct`: direct with layer_first, whose start_writing and
start_loading also sort the host indices on the CPU); device pool
MHATokenToKVPool of 1 layer, 1 head, head_dim 4, fp16 (allocated, never
written); the host ratio is set so the host pool is 11,718 pages (a
ratio-sized pool gets one padding page more).

When SGLang does not import, radixkv with the host tier runs against radixkv
device-only (same pool, no host tier), and the output says why.

    RADIXKV_SGLANG_VENV=<venv> python bench/python/bench_hicache.py TRACE \\
        [--rounds 3] [--requests N] [--sglang-io kernel|direct] [--json] \\
        [--pages | --both] [--page-size 16] [--native-calls]

`--pages` runs radixkv through its page path, `--both` through both paths
(and SGLang); `--page-size` changes both caches' page size, their pools
keeping the same tokens; `--native-calls` then replays radixkv (with its
host tier; the page path when it ran) once more under cProfile and prints
its native calls' time, per call and per request: the floor under its
Python.

<venv> is the SGLang venv .ci/engines builds (it prints its path); the
script runs itself again with that venv's python, which holds SGLang 0.5.23
and radixkv as a wheel of build/release (the CPU shims on its path only
stand in for torchvision and sgl_kernel imports).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import logging
import os
import statistics
import sys
import time
import warnings
from array import array
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import _ensure_torchvision_importable, _to_q_array  # noqa: E402

import radixkv  # noqa: E402
from radixkv.replay.traces import Request, TokenMaker, load_mooncake, max_hash_id  # noqa: E402
from radixkv.scheduler import CacheManager  # noqa: E402

BLOCK = 512  # the trace's hash blocks
PAGE = 512  # the caches' page size (--page-size; the pools keep their token counts)
DEVICE_PAGES = 5859
HOST_PAGES = 11718
WARMUP = 200  # requests replayed through each system before the rounds
OPS = ("match", "load_back", "lock", "evict", "allocate", "insert", "drain")
clock = time.perf_counter_ns


class Figures:
    """One round of one system: hit tokens, time in the cache's calls, per-op samples."""

    def __init__(self):
        self.requests = self.skipped = 0
        self.input_tokens = self.device_hit = self.host_hit = 0
        self.spent_ns = 0
        self.ops: Dict[str, List[int]] = {op: [] for op in OPS}

    def add(self, op: str, ns: int) -> int:
        self.ops[op].append(ns)
        return ns


def request_slots(
    allocate, prefix: torch.Tensor, prefill: int, out: int, f: Figures, unit: int = 1
):
    """A request's row of slots as a scheduler builds it, in parts: the
    match's `prefix`, pages for the `prefill` tokens, then pages for the `out`
    decode tokens the last prefill page cannot hold. `allocate(n, f)` is a
    system's timed allocation, returning (slots, ns), or with `unit` (the page
    size) page ids. Returns (parts, ns)."""
    own, spent = allocate(prefill, f)
    parts = [prefix, own]
    spare = own.shape[0] * unit - prefill
    if out > spare:
        more, ns = allocate(out - spare, f)
        spent += ns
        parts.append(more)
    return parts, spent


# ---------------------------------------------------------------------------
# radixkv
# ---------------------------------------------------------------------------


class Radixkv:
    """CacheManager driven as radixkv.replay's Instance.serve() drives it;
    with `pages`, through its page path (page ids cross, not slots:
    match_pages, allocate_pages, free_and_cache_finished_req_pages)."""

    def __init__(self, host_pages: int, pages: bool = False):
        self.host_pages = host_pages
        self.cm = cm = CacheManager(
            DEVICE_PAGES,
            page_size=PAGE,
            host_num_pages=host_pages,
            write_policy="write_through",
            manual_copies=host_pages > 0,
        )
        self.unit = PAGE if pages else 1  # tokens an entry of the calls' results
        self.match = cm.match_pages if pages else cm.match_req
        self.load_back = cm.load_back_pages if pages else cm.load_back
        self.allocate = cm.allocate_pages if pages else cm.allocate
        self.finish_req = (
            cm.free_and_cache_finished_req_pages if pages else cm.free_and_cache_finished_req
        )

    @staticmethod
    def native(ids: torch.Tensor, out_ids: torch.Tensor):
        return ids, torch.cat([ids, out_ids]) if out_ids.numel() else ids

    def serve(self, req: Request, prompt, full, f: Figures) -> None:
        cm, n_in, out = self.cm, req.input_length, req.output_length
        t0 = clock()
        handle, cached = self.match(prompt)
        spent = f.add("match", clock() - t0)
        device_hit = handle.cached_len
        if handle.host_hit_len:
            t0 = clock()
            handle, cached = self.load_back(handle)
            spent += f.add("load_back", clock() - t0)
        else:
            t0 = clock()
            cm.lock(handle)
            spent += f.add("lock", clock() - t0)
        hit = handle.cached_len

        parts, ns = request_slots(self._allocate, cached, n_in - hit, out, f, self.unit)
        spent += ns

        t0 = clock()  # the row of slots joined inside the timing, as SGLang's is
        self.finish_req(handle, full, torch.cat(parts))
        spent += f.add("insert", clock() - t0)
        if self.host_pages:
            t0 = clock()
            failed = cm.drain()
            spent += f.add("drain", clock() - t0)
            if failed:
                raise RuntimeError(f"radixkv: {len(failed)} load(s) failed")
        f.spent_ns += spent
        f.device_hit += device_hit
        f.host_hit += hit - device_hit

    def _allocate(self, n: int, f: Figures):
        t0 = clock()
        evicted = self.cm.make_room(n)
        t1 = clock()
        slots = self.allocate(n)
        t2 = clock()
        if evicted:
            f.add("evict", t1 - t0)
        f.add("allocate", t2 - t1)
        return slots, t2 - t0

    def finish(self) -> None:
        cm = self.cm
        if self.host_pages and cm.drain():
            raise RuntimeError("radixkv: a load failed at the end")
        cm.check_integrity()
        if cm.held_pages:
            raise RuntimeError(f"radixkv: {cm.held_pages} pages still held")
        cm.close()


# ---------------------------------------------------------------------------
# SGLang
# ---------------------------------------------------------------------------

_sgl: Optional[SimpleNamespace] = None


def import_sglang(io: str) -> SimpleNamespace:
    """SGLang's cache modules, its config published (io backend `io`: "kernel"
    with the page_first layout, or "direct" with layer_first), the CPU spots
    replaced."""
    global _sgl
    if _sgl is not None:
        if _sgl.io != io:
            raise ValueError(f"SGLang is set up for the {_sgl.io} io backend, not {io}")
        return _sgl
    _ensure_torchvision_importable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "only CUDA supports AWQ" and the like
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import (
            InitLoadBackParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host import common as host_common
        from sglang.srt.mem_cache.pool_host import mha as host_mha
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.runtime_context import get_context
    logging.getLogger("sglang").setLevel(logging.ERROR)

    def host_buffer(dims, dtype, device, pin_memory, allocator, *args, **kwargs):
        return torch.zeros(dims, dtype=dtype, device="cpu")

    def no_copy(*args, **kwargs):
        return None

    host_common.ALLOC_MEMORY_FUNCS["cpu"] = host_buffer
    # The K/V copies of both io backends (kernel: the sgl_kernel ones SGLang
    # imports on CUDA only; direct: per-layer index copies).
    host_mha.transfer_kv_all_layer_lf_pf = no_copy
    host_mha.transfer_kv_per_layer_pf_lf = no_copy
    host_mha.transfer_kv_direct = no_copy

    # init_hicache reads its settings from the published ServerArgs. A
    # ratio-sized host pool is size // page + 1 pages: aim inside the last one.
    ratio = (HOST_PAGES - 0.5) / DEVICE_PAGES
    server_args = (
        get_context()
        .override_server_args(
            enable_hierarchical_cache=True,
            hicache_ratio=ratio,
            hicache_size=0,
            hicache_write_policy="write_through",
            hicache_io_backend=io,
            hicache_mem_layout={"kernel": "page_first", "direct": "layer_first"}[io],
            page_size=PAGE,
            device="cpu",
        )
        .install()
    )
    _sgl = SimpleNamespace(
        io=io,
        server_args=server_args,
        Allocator=PagedTokenToKVPoolAllocator,
        KVPool=MHATokenToKVPool,
        CacheInitParams=CacheInitParams,
        UnifiedRadixCache=UnifiedRadixCache,
        FULL=ComponentType.FULL,
        RadixKey=RadixKey,
        MatchPrefixParams=MatchPrefixParams,
        InsertParams=InsertParams,
        InitLoadBackParams=InitLoadBackParams,
    )
    return _sgl


class Sglang:
    """UnifiedRadixCache with its HiCache, driven as SGLang's scheduler drives it."""

    def __init__(self, io: str):
        s = self.s = import_sglang(io)
        tokens = DEVICE_PAGES * PAGE
        kv = s.KVPool(tokens, PAGE, torch.float16, 1, 4, 1, "cpu", False)
        self.alloc = s.Allocator(tokens, PAGE, torch.float16, "cpu", kv, need_sort=False)
        params = s.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self.alloc,
            page_size=PAGE,
            tree_components=(s.FULL,),
        )
        self.cache = s.UnifiedRadixCache(params)
        self.cache.init_hicache(s.server_args, params)
        atexit.unregister(self.cache.shutdown)
        cc = self.cache.cache_controller
        host_tokens = cc.mem_pool_host.size
        if host_tokens != HOST_PAGES * PAGE or self.alloc.available_size() != tokens:
            raise RuntimeError(
                f"SGLang pools are {self.alloc.available_size() // PAGE} device and "
                f"{host_tokens // PAGE} host pages, not {DEVICE_PAGES} and {HOST_PAGES}"
            )
        self.tree_core = type(self.cache.tree_core).__name__
        self.settings = (
            f"tree core {self.cache._tree_core_backend} ({self.tree_core}), "
            f"{type(cc).__name__}, write policy {cc.write_policy}, "
            f"io backend {cc.io_backend}, layout {cc.mem_pool_host.layout}"
        )
        self.rid = 0

    @staticmethod
    def native(ids: torch.Tensor, out_ids: torch.Tensor):
        prompt = _to_q_array(ids)
        return prompt, prompt + _to_q_array(out_ids) if out_ids.numel() else prompt

    def serve(self, req: Request, prompt: array, full: array, f: Figures) -> None:
        s, cache, n_in, out = self.s, self.cache, req.input_length, req.output_length
        self.rid += 1
        t0 = clock()
        m = cache.match_prefix(s.MatchPrefixParams(key=s.RadixKey(prompt, limit=n_in - 1)))
        t1 = clock()
        node, device_hit, loaded = m.last_device_node, m.device_prefix_len, 0
        if m.host_hit_length > 0:
            best = m.best_match_node
            stub = SimpleNamespace(
                rid=str(self.rid),
                last_node=node,
                swa_host_hit_length=0,
                mamba_host_hit_length=0,
                kv=SimpleNamespace(mamba_pool_idx=None),
            )
            t2 = clock()
            host_pin = cache.inc_host_lock_ref(best).to_dec_params()
            pin = cache.lock(best)
            loaded, node = cache.init_load_back(
                s.InitLoadBackParams(
                    best_match_node=best, host_hit_length=m.host_hit_length, req=stub
                )
            )
            cache.unlock(pin)
            cache.dec_host_lock_ref(best, host_pin)
            lock = cache.lock(node)
            cache.ready_to_load_host_cache()
            spent = f.add("load_back", clock() - t2)
        else:
            t2 = clock()
            lock = cache.lock(node)
            spent = f.add("lock", clock() - t2)
        hit = device_hit + loaded
        t3 = clock()
        prefix = cache.path_device_indices(node)[:hit]
        spent += f.add("match", t1 - t0 + clock() - t3)

        parts, ns = request_slots(self._allocate, prefix, n_in - hit, out, f)
        spent += ns
        total = n_in + out

        t0 = clock()
        row = torch.cat(parts)
        key = s.RadixKey(full).page_aligned(PAGE)
        aligned = len(key)
        values = row[:aligned].to(dtype=torch.int64, copy=True)
        result = cache.insert(s.InsertParams(key=key, value=values, prev_prefix_len=hit))
        prompt_key = s.RadixKey(prompt).page_aligned(PAGE)
        if 0 < len(prompt_key) < aligned:
            cache.insert(
                s.InsertParams(
                    key=prompt_key,
                    value=values[: len(prompt_key)],
                    prev_prefix_len=len(prompt_key),
                    inserted_len=len(prompt_key),
                    priority=1,
                )
            )
        new_node = result.last_device_node
        cached = len(cache.path_device_indices(new_node))
        cache.unlock(lock)
        lock = cache.lock(new_node)
        if total > cached:
            self.alloc.free(row[cached:total])
        cache.unlock(lock)
        spent += f.add("insert", clock() - t0)

        t0 = clock()
        cache.check_hicache_events()
        spent += f.add("drain", clock() - t0)
        f.spent_ns += spent
        f.device_hit += device_hit
        f.host_hit += loaded

    def _allocate(self, n: int, f: Figures):
        need = -(-n // PAGE) * PAGE
        short = self.alloc.available_size() < need
        t0 = clock()
        self.alloc.evict_to_free_tokens(self.cache, need)
        t1 = clock()
        slots = self.alloc.alloc(need)
        t2 = clock()
        if slots is None:
            raise RuntimeError(f"SGLang: no room for {need} tokens")
        if short:
            f.add("evict", t1 - t0)
        f.add("allocate", t2 - t1)
        return slots, t2 - t0

    def finish(self) -> None:
        cache, cc = self.cache, self.cache.cache_controller
        cache.check_hicache_events()
        busy = (
            len(cache.ongoing_write_through),
            len(cache.ongoing_load_back),
            len(cc.ack_write_queue) + len(cc.ack_load_queue),
        )
        held = DEVICE_PAGES * PAGE - self.alloc.available_size() - cache.evictable_size()
        if any(busy) or held or cache.protected_size():
            raise RuntimeError(
                f"SGLang: copies in flight {busy}, {held} device tokens held, "
                f"{cache.protected_size()} protected"
            )
        cache.release_host_resources()


# ---------------------------------------------------------------------------
# The replay
# ---------------------------------------------------------------------------


def too_large(req: Request) -> bool:
    return -(-(req.input_length + req.output_length) // PAGE) > DEVICE_PAGES


def replay(make, requests: List[Request], max_hash: int) -> Figures:
    system = make()
    tokens = TokenMaker(BLOCK, max_hash)
    f = Figures()
    gc.collect()
    for req in requests:
        if too_large(req):
            f.skipped += 1
            continue
        ids = tokens.prompt(req)
        prompt, full = system.native(ids, tokens.output(req.output_length))
        system.serve(req, prompt, full, f)
        f.requests += 1
        f.input_tokens += req.input_length
    system.finish()
    return f


def sglang_here(io: str):
    """(SGLang's settings, None) when its HiCache builds here, else (None, why not)."""
    try:
        from importlib.metadata import version

        probe = Sglang(io)
        probe.finish()
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        return None, f"{type(e).__name__}: {e}"
    return f"SGLang {version('sglang')}: {probe.settings}", None


def reexec_in_sglang_venv() -> None:
    """Runs this script again with $RADIXKV_SGLANG_VENV's python, once."""
    venv = os.environ.get("RADIXKV_SGLANG_VENV")
    if not venv or os.environ.get("_BENCH_HICACHE_REEXEC"):
        return
    python = os.path.join(venv, "bin", "python")
    if os.path.realpath(sys.prefix) == os.path.realpath(venv) or not os.path.exists(python):
        return
    os.environ["_BENCH_HICACHE_REEXEC"] = "1"
    sys.stdout.flush()
    os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:]])


def median_us(samples_ns: List[int]) -> Optional[float]:
    return statistics.median(samples_ns) / 1e3 if samples_ns else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="the Mooncake conversation trace (JSONL)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per system (default 3)")
    ap.add_argument("--requests", type=int, help="replay only the first N requests")
    ap.add_argument(
        "--sglang-io",
        choices=("kernel", "direct"),
        default="kernel",
        help="SGLang's io backend: kernel with page_first (its defaults) or direct "
        "with layer_first (default kernel)",
    )
    ap.add_argument(
        "--pages", action="store_true", help="radixkv through its page path (match_pages, ...)"
    )
    ap.add_argument(
        "--both",
        action="store_true",
        help="radixkv through the token and the page path, against each other (with SGLang "
        "when it imports)",
    )
    ap.add_argument(
        "--page-size",
        type=int,
        default=512,
        choices=(16, 32, 64, 128, 256, 512),
        help="the caches' page size; the pools keep their tokens (default 512)",
    )
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    ap.add_argument(
        "--native-calls",
        action="store_true",
        help="then one more round of radixkv (the page path when it ran) under cProfile: its "
        "native calls, us a call and a request",
    )
    args = ap.parse_args()
    global PAGE, DEVICE_PAGES, HOST_PAGES
    scale = BLOCK // args.page_size
    PAGE, DEVICE_PAGES, HOST_PAGES = args.page_size, DEVICE_PAGES * scale, HOST_PAGES * scale
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")

    settings, why = sglang_here(args.sglang_io)
    if why is not None:
        reexec_in_sglang_venv()
    requests = load_mooncake(args.trace)
    if args.requests is not None:
        requests = requests[: args.requests]
    max_hash = max_hash_id(requests)
    torch.set_num_threads(1)

    systems = {"radixkv": lambda: Radixkv(HOST_PAGES)}
    if args.pages:
        systems = {"radixkv-pages": lambda: Radixkv(HOST_PAGES, pages=True)}
    if args.both:
        systems["radixkv-pages"] = lambda: Radixkv(HOST_PAGES, pages=True)
    if why is None:
        systems["sglang"] = lambda: Sglang(args.sglang_io)
    else:
        systems["radixkv-device"] = lambda: Radixkv(0)
    print(
        f"{len(requests):,} requests of {os.path.basename(args.trace)}, page {PAGE}, "
        f"{DEVICE_PAGES:,} device pages, {HOST_PAGES:,} host pages "
        f"({HOST_PAGES * PAGE:,} tokens), write_through, no K/V stored, "
        f"{args.rounds} rounds alternating"
    )
    print(
        f"radixkv {getattr(radixkv, '__version__', '?')} from {os.path.dirname(radixkv.__file__)}"
    )
    if settings:
        print(settings)
    else:
        print(f"SGLang not importable here ({why}): radixkv against radixkv device-only")

    rounds: Dict[str, List[Figures]] = {name: [] for name in systems}
    names = list(systems)
    for name in names:  # warm-up, not counted
        replay(systems[name], requests[:WARMUP], max_hash)
    # (the trace out of the collector's walks: see the docstring)
    gc.collect()
    gc.freeze()
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            f = replay(systems[name], requests, max_hash)
            rounds[name].append(f)
            print(
                f"  round {r + 1} {name}: {f.spent_ns / 1e3 / f.requests:.1f} us/request "
                f"in the cache, {time.perf_counter() - t0:.1f} s",
                flush=True,
            )

    rows = {}
    for name, fs in rounds.items():
        per_req = [f.spent_ns / 1e3 / f.requests for f in fs]
        first = fs[0]
        rows[name] = {
            "requests": first.requests,
            "skipped": first.skipped,
            "hit_rate": (first.device_hit + first.host_hit) / first.input_tokens,
            "device_hit_rate": first.device_hit / first.input_tokens,
            "host_hit_rate": first.host_hit / first.input_tokens,
            "us_per_request": statistics.median(per_req),
            "us_per_request_rounds": [round(x, 1) for x in per_req],
            "op_median_us": {op: median_us([x for f in fs for x in f.ops[op]]) for op in OPS},
            "op_calls": {op: len(first.ops[op]) for op in OPS},
        }
        if any((f.device_hit, f.host_hit) != (first.device_hit, first.host_hit) for f in fs[1:]):
            raise RuntimeError(f"{name}: hits differ between rounds")

    print(
        f"\n{'system':<16}{'requests':>9}{'hit':>8}{'device':>8}{'host':>8}"
        f"{'us/request':>12}{'min..max':>18}"
    )
    for name, row in rows.items():
        spread = row["us_per_request_rounds"]
        print(
            f"{name:<16}{row['requests']:>9,}{100 * row['hit_rate']:>7.2f}%"
            f"{100 * row['device_hit_rate']:>7.2f}%{100 * row['host_hit_rate']:>7.2f}%"
            f"{row['us_per_request']:>12.1f}{f'{min(spread):.1f}..{max(spread):.1f}':>18}"
        )
    base = names[0]
    ratio = None
    for other in names[1:]:
        if other == "sglang":
            continue
        ratio = rows[other]["us_per_request"] / rows[base]["us_per_request"]
        print(f"{other} / {base} per request: {ratio:.2f}x")
    if "sglang" in rows:
        for name in names:
            if name != "sglang":
                ratio = rows["sglang"]["us_per_request"] / rows[name]["us_per_request"]
                print(f"sglang / {name} per request: {ratio:.2f}x")

    print(f"\n{'median us per call (calls a round)':<36}" + "".join(f"{n:>20}" for n in names))
    for op in OPS:
        cells = []
        for name in names:
            us, calls = rows[name]["op_median_us"][op], rows[name]["op_calls"][op]
            cells.append(f"{us:>10.1f} ({calls:>6,})" if us is not None else f"{'-':>19}")
        print(f"  {op:<34}" + "".join(f"{c:>20}" for c in cells))
    if args.json:
        print(json.dumps({"rows": rows, "ratio": ratio, "sglang": why or settings}))
    if args.native_calls:
        name = "radixkv-pages" if "radixkv-pages" in systems else "radixkv"
        native_calls(name, systems[name], requests, max_hash)


def native_calls(name: str, make, requests: List[Request], max_hash: int) -> None:
    """One round of `make` under cProfile: radixkv's native calls, the time
    inside each (cProfile adds a little to every call) per call and per
    request, and their sum: what a request costs before any Python."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    f = replay(make, requests, max_hash)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = []  # (us a request, calls a request, us a call, the call)
    for (file, _, fn), (_, calls, inside, _, _) in stats.items():
        if file == "~" and "radixkv._core" in fn and "check_integrity" not in fn:
            rows.append((inside * 1e6 / f.requests, calls / f.requests, inside * 1e6 / calls, fn))
    print(f"\nnative calls of {name} under cProfile, {f.requests:,} requests:")
    print(f"  {'us a request':>12}{'calls a request':>17}{'us a call':>11}  call")
    for row in sorted(rows, reverse=True):
        if row[0] >= 0.01:
            print(f"  {row[0]:>12.2f}{row[1]:>17.2f}{row[2]:>11.2f}  {row[3]}")
    print(f"  {sum(r[0] for r in rows):>12.2f}  in all (the end's check_integrity left out)")


if __name__ == "__main__":
    main()
