"""radixkv.compat.vllm.config: the connector's extra config, checked by name
before vLLM builds anything, and what both halves derive alike from vLLM's
configuration (pages per host byte, the names' seeds). Needs no vLLM."""

from types import SimpleNamespace

import pytest
import torch

from radixkv.compat.vllm.config import (
    ASYNC_LOAD_BLOCKS,
    STORE_ONLY_PAGES,
    BlockLayout,
    Seeds,
    Settings,
    check_parallel,
    request_namespace,
)


class FullAttentionSpec(SimpleNamespace):
    """Stands for vLLM's spec of the same name: only its fields are read."""


def _configs(layers=2, groups=1, spec=FullAttentionSpec):
    s = spec(num_kv_heads=2, head_size=8, block_size=16, dtype=torch.float16)
    group = SimpleNamespace(kv_cache_spec=s, layer_names=[f"l.{i}" for i in range(layers)])
    vllm = SimpleNamespace(
        model_config=SimpleNamespace(model="m", revision=None, quantization=None),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    return vllm, SimpleNamespace(kv_cache_groups=[group] * groups, num_blocks=10)


def test_defaults_and_a_full_config(tmp_path):
    s = Settings.parse({"directory": str(tmp_path)})
    assert s.storage["backend"] == "file" and s.host_bytes == 0
    assert s.async_load_blocks == ASYNC_LOAD_BLOCKS and s.host_eviction_policy == "lru"
    s = Settings.parse(
        {
            "backend": "none",
            "host_bytes": 1 << 20,
            "namespace": "n",
            "host_codec": "float8",
            "host_eviction_policy": "lfu",
            "host_quotas": {"": 4, "tenant": 8},
            "async_load_blocks": 2,
        }
    )
    assert s.storage is None and s.host_codec == "float8"
    assert s.host_quotas == {None: 4, "tenant": 8} and s.async_load_blocks == 2


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"host_byts": 1, "backend": "none"}, "unknown kv_connector_extra_config key.s. host_byts"),
        ({"backend": "none"}, 'backend "none" needs host_bytes > 0'),
        ({"backend": "none", "host_bytes": 8, "directory": "/x"}, "takes no store options"),
        ({"backend": "none", "host_bytes": -1}, "host_bytes"),
        ({"backend": "none", "host_bytes": 8, "host_codec": "int3"}, "host_codec"),
        (
            {"backend": "none", "host_bytes": 8, "host_eviction_policy": "mru"},
            "host_eviction_policy must be one of lru, fifo, lfu",
        ),
        ({"backend": "none", "host_bytes": 8, "host_quotas": [1]}, "host_quotas must map"),
        ({"backend": "none", "host_bytes": 8, "host_quotas": {"t": 0}}, r"host_quotas\['t'\]"),
        ({"backend": "none", "host_bytes": 8, "async_load_blocks": 0}, "async_load_blocks"),
        ({"backend": "none", "host_bytes": 8, "namespace": 3}, "namespace must be a string"),
        ({"backend": "s3"}, "backend must be 'file' or 'mooncake'"),
        ({"backend": "file"}, "directory"),
    ],
)
def test_bad_settings_are_refused_by_name(extra, words):
    with pytest.raises((ValueError, TypeError), match=words):
        Settings.parse(extra)


def test_host_bytes_become_whole_pages_of_every_layer():
    vllm, kv = _configs()
    layout = BlockLayout.from_config(vllm, kv)
    # K and V of 2 layers, 2 heads, 16 tokens, 8 elements, 2 bytes
    assert layout.page_bytes(None) == 2 * 2 * 2 * 16 * 8 * 2
    s = Settings.parse({"backend": "none", "host_bytes": 10 * 2048 + 5})
    assert layout.host_pages(s) == 10
    float8 = Settings.parse({"backend": "none", "host_bytes": 10 * 2048, "host_codec": "float8"})
    assert layout.host_pages(float8) > 10  # smaller pages, more of them
    with pytest.raises(ValueError, match=r"host_bytes \(100\) holds no block"):
        layout.host_pages(Settings.parse({"backend": "none", "host_bytes": 100}))
    store_only = Settings.parse({"directory": "/tmp/x"})
    assert layout.host_pages(store_only) == STORE_ONLY_PAGES


def test_models_it_does_not_serve_are_refused_by_name():
    class SlidingWindowSpec(FullAttentionSpec):
        pass

    with pytest.raises(ValueError, match="one KV cache group .* has 2"):
        BlockLayout.from_config(*_configs(groups=2))
    with pytest.raises(ValueError, match="SlidingWindowSpec"):
        BlockLayout.from_config(*_configs(spec=SlidingWindowSpec))
    vllm, _ = _configs()
    vllm.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_parallel(vllm)


def test_seeds_keep_configurations_and_tenants_apart():
    vllm, kv = _configs()
    layout = BlockLayout.from_config(vllm, kv)
    plain = Seeds("m", layout, 16, None)
    assert plain(None) == Seeds("m", layout, 16, None)(None)  # both halves agree
    others = {
        plain("tenant"),
        Seeds("m2", layout, 16, None)(None),
        Seeds("m", layout, 32, None)(None),
        Seeds("m", layout, 16, "float8")(None),
        Seeds("m", BlockLayout.from_config(*_configs(layers=3)), 16, None)(None),
    }
    assert plain(None) not in others and len(others) == 5


def test_a_request_s_namespace_keeps_salt_and_adapter_apart():
    assert request_namespace(SimpleNamespace(cache_salt=None, lora_request=None)) == (None, None)
    salted = request_namespace(SimpleNamespace(cache_salt="t", lora_request=None))
    lora = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path="/p")
    both = request_namespace(SimpleNamespace(cache_salt="t", lora_request=lora))
    adapter = request_namespace(SimpleNamespace(cache_salt=None, lora_request=lora))
    assert salted[1] == both[1] == "t" and adapter[1] is None
    assert len({salted[0], both[0], adapter[0]}) == 3
