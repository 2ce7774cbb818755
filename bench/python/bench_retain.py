"""Retention claims: what a claim costs a scheduler, and what it buys.

Cost. Requests (page 16) of one of 64 system prompts of 2,048 tokens and 512
tokens of their own, cached, then, per round: `retain` + `release` of each,
against `match_req` of the same inputs in the same round (the baseline: a
claim is a match plus counting); and `match_req` with 1,000 live claims that
refresh on hit, against `match_req` with none. Prints medians in
microseconds per call, the spread over rounds, and the ratios.

Effect. `radixkv replay --retain TTL` on the built-in chat workload (400
sessions with 5 to 60 s between turns), device only, at three pool sizes:
token hit rate and evicted tokens with and without claims.

python bench/python/bench_retain.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from radixkv.scheduler import CacheManager

PAGE, SYSTEM, OWN, PROMPTS = 16, 2048, 512, 64


def requests(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    systems = [
        torch.randint(0, 1 << 30, (SYSTEM,), generator=g, dtype=torch.int32) for _ in range(PROMPTS)
    ]
    return [
        torch.cat(
            [
                systems[i % PROMPTS],
                torch.randint(0, 1 << 30, (OWN,), generator=g, dtype=torch.int32),
            ]
        )
        for i in range(n)
    ]


def cached_manager(reqs, **kwargs) -> CacheManager:
    cm = CacheManager(
        len(reqs) * (SYSTEM + OWN) // PAGE + 64, PAGE, retain_budget_tokens=1 << 30, **kwargs
    )
    for ids in reqs:
        h, idx = cm.match_req(ids)
        cm.lock(h)
        own = cm.allocate(len(ids) - len(idx))
        cm.free_and_cache_finished_req(h, ids, torch.cat([idx, own]))
    return cm


def per_call(fn, items) -> float:
    t0 = time.perf_counter_ns()
    for x in items:
        fn(x)
    return (time.perf_counter_ns() - t0) / 1e3 / len(items)


def costs(rounds: int):
    reqs = requests(1000, 0)
    cm = cached_manager(reqs)
    match, claim = [], []
    for _ in range(rounds):
        match.append(per_call(cm.match_req, reqs))
        claim.append(per_call(lambda ids: cm.release(cm.retain(ids)), reqs))
    refreshing = cached_manager(reqs, clock=lambda: 0.0)
    for ids in reqs:
        refreshing.retain(ids, ttl_s=60.0, refresh_on_hit=True)
    plain, refreshed = [], []
    for _ in range(rounds):
        plain.append(per_call(cm.match_req, reqs))
        refreshed.append(per_call(refreshing.match_req, reqs))
    return {
        "match": match,
        "retain+release": claim,
        "match (none claimed)": plain,
        "match (1,000 refreshing claims)": refreshed,
    }


def effect():
    rows = []
    for cap in (8192, 32768, 65536):
        row = {"capacity_tokens": cap}
        for label, extra in (("plain", []), ("retain 60 s", ["--retain", "60"])):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "radixkv",
                    "replay",
                    "--no-store",
                    "--storage",
                    "none",
                    "--host-capacity-tokens",
                    "0",
                    "--capacity-tokens",
                    str(cap),
                    "--json",
                    *extra,
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            r = json.loads(out)
            row[label] = {
                k: r[k]
                for k in (
                    "token_hit_rate",
                    "evicted_tokens",
                    "retain_claims",
                    "retain_refused",
                    "retain_expired",
                    "retain_budget_tokens",
                )
            }
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    c = costs(args.rounds)
    print("cost, us a call: median (min..max over rounds)")
    for name, xs in c.items():
        print(f"  {name:<34} {statistics.median(xs):8.2f} ({min(xs):.2f}..{max(xs):.2f})")
    print(
        f"  retain+release / match             {statistics.median(c['retain+release']) / statistics.median(c['match']):8.2f}x"
    )
    print(
        f"  match, refreshing / none           "
        f"{statistics.median(c['match (1,000 refreshing claims)']) / statistics.median(c['match (none claimed)']):8.2f}x"
    )
    print("effect (built-in chat workload, device only):")
    for row in effect():
        p, k = row["plain"], row["retain 60 s"]
        print(
            f"  {row['capacity_tokens']:>6} tokens: hit rate {p['token_hit_rate']:.4f} -> "
            f"{k['token_hit_rate']:.4f}, evicted {p['evicted_tokens']:,} -> {k['evicted_tokens']:,}; "
            f"claims {k['retain_claims']}, refused {k['retain_refused']}, expired "
            f"{k['retain_expired']} (budget {k['retain_budget_tokens']:,})"
        )


if __name__ == "__main__":
    main()
