"""The connector's settings (`kv_connector_extra_config`, checked), and
what both halves derive alike from vLLM's configuration: the host page of
one block of every layer, the host tier's size in pages, the seed of the
block names."""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from radixkv._checks import as_count
from radixkv.kvcache.engine_pool import EngineKVPool
from radixkv.kvcache.host_pages import HOST_PAGE_POLICIES
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.kvcache.page_codec import check_codec
from radixkv.storage import config_fingerprint
from radixkv.storage.staged import STORAGE_OPTIONS, storage_options

# Host pages a store's reads and writes pass through when host_bytes is 0.
STORE_ONLY_PAGES = 64
# Loads of at least this many blocks run while other requests compute.
ASYNC_LOAD_BLOCKS = 64

KEYS = (
    "host_bytes",
    "namespace",
    "host_codec",
    "host_eviction_policy",
    "host_quotas",
    "async_load_blocks",
    *STORAGE_OPTIONS,
)


def _refuse(message: str) -> ValueError:
    return ValueError(f"radixkv's vLLM connector: {message}")


@dataclass(frozen=True)
class Settings:
    """What the user asked for, checked."""

    host_bytes: int = 0
    storage: Optional[dict] = None  # storage_options'; None: the host tier alone
    namespace: Optional[str] = None
    host_codec: Optional[str] = None
    host_eviction_policy: str = "lru"
    # cache_salt -> host pages ("" in the JSON: requests without a salt)
    host_quotas: Dict[Optional[str], int] = field(default_factory=dict)
    async_load_blocks: int = ASYNC_LOAD_BLOCKS

    @classmethod
    def parse(cls, extra: Optional[Mapping[str, Any]]) -> "Settings":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise _refuse(
                f"unknown kv_connector_extra_config key(s) {', '.join(unknown)} "
                f"(it knows {', '.join(KEYS)})"
            )
        host_bytes = as_count(extra.pop("host_bytes", 0), "extra_config host_bytes", minimum=0)
        namespace = extra.pop("namespace", None)
        if namespace is not None and not isinstance(namespace, str):
            raise _refuse(f"extra_config namespace must be a string, got {namespace!r}")
        codec = extra.pop("host_codec", None)
        try:
            codec = check_codec(codec)
        except ValueError as e:
            raise _refuse(f"extra_config host_codec: {e}") from None
        policy = extra.pop("host_eviction_policy", "lru")
        if policy not in HOST_PAGE_POLICIES:
            raise _refuse(
                f"extra_config host_eviction_policy must be one of "
                f"{', '.join(HOST_PAGE_POLICIES)}, got {policy!r}"
            )
        quotas_in = extra.pop("host_quotas", None) or {}
        if not isinstance(quotas_in, Mapping):
            raise _refuse('extra_config host_quotas must map a cache_salt ("" for none) to pages')
        quotas: Dict[Optional[str], int] = {
            (salt or None): as_count(n, f"extra_config host_quotas[{salt!r}]")
            for salt, n in quotas_in.items()
        }
        async_blocks = as_count(
            extra.pop("async_load_blocks", ASYNC_LOAD_BLOCKS), "extra_config async_load_blocks"
        )
        if extra.get("backend") == "none":
            if not host_bytes:
                raise _refuse(
                    'extra_config backend "none" needs host_bytes > 0 (the host tier is '
                    "then the only one)"
                )
            extra.pop("backend")
            if extra:
                raise _refuse(
                    f'extra_config backend "none" takes no store options, got '
                    f"{', '.join(sorted(extra))}"
                )
            storage = None
        else:
            storage = storage_options(extra)
        return cls(host_bytes, storage, namespace, codec, policy, quotas, async_blocks)


@dataclass(frozen=True)
class BlockLayout:
    """One block of every layer, as radixkv's host tier holds it (one host
    page), from vLLM's KV cache spec: what the scheduler knows before any
    tensor exists, and the worker checks its tensors against."""

    layers: int
    heads: int  # the spec's KV heads
    row: int  # elements of one layer's K (or V) of a block, per head
    dtype: torch.dtype
    describe: str  # what else decides a block's bytes (the names' seed)

    @classmethod
    def from_config(cls, vllm_config: Any, kv_cache_config: Any) -> "BlockLayout":
        groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
        if len(groups) != 1:
            raise _refuse(
                f"it serves models with one KV cache group (full attention); this one "
                f"has {len(groups)}"
            )
        spec = groups[0].kv_cache_spec
        if type(spec).__name__ != "FullAttentionSpec":
            raise _refuse(
                f"it serves full attention; this model's KV cache is {type(spec).__name__}"
            )
        model = vllm_config.model_config
        describe = (
            f"vllm:{type(spec).__name__} heads={spec.num_kv_heads} head={spec.head_size} "
            f"revision={getattr(model, 'revision', None)} "
            f"quantization={getattr(model, 'quantization', None)} "
            f"cache_dtype={vllm_config.cache_config.cache_dtype}"
        )
        return cls(
            layers=len(groups[0].layer_names),
            heads=spec.num_kv_heads,
            row=spec.block_size * spec.head_size,
            dtype=spec.dtype,
            describe=describe,
        )

    def page_bytes(self, codec: Optional[str]) -> int:
        """Bytes of one host page (with `codec`: encoded, scales included)."""
        plane = torch.empty((1, self.heads, self.row), dtype=self.dtype, device="meta")
        planes = [plane] * self.layers
        pool = EngineKVPool(planes, planes, page_size=1)
        return HostKVCache(pool, num_pages=1, layout="page_first", codec=codec).page_bytes

    def host_pages(self, settings: Settings) -> int:
        """How many host pages `settings` give (both halves count alike)."""
        page_bytes = self.page_bytes(settings.host_codec)
        pages = settings.host_bytes // page_bytes
        if settings.host_bytes and not pages:
            raise _refuse(
                f"extra_config host_bytes ({settings.host_bytes}) holds no block of this "
                f"model ({page_bytes} bytes)"
            )
        if not pages and settings.storage is not None:
            pages = STORE_ONLY_PAGES
        return pages


class Seeds:
    """The fingerprints that start each namespace's chain of block names:
    the model (or `namespace`), the K/V dtype, the block size and layout,
    the layers, the host codec and the request's namespace (cache_salt,
    LoRA adapter), so configurations and tenants never read each other's
    blocks. Salts come from clients: a bounded few are kept."""

    def __init__(self, model: str, layout: BlockLayout, block_size: int, codec: Optional[str]):
        self.model, self.layout, self.block_size, self.codec = model, layout, block_size, codec
        self._seeds: "collections.OrderedDict[Optional[str], bytes]" = collections.OrderedDict()

    def __call__(self, namespace: Optional[str]) -> bytes:
        seed = self._seeds.get(namespace)
        if seed is not None:
            self._seeds.move_to_end(namespace)
            return seed
        seed = config_fingerprint(
            model=self.model,
            dtype=self.layout.dtype,
            page_size=self.block_size,
            layout=f"{self.layout.describe} host_codec={self.codec}",
            num_layers=self.layout.layers,
            kv_heads=1,
            head_dim=1,
            namespace=namespace,
        )
        self._seeds[namespace] = seed
        if len(self._seeds) > 4096:
            self._seeds.popitem(last=False)
        return seed


def request_namespace(request: Any) -> Tuple[Optional[str], Optional[str]]:
    """(the names' namespace, the quota group) of a vLLM request: its
    cache_salt and LoRA adapter kept apart; the group is the salt."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    if not salt and lora is None:
        return None, None
    lora_id = (
        None
        if lora is None
        else [lora.lora_name, lora.lora_int_id, getattr(lora, "lora_path", None)]
    )
    return json.dumps({"salt": salt, "lora": lora_id}), salt or None


def check_parallel(vllm_config: Any) -> None:
    par = vllm_config.parallel_config
    if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
        # The scheduler names blocks for every rank alike; a rank's shard of a
        # block would need its own name.
        raise _refuse(
            "it serves one rank (tensor_parallel_size and pipeline_parallel_size 1) in "
            "this version"
        )
