"""K/V transfer between the device pool and the host pool, on the CPU.

Rows of a real model: 8 KV heads x 128 x bfloat16, 2 KiB per token per layer
for K and as much for V; 4 layers; pages of 16 tokens. The device pool is
LayerFirst `[2, L, P, 16, 8, 128]`; the host pool is `page_first`
`[P, 2, L, 16, 8, 128]` or `layer_first`. Each case moves `tokens` tokens
(whole pages at random page ids in both pools, as a pool that has run a
while hands them out; successive calls cycle through 2 disjoint page sets so
the copies run from memory, not cache):
  backup   device -> host, all layers (what write_through queues)
  load     host -> device, one layer (what a forward pass waits for, per layer)
against
  memcpy   libc memcpy of one contiguous buffer of the same bytes
  torch    per side (and layer), `dst.index_copy_(0, dst_pages, src.index_select(0,
           src_pages))` over page-shaped views: what the tier would do in torch
  radixkv  `radixkv._core.transfer_rows`: the copy the controller's CPU engine
           runs (memcpy of whole page runs per side and layer)
GB/s counts the bytes copied once. Then the controller's own cost per queued
copy (queue, thread hand-off, acknowledgement) for copies of one page, with
the CPU engine and with the bookkeeping-only engine.

python bench/python/bench_transfer.py [--reps N] [--tokens 1024 4096 16384 32768]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_store import time_us  # noqa: E402  (median us per call, batched samples)

from radixkv import _core  # noqa: E402
from radixkv.kvcache import MHAKVCache  # noqa: E402
from radixkv.kvcache.host_pool import HostKVCache  # noqa: E402

HEADS, HEAD_DIM, DTYPE, LAYERS, PAGE = 8, 128, torch.bfloat16, 4, 16
ROW = HEADS * HEAD_DIM * DTYPE.itemsize  # 2 KiB
SETS = 2


_libc = ctypes.CDLL(None)
_libc.memcpy.restype = ctypes.c_void_p
_libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def memcpy_us(nbytes: int, reps: int) -> float:
    src = torch.ones(SETS * nbytes, dtype=torch.uint8)
    dst = torch.zeros(SETS * nbytes, dtype=torch.uint8)
    state = [0]

    def run():
        k = state[0] = (state[0] + 1) % SETS
        _libc.memcpy(dst.data_ptr() + k * nbytes, src.data_ptr() + k * nbytes, nbytes)

    return time_us(run, reps)


def bench_size(tokens: int, layout: str, reps: int, seed: int) -> list:
    pages = tokens // PAGE
    pool_pages = SETS * pages + 8
    g = torch.Generator().manual_seed(seed)
    dev = MHAKVCache(HEADS, LAYERS, HEAD_DIM, pool_pages, DTYPE, page_size=PAGE)
    dev.kv_buffer.copy_(torch.randn(dev.kv_buffer.shape, generator=g).to(DTYPE))
    host = HostKVCache(dev, pool_pages, layout=layout, pin_memory=False)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(DTYPE))
    dl, hl = list(dev.copy_layout()), list(host.copy_layout())
    perm_d = torch.randperm(pool_pages, generator=g)[: SETS * pages].view(SETS, pages)
    perm_h = torch.randperm(pool_pages, generator=g)[: SETS * pages].view(SETS, pages)

    def slots(page_ids):
        return (page_ids[:, None] * PAGE + torch.arange(PAGE)).flatten().to(torch.int32)

    d_slots = [slots(p) for p in perm_d]
    h_slots = [slots(p) for p in perm_h]
    state = [0]

    def nxt():
        state[0] = (state[0] + 1) % SETS
        return state[0]

    # Page-shaped views for torch: [P, PAGE * ROW] bytes per (side, layer).
    def page_view(view6, side, layer):
        return (
            view6[side, layer].reshape(pool_pages, -1)
            if view6[side, layer].is_contiguous()
            else view6[side, layer].flatten(1)
        )

    dev_view = dev._view
    host_view = host._view
    out = []
    for op in ("backup", "load"):
        layers = range(LAYERS) if op == "backup" else range(1)
        nbytes = 2 * len(layers) * tokens * ROW
        if op == "backup":

            def rk():
                k = nxt()
                _core.transfer_rows(
                    dev.kv_buffer, dl, host.kv_buffer, hl, ROW, LAYERS, d_slots[k], h_slots[k]
                )

            def tk():
                k = nxt()
                for layer in layers:
                    for side in (0, 1):
                        src = page_view(dev_view, side, layer)
                        dst = page_view(host_view, side, layer)
                        dst.index_copy_(0, perm_h[k], src.index_select(0, perm_d[k]))
        else:

            def rk():
                k = nxt()
                _core.transfer_rows(
                    host.kv_buffer, hl, dev.kv_buffer, dl, ROW, LAYERS, h_slots[k], d_slots[k], 0, 1
                )

            def tk():
                k = nxt()
                for side in (0, 1):
                    src = page_view(host_view, side, 0)
                    dst = page_view(dev_view, side, 0)
                    dst.index_copy_(0, perm_d[k], src.index_select(0, perm_h[k]))

        # Both paths must copy the same bytes.
        rk()
        k = state[0]
        for layer in layers:
            for side in (0, 1):
                a = page_view(dev_view, side, layer)[perm_d[k]]
                b = page_view(host_view, side, layer)[perm_h[k]]
                assert torch.equal(a, b), f"{op} copied the wrong bytes"
        us = {
            "radixkv": time_us(rk, reps),
            "torch": time_us(tk, reps),
            "memcpy": memcpy_us(nbytes, reps),
        }
        gbps = {k: nbytes / (v * 1e3) for k, v in us.items()}
        out.append(
            {
                "op": op,
                "host_layout": layout,
                "tokens": tokens,
                "bytes": nbytes,
                "us": {k: round(v, 1) for k, v in us.items()},
                "gbps": {k: round(v, 2) for k, v in gbps.items()},
                "of_memcpy": round(gbps["radixkv"] / gbps["memcpy"], 3),
                "vs_torch": round(gbps["radixkv"] / gbps["torch"], 2),
            }
        )
    return out


def controller_cost(reps: int) -> list:
    """Microseconds per queued one-page copy: queue it, let the controller run
    it, take its acknowledgement; in batches of 64 copies."""
    dev = MHAKVCache(HEADS, LAYERS, HEAD_DIM, 256, DTYPE, page_size=PAGE)
    host = HostKVCache(dev, 256, pin_memory=False)
    engines = {
        "cpu engine": lambda manual: _core.CacheController(
            dev.kv_buffer,
            list(dev.copy_layout()),
            host.kv_buffer,
            list(host.copy_layout()),
            ROW,
            LAYERS,
            manual,
        ),
        "bookkeeping engine": lambda manual: _core.CacheController(LAYERS, manual),
    }
    page = [torch.arange(PAGE, dtype=torch.int32) + PAGE * i for i in range(64)]
    rows = []
    for name, make in engines.items():
        for manual in (False, True):
            c = make(manual)

            def run(kind):
                for i in range(64):
                    if kind == "backup":
                        c.backup(page[i], page[63 - i])
                    else:
                        c.load(page[63 - i], page[i])
                c.drain()
                acks = c.take_backup_acks() if kind == "backup" else c.take_load_acks()
                assert len(acks) == 64

            for kind in ("backup", "load"):
                us = time_us(lambda: run(kind), reps) / 64
                rows.append(
                    {
                        "engine": name,
                        "thread": "manual" if manual else "worker",
                        "op": kind,
                        "us_per_copy": round(us, 2),
                    }
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the controller copies on one thread
    results = []
    print(
        f"{'op':<7}{'host layout':<13}{'tokens':>7}{'MiB':>7}  "
        f"{'radixkv GB/s':>13}{'torch GB/s':>11}{'memcpy GB/s':>12}{'of memcpy':>10}"
        f"{'vs torch':>9}"
    )
    for layout in ("page_first", "layer_first"):
        for tokens in args.tokens:
            for r in bench_size(tokens, layout, args.reps, args.seed):
                results.append(r)
                g = r["gbps"]
                print(
                    f"{r['op']:<7}{layout:<13}{tokens:>7}{r['bytes'] / 2**20:>7.0f}  "
                    f"{g['radixkv']:>13.2f}{g['torch']:>11.2f}{g['memcpy']:>12.2f}"
                    f"{r['of_memcpy']:>10.2f}{r['vs_torch']:>8.1f}x"
                )
    print("\ncontroller cost per queued one-page copy (queue + run + acknowledgement):")
    ctl = controller_cost(args.reps)
    for r in ctl:
        print(f"  {r['engine']:<20}{r['thread']:<8}{r['op']:<8}{r['us_per_copy']:>8.2f} us")
    for r in results + ctl:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
