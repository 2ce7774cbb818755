"""A replay over several serving instances, each a process with its own device
and host tiers, sharing one storage tier."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import signal
import threading
import time
import traceback
import zlib
from typing import Dict, List, Sequence

import torch

from radixkv.replay.control import StopOnCtrlC, UntilStopped, progress_bar
from radixkv.replay.core import Instance, ReplayResult, StorageUnavailable, percentiles, too_large
from radixkv.replay.traces import Request, TokenMaker

# Counters summed over instances.
_SUMMED = (
    "requests",
    "skipped_requests",
    "input_tokens",
    "hit_tokens",
    "computed_tokens",
    "output_tokens",
    "evicted_tokens",
    "stored_tokens",
    "device_hit_tokens",
    "host_hit_tokens",
    "loaded_back_tokens",
    "backed_up_tokens",
    "host_evicted_tokens",
    "failed_loads",
    "kv_mismatches",
    "storage_hit_tokens",
    "prefetched_tokens",
    "storage_written_pages",
    "storage_errors",
    "pool_bytes",
    "host_pool_bytes",
    "retain_claims",
    "retain_refused",
    "retain_expired",
)


def _worker(conn, config: dict, overlap: bool) -> None:
    # Ctrl-C reaches the whole process group: the driver stops the run and
    # tells each instance to finish, an instance never stops mid-request.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    try:
        inst = Instance(**config)
    except StorageUnavailable as e:
        conn.send(("storage", str(e)))
        return
    except BaseException as e:  # tell the driver, do not leave it waiting
        conn.send(("error", repr(e)))
        return
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        req, fresh_at = msg
        try:
            inst.serve(req, fresh_at)
        except Exception:
            conn.send(("error", traceback.format_exc()))
            return
        if not overlap:
            conn.send(("done", None))
    result = inst.finish()
    conn.send(("result", (result, inst.lat)))


def _recv(conn, proc, k: int):
    """The next message from instance `k`; raises if its process died first
    (a crash or a kill), instead of waiting for it forever."""
    while not conn.poll():
        multiprocessing.connection.wait([conn, proc.sentinel])
        if not conn.poll() and not proc.is_alive():
            break
    try:
        return conn.recv()
    except (EOFError, OSError):  # its end of the pipe closed: the process is gone
        proc.join(5)
        raise RuntimeError(f"replay instance {k} died (exit code {proc.exitcode})") from None


def _send(conn, proc, k: int, msg) -> None:
    """Sends to instance `k`; if it is gone, raises with what it said last
    (its error) or that it died."""
    try:
        conn.send(msg)
    except OSError:
        while True:
            kind, what = _recv(conn, proc, k)  # raises "died" once nothing is left
            if kind == "error":
                raise RuntimeError(f"replay instance {k} failed:\n{what}") from None


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored while a process is started: a spawned Python that
    starts with SIGINT ignored keeps ignoring it, so Ctrl-C reaching the
    process group while it imports prints no traceback there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def route(req: Request, index: int, instances: int) -> int:
    """The instance that serves request `index`: by session when the trace
    names one (a conversation stays on one instance), else round robin."""
    if req.session is not None:
        return zlib.crc32(req.session.encode()) % instances
    return index % instances


def replay_instances(
    requests: Sequence[Request], config: dict, instances: int, progress: bool
) -> ReplayResult:
    overlap = config["overlap"]
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    finished = False
    for _ in range(instances):
        here, there = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(there, config, overlap), daemon=True)
        with _sigint_ignored():
            p.start()  # ignoring SIGINT from its first instruction, not once it imported
        there.close()  # the child's end: its death then reads as EOF here
        pipes.append(here)
        procs.append(p)
    try:
        for k, conn in enumerate(pipes):
            kind, what = _recv(conn, procs[k], k)
            if kind == "storage":
                raise StorageUnavailable(what)
            if kind == "error":
                raise RuntimeError(f"a replay instance failed to start: {what}")
        # Fresh tokens (outputs, prompts longer than their blocks) as one
        # instance would hand them out, so the tokens do not depend on N.
        maker = TokenMaker(config["block_size"], config["max_hash"])
        t_start = time.perf_counter()
        with StopOnCtrlC() as ctrl_c, progress_bar(len(requests), progress) as bar:
            todo = UntilStopped(requests, bar, ctrl_c)
            for i, req in todo:
                k = route(req, i, instances)
                _send(pipes[k], procs[k], k, (req, maker.position))
                if not too_large(req, config["page_size"], config["capacity_pages"]):
                    maker.advance(req)
                if not overlap:
                    kind, what = _recv(pipes[k], procs[k], k)
                    if kind != "done":
                        raise RuntimeError(f"replay instance {k} failed:\n{what}")
        for k, conn in enumerate(pipes):
            _send(conn, procs[k], k, None)
        results, lats = [], []
        for k, conn in enumerate(pipes):
            while True:
                kind, what = _recv(conn, procs[k], k)
                if kind == "result":
                    break
                if kind == "error":
                    raise RuntimeError(f"replay instance {k} failed:\n{what}")
            results.append(what[0])
            lats.append(what[1])
        wall = time.perf_counter() - t_start
        finished = True
    finally:
        # After a failure (or a second Ctrl-C) the instances are stopped, not
        # waited for: all are killed before any is joined.
        if not finished:
            for p in procs:
                p.kill()
        for p in procs:
            p.join(timeout=60 if finished else None)
            if p.is_alive():
                p.kill()
                p.join()
    return _combine(results, lats, wall, todo.interrupted)


def _combine(
    results: List[ReplayResult], lats: List[Dict[str, List[int]]], wall: float, interrupted: bool
) -> ReplayResult:
    first = results[0]
    out = ReplayResult(first.policy, first.page_size, first.capacity_tokens)
    for name in (
        "host_capacity_tokens",
        "write_policy",
        "storage",
        "storage_codec",
        "host_codec",
        "prefetch_policy",
        "eviction_policy",
        "retain_ttl_s",
        "retain_budget_tokens",
    ):
        setattr(out, name, getattr(first, name))
    # Every figure of a manager is a count of tokens, pages or events: the
    # instances' add up.
    for r in results:
        for key, value in r.cache_metrics.items():
            out.cache_metrics[key] = out.cache_metrics.get(key, 0) + value
    for name in _SUMMED:
        setattr(out, name, sum(getattr(r, name) for r in results))
    out.peak_pages = max(r.peak_pages for r in results)
    out.interrupted = interrupted or any(r.interrupted for r in results)
    out.wall_s = wall
    merged: Dict[str, List[int]] = {}
    for lat in lats:
        for k, v in lat.items():
            merged.setdefault(k, []).extend(v)
    out.latency_us = {k: percentiles(v) for k, v in merged.items()}
    for r, lat in zip(results, lats):
        r.latency_us = {k: percentiles(v) for k, v in lat.items()}
        r.wall_s = wall
        out.instances.append(r.to_json())
    return out
