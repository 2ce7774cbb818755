"""The replay through all tiers: with an unbounded store and `wait_complete`,
the rate over all tiers is the optimum however small device and host are, for
one instance and for several sharing file or Mooncake storage; every row read
back is checked (kv_mismatches)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from radixkv.replay import chat_sessions, load_mooncake, replay
from radixkv.replay.replay import StorageConfig
from radixkv.storage import MooncakeMaster

from test_replay import TRACE, needs_trace
from storage_env import needs_mooncake

BLOCK = 16


def small_tiers(requests):
    """A device pool as small as the largest request, a host pool twice that."""
    biggest = max(-(-(r.input_length + r.output_length) // BLOCK) for r in requests)
    return dict(capacity_pages=biggest, host_pages=2 * biggest)


def page_bytes(directory) -> int:
    """Bytes of the page files under `directory`."""
    return sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, names in os.walk(directory)
        for f in names
        if f.endswith(".page")
    )


def run(requests, storage, **kw):
    return replay(
        requests,
        block_size=BLOCK,
        page_size=BLOCK,
        storage=storage,
        **{**small_tiers(requests), **kw},
    )


@pytest.mark.parametrize("instances", [1, 2, 3])
def test_an_unbounded_file_store_reaches_the_optimum_from_small_tiers(tmp_path, instances):
    requests = chat_sessions(60, BLOCK, seed=instances)
    r = run(requests, StorageConfig("file", directory=str(tmp_path)), instances=instances)
    assert r.hit_tokens == r.optimal_hit_tokens
    assert r.kv_mismatches == 0 and r.storage_errors == 0 and r.failed_loads == 0
    assert r.storage_hit_tokens > 0  # the small tiers did lose pages, storage gave them back
    assert r.device_hit_tokens + r.host_hit_tokens + r.storage_hit_tokens == r.hit_tokens
    without = replay(
        requests, block_size=BLOCK, page_size=BLOCK, instances=1, **small_tiers(requests)
    )
    assert without.hit_tokens < r.hit_tokens
    if instances > 1:
        assert len(r.instances) == instances
        assert sum(i["requests"] for i in r.instances) == r.requests == len(requests)
        assert sum(i["hit_tokens"] for i in r.instances) == r.hit_tokens


def test_instances_are_deterministic_and_see_the_same_tokens(tmp_path):
    requests = chat_sessions(40, BLOCK, seed=7)
    a = run(requests, StorageConfig("file", directory=str(tmp_path / "a")), instances=2)
    b = run(requests, StorageConfig("file", directory=str(tmp_path / "b")), instances=2)
    keys = (
        "hit_tokens",
        "device_hit_tokens",
        "host_hit_tokens",
        "storage_hit_tokens",
        "storage_written_pages",
        "input_tokens",
        "stored_tokens",
    )
    assert [getattr(a, k) for k in keys] == [getattr(b, k) for k in keys]
    one = run(requests, StorageConfig("file", directory=str(tmp_path / "c")), instances=1)
    # The same tokens whichever instance serves a request: the store holds
    # the same pages.
    assert one.storage_written_pages == a.storage_written_pages
    assert one.hit_tokens == a.hit_tokens


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_overlapped_instances_stay_correct(tmp_path, policy):
    requests = chat_sessions(40, BLOCK, seed=8)
    r = run(
        requests,
        StorageConfig("file", directory=str(tmp_path), prefetch_policy=policy),
        instances=2,
        overlap=True,
    )
    assert r.kv_mismatches == 0 and r.failed_loads == 0
    assert 0 < r.hit_tokens <= r.optimal_hit_tokens
    assert r.requests == len(requests)


def test_faults_in_the_store_cost_hits_never_correctness(tmp_path):
    requests = chat_sessions(40, BLOCK, seed=9)
    r = run(requests, StorageConfig("file", directory=str(tmp_path), fault_seed=3))
    assert r.storage_errors > 0
    assert r.kv_mismatches == 0 and r.failed_loads == 0
    assert r.hit_tokens <= r.optimal_hit_tokens


def test_a_bounded_store_keeps_serving(tmp_path):
    requests = chat_sessions(40, BLOCK, seed=10)
    r = run(requests, StorageConfig("file", directory=str(tmp_path), max_bytes=64 << 10))
    assert r.kv_mismatches == 0 and r.hit_tokens < r.optimal_hit_tokens
    assert 0 < page_bytes(tmp_path) <= 64 << 10


def test_a_restarted_replay_gets_its_hits_back_from_a_bounded_store(tmp_path):
    """The same sessions replayed twice on one directory: the second run's
    device and host start empty, so what they miss the store serves, and the
    store stays within its bound both times."""
    requests = chat_sessions(40, BLOCK, seed=12)
    bound = 256 << 10
    first = run(requests, StorageConfig("file", directory=str(tmp_path), max_bytes=bound))
    again = run(requests, StorageConfig("file", directory=str(tmp_path), max_bytes=bound))
    assert 0 < page_bytes(tmp_path) <= bound
    assert again.kv_mismatches == 0 and again.storage_errors == 0
    assert again.storage_hit_tokens > first.storage_hit_tokens
    assert again.hit_tokens > first.hit_tokens


def test_the_cli_bounds_a_store_it_is_given(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixkv",
            "replay",
            "--sessions",
            "20",
            "--json",
            "--storage-dir",
            str(tmp_path),
            "--storage-max-mib",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out)["kv_mismatches"] == 0
    assert 0 < page_bytes(tmp_path) <= 1 << 20


def test_instances_sharing_a_store_share_its_bound(tmp_path):
    """`--instances 2` are two processes with a FileStorage each on one
    directory: the bound is the directory's, and the help says what it
    counts."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixkv",
            "replay",
            "--sessions",
            "40",
            "--json",
            "--storage",
            "file",
            "--storage-dir",
            str(tmp_path),
            "--storage-max-mib",
            "1",
            "--instances",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out)["kv_mismatches"] == 0
    assert 0 < page_bytes(tmp_path) <= 1 << 20
    usage = subprocess.run(
        [sys.executable, "-m", "radixkv", "replay", "--help"], capture_output=True, text=True
    ).stdout
    usage = " ".join(usage.split())
    assert "the bytes of the page files" in usage and "disk blocks" in usage
    assert "every instance that shares it" in usage


@needs_mooncake
def test_two_instances_sharing_mooncake_reach_the_optimum():
    requests = chat_sessions(40, BLOCK, seed=11)
    with MooncakeMaster() as m:
        storage = StorageConfig(
            "mooncake",
            master_address=m.master_address,
            metadata_server=m.metadata_server,
            segment_bytes=64 << 20,
        )
        r = run(requests, storage, instances=2)
    assert r.hit_tokens == r.optimal_hit_tokens
    assert r.kv_mismatches == 0 and r.storage_errors == 0 and r.storage_hit_tokens > 0


@needs_trace
def test_trace_through_all_tiers_reaches_the_optimum(tmp_path):
    """The public trace's first requests, 512-token pages, device and host far
    below what the requests use."""
    requests = load_mooncake(TRACE)[:400]
    biggest = max(-(-(r.input_length + r.output_length) // 512) for r in requests)
    r = replay(
        requests,
        block_size=512,
        page_size=512,
        capacity_pages=biggest,
        host_pages=2 * biggest,
        instances=2,
        storage=StorageConfig("file", directory=str(tmp_path)),
    )
    assert r.hit_tokens == r.optimal_hit_tokens
    assert r.kv_mismatches == 0 and r.storage_hit_tokens > 0


def test_cli_builtin_replay_goes_through_all_tiers():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixkv",
            "replay",
            "--sessions",
            "30",
            "--capacity-tokens",
            "2048",
            "--host-capacity-tokens",
            "4096",
            "--instances",
            "2",
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    report = json.loads(out.stdout)
    assert report["storage"] == "file" and report["prefetch_policy"] == "wait_complete"
    assert report["hit_tokens"] == report["optimal_hit_tokens"]
    assert report["kv_mismatches"] == 0
    for key in (
        "storage_hit_tokens",
        "prefetched_tokens",
        "storage_written_pages",
        "storage_errors",
    ):
        assert key in report
    assert len(report["instances"]) == 2


def test_cli_storage_needs_a_host_tier_and_instances_need_storage():
    from test_replay import one_error_line, run_cli

    one_error_line(
        run_cli("replay", "--storage", "file", "--host-capacity-tokens", "0"), "--storage"
    )
    one_error_line(run_cli("replay", "--storage", "none", "--instances", "2"), "--instances")


def test_an_instance_that_dies_ends_the_replay_with_an_error_not_a_hang(tmp_path):
    import multiprocessing
    import signal
    import threading
    import time

    requests = chat_sessions(400, BLOCK, seed=12)
    outcome = {}

    def drive():
        try:
            run(requests, StorageConfig("file", directory=str(tmp_path)), instances=2)
        except RuntimeError as e:
            outcome["error"] = str(e)

    t = threading.Thread(target=drive)
    t.start()
    deadline = time.monotonic() + 60
    while len(multiprocessing.active_children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # serving by now
    os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
    t.join(120)
    assert not t.is_alive(), "the replay waits for a dead instance"
    assert "died" in outcome.get("error", "") or "failed" in outcome.get("error", "")


@pytest.mark.parametrize(
    "args,words",
    [
        (["--storage", "none", "--storage-dir", "/tmp/x"], ["--storage-dir", "file"]),
        (["--storage", "file", "--mooncake-master", "1.2.3.4:5"], ["--mooncake-master"]),
        (["--storage", "file", "--mooncake-segment-mib", "64"], ["--mooncake-segment-mib"]),
        (["--storage", "none", "--prefetch-policy", "timeout"], ["--prefetch-policy"]),
        (["--storage", "mooncake", "--mooncake-metadata", "http://x"], ["--mooncake-metadata"]),
        (["--storage", "mooncake", "--storage-dir", "/tmp/x"], ["--storage-dir"]),
        (["--storage-dir", ""], ["--storage-dir"]),
        (["--storage-dir", "/proc"], ["--storage file", "/proc"]),
        (["--storage-dir", "/proc", "--instances", "2"], ["--storage file", "/proc"]),
    ],
)
def test_cli_storage_mistakes_get_one_error_line(args, words):
    from test_replay import one_error_line, run_cli

    one_error_line(run_cli("replay", "--sessions", "5", *args), *words)


def test_cli_ctrl_c_with_instances_prints_the_partial_result():
    """Ctrl-C reaches the whole process group, as from a terminal."""
    from test_replay import wait_for_the_progress_bar

    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixkv",
            "replay",
            "--sessions",
            "5000",
            "--instances",
            "2",
            "--progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    seen = wait_for_the_progress_bar(p)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    err = seen + err
    assert p.returncode == 130, err
    assert "token hit rate" in out and "Traceback" not in err
    assert "interrupted: the figures cover the first" in err


def test_the_driver_numbers_fresh_tokens_as_one_instance_would_across_the_wrap():
    from radixkv.replay import Request, TokenMaker
    from radixkv.replay.traces import OUTPUT_TOKEN_BASE

    one, driver = TokenMaker(4, 10), TokenMaker(4, 10)
    reqs = [Request(0, 4 + 3 * k, 5 + k, [1]) for k in range(6)]
    for start in (OUTPUT_TOKEN_BASE, 2**31 - 12):  # the second crosses the wrap
        one.seek(start)
        driver.seek(start)
        for r in reqs:
            one.prompt(r), one.output(r.output_length)
            driver.advance(r)
            assert driver.position == one.position


def _ctrl_c_during_the_backup(monkeypatch, nth, times=1):
    """Sends the process SIGINT (`times` times) from inside the host tier's
    `nth` backup: the middle of a request, with copies in flight. Returns
    the count of requests the replay began."""
    from radixkv.replay.core import Instance
    from radixkv.scheduler.host_tier import HostTier

    calls, began = [0], [0]
    queue_backup, serve = HostTier._queue_backup, Instance.serve

    def queue_backup_then_ctrl_c(self, copy, device_slots, host_slots, pages=False):
        n = queue_backup(self, copy, device_slots, host_slots, pages)
        calls[0] += 1
        if calls[0] == nth:
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)
        return n

    def counting_serve(self, *args):
        began[0] += 1
        return serve(self, *args)

    monkeypatch.setattr(HostTier, "_queue_backup", queue_backup_then_ctrl_c)
    monkeypatch.setattr(Instance, "serve", counting_serve)
    return began


def test_ctrl_c_in_the_middle_of_a_request_stops_after_it(tmp_path, monkeypatch):
    """Ctrl-C lands inside the tiers' bookkeeping; the request finishes, its
    copies with it, and the run stops with the pool whole (finish checks
    it) and every row read back right."""
    requests = chat_sessions(60, BLOCK, seed=5)
    began = _ctrl_c_during_the_backup(monkeypatch, nth=20)
    r = run(requests, StorageConfig("file", directory=str(tmp_path)))
    assert r.interrupted
    assert 0 < r.requests == began[0] < len(requests)
    assert r.kv_mismatches == 0 and r.failed_loads == 0
    assert r.backed_up_tokens > 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_stops_at_once(tmp_path, monkeypatch):
    requests = chat_sessions(60, BLOCK, seed=5)
    _ctrl_c_during_the_backup(monkeypatch, nth=20, times=2)
    with pytest.raises(KeyboardInterrupt):
        run(requests, StorageConfig("file", directory=str(tmp_path)))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("overlap", [[], ["--overlap"]])
def test_a_second_ctrl_c_leaves_no_storage_behind(tmp_path, monkeypatch, capsys, overlap):
    """The storage thread stops with the run before its temporary directory
    goes: none is left behind, and no traceback."""
    import tempfile

    from radixkv.replay import cli

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _ctrl_c_during_the_backup(monkeypatch, nth=50, times=2)
    assert cli.main(["--sessions", "100", *overlap]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
    assert list(tmp_path.iterdir()) == []


def _ctrl_c_during_the_final_figures(monkeypatch):
    from radixkv.replay.core import Instance

    final, calls = Instance.finish, [0]

    def ctrl_c_first(self, interrupted=False):
        calls[0] += 1
        if calls[0] == 1:
            signal.raise_signal(signal.SIGINT)
        return final(self, interrupted)

    monkeypatch.setattr(Instance, "finish", ctrl_c_first)


def test_ctrl_c_after_the_last_request_keeps_the_whole_result(monkeypatch, capsys):
    from radixkv.replay import cli

    _ctrl_c_during_the_final_figures(monkeypatch)
    assert cli.main(["--sessions", "40"]) == 0
    out = capsys.readouterr()
    assert "token hit rate" in out.out and "interrupted" not in out.err


def test_ctrl_c_between_sweep_points_stops_the_sweep_and_writes_it(tmp_path, monkeypatch, capsys):
    from radixkv.replay import cli

    _ctrl_c_during_the_final_figures(monkeypatch)
    assert cli.main(["--sessions", "40", "--sweep", "3", "--out", str(tmp_path)]) == 130
    points = json.loads((tmp_path / "replay_sweep.json").read_text())["points"]
    assert len(points) == 1 and not points[0]["interrupted"]
    assert "interrupted: the sweep covers 1 of 3 points" in capsys.readouterr().err
