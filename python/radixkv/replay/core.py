"""One serving instance of a replay and what it reports: the model shape of its
KV pool, its storage tier, its result. The in-process replay (replay.py) and
the one over several processes (instances.py) both build on it."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

import torch

from radixkv.kvcache.page_ids import slots_of_pages
from radixkv.replay.traces import Request, TokenMaker
from radixkv.scheduler import CacheManager, RetainBudgetError, RetentionClaim

if TYPE_CHECKING:
    from radixkv.scheduler.storage_tier import StorageFaultPolicy
    from radixkv.storage.base import StorageBackend

# The K/V rows are stored and checked only by an instance with a pool (`store`).
_NO_POOL = "this instance stores no K/V: it has no pool (store=False)"


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
        from radixkv.kvcache.pool_args import SUPPORTED_DTYPES

        dtype = getattr(torch, parts[3].strip(), None) if len(parts) == 4 else torch.float16
        if min(layers, heads, dim) < 1:
            raise ValueError(f"--kv sizes must be >= 1, got {text!r}")
        if dtype is None or dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise ValueError(f"--kv dtype must be one of {names}, got {parts[3]!r}")
        return cls(layers, heads, dim, dtype)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.num_layers},{self.num_kv_heads},{self.head_dim},{dtype}"

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def rows(self, tokens: torch.Tensor, start: int, layer: int, side: int) -> torch.Tensor:
        """The K (side 0) or V (side 1) rows the replay stores for `tokens` at
        positions `start, start + 1, ...` in `layer`: small integers derived
        from token id, position, layer and side, exact in every dtype, so a
        row that comes back from the host tier can be checked bit for bit."""
        n, width = len(tokens), self.num_kv_heads * self.head_dim
        key = (
            tokens.to(torch.int64) * 1000003
            + torch.arange(start, start + n, dtype=torch.int64) * 7919
            + layer * 104729
            + side * 15485863
        )
        vals = (key[:, None] + torch.arange(width, dtype=torch.int64) * 31) % 401 - 200
        return vals.to(torch.float32).to(self.dtype).view(n, self.num_kv_heads, self.head_dim)


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
    latency_us: Dict[str, Dict[str, Optional[float]]] = field(default_factory=dict)
    # The unbounded optimum over the requests replayed (None when pages and
    # trace blocks differ, where the block-level optimum does not apply).
    optimal_hit_tokens: Optional[int] = None
    # Most pages in use at once (cached or held by the request in flight).
    peak_pages: int = 0
    # Bytes of the K/V pool stores went to (0 when storing is off).
    pool_bytes: int = 0
    # Stopped early (Ctrl-C): the figures cover the requests replayed so far.
    interrupted: bool = False
    # The host tier (host_capacity_tokens 0: none). hit_tokens is
    # device_hit_tokens + host_hit_tokens.
    host_capacity_tokens: int = 0
    write_policy: Optional[str] = None
    eviction_policy: str = "lru"
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    loaded_back_tokens: int = 0
    backed_up_tokens: int = 0
    host_evicted_tokens: int = 0
    failed_loads: int = 0
    host_pool_bytes: int = 0
    host_codec: Optional[str] = None  # how the host holds pages (None: as the device does)
    # Loaded-back tokens whose K/V rows differ from what was stored (stored runs).
    kv_mismatches: int = 0
    # The storage tier (None: none). hit_tokens also counts storage hits:
    # tokens a request's prefetch read from storage and the request then used.
    storage: Optional[str] = None
    storage_codec: Optional[str] = None  # what the store writes pages as (None: as they are)
    prefetch_policy: Optional[str] = None
    storage_hit_tokens: int = 0
    prefetched_tokens: int = 0
    storage_written_pages: int = 0
    storage_errors: int = 0
    # Retention claims (--retain): each session's finished turn is claimed
    # for retain_ttl_s seconds of trace time, within retain_budget_tokens.
    retain_ttl_s: Optional[float] = None
    retain_budget_tokens: int = 0
    retain_claims: int = 0
    retain_refused: int = 0
    retain_expired: int = 0
    # The manager's own figures at the end (CacheMetrics as a dict): hits
    # per tier as it attributes them at match time, residency, claims.
    cache_metrics: Dict[str, int] = field(default_factory=dict)
    # Per instance when there are several (their JSON objects).
    instances: List[dict] = field(default_factory=list)

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
            "host_capacity_tokens": self.host_capacity_tokens,
            "write_policy": self.write_policy,
            "eviction_policy": self.eviction_policy,
            "device_hit_tokens": self.device_hit_tokens,
            "host_hit_tokens": self.host_hit_tokens,
            "device_hit_rate": self._rate(self.device_hit_tokens),
            "host_hit_rate": self._rate(self.host_hit_tokens),
            "loaded_back_tokens": self.loaded_back_tokens,
            "backed_up_tokens": self.backed_up_tokens,
            "host_evicted_tokens": self.host_evicted_tokens,
            "failed_loads": self.failed_loads,
            "host_pool_bytes": self.host_pool_bytes,
            "kv_mismatches": self.kv_mismatches,
            "storage": self.storage,
            "storage_codec": self.storage_codec,
            "host_codec": self.host_codec,
            "prefetch_policy": self.prefetch_policy,
            "storage_hit_tokens": self.storage_hit_tokens,
            "storage_hit_rate": self._rate(self.storage_hit_tokens),
            "prefetched_tokens": self.prefetched_tokens,
            "storage_written_pages": self.storage_written_pages,
            "storage_errors": self.storage_errors,
            "retain_ttl_s": self.retain_ttl_s,
            "retain_budget_tokens": self.retain_budget_tokens,
            "retain_claims": self.retain_claims,
            "retain_refused": self.retain_refused,
            "retain_expired": self.retain_expired,
            "cache_metrics": self.cache_metrics,
            "instances": self.instances,
        }

    def _rate(self, tokens: int) -> float:
        return round(tokens / self.input_tokens, 6) if self.input_tokens else 0.0


def pages_for_all(requests: Sequence[Request], page_size: int) -> int:
    """Pages that hold every token of every request at once: no eviction ever."""
    return sum(-(-(r.input_length + r.output_length) // page_size) for r in requests)


def percentiles(samples_ns: List[int]) -> Dict[str, Optional[float]]:
    if not samples_ns:
        return {"count": 0, "p50": None, "p99": None}
    t = torch.tensor(samples_ns, dtype=torch.float64) / 1e3
    q = torch.quantile(t, torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
    return {"count": len(samples_ns), "p50": round(q[0], 3), "p99": round(q[1], 3)}


class StorageUnavailable(RuntimeError):
    """The storage tier could not be opened (a directory that cannot be
    written, a Mooncake master that does not answer)."""


@dataclass
class StorageConfig:
    """The storage tier a replay writes to and prefetches from."""

    kind: str  # "file" or "mooncake"
    directory: Optional[str] = None  # file
    max_bytes: Optional[int] = None  # file: bound on the directory
    # Pages stored encoded ("float8"): a file store encodes plain host pages;
    # Mooncake moves pages as they are, so it needs the host codec too.
    codec: Optional[str] = None
    master_address: Optional[str] = None  # mooncake
    metadata_server: Optional[str] = None  # mooncake
    segment_bytes: int = 256 << 20  # mooncake: memory each instance lends
    # mooncake: the address each instance advertises. Mooncake's transfer
    # engine listens on every interface whatever it is (see MooncakeStorage):
    # the replay accepts that, and the command line says so.
    local_hostname: str = "127.0.0.1"
    prefetch_policy: str = "wait_complete"
    namespace: Optional[str] = None
    fault_seed: Optional[int] = None  # wrap the backend in FaultyStorage (tests)
    fault_call: float = 0.05  # ... failing this share of calls
    fault_page: float = 0.1  # ... and of pages
    faults: Optional[StorageFaultPolicy] = None  # the tier's (None: defaults)

    def backend(self, kv: "KVShape", page_size: int) -> StorageBackend:
        from radixkv.storage import FaultyStorage, FileStorage, MooncakeStorage

        if self.kind not in ("file", "mooncake"):
            raise ValueError(f"storage must be file or mooncake, got {self.kind!r}")
        backend: StorageBackend
        try:
            if self.kind == "file":
                if self.directory is None:
                    raise TypeError("storage 'file' needs a directory")
                files = FileStorage(
                    self.directory,
                    self.fingerprint(kv, page_size),
                    self.max_bytes,
                    codec=self.codec,
                )
                files.wait_indexed()  # a replay starts from the whole index
                backend = files
            else:
                if self.master_address is None or self.metadata_server is None:
                    raise TypeError("storage 'mooncake' needs master_address and metadata_server")
                backend = MooncakeStorage(
                    self.master_address,
                    self.metadata_server,
                    local_hostname=self.local_hostname,
                    listen_on_all_interfaces=True,
                    segment_bytes=self.segment_bytes,
                    codec=self.codec,
                )
        except (OSError, RuntimeError) as e:
            where = self.directory if self.kind == "file" else self.master_address
            raise StorageUnavailable(f"{where}: {e}") from e
        if self.fault_seed is not None:
            backend = FaultyStorage(
                backend, seed=self.fault_seed, fail_call=self.fault_call, fail_page=self.fault_page
            )
        return backend

    def fingerprint(self, kv: "KVShape", page_size: int) -> bytes:
        from radixkv.storage import config_fingerprint

        return config_fingerprint(
            model="radixkv-replay",
            dtype=kv.dtype,
            page_size=page_size,
            layout="page_first",
            num_layers=kv.num_layers,
            kv_heads=kv.num_kv_heads,
            head_dim=kv.head_dim,
            namespace=self.namespace,
        )


class Instance:
    """One serving instance of a replay: its pools, its CacheManager, its figures.

    Per request: prefetch from storage (when configured, waiting as its
    policy says) and match the prompt (all but its last token); lock the
    match, or load back its host part; allocate the rest (evicting what is
    missing) and store the computed tokens' K/V; decode the output
    (allocating more pages when the last one fills, storing its K/V); cache
    prompt and output and release the request's pages and lock. Unless
    `overlap`, the request's copies (backups, writes to storage) finish
    before the next request matches.

    With `retain_ttl_s` the instance models an agent that comes back: when a
    request of a session finishes, its whole sequence is claimed (retain)
    for that many seconds of trace time, and the session's previous claim is
    released. Claims hold at most `retain_budget_tokens`.
    """

    def __init__(
        self,
        *,
        block_size: int,
        page_size: int,
        capacity_pages: int,
        policy: str,
        kv: KVShape,
        store: bool,
        host_pages: int,
        write_policy: str,
        storage: Optional[StorageConfig],
        max_hash: int,
        host_codec: Optional[str] = None,
        overlap: bool = False,
        eviction_policy: str = "lru",
        eviction_policy_config: Optional[dict] = None,
        retain_ttl_s: Optional[float] = None,
        retain_budget_tokens: int = 0,
    ):
        self.page_size, self.capacity_pages, self.kv, self.store = (
            page_size,
            capacity_pages,
            kv,
            store,
        )
        self.host_pages, self.overlap = host_pages, overlap
        self.tokens = TokenMaker(block_size, max_hash)
        self.pool = None
        if store:
            from radixkv.kvcache import MHAKVCache

            self.pool = MHAKVCache(
                kv.num_kv_heads,
                kv.num_layers,
                kv.head_dim,
                capacity_pages,
                kv.dtype,
                page_size=page_size,
                tp_size=1,
            )
        backend = storage.backend(kv, page_size) if storage is not None else None
        # The manager's clock is the trace's: claims expire in trace time.
        self.now = 0.0
        self.retain_ttl_s = retain_ttl_s
        self.claims: Dict[str, RetentionClaim] = {}
        # Without a pool the tier keeps its bookkeeping only, its copies run
        # inline (manual) when drained.
        self.cm = CacheManager(
            capacity_pages,
            page_size=page_size,
            type=policy,
            host_num_pages=host_pages,
            write_policy=write_policy,
            kv_cache=self.pool,
            host_codec=host_codec,
            manual_copies=self.pool is None,
            storage=backend,
            storage_seed=storage.fingerprint(kv, page_size) if storage is not None else None,
            prefetch_policy=storage.prefetch_policy if storage is not None else "best_effort",
            storage_faults=storage.faults if storage is not None else None,
            eviction_policy=eviction_policy,
            eviction_policy_config=eviction_policy_config if eviction_policy == "tlru" else None,
            retain_budget_tokens=retain_budget_tokens,
            clock=lambda: self.now,
        )
        r = self.result = ReplayResult(policy, page_size, capacity_pages * page_size)
        r.eviction_policy = eviction_policy
        self.paged = policy == "radix"  # (the page path is the radix cache's)
        if retain_ttl_s is not None:
            r.retain_ttl_s, r.retain_budget_tokens = retain_ttl_s, retain_budget_tokens
        r.pool_bytes = self.pool.nbytes if self.pool is not None else 0
        r.host_capacity_tokens = host_pages * page_size
        if host_pages:
            r.write_policy = write_policy
            r.host_pool_bytes = self.cm.host_pool.nbytes if self.cm.host_pool is not None else 0
        # Rows that went through a lossy codec come back within its error.
        self.lossy = host_codec is not None or (storage is not None and storage.codec is not None)
        r.host_codec = host_codec
        if storage is not None:
            r.storage = storage.kind
            r.prefetch_policy = storage.prefetch_policy
            r.storage_codec = storage.codec
        self.lat: Dict[str, List[int]] = {"match": [], "allocate": [], "insert": [], "evict": []}
        if host_pages:
            self.lat["load_back"] = []
        if storage is not None:
            self.lat["prefetch"] = []
        self.replayed: List[Request] = []

    def _store_kv(self, slots: torch.Tensor, ids: torch.Tensor, start: int) -> None:
        kv, pool = self.kv, self.pool
        if pool is None:
            raise RuntimeError(_NO_POOL)
        for layer in range(kv.num_layers):
            pool.store_kv(
                kv.rows(ids, start, layer, 0), kv.rows(ids, start, layer, 1), slots, layer
            )
        self.result.stored_tokens += len(slots)

    def _check_loaded(self, slots: torch.Tensor, ids: torch.Tensor, start: int) -> int:
        """Tokens among `slots` whose rows differ from what was stored for
        them: bit for bit, or with a lossy codec (host or storage) by more than its
        error (float8 e4m3 keeps 4 significant bits, and a page may go
        through it twice: an eighth of the value, and 2^-8 of the largest,
        200, for values that round to its subnormals)."""
        kv, pool = self.kv, self.pool
        if pool is None:
            raise RuntimeError(_NO_POOL)
        bad = torch.zeros(len(slots), dtype=torch.bool)
        for layer in range(kv.num_layers):  # k_cache(layer) waits for the layer's load
            for side, cache in ((0, pool.k_cache(layer)), (1, pool.v_cache(layer))):
                rows = cache.reshape(-1, kv.num_kv_heads, kv.head_dim)[slots.long()]
                want = kv.rows(ids, start, layer, side)
                if self.lossy:
                    err = (rows.float() - want.float()).abs()
                    off = ~(err <= want.float().abs() / 8 + 200 / 256)  # (a NaN is off)
                else:
                    off = rows.view(torch.uint8) != want.view(torch.uint8)
                bad |= off.flatten(1).any(1)
        return int(bad.sum())

    def skips(self, req: Request) -> bool:
        return too_large(req, self.page_size, self.capacity_pages)

    def serve(self, req: Request, fresh_at: Optional[int] = None) -> None:
        cm, result, lat, clock = self.cm, self.result, self.lat, time.perf_counter_ns
        if self.skips(req):
            result.skipped_requests += 1
            return
        self.now = req.timestamp
        if fresh_at is not None:
            self.tokens.seek(fresh_at)
        full_ids = self.tokens.request_tokens(req)
        ids = full_ids[: req.input_length]

        prefetched = 0
        if "prefetch" in lat:
            t0 = clock()
            op = cm.prefetch(ids)
            if op is not None:
                prefetched = cm.wait_prefetch(op)
            lat["prefetch"].append(clock() - t0)
        # The radix cache's requests go through the page path (page ids, not
        # slots, cross); slots are made only where K/V bytes are written.
        paged = self.paged
        t0 = clock()
        handle, cached = cm.match_pages(ids) if paged else cm.match_req(ids)
        lat["match"].append(clock() - t0)
        device_hit, host_hit = handle.cached_len, handle.host_hit_len
        if host_hit:
            t0 = clock()
            handle, cached = cm.load_back_pages(handle) if paged else cm.load_back(handle)
            lat["load_back"].append(clock() - t0)
            loaded = handle.cached_len - device_hit
            if self.store and loaded:
                slots = self._slots(cached)
                result.kv_mismatches += self._check_loaded(
                    slots[device_hit:], ids[device_hit : device_hit + loaded], device_hit
                )
        else:
            cm.lock(handle)
        hit = handle.cached_len

        # Prefill: everything after the match, the last prompt token included.
        allocate = cm.allocate_pages if paged else cm.allocate
        unit = self.page_size if paged else 1
        t0 = clock()
        evicted = cm.make_room(req.input_length - hit)
        t1 = clock()
        own = allocate(req.input_length - hit)
        t2 = clock()
        if evicted:
            lat["evict"].append(t1 - t0)
            result.evicted_tokens += evicted
        lat["allocate"].append(t2 - t0)
        if self.store:
            self._store_kv(self._slots(own)[: req.input_length - hit], ids[hit:], hit)

        # Decode: the last page's spare slots first, then new pages.
        out = req.output_length
        spare = own.shape[0] * unit - (req.input_length - hit)
        if out > spare:
            t0 = clock()
            evicted = cm.make_room(out - spare)
            t1 = clock()
            more = allocate(out - spare)
            t2 = clock()
            if evicted:
                lat["evict"].append(t1 - t0)
                result.evicted_tokens += evicted
            lat["allocate"].append(t2 - t0)
            indices = torch.cat([cached, own, more])
        else:
            indices = torch.cat([cached, own])
        if self.store and out:
            self._store_kv(
                self._slots(indices)[req.input_length : req.input_length + out],
                full_ids[req.input_length :],
                req.input_length,
            )
        result.peak_pages = max(result.peak_pages, self.capacity_pages - cm.free_pages)

        t0 = clock()
        if paged:
            cm.free_and_cache_finished_req_pages(handle, full_ids, indices)
        else:
            cm.free_and_cache_finished_req(handle, full_ids, indices)
        lat["insert"].append(clock() - t0)
        if self.retain_ttl_s is not None and req.session is not None:
            self._retain(req.session, full_ids)
        if self.host_pages:
            if self.overlap:
                cm.writing_check()
                result.failed_loads += len(cm.loading_check())
                cm.storage_check()
            else:
                # The request's copies finish before the next one matches.
                result.failed_loads += len(cm.drain())

        self.replayed.append(req)
        result.requests += 1
        result.input_tokens += req.input_length
        result.hit_tokens += hit
        result.device_hit_tokens += device_hit
        from_storage = min(prefetched, hit - device_hit)
        result.storage_hit_tokens += from_storage
        result.host_hit_tokens += hit - device_hit - from_storage
        result.computed_tokens += req.input_length - hit
        result.output_tokens += out

    def _slots(self, indices: torch.Tensor) -> torch.Tensor:
        """A request's slots from what its calls gave: page ids on the page path."""
        return slots_of_pages(indices, self.page_size) if self.paged else indices

    def _retain(self, session: str, full_ids: torch.Tensor) -> None:
        """The session's turn is over: its conversation so far is claimed
        until its next turn (or the claim's time runs out)."""
        cm = self.cm
        previous = self.claims.pop(session, None)
        if previous is not None:
            cm.release(previous)
        try:
            self.claims[session] = cm.retain(full_ids, ttl_s=self.retain_ttl_s)
        except RetainBudgetError:
            pass

    def finish(self, interrupted: bool = False) -> ReplayResult:
        cm, result = self.cm, self.result
        if self.retain_ttl_s is not None:
            m = cm.metrics
            result.retain_claims = m.retain_claims_made
            result.retain_refused = m.retain_claims_refused
            result.retain_expired = m.retain_claims_expired
        result.interrupted = interrupted
        if self.host_pages:
            result.failed_loads += len(cm.drain())
            counters = cm.tier_counters
            if counters is None:  # (a manager with a host tier has them)
                raise RuntimeError("the host tier's counters are missing")
            result.loaded_back_tokens = counters.loaded_back
            result.backed_up_tokens = counters.backed_up
            result.host_evicted_tokens = counters.host_evicted
        storage = cm.storage_counters
        if storage is not None:
            result.prefetched_tokens = storage.prefetched_tokens
            result.storage_written_pages = storage.written_pages
            result.storage_errors = storage.errors
        # A stop (Ctrl-C) comes between requests: the pool is whole either way.
        cm.check_integrity()
        result.cache_metrics = dataclasses.asdict(cm.metrics)
        if cm.held_pages != 0:
            raise RuntimeError(f"replay leaked {cm.held_pages} pages")
        cm.close()
        return result


def too_large(req: Request, page_size: int, capacity_pages: int) -> bool:
    return -(-(req.input_length + req.output_length) // page_size) > capacity_pages
