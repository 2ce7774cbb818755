"""A scheduler step for a whole batch, and the end of a request in one call.

A step is what a scheduler does for a prefill batch of B requests (B = 32 and
256): match, lock, allocate the rest, and (once computed) finish each one.
"singles" makes one CacheManager call per request for each of those;
"batch" makes one call per step for each (match_req_batch, allocate_batch,
free_and_cache_finished_reqs; the locks stay one native call a handle), with
a tensor per request in and out; "flat batch" makes the same calls in their
flat form: the matches' slots come back in one tensor, the allocation in
one, and the finish takes both as they are
(free_and_cache_finished_reqs_flat(..., own=)), so no request has a tensor
of its own.
"python finish" is the baseline of the finish alone: the checks, insert,
frees and unlock the CacheManager made in Python before finish_request (the
same calls, kept here), against free_and_cache_finished_req now.

Requests (page 16): one of 64 system prompts of 2,048 tokens, then 512 tokens
of their own; a pool of pages for 4 steps of 256, so a step evicts what
earlier steps cached (cold, distinct requests, as a busy scheduler sees them).
Each case runs in alternating rounds on its own manager; prints medians in
microseconds per request, with the spread over rounds, and ratios. What is
built before the rounds is frozen out of Python's garbage collector
(`gc.freeze()`, as engines do after start-up): its full collections would
otherwise walk torch's objects inside whichever case happens to trigger one.

python bench/python/bench_step.py [--rounds N] [--steps N]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from radixkv._checks import int32_tensor
from radixkv.kvcache.base import released_slots
from radixkv.scheduler import CacheManager

PAGE = 16
PROMPT, OWN, PROMPTS = 2048, 512, 64


def requests(g: torch.Generator, prompts: list, count: int) -> list:
    pick = torch.randint(0, PROMPTS, (count,), generator=g).tolist()
    own = torch.randint(0, 32000, (count, OWN), generator=g)
    return [torch.cat([prompts[p], own[i]]).to(torch.int32) for i, p in enumerate(pick)]


def manager() -> CacheManager:
    per_request = (PROMPT + OWN) // PAGE
    return CacheManager(num_pages=4 * 256 * per_request, page_size=PAGE)


def python_finish(cm: CacheManager, h, ids: torch.Tensor, idx: torch.Tensor) -> None:
    """free_and_cache_finished_req as the CacheManager made it in Python."""
    tree, pages, ps = cm.manager.tree, cm._pages, cm.page_size
    ids, idx = int32_tensor(ids, "input_ids", cm.device), int32_tensor(idx, "indices", cm.device)
    n, m = ids.shape[0], idx.shape[0]
    assert m == -(-n // ps) * ps and cm.manager.is_valid(h) and h.lock_count >= 1
    cached = h.cached_len
    if cached and not torch.equal(idx[:cached], tree.handle_slots(h)):
        raise ValueError("indices must start with the cache's slots")
    pages.check_owned(idx[cached:], "indices", tree)
    in_cache = tree.insert_prefix(ids, idx[:n], 0, h.namespace)
    for slots in released_slots(idx, cached, in_cache, n, ps, True):
        pages.free(slots)
    cm._held_pages -= (m - cached) // ps
    cm.unlock(h)


def singles(cm: CacheManager, batch: list, finish) -> None:
    held = []
    for ids in batch:
        h, idx = cm.match_req(ids)
        cm.lock(h)
        held.append((h, ids, torch.cat([idx, cm.allocate(len(ids) - h.cached_len)])))
    for h, ids, idx in held:
        finish(cm, h, ids, idx)


def native_finish(cm: CacheManager, h, ids, idx) -> None:
    cm.free_and_cache_finished_req(h, ids, idx)


def batched(cm: CacheManager, batch: list) -> None:
    matched = cm.match_req_batch(batch)
    for h, _ in matched:
        cm.lock(h)
    own = cm.allocate_batch([len(ids) - h.cached_len for ids, (h, _) in zip(batch, matched)])
    cm.free_and_cache_finished_reqs(
        [(h, ids, torch.cat([idx, o])) for ids, (h, idx), o in zip(batch, matched, own)]
    )


def flat(cm: CacheManager, batch: list) -> None:
    """The same step with the flat calls: the matches' slots in one tensor,
    the allocation in one, and the finish taking both as they are."""
    handles, cached = cm.match_req_batch(batch, flat=True)
    for h in handles:
        cm.lock(h)
    own = cm.allocate_batch([len(ids) - h.cached_len for ids, h in zip(batch, handles)], flat=True)
    cm.free_and_cache_finished_reqs_flat(handles, batch, cached, own=own)


CASES = {
    "singles, python finish": lambda cm, b: singles(cm, b, python_finish),
    "singles": lambda cm, b: singles(cm, b, native_finish),
    "batch": batched,
    "flat batch": flat,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="steps a case runs per round")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out: dict = {}
    for size in (32, 256):
        g = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(0, 32000, (PROMPT,), generator=g) for _ in range(PROMPTS)]
        steps = [requests(g, prompts, size) for _ in range(args.steps)]
        managers = {name: manager() for name in CASES}
        gc.collect()
        gc.freeze()
        per_round: dict = {name: [] for name in CASES}
        for _ in range(args.rounds):
            for name, run in CASES.items():  # alternating: the same drift for each
                cm, times = managers[name], []
                for batch in steps:
                    t0 = time.perf_counter_ns()
                    run(cm, batch)
                    times.append((time.perf_counter_ns() - t0) / 1e3 / size)
                per_round[name].append(statistics.median(times))
        for name, cm in managers.items():
            cm.check_integrity()
        base = statistics.median(per_round["singles, python finish"])
        print(f"\nstep of {size} requests (us per request: median of rounds [min, max])")
        for name, vals in per_round.items():
            med = statistics.median(vals)
            print(f"  {name:24s} {med:8.2f}  [{min(vals):.2f}, {max(vals):.2f}]  x{med / base:.2f}")
        out[size] = {name: statistics.median(v) for name, v in per_round.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
