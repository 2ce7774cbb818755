"""Namespace quotas: what a flooding tenant costs a well-behaved one, with
and without a quota on the flood, and what the quotas cost per request.

The public trace (Mooncake FAST'25 conversations, page 512) is tenant
"trace"; after each of its requests, tenant "flood" sends `--flood` prompts
of the same length made of blocks nobody shares (a crawler, a batch job).
One CacheManager (bookkeeping only: the tree, the pages and the quotas),
a device pool of `--device-tokens`, no host tier. Reported: the trace
tenant's token hit rate alone, beside the flood, and beside the flood held
to a quota of a few fractions of the pool; and the median time of a request
cycle (match, allocate, finish) with no quota set against one with quotas
on both tenants (the quota's bookkeeping on every request).

python bench/python/bench_quotas.py [--trace PATH] [--limit N] [--flood 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from bench_codec import TRACE  # (run from this directory's parent: it is on the path)

from radixkv.replay import load_mooncake
from radixkv.replay.traces import TokenMaker
from radixkv.scheduler import CacheManager

PAGE = 512


def run(
    requests,
    device_tokens: int,
    flood: int,
    quota_frac,
    trace_quota: bool = False,
    named: bool = True,
):
    cm = CacheManager(device_tokens // PAGE, PAGE)
    if quota_frac is not None:
        cm.set_quota("flood", device_tokens=int(device_tokens * quota_frac) // PAGE * PAGE)
    if trace_quota:  # a limit that never binds: only the bookkeeping
        cm.set_quota("trace", device_tokens=device_tokens)
    maker = TokenMaker(PAGE, max(max(r.hash_ids, default=0) for r in requests))
    fresh = 2**30  # flood tokens: far above the trace's blocks
    hit = total = 0
    times = []

    def serve(ids, namespace):
        t = time.perf_counter_ns()
        h, cached = cm.match_req(ids, namespace)
        cm.lock(h)
        own = cm.allocate(len(ids) - h.cached_len, namespace if named else None)
        cm.free_and_cache_finished_req(h, ids, torch.cat([cached, own]))
        times.append(time.perf_counter_ns() - t)
        return h.cached_len

    for r in requests:
        if r.input_length > device_tokens // 4:
            continue
        ids = maker.prompt(r)
        hit += serve(ids, "trace")
        total += len(ids)
        for _ in range(flood):
            n = len(ids)
            serve(torch.from_numpy(np.arange(fresh, fresh + n, dtype=np.int32)), "flood")
            fresh += -(-n // PAGE) * PAGE
    cm.check_integrity()
    return hit / total, statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--device-tokens", type=int, default=400_000)
    ap.add_argument("--flood", type=int, default=1, help="flood prompts per trace request")
    ap.add_argument("--quotas", default="0.5,0.25,0.1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    requests = load_mooncake(args.trace)[: args.limit]
    alone, us_alone = run(requests, args.device_tokens, 0, None)
    print(json.dumps({"trace_alone_hit_rate": round(alone, 4), "cycle_us": round(us_alone, 1)}))
    rows = []
    fracs = [float(q) for q in args.quotas.split(",")]
    # allocate() told the request's namespace (its own pages make room first),
    # and for the tightest quota also not told.
    for frac, named in [(None, True)] + [(f, True) for f in fracs] + [(min(fracs), False)]:
        rate, us = run(requests, args.device_tokens, args.flood, frac, named=named)
        row = {
            "flood_quota": frac,
            "allocate_named": named,
            "trace_hit_rate": round(rate, 4),
            "cycle_us": round(us, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    # The bookkeeping alone: the same flood, a limit on each tenant that never binds.
    _, us_off = run(requests, args.device_tokens, args.flood, None)
    _, us_on = run(requests, args.device_tokens, args.flood, 1.0, trace_quota=True)
    print(
        json.dumps(
            {
                "cycle_us_no_quota": round(us_off, 1),
                "cycle_us_quotas_not_binding": round(us_on, 1),
                "ratio": round(us_on / us_off, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
