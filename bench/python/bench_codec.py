"""The float8 codec: what half the bytes a page buys in hits on the public
trace, in a bounded store and in host memory, and what encoding and decoding
cost.

Hit rate: the Mooncake FAST'25 conversation trace (page 512, K/V of the
replay's default shape in float16: 1 layer, 1 KV head of 8: 16 KiB a page)
through a small device pool and host tier and a file store bounded to a few
sizes, once as pages are and once with `codec="float8"` (the same budget
then holds about twice the pages). Every row read back is checked, within
the codec's error when it is on (`kv_mismatches`).

Host memory: the same trace through a device pool and a host tier of a
few sizes in bytes, once with plain host pages and once with
`host_codec="float8"` (as many pages as the bytes hold: about twice), no
store. Rows loaded back are checked within the codec's error.

Speed: `encode_float8_page` and `decode_float8_page` on pages of a real
model's shape (16 tokens x 8 heads x 128 x bfloat16 x K and V x 32 layers:
2 MiB) against a plain copy of the same bytes (`memoryview` slice
assignment), medians of `--reps`.

python bench/python/bench_codec.py [--trace PATH] [--limit N] [--budgets-mib 16,32,64,128]
    [--host-mib 2,4,8] [--no-store-budgets]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import radixkv
from radixkv.replay import load_mooncake, replay
from radixkv.replay.core import KVShape
from radixkv.replay.replay import StorageConfig

TRACE = os.path.join(
    os.path.dirname(__file__),
    "..",
    "..",
    "..",
    "shared",
    "traces",
    "mooncake_fast25_conversation_trace.jsonl",
)


def _replay(requests, device_tokens: int, kv: KVShape, name: str, **kw):
    """One replay of the trace at page 512, checked: (result, seconds)."""
    t = time.perf_counter()
    r = replay(
        requests,
        block_size=512,
        page_size=512,
        capacity_pages=device_tokens // 512,
        kv=kv,
        **kw,
    )
    took = time.perf_counter() - t
    if r.kv_mismatches or r.storage_errors or r.failed_loads:
        raise SystemExit(
            f"{name}: {r.kv_mismatches} mismatches, {r.storage_errors} storage errors, "
            f"{r.failed_loads} failed loads"
        )
    return r, took


def _finish_row(row: dict, r, rows: list) -> None:
    row["optimal_hit_rate"] = round(r.optimal_hit_tokens / r.input_tokens, 4)
    rows.append(row)
    print(json.dumps(row), flush=True)


def hit_rates(requests, budgets, device_tokens: int, host_tokens: int) -> list:
    rows: list = []
    kv = KVShape(dtype=torch.float16)
    for mib in budgets:
        row = {"store_mib": mib}
        for codec in (None, "float8"):
            name = codec or "plain"
            with tempfile.TemporaryDirectory(prefix="radixkv-codec-") as d:
                store = StorageConfig("file", directory=d, max_bytes=mib << 20, codec=codec)
                r, took = _replay(
                    requests, device_tokens, kv, name, host_pages=host_tokens // 512, storage=store
                )
            row[f"{name}_hit_rate"] = round(r.token_hit_rate, 4)
            row[f"{name}_storage_hit_rate"] = round(r.storage_hit_tokens / r.input_tokens, 4)
            row[f"{name}_s"] = round(took, 1)
        _finish_row(row, r, rows)
    return rows


def host_hit_rates(requests, host_mibs, device_tokens: int) -> list:
    rows: list = []
    kv = KVShape(dtype=torch.float16)
    row_bytes = kv.num_kv_heads * kv.head_dim * 2
    plain_page = 2 * kv.num_layers * 512 * row_bytes
    # An encoded page: one byte an element and a float32 scale per (side, layer,
    # head), each page's bytes 16-byte aligned in the host pool.
    packed_page = -(-(plain_page // 2 + 2 * kv.num_layers * kv.num_kv_heads * 4) // 16) * 16
    for mib in host_mibs:
        row: dict = {"host_mib": mib}
        for codec, page_bytes in ((None, plain_page), ("float8", packed_page)):
            name = codec or "plain"
            pages = (mib << 20) // page_bytes
            r, took = _replay(requests, device_tokens, kv, name, host_pages=pages, host_codec=codec)
            row[f"{name}_host_pages"] = pages
            row[f"{name}_host_pool_mib"] = round(r.host_pool_bytes / 2**20, 2)
            row[f"{name}_hit_rate"] = round(r.token_hit_rate, 4)
            row[f"{name}_host_hit_rate"] = round(r.host_hit_tokens / r.input_tokens, 4)
            row[f"{name}_s"] = round(took, 1)
        _finish_row(row, r, rows)
    return rows


def speed(reps: int) -> dict:
    shape = (2 * 32, 16, 8, 128, "bfloat16", 0)
    raw = bytearray(2 * 32 * 16 * 8 * 128 * 2)
    page = torch.frombuffer(raw, dtype=torch.bfloat16)
    page.copy_(torch.randn(page.shape))
    packed = bytearray(radixkv._core.float8_page_bytes(*shape))
    back = bytearray(len(raw))
    copy = bytearray(len(raw))
    enc, dec, plain = [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        radixkv._core.encode_float8_page(raw, packed, *shape)
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        radixkv._core.decode_float8_page(packed, back, *shape)
        dec.append(time.perf_counter() - t)
        t = time.perf_counter()
        memoryview(copy)[:] = raw
        plain.append(time.perf_counter() - t)
    gb = len(raw) / 1e9
    e, d, c = (statistics.median(x) for x in (enc, dec, plain))
    return {
        "page_mib": len(raw) / 2**20,
        "encode_gb_s": round(gb / e, 2),
        "decode_gb_s": round(gb / d, 2),
        "copy_gb_s": round(gb / c, 2),
        "encode_over_copy": round(e / c, 1),
        "decode_over_copy": round(d / c, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests")
    ap.add_argument("--budgets-mib", default="16,32,64,128")
    ap.add_argument("--device-tokens", type=int, default=200_000)
    ap.add_argument("--host-tokens", type=int, default=400_000)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--host-mib", default="2,4,8", help="host tier budgets (MiB)")
    ap.add_argument("--no-store-budgets", action="store_true", help="skip the store budgets")
    ap.add_argument("--no-trace", action="store_true", help="only the speed")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(speed(args.reps)), flush=True)
    if not args.no_trace:
        requests = load_mooncake(args.trace)[: args.limit]
        if not args.no_store_budgets:
            budgets = [int(b) for b in args.budgets_mib.split(",")]
            hit_rates(requests, budgets, args.device_tokens, args.host_tokens)
        host_mibs = [int(b) for b in args.host_mib.split(",")]
        host_hit_rates(requests, host_mibs, args.device_tokens)


if __name__ == "__main__":
    main()
