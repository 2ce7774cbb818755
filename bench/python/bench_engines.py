"""radixkv inside a real engine against the engine's own cache, same run:
time to first token on a prefix miss and on a prefix hit, and requests per
second on the tests' seeded multi-turn chat workload (tests/engines).

    RADIXKV_SGLANG_VENV=... python bench/python/bench_engines.py [--rounds 3]

The venv is the one .ci/engines builds (it prints its path). Servers are
started one at a time on 127.0.0.1 with the tiny float32 Llama; the two
caches alternate round by round so drift on a shared machine hits both.
TTFT is the latency of a one-token /generate (the prefill and one sample),
median of `--samples` requests: a miss is a fresh 1,000-token prompt, a hit
the same prompt again (999 tokens cached)."""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "engines"))
from engine_env import Server, Workload, build_model, free_port, generate  # noqa: E402


def sglang_server(python, model, log, backend):
    port = free_port()
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
           "--attention-backend", "torch_native", "--dtype", "float32",
           "--max-total-tokens", "16384", "--host", "127.0.0.1", "--port", str(port),
           "--random-seed", "0"]
    if backend:
        cmd += ["--radix-cache-backend", backend]
    return Server(cmd, log, {"SGLANG_USE_CPU_ENGINE": "1"}, port)


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
    return statistics.median(miss), statistics.median(hit), rps, \
        sum(t.cached_tokens for t in turns)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=15)
    args = ap.parse_args()
    venv = os.environ.get("RADIXKV_SGLANG_VENV")
    if not venv:
        sys.exit("set RADIXKV_SGLANG_VENV to the SGLang venv (bash .ci/engines prints it)")
    python = os.path.join(venv, "bin", "python")
    tmp = tempfile.mkdtemp(prefix="bench-engines-")
    model = build_model(python, os.path.join(tmp, "model"))
    results = {"sglang": [], "radixkv": []}
    for r in range(args.rounds):
        for name in ("sglang", "radixkv"):
            server = sglang_server(python, model, os.path.join(tmp, f"{name}-{r}.log"),
                                   None if name == "sglang" else "radixkv")
            try:
                results[name].append(measure(server, args.samples, seed=r))
            finally:
                server.stop()
    print(f"SGLang 0.5.23 on CPU, tiny float32 Llama, {args.rounds} rounds x "
          f"{args.samples} samples (medians of the per-round medians)")
    print(f"{'cache':10} {'TTFT miss ms':>13} {'TTFT hit ms':>12} {'req/s':>7} {'cached':>7}")
    med = {}
    for name, rows in results.items():
        miss, hit, rps, cached = (statistics.median(c) for c in zip(*rows))
        med[name] = (miss, hit, rps)
        print(f"{name:10} {miss * 1e3:13.2f} {hit * 1e3:12.2f} {rps:7.1f} {cached:7.0f}")
    s, k = med["sglang"], med["radixkv"]
    print(f"radixkv / sglang: miss {k[0] / s[0]:.2f}, hit {k[1] / s[1]:.2f}, "
          f"req/s {k[2] / s[2]:.2f}")


if __name__ == "__main__":
    main()
