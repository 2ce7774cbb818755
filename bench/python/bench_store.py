"""KV store microbenchmark on the CPU: radixkv's native scatter against torch.

Three sections (`--sections`, default all):

mha: the MHA store (below).
mla: `radixkv.kernel.store_mla` (what `MLAKVCache.store_kv` runs) writing k_nope
  (512) and k_rope (64) bfloat16, slices of one fused projection output, into
  rows of 576 in one call, against torch indexing of the two halves
  (`rows[loc, :512] = k_nope; rows[loc, 512:] = k_rope`).
fp8: `store_cache` into float8_e4m3fn caches from bfloat16 k and v (8 heads x
  128) with per-tensor scales, against torch's `(k.float() / s).to(fp8)` then
  indexing, for k and v.

`--baseline DIR` also times each mha case with an older build of radixkv (a
child process with DIR first on PYTHONPATH), alternating the two builds A B A
B per case, and reports each build's best median and their ratio
(`vs_baseline`, < 1 is faster), so a kernel change is compared with the old
kernel in the same run on the same machine.

The mha section:

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
import os
import statistics
import subprocess
import sys
import time

import torch

from radixkv.kernel import store_cache

try:
    from radixkv.kernel import store_mla
except ImportError:  # a baseline build from before MLA
    store_mla = None

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


def bench_case(
    row_bytes: int, tokens: int, reps: int, seed: int, only_radixkv: bool = False
) -> dict:
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
    fns = [("radixkv", radixkv_store), ("index_copy", index_copy), ("index_put", index_put)]
    for name, fn in fns[:1] if only_radixkv else fns:
        us = time_us(fn, reps)
        out[f"{name}_us"] = round(us, 3)
        out[f"{name}_gbps"] = round(bytes_moved / (us * 1e3), 2)
    if not only_radixkv:
        out["speedup_vs_index_copy"] = round(out["index_copy_us"] / out["radixkv_us"], 2)
        out["speedup_vs_index_put"] = round(out["index_put_us"] / out["radixkv_us"], 2)
    return out


MLA_LORA, MLA_ROPE = 512, 64


def bench_mla_case(tokens: int, reps: int, seed: int) -> dict:
    row = MLA_LORA + MLA_ROPE
    slots = max(SLOT_SETS * tokens, MIN_CACHE_BYTES // (row * DTYPE.itemsize))
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(slots, 1, row, dtype=DTYPE)
    rows = cache.view(slots, row)
    # k_nope and k_rope as a model produces them: slices of one projection output.
    fused = torch.randn(tokens, MLA_LORA + 64 + MLA_ROPE, generator=g).to(DTYPE)
    k_nope, k_rope = fused[:, :MLA_LORA], fused[:, MLA_LORA + 64 :]
    perm = torch.randperm(slots, generator=g)[: SLOT_SETS * tokens]
    sets32 = list(perm.to(torch.int32).view(SLOT_SETS, tokens).unbind(0))
    sets64 = list(perm.view(SLOT_SETS, tokens).unbind(0))
    turn = itertools.cycle(range(SLOT_SETS))

    def radixkv_store():
        store_mla(cache, sets32[next(turn)], k_nope, k_rope, MLA_LORA)

    def torch_halves():
        loc = sets64[next(turn)]
        rows[loc, :MLA_LORA] = k_nope
        rows[loc, MLA_LORA:] = k_rope

    for _ in range(SLOT_SETS):
        radixkv_store()
    for loc in sets64:
        assert torch.equal(rows[loc], torch.cat([k_nope, k_rope], 1)), "radixkv is wrong"
    bytes_moved = 2 * tokens * row * DTYPE.itemsize
    out = {
        "tokens": tokens,
        "kv_lora_rank": MLA_LORA,
        "qk_rope_head_dim": MLA_ROPE,
        "dtype": str(DTYPE).removeprefix("torch."),
        "bytes": bytes_moved,
    }
    for name, fn in (("radixkv", radixkv_store), ("torch", torch_halves)):
        us = time_us(fn, reps)
        out[f"{name}_us"] = round(us, 3)
        out[f"{name}_gbps"] = round(bytes_moved / (us * 1e3), 2)
    out["speedup_vs_torch"] = round(out["torch_us"] / out["radixkv_us"], 2)
    return out


FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_HEADS, FP8_HEAD_DIM = 8, 128


def bench_fp8_case(tokens: int, reps: int, seed: int) -> dict:
    H, D = FP8_HEADS, FP8_HEAD_DIM
    slots = max(SLOT_SETS * tokens, MIN_CACHE_BYTES // (H * D))
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(slots, H, D, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    k = (torch.randn(tokens, H, D, generator=g) * 4).to(DTYPE)
    v = (torch.randn(tokens, H, D, generator=g) * 4).to(DTYPE)
    k_scale, v_scale = 0.0173, 0.0291
    perm = torch.randperm(slots, generator=g)[: SLOT_SETS * tokens]
    sets32 = list(perm.to(torch.int32).view(SLOT_SETS, tokens).unbind(0))
    sets64 = list(perm.view(SLOT_SETS, tokens).unbind(0))
    turn = itertools.cycle(range(SLOT_SETS))

    def radixkv_store():
        store_cache(k_cache, v_cache, sets32[next(turn)], k, v, k_scale=k_scale, v_scale=v_scale)

    def torch_convert():
        loc = sets64[next(turn)]
        k_cache[loc] = (k.float() / k_scale).to(FP8)
        v_cache[loc] = (v.float() / v_scale).to(FP8)

    for _ in range(SLOT_SETS):
        radixkv_store()
    want_k = (k.float() / k_scale).to(FP8).view(torch.uint8)
    for loc in sets64:
        assert torch.equal(k_cache[loc].view(torch.uint8), want_k), "radixkv is wrong"
    out = {
        "tokens": tokens,
        "heads": H,
        "head_dim": D,
        "src_dtype": "bfloat16",
        "cache_dtype": "float8_e4m3fn",
        "bytes": 2 * tokens * H * D * (DTYPE.itemsize + 1),
    }  # read + written, k and v
    for name, fn in (("radixkv", radixkv_store), ("torch", torch_convert)):
        us = time_us(fn, reps)
        out[f"{name}_us"] = round(us, 3)
        out[f"{name}_gbps"] = round(out["bytes"] / (us * 1e3), 2)
    out["speedup_vs_torch"] = round(out["torch_us"] / out["radixkv_us"], 2)
    return out


def radixkv_us(row_bytes: int, tokens: int, reps: int, seed: int) -> float:
    """The mha case's radixkv time alone (what --baseline compares)."""
    return bench_case(row_bytes, tokens, reps, seed, only_radixkv=True)["radixkv_us"]


class Baseline:
    """An older radixkv build in a child process (its python/ directory first on
    PYTHONPATH) that times mha cases on request, so the parent can alternate
    the two builds case by case and machine load drifts on both alike."""

    def __init__(self, path: str, args) -> None:
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                [path] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            ),
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--serve",
                "--reps",
                str(args.reps),
                "--seed",
                str(args.seed),
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def time(self, row_bytes: int, tokens: int) -> float:
        self.proc.stdin.write(f"{row_bytes} {tokens}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def serve(args) -> None:
    for line in sys.stdin:
        rb, n = map(int, line.split())
        print(radixkv_us(rb, n, args.reps, args.seed), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--row-bytes", type=int, nargs="*", default=ROW_BYTES)
    ap.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    ap.add_argument(
        "--sections", nargs="*", default=["mha", "mla", "fp8"], choices=["mha", "mla", "fp8"]
    )
    ap.add_argument(
        "--baseline",
        default=None,
        help="a python/ directory of an older radixkv build to compare mha with",
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads for the baselines (default: torch's own)",
    )
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.serve:
        return serve(args)

    before = Baseline(args.baseline, args) if args.baseline and "mha" in args.sections else None
    memcpy = memcpy_gbps(args.reps)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads; "
        f"memcpy (1 thread, 256 MiB) {memcpy:.1f} GB/s (read + written)"
    )
    if "mha" in args.sections:
        main_mha(args, memcpy, before)
    if "mla" in args.sections:
        if store_mla is None:
            raise SystemExit("this radixkv has no store_mla")
        rows = [bench_mla_case(n, args.reps, args.seed) for n in args.tokens]
        header = (
            f"MLA (512 + 64, bf16)\n{'tokens':>6} | {'radixkv us':>10} {'GB/s':>6} | "
            f"{'torch us':>9} {'GB/s':>6} | {'x torch':>7}"
        )
        print(header)
        print("-" * len(header.splitlines()[1]))
        for r in rows:
            print(
                f"{r['tokens']:>6} | {r['radixkv_us']:>10.2f} {r['radixkv_gbps']:>6.1f} | "
                f"{r['torch_us']:>9.2f} {r['torch_gbps']:>6.1f} | {r['speedup_vs_torch']:>7.2f}"
            )
        for r in rows:
            print(json.dumps({"bench": "store_mla_cpu", **r}))
    if "fp8" in args.sections:
        if FP8 is None:
            raise SystemExit("this torch has no float8_e4m3fn")
        rows = [bench_fp8_case(n, args.reps, args.seed) for n in args.tokens]
        header = (
            f"float8 (bf16 -> e4m3fn, 8 x 128, k and v scaled)\n{'tokens':>6} | "
            f"{'radixkv us':>10} {'GB/s':>6} | {'torch us':>9} {'GB/s':>6} | {'x torch':>7}"
        )
        print(header)
        print("-" * len(header.splitlines()[1]))
        for r in rows:
            print(
                f"{r['tokens']:>6} | {r['radixkv_us']:>10.2f} {r['radixkv_gbps']:>6.1f} | "
                f"{r['torch_us']:>9.2f} {r['torch_gbps']:>6.1f} | {r['speedup_vs_torch']:>7.2f}"
            )
        for r in rows:
            print(json.dumps({"bench": "store_fp8_cpu", **r}))


def main_mha(args, memcpy: float, before) -> None:
    rows = []
    for rb in args.row_bytes:
        for n in args.tokens:
            r = bench_case(rb, n, args.reps, args.seed)
            r["memcpy_gbps"] = round(memcpy, 2)
            r["fraction_of_memcpy"] = round(r["radixkv_gbps"] / memcpy, 3)
            if before is not None:
                # Alternate the two builds twice, A B A B, and keep each one's
                # best median: load from other work only ever adds time.
                base, mine = [], []
                for _ in range(2):
                    base.append(before.time(rb, n))
                    mine.append(radixkv_us(rb, n, args.reps, args.seed))
                r["radixkv_best_us"] = round(min(mine), 3)
                r["baseline_us"] = round(min(base), 3)
                r["vs_baseline"] = round(min(mine) / min(base), 3)
            rows.append(r)
    if before is not None:
        before.close()

    header = (
        f"{'row B':>6} {'tokens':>6} | {'radixkv us':>10} {'GB/s':>6} | "
        f"{'index_copy us':>13} {'GB/s':>6} | {'index_put us':>12} {'GB/s':>6} | "
        f"{'x copy':>6} {'x put':>6} {'of memcpy':>9}"
        + (f" | {'best us':>8} {'baseline us':>11} {'vs base':>7}" if before is not None else "")
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
            + (
                f" | {r['radixkv_best_us']:>8.2f} {r['baseline_us']:>11.2f} "
                f"{r['vs_baseline']:>7.3f}"
                if before is not None
                else ""
            )
        )
    for r in rows:
        print(json.dumps({"bench": "store_cpu", **r}))


if __name__ == "__main__":
    main()
