"""KV store microbenchmark on the CPU: radixkv's native scatter against torch.

Each case stores `tokens` rows of k and of v (bfloat16; head_dim 128 when
`row_bytes` is a multiple of 256, else head_dim 100, so rows of 200 and 600
bytes are not whole 64-byte lines) into distinct random slots of a
LayerFirst pool layer, the way `MHAKVCache.store_kv` does; successive calls
cycle through 4 disjoint slot sets, as serving writes fresh slots:
  radixkv       radixkv.kernel.store_cache (the native kernel)
  index_copy    k_cache.view(-1, H*D).index_copy_(0, out_loc, k.view(n, -1)), same for v
  index_put     k_cache.view(-1, H, D)[out_loc] = k, same for v
Throughput is bytes read + written: 2 (k and v) x 2 x tokens x row_bytes, over
the median time. The machine's memcpy bandwidth (libc memcpy of one 256 MiB
buffer, one thread, counted the same way) is measured in the same run. The
cache holds at least 64 MiB per layer, so large batches do not fit in cache.
Prints a table, then one JSON line per case.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import statistics
import time

import torch

from radixkv.kernel import store_cache

DTYPE = torch.bfloat16
ROW_BYTES = [256, 512, 1024, 2048, 4096, 200, 600]
TOKENS = [1, 16, 256, 1024, 4096, 16384]
MIN_CACHE_BYTES = 64 << 20
SLOT_SETS = 4


def time_us(fn, reps: int, min_batch_ns: float = 2e6) -> float:
    """Median microseconds per call; calls are batched so a sample lasts >= 2 ms."""
    fn()
    t0 = time.perf_counter_ns()
    fn()
    one = max(time.perf_counter_ns() - t0, 1)
    batch = max(1, int(min_batch_ns // one))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - t0) / batch)
    return statistics.median(samples) / 1e3


def memcpy_gbps(reps: int) -> float:
    libc = ctypes.CDLL(None)
    libc.memcpy.restype = ctypes.c_void_p
    libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    n = 256 << 20
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    s, d = src.data_ptr(), dst.data_ptr()
    us = time_us(lambda: libc.memcpy(d, s, n), reps)
    return 2 * n / (us * 1e3)


def bench_case(row_bytes: int, tokens: int, reps: int, seed: int) -> dict:
    head_dim = 128 if row_bytes % 256 == 0 else 100
    if row_bytes % (head_dim * DTYPE.itemsize):
        raise SystemExit(f"row_bytes={row_bytes} is not a multiple of 256 or 200")
    heads = row_bytes // (head_dim * DTYPE.itemsize)
    slots = max(SLOT_SETS * tokens, MIN_CACHE_BYTES // row_bytes)
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(slots, heads, head_dim, dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(tokens, heads, head_dim, generator=g).to(DTYPE)
    v = torch.randn(tokens, heads, head_dim, generator=g).to(DTYPE)
    perm = torch.randperm(slots, generator=g)[: SLOT_SETS * tokens]
    sets32 = list(perm.to(torch.int32).view(SLOT_SETS, tokens).unbind(0))
    sets64 = list(perm.view(SLOT_SETS, tokens).unbind(0))
    kc2, vc2 = k_cache.view(slots, -1), v_cache.view(slots, -1)
    k2, v2 = k.view(tokens, -1), v.view(tokens, -1)
    turn = itertools.cycle(range(SLOT_SETS))

    def radixkv_store():
        store_cache(k_cache, v_cache, sets32[next(turn)], k, v)

    def index_copy():
        loc = sets64[next(turn)]
        kc2.index_copy_(0, loc, k2)
        vc2.index_copy_(0, loc, v2)

    def index_put():
        loc = sets64[next(turn)]
        k_cache[loc] = k
        v_cache[loc] = v

    for _ in range(SLOT_SETS):
        radixkv_store()
    for loc in sets64:
        assert torch.equal(k_cache[loc], k) and torch.equal(v_cache[loc], v), "radixkv is wrong"

    bytes_moved = 2 * 2 * tokens * row_bytes
    out = {
        "row_bytes": row_bytes,
        "tokens": tokens,
        "heads": heads,
        "head_dim": head_dim,
        "dtype": str(DTYPE).removeprefix("torch."),
        "bytes": bytes_moved,
    }
    for name, fn in (
        ("radixkv", radixkv_store),
        ("index_copy", index_copy),
        ("index_put", index_put),
    ):
        us = time_us(fn, reps)
        out[f"{name}_us"] = round(us, 3)
        out[f"{name}_gbps"] = round(bytes_moved / (us * 1e3), 2)
    out["speedup_vs_index_copy"] = round(out["index_copy_us"] / out["radixkv_us"], 2)
    out["speedup_vs_index_put"] = round(out["index_put_us"] / out["radixkv_us"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--row-bytes", type=int, nargs="*", default=ROW_BYTES)
    ap.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads for the baselines (default: torch's own)",
    )
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    memcpy = memcpy_gbps(args.reps)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads; "
        f"memcpy (1 thread, 256 MiB) {memcpy:.1f} GB/s (read + written)"
    )
    rows = []
    for rb in args.row_bytes:
        for n in args.tokens:
            r = bench_case(rb, n, args.reps, args.seed)
            r["memcpy_gbps"] = round(memcpy, 2)
            r["fraction_of_memcpy"] = round(r["radixkv_gbps"] / memcpy, 3)
            rows.append(r)

    header = (
        f"{'row B':>6} {'tokens':>6} | {'radixkv us':>10} {'GB/s':>6} | "
        f"{'index_copy us':>13} {'GB/s':>6} | {'index_put us':>12} {'GB/s':>6} | "
        f"{'x copy':>6} {'x put':>6} {'of memcpy':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['row_bytes']:>6} {r['tokens']:>6} | {r['radixkv_us']:>10.2f} "
            f"{r['radixkv_gbps']:>6.1f} | {r['index_copy_us']:>13.2f} "
            f"{r['index_copy_gbps']:>6.1f} | {r['index_put_us']:>12.2f} "
            f"{r['index_put_gbps']:>6.1f} | {r['speedup_vs_index_copy']:>6.2f} "
            f"{r['speedup_vs_index_put']:>6.2f} {r['fraction_of_memcpy']:>9.0%}"
        )
    for r in rows:
        print(json.dumps({"bench": "store_cpu", **r}))


if __name__ == "__main__":
    main()
