"""radixkv.compat.minisgl against mini-SGLang's own RadixPrefixCache, in one run.

First a differential check: the same 2,000 random operations (matches of
shared and diverging prefixes, inserts, evictions, page size 4) on both, every
result compared (cached lengths, matched indices, size_info, evicted slots).
Then medians over the scheduler's calls, page size 1, bench_radix's tree of
1,000 cached 1,024-token sequences sharing 512 tokens:
  match    match_prefix + get_matched_indices() of a cached sequence
           (different ones, shuffled), what mini-SGLang's prefill does
  insert   insert_prefix of a new sequence sharing the prefix (its result
           handle included)
mini-SGLang's source comes from RADIXKV_PEERS_DIR (bench/PEERS.md).

Then radixkv.compat.sglang against SGLang's own RadixCache (whatever 0.5.x
imports; bench/PEERS.md), both driven through SGLang's parameter objects with
the same RadixKey objects (SGLang's own, array('q') token ids, built outside
the timed region) and int64 values, on a tree of 1,000 cached 1,024-token
requests: 8 system prompts of 512 tokens, each request its own 512 after one.
Every query is a distinct request, in shuffled order:
  match        a cached request (a full hit), with its device indices
  match_split  a cached request cut at a random point of its own part and
               continued by new tokens: the match ends inside a node (a split)
  match_new    a new request on a cached system prompt (a 512-token hit)
  insert       a new request on a cached system prompt (512 already cached)
  lock         inc_lock_ref + dec_lock_ref on a matched request's node
  finish       cache_finished_req of such a request, which also frees its
               duplicate slots (where the installed SGLang still has it)
  evict        1,024 tokens (two requests' own parts) from ~2,000 leaves

python bench/python/bench_compat.py [--reps N] [--only minisgl|sglang] [--page P]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import sys
import time
import warnings
from array import array
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import (  # noqa: E402
    MINISGLANG_DIR,
    SlotSink,
    _ensure_minisglang_on_path,
    _ensure_torchvision_importable,
    _minisgl_set_page_size,
)

from radixkv.compat import sglang as compat_sglang  # noqa: E402
from radixkv.compat.minisgl import create_prefix_cache  # noqa: E402


def theirs(page: int):
    _ensure_minisglang_on_path()
    import minisgl.kvcache as kvcache

    _minisgl_set_page_size(page)
    return kvcache.create_prefix_cache(device=torch.device("cpu"), type="radix")


def differential(steps: int = 2000, page: int = 4) -> int:
    a, b = theirs(page), create_prefix_cache("cpu", "radix", page_size=page)
    g = torch.Generator().manual_seed(0)
    bases = [torch.randint(0, 100, (40,), generator=g, dtype=torch.int32) for _ in range(4)]
    slot = 0
    for k in range(steps):
        base = bases[k % 4]
        ids = torch.cat(
            [
                base[: int(torch.randint(0, 40, (1,), generator=g))],
                torch.randint(0, 100, (k % 11,), generator=g, dtype=torch.int32),
            ]
        )
        ha, hb = a.match_prefix(ids).cuda_handle, b.match_prefix(ids).cuda_handle
        assert ha.cached_len == hb.cached_len, k
        if ha.cached_len:
            assert torch.equal(ha.get_matched_indices(), hb.get_matched_indices()), k
        idx = torch.cat(
            [
                hb.get_matched_indices(),
                torch.arange(slot, slot + len(ids) - hb.cached_len, dtype=torch.int32),
            ]
        )
        slot += len(ids)
        ra, rb = a.insert_prefix(ids, idx), b.insert_prefix(ids, idx)
        assert (ra.cached_len, ra.handle.cached_len) == (rb.cached_len, rb.handle.cached_len), k
        assert tuple(a.size_info) == tuple(b.size_info), k
        if k % 13 == 12:
            n = a.size_info.evictable_size // 2
            assert sorted(a.evict(n).tolist()) == sorted(b.evict(n).tolist()), k
    return steps


def timings(make, reps: int) -> dict:
    cache = make()
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 32000, (512,), generator=g, dtype=torch.int32)
    seqs = [
        torch.cat([prefix, torch.randint(0, 32000, (512,), generator=g, dtype=torch.int32)])
        for _ in range(1000)
    ]
    slot = 0
    for s in seqs:
        cache.insert_prefix(s, torch.arange(slot, slot + 1024, dtype=torch.int32))
        slot += 1024
    order = torch.randperm(1000, generator=g).tolist()
    out = {}
    samples = []
    for r in range(reps):
        batch = [seqs[order[(r * 20 + i) % 1000]] for i in range(20)]
        t0 = time.perf_counter_ns()
        for s in batch:
            cache.match_prefix(s).cuda_handle.get_matched_indices()
        samples.append((time.perf_counter_ns() - t0) / 20)
    out["match"] = statistics.median(samples) / 1e3
    fresh = [
        torch.cat([prefix, torch.randint(0, 32000, (512,), generator=g, dtype=torch.int32)])
        for _ in range(reps * 5)
    ]
    slots = [
        torch.cat(
            [
                torch.arange(512, dtype=torch.int32),
                torch.arange(slot + 512 * i, slot + 512 * (i + 1), dtype=torch.int32),
            ]
        )
        for i in range(reps * 5)
    ]
    samples = []
    for r in range(reps):
        t0 = time.perf_counter_ns()
        for i in range(r * 5, r * 5 + 5):
            cache.insert_prefix(fresh[i], slots[i])
        samples.append((time.perf_counter_ns() - t0) / 5)
    out["insert"] = statistics.median(samples) / 1e3
    return out


def sglang_modules():
    """SGLang's radix cache and parameter modules and its version, or the reason why not."""
    _ensure_torchvision_importable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its import chain warns about missing GPU kernels
            rc = importlib.import_module("sglang.srt.mem_cache.radix_cache")
            bpc = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
        from importlib.metadata import version

        return (rc, bpc, version("sglang")), None
    except Exception as e:  # any failure of its import chain
        return None, f"{type(e).__name__}: {e}"


class SglangWorkload:
    """The requests of the SGLang section, identical for both caches."""

    def __init__(self, rc, reps: int, seed: int = 2):
        rng = random.Random(seed)

        def tokens(n):
            return [rng.randrange(32000) for _ in range(n)]

        def key(toks):
            return rc.RadixKey(array("q", toks))

        self.systems = [tokens(512) for _ in range(8)]
        self.cached = [self.systems[i % 8] + tokens(512) for i in range(1000)]
        self.cached_keys = [key(t) for t in self.cached]
        n = reps * 20
        order = list(range(1000))
        rng.shuffle(order)
        self.hits = [self.cached_keys[order[i % 1000]] for i in range(n)]
        self.splits = []
        for i in range(n):
            base = self.cached[order[(i * 7) % 1000]]
            cut = rng.randrange(520, 1000)
            self.splits.append(key(base[:cut] + tokens(1024 - cut)))
        self.news = [key(rng.choice(self.systems) + tokens(512)) for _ in range(n)]
        self.inserts = [rng.choice(self.systems) + tokens(512) for _ in range(reps * 5)]
        self.insert_keys = [key(t) for t in self.inserts]
        self.insert_heads = [key(t[:512]) for t in self.inserts]
        self.refills = [key(rng.choice(self.systems) + tokens(512)) for _ in range(reps * 2)]


def sglang_timings(make, rc, bpc, work: SglangWorkload, reps: int, page: int) -> dict:
    """Medians in microseconds a call. `make(allocator, req_to_token_pool)` builds the cache."""
    sink = SlotSink(page_size=page)
    rows = reps * 5 + 1
    pool = SimpleNamespace(req_to_token=torch.zeros((rows, 1024), dtype=torch.int32))
    pool.write = lambda idx, val: pool.req_to_token.__setitem__(idx, val)
    cache = make(sink, pool)
    slot = 0
    for k in work.cached_keys:
        cache.insert(bpc.InsertParams(key=k, value=torch.arange(slot, slot + 1024)))
        slot += 1024

    def indices(m):
        if hasattr(m, "device_indices"):
            return m.device_indices
        return cache.path_device_indices(m.last_device_node)[: m.device_prefix_len]

    out = {}
    for case, queries in (
        ("match", work.hits),
        ("match_split", work.splits),
        ("match_new", work.news),
    ):
        samples = []
        for r in range(reps):
            batch = queries[r * 20 : (r + 1) * 20]
            t0 = time.perf_counter_ns()
            for k in batch:
                indices(cache.match_prefix(bpc.MatchPrefixParams(key=k)))
            samples.append((time.perf_counter_ns() - t0) / 20)
        out[case] = statistics.median(samples) / 1e3

    # Inserts pass the system prompt's own slots back, as a scheduler does.
    values = []
    for k in work.insert_keys:
        head = indices(cache.match_prefix(bpc.MatchPrefixParams(key=k)))[:512]
        values.append(torch.cat([head, torch.arange(slot, slot + 512)]))
        slot += 512
    samples = []
    for r in range(reps):
        t0 = time.perf_counter_ns()
        for i in range(r * 5, r * 5 + 5):
            cache.insert(bpc.InsertParams(key=work.insert_keys[i], value=values[i]))
        samples.append((time.perf_counter_ns() - t0) / 5)
    out["insert"] = statistics.median(samples) / 1e3

    # A lock and its unlock on a matched request's node (what admitting and
    # finishing a request costs the tree besides the match and the insert).
    nodes = [
        cache.match_prefix(bpc.MatchPrefixParams(key=k)).last_device_node for k in work.hits[:1000]
    ]
    samples = []
    for r in range(reps):
        batch = nodes[(r * 20) % 1000 : (r * 20) % 1000 + 20]
        t0 = time.perf_counter_ns()
        for node in batch:
            cache.inc_lock_ref(node)
            cache.dec_lock_ref(node)
        samples.append((time.perf_counter_ns() - t0) / 20)
    out["lock"] = statistics.median(samples) / 1e3

    # cache_finished_req: a request on a cached system prompt, admitted
    # (matched and locked) untimed, whose own 512 tokens another request with
    # the same prompt cached meanwhile (the inserts above): the finish inserts
    # nothing new and frees its 512 duplicate slots.
    if hasattr(cache, "cache_finished_req"):
        samples = []
        for r in range(reps):
            reqs = []
            for i in range(r * 5, r * 5 + 5):
                # admitted before the other request cached its own part: a
                # 512-token hit, the rest computed into fresh slots
                m = cache.match_prefix(bpc.MatchPrefixParams(key=work.insert_heads[i]))
                node, prefix = m.last_device_node, indices(m)
                cache.inc_lock_ref(node)
                row = i + 1
                pool.req_to_token[row, : len(prefix)] = prefix
                pool.req_to_token[row, len(prefix) :] = torch.arange(
                    slot, slot + 1024 - len(prefix)
                )
                slot += 1024 - len(prefix)
                reqs.append(
                    SimpleNamespace(
                        req_pool_idx=row,
                        origin_input_ids=array("q", work.inserts[i]),
                        output_ids=array("q", [7]),
                        extra_key=None,
                        priority=None,
                        last_node=node,
                        prefix_indices=prefix,
                        cache_protected_len=len(prefix),
                        cache_salt=None,
                    )
                )
            freed = sink.freed
            t0 = time.perf_counter_ns()
            for req in reqs:
                cache.cache_finished_req(req, kv_len_to_handle=1024)
            samples.append((time.perf_counter_ns() - t0) / 5)
            if sink.freed - freed != 5 * 512:
                raise RuntimeError(f"finish freed {sink.freed - freed} slots, not 5 x 512")
        out["finish"] = statistics.median(samples) / 1e3

    # Evict 1,024 tokens (two requests' own parts) from the tree's ~2,000
    # unlocked leaves; two new requests are inserted untimed to keep its size.
    samples = []
    for r in range(reps):
        t0 = time.perf_counter_ns()
        cache.evict(bpc.EvictParams(num_tokens=1024))
        samples.append(time.perf_counter_ns() - t0)
        for k in work.refills[2 * r : 2 * r + 2]:
            head = indices(cache.match_prefix(bpc.MatchPrefixParams(key=k)))
            cache.insert(
                bpc.InsertParams(
                    key=k, value=torch.cat([head, torch.arange(slot, slot + 1024 - len(head))])
                )
            )
            slot += 1024
    out["evict"] = statistics.median(samples) / 1e3
    return out


def run_sglang(reps: int, page: int) -> bool:
    mods, why = sglang_modules()
    if mods is None:
        print(f"SGLang's RadixCache does not import here ({why}): see bench/PEERS.md")
        return False
    rc, bpc, version = mods
    work = SglangWorkload(rc, reps)

    def theirs(alloc, pool):
        c = rc.RadixCache.create_simulated(mock_allocator=alloc, page_size=page)
        c.req_to_token_pool = pool
        return c

    def ours(alloc, pool):
        return compat_sglang.RadixCache(
            req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, page_size=page
        )

    # Alternate the two in one process, twice, and keep each case's better median.
    runs = {"ours": [], "peer": []}
    for _ in range(2):
        runs["ours"].append(sglang_timings(ours, rc, bpc, work, reps, page))
        runs["peer"].append(sglang_timings(theirs, rc, bpc, work, reps, page))
    ours_t = {c: min(r[c] for r in runs["ours"]) for c in runs["ours"][0]}
    peer_t = {c: min(r[c] for r in runs["peer"]) for c in runs["peer"][0]}
    print(f"SGLang {version}, page size {page}")
    print(f"{'case':<12}{'radixkv.compat.sglang':>24}{'SGLang RadixCache':>20}{'ratio':>8}")
    for case in ours_t:
        if case not in peer_t:
            print(f"{case:<12}{ours_t[case]:>21.2f} us{'-':>20}")
            continue
        print(
            f"{case:<12}{ours_t[case]:>21.2f} us{peer_t[case]:>17.2f} us"
            f"{peer_t[case] / ours_t[case]:>7.1f}x"
        )
        print(
            json.dumps(
                {
                    "bench": "compat_sglang",
                    "case": case,
                    "page_size": page,
                    "sglang": version,
                    "radixkv_us": round(ours_t[case], 3),
                    "sglang_us": round(peer_t[case], 3),
                }
            )
        )
    return True


def run_minisgl(reps: int) -> bool:
    if not os.path.isdir(MINISGLANG_DIR):
        print(f"mini-SGLang's source is not at {MINISGLANG_DIR}: see bench/PEERS.md")
        return False
    steps = differential()
    print(f"differential check: {steps} operations, every result equal to mini-SGLang's")
    ours = timings(lambda: create_prefix_cache("cpu", "radix"), reps)
    peer = timings(lambda: theirs(1), reps)
    print(f"{'case':<8}{'radixkv.compat.minisgl':>26}{'mini-SGLang':>14}{'ratio':>8}")
    for case in ours:
        print(
            f"{case:<8}{ours[case]:>23.2f} us{peer[case]:>11.2f} us"
            f"{peer[case] / ours[case]:>7.1f}x"
        )
        print(
            json.dumps(
                {
                    "bench": "compat_minisgl",
                    "case": case,
                    "radixkv_us": round(ours[case], 3),
                    "minisgl_us": round(peer[case], 3),
                }
            )
        )
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--only", choices=("minisgl", "sglang"), default=None)
    ap.add_argument("--page", type=int, default=1, help="page size of the SGLang section")
    args = ap.parse_args()
    ran = False
    if args.only in (None, "minisgl"):
        ran |= run_minisgl(args.reps)
    if args.only in (None, "sglang"):
        ran |= run_sglang(args.reps, args.page)
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
