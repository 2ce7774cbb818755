"""The replay's hit rate: the exact optimum when unbounded, exact LRU when not."""

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from reference import ReferenceRadixCache
from radixkv.replay import (
    Request,
    TokenMaker,
    chat_sessions,
    load_mooncake,
    optimal_hit_tokens,
    pages_for_all,
    replay,
)
from radixkv.replay.traces import max_hash_id

# The replay's progress bar (tqdm) as it shows on stderr: "replay:  42%|████▏     | 3360/8000 ...".
BAR = re.compile(r"replay: +\d+%\|")


def _mooncake_trace():
    """(path, None) of the Mooncake FAST'25 conversation trace in the directory
    RADIXKV_TRACES names, or (None, why the tests that need it skip)."""
    where = (
        "the Mooncake FAST'25 traces are public at github.com/kvcache-ai/Mooncake "
        "under FAST25-release/traces"
    )
    directory = os.environ.get("RADIXKV_TRACES")
    if not directory:
        return None, f"RADIXKV_TRACES is not set: {where}; set it to their directory"
    for name in ("mooncake_fast25_conversation_trace.jsonl", "conversation_trace.jsonl"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path, None
    return None, (f"RADIXKV_TRACES={directory} holds no conversation_trace.jsonl: {where}")


TRACE, NO_TRACE = _mooncake_trace()
needs_trace = pytest.mark.skipif(TRACE is None, reason=NO_TRACE or "")


def _reference_replay(requests, block, page, capacity_pages):
    """The replay's request flow over the pure-Python reference cache and a
    plain free-page list: (hit tokens, evicted tokens)."""
    cache = ReferenceRadixCache(page)
    tokens = TokenMaker(block, max_hash_id(requests))
    free = list(range(capacity_pages))

    def take(n):
        pages = -(-n // page)
        missing = pages - len(free)
        evicted = 0
        if missing > 0:
            out = cache.evict(missing * page)
            evicted = len(out)
            free.extend(s // page for s in out[::page])
        got = [free.pop() for _ in range(pages)]
        return [p * page + j for p in got for j in range(page)], evicted

    hit_total = evicted_total = 0
    for r in requests:
        ids = tokens.prompt(r).tolist()
        handle, cached = cache.match_prefix(ids[:-1])
        cache.lock_handle(handle)
        hit = handle.cached_len
        own, ev1 = take(r.input_length - hit)
        spare = len(own) - (r.input_length - hit)
        ev2 = 0
        if r.output_length > spare:
            more, ev2 = take(r.output_length - spare)
            own += more
        full = ids + tokens.output(r.output_length).tolist()
        indices = cached + own
        n = len(full)
        in_cache = cache.insert_prefix(full, indices[:n])
        for s in indices[hit:in_cache:page] + indices[n - n % page :: page]:
            free.append(s // page)
        cache.lock_handle(handle, unlock=True)
        hit_total += hit
        evicted_total += ev1 + ev2
    return hit_total, evicted_total


@pytest.mark.parametrize("block,page", [(16, 16), (8, 8), (8, 4), (4, 1)])
def test_unbounded_capacity_reaches_the_optimum(block, page):
    requests = chat_sessions(120, block, seed=block + page)
    r = replay(requests, block_size=block, page_size=page, store=False)
    assert r.evicted_tokens == 0
    if page == block:
        assert r.hit_tokens == optimal_hit_tokens(requests, block)
    else:
        # Smaller pages can only match more of each block, never less.
        assert r.hit_tokens >= optimal_hit_tokens(requests, block)
    assert r.hit_tokens > 0 and r.requests == len(requests)


@pytest.mark.parametrize("block,page,fraction", [(16, 16, 8), (16, 16, 32), (8, 4, 16), (4, 1, 64)])
def test_finite_capacity_follows_exact_lru(block, page, fraction):
    requests = chat_sessions(30, block, seed=fraction)
    capacity = max(
        pages_for_all(requests, page) // fraction,
        max(-(-(r.input_length + r.output_length) // page) for r in requests),
    )
    r = replay(requests, block_size=block, page_size=page, capacity_pages=capacity, store=False)
    assert r.evicted_tokens > 0, "the capacity should force evictions"
    assert (r.hit_tokens, r.evicted_tokens) == _reference_replay(requests, block, page, capacity)


def test_naive_policy_never_hits():
    requests = chat_sessions(40, 16, seed=3)
    r = replay(requests, block_size=16, page_size=16, policy="naive", store=False)
    assert r.hit_tokens == 0 and r.computed_tokens == r.input_tokens


def test_requests_larger_than_the_pool_are_skipped():
    requests = chat_sessions(20, 16, seed=4)
    biggest = max(-(-(r.input_length + r.output_length) // 16) for r in requests)
    r = replay(requests, block_size=16, page_size=16, capacity_pages=biggest - 1, store=False)
    assert r.skipped_requests >= 1
    assert r.requests + r.skipped_requests == len(requests)


def test_store_writes_the_computed_tokens():
    requests = chat_sessions(20, 16, seed=5)
    r = replay(requests, block_size=16, page_size=16, store=True)
    assert r.stored_tokens == r.computed_tokens + r.output_tokens


@needs_trace
def test_mooncake_prefix_reaches_the_optimum():
    requests = load_mooncake(TRACE)[:1500]
    r = replay(requests, block_size=512, page_size=512, store=False)
    assert r.hit_tokens == optimal_hit_tokens(requests, 512)
    assert 0 < r.token_hit_rate < 1


def test_cli_json_and_sweep(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "radixkv", "replay", "--sessions", "30", "--no-store", "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    report = json.loads(out.stdout)
    for key in (
        "requests",
        "input_tokens",
        "hit_tokens",
        "token_hit_rate",
        "evicted_tokens",
        "wall_s",
        "requests_per_s",
        "latency_us",
    ):
        assert key in report
    assert report["hit_tokens"] == report["optimal_hit_tokens"]
    for op in ("match", "allocate", "insert", "evict"):
        assert op in report["latency_us"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "radixkv",
            "replay",
            "--sessions",
            "30",
            "--no-store",
            "--sweep",
            "3",
            "--out",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    sweep = json.loads((tmp_path / "replay_sweep.json").read_text())
    rates = [p["token_hit_rate"] for p in sweep["points"]]
    assert len(rates) == 3 and rates[-1] >= rates[0]
    assert (tmp_path / "replay_sweep.png").stat().st_size > 1000


def run_cli(*args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "radixkv", *args], capture_output=True, text=True, **kwargs
    )


def one_error_line(result, *words):
    """A user mistake: exit 2, no traceback, one `error:` line naming `words`."""
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_cli_rejects_bad_arguments():
    one_error_line(run_cli("replay", "--kv", "1,x,8"), "--kv")


@pytest.mark.parametrize(
    "args,words",
    [
        (["--page-size", "0"], ["--page-size", ">= 1"]),
        (["--block-size", "0"], ["--block-size"]),
        (["--limit", "-5"], ["--limit"]),
        (["--sweep", "0"], ["--sweep"]),
        (["--capacity-tokens", "0"], ["--capacity-tokens"]),
        (["--sessions", "x"], ["--sessions"]),
        (["--kv", "1,1,8,int8"], ["--kv", "int8"]),
        (["--kv", "1,1,8,nonsense"], ["--kv"]),
        (["--capacity-pages", "1", "--no-store"], ["every request was skipped"]),
        (["--host-codec", "float8", "--kv", "1,1,8,float8_e4m3fn"], ["--host-codec", "--kv"]),
        (["--storage-codec", "float8", "--kv", "1,1,8,float8_e4m3fn"], ["--storage-codec"]),
        (["--host-codec", "float8", "--no-store"], ["--host-codec", "--no-store"]),
        (["--host-codec", "float8", "--storage-codec", "fp4"], ["--storage-codec"]),
    ],
)
def test_cli_user_mistakes_get_one_error_line(args, words):
    one_error_line(run_cli("replay", "--sessions", "5", *args), *words)


def test_cli_trace_file_mistakes_name_the_file_and_line(tmp_path):
    one_error_line(run_cli("replay", str(tmp_path / "missing.jsonl")), "missing.jsonl")
    one_error_line(run_cli("replay", str(tmp_path)), "directory")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_len'
    )  # cut off mid-line
    one_error_line(run_cli("replay", str(bad)), "bad.jsonl:2")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    one_error_line(run_cli("replay", str(binary)), "binary.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    one_error_line(run_cli("replay", str(empty)), "no requests")


@pytest.mark.parametrize("line", ["[1, 2, 3]", '"x"', "null", "42"])
def test_cli_trace_line_that_is_json_but_not_an_object_names_the_line(tmp_path, line):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n' + line + "\n"
    )
    one_error_line(run_cli("replay", str(trace)), "t.jsonl:2", "JSON object")


def test_cli_unknown_command_gets_one_error_line():
    one_error_line(run_cli("repaly"), "repaly", "replay")
    one_error_line(run_cli("--bogus"), "--bogus")
    assert run_cli("--help").returncode == run_cli().returncode == 0


def test_cli_sweep_checks_out_before_replaying(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = run_cli("replay", "--sweep", "3", "--out", str(blocker / "sub"), "--progress")
    one_error_line(r, "--out")
    assert not BAR.search(r.stderr)  # refused before the first replay began


def test_cli_warns_when_the_block_size_disagrees(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": i, "input_length": 1000, "output_length": 4, "hash_ids": [3 * i, 3 * i + 1]}
        for i in range(20)
    ]  # 512-token blocks
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    r = run_cli("replay", str(trace), "--block-size", "256", "--no-store")
    assert r.returncode == 0
    assert "warning: --block-size 256 disagrees with the trace" in r.stderr
    assert "512" in r.stderr
    assert "warning" not in run_cli("replay", str(trace), "--no-store").stderr


def test_cli_optimum_is_over_the_requests_replayed(tmp_path):
    """With a pool too small for the long requests, the optimum shown is that of
    the requests actually replayed, never above 100% of their tokens."""
    r = json.loads(
        run_cli(
            "replay",
            "--sessions",
            "60",
            "--capacity-tokens",
            "400",
            "--no-store",
            "--json",
            check=True,
        ).stdout
    )
    assert r["skipped_requests"] > 0 and r["requests"] > 0
    assert r["optimal_hit_tokens"] <= r["input_tokens"]
    assert r["hit_tokens"] <= r["optimal_hit_tokens"]


def test_the_cold_bound_is_named_and_a_warm_store_says_so():
    """The table names the optimum for what it is, the hit rate of an
    unbounded cache starting empty, and a run above it (a store warm from an
    earlier run) says the bound is not its."""
    from radixkv.replay.cli import _cold_bound
    from radixkv.replay.core import ReplayResult

    pct = lambda x: f"{x}%"  # noqa: E731
    cold = ReplayResult("lru", 16, 1024, hit_tokens=80, optimal_hit_tokens=82)
    assert _cold_bound(cold, pct) == " (an unbounded cache starting empty: 82%)"
    warm = ReplayResult("lru", 16, 1024, hit_tokens=98, optimal_hit_tokens=82)
    assert "starting empty: 82%" in _cold_bound(warm, pct)
    assert "warm store" in _cold_bound(warm, pct)
    assert _cold_bound(ReplayResult("lru", 16, 1024, hit_tokens=5), pct) == ""


def wait_for_the_progress_bar(p, timeout=120):
    """Reads `p`'s stderr until the replay's progress bar shows (the replay
    has begun, past loading); returns what it read."""
    seen, deadline = b"", time.monotonic() + timeout
    fd = p.stderr.fileno()
    while not BAR.search(seen.decode(errors="replace")):
        assert time.monotonic() < deadline and p.poll() is None, seen
        if select.select([fd], [], [], 0.1)[0]:
            seen += os.read(fd, 1 << 16)
    return seen.decode()


def test_cli_progress_flag_shows_the_bar_in_a_log():
    """The bar shows once a replay has run a second, with the rate and the time left."""
    r = run_cli("replay", "--sessions", "8000", "--no-store", "--progress", check=True)
    assert BAR.search(r.stderr) and "token hit rate" in r.stdout
    last = [line for line in r.stderr.splitlines() if BAR.search(line)][-1]  # as close() drew it
    assert re.search(r"replay: 100%\|.*\| (\d+)/\1 \[.*req/s\]", last), last
    assert not BAR.search(run_cli("replay", "--sessions", "8000", "--no-store").stderr)


def test_cli_ctrl_c_prints_the_partial_result():
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixkv",
            "replay",
            "--sessions",
            "50000",
            "--no-store",
            "--capacity-tokens",
            "100000000",
            "--progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = wait_for_the_progress_bar(p)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    err = seen + err
    assert p.returncode == 130, err
    assert "token hit rate" in out and "Traceback" not in err
    assert "interrupted: the figures cover the first" in err


def test_version_flag():
    r = run_cli("--version", check=True)
    assert r.stdout.strip().startswith("radixkv ")


def test_default_trace_pool_is_sized_by_what_an_unbounded_cache_uses():
    requests = chat_sessions(60, 16, seed=9)
    r = replay(requests, block_size=16, page_size=16, store=False)
    assert 0 < r.peak_pages < pages_for_all(requests, 16)
    again = replay(requests, block_size=16, page_size=16, capacity_pages=r.peak_pages, store=True)
    assert again.evicted_tokens == 0 and again.hit_tokens == r.hit_tokens
    assert again.pool_bytes == r.peak_pages * 16 * 32  # 1 layer, 1 head of 8 fp16, K and V


def test_load_mooncake_names_the_bad_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": 5}\n'
    )
    with pytest.raises(ValueError, match=":2:"):
        load_mooncake(str(p))


def test_token_maker_materialises_blocks_and_fresh_tails():
    maker = TokenMaker(4, 10)
    assert maker.prompt(Request(0, 5, 1, [1, 2])).tolist() == [4, 5, 6, 7, 8]
    # A prompt longer than its blocks gets fresh tokens; outputs never repeat.
    tail = maker.prompt(Request(0, 6, 1, [1])).tolist()
    assert tail[:4] == [4, 5, 6, 7] and min(tail[4:]) >= 1 << 30
    assert set(maker.output(3).tolist()).isdisjoint(tail)


def test_cli_sweep_compares_eviction_policies(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixkv",
            "replay",
            "--sessions",
            "30",
            "--no-store",
            "--host-capacity-tokens",
            "0",
            "--sweep",
            "3",
            "--eviction-policy",
            "lru,lfu,mru",
            "--json",
            "--out",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    points = json.loads(out.stdout)["points"]
    assert [p["eviction_policy"] for p in points] == ["lru"] * 3 + ["lfu"] * 3 + ["mru"] * 3
    assert (tmp_path / "replay_sweep.png").stat().st_size > 1000
    assert all(0 < p["hit_tokens"] <= p["optimal_hit_tokens"] for p in points)
    assert points[0]["hit_tokens"] != points[6]["hit_tokens"]  # the policies differ


@pytest.mark.parametrize(
    "args,words",
    [
        (["--eviction-policy", "random"], ["--eviction-policy", "random"]),
        (["--eviction-policy", "lru,lfu"], ["--eviction-policy", "--sweep"]),
        (
            ["--eviction-policy", "lfu", "--policy", "naive", "--host-capacity-tokens", "0"],
            ["--eviction-policy", "radix"],
        ),
        (["--eviction-policy-config", '{"threshold": 5}'], ["--eviction-policy-config", "tlru"]),
        (["--eviction-policy", "tlru", "--eviction-policy-config", "[1]"], ["JSON object"]),
        (
            ["--eviction-policy", "tlru", "--eviction-policy-config", '{"xi": 1}'],
            ["--eviction-policy-config", "threshold"],
        ),
    ],
)
def test_cli_eviction_policy_mistakes(args, words):
    one_error_line(run_cli("replay", "--sessions", "5", "--no-store", *args), *words)


def test_cli_retain_keeps_sessions_and_says_what_it_claimed():
    base = ["replay", "--sessions", "120", "--no-store", "--storage", "none"]
    base += ["--host-capacity-tokens", "0", "--capacity-tokens", "8192", "--json"]
    plain = json.loads(run_cli(*base).stdout)
    kept = json.loads(run_cli(*base, "--retain", "60").stdout)
    assert plain["retain_ttl_s"] is None and plain["retain_claims"] == 0
    assert kept["retain_ttl_s"] == 60.0 and kept["retain_budget_tokens"] > 0
    assert kept["retain_claims"] > 0 and kept["retain_expired"] > 0
    assert kept["requests"] == plain["requests"]  # the budget admits every request
    assert kept["input_tokens"] == plain["input_tokens"]
    assert kept["hit_tokens"] != plain["hit_tokens"]


@pytest.mark.parametrize(
    "args,words",
    [
        (["--retain", "0"], ["--retain", "> 0"]),
        (["--retain", "x"], ["--retain", "seconds"]),
        (
            ["--retain", "5", "--policy", "naive", "--host-capacity-tokens", "0"],
            ["--retain", "radix"],
        ),
    ],
)
def test_cli_retain_mistakes(args, words):
    one_error_line(run_cli("replay", "--sessions", "5", "--no-store", *args), *words)


def test_cli_retain_needs_sessions(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 40, "output_length": 4, "hash_ids": [1]}\n')
    one_error_line(run_cli("replay", str(trace), "--no-store", "--retain", "5"), "sessions")


def test_cli_tlru_takes_its_config():
    base = ["replay", "--sessions", "60", "--no-store", "--storage", "none"]
    base += ["--host-capacity-tokens", "0", "--capacity-tokens", "4096", "--json"]
    lru = json.loads(run_cli(*base).stdout)
    plain = json.loads(run_cli(*base, "--eviction-policy", "tlru").stdout)
    tuned = json.loads(
        run_cli(
            *base,
            "--eviction-policy",
            "tlru",
            "--eviction-policy-config",
            '{"threshold": 64, "next_prompt_estimate": 16}',
        ).stdout
    )
    assert plain["hit_tokens"] == lru["hit_tokens"]  # no leaf is safe: lru's order
    assert tuned["eviction_policy"] == "tlru" and tuned["hit_tokens"] != lru["hit_tokens"]
