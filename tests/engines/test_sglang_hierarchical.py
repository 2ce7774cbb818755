"""radixkv's whole cache inside a real SGLang 0.5.23 server:
`--radix-cache-backend radixkv --enable-hierarchical-cache`, against SGLang's
own HiCache (on the CPU with the tests' shims) and SGLang without one.

- The seeded chat with a device pool smaller than its working set and a host
  tier twice as large: outputs token for token those of SGLang's own caches
  (float32), cached tokens at least HiCache's and above SGLang without a host
  tier, host hits in SGLang's per-request split and in radixkv's figures at
  SGLang's /metrics, KV events of both tiers through --kv-events-config.
- The public conversation trace through the same servers: the hit rate within
  a point of `radixkv replay` on the same requests and sizes, and at least
  HiCache's.
- radixkv's file store as L3: two servers on one store share pages, a server
  started again on it is served from it, and (that server) many
  conversations in flight with SGLang's forced retraction; the three run the
  three write policies.
- radixkv's config: a quota on a flooding extra_key keeps another tenant's
  hits; float8 host pages give more host hits in the same host memory.
Every server runs SGLang's idle leak check, logs no error and exits cleanly."""

import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from engine_env import (
    CHAT_MAX_TOTAL_TOKENS,
    Workload,
    free_port,
    generate_detailed,
    server_problems,
    sglang_server,
)
from trace_sample import sample, tokens, trace_path, write_scaled

MAX_TOTAL_TOKENS = CHAT_MAX_TOTAL_TOKENS  # the chat's pool: eviction happens
PAGE = 4
TRACE_BLOCK = 16  # each 512-token block of the trace as 16 tokens
TRACE_OUTPUT = 4
# SGLang's HiCache on the CPU: its direct copies, layer_first (the shims).
THEIR_HICACHE = [
    "--enable-hierarchical-cache",
    "--hicache-ratio",
    "2",
    "--hicache-io-backend",
    "direct",
    "--hicache-mem-layout",
    "layer_first",
]
OUR_HICACHE = [
    "--enable-hierarchical-cache",
    "--hicache-ratio",
    "2",
    "--hicache-mem-layout",
    "page_first",
]


@pytest.fixture(scope="module")
def python(sglang_python):
    return sglang_python


@pytest.fixture(scope="module")
def model(sglang_model):
    return sglang_model


def serve(python, model, log_path, backend, extra_args, env=None):
    return sglang_server(python, model, log_path, backend, MAX_TOTAL_TOKENS, PAGE, extra_args, env)


def chat(server):
    """The chat workload's turns (with SGLang's split of each hit by tier)."""
    return Workload().run(lambda ids, extras: generate_detailed(server, ids, extras))


def replay_trace(server, requests):
    """The sampled trace, one request after another: (cached, prompt tokens)."""
    cached = asked = 0
    for r in requests:
        ids = tokens(r["hash_ids"], TRACE_BLOCK)
        _, hit, _ = generate_detailed(server, ids, {}, TRACE_OUTPUT)
        cached += hit
        asked += len(ids)
    return cached, asked


def idle_then_stop(server):
    """SGLang checks its pools for leaked slots when idle (raising on a
    leak); one more request shows it still serves; then SIGTERM."""
    time.sleep(3)
    generate_detailed(server, [5, 6, 7, 8], {})
    return server.stop()


@pytest.fixture(scope="module")
def trace_requests(tmp_path_factory):
    requests = sample(trace_path())
    out = str(tmp_path_factory.mktemp("trace") / "scaled.jsonl")
    write_scaled(requests, out, TRACE_BLOCK, TRACE_OUTPUT)
    return requests, out


class Events:
    """A subscriber to the server's --kv-events-config endpoint: radixkv's
    EventIndex, polled on a thread."""

    def __init__(self, endpoint, replay):
        from radixkv.event_index import EventIndex

        self.index = EventIndex(endpoint, replay)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stopped.is_set():
            self.index.poll(100)

    def close(self):
        self.stopped.set()
        self.thread.join()
        view = {medium: len(blocks) for medium, blocks in self.index.view().items()}
        self.index.close()
        return view


@pytest.fixture(scope="module")
def runs(python, model, tmp_path_factory, trace_requests, sglang_own_chat):
    """Each cache's chat and trace: radixkv's hierarchical cache (with KV
    events and metrics on), SGLang's own HiCache, SGLang without one (the
    chat only, shared with test_sglang.py)."""
    pytest.importorskip("zmq")
    requests, _ = trace_requests
    logs = tmp_path_factory.mktemp("logs")
    out = {}
    for name, backend, args in (
        ("radixkv", "radixkv", OUR_HICACHE),
        ("hicache", None, THEIR_HICACHE),
    ):
        extra = list(args)
        events = None
        if name == "radixkv":
            pub, replay = free_port(), free_port()
            config = {
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{pub}",
                "bind": True,
                "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            }
            extra += ["--kv-events-config", json.dumps(config), "--enable-metrics"]
        server = serve(python, model, str(logs / f"{name}.log"), backend, extra)
        try:
            if name == "radixkv":
                events = Events(config["endpoint"], config["replay_endpoint"])
            turns = chat(server)
            time.sleep(2)  # radixkv writes its figures at most once a second
            metrics = server.get_text("/metrics") if name == "radixkv" else ""
            view = events.close() if events is not None else None
            events = None
            server.post("/flush_cache?timeout=60", {})
            trace = replay_trace(server, requests)
            code = idle_then_stop(server)
        finally:
            if events is not None:
                events.close()
            server.stop()
        out[name] = dict(turns=turns, trace=trace, log=server.log(), code=code, metrics=metrics)
        out[name]["events"] = view
    out["plain"] = sglang_own_chat(PAGE)
    return out


def test_radixkvs_host_tier_serves_the_chat_as_sglangs_caches_do(runs):
    ours, hicache, plain = runs["radixkv"], runs["hicache"], runs["plain"]
    assert "Tree cache initialized: source=registered('radixkv')" in ours["log"]
    assert len(ours["turns"]) == len(hicache["turns"]) == len(plain["turns"])
    for a, b, c in zip(ours["turns"], hicache["turns"], plain["turns"]):
        assert a.output_ids == b.output_ids == c.output_ids  # greedy, float32: token for token
    cached = [sum(t.cached_tokens for t in run["turns"]) for run in (ours, hicache, plain)]
    assert cached[0] >= cached[1] and cached[0] > cached[2], cached
    host_hits = sum(t.details.get("host", 0) for t in ours["turns"])
    assert host_hits > 0  # loaded back from radixkv's host tier
    # radixkv's own figures, in SGLang's /metrics.
    figures = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in ours["metrics"].splitlines()
        if line.startswith("radixkv_") and "{" in line
    }
    assert figures["radixkv_host_hit_tokens_total"] > 0
    assert figures["radixkv_loaded_back_tokens_total"] >= host_hits
    # KV events of both tiers from radixkv's publisher.
    assert ours["events"]["GPU"] > 0 and ours["events"]["CPU_PINNED"] > 0
    for run in runs.values():
        assert server_problems(run["log"]) == []
        assert run["code"] == 0


def test_the_public_trace_hits_as_the_offline_replay_and_at_least_hicache(runs, trace_requests):
    _, path = trace_requests
    (ours, asked), (theirs, asked_theirs) = runs["radixkv"]["trace"], runs["hicache"]["trace"]
    assert asked == asked_theirs
    replay = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixkv",
            "replay",
            path,
            "--block-size",
            str(TRACE_BLOCK),
            "--page-size",
            str(PAGE),
            "--capacity-tokens",
            str(MAX_TOTAL_TOKENS),
            "--host-capacity-tokens",
            str(2 * MAX_TOTAL_TOKENS),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert replay.returncode == 0, replay.stderr
    offline = json.loads(replay.stdout)["token_hit_rate"]
    rate = ours / asked
    print(
        f"trace hit rate: server {rate:.4f}, offline replay {offline:.4f}, "
        f"HiCache {theirs / asked:.4f} ({asked} tokens asked)"
    )
    assert abs(rate - offline) <= 0.01, (rate, offline)
    assert ours >= theirs, (ours, theirs)


def test_a_store_is_shared_by_servers_and_serves_one_started_again(python, model, tmp_path):
    store = tmp_path / "store"
    args = OUR_HICACHE + [
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-prefetch-policy",
        "wait_complete",
        "--hicache-storage-backend-extra-config",
        json.dumps({"directory": str(store), "prefetch_threshold": 16}),
    ]
    a = serve(python, model, str(tmp_path / "a.log"), "radixkv", args)
    b = None
    try:
        first = chat(a)
        # A second server on the same store, while the first serves (and
        # backing up to host only what it evicts).
        write_back = args + ["--hicache-write-policy", "write_back"]
        b = serve(python, model, str(tmp_path / "b.log"), "radixkv", write_back)
        second = chat(b)
        codes = [idle_then_stop(a), idle_then_stop(b)]
    finally:
        a.stop()
        if b is not None:
            b.stop()
    assert [t.output_ids for t in first] == [t.output_ids for t in second]
    shared = sum(t.details.get("storage", 0) for t in second)
    assert shared > 0
    assert sum(t.cached_tokens for t in second) > sum(t.cached_tokens for t in first)
    # One more started on the store after both stopped: served from it, with
    # conversations in flight together and SGLang retracting some of them.
    selective = args + ["--hicache-write-policy", "write_through_selective"]
    c = serve(
        python, model, str(tmp_path / "c.log"), "radixkv", selective, {"SGLANG_TEST_RETRACT": "1"}
    )
    try:
        again = [generate_detailed(c, ids, {}) for ids in _first_prompts(2)]
        answers = _conversations_in_flight(c, 8)
        codes.append(idle_then_stop(c))
    finally:
        c.stop()
    assert sum(t[2].get("storage", 0) for t in again) > 0
    assert answers == 8 * 4
    assert "Retract requests" in c.log() or "Testing retraction" in c.log()
    for server in (a, b, c):
        assert server_problems(server.log()) == []
    assert codes == [0, 0, 0]


def _first_prompts(n):
    """The chat's first `n` prompts (the first turns of its first
    conversations, in the default namespace: the workload is seeded and
    draws no word from an answer)."""
    prompts = []

    def record(ids, extras):
        prompts.append(ids)
        return [], 0

    Workload().run(record)
    return prompts[:n]


def _conversations_in_flight(server, n):
    answered = []

    def conversation(c):
        rng = random.Random(c)
        ids = [rng.randrange(3, 1000) for _ in range(100 + 20 * (c % 3))]
        for _ in range(4):
            ids += [rng.randrange(3, 1000) for _ in range(30)]
            out, _, _ = generate_detailed(server, ids, {}, max_new_tokens=48)
            answered.append(len(out))
            ids += out

    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(answered)


def _flood(server):
    """A tenant flooding the server with new prompts between another
    tenant's two recurring ones: the other tenant's hit rate."""
    rng = random.Random(1)
    victim = [[rng.randrange(3, 1000) for _ in range(160)] for _ in range(2)]
    hits = asked = 0
    for r in range(12):
        for _ in range(8):
            flood = [rng.randrange(3, 1000) for _ in range(240)]
            generate_detailed(server, flood, {"extra_key": "flood"}, 4)
        _, cached, _ = generate_detailed(server, victim[r % 2], {"extra_key": "victim"}, 4)
        if r >= 2:
            hits += cached
            asked += len(victim[r % 2]) - 1
    return hits / asked


def _random_revisits(server):
    """16 prompts asked in a seeded random order: the host tier's hits."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(200)] for _ in range(16)]
    host = 0
    for _ in range(48):
        _, _, details = generate_detailed(server, prompts[rng.randrange(16)], {}, 4)
        host += details.get("host", 0)
    return host


def test_radixkvs_config_quota_and_float8_host_pages(python, model, tmp_path):
    # 1.5x: a plain host pool a little larger than the device pool.
    args = [
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "1.5",
        "--hicache-mem-layout",
        "page_first",
    ]
    results, servers = {}, []
    for name, config in (
        ("plain", {}),
        ("quota", {"quotas": [{"extra_key": "flood", "device_tokens": 256, "host_tokens": 512}]}),
        ("float8", {"host_codec": "float8"}),
    ):
        env = {"RADIXKV_SGLANG_CONFIG": json.dumps(config)}
        server = serve(python, model, str(tmp_path / f"{name}.log"), "radixkv", args, env)
        servers.append(server)
        try:
            if name != "float8":
                results[f"{name} victim"] = _flood(server)
                server.post("/flush_cache?timeout=60", {})
            if name != "quota":
                results[f"{name} host"] = _random_revisits(server)
            results[f"{name} code"] = idle_then_stop(server)
        finally:
            server.stop()
    print("quota and float8:", results)
    assert results["plain victim"] < 0.5 < results["quota victim"], results
    assert results["float8 host"] >= 2 * results["plain host"] > 0, results
    for server in servers:
        assert server_problems(server.log()) == []
    assert [results[f"{n} code"] for n in ("plain", "quota", "float8")] == [0, 0, 0]


def test_what_radixkv_cannot_serve_is_refused_by_name(python):
    script = r"""
import json, os
from types import SimpleNamespace
from radixkv.compat.sglang.plugin import build
params = SimpleNamespace(is_eagle=False, enable_kv_cache_events=False, pp_size=1, attn_cp_size=1)
base = dict(is_hybrid_swa=False, is_hybrid_ssm=False, is_dsa=False, enable_hierarchical_cache=True,
            disable_radix_cache=False, params=params, tp_size=2)
try:
    build(SimpleNamespace(**base))
except ValueError as e:
    assert "--tp-size 2 with --enable-hierarchical-cache" in str(e), e
else:
    raise AssertionError("tp 2 was not refused")
from radixkv.compat.sglang import config
os.environ[config.ENV] = json.dumps({"host_codec": "float8", "eviction": "slru"})
try:
    config.load_config()
except ValueError as e:
    assert "unknown key eviction" in str(e), e
else:
    raise AssertionError("an unknown key was accepted")
print("ok")
"""
    r = subprocess.run(
        [python, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"},
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
