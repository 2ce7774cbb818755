"""A serving engine for the KV events tests, run as a process of its own:
`python event_engine.py ENDPOINT REPLAY_ENDPOINT SEED [REQUESTS [idle]]`.

It serves requests through a CacheManager with a host tier and KV events,
flushing the events after each. With REQUESTS it waits for a line on stdin
(subscribers have connected), serves that many, prints one
JSON line (its epoch, the next batch number and its blocks per medium, from
its own snapshot), then keeps flushing (answering snapshot requests) until
stdin closes. Without, it serves until it is killed. With `idle` it serves
its requests at once, as a burst, prints the JSON line and then flushes
nothing (a snapshot request waits for ever) until stdin closes."""

import json
import sys
import time

import torch

from radixkv.event_index import snapshot_view
from radixkv.events import EventPublisher
from radixkv.scheduler import CacheManager

PAGE = 4


def main() -> None:
    endpoint, replay, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    limit = int(sys.argv[4]) if len(sys.argv) > 4 else None
    idle = len(sys.argv) > 5 and sys.argv[5] == "idle"
    pub = EventPublisher(endpoint, replay_endpoint=replay, bind=True)
    cm = CacheManager(24, PAGE, host_num_pages=48, kv_events=pub)
    g = torch.Generator().manual_seed(seed)
    systems = [
        torch.randint(0, 1000, (3 * PAGE,), generator=g, dtype=torch.int32) for _ in range(3)
    ]
    served = 0
    print(json.dumps({"epoch": pub.epoch}), flush=True)
    if limit is not None and not idle:
        sys.stdin.readline()
    while limit is None or served < limit:
        own = torch.randint(
            0,
            1000,
            (int(torch.randint(1, 4, (1,), generator=g)) * PAGE,),
            generator=g,
            dtype=torch.int32,
        )
        ids = torch.cat([systems[served % 3], own])
        h, idx = cm.match_req(ids)
        h, idx = cm.load_back(h)
        rest = cm.allocate(len(ids) - h.cached_len)
        cm.free_and_cache_finished_req(h, ids, torch.cat([idx, rest]))
        cm.drain()  # applies the copies and flushes the events
        served += 1
        time.sleep(0.002)
    snap = cm.kv_snapshot()
    view = {m: sorted(h) for m, h in snapshot_view(snap.payload).items()}
    print(json.dumps({"epoch": snap.epoch, "next_seq": snap.seq, "blocks": view}), flush=True)
    import select

    if idle:
        sys.stdin.read()  # the replay thread answers; the engine's thread flushes nothing
        return
    while True:  # answer snapshot requests until told to stop
        if select.select([sys.stdin], [], [], 0.01)[0] and not sys.stdin.readline():
            break
        cm.flush_events()
    cm.close()
    pub.close()


if __name__ == "__main__":
    main()
