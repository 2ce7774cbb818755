"""`radixkv replay`: replay a trace (or the built-in chat workload) through the cache."""

from __future__ import annotations

import argparse
import math
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from typing import List, NoReturn, Optional, Sequence

from radixkv.replay.control import StopOnCtrlC
from radixkv.replay.core import (
    KVShape,
    ReplayResult,
    StorageConfig,
    StorageUnavailable,
    pages_for_all,
)
from radixkv.replay.replay import replay
from radixkv.replay.traces import Request, load_mooncake
from radixkv.replay.workloads import chat_sessions
from radixkv.kvcache import EVICTION_POLICIES
from radixkv.kvcache.page_codec import CODECS, check_codec_dtype
from radixkv.scheduler.host_tier import WRITE_POLICIES
from radixkv.scheduler.storage_tier import PREFETCH_POLICIES

MOONCAKE_BLOCK = 512
BUILTIN_BLOCK = 16
# The built-in workload's default device pool: a small one (its prompts hold
# 1.2M tokens), so LRU eviction and the host tier, twice as large by default,
# are part of the default run.
BUILTIN_CAPACITY_TOKENS = 1 << 14
# Exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130


class UsageError(Exception):
    """A user mistake: reported as one `error:` line and exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the whole usage
        raise UsageError(message)


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def build_parser(prog: str = "radixkv replay") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description=__doc__)
    positive = _int_at_least(1)
    p.add_argument(
        "trace",
        nargs="?",
        help="Mooncake-format JSONL trace; omitted: built-in " "multi-turn chat workload",
    )
    cap = p.add_mutually_exclusive_group()
    cap.add_argument(
        "--capacity-tokens",
        type=positive,
        help="KV pool size in tokens "
        "(rounded up to pages; default for a trace: the pages an unbounded cache "
        f"uses, no eviction; built in: {BUILTIN_CAPACITY_TOKENS:,})",
    )
    cap.add_argument("--capacity-pages", type=positive, help="KV pool size in pages")
    p.add_argument(
        "--block-size",
        type=positive,
        help=f"tokens per trace block (default "
        f"{MOONCAKE_BLOCK} for a trace file, {BUILTIN_BLOCK} built in)",
    )
    p.add_argument("--page-size", type=positive, help="KV page size (default: the block size)")
    p.add_argument("--policy", choices=["radix", "naive"], default="radix")
    p.add_argument(
        "--host-capacity-tokens",
        type=_int_at_least(0),
        metavar="N",
        help="host-memory tier (L2) in tokens, rounded up to pages; 0: none "
        "(default for a trace: 0; built in: twice the device pool). More than the "
        "trace holds is an unbounded host, allocated only as large as it is used",
    )
    p.add_argument(
        "--host-codec",
        choices=CODECS,
        help="hold host pages encoded: float8 e4m3 with a scale per page, layer and head "
        "(half the bytes of 16-bit K/V, so the same memory holds twice the pages; "
        "lossy, so rows loaded back are compared within the codec's error). A "
        "storage tier then stores pages as they are, with the same codec",
    )
    p.add_argument(
        "--storage",
        choices=["none", "file", "mooncake"],
        help="storage tier (L3) behind the host tier (default for a trace: none; "
        "built in: file, in a temporary directory)",
    )
    p.add_argument(
        "--storage-dir",
        help="--storage file: the directory (default: a temporary "
        "one, removed at the end); pages already there are read",
    )
    p.add_argument(
        "--storage-max-mib",
        type=positive,
        metavar="MIB",
        help="--storage file: bound the bytes of the page files in the directory to MIB "
        "MiB, for every instance that shares it (the files' sizes: the disk blocks they "
        "take, and the directories, come on top), removing the least recently used page "
        "no stored page extends (default: unbounded)",
    )
    p.add_argument(
        "--storage-codec",
        choices=CODECS,
        help="--storage file: write pages as float8 e4m3 with a scale per page, "
        "layer and head (half the bytes of 16-bit K/V; lossy, so rows read back "
        "are compared within the codec's error)",
    )
    p.add_argument(
        "--mooncake-master",
        metavar="HOST:PORT",
        help="--storage mooncake: the "
        "master (default: start mooncake_master on 127.0.0.1, stop it at the end)",
    )
    p.add_argument(
        "--mooncake-metadata",
        metavar="URL",
        help="--storage mooncake: the "
        "metadata server (with --mooncake-master; default http://HOST:8080/metadata)",
    )
    p.add_argument(
        "--mooncake-segment-mib",
        type=positive,
        metavar="MIB",
        help="--storage mooncake: memory each instance lends the store (default 256)",
    )
    p.add_argument(
        "--prefetch-policy",
        choices=list(PREFETCH_POLICIES),
        help="how long a request waits for its pages from storage (default "
        "wait_complete: deterministic)",
    )
    p.add_argument(
        "--instances",
        type=positive,
        default=1,
        help="serving instances, each a "
        "process with its own device and host tiers, sharing the storage tier",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="instances run concurrently and " "copies overlap later requests (not deterministic)",
    )
    p.add_argument(
        "--write-policy",
        choices=list(WRITE_POLICIES),
        default="write_through",
        help="when a node is copied to host: when inserted (write_through), on its "
        "second hit (write_through_selective), when evicted (write_back)",
    )
    p.add_argument(
        "--eviction-policy",
        default="lru",
        metavar="P[,P...]",
        help="which cached leaf goes first: "
        + ", ".join(EVICTION_POLICIES)
        + " (default lru); with --sweep a list, or 'all', compares them in one plot "
        "(the traces carry no request priorities: priority orders as lru)",
    )
    p.add_argument(
        "--eviction-policy-config",
        type=_json_object,
        metavar="JSON",
        help='tlru\'s config, SGLang\'s: {"threshold": T, "next_prompt_estimate": Q} in tokens '
        "(a leaf of at most T - Q tokens goes first)",
    )
    p.add_argument(
        "--kv",
        default="1,1,8,float16",
        metavar="L,H,D[,DTYPE]",
        help="model shape of the KV pool: layers, kv heads, head dim, dtype "
        "(default 1,1,8,float16)",
    )
    p.add_argument(
        "--retain",
        type=_positive_seconds,
        metavar="TTL",
        help="an agent workload: claim each session's conversation after every turn for TTL "
        "seconds of trace time (retain), within half the pool (needs sessions: the built-in "
        "workload)",
    )
    p.add_argument("--no-store", action="store_true", help="skip storing K/V into the pool")
    p.add_argument("--limit", type=positive, help="replay only the first N requests")
    p.add_argument("--sessions", type=positive, default=400, help="built-in workload: sessions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--progress",
        action="store_true",
        help="show the progress bar on stderr even when it is not a terminal (a log)",
    )
    p.add_argument(
        "--sweep",
        type=positive,
        nargs="?",
        const=8,
        metavar="N",
        help="replay at N capacities (unbounded / 2^k) and write a hit-rate plot",
    )
    p.add_argument("--out", default=".", help="directory for --sweep's JSON and PNG")
    return p


def _cold_bound(r: ReplayResult, pct) -> str:
    """The hit rate of an unbounded cache starting empty, beside the run's
    (nothing without one). A run above it began with pages stored by an
    earlier run, and says so: the bound is not its."""
    if r.optimal_hit_tokens is None:
        return ""
    bound = f"an unbounded cache starting empty: {pct(r.optimal_hit_tokens)}"
    if r.hit_tokens > r.optimal_hit_tokens:
        bound += "; this run began with a warm store, which that bound does not count"
    return f" ({bound})"


def _table(r: ReplayResult, kv: KVShape) -> str:
    pct = lambda x: f"{100 * x / r.input_tokens:.2f}%" if r.input_tokens else "-"  # noqa: E731
    pool = (
        f"{kv} x {r.capacity_tokens:,} slots = {r.pool_bytes / 2**20:,.1f} MiB"
        if r.pool_bytes
        else "not stored (--no-store)"
    )
    lines = [
        f"policy {r.policy}, page size {r.page_size}, capacity {r.capacity_tokens:,} tokens",
        f"  requests        {r.requests:>14,}   (skipped, larger than the pool: "
        f"{r.skipped_requests})",
        f"  input tokens    {r.input_tokens:>14,}",
        f"  hit tokens      {r.hit_tokens:>14,}   token hit rate {pct(r.hit_tokens)}"
        + _cold_bound(r, pct),
    ]
    if r.host_capacity_tokens:
        host_pool = (
            f"{r.host_pool_bytes / 2**20:,.1f} MiB"
            if r.host_pool_bytes
            else "not stored (--no-store)"
        )
        lines += [
            f"    on device     {r.device_hit_tokens:>14,}   {pct(r.device_hit_tokens)}",
            f"    on host       {r.host_hit_tokens:>14,}   {pct(r.host_hit_tokens)}",
            f"  host tier       {r.host_capacity_tokens:>14,} tokens, {r.write_policy}, "
            f"{host_pool}" + (f", {r.host_codec}" if r.host_codec else ""),
            f"    backed up     {r.backed_up_tokens:>14,}",
            f"    loaded back   {r.loaded_back_tokens:>14,}   K/V mismatches {r.kv_mismatches}"
            + (f", failed loads {r.failed_loads}" if r.failed_loads else ""),
            f"    host evicted  {r.host_evicted_tokens:>14,}",
        ]
    if r.storage:
        after_host = 1 + next(i for i, line in enumerate(lines) if line.startswith("    on host"))
        lines.insert(
            after_host,
            f"    from storage  {r.storage_hit_tokens:>14,}   {pct(r.storage_hit_tokens)}",
        )
        lines += [
            f"  storage tier    {r.storage}, prefetch {r.prefetch_policy}"
            + (f", {len(r.instances)} instances" if r.instances else ""),
            f"    written       {r.storage_written_pages:>14,} pages",
            f"    prefetched    {r.prefetched_tokens:>14,} tokens   errors {r.storage_errors}",
        ]
    if r.retain_ttl_s is not None:
        lines += [
            f"  retention       {r.retain_ttl_s:g} s a turn, budget {r.retain_budget_tokens:,} "
            "tokens",
            f"    claims        {r.retain_claims:>14,}   refused {r.retain_refused:,}, expired "
            f"{r.retain_expired:,}",
        ]
    lines += [
        f"  computed tokens {r.computed_tokens:>14,}",
        f"  output tokens   {r.output_tokens:>14,}",
        f"  evicted tokens  {r.evicted_tokens:>14,}",
        f"  K/V stored      {r.stored_tokens:>14,} tokens",
        f"  K/V pool        {pool}",
        f"  peak pages      {r.peak_pages:>14,}",
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
        print(
            "note: matplotlib is not installed; no plot written " "(pip install 'radixkv[plot]')",
            file=sys.stderr,
        )
        return False
    xs = [p["capacity_tokens"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    policies = list(dict.fromkeys(p.get("eviction_policy", "lru") for p in points))
    if len(policies) > 1:  # one curve per eviction policy, over all tiers
        for name in policies:
            mine = [p for p in points if p.get("eviction_policy", "lru") == name]
            ax.plot(
                [p["capacity_tokens"] for p in mine],
                [100 * p["token_hit_rate"] for p in mine],
                marker="o",
                label=name,
            )
        ax.legend(loc="lower right")
        ax.set_xlabel("device KV capacity (tokens)")
    elif any(p["host_capacity_tokens"] for p in points):
        device = [100 * p["device_hit_rate"] for p in points]
        host = [100 * p["host_hit_rate"] for p in points]
        ax.stackplot(xs, device, host, labels=["device (L1)", "host (L2)"], alpha=0.8)
        ax.plot(xs, [d + h for d, h in zip(device, host)], marker="o", color="black", lw=1)
        ax.legend(loc="lower right")
        ax.set_xlabel("device KV capacity (tokens; host tier scaled with it)")
    else:
        ax.plot(xs, [100 * p["token_hit_rate"] for p in points], marker="o")
        ax.set_xlabel("KV capacity (tokens)")
    ax.set_xscale("log", base=2)
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _load_trace(path: str) -> List[Request]:
    try:
        return load_mooncake(path)
    except FileNotFoundError:
        raise UsageError(f"trace {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"trace {path}: is a directory, not a JSONL file") from None
    except PermissionError:
        raise UsageError(f"trace {path}: permission denied") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"trace {path}: not a text file ({e.reason})") from None
    except ValueError as e:  # load_mooncake names the file and the line
        raise UsageError(str(e)) from None


def _check_block_size(requests: Sequence[Request], block: int) -> Optional[str]:
    """A warning when most requests' hash ids do not cover their prompt in
    blocks of `block` tokens (the trace was made with another block size)."""

    def fits(b: int) -> float:
        named = [r for r in requests if r.hash_ids]
        ok = sum(len(r.hash_ids) == -(-r.input_length // b) for r in named)
        return ok / len(named) if named else 1.0

    if fits(block) >= 0.9:
        return None
    best = max((2**k for k in range(4, 14)), key=fits)
    hint = f"; blocks of {best} fit {100 * fits(best):.0f}%" if fits(best) > fits(block) else ""
    return (
        f"warning: --block-size {block} disagrees with the trace: only "
        f"{100 * fits(block):.0f}% of its requests have ceil(input_length / {block}) hash "
        f"ids{hint}"
    )


def _check_out_dir(path: str) -> None:
    """--out must be a directory we can write, before any replay runs."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(f"--out {path}: cannot write there ({e.strerror or e})") from None


def _write_json(path: str, data: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    except OSError as e:
        raise UsageError(f"--out: cannot write {path} ({e.strerror or e})") from None


def _run(args) -> int:
    if args.trace:
        requests = _load_trace(args.trace)
        block = args.block_size or MOONCAKE_BLOCK
        name = os.path.basename(args.trace)
        if args.block_size:
            warning = _check_block_size(requests, block)
            if warning:
                print(warning, file=sys.stderr)
    else:
        block = args.block_size or BUILTIN_BLOCK
        requests = chat_sessions(args.sessions, block, args.seed)
        name = f"built-in chat ({args.sessions} sessions)"
    if args.limit is not None:
        requests = requests[: args.limit]
    if args.retain is not None and args.policy != "radix":
        raise UsageError("--retain needs --policy radix")
    if args.retain is not None and not any(r.session for r in requests):
        raise UsageError(f"--retain claims sessions' prefixes, and {name} names no sessions")
    if not requests:
        raise UsageError(f"{name} has no requests")
    page = args.page_size or block
    try:
        kv = KVShape.parse(args.kv)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.sweep:
        _check_out_dir(args.out)

    if args.capacity_pages is not None:
        capacity = args.capacity_pages
    elif args.capacity_tokens is not None:
        capacity = -(-args.capacity_tokens // page)
    elif not args.trace:
        capacity = -(-BUILTIN_CAPACITY_TOKENS // page)
    elif args.no_store:
        capacity = pages_for_all(requests, page)
    else:
        # Room for every token at once would be far more than an unbounded
        # cache ever uses: a bookkeeping-only pass measures what it does use.
        dry = replay(requests, block_size=block, page_size=page, policy=args.policy, store=False)
        if dry.interrupted:
            raise KeyboardInterrupt
        capacity = max(1, dry.peak_pages)
    if args.host_capacity_tokens is not None:
        host_tokens = args.host_capacity_tokens
    else:
        host_tokens = 0 if args.trace else 2 * capacity * page
    if host_tokens and args.policy != "radix":
        raise UsageError("--host-capacity-tokens needs --policy radix")
    storage_kind = args.storage or ("none" if args.trace or args.no_store else "file")
    if storage_kind != "none":
        if args.no_store:
            raise UsageError(f"--storage {storage_kind} moves K/V bytes: drop --no-store")
        if not host_tokens:
            raise UsageError(
                f"--storage {storage_kind} sits behind the host tier: give "
                "--host-capacity-tokens"
            )
    elif args.instances > 1:
        raise UsageError("--instances shares a storage tier: give --storage file or mooncake")
    if args.host_codec:
        if args.no_store or not host_tokens:
            raise UsageError(
                "--host-codec encodes the K/V bytes of a host tier: give "
                "--host-capacity-tokens and drop --no-store"
            )
        if args.storage_codec not in (None, args.host_codec):
            raise UsageError("--storage-codec must be --host-codec's codec (or left out)")
    codec = args.host_codec or args.storage_codec
    which = "host" if args.host_codec else "storage"
    check_codec_dtype(codec or None, kv.dtype, f"--{which}-codec {codec}", UsageError, "--kv's ")
    _check_storage_flags(args, storage_kind)
    # From here Ctrl-C stops the replay between requests, and the figures,
    # the sweep's files and the storage's clean-up are still made.
    with StopOnCtrlC() as ctrl_c, _storage(args, storage_kind) as storage:
        if ctrl_c.stop:  # while the storage started: nothing replayed yet
            raise KeyboardInterrupt
        try:
            return _replays(
                args, requests, name, block, page, kv, capacity, host_tokens, storage, ctrl_c
            )
        except StorageUnavailable as e:
            raise UsageError(f"--storage {storage_kind}: {e}") from None


def _check_storage_flags(args, kind: str) -> None:
    """A storage flag that the chosen storage would ignore is a mistake."""
    only = {
        "--storage-dir": ("file", args.storage_dir),
        "--storage-max-mib": ("file", args.storage_max_mib),
        "--storage-codec": ("file", args.storage_codec),
        "--mooncake-master": ("mooncake", args.mooncake_master),
        "--mooncake-metadata": ("mooncake", args.mooncake_metadata),
        "--mooncake-segment-mib": ("mooncake", args.mooncake_segment_mib),
        "--prefetch-policy": (None, args.prefetch_policy),
    }
    for flag, (needs, value) in only.items():
        if value is None or (needs or kind) == kind and kind != "none":
            continue
        raise UsageError(f"{flag} needs --storage {needs or 'file or mooncake'}")
    if args.storage_dir == "":
        raise UsageError("--storage-dir is empty")
    if args.mooncake_metadata and not args.mooncake_master:
        raise UsageError(
            "--mooncake-metadata goes with --mooncake-master (without it, a local "
            "master is started with its own metadata server)"
        )


@contextlib.contextmanager
def _storage(args, kind: str):
    """The storage tier's configuration; a temporary directory or a local
    Mooncake master live for the run and go with it."""
    if kind == "none":
        yield None
        return
    policy = args.prefetch_policy or "wait_complete"  # deterministic
    segment = (args.mooncake_segment_mib or 256) << 20
    if kind == "mooncake":
        print(
            "note: Mooncake's transfer engine listens on every interface while the replay "
            "runs (no Mooncake setting binds it to 127.0.0.1; docs/reliability.md)",
            file=sys.stderr,
        )
    if kind == "file":
        bound = None if args.storage_max_mib is None else args.storage_max_mib << 20
        codec = args.storage_codec or args.host_codec
        if args.storage_dir:
            if os.path.exists(args.storage_dir) and not os.path.isdir(args.storage_dir):
                raise UsageError(f"--storage-dir {args.storage_dir} is not a directory")
            # (The store makes the directory, with its own mode.)
            yield StorageConfig(
                "file",
                directory=args.storage_dir,
                max_bytes=bound,
                codec=codec,
                prefetch_policy=policy,
            )
        else:
            with tempfile.TemporaryDirectory(
                prefix="radixkv-store.", ignore_cleanup_errors=True
            ) as d:
                yield StorageConfig(
                    "file", directory=d, max_bytes=bound, codec=codec, prefetch_policy=policy
                )
        return
    if args.mooncake_master:
        host = args.mooncake_master.rsplit(":", 1)[0]
        yield StorageConfig(
            "mooncake",
            master_address=args.mooncake_master,
            metadata_server=args.mooncake_metadata or f"http://{host}:8080/metadata",
            segment_bytes=segment,
            prefetch_policy=policy,
            codec=args.host_codec,
        )
        return
    from radixkv.storage import MooncakeMaster

    try:
        master = MooncakeMaster()
    except RuntimeError as e:
        raise UsageError(f"--storage mooncake: {e}") from None
    with master:
        yield StorageConfig(
            "mooncake",
            master_address=master.master_address,
            metadata_server=master.metadata_server,
            segment_bytes=segment,
            prefetch_policy=policy,
            codec=args.host_codec,
        )


def _eviction_policies(args) -> List[str]:
    text = args.eviction_policy
    names = list(EVICTION_POLICIES) if text == "all" else [p.strip() for p in text.split(",")]
    for n in names:
        if n not in EVICTION_POLICIES:
            raise UsageError(
                f"--eviction-policy: {n!r} is not one of "
                f"{', '.join(EVICTION_POLICIES)} (or 'all')"
            )
    if len(names) > 1 and not args.sweep:
        raise UsageError("--eviction-policy: several policies are compared by --sweep")
    if names != ["lru"] and args.policy != "radix":
        raise UsageError("--eviction-policy needs --policy radix")
    if args.eviction_policy_config is not None:
        if "tlru" not in names:
            raise UsageError("--eviction-policy-config is tlru's: give --eviction-policy tlru")
        from radixkv.kvcache import tel_safe_tokens

        try:
            tel_safe_tokens("tlru", args.eviction_policy_config)
        except (TypeError, ValueError) as e:
            raise UsageError(f"--eviction-policy-config: {e}") from None
    return names


def _replays(
    args, requests, name, block, page, kv, capacity, host_tokens, storage, ctrl_c: StopOnCtrlC
) -> int:
    policies = _eviction_policies(args)
    common = dict(
        block_size=block,
        page_size=page,
        policy=args.policy,
        kv=kv,
        store=not args.no_store,
        progress=args.progress or sys.stderr.isatty(),
        write_policy=args.write_policy,
        instances=args.instances,
        overlap=args.overlap,
        eviction_policy_config=args.eviction_policy_config,
        retain_ttl_s=args.retain,
        host_codec=args.host_codec,
    )

    def host_pages_for(device_pages: int) -> int:
        # In a sweep the host tier keeps its ratio to the device pool.
        pages = -(-host_tokens // page)
        return pages if not args.sweep else pages * device_pages // max(1, capacity)

    def check(r: ReplayResult) -> None:
        if r.requests == 0 and not r.interrupted:
            raise UsageError(
                f"every request was skipped: the largest needs "
                f"{max(-(-(q.input_length + q.output_length) // page) for q in requests):,} pages "
                f"but the pool has {r.capacity_tokens // page:,}: raise --capacity-tokens"
            )

    if args.sweep:
        points: List[dict] = []
        planned = [(evict, k) for evict in policies for k in range(args.sweep)]
        for evict, k in planned:
            if ctrl_c.stop or (points and points[-1]["interrupted"]):
                break
            pages = max(1, capacity >> (args.sweep - 1 - k))
            # Each point starts from an empty store: its own namespace.
            point_storage = (
                dataclasses.replace(storage, namespace=f"sweep-{evict}-{k}")
                if storage is not None
                else None
            )
            r = replay(
                requests,
                capacity_pages=pages,
                host_pages=host_pages_for(pages),
                storage=point_storage,
                eviction_policy=evict,
                **common,
            )
            if r.interrupted and r.requests + r.skipped_requests == 0:
                break  # stopped before its first request: no point
            points.append(r.to_json())
            if not args.json:
                tiers = (
                    f" (device {100 * r.device_hit_tokens / max(1, r.input_tokens):.2f}%"
                    f" + host {100 * r.host_hit_tokens / max(1, r.input_tokens):.2f}%)"
                    if r.host_capacity_tokens
                    else ""
                )
                who = f"{evict:<9}" if len(policies) > 1 else ""
                print(
                    f"{who}capacity {r.capacity_tokens:>14,} tokens: hit rate "
                    f"{100 * r.token_hit_rate:6.2f}%{tiers}  evicted "
                    f"{r.evicted_tokens:,}  skipped {r.skipped_requests:,}  "
                    f"{r.wall_s:.2f} s"
                )
        json_path = os.path.join(args.out, "replay_sweep.json")
        _write_json(json_path, {"trace": name, "points": points})
        png = os.path.join(args.out, "replay_sweep.png")
        plotted = _plot(points, png, f"{name}: {args.policy}, page {page}")
        if args.json:
            print(json.dumps({"trace": name, "points": points}))
        else:
            print(f"wrote {json_path}" + (f" and {png}" if plotted else ""))
        if len(points) < len(planned) or points[-1]["interrupted"]:
            print(
                f"interrupted: the sweep covers {len(points)} of {len(planned)} points"
                + (", the last one partial" if points and points[-1]["interrupted"] else ""),
                file=sys.stderr,
            )
            return INTERRUPTED
        bad = sum(p["kv_mismatches"] for p in points)
        if bad:
            print(
                f"error: {bad:,} tokens loaded back from host differ from the K/V stored "
                "for them",
                file=sys.stderr,
            )
            return 1
        return 0

    r = replay(
        requests,
        capacity_pages=capacity,
        host_pages=host_pages_for(capacity),
        storage=storage,
        eviction_policy=policies[0],
        **common,
    )
    check(r)
    out = r.to_json()
    out["trace"] = name
    if args.json:
        print(json.dumps(out))
    else:
        print(f"replay of {name}")
        print(_table(r, kv))
    if r.interrupted:
        print(
            f"interrupted: the figures cover the first {r.requests + r.skipped_requests:,} "
            f"of {len(requests):,} requests",
            file=sys.stderr,
        )
        return INTERRUPTED
    if r.kv_mismatches:
        print(
            f"error: {r.kv_mismatches:,} tokens loaded back from host differ from the K/V "
            "stored for them",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: Optional[List[str]] = None, prog: str = "radixkv replay") -> int:
    try:
        args = build_parser(prog).parse_args(argv)
        return _run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside a replay (loading the trace, say)
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
