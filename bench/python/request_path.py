"""How far one request's calls travel through radixkv's Python files.

A CacheManager with every tier on (host tier over an MHA pool, FileStorage,
KV events to a publisher that keeps them) serves a warm-up request, then the
traced one: prefetch, match, load back, allocate, finish, and the three
checks a scheduler runs each round, then a drain (the backup lands and
is written to storage). Every call from one radixkv Python file
into another is a hop; a pair of files calling each other both ways is
back-and-forth. Prints the files, the hops and the pairs, or JSON with
--json.

    python bench/python/request_path.py [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch

import radixkv
from radixkv.kvcache import MHAKVCache
from radixkv.scheduler import CacheManager
from radixkv.events import EventPublisher
from radixkv.storage import FileStorage, config_fingerprint

ROOT = os.path.dirname(os.path.abspath(radixkv.__file__))
PAGE = 16


class _Keep(EventPublisher):
    """A publisher that keeps its batches (nothing leaves the process)."""

    def __init__(self) -> None:  # no sockets
        self.batches: list = []
        self._closed = False

    def publish(self, events) -> None:
        self.batches.append(events)

    def publish_packed(self, events) -> None:
        self.batches.append(events)


def _one_request(cm: CacheManager, ids: list) -> None:
    op = cm.prefetch(ids)
    cm.wait_prefetch(op)
    handle, _ = cm.match_req(ids)
    handle, indices = cm.load_back(handle)
    new = cm.allocate(len(ids) - handle.cached_len)
    indices = torch.cat([indices.cpu(), new.cpu()])
    cm.free_and_cache_finished_req(handle, ids, indices)
    cm.writing_check()
    cm.loading_check()
    cm.storage_check()
    cm.drain()  # its backup lands and is written on to storage


def trace(fn):
    """Runs fn() under a profiler; returns the cross-file call counts."""
    hops: collections.Counter = collections.Counter()

    def prof(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_code.co_filename
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        if callee.startswith(ROOT) and caller.startswith(ROOT) and callee != caller:
            hops[(os.path.relpath(caller, ROOT), os.path.relpath(callee, ROOT))] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return hops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        pool = MHAKVCache(2, 2, 64, 64, torch.float32, page_size=PAGE, device="cpu")
        seed = config_fingerprint(
            model="request-path",
            dtype=torch.float32,
            page_size=PAGE,
            layout="mha",
            num_layers=2,
            kv_heads=2,
            head_dim=64,
        )
        cm = CacheManager(
            64,
            PAGE,
            kv_cache=pool,
            host_num_pages=64,
            manual_copies=True,  # copies run in the calls that wait for them: one count
            storage=FileStorage(root, seed),
            kv_events=_Keep(),
        )
        prompt = list(range(1, 8 * PAGE + 2))
        _one_request(cm, prompt)
        cm.drain()
        cm.reset()  # device and host empty: the next one reads its prefix from storage
        hops = trace(lambda: _one_request(cm, prompt + list(range(500, 500 + 2 * PAGE))))
        cm.close()
    files = sorted({f for pair in hops for f in pair})
    both = sorted({tuple(sorted(p)) for p in hops if (p[1], p[0]) in hops})
    out = {
        "files": len(files),
        "hops": sum(hops.values()),
        "file_pairs": len(hops),
        "back_and_forth": [" <-> ".join(p) for p in both],
        "file_list": files,
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"{len(files)} files, {out['hops']} hops over {len(hops)} caller->callee pairs")
    for (a, b), n in sorted(hops.items(), key=lambda kv: -kv[1]):
        print(f"  {n:4d}  {a} -> {b}")
    print("back-and-forth:", ", ".join(out["back_and_forth"]) or "none")


if __name__ == "__main__":
    main()
