"""`radixkv replay`: replay a trace (or the built-in chat workload) through the cache."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from radixkv.replay.replay import KVShape, ReplayResult, pages_for_all, replay
from radixkv.replay.traces import load_mooncake, optimal_hit_tokens
from radixkv.replay.workloads import chat_sessions

MOONCAKE_BLOCK = 512
BUILTIN_BLOCK = 16
# The built-in workload's default pool: about a fifth of its tokens, so LRU
# eviction is part of the default run.
BUILTIN_CAPACITY_TOKENS = 1 << 18


def build_parser(prog: str = "radixkv replay") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("trace", nargs="?", help="Mooncake-format JSONL trace; omitted: built-in "
                   "multi-turn chat workload")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--capacity-tokens", type=int, help="KV pool size in tokens "
                     "(rounded up to pages; default for a trace: room for every token, no "
                     f"eviction; built in: {BUILTIN_CAPACITY_TOKENS:,})")
    cap.add_argument("--capacity-pages", type=int, help="KV pool size in pages")
    p.add_argument("--block-size", type=int, help=f"tokens per trace block (default "
                   f"{MOONCAKE_BLOCK} for a trace file, {BUILTIN_BLOCK} built in)")
    p.add_argument("--page-size", type=int, help="KV page size (default: the block size)")
    p.add_argument("--policy", choices=["radix", "naive"], default="radix")
    p.add_argument("--kv", default="1,1,8,float16", metavar="L,H,D[,DTYPE]",
                   help="model shape of the KV pool: layers, kv heads, head dim, dtype "
                   "(default 1,1,8,float16)")
    p.add_argument("--no-store", action="store_true", help="skip storing K/V into the pool")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--sessions", type=int, default=400, help="built-in workload: sessions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--sweep", type=int, nargs="?", const=8, metavar="N",
                   help="replay at N capacities (unbounded / 2^k) and write a hit-rate plot")
    p.add_argument("--out", default=".", help="directory for --sweep's JSON and PNG")
    return p


def _table(r: ReplayResult, optimum: Optional[int]) -> str:
    lines = [
        f"policy {r.policy}, page size {r.page_size}, capacity {r.capacity_tokens:,} tokens",
        f"  requests        {r.requests:>14,}   (skipped, larger than the pool: "
        f"{r.skipped_requests})",
        f"  input tokens    {r.input_tokens:>14,}",
        f"  hit tokens      {r.hit_tokens:>14,}   token hit rate {100 * r.token_hit_rate:.2f}%"
        + (f" (unbounded optimum {100 * optimum / r.input_tokens:.2f}%)"
           if optimum is not None and r.input_tokens else ""),
        f"  computed tokens {r.computed_tokens:>14,}",
        f"  output tokens   {r.output_tokens:>14,}",
        f"  evicted tokens  {r.evicted_tokens:>14,}",
        f"  K/V stored      {r.stored_tokens:>14,} tokens",
        f"  wall time       {r.wall_s:>14.3f} s    {r.requests / max(r.wall_s, 1e-9):,.0f} "
        "requests/s",
        "  latency (us)         p50        p99      count",
    ]
    for op, v in r.latency_us.items():
        if v["count"]:
            lines.append(f"    {op:<12} {v['p50']:>10.2f} {v['p99']:>10.2f} {v['count']:>10,}")
        else:
            lines.append(f"    {op:<12} {'-':>10} {'-':>10} {0:>10}")
    return "\n".join(lines)


def _plot(points: List[dict], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot written "
              "(pip install matplotlib)", file=sys.stderr)
        return False
    xs = [p["capacity_tokens"] for p in points]
    ys = [100 * p["token_hit_rate"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV capacity (tokens)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Optional[List[str]] = None, prog: str = "radixkv replay") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.trace:
        requests = load_mooncake(args.trace)
        block = args.block_size or MOONCAKE_BLOCK
        name = os.path.basename(args.trace)
    else:
        block = args.block_size or BUILTIN_BLOCK
        requests = chat_sessions(args.sessions, block, args.seed)
        name = f"built-in chat ({args.sessions} sessions)"
    if args.limit is not None:
        requests = requests[: args.limit]
    if not requests:
        print("error: the trace has no requests", file=sys.stderr)
        return 2
    page = args.page_size or block
    for flag, v in (("--page-size", page), ("--block-size", block)):
        if v < 1:
            print(f"error: {flag} must be >= 1, got {v}", file=sys.stderr)
            return 2
    try:
        kv = KVShape.parse(args.kv)
    except (ValueError, AttributeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    unbounded = pages_for_all(requests, page)
    if args.capacity_pages is not None:
        capacity = args.capacity_pages
    elif args.capacity_tokens is not None:
        capacity = -(-args.capacity_tokens // page)
    elif not args.trace:
        capacity = -(-BUILTIN_CAPACITY_TOKENS // page)
    else:
        capacity = unbounded
    if capacity < 1:
        print("error: the capacity must be at least one page", file=sys.stderr)
        return 2
    optimum = optimal_hit_tokens(requests, block) if page == block else None
    common = dict(block_size=block, page_size=page, policy=args.policy, kv=kv,
                  store=not args.no_store, seed=args.seed)

    if args.sweep:
        points = []
        for k in range(args.sweep):
            pages = max(1, capacity >> (args.sweep - 1 - k))
            r = replay(requests, capacity_pages=pages, progress=sys.stderr.isatty(), **common)
            points.append(r.to_json())
            if not args.json:
                print(f"capacity {r.capacity_tokens:>14,} tokens: hit rate "
                      f"{100 * r.token_hit_rate:6.2f}%  evicted {r.evicted_tokens:,}  "
                      f"{r.wall_s:.2f} s")
        os.makedirs(args.out, exist_ok=True)
        json_path = os.path.join(args.out, "replay_sweep.json")
        with open(json_path, "w") as f:
            json.dump({"trace": name, "points": points}, f, indent=1)
        png = os.path.join(args.out, "replay_sweep.png")
        plotted = _plot(points, png, f"{name}: {args.policy}, page {page}")
        if args.json:
            print(json.dumps({"trace": name, "points": points}))
        else:
            print(f"wrote {json_path}" + (f" and {png}" if plotted else ""))
        return 0

    r = replay(requests, capacity_pages=capacity, progress=sys.stderr.isatty(), **common)
    out = r.to_json()
    out["trace"] = name
    if optimum is not None:
        out["optimal_hit_tokens"] = optimum
    if args.json:
        print(json.dumps(out))
    else:
        print(f"replay of {name}")
        print(_table(r, optimum))
    return 0
