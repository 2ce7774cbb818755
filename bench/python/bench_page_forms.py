"""What a request's native calls cost per token, and what the page forms
would cost at a token interface's boundary.

finish: a CacheManager (device only, page 512, pages aligned) finishes
12,288-token requests through `free_and_cache_finished_req_pages`, each
either all new (its tokens copied into new nodes) or all cached (its tokens
compared with the matched path again, nothing copied); the two alternate.

match: a tree of its own holds 12,288 tokens; a match of them all through
the slot form (`match_prefix`, which writes the slots natively) against the
page form (`match_pages`) with the slots made from its pages in Python
(`slots_of_pages`), as an engine that speaks token slots (SGLang) would need
them; at page 16 and 512.

Medians in microseconds, one intra-op thread, what exists before the loops
frozen out of the garbage collector.

    python bench/python/bench_page_forms.py [--reps N]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from radixkv import _core
from radixkv.kvcache.page_ids import slots_of_pages
from radixkv.scheduler import CacheManager

TOKENS = 12288
clock = time.perf_counter_ns


def finish_split(reps: int, g: torch.Generator) -> dict:
    cm = CacheManager(5859, page_size=512)
    same = torch.randint(0, 32000, (TOKENS,), generator=g, dtype=torch.int32)
    times: dict = {"all new": [], "all cached": []}

    def one(ids: torch.Tensor, into: list) -> None:
        handle, cached = cm.match_pages(ids)
        cm.lock(handle)
        pages = torch.cat([cached, cm.allocate_pages(TOKENS - handle.cached_len)])
        t0 = clock()
        cm.free_and_cache_finished_req_pages(handle, ids, pages)
        into.append(clock() - t0)

    one(same, [])
    for _ in range(reps):
        one(torch.randint(0, 32000, (TOKENS,), generator=g, dtype=torch.int32), times["all new"])
        one(same, times["all cached"])
    cm.check_integrity()
    return {k: statistics.median(v) / 1e3 for k, v in times.items()}


def match_forms(page_size: int, reps: int, g: torch.Generator) -> dict:
    ids = torch.randint(0, 32000, (TOKENS + 1,), generator=g, dtype=torch.int32)
    slots = torch.arange(page_size, page_size + TOKENS, dtype=torch.int32)
    by_slots, by_pages = _core.RadixTree(page_size), _core.RadixTree(page_size, aligned_pages=True)
    by_slots.insert_prefix(ids[:TOKENS], slots)
    by_pages.insert_prefix(ids[:TOKENS], slots)
    times: dict = {"slot form": [], "page form + slots": []}
    for _ in range(reps):
        t0 = clock()
        _, got = by_slots.match_prefix(ids[:TOKENS])
        t1 = clock()
        _, pages = by_pages.match_pages(ids, 0, True)
        got_too = slots_of_pages(pages, page_size)
        t2 = clock()
        times["slot form"].append(t1 - t0)
        times["page form + slots"].append(t2 - t1)
    if not torch.equal(got, got_too):
        raise RuntimeError("the two forms matched different slots")
    return {k: statistics.median(v) / 1e3 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=400, help="requests or matches a case")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    gc.collect()
    gc.freeze()
    split = finish_split(args.reps, g)
    print(f"finish of {TOKENS:,} tokens at page 512, median us:")
    for case, us in split.items():
        print(f"  {case:<12}{us:>8.2f}")
    print(f"match of {TOKENS:,} cached tokens, median us:")
    for page_size in (16, 512):
        forms = match_forms(page_size, 5 * args.reps, g)
        cells = "".join(f"  {k} {us:.2f}" for k, us in forms.items())
        print(f"  page {page_size:<4}{cells}")


if __name__ == "__main__":
    main()
