"""radixkv on a CUDA GPU: the store and compare kernels and the host tier's copies.

store   n tokens written at scattered slots of a paged cache [pages, 16, ...]
        (bfloat16 unless named) by radixkv's kernel with its bounds check (one
        synchronization), without it (check_bounds=False), and by torch's
        indexed assignment of the same rows. Kinds:
          mha      K and V, 8 KV heads x 128
          fp8      K and V, 8 x 128, bfloat16 in, float8_e4m3fn cache, scale 0.5
                   (torch: `(k.float() / 0.5).to(float8)` then the assignment)
          mla      one 576-wide row (kv_lora_rank 512 + rope 64) from two inputs
          side     mha plus two side planes (4 float32 and 8 int8 per token),
                   written by the same kernel call
        Each result is checked bit for bit against torch's.
compare first_mismatch_batched of one query against B keys of L tokens (the
        radix match's inner loop), one warp per key, against the same in torch ops.
load    a CacheManager with a device pool and a pinned host tier (4 layers):
        n tokens evicted to host, then `load_back` and waiting for the last
        layer (the copy engine's two streams, layer by layer), against one
        cudaMemcpy of the same bytes from pinned memory (the ceiling). Pool
        kinds mha, fp8 (float8 pool), mla and side (mha + a 4-float side
        plane). `backup_wall_us`: finishing a new n-token request with
        write_through until its pages are on the host (wall time of
        `free_and_cache_finished_req` + `drain`, the device -> host copies).
Times are CUDA-event medians over --reps runs after warm-ups (backup: wall).

python bench/python/bench_cuda.py [--reps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from radixkv.kernel import first_mismatch_batched, store_cache, store_mla
from radixkv.kernel.compare import _first_mismatch_torch
from radixkv.kvcache import MHAKVCache, MLAKVCache
from radixkv.scheduler import CacheManager

HEADS, DIM, DT, PAGE = 8, 128, torch.bfloat16, 16
FP8 = torch.float8_e4m3fn
DEV = "cuda"  # --device cpu: a dry run of the script itself, timed by the wall clock
LORA, ROPE = 512, 64


class Timer:
    """CUDA events on the GPU, the wall clock in a CPU dry run."""

    def __init__(self):
        if DEV == "cuda":
            self.a, self.b = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )

    def start(self):
        if DEV == "cuda":
            self.a.record()
        else:
            self.t = time.perf_counter()

    def stop(self) -> float:
        """Microseconds since start."""
        if DEV == "cuda":
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b) * 1e3
        return (time.perf_counter() - self.t) * 1e6


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def cuda_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    sync()
    out = []
    for _ in range(reps):
        t = Timer()
        t.start()
        fn()
        out.append(t.stop())
    return statistics.median(out)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _store_case(kind: str, n: int):
    """(radixkv store(check_bounds), torch store, caches to compare, bytes written)."""
    pages = 4 * n // PAGE + 64
    slots = pages * PAGE
    loc = torch.randperm(slots, device=DEV)[:n]
    if kind == "mla":
        cache = torch.zeros(pages, PAGE, 1, LORA + ROPE, dtype=DT, device=DEV)
        nope = torch.randn(n, 1, LORA, device=DEV).to(DT)
        rope = torch.randn(n, 1, ROPE, device=DEV).to(DT)
        rows = cache.view(-1, LORA + ROPE)

        def ours(check):
            store_mla(cache, loc, nope, rope, LORA, check_bounds=check)

        def theirs():
            rows[loc, :LORA] = nope.view(n, LORA)
            rows[loc, LORA:] = rope.view(n, ROPE)

        return ours, theirs, [cache], n * (LORA + ROPE) * 2
    cdt = FP8 if kind == "fp8" else DT
    kc = torch.zeros(pages, PAGE, HEADS, DIM, dtype=cdt, device=DEV)
    vc = torch.zeros_like(kc)
    k = torch.randn(n, HEADS, DIM, device=DEV).to(DT)
    v = torch.randn(n, HEADS, DIM, device=DEV).to(DT)
    fk, fv = kc.view(-1, HEADS, DIM), vc.view(-1, HEADS, DIM)
    caches, nbytes = [kc, vc], 2 * n * HEADS * DIM * kc.element_size()
    side, bufs = None, []
    if kind == "side":
        bufs = [
            torch.zeros(slots, 4, device=DEV),
            torch.zeros(slots, 8, dtype=torch.int8, device=DEV),
        ]
        srcs = [
            torch.randn(n, 4, device=DEV),
            torch.randint(-100, 100, (n, 8), dtype=torch.int8, device=DEV),
        ]
        side = [("scale", bufs[0], srcs[0]), ("label", bufs[1], srcs[1])]
        caches += bufs
        nbytes += n * (16 + 8)
    scale = 0.5 if kind == "fp8" else None

    def ours(check):
        store_cache(kc, vc, loc, k, v, k_scale=scale, v_scale=scale, side=side, check_bounds=check)

    def theirs():
        if kind == "fp8":
            fk[loc] = (k.float() / 0.5).to(FP8)
            fv[loc] = (v.float() / 0.5).to(FP8)
        else:
            fk[loc] = k
            fv[loc] = v
        if side:
            for _, buf, src in side:
                buf[loc] = src

    return ours, theirs, caches, nbytes


def bench_store(reps: int) -> list:
    rows = []
    for kind in ("mha", "fp8", "mla", "side"):
        for n in (16, 256, 4096, 32768):
            torch.manual_seed(n)
            ours, theirs, caches, nbytes = _store_case(kind, n)
            us = {
                "radixkv": cuda_us(lambda: ours(True), reps),
                "radixkv unchecked": cuda_us(lambda: ours(False), reps),
                "torch": cuda_us(theirs, reps),
            }
            for c in caches:
                c.zero_()
            theirs()
            want = [_bits(c).clone() for c in caches]
            for c in caches:
                c.zero_()
            ours(False)
            same = all(torch.equal(_bits(c), w) for c, w in zip(caches, want))
            rows.append(
                {
                    "case": "store",
                    "kind": kind,
                    "tokens": n,
                    "bit_exact": same,
                    "us": {a: round(b, 1) for a, b in us.items()},
                    "gbps": {a: round(nbytes / b / 1e3, 1) for a, b in us.items()},
                }
            )
    return rows


def bench_compare(reps: int) -> list:
    rows = []
    for batch, length in ((64, 512), (1024, 512), (256, 8192)):
        g = torch.Generator(device="cpu").manual_seed(batch)
        query = torch.randint(0, 1 << 20, (length,), dtype=torch.int32, generator=g)
        keys = query.repeat(batch, 1)
        cut = torch.randint(0, length + 1, (batch,), generator=g)
        for b in range(batch):
            if cut[b] < length:
                keys[b, cut[b]] += 1
        lens = torch.randint(0, length + 1, (batch,), dtype=torch.int32, generator=g)
        query, keys, lens = query.to(DEV), keys.to(DEV), lens.to(DEV)
        out = torch.empty(batch, dtype=torch.int32, device=DEV)
        ref = torch.empty_like(out)
        us = {
            "radixkv": cuda_us(lambda: first_mismatch_batched(query, keys, lens, out=out), reps),
            "torch": cuda_us(lambda: _first_mismatch_torch(query, keys, lens, ref), reps),
        }
        rows.append(
            {
                "case": "compare",
                "batch": batch,
                "length": length,
                "same": bool(torch.equal(out, ref)),
                "us": {a: round(b, 1) for a, b in us.items()},
            }
        )
    return rows


def _pool(kind: str, pages: int, layers: int):
    if kind == "mla":
        return MLAKVCache(
            LORA, ROPE, layers, pages, DT, device=DEV, page_size=PAGE, check_bounds=False
        )
    pool = MHAKVCache(
        HEADS,
        layers,
        DIM,
        pages,
        FP8 if kind == "fp8" else DT,
        device=DEV,
        page_size=PAGE,
        check_bounds=False,
    )
    if kind == "side":
        pool.register_side_buffer("scale", (4,), torch.float32)
    return pool


def bench_load(reps: int, layers: int = 4) -> list:
    rows = []
    for kind in ("mha", "fp8", "mla", "side"):
        for n in (1024, 16384):
            pages = n // PAGE
            pool = _pool(kind, 2 * pages + 2, layers)
            cm = CacheManager(
                2 * pages + 2, page_size=PAGE, device=DEV, kv_cache=pool, host_num_pages=4 * pages
            )
            a = torch.arange(n + 1, dtype=torch.int32)
            samples, checked = [], None
            written: list = []  # what the first request wrote, set in its round
            for r in range(reps + 2):
                h, idx = cm.match_req(a)
                h, idx = cm.load_back(h)
                if h.cached_len:  # a host hit: time the load
                    t = Timer()
                    t.start()
                    cm.start_loading()
                    pool.k_cache(layers - 1)  # waits for the last layer
                    us = t.stop()
                    if r >= 2:
                        samples.append(us)
                    if checked is None:  # the bytes that came back are the bytes that left
                        got = [
                            pool.k_cache(x)
                            .reshape(-1, *pool.k_cache(x).shape[2:])[idx[:n].long().to(DEV)]
                            .cpu()
                            for x in range(layers)
                        ]
                        checked = all(torch.equal(_bits(g), _bits(w)) for g, w in zip(got, written))
                own = cm.allocate(len(a) - h.cached_len)
                full = torch.cat([idx, own])
                if not h.cached_len:  # the first time: write every layer, keep a copy
                    for x in range(layers):
                        rows_x = pool.k_cache(x).reshape(-1, *pool.k_cache(x).shape[2:])
                        src = torch.randint(0, 100, rows_x[:n].shape, device=DEV).to(rows_x.dtype)
                        rows_x[full[:n].long().to(DEV)] = src
                    written = [
                        pool.k_cache(x)
                        .reshape(-1, *pool.k_cache(x).shape[2:])[full[:n].long().to(DEV)]
                        .cpu()
                        for x in range(layers)
                    ]
                cm.free_and_cache_finished_req(h, a, full)
                cm.drain()
                cm.make_room(cm.num_pages * PAGE)  # out to host again
                cm.drain()
            nbytes = layers * n * _token_bytes(pool)
            src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEV == "cuda")
            dst = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
            memcpy = cuda_us(lambda: dst.copy_(src, non_blocking=True), reps)
            load = statistics.median(samples) if samples else float("nan")
            rows.append(
                {
                    "case": "load",
                    "kind": kind,
                    "tokens": n,
                    "layers": layers,
                    "bytes_back": checked,
                    "us": round(load, 1),
                    "memcpy_us": round(memcpy, 1),
                    "gbps": round(nbytes / load / 1e3, 1),
                    "of_memcpy": round(memcpy / load, 2),
                    "backup_wall_us": _backup_us(kind, n, layers, reps),
                }
            )
    return rows


def _backup_us(kind: str, n: int, layers: int, reps: int) -> float:
    """Median wall time of finishing a new n-token request with write_through
    until its pages are on the host (`free_and_cache_finished_req` + `drain`)."""
    pages = n // PAGE
    pool = _pool(kind, pages + 2, layers)
    cm = CacheManager(
        pages + 2, page_size=PAGE, device=DEV, kv_cache=pool, host_num_pages=4 * pages
    )
    out = []
    for r in range(reps + 2):
        a = torch.arange(n, dtype=torch.int32) + r * (n + 7)  # a request never seen
        h, _ = cm.match_req(a)
        cm.lock(h)
        idx = cm.allocate(n)
        sync()
        t0 = time.perf_counter()
        cm.free_and_cache_finished_req(h, a, idx)
        cm.drain()
        if r >= 2:
            out.append((time.perf_counter() - t0) * 1e6)
        cm.make_room(cm.num_pages * PAGE)
        cm.drain()
    return round(statistics.median(out), 1)


def _token_bytes(pool) -> int:
    """Bytes of one token in one layer: K, V (MHA) or the row (MLA), and side planes."""
    per = 0
    k = pool.k_cache(0)
    per += k[0, 0].numel() * k.element_size()
    if isinstance(pool, MHAKVCache):
        v = pool.v_cache(0)
        per += v[0, 0].numel() * v.element_size()
    for name in pool.side_buffer_names:
        s = pool.side_buffer(name, 0)
        per += s[0, 0].numel() * s.element_size()
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--only", choices=["store", "compare", "load"], nargs="*")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    print(
        torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)",
        "torch",
        torch.__version__,
    )
    parts = {"store": bench_store, "compare": bench_compare, "load": bench_load}
    for name in args.only or list(parts):
        try:
            for r in parts[name](args.reps):
                print(json.dumps(r), flush=True)
        except Exception as e:  # one part's failure must not hide the others' figures
            print(json.dumps({"case": name, "error": f"{type(e).__name__}: {e}"}), flush=True)


if __name__ == "__main__":
    main()
