"""What radixkv's hierarchical cache inside SGLang is made of: SGLang's own
HiCache flags, read as HiCache reads them, and radixkv's features from one
JSON config.

radixkv's config is the environment variable `RADIXKV_SGLANG_CONFIG`: a JSON
object, or `@path` naming a file holding one. Every key is optional; an
unknown key is an error at start-up:

    eviction_policy         one of radixkv's policies (lru, lfu, fifo, mru,
                            priority, slru, tlru); default SGLang's
                            --radix-eviction-policy
    eviction_policy_config  the policy's parameters (an object), as
                            CacheManager(eviction_policy_config=) takes them
    host_codec              "float8": host pages held as float8 e4m3 with a
                            scale per page, layer and head (about twice the
                            pages in the same --hicache-size); null: plain
    quotas                  a list of {"extra_key": ..., "cache_salt": ...,
                            "device_tokens" | "device_bytes": ...,
                            "host_tokens" | "host_bytes": ...}: what the
                            requests of one extra_key (and cache_salt) keep
                            cached on each tier (CacheManager.set_quota)
    retain_budget_tokens    the retention budget (CacheManager)
    max_namespaces          extra_key names remembered (CacheManager)

The HiCache flags: --hicache-ratio / --hicache-size size the host pool's
memory (times the device pool's bytes, or GB), in pages of radixkv's host
page size, so a float8 host holds more of them in the same memory; --hicache-write-policy, --hicache-mem-layout
(layer_first, page_first or page_first_direct; radixkv keeps layer_first or
page_first), --hicache-io-backend (kernel or direct: both are radixkv's copy
engine here), --hicache-storage-backend (file, mooncake, or dynamic naming
radixkv's `radixkv.compat.sglang.hicache_storage`) with
--hicache-storage-backend-extra-config (radixkv's storage options, see
radixkv.storage.staged, and SGLang's prefetch_threshold,
prefetch_timeout_base and prefetch_timeout_per_ki_token), and
--hicache-storage-prefetch-policy. `--kv-events-config` with the zmq
publisher gives radixkv's publisher (epochs, a replay socket, snapshots) in
SGLang's place.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional, Tuple

from radixkv.kvcache.page_codec import check_codec
from radixkv.kvcache.radix_manager import EVICTION_POLICIES
from radixkv.scheduler.host_tier import WRITE_POLICIES
from radixkv.scheduler.storage_tier import PREFETCH_POLICIES

ENV = "RADIXKV_SGLANG_CONFIG"

_KEYS = (
    "eviction_policy",
    "eviction_policy_config",
    "host_codec",
    "quotas",
    "retain_budget_tokens",
    "max_namespaces",
)
_QUOTA_KEYS = (
    "extra_key",
    "cache_salt",
    "device_tokens",
    "device_bytes",
    "host_tokens",
    "host_bytes",
)
# SGLang's host layouts and what radixkv keeps for each.
_LAYOUTS = {
    "layer_first": "layer_first",
    "page_first": "page_first",
    "page_first_direct": "page_first",
}
_IO_BACKENDS = ("kernel", "direct")
# Keys SGLang's extra config carries for its own prefetch logic (not the store's).
_PREFETCH_KEYS = (
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
)
# The dynamic-backend keys that only name the class.
_DYNAMIC_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
OUR_STORAGE_MODULE = "radixkv.compat.sglang.hicache_storage"


def load_config(text: Optional[str] = None) -> Dict[str, Any]:
    """radixkv's config: `text` (default: the environment variable), JSON or
    `@path`; {} when there is none. ValueError names what is wrong."""
    if text is None:
        text = os.environ.get(ENV)
    if text is None or not text.strip():
        return {}
    where = ENV
    if text.startswith("@"):
        where = text[1:]
        with open(where) as f:
            text = f.read()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: radixkv's config is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: radixkv's config must be a JSON object")
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            f"(radixkv knows {', '.join(_KEYS)})"
        )
    return config


@dataclasses.dataclass
class Quota:
    extra_key: Optional[str]
    cache_salt: Optional[str]
    limits: Dict[str, int]


@dataclasses.dataclass
class Storage:
    """The storage tier: the backend's options (storage.staged's), and
    SGLang's prefetch knobs."""

    options: Dict[str, Any]
    prefetch_policy: str
    threshold_tokens: int = 256
    timeout_base_s: float = 1.0
    timeout_per_ki_token_s: float = 0.25


@dataclasses.dataclass
class Settings:
    """Everything the hierarchical cache is built from."""

    write_policy: str = "write_through"
    host_layout: str = "page_first"
    host_codec: Optional[str] = None
    hicache_ratio: Optional[float] = 2.0
    hicache_size_gb: float = 0.0
    eviction_policy: str = "lru"
    eviction_policy_config: Optional[dict] = None
    quotas: List[Quota] = dataclasses.field(default_factory=list)
    retain_budget_tokens: Optional[int] = None
    max_namespaces: int = 1 << 16
    storage: Optional[Storage] = None
    kv_events: Optional[Dict[str, Any]] = None

    def host_pages(self, device_pages: int, device_page_bytes: int, host_page_bytes: int) -> int:
        """Host pages in the memory HiCache gives its pool: `hicache_size_gb`
        GB when given, else `hicache_ratio` times the device pool's bytes.
        A float8 host page takes fewer bytes, so the same memory holds more."""
        if self.hicache_size_gb > 0:
            memory = self.hicache_size_gb * 1e9
        else:
            ratio = 2.0 if self.hicache_ratio is None else self.hicache_ratio
            memory = ratio * device_pages * device_page_bytes
        return max(1, int(memory) // host_page_bytes)


def _extra_config(raw) -> Dict[str, Any]:
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        return dict(raw)
    if isinstance(raw, str):
        if raw.startswith("@"):
            with open(raw[1:]) as f:
                raw = f.read()
        try:
            out = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"--hicache-storage-backend-extra-config is not JSON ({e})") from None
        if isinstance(out, dict):
            return out
    raise ValueError("--hicache-storage-backend-extra-config must be a JSON object")


def _storage(sg: Dict[str, Any]) -> Optional[Storage]:
    backend = sg.get("hicache_storage_backend")
    if backend is None:
        return None
    extra = _extra_config(sg.get("hicache_storage_backend_extra_config"))
    if backend == "dynamic":
        module = extra.get("module_path")
        if module != OUR_STORAGE_MODULE:
            raise ValueError(
                f"--hicache-storage-backend dynamic with module_path {module!r}: radixkv's "
                f"hierarchical cache writes to its own stores only (module_path "
                f"{OUR_STORAGE_MODULE!r}, or --hicache-storage-backend file or mooncake)"
            )
        backend = extra.get("backend", "file")
    elif backend not in ("file", "mooncake"):
        raise ValueError(
            f"--hicache-storage-backend {backend}: radixkv's hierarchical cache writes to "
            "its file store or Mooncake Store (file, mooncake, or dynamic with "
            f"module_path {OUR_STORAGE_MODULE!r})"
        )
    if extra.get("backend", backend) != backend:
        raise ValueError(
            f"--hicache-storage-backend {backend} but the extra config says backend "
            f"{extra['backend']!r}"
        )
    options = {k: v for k, v in extra.items() if k not in _PREFETCH_KEYS + _DYNAMIC_KEYS}
    options["backend"] = backend
    if backend == "file" and not options.get("directory"):
        options["directory"] = (
            sg.get("file_storage_path")
            or os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
            or "/tmp/hicache"
        )
    if backend == "mooncake":
        # SGLang's Mooncake backend's names, where radixkv's are not given.
        for ours, theirs in (
            ("master_address", "master_server_address"),
            ("local_hostname", "local_hostname"),
        ):
            if ours not in options and theirs in options:
                options[ours] = options.pop(theirs)
    policy = sg.get("hicache_storage_prefetch_policy") or "timeout"
    if policy not in PREFETCH_POLICIES:
        raise ValueError(
            f"--hicache-storage-prefetch-policy must be one of {', '.join(PREFETCH_POLICIES)}, "
            f"got {policy!r}"
        )
    storage = Storage(options, policy)
    for key, field, kind in (
        ("prefetch_threshold", "threshold_tokens", int),
        ("prefetch_timeout_base", "timeout_base_s", float),
        ("prefetch_timeout_per_ki_token", "timeout_per_ki_token_s", float),
    ):
        if key in extra:
            value = extra[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"extra config {key} must be a number >= 0, got {value!r}")
            setattr(storage, field, kind(value))
    return storage


def _quotas(raw) -> List[Quota]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(f"{ENV}: quotas must be a list of objects")
    out = []
    for i, q in enumerate(raw):
        if not isinstance(q, dict):
            raise ValueError(f"{ENV}: quotas[{i}] must be an object")
        unknown = sorted(set(q) - set(_QUOTA_KEYS))
        if unknown:
            raise ValueError(f"{ENV}: quotas[{i}] has unknown keys {', '.join(unknown)}")
        limits = {k: q[k] for k in _QUOTA_KEYS[2:] if q.get(k) is not None}
        if not limits:
            raise ValueError(f"{ENV}: quotas[{i}] sets no limit")
        out.append(Quota(q.get("extra_key"), q.get("cache_salt") or None, limits))
    return out


def _events(raw) -> Optional[Dict[str, Any]]:
    """SGLang's --kv-events-config when it publishes over ZeroMQ, else None."""
    if not raw:
        return None
    config = json.loads(raw) if isinstance(raw, str) else dict(raw)
    if config.get("publisher", "null") != "zmq":
        return None
    if config.get("format", "default") != "default":
        raise ValueError(
            f"--kv-events-config format {config['format']!r}: radixkv publishes vLLM's "
            "(SGLang's default) format"
        )
    return config


def settings(sg: Dict[str, Any], config: Dict[str, Any]) -> Settings:
    """The hierarchical cache's settings from SGLang's resolved HiCache
    knobs `sg` (the names of SGLang's memory config) and radixkv's
    `config`. ValueError names each flag or key it cannot serve."""
    mode = sg.get("hicache_host_memory_mode") or "cache"
    if mode != "cache":
        raise ValueError(
            f"--hicache-host-memory-mode {mode}: radixkv's host tier is a cache tier "
            "(--hicache-host-memory-mode cache)"
        )
    write_policy = sg.get("hicache_write_policy") or "write_through"
    if write_policy not in WRITE_POLICIES:
        raise ValueError(f"--hicache-write-policy {write_policy} is not one of {WRITE_POLICIES}")
    layout = sg.get("hicache_mem_layout") or "page_first"
    if layout not in _LAYOUTS:
        raise ValueError(
            f"--hicache-mem-layout {layout}: radixkv's host pool is layer_first or page_first "
            "(page_first_direct is kept as page_first)"
        )
    io = sg.get("hicache_io_backend") or "kernel"
    if io not in _IO_BACKENDS:
        raise ValueError(
            f"--hicache-io-backend {io}: radixkv copies with its own engine on CPUs and CUDA "
            "GPUs (kernel or direct)"
        )
    codec = check_codec(config.get("host_codec"))
    storage = _storage(sg)
    host_layout = _LAYOUTS[layout]
    if (codec is not None or storage is not None) and host_layout != "page_first":
        what = "host_codec" if codec is not None else "--hicache-storage-backend"
        raise ValueError(
            f"{what} needs --hicache-mem-layout page_first (a page is one region of host "
            "memory there)"
        )
    policy = config.get("eviction_policy") or sg.get("radix_eviction_policy") or "lru"
    if policy not in EVICTION_POLICIES:
        raise ValueError(
            f"eviction policy {policy!r} is not one of radixkv's: {', '.join(EVICTION_POLICIES)}"
        )
    policy_config = config.get("eviction_policy_config")
    if policy_config is None and not config.get("eviction_policy"):
        raw = sg.get("radix_eviction_policy_config")
        policy_config = json.loads(raw) if isinstance(raw, str) and raw else raw or None
    size = sg.get("hicache_size") or 0
    ratio = sg.get("hicache_ratio")
    return Settings(
        write_policy=write_policy,
        host_layout=host_layout,
        host_codec=codec,
        hicache_ratio=None if ratio is None else float(ratio),
        hicache_size_gb=float(size),
        eviction_policy=policy,
        eviction_policy_config=policy_config,
        quotas=_quotas(config.get("quotas")),
        retain_budget_tokens=config.get("retain_budget_tokens"),
        max_namespaces=config.get("max_namespaces", 1 << 16),
        storage=storage,
        kv_events=_events(sg.get("kv_events_config")),
    )


def namespace_name(extra_key, cache_salt=None):
    """The cache namespace of SGLang's (extra_key, cache_salt): extra_key
    alone, or both length-prefixed in one bytes name (no two pairs and no
    str name share it). None for the default namespace."""
    if cache_salt is None:
        return extra_key
    parts = [
        repr(bytes(x) if isinstance(x, (bytearray, memoryview)) else x).encode("utf-8")
        for x in (extra_key, cache_salt)
    ]
    return b"".join(len(p).to_bytes(8, "little") + p for p in parts)


def sglang_knobs() -> Tuple[Dict[str, Any], Optional[str]]:
    """SGLang's resolved HiCache knobs (its memory config, as HiCache reads
    it after auto-sizing) and its kv events config, from the running
    SGLang."""
    from sglang.srt.runtime_context import get_memory, get_observability

    memory = get_memory()
    names = (
        "hicache_ratio",
        "hicache_size",
        "hicache_write_policy",
        "hicache_io_backend",
        "hicache_mem_layout",
        "hicache_host_memory_mode",
        "hicache_storage_backend",
        "hicache_storage_backend_extra_config",
        "hicache_storage_prefetch_policy",
        "radix_eviction_policy",
        "radix_eviction_policy_config",
    )
    sg = {n: getattr(memory, n, None) for n in names}
    events = getattr(get_observability(), "kv_events_config", None)
    sg["kv_events_config"] = events
    return sg, events
