"""radixkv on a CUDA GPU: the store kernel and the host tier's loads.

store   store_cache of n tokens' K and V (8 KV heads x 128, bfloat16) into a
        paged cache [pages, 16, 8, 128] at scattered slots: radixkv's kernel
        with its bounds check (one synchronization), without it
        (check_bounds=False), and torch's indexed assignment
        `cache.view(-1, 8, 128)[loc] = k` (same for v)
load    a CacheManager with a device pool and a pinned host tier (4 layers):
        n tokens evicted to host, then `load_back` and waiting for the last
        layer (the copy engine's two streams, layer by layer), against one
        cudaMemcpy of the same bytes from pinned memory (the ceiling)
Times are CUDA-event medians over --reps runs after warm-ups.

python bench/python/bench_cuda.py [--reps N]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from radixkv.kernel import store_cache
from radixkv.kvcache import MHAKVCache
from radixkv.scheduler import CacheManager

HEADS, DIM, DT, PAGE = 8, 128, torch.bfloat16, 16


def cuda_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def bench_store(reps: int) -> list:
    rows = []
    for n in (16, 256, 4096, 32768):
        pages = 4 * n // PAGE + 64
        kc = torch.zeros(pages, PAGE, HEADS, DIM, dtype=DT, device="cuda")
        vc = torch.zeros_like(kc)
        k = torch.randn(n, HEADS, DIM, device="cuda").to(DT)
        v = torch.randn(n, HEADS, DIM, device="cuda").to(DT)
        loc = torch.randperm(pages * PAGE, device="cuda")[:n]
        flat_k, flat_v = kc.view(-1, HEADS, DIM), vc.view(-1, HEADS, DIM)

        def torch_store():
            flat_k[loc] = k
            flat_v[loc] = v

        us = {"radixkv": cuda_us(lambda: store_cache(kc, vc, loc, k, v), reps),
              "radixkv unchecked": cuda_us(
                  lambda: store_cache(kc, vc, loc, k, v, check_bounds=False), reps),
              "torch": cuda_us(torch_store, reps)}
        kc.zero_(), vc.zero_()
        store_cache(kc, vc, loc, k, v, check_bounds=False)
        assert torch.equal(flat_k[loc], k) and torch.equal(flat_v[loc], v)
        nbytes = 2 * n * HEADS * DIM * 2
        rows.append({"case": "store", "tokens": n, "us": {a: round(b, 1) for a, b in us.items()},
                     "gbps": {a: round(nbytes / b / 1e3, 1) for a, b in us.items()}})
    return rows


def bench_load(reps: int, layers: int = 4) -> list:
    rows = []
    for n in (1024, 16384):
        pages = n // PAGE
        pool = MHAKVCache(HEADS, layers, DIM, 2 * pages + 2, DT, device="cuda", page_size=PAGE,
                          check_bounds=False)
        cm = CacheManager(2 * pages + 2, page_size=PAGE, device="cuda", kv_cache=pool,
                          host_num_pages=4 * pages)
        a = torch.arange(n + 1, dtype=torch.int32)
        samples = []
        for r in range(reps + 2):
            h, idx = cm.match_req(a)
            h, idx = cm.load_back(h)
            if h.cached_len:  # a host hit: time the load
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                cm.start_loading()
                pool.k_cache(layers - 1)         # waits for the last layer
                end.record()
                end.synchronize()
                if r >= 2:
                    samples.append(start.elapsed_time(end) * 1e3)
            own = cm.allocate(len(a) - h.cached_len)
            cm.free_and_cache_finished_req(h, a, torch.cat([idx, own]))
            cm.drain()
            cm.make_room(cm.num_pages * PAGE)    # out to host again
            cm.drain()
        nbytes = 2 * layers * n * HEADS * DIM * 2
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        memcpy = cuda_us(lambda: dst.copy_(src, non_blocking=True), reps)
        load = statistics.median(samples) if samples else float("nan")
        rows.append({"case": "load", "tokens": n, "layers": layers, "us": round(load, 1),
                     "memcpy_us": round(memcpy, 1), "gbps": round(nbytes / load / 1e3, 1),
                     "of_memcpy": round(memcpy / load, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    for r in bench_store(args.reps) + bench_load(args.reps):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
