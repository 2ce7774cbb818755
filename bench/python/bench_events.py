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
"on" publishes to a PUB socket on 127.0.0.1 with a subscriber reading it on
another thread (the publisher's thread encodes and sends: on a machine with
few cores it competes with the scheduler, which this measures too).
Off and on alternate, each over the same requests on a fresh manager, warmed
up first; medians of 25-request batches, microseconds per request.

python bench/python/bench_events.py [--requests N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
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
    return [torch.cat([prompts[i // GROUP],
                       torch.randint(0, 32000, (SEQ - SHARED,), generator=g)]).to(torch.int32)
            for i in range(n)]


def manager(case: str, publisher):
    pages = POOL_REQUESTS * SEQ // PAGE
    host = 2 * pages if case == "host" else 0
    return CacheManager(num_pages=pages, page_size=PAGE, host_num_pages=host,
                        manual_copies=False, kv_events=publisher)


def cycle(cm: CacheManager, ids: torch.Tensor) -> None:
    h, cached = cm.match_req(ids)
    cm.lock(h)
    own = cm.allocate(len(ids) - h.cached_len)
    cm.free_and_cache_finished_req(h, ids, torch.cat([cached, own]))
    cm.writing_check()


def run(case: str, publisher, requests, batch: int = 25):
    cm = manager(case, publisher)
    warm = POOL_REQUESTS * 2  # fill the pool (and host), so every timed request evicts
    for ids in requests[:warm]:
        cycle(cm, ids)
    samples = []
    timed = requests[warm:]
    for b in range(0, len(timed) - batch + 1, batch):
        t0 = time.perf_counter_ns()
        for ids in timed[b:b + batch]:
            cycle(cm, ids)
        samples.append((time.perf_counter_ns() - t0) / batch / 1e3)
    cm.check_integrity()
    return samples


class Reader:
    """A subscriber draining the stream on its own thread, counting bytes."""

    def __init__(self, endpoint: str):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches = self.bytes = 0
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                self.batches += 1
                self.bytes += len(frames[2])

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="distinct requests per run")
    ap.add_argument("--rounds", type=int, default=3, help="off/on pairs per case")
    args = ap.parse_args()
    requests = make_requests(args.requests + 2 * POOL_REQUESTS, seed=0)
    publisher = EventPublisher("tcp://127.0.0.1:*", max_queue_size=1_000_000)
    reader = Reader(publisher.endpoint)
    time.sleep(0.2)
    results = []
    try:
        for case in ("device", "host"):
            off, on = [], []
            for _ in range(args.rounds):
                off += run(case, None, requests)
                on += run(case, publisher, requests)
            results.append({"case": case, "off_us": statistics.median(off),
                            "on_us": statistics.median(on)})
        deadline = time.monotonic() + 10
        while reader.batches < publisher.next_seq and time.monotonic() < deadline:
            time.sleep(0.05)
        published = publisher.next_seq
        received, nbytes = reader.batches, reader.bytes
    finally:
        reader.close()
        publisher.close()
    print(f"KV events: {args.requests} distinct {SEQ}-token requests (page {PAGE}), "
          f"median us per request")
    print(f"{'case':<10}{'off':>10}{'on':>10}{'on/off':>9}")
    for r in results:
        r["ratio"] = r["on_us"] / r["off_us"]
        print(f"{r['case']:<10}{r['off_us']:>10.2f}{r['on_us']:>10.2f}{r['ratio']:>8.2f}x")
    print(f"batches published {published}, received {received}, "
          f"{nbytes / max(received, 1) / 1024:.1f} KiB a batch, dropped {publisher.dropped}")
    for r in results:
        print(json.dumps({"bench": "events", "requests": args.requests, **r}))


if __name__ == "__main__":
    main()
