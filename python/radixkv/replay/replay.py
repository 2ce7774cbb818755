"""Replays requests through a CacheManager the way a serving engine does."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from radixkv.replay.traces import Request, TokenMaker, max_hash_id, optimal_hit_tokens
from radixkv.scheduler import CacheManager


@dataclass
class KVShape:
    """The model shape of the KV pool the replay stores into."""

    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 8
    dtype: torch.dtype = torch.float16

    @classmethod
    def parse(cls, text: str) -> "KVShape":
        """`layers,heads,head_dim[,dtype]`, e.g. `2,8,128,bfloat16`."""
        parts = text.split(",")
        if len(parts) not in (3, 4):
            raise ValueError(f"--kv must be layers,heads,head_dim[,dtype], got {text!r}")
        try:
            layers, heads, dim = (int(p) for p in parts[:3])
        except ValueError:
            raise ValueError(f"--kv sizes must be integers, got {text!r}") from None
        from radixkv.kvcache.mha_pool import SUPPORTED_DTYPES

        dtype = getattr(torch, parts[3].strip(), None) if len(parts) == 4 else torch.float16
        if min(layers, heads, dim) < 1:
            raise ValueError(f"--kv sizes must be >= 1, got {text!r}")
        if dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise ValueError(f"--kv dtype must be one of {names}, got {parts[3]!r}")
        return cls(layers, heads, dim, dtype)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.num_layers},{self.num_kv_heads},{self.head_dim},{dtype}"

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass
class ReplayResult:
    policy: str
    page_size: int
    capacity_tokens: int
    requests: int = 0
    skipped_requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    output_tokens: int = 0
    evicted_tokens: int = 0
    stored_tokens: int = 0
    wall_s: float = 0.0
    latency_us: Dict[str, Dict[str, float]] = field(default_factory=dict)
    # The unbounded optimum over the requests replayed (None when pages and
    # trace blocks differ, where the block-level optimum does not apply).
    optimal_hit_tokens: Optional[int] = None
    # Most pages in use at once (cached or held by the request in flight).
    peak_pages: int = 0
    # Bytes of the K/V pool stores went to (0 when storing is off).
    pool_bytes: int = 0
    # Stopped early (Ctrl-C): the figures cover the requests replayed so far.
    interrupted: bool = False

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def to_json(self) -> dict:
        return {
            "policy": self.policy,
            "page_size": self.page_size,
            "capacity_tokens": self.capacity_tokens,
            "requests": self.requests,
            "skipped_requests": self.skipped_requests,
            "input_tokens": self.input_tokens,
            "hit_tokens": self.hit_tokens,
            "token_hit_rate": round(self.token_hit_rate, 6),
            "computed_tokens": self.computed_tokens,
            "output_tokens": self.output_tokens,
            "evicted_tokens": self.evicted_tokens,
            "stored_tokens": self.stored_tokens,
            "wall_s": round(self.wall_s, 4),
            "requests_per_s": round(self.requests / self.wall_s, 1) if self.wall_s else None,
            "latency_us": self.latency_us,
            "optimal_hit_tokens": self.optimal_hit_tokens,
            "peak_pages": self.peak_pages,
            "pool_bytes": self.pool_bytes,
            "interrupted": self.interrupted,
        }


def pages_for_all(requests: Sequence[Request], page_size: int) -> int:
    """Pages that hold every token of every request at once: no eviction ever."""
    return sum(-(-(r.input_length + r.output_length) // page_size) for r in requests)


def _percentiles(samples_ns: List[int]) -> Dict[str, float]:
    if not samples_ns:
        return {"count": 0, "p50": None, "p99": None}
    t = torch.tensor(samples_ns, dtype=torch.float64) / 1e3
    q = torch.quantile(t, torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
    return {"count": len(samples_ns), "p50": round(q[0], 3), "p99": round(q[1], 3)}


class _Progress:
    """A one-line progress bar on stderr for runs longer than a second."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.start = time.perf_counter()
        self.shown = -1

    def update(self, done: int) -> None:
        if not self.enabled or self.total == 0:
            return
        pct = 100 * done // self.total
        if pct != self.shown and time.perf_counter() - self.start > 1.0:
            self.shown = pct
            bar = "#" * (pct // 4)
            print(f"\rreplay [{bar:<25}] {pct:3d}% {done}/{self.total}", end="",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.shown >= 0:
            print(file=sys.stderr)


def replay(requests: Sequence[Request], *, block_size: int, page_size: int,
           capacity_pages: Optional[int] = None, policy: str = "radix",
           kv: Optional[KVShape] = None, store: bool = True, progress: bool = False,
           seed: int = 0) -> ReplayResult:
    """Drives `requests` one after another through a CacheManager.

    Per request: match the prompt (all but its last token), lock the match,
    allocate the rest (evicting what is missing), store the K/V of the
    computed tokens into an MHAKVCache, then decode the output (allocating
    more pages when the last one fills, storing its K/V), and finally cache
    prompt and output and release the request's pages and lock. A request
    larger than the whole pool is skipped and counted. Ctrl-C stops after the
    request in flight; the result covers what was replayed (`interrupted`).
    """
    # The replay is one thread driving the cache, like a scheduler. torch's
    # intra-op threads would only spin between the small tensor ops here
    # and take the second core from the driver.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _replay(requests, block_size=block_size, page_size=page_size,
                       capacity_pages=capacity_pages, policy=policy, kv=kv, store=store,
                       progress=progress, seed=seed)
    finally:
        torch.set_num_threads(threads)


def _replay(requests, *, block_size, page_size, capacity_pages, policy, kv, store, progress,
            seed) -> ReplayResult:
    if capacity_pages is None:
        capacity_pages = pages_for_all(requests, page_size)
    tokens = TokenMaker(block_size, max_hash_id(requests))
    cm = CacheManager(capacity_pages, page_size=page_size, type=policy)
    kv = kv or KVShape()
    pool = None
    if store:
        from radixkv.kvcache import MHAKVCache

        pool = MHAKVCache(kv.num_kv_heads, kv.num_layers, kv.head_dim, capacity_pages,
                          kv.dtype, page_size=page_size, tp_size=1)
        longest = max(r.input_length + r.output_length for r in requests)
        g = torch.Generator().manual_seed(seed)
        src = torch.randn(longest, kv.num_kv_heads, kv.head_dim, generator=g).to(kv.dtype)

    def store_kv(slots: torch.Tensor) -> None:
        n = slots.numel()
        for layer in range(kv.num_layers):
            pool.store_kv(src[:n], src[:n], slots, layer)
        result.stored_tokens += n

    result = ReplayResult(policy, page_size, capacity_pages * page_size)
    result.pool_bytes = pool.nbytes if pool is not None else 0
    lat: Dict[str, List[int]] = {"match": [], "allocate": [], "insert": [], "evict": []}
    clock = time.perf_counter_ns
    bar = _Progress(len(requests), progress)
    replayed: List[Request] = []
    t_start = time.perf_counter()
    try:
        for i, req in enumerate(requests):
            bar.update(i)
            total = req.input_length + req.output_length
            if -(-total // page_size) > capacity_pages:
                result.skipped_requests += 1
                continue
            ids = tokens.prompt(req)

            t0 = clock()
            handle, cached = cm.match_req(ids)
            lat["match"].append(clock() - t0)
            cm.lock(handle)
            hit = handle.cached_len

            # Prefill: everything after the match, the last prompt token included.
            t0 = clock()
            evicted = cm.make_room(req.input_length - hit)
            t1 = clock()
            own = cm.allocate(req.input_length - hit)
            t2 = clock()
            if evicted:
                lat["evict"].append(t1 - t0)
                result.evicted_tokens += evicted
            lat["allocate"].append(t2 - t0)
            if store:
                store_kv(own[: req.input_length - hit])

            # Decode: the last page's spare slots first, then new pages.
            out = req.output_length
            spare = own.numel() - (req.input_length - hit)
            if out > spare:
                t0 = clock()
                evicted = cm.make_room(out - spare)
                t1 = clock()
                more = cm.allocate(out - spare)
                t2 = clock()
                if evicted:
                    lat["evict"].append(t1 - t0)
                    result.evicted_tokens += evicted
                lat["allocate"].append(t2 - t0)
                own = torch.cat([own, more])
            if store and out:
                start = req.input_length - hit
                store_kv(own[start:start + out])
            result.peak_pages = max(result.peak_pages, capacity_pages - cm.free_pages)

            full_ids = torch.cat([ids, tokens.output(out)]) if out else ids
            t0 = clock()
            cm.free_and_cache_finished_req(handle, full_ids, torch.cat([cached, own]))
            lat["insert"].append(clock() - t0)

            replayed.append(req)
            result.requests += 1
            result.input_tokens += req.input_length
            result.hit_tokens += hit
            result.computed_tokens += req.input_length - hit
            result.output_tokens += out
    except KeyboardInterrupt:
        # A request interrupted half-way holds pages and a lock: the figures
        # stop at the last finished request, and the pool's check is skipped.
        result.interrupted = True
    result.wall_s = time.perf_counter() - t_start
    bar.close()
    if not result.interrupted:
        cm.check_integrity()
        if cm.held_pages != 0:
            raise RuntimeError(f"replay leaked {cm.held_pages} pages")
    if page_size == block_size:
        result.optimal_hit_tokens = optimal_hit_tokens(replayed, block_size)
    result.latency_us = {k: _percentiles(v) for k, v in lat.items()}
    return result
