"""KV events: a scheduler's request cycle with events off against the same
cycle with them on, in one run.

Requests are distinct: 1,024 tokens each (page 16), the first 256 shared
within groups of 8 (a system prompt), the rest random. The device pool holds
32 requests' pages, so in the steady state every request evicts about one
request's pages: each request announces its 48 new pages (BlockStored) and
the removal of about as many (BlockRemoved). A request is match_req, lock,
allocate, free_and_cache_finished_req and writing_check (the per-round call
that publishes the round's batch). Cases:
  device       the device pool only
  host         with a host tier twice the pool (bookkeeping only, copies
               inline), so each request also backs up (CPU_PINNED stored) and
               host eviction removes
"on" publishes to a PUB socket on 127.0.0.1 (encoded on the scheduler's
thread, sent by ZeroMQ's) with a subscriber reading it in another process;
"ledger" is the same with a publisher that sends nothing, which separates
the manager's bookkeeping from the encoding and sending. The ledger hashes
and packs on its own thread: the process CPU per request (every thread's,
the ledger's and ZeroMQ's too) is printed below the wall figures.
"snapshot": cm.kv_snapshot() of the host case's manager once the pools are
full (every block of both tiers as one batch, what a router that lost track
asks for), its median over 20 calls against a request cycle's.
Off and on alternate, each over the same requests on a fresh manager, warmed
up first; medians of 25-request batches, microseconds per request.
`--step N`: a scheduler step of N requests, the round's call (and its one
published batch) once a step instead of once a request (batches of N
requests timed); `--pages`: the requests through the page path
(match_pages, allocate_pages, free_and_cache_finished_req_pages).

python bench/python/bench_events.py [--requests N] [--rounds R] [--step N] [--pages]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from radixkv.events import EventPublisher
from radixkv.scheduler import CacheManager

PAGE = 16
SEQ = 1024
SHARED = 256
GROUP = 8
POOL_REQUESTS = 32


def make_requests(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 32000, (SHARED,), generator=g) for _ in range(n // GROUP + 1)]
    return [
        torch.cat([prompts[i // GROUP], torch.randint(0, 32000, (SEQ - SHARED,), generator=g)]).to(
            torch.int32
        )
        for i in range(n)
    ]


def manager(case: str, publisher):
    pages = POOL_REQUESTS * SEQ // PAGE
    host = 2 * pages if case == "host" else 0
    return CacheManager(
        num_pages=pages,
        page_size=PAGE,
        host_num_pages=host,
        manual_copies=False,
        kv_events=publisher,
    )


STEP = 1  # requests a scheduler step (--step)
PAGES = False  # the page path (--pages)


def cycle(cm: CacheManager, ids: torch.Tensor, end_of_step: bool = True) -> None:
    if PAGES:
        h, cached = cm.match_pages(ids)
        cm.lock(h)
        own = cm.allocate_pages(len(ids) - h.cached_len)
        cm.free_and_cache_finished_req_pages(h, ids, torch.cat([cached, own]))
    else:
        h, cached = cm.match_req(ids)
        cm.lock(h)
        own = cm.allocate(len(ids) - h.cached_len)
        cm.free_and_cache_finished_req(h, ids, torch.cat([cached, own]))
    if end_of_step:
        cm.writing_check()


class Ledger(EventPublisher):
    """A publisher that sends nothing: the manager's bookkeeping alone."""

    def __init__(self):  # no sockets
        self.batches = 0
        self.data_parallel_rank = 0
        self._closed = False

    def publish(self, events):
        self.batches += 1
        return None

    def publish_packed(self, events):
        self.batches += 1
        return None


def run(case: str, publisher, requests, batch: int = 25):
    """Wall, main-thread CPU and process CPU microseconds per request, per
    batch (the process's: the ledger's thread and ZeroMQ's too)."""
    cm = manager(case, publisher)
    warm = POOL_REQUESTS * 2  # fill the pool (and host), so every timed request evicts
    for ids in requests[:warm]:
        cycle(cm, ids)
    wall, cpu, proc = [], [], []
    timed = requests[warm:]
    batch = STEP if STEP > 1 else batch
    for b in range(0, len(timed) - batch + 1, batch):
        t0, c0, p0 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
        for i, ids in enumerate(timed[b : b + batch]):
            cycle(cm, ids, STEP == 1 or i == batch - 1)
        wall.append((time.perf_counter_ns() - t0) / batch / 1e3)
        cpu.append((time.thread_time_ns() - c0) / batch / 1e3)
        proc.append((time.process_time_ns() - p0) / batch / 1e3)
    cm.check_integrity()
    return wall, cpu, proc


def snapshot_cost(requests):
    """(median ms of kv_snapshot, blocks in it, payload KiB, us a request cycle)."""
    from radixkv.event_index import snapshot_view

    cm = manager("host", Ledger())
    for ids in requests:
        cycle(cm, ids)
    times = []
    for _ in range(20):
        t0 = time.perf_counter_ns()
        snap = cm.kv_snapshot()
        times.append((time.perf_counter_ns() - t0) / 1e6)
    blocks = sum(len(h) for h in snapshot_view(snap.payload).values())
    t0 = time.perf_counter_ns()
    for ids in requests[:200]:
        cycle(cm, ids)
    per_request = (time.perf_counter_ns() - t0) / 200 / 1e3
    return statistics.median(times), blocks, len(snap.payload) / 1024, per_request


READER = """
import sys, zmq
ctx = zmq.Context(); sock = ctx.socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b""); sock.connect(sys.argv[1])
batches = nbytes = 0
print("ready", flush=True)
while True:
    frames = sock.recv_multipart()
    if frames[2] == b"stop":
        break
    batches += 1; nbytes += len(frames[2])
print(batches, nbytes, flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="distinct requests per run")
    ap.add_argument("--rounds", type=int, default=3, help="off/ledger/on triples per case")
    ap.add_argument("--step", type=int, default=1, help="requests a scheduler step (default 1)")
    ap.add_argument("--pages", action="store_true", help="the requests through the page path")
    args = ap.parse_args()
    global STEP, PAGES
    STEP, PAGES = max(1, args.step), args.pages
    requests = make_requests(args.requests + 2 * POOL_REQUESTS, seed=0)
    publisher = EventPublisher("tcp://127.0.0.1:*")
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, publisher.endpoint], stdout=subprocess.PIPE, text=True
    )
    assert reader.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # the subscription reaches the publisher
    results = []
    try:
        for case in ("device", "host"):
            got = {"off": ([], [], []), "ledger": ([], [], []), "on": ([], [], [])}
            for _ in range(args.rounds):
                for name, pub in (("off", None), ("ledger", Ledger()), ("on", publisher)):
                    for kept, new in zip(got[name], run(case, pub, requests)):
                        kept.extend(new)
            r = {"case": case}
            for name, (wall, cpu, proc) in got.items():
                r[f"{name}_us"] = statistics.median(wall)
                r[f"{name}_cpu_us"] = statistics.median(cpu)
                r[f"{name}_process_cpu_us"] = statistics.median(proc)
            results.append(r)
        published = publisher.next_seq
        publisher._pub.send_multipart((b"", b"\0" * 8, b"stop"))
        received, nbytes = (int(x) for x in reader.stdout.readline().split())
    finally:
        reader.kill()
        publisher.close()
    print(
        f"KV events: {args.requests} distinct {SEQ}-token requests (page {PAGE}), "
        f"steps of {STEP}, {'page' if PAGES else 'slot'} path, "
        f"median us per request (wall; main-thread CPU in brackets)"
    )
    print(f"{'case':<8}{'off':>16}{'ledger':>16}{'on':>16}{'ledger/off':>12}{'on/off':>8}")
    for r in results:
        r["ledger_ratio"] = r["ledger_us"] / r["off_us"]
        r["ratio"] = r["on_us"] / r["off_us"]
        cells = "".join(
            f"{r[n + '_us']:>8.1f} ({r[n + '_cpu_us']:>5.1f})" for n in ("off", "ledger", "on")
        )
        print(f"{r['case']:<8}{cells}{r['ledger_ratio']:>11.2f}x{r['ratio']:>7.2f}x")
    for r in results:
        cells = "".join(f"{r[n + '_process_cpu_us']:>16.1f}" for n in ("off", "ledger", "on"))
        print(f"{r['case']:<8}{cells}   process CPU (every thread)")
    print(
        f"batches published {published}, received {received}, "
        f"{nbytes / max(received, 1) / 1024:.1f} KiB a batch"
    )
    ms, blocks, kib, cycle_us = snapshot_cost(requests)
    print(
        f"snapshot of {blocks:,} blocks (both tiers full): {ms:.2f} ms, {kib:,.0f} KiB, "
        f"{ms * 1e3 / cycle_us:.0f} request cycles"
    )
    for r in results:
        print(json.dumps({"bench": "events", "requests": args.requests, **r}))


if __name__ == "__main__":
    main()
