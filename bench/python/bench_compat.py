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

python bench/python/bench_compat.py [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import MINISGLANG_DIR, _ensure_minisglang_on_path, _minisgl_set_page_size  # noqa: E402

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
        ids = torch.cat([base[: int(torch.randint(0, 40, (1,), generator=g))],
                         torch.randint(0, 100, (k % 11,), generator=g, dtype=torch.int32)])
        ha, hb = a.match_prefix(ids).cuda_handle, b.match_prefix(ids).cuda_handle
        assert ha.cached_len == hb.cached_len, k
        if ha.cached_len:
            assert torch.equal(ha.get_matched_indices(), hb.get_matched_indices()), k
        idx = torch.cat([hb.get_matched_indices(),
                         torch.arange(slot, slot + len(ids) - hb.cached_len, dtype=torch.int32)])
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
    seqs = [torch.cat([prefix, torch.randint(0, 32000, (512,), generator=g, dtype=torch.int32)])
            for _ in range(1000)]
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
    fresh = [torch.cat([prefix, torch.randint(0, 32000, (512,), generator=g, dtype=torch.int32)])
             for _ in range(reps * 5)]
    slots = [torch.cat([torch.arange(512, dtype=torch.int32),
                        torch.arange(slot + 512 * i, slot + 512 * (i + 1), dtype=torch.int32)])
             for i in range(reps * 5)]
    samples = []
    for r in range(reps):
        t0 = time.perf_counter_ns()
        for i in range(r * 5, r * 5 + 5):
            cache.insert_prefix(fresh[i], slots[i])
        samples.append((time.perf_counter_ns() - t0) / 5)
    out["insert"] = statistics.median(samples) / 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    if not os.path.isdir(MINISGLANG_DIR):
        print(f"mini-SGLang's source is not at {MINISGLANG_DIR}: see bench/PEERS.md")
        return 1
    steps = differential()
    print(f"differential check: {steps} operations, every result equal to mini-SGLang's")
    ours = timings(lambda: create_prefix_cache("cpu", "radix"), args.reps)
    peer = timings(lambda: theirs(1), args.reps)
    print(f"{'case':<8}{'radixkv.compat.minisgl':>26}{'mini-SGLang':>14}{'ratio':>8}")
    for case in ours:
        print(f"{case:<8}{ours[case]:>23.2f} us{peer[case]:>11.2f} us"
              f"{peer[case] / ours[case]:>7.1f}x")
        print(json.dumps({"bench": "compat_minisgl", "case": case, "radixkv_us": round(ours[case], 3),
                          "minisgl_us": round(peer[case], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
