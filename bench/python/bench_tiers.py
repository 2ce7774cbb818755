"""The host tier's bookkeeping: tree operations with the tier on against the
same operations with it off, in one run, and a scheduler's request cycle.

Tree cases (page size 1, bench_radix.py's workloads; "on": every node also
has a host copy, as write_through leaves it):
  match_many   2,000 matches cycling over 1,000 cached 1,024-token sequences
  insert_many  2,000 inserts of new 1,024-token sequences sharing the cached
               512-token prefix (whose nodes, "on", have host copies)
  backup       "on" only: write_through's bookkeeping after each of those
               inserts (find_backup, begin_backup, host pages from a
               PageAllocator, finish_backup), without the copy itself
  backup_fused the same in the host tier's two calls: start_backup (find,
               host pages, begin) and finish_backup freeing what is not taken
               (alternating batches with "backup", half the inserts each)
  evict@10000  evict 1,024 tokens (8 leaves) from 10,000 unlocked leaves; "on"
               keeps them as host-only nodes instead of deleting them (the
               evicted leaves are put back between samples, untimed)
  load         "on" only: the bookkeeping of loading one 128-token host-only
               leaf back (find_load, begin_load, device pages from a
               PageAllocator, the request's indices, finish_load)
  load_fused   the same with start_load (find, begin, pages and indices in
               one call), then finish_load (alternating with "load")
Request cycle (CacheManager, 1,024-token requests sharing 512 tokens, a pool
of 64 requests' pages so every request evicts, page 16): match_req,
lock or load_back, allocate, free_and_cache_finished_req and, with the tier,
drain (the replay's deterministic mode) -- tier off, then a 2x host tier
with the bookkeeping-only engine run inline (manual) and on its thread.
Then write_through's calls for one 12,288-token path at page 512 (start,
finish, and the host eviction that makes it need a backup again), and the
cost of a shielded call (a method that does nothing, plain and
under `_core.shielded`, which every CacheManager call is).
Prints a table of medians in microseconds with ratios on/off, then JSON.

python bench/python/bench_tiers.py [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_radix import PREFIX, SEQ, SUFFIX_EVICT, VOCAB, Workload, median_us, now_ns  # noqa: E402

from radixkv import _core  # noqa: E402
from radixkv.scheduler import CacheManager  # noqa: E402


class Backups:
    """write_through's bookkeeping on a bare tree, host pages from an allocator."""

    def __init__(self, tree):
        self.tree = tree
        self.host = _core.PageAllocator(1 << 23, 1)

    def __call__(self, ids):
        tree = self.tree
        copy = tree.find_backup(ids)
        if copy is None:
            return
        tree.begin_backup(copy)
        tree.finish_backup(copy, self.host.allocate(copy[3] - copy[2]))

    def fused(self, ids):
        """The same in the two calls the host tier makes: start_backup (find,
        host pages, begin) and finish_backup freeing what is not taken."""
        started = self.tree.start_backup(ids, self.host)
        if started is None:
            return
        copy, _, host = started
        self.tree.finish_backup(copy, host, True, self.host)


def make_tree(seqs, tier: bool):
    tree = _core.RadixTree(1)
    backups = Backups(tree)
    slot = 0
    for s in seqs:
        tree.insert_prefix(s, torch.arange(slot, slot + len(s), dtype=torch.int32))
        slot += len(s)
        if tier:
            backups(s)
    return tree, backups, slot


def batched(calls, fn, batch=20):
    samples = []
    for b in range(0, len(calls), batch):
        chunk = calls[b : b + batch]
        t0 = now_ns()
        for args in chunk:
            fn(*args)
        samples.append((now_ns() - t0) / len(chunk))
    return median_us(samples)


def bench_tree(tier: bool, seed: int, reps: int) -> dict:
    out = {}
    w = Workload(seed + 2)
    seqs = [w.sequence(SEQ - PREFIX) for _ in range(1000)]
    tree, backups, slot = make_tree(seqs, tier)
    gen = torch.Generator().manual_seed(seed + 3)
    order = torch.cat([torch.randperm(1000, generator=gen) for _ in range(2)]).tolist()
    out["match_many"] = batched([(seqs[i],) for i in order], tree.match_prefix)

    prefix_slots = torch.arange(0, PREFIX, dtype=torch.int32)
    fresh = []
    for _ in range(2000):
        s = w.sequence(SEQ - PREFIX)
        v = torch.cat([prefix_slots, torch.arange(slot, slot + SEQ - PREFIX, dtype=torch.int32)])
        slot += SEQ - PREFIX
        fresh.append((s, v))
    out["insert_many"] = batched(fresh[:1000], tree.insert_prefix)
    if tier:
        for s, v in fresh[1000:]:
            tree.insert_prefix(s, v)
        # Half the fresh requests each way, batches alternating.
        calls = [(s,) for s, _ in fresh[1000:]]
        seps, fus = [], []
        for b in range(0, len(calls), 40):
            seps.append(batched(calls[b : b + 20], backups))
            fus.append(batched(calls[b + 20 : b + 40], backups.fused))
        out["backup"], out["backup_fused"] = statistics.median(seps), statistics.median(fus)

    # evict@10000
    w = Workload(seed)
    leaves = 10000
    suffix = torch.randint(0, VOCAB, (leaves, SUFFIX_EVICT), generator=w.g, dtype=torch.int32)
    seqs = [torch.cat([w.prefix, suffix[i]]) for i in range(leaves)]
    tree, backups, slot = make_tree(seqs, tier)
    samples, cursor = [], 0
    for _ in range(reps * 20):
        t0 = now_ns()
        freed = tree.evict(1024)
        samples.append(now_ns() - t0)
        assert len(freed) >= 1024
        k = 1024 // SUFFIX_EVICT
        for s in seqs[cursor : cursor + k]:
            # Over a host-only node the insert hands it device slots again.
            n = len(s) - PREFIX
            v = torch.cat(
                [
                    torch.arange(0, PREFIX, dtype=torch.int32),
                    torch.arange(slot, slot + n, dtype=torch.int32),
                ]
            )
            slot += n
            tree.insert_prefix(s, v)
        cursor = (cursor + k) % leaves
    out["evict@10000"] = median_us(samples)

    if tier:
        # Load bookkeeping: evict a leaf to host only, then load it back into
        # pages of a device allocator (which hands out slots past the tree's).
        device = _core.PageAllocator(slot + (1 << 22), 1)
        device.allocate(slot)
        samples, fused = [], []
        for i in range(reps * 40):
            tree.evict(SUFFIX_EVICT)  # the oldest leaf goes to host only
            s = seqs[(cursor + i) % leaves]
            h, _ = tree.match_prefix(s)
            if h.host_hit_len == 0:
                continue
            if i % 2 == 0:  # find, begin, pages, the request's indices; then finish
                t0 = now_ns()
                copy = tree.find_load(h)
                loaded, host, prefix = tree.begin_load(copy)
                new = device.allocate(len(host))
                torch.cat([prefix, new])
                tree.finish_load(copy, new)
                samples.append(now_ns() - t0)
            else:  # the same in start_load's one call; then finish
                t0 = now_ns()
                copy, loaded, host, indices = tree.start_load(h, device)
                tree.finish_load(copy, indices[copy.start :])
                fused.append(now_ns() - t0)
            tree.lock_handle(loaded, True)
        out["load"], out["load_fused"] = median_us(samples), median_us(fused)
    return out


def bench_requests(mode: str, seed: int, requests: int = 1500) -> float:
    page = 16
    per_req = SEQ // page + 1
    pages = 64 * per_req
    kwargs = {}
    if mode != "off":
        kwargs = dict(host_num_pages=2 * pages, manual_copies=(mode == "inline"))
    cm = CacheManager(pages, page_size=page, **kwargs)
    w = Workload(seed + 5)
    # 300 distinct sequences cycled: device holds 64, host another 128.
    seqs = [w.sequence(SEQ - PREFIX) for _ in range(300)]
    gen = torch.Generator().manual_seed(seed)
    order = torch.randint(0, len(seqs), (requests,), generator=gen).tolist()
    samples = []
    for i in order:
        ids = seqs[i]
        t0 = now_ns()
        h, idx = cm.match_req(ids)
        if h.host_hit_len:
            h, idx = cm.load_back(h)
        else:
            cm.lock(h)
        own = cm.allocate(len(ids) - h.cached_len)
        cm.free_and_cache_finished_req(h, ids, torch.cat([idx, own]))
        if mode != "off":
            cm.drain()
        samples.append(now_ns() - t0)
    cm.check_integrity()
    return median_us(samples[len(samples) // 5 :])  # after the warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    off = bench_tree(False, args.seed, args.reps)
    on = bench_tree(True, args.seed, args.reps)
    rows = []
    print(f"{'case':<14}{'tier off':>10}{'tier on':>10}{'on/off':>8}   (median us)")
    cases = ["match_many", "insert_many", "evict@10000", "backup", "backup_fused", "load"]
    for case in cases + ["load_fused"]:
        a, b = off.get(case), on.get(case)
        ratio = f"{b / a:>7.2f}x" if a else "       -"
        print(
            f"{case:<14}{a if a is not None else '-':>10}{b:>10.3f}{ratio}"
            if a is None
            else f"{case:<14}{a:>10.3f}{b:>10.3f}{ratio}"
        )
        rows.append({"case": case, "tier_off_us": a and round(a, 3), "tier_on_us": round(b, 3)})
    req = {mode: bench_requests(mode, args.seed) for mode in ("off", "inline", "thread")}
    print("\nrequest cycle through CacheManager (median us per request):")
    for mode, us in req.items():
        name = {
            "off": "no host tier",
            "inline": "host tier, copies inline",
            "thread": "host tier, controller thread",
        }[mode]
        print(f"  {name:<32}{us:>9.2f}{us / req['off']:>8.2f}x")
        rows.append({"case": f"request_cycle/{mode}", "us": round(us, 2)})
    big = bench_big_page_backup(args.seed)
    print(
        f"\na 12,288-token backup at page 512 (24 pages), the host tier's calls "
        f"(median us): start_backup {big['start_us']:.2f}, finish_backup "
        f"{big['finish_us']:.2f}, evict_host and free {big['evict_us']:.2f}"
    )
    rows.append({"case": "backup@512", **big})
    shield = bench_shield(args.reps)
    print(
        f"\na shielded call (signals held back, every CacheManager call): "
        f"{shield['plain_ns']:.0f} ns plain, {shield['shielded_ns']:.0f} ns shielded"
    )
    rows.append({"case": "shielded_call", **shield})
    for r in rows:
        print(json.dumps(r))


def bench_big_page_backup(seed: int, n: int = 20_000) -> dict:
    """write_through's calls for one 12,288-token path at page 512, over and
    over: start_backup (find, host pages, begin), finish_backup (the host
    pages' checks, the nodes take them), then evict_host and the free that
    make the path need a backup again. What each costs per slot shows here,
    where a path has 12k slots and 24 pages."""
    ps, pages_n = 512, 64
    tree = _core.RadixTree(ps, pages_n * ps, "lru")
    pages, host = _core.PageAllocator(pages_n, ps), _core.PageAllocator(2 * pages_n, ps)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32000, (24 * ps,), generator=g, dtype=torch.int32)
    h, _ = tree.match_prefix(ids)
    tree.lock_handle(h)
    tree.finish_request(h, ids, pages.allocate(len(ids)), pages)
    times: dict = {"start_us": [], "finish_us": [], "evict_us": []}
    for _ in range(n):
        t0 = now_ns()
        copy, _, host_slots = tree.start_backup(ids, host)
        t1 = now_ns()
        tree.finish_backup(copy, host_slots, True, host)
        t2 = now_ns()
        host.free(tree.evict_host(len(ids)), tree, True)
        t3 = now_ns()
        times["start_us"].append((t1 - t0) / 1e3)
        times["finish_us"].append((t2 - t1) / 1e3)
        times["evict_us"].append((t3 - t2) / 1e3)
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def bench_shield(reps: int) -> dict:
    """A method that does nothing, plain and under `_core.shielded` (what
    every CacheManager call pays to hold Ctrl-C back while it runs)."""

    class Methods:
        def plain(self, x):
            return x

        @_core.shielded
        def shielded(self, x):
            return x

    m, n = Methods(), 20_000
    out = {}
    for name in ("plain", "shielded"):
        fn, samples = getattr(m, name), []
        for _ in range(reps):
            t0 = now_ns()
            for i in range(n):
                fn(i)
            samples.append((now_ns() - t0) / n)
        out[f"{name}_ns"] = round(sorted(samples)[len(samples) // 2], 1)
    return out


if __name__ == "__main__":
    main()
