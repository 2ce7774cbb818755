"""Prefix-cache microbenchmarks: radixkv against the peers, in one process.

Workloads (page size 1, token ids below 32,000, fixed seed):
  match      match of a cached 1,024-token sequence, with its indices tensor,
             in a tree of 1,000 sequences sharing a 512-token prefix
  split      match that diverges inside a node (each query splits once)
  insert     insert of a new 1,024-token sequence sharing the 512 prefix
  lock       a lock + unlock pair on a matched handle
  match_many match of a different cached sequence each time: 2,000 matches
             cycling over 1,000 distinct 1,024-token sequences in shuffled order
             (cold caches, as a scheduler sees them)
  insert_many insert of 2,000 new 1,024-token sequences whose first 512
             indices are the cached prefix's own slots (what a scheduler passes)
  match_32_singles  32 of those matches (a prefill batch), per request
  match_batch32  the same 32 in one match_prefix_batch call (radixkv; the
             peers have no batch call: their figure is their 32 singles)
  lock_call  lock_handle(h) then lock_handle(h, unlock=True), called the way
             users call them (radixkv; the peers through their adapters)
  evict@N    evict 1,024 tokens (8 leaves) from a tree of N unlocked leaves
             (a shared 512-token prefix with N unique 128-token suffixes);
             the evicted leaves are put back between samples, untimed
Prints a table of medians (microseconds) with ratios peer/radixkv, then one
JSON line per case. Peers get their keys in their own native form, converted
outside the timed region (their best case); radixkv takes the torch tensors.
Peers that are not installed are skipped with a note; bench/PEERS.md says how
to install them.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List

import torch

from radixkv import _core
from radixkv.kvcache import RadixCacheManager

VOCAB = 32000
PREFIX = 512
SEQ = 1024
SUFFIX_EVICT = 128
MEMORY_PAGE_SIZES = (1, 16, 512)


class RadixkvCache:
    """radixkv behind the same adapter shape as bench/python/peers.py."""

    name = "radixkv"

    def __init__(self, page_size: int = 1):
        m = RadixCacheManager("cpu", page_size)
        self.manager = m
        self.insert = m.insert_prefix
        self.match = m.match_prefix
        self.lock = m.lock_handle
        self.unlock = lambda h: m.lock_handle(h, True)
        self.evict_raw = m.evict
        self.evict = lambda n: int(m.evict(n).numel())
        self.evictable_size = lambda: m.size_info.evictable_size

    @staticmethod
    def prepare(tokens):
        return tokens


def load_peers() -> Dict[str, Callable]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import peers
    except Exception as e:  # the adapter module itself failed
        print(f"note: peers unavailable ({type(e).__name__}: {e})")
        return {}
    return peers.available_peers()


def now_ns() -> int:
    return time.perf_counter_ns()


def median_us(samples_ns: List[float]) -> float:
    return statistics.median(samples_ns) / 1e3


class Workload:
    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.prefix = torch.randint(0, VOCAB, (PREFIX,), generator=g, dtype=torch.int32)

    def sequence(self, n_unique: int) -> torch.Tensor:
        return torch.cat(
            [self.prefix, torch.randint(0, VOCAB, (n_unique,), generator=self.g, dtype=torch.int32)]
        )


def build(cache, seqs: List[torch.Tensor], first_slot: int = 0) -> int:
    slot = first_slot
    for s in seqs:
        n = len(s)
        cache.insert(s, torch.arange(slot, slot + n, dtype=torch.int32))
        slot += n
    return slot


def bench_core(factory, name: str, reps: int, seed: int) -> Dict[str, float]:
    """match, split, insert, lock on the 1,000-sequence tree."""
    w = Workload(seed)
    seqs = [w.sequence(SEQ - PREFIX) for _ in range(1000)]
    cache = factory()
    slot = build(cache, seqs)
    out: Dict[str, float] = {}

    prepare = cache.prepare
    query = prepare(seqs[len(seqs) // 2])
    match = cache.match
    handle, indices = match(query)
    assert indices.numel() == SEQ, f"{name}: match returned {indices.numel()} slots"
    batch = 50
    samples = []
    for _ in range(reps):
        t0 = now_ns()
        for _ in range(batch):
            match(query)
        samples.append((now_ns() - t0) / batch)
    out["match"] = median_us(samples)

    lock, unlock = cache.lock, cache.unlock
    samples = []
    for _ in range(reps):
        t0 = now_ns()
        for _ in range(batch):
            lock(handle)
            unlock(handle)
        samples.append((now_ns() - t0) / batch)
    out["lock"] = median_us(samples)

    # Each query diverges inside the unique part of a different sequence.
    gen = torch.Generator().manual_seed(seed + 1)
    queries = []
    for s in seqs:
        cut = PREFIX + 1 + int(torch.randint(0, SEQ - PREFIX - 2, (1,), generator=gen))
        q = s.clone()
        q[cut] = (int(q[cut]) + 1) % VOCAB
        queries.append(prepare(q))
    samples = []
    for q in queries:
        t0 = now_ns()
        _, idx = match(q)
        samples.append(now_ns() - t0)
    out["split"] = median_us(samples)

    fresh = [prepare(w.sequence(SEQ - PREFIX)) for _ in range(min(reps * 2, 1000))]
    insert = cache.insert
    samples = []
    for s in fresh:
        slots = torch.arange(slot, slot + SEQ, dtype=torch.int32)
        slot += SEQ
        t0 = now_ns()
        insert(s, slots)
        samples.append(now_ns() - t0)
    out["insert"] = median_us(samples)
    return out


def bench_realistic(
    factory, name: str, seed: int, distinct: int = 1000, calls: int = 2000, batch: int = 20
) -> Dict[str, float]:
    """The access patterns of a scheduler: many distinct requests, many inserts.
    Each sample is the mean over `batch` consecutive calls on different
    sequences, so the timer's own cost stays out of the way."""
    w = Workload(seed + 2)
    seqs = [w.sequence(SEQ - PREFIX) for _ in range(distinct)]
    cache = factory()
    slot = build(cache, seqs)
    prefix_slots = torch.arange(0, PREFIX, dtype=torch.int32)  # the first sequence's prefix
    prepare, match, insert = cache.prepare, cache.match, cache.insert
    gen = torch.Generator().manual_seed(seed + 3)
    order = torch.cat(
        [torch.randperm(distinct, generator=gen) for _ in range(-(-calls // distinct))]
    )[:calls].tolist()
    queries = [prepare(seqs[i]) for i in order]
    out: Dict[str, float] = {}
    samples = []
    for b in range(0, calls, batch):
        chunk = queries[b : b + batch]
        t0 = now_ns()
        for q in chunk:
            match(q)
        samples.append((now_ns() - t0) / len(chunk))
    out["match_many"] = median_us(samples)

    # A prefill batch of 32 requests: 32 single matches against (radixkv)
    # one match_prefix_batch; per request. Peers have no batch call: their
    # batch is their 32 single matches.
    manager = getattr(cache, "manager", None)
    chunks = [queries[b : b + 32] for b in range(0, calls - 31, 32)]
    singles, batched = [], []
    for chunk in chunks:
        t0 = now_ns()
        for q in chunk:
            match(q)
        singles.append((now_ns() - t0) / 32)
    if isinstance(manager, RadixCacheManager):
        match_batch = manager.match_prefix_batch
        for chunk in chunks:
            t0 = now_ns()
            match_batch(chunk)
            batched.append((now_ns() - t0) / 32)
    out["match_32_singles"] = median_us(singles)
    out["match_batch32"] = median_us(batched or singles)

    fresh = [prepare(w.sequence(SEQ - PREFIX)) for _ in range(calls)]
    slot_lists = []
    for _ in range(calls):
        slot_lists.append(
            torch.cat([prefix_slots, torch.arange(slot, slot + SEQ - PREFIX, dtype=torch.int32)])
        )
        slot += SEQ - PREFIX
    samples = []
    for b in range(0, calls, batch):
        t0 = now_ns()
        for s, v in zip(fresh[b : b + batch], slot_lists[b : b + batch]):
            insert(s, v)
        samples.append((now_ns() - t0) / batch)
    out["insert_many"] = median_us(samples)

    handle, _ = match(queries[0])
    samples = []
    if isinstance(manager, RadixCacheManager):
        lock_handle = manager.lock_handle
        for _ in range(calls // batch):
            t0 = now_ns()
            for _ in range(batch):
                lock_handle(handle)
                lock_handle(handle, unlock=True)
            samples.append((now_ns() - t0) / batch)
    else:
        lock, unlock = cache.lock, cache.unlock
        for _ in range(calls // batch):
            t0 = now_ns()
            for _ in range(batch):
                lock(handle)
                unlock(handle)
            samples.append((now_ns() - t0) / batch)
    out["lock_call"] = median_us(samples)
    return out


def bench_evict(factory, name: str, leaves: int, reps: int, seed: int) -> float:
    w = Workload(seed)
    cache = factory()
    prepare = cache.prepare
    suffix = torch.randint(0, VOCAB, (leaves, SUFFIX_EVICT), generator=w.g, dtype=torch.int32)
    seqs = [prepare(torch.cat([w.prefix, suffix[i]])) for i in range(leaves)]
    build(cache, seqs)
    evict = getattr(cache, "evict_raw", cache.evict)
    # The oldest leaves go first, so re-inserting them (untimed) restores the tree.
    order = iter(range(reps * 64))
    samples = []
    cursor = 0
    for _ in range(reps):
        t0 = now_ns()
        evict(1024)
        samples.append(now_ns() - t0)
        k = 1024 // SUFFIX_EVICT
        back = seqs[cursor : cursor + k]
        cursor = (cursor + k) % leaves
        for s in back:
            start = (leaves + next(order)) * (PREFIX + SUFFIX_EVICT)
            cache.insert(s, torch.arange(start, start + len(s), dtype=torch.int32))
    del cache
    gc.collect()
    return median_us(samples)


def bench_namespaces(reps: int, seed: int, distinct: int = 2000) -> Dict[str, float]:
    """Matches of 1,024-token requests in the default namespace and in another,
    on one tree holding each request in both (the root then has twice the
    children): a namespace is keyed at the root only. Alternated samples."""
    rng = torch.Generator().manual_seed(seed)
    tree = _core.RadixTree(1)
    reqs, slot = [], 0
    for _ in range(distinct):
        ids = torch.randint(0, 50_000, (1024,), dtype=torch.int32, generator=rng)
        for ns in (0, 7):
            tree.insert_prefix(ids, torch.arange(slot, slot + 1024, dtype=torch.int32), 0, ns)
            slot += 1024
        reqs.append(ids)
    order = torch.randperm(distinct, generator=rng).tolist()
    samples: Dict[int, List[float]] = {0: [], 7: []}
    for r in range(reps):
        for ns in (0, 7) if r % 2 == 0 else (7, 0):
            ids = reqs[order[r % distinct]]
            t = now_ns()
            tree.match_prefix(ids, ns)
            samples[ns].append(now_ns() - t)
    return {"match_ns0": median_us(samples[0]), "match_ns7": median_us(samples[7])}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def no_huge_pages() -> None:
    """Transparent huge pages off for this process (Linux prctl
    PR_SET_THP_DISABLE), before the tree allocates anything."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(41, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE) failed")


def bytes_per_token(page_size: int = 1, tokens: int = 1 << 22, warm: bool = True) -> float:
    """RSS growth per cached token over `tokens` tokens in 1,024-token sequences,
    at `page_size` (the tree keeps a slot per page). With `warm`, a throwaway
    tree first caches 64 sequences (and is kept, so its memory is not
    reused), so what the first calls cost once (the code pages of the insert
    path, touched on first use: about 0.04 bytes a token over 4M tokens, and
    the Python allocator's pools the calls' short-lived objects take: 16 KiB,
    0.004 a token, where 8 warm-up sequences left one untouched) is not
    counted as the tree's."""
    g = torch.Generator().manual_seed(7)
    seqs = [
        torch.randint(0, VOCAB, (SEQ,), generator=g, dtype=torch.int32)
        for _ in range(tokens // SEQ)
    ]
    slots = [torch.arange(i * SEQ, (i + 1) * SEQ, dtype=torch.int32) for i in range(len(seqs))]
    # The warm-up tree stays alive, so the measured one cannot reuse its memory.
    warm_up = RadixCacheManager("cpu", page_size, aligned_pages=page_size > 1)
    for s, v in zip(seqs[:64] if warm else [], slots[:64]):
        warm_up.insert_prefix(s, v)
    gc.collect()
    before = rss_bytes()
    # Pages aligned in their pool, as a CacheManager's tree takes them (a bit a page).
    m = RadixCacheManager("cpu", page_size, aligned_pages=page_size > 1)
    for s, v in zip(seqs, slots):
        m.insert_prefix(s, v)
    after = rss_bytes()
    del warm_up
    # Random sequences may share a few leading tokens, so count what is stored.
    return (after - before) / m.size_info.total_size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=300, help="samples per case (default 300)")
    p.add_argument(
        "--leaves",
        type=int,
        nargs="+",
        default=[10_000, 1_000_000],
        help="tree sizes for the evict cases",
    )
    p.add_argument(
        "--peer-max-leaves",
        type=int,
        default=100_000,
        help="skip peers on evict trees larger than this",
    )
    p.add_argument("--no-peers", action="store_true", help="radixkv only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="print bytes per cached token and exit (run in a fresh process)",
    )
    p.add_argument("--memory-page-size", type=int, default=1, help="the page size of --memory-only")
    p.add_argument(
        "--memory-tokens", type=int, default=1 << 22, help="tokens cached by --memory-only"
    )
    p.add_argument(
        "--memory-no-huge-pages",
        action="store_true",
        help="--memory-only with transparent huge pages off for the process (the node "
        "arena's 2 MiB slabs then fault in 4 KiB at a time: the structure's own bytes)",
    )
    p.add_argument(
        "--memory-cold",
        action="store_true",
        help="--memory-only without the warm-up: the first calls' one-time costs counted too",
    )
    args = p.parse_args(argv)
    if args.memory_only:
        if args.memory_no_huge_pages:
            no_huge_pages()
        bpt = bytes_per_token(args.memory_page_size, args.memory_tokens, not args.memory_cold)
        print(f"{bpt:.3f}")
        return 0

    impls: Dict[str, Callable] = {"radixkv": RadixkvCache}
    if not args.no_peers:
        impls.update(load_peers())

    results: Dict[str, Dict[str, float]] = {}
    for name, factory in impls.items():
        print(f"running {name} ...", file=sys.stderr, flush=True)
        r = bench_core(factory, name, args.reps, args.seed)
        r.update(bench_realistic(factory, name, args.seed))
        for leaves in args.leaves:
            if name != "radixkv" and leaves > args.peer_max_leaves:
                continue
            reps = args.reps if name == "radixkv" else max(5, min(args.reps, 2_000_000 // leaves))
            r[f"evict@{leaves}"] = bench_evict(factory, name, leaves, reps, args.seed)
        results[name] = r
        gc.collect()

    cases = list(results["radixkv"].keys())
    names = list(results.keys())
    header = f"{'case':<16}" + "".join(f"{n:>16}" for n in names)
    print("\nmedian microseconds per operation (ratio = peer / radixkv)")
    print(header)
    for case in cases:
        row = f"{case:<16}"
        for n in names:
            v = results[n].get(case)
            if v is None:
                row += f"{'-':>16}"
            elif n == "radixkv":
                row += f"{v:>16.3f}"
            else:
                row += f"{v:>9.2f} ({v / results['radixkv'][case]:>4.1f}x)"
        print(row)
    # A fresh process per page size, so memory freed by the runs above cannot
    # hide growth.
    bpt = {}
    for page in MEMORY_PAGE_SIZES:
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--memory-only"]
            + ["--memory-page-size", str(page)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        bpt[page] = float(out.strip().splitlines()[-1])
    print(
        "\nradixkv memory, bytes per cached token (RSS growth over 4M tokens): "
        + ", ".join(f"page {page} {v:.2f}" for page, v in bpt.items())
    )
    for n in names:
        for case, v in results[n].items():
            base = results["radixkv"].get(case)
            print(
                json.dumps(
                    {
                        "bench": "radix",
                        "impl": n,
                        "case": case,
                        "median_us": round(v, 4),
                        "ratio_vs_radixkv": round(v / base, 2) if base else None,
                    }
                )
            )
    for page, v in bpt.items():
        case = "bytes_per_token" if page == 1 else f"bytes_per_token_page{page}"
        print(json.dumps({"bench": "radix", "impl": "radixkv", "case": case, "value": round(v, 2)}))
    ns = bench_namespaces(max(args.reps, 2000), args.seed)
    print(
        f"\nnamespaces: match of a 1,024-token request, default namespace "
        f"{ns['match_ns0']:.3f} us, namespace 7 {ns['match_ns7']:.3f} us "
        f"(ratio {ns['match_ns7'] / ns['match_ns0']:.2f})"
    )
    print(
        json.dumps(
            {
                "bench": "radix",
                "impl": "radixkv",
                "case": "namespaces",
                **{k: round(v, 4) for k, v in ns.items()},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
