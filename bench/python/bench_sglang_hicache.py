"""radixkv's hierarchical cache inside a real SGLang server against SGLang's
own HiCache, same run, rounds alternating: what the scheduler spends in the
cache per request, time to first token of a host hit against a recompute,
and requests per second.

    RADIXKV_SGLANG_VENV=... RADIXKV_TRACES=... \\
        python bench/python/bench_sglang_hicache.py [--rounds 3]

Both servers: SGLang 0.5.23 on the CPU, the tests' tiny float32 Llama, a
device pool of 1,024 tokens (pages of 4) and a host tier twice its memory
(`--enable-hierarchical-cache --hicache-ratio 2`; SGLang's own HiCache with
the tests' CPU shims, `--hicache-io-backend direct --hicache-mem-layout
layer_first`; radixkv's `page_first`), both with `--sleep-on-idle` (without
it, `--spin-when-idle`, the scheduler busy-waits between requests and makes
its per-round calls as often as the idle time allows: a count set by the
client's pauses, not by the requests). Each round, on each server:
- cache CPU: the scheduler thread's CPU time inside the prefix cache's calls
  (match, load back, the per-round acknowledgements, checkpoints, eviction,
  locks, ...; the tests' `_cache_timer` plug-in wraps each call the
  scheduler makes, counting a call made inside another once, and what the
  timing adds to a call, measured on an empty call in the same process, is
  taken off), per request, over the chat workload then the sampled public
  trace (tests/engines), idle rounds of the scheduler included; and apart,
  the calls SGLang makes every round, work or none (check_hicache_events,
  evictable_size, protected_size, flush_pending_backups), per round;
- TTFT: a one-token request for a fresh 400-token prompt (a miss), the same
  again (a device hit), then after three other prompts pushed it off the
  device (a host hit: loaded back from the host tier); medians of 5;
- requests per second over the chat workload (8 conversations x 4 turns).
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "engines"))
from engine_env import Workload, build_model, generate_detailed, sglang_server  # noqa: E402
from trace_sample import sample, tokens, trace_path  # noqa: E402

POOL = 1024
PAGE = 4
SERVERS = {
    "hicache": (
        None,
        [
            "--enable-hierarchical-cache",
            "--hicache-ratio",
            "2",
            "--hicache-io-backend",
            "direct",
            "--hicache-mem-layout",
            "layer_first",
        ],
    ),
    "radixkv": (
        "radixkv",
        [
            "--enable-hierarchical-cache",
            "--hicache-ratio",
            "2",
            "--hicache-mem-layout",
            "page_first",
        ],
    ),
}


def ttft(server, ids):
    t0 = time.perf_counter()
    _, cached, details = generate_detailed(server, ids, {}, 1)
    return time.perf_counter() - t0, cached, details


def measure_ttft(server, samples: int, seed: int):
    rng = random.Random(seed)
    miss, device, host = [], [], []
    for _ in range(samples):
        server.post("/flush_cache", {})
        ids = [rng.randrange(3, 1000) for _ in range(400)]
        t, cached, _ = ttft(server, ids)
        assert cached == 0
        miss.append(t)
        t, cached, details = ttft(server, ids)
        assert details.get("device", 0) >= 396, details
        device.append(t)
        for _ in range(3):
            generate_detailed(server, [rng.randrange(3, 1000) for _ in range(400)], {}, 1)
        t, cached, details = ttft(server, ids)
        assert details.get("host", 0) >= 396, details
        host.append(t)
    return statistics.median(miss), statistics.median(device), statistics.median(host)


def cache_cpu(server, timer: str, requests) -> tuple:
    """(cache CPU seconds per request, requests, {call: seconds per request},
    CPU seconds of the calls SGLang makes every scheduler round, per round)
    over the chat and the trace."""
    server.post("/flush_cache", {})
    before = _read(timer)
    n = len(Workload().run(lambda ids, extras: generate_detailed(server, ids, extras)))
    for r in requests:
        generate_detailed(server, tokens(r["hash_ids"], 16), {}, 4)
        n += 1
    time.sleep(1.5)
    generate_detailed(server, [5, 6, 7, 8], {}, 1)  # a call after the second: the file is current
    after = _read(timer)
    spent = {k: (after[k][1] - before.get(k, (0, 0.0))[1]) / n for k in after}
    rounds = (
        after.get("check_hicache_events", (0, 0.0))[0]
        - before.get("check_hicache_events", (0, 0.0))[0]
    )
    per_round = sum(spent.get(k, 0.0) for k in ROUND_CALLS) * n / max(rounds, 1)
    return spent.pop("all"), n, spent, per_round


# What SGLang's scheduler calls on the cache every round, work or none.
ROUND_CALLS = ("check_hicache_events", "evictable_size", "protected_size", "flush_pending_backups")


def _read(path: str) -> dict:
    """{call: (calls, CPU seconds)} so far (the outermost calls under
    "all"), less what timing them added."""
    try:
        with open(path) as f:
            totals = json.load(f)
    except (OSError, ValueError):
        return {"all": (0, 0.0)}
    overhead = totals.pop("overhead", (0, 0.0))[1]
    totals.setdefault("all", (0, 0.0))
    return {k: (c, s - c * overhead) for k, (c, s) in totals.items()}


def requests_per_second(server, seed: int) -> float:
    server.post("/flush_cache", {})
    work = Workload(seed=seed, conversations=8, turns=4)
    t0 = time.perf_counter()
    turns = work.run(lambda ids, extras: generate_detailed(server, ids, extras))
    return len(turns) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument(
        "--spin-when-idle",
        action="store_true",
        help="leave out --sleep-on-idle: the scheduler then busy-waits between "
        "requests, making its per-round calls as often as idle time allows",
    )
    args = ap.parse_args()
    venv = os.environ.get("RADIXKV_SGLANG_VENV")
    if not venv:
        sys.exit("set RADIXKV_SGLANG_VENV to the sglang venv (bash .ci/engines prints it)")
    python = os.path.join(venv, "bin", "python")
    tmp = tempfile.mkdtemp(prefix="bench-sglang-hicache-")
    model = build_model(python, os.path.join(tmp, "model"))
    requests = sample(trace_path())
    rows = {name: [] for name in SERVERS}
    breakdown = {name: [] for name in SERVERS}
    for r in range(args.rounds):
        for name, (backend, extra) in SERVERS.items():
            timer = os.path.join(tmp, f"{name}-{r}.timer.json")
            log = os.path.join(tmp, f"{name}-{r}.log")
            env = {"RADIXKV_CACHE_TIMER": timer}
            flags = extra if args.spin_when_idle else [*extra, "--sleep-on-idle"]
            server = sglang_server(python, model, log, backend, POOL, PAGE, flags, env)
            try:
                generate_detailed(server, [5, 6, 7], {}, 1)  # warm
                cpu, n, calls, per_round = cache_cpu(server, timer, requests)
                miss, device, host = measure_ttft(server, args.samples, seed=r)
                rps = requests_per_second(server, seed=r)
                rows[name].append((cpu, miss, device, host, rps, per_round))
                breakdown[name].append(calls)
            finally:
                server.stop()
    idle = "busy-waits when idle" if args.spin_when_idle else "--sleep-on-idle"
    print(
        f"SGLang 0.5.23 on CPU ({idle}), tiny float32 Llama, device {POOL} tokens, host 2x; "
        f"{args.rounds} rounds (medians over rounds); cache CPU over {n} requests"
    )
    print(
        f"{'cache':10}{'cache CPU us/req':>18}{'us/round':>10}{'TTFT miss ms':>14}"
        f"{'device hit':>12}{'host hit':>10}{'req/s':>8}"
    )
    med = {}
    for name, got in rows.items():
        cols = [statistics.median(c) for c in zip(*got)]
        med[name] = cols
        cpu, miss, device, host, rps, per_round = cols
        print(
            f"{name:10}{cpu * 1e6:18.1f}{per_round * 1e6:10.2f}{miss * 1e3:14.2f}"
            f"{device * 1e3:12.2f}{host * 1e3:10.2f}{rps:8.1f}"
        )
    a, b = med["hicache"], med["radixkv"]
    print(
        f"radixkv / hicache: cache CPU {b[0] / a[0]:.3f} ({a[0] / b[0]:.1f}x less; the calls "
        f"made every round {a[5] / b[5]:.1f}x less), host hit TTFT {b[3] / a[3]:.2f}, "
        f"req/s {b[4] / a[4]:.2f}; radixkv host hit / its miss {b[3] / b[1]:.2f}"
    )
    print("where the cache CPU goes, us per request (medians over rounds):")
    for name, got in breakdown.items():
        keys = sorted(got[0], key=lambda k: -statistics.median(g.get(k, 0.0) for g in got))
        parts = [f"{k} {statistics.median(g.get(k, 0.0) for g in got) * 1e6:.0f}" for k in keys]
        print(f"  {name}: " + ", ".join(parts[:8]))


if __name__ == "__main__":
    main()
