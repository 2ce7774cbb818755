"""radixkv.compat.sglang.config: what radixkv's hierarchical cache inside
SGLang is built from. SGLang's HiCache flags as HiCache reads them (host
memory by ratio or GB in radixkv's host pages, write policies, layouts, io
backends, storage backends and prefetch knobs), radixkv's JSON config
(every key, unknown keys refused), each flag or key it cannot serve refused
by name. No SGLang needed: the knobs are a dict."""

import json

import pytest

from radixkv.compat.sglang import config
from radixkv.compat.sglang.config import load_config, namespace_name, settings


def knobs(**change):
    base = dict(
        hicache_ratio=2.0,
        hicache_size=0,
        hicache_write_policy="write_through",
        hicache_io_backend="kernel",
        hicache_mem_layout="page_first",
        hicache_host_memory_mode="cache",
        hicache_storage_backend=None,
        hicache_storage_backend_extra_config=None,
        hicache_storage_prefetch_policy="timeout",
        radix_eviction_policy="lru",
        radix_eviction_policy_config=None,
        kv_events_config=None,
    )
    return {**base, **change}


def test_the_host_pool_is_hicaches_memory_in_radixkvs_host_pages():
    s = settings(knobs(), {})
    # ratio: twice the device pool's bytes; a page of half the bytes is twice the pages.
    assert s.host_pages(device_pages=100, device_page_bytes=1000, host_page_bytes=1000) == 200
    assert s.host_pages(100, 1000, 500) == 400
    s = settings(knobs(hicache_size=2, hicache_ratio=None), {})
    assert s.host_pages(100, 1000, 1 << 20) == int(2e9) // (1 << 20)
    assert settings(knobs(hicache_ratio=None), {}).host_pages(10, 10, 10) == 20  # HiCache's 2


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize(
    "layout, kept", [("layer_first", "layer_first"), ("page_first", "page_first"),
                     ("page_first_direct", "page_first")],
)  # fmt: skip
def test_write_policies_and_layouts_are_hicaches(policy, layout, kept):
    s = settings(knobs(hicache_write_policy=policy, hicache_mem_layout=layout), {})
    assert (s.write_policy, s.host_layout) == (policy, kept)
    for io in ("kernel", "direct"):
        assert settings(knobs(hicache_io_backend=io), {}).host_layout == "page_first"


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(hicache_host_memory_mode="buffer_only"), "--hicache-host-memory-mode buffer_only"),
        (dict(hicache_mem_layout="page_head"), "--hicache-mem-layout page_head"),
        (dict(hicache_io_backend="kernel_ascend"), "--hicache-io-backend kernel_ascend"),
        (dict(hicache_write_policy="write_sometimes"), "--hicache-write-policy"),
        (dict(hicache_storage_backend="hf3fs"), "--hicache-storage-backend hf3fs"),
        (
            dict(
                hicache_storage_backend="dynamic",
                hicache_storage_backend_extra_config=json.dumps({"module_path": "their.store"}),
            ),
            "module_path 'their.store'",
        ),
        (
            dict(hicache_storage_backend="file", hicache_mem_layout="layer_first"),
            "--hicache-storage-backend needs --hicache-mem-layout page_first",
        ),
        (
            dict(hicache_storage_backend="file", hicache_storage_prefetch_policy="eager"),
            "--hicache-storage-prefetch-policy",
        ),
        (dict(radix_eviction_policy="weird"), "eviction policy 'weird'"),
        (
            dict(kv_events_config=json.dumps({"publisher": "zmq", "format": "dynamo"})),
            "--kv-events-config format 'dynamo'",
        ),
        (
            dict(
                hicache_storage_backend="file",
                hicache_storage_backend_extra_config='{"prefetch_threshold": -1}',
            ),
            "prefetch_threshold",
        ),
    ],
)
def test_flags_radixkv_cannot_serve_are_refused_by_name(change, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        settings(knobs(**change), {})


def test_host_codec_needs_page_first():
    with pytest.raises(ValueError, match="host_codec needs --hicache-mem-layout page_first"):
        settings(knobs(hicache_mem_layout="layer_first"), {"host_codec": "float8"})
    assert settings(knobs(), {"host_codec": "float8"}).host_codec == "float8"
    with pytest.raises(ValueError, match="codec"):
        settings(knobs(), {"host_codec": "int4"})


def test_storage_backends_take_radixkvs_options_and_sglangs_prefetch_knobs(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    s = settings(knobs(hicache_storage_backend="file"), {})
    assert s.storage.options == {"backend": "file", "directory": str(tmp_path)}
    assert s.storage.prefetch_policy == "timeout"
    extra = {
        "module_path": config.OUR_STORAGE_MODULE,
        "backend_name": "radixkv",
        "class_name": "RadixkvHiCacheStorage",
        "interface_v1": 1,
        "backend": "mooncake",
        "master_server_address": "127.0.0.1:50051",
        "metadata_server": "http://127.0.0.1:8080/metadata",
        "prefetch_threshold": 64,
        "prefetch_timeout_base": 0.5,
        "prefetch_timeout_per_ki_token": 0.1,
    }
    s = settings(
        knobs(
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(extra),
            hicache_storage_prefetch_policy="wait_complete",
        ),
        {},
    )
    assert s.storage.options == {
        "backend": "mooncake",
        "master_address": "127.0.0.1:50051",
        "metadata_server": "http://127.0.0.1:8080/metadata",
    }
    assert (s.storage.threshold_tokens, s.storage.timeout_base_s) == (64, 0.5)
    assert s.storage.timeout_per_ki_token_s == 0.1
    assert s.storage.prefetch_policy == "wait_complete"
    with pytest.raises(ValueError, match="extra config says backend 'file'"):
        settings(
            knobs(
                hicache_storage_backend="mooncake",
                hicache_storage_backend_extra_config='{"backend": "file"}',
            ),
            {},
        )


def test_radixkvs_config_every_key_and_unknown_ones_refused(monkeypatch, tmp_path):
    full = {
        "eviction_policy": "slru",
        "eviction_policy_config": {"protected_fraction": 0.5},
        "host_codec": "float8",
        "quotas": [
            {"extra_key": "a", "device_tokens": 64, "host_tokens": 128},
            {"extra_key": "b", "cache_salt": "s", "host_bytes": 1 << 20},
        ],
        "retain_budget_tokens": 256,
        "max_namespaces": 100,
    }
    monkeypatch.setenv(config.ENV, json.dumps(full))
    loaded = load_config()
    s = settings(knobs(radix_eviction_policy="lru"), loaded)
    assert (s.eviction_policy, s.eviction_policy_config) == ("slru", {"protected_fraction": 0.5})
    assert [(q.extra_key, q.cache_salt, q.limits) for q in s.quotas] == [
        ("a", None, {"device_tokens": 64, "host_tokens": 128}),
        ("b", "s", {"host_bytes": 1 << 20}),
    ]
    assert (s.retain_budget_tokens, s.max_namespaces) == (256, 100)
    path = tmp_path / "radixkv.json"
    path.write_text(json.dumps({"eviction_policy": "tlru"}))
    assert load_config(f"@{path}") == {"eviction_policy": "tlru"}
    assert load_config("") == {} and load_config("  ") == {}
    monkeypatch.delenv(config.ENV)
    assert load_config() == {}
    for text, words in (
        ('{"eviction": "lru"}', "unknown key eviction"),
        ("[1, 2]", "must be a JSON object"),
        ("{not json", "not JSON"),
    ):
        with pytest.raises(ValueError, match=words):
            load_config(text)
    for quotas, words in (
        ("no", "quotas must be a list"),
        (["no"], r"quotas\[0\] must be an object"),
        ([{"extra_key": "a"}], r"quotas\[0\] sets no limit"),
        ([{"extra_key": "a", "tokens": 3}], r"quotas\[0\] has unknown keys tokens"),
    ):
        with pytest.raises(ValueError, match=words):
            settings(knobs(), {"quotas": quotas})


def test_sglangs_eviction_policy_is_the_default_and_events_need_zmq():
    s = settings(knobs(radix_eviction_policy="lfu"), {})
    assert s.eviction_policy == "lfu"
    assert settings(knobs(kv_events_config='{"publisher": "null"}'), {}).kv_events is None
    events = settings(
        knobs(kv_events_config='{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5"}'), {}
    ).kv_events
    assert events["endpoint"] == "tcp://127.0.0.1:5"


def test_namespaces_of_extra_key_and_cache_salt_never_collide():
    assert namespace_name(None) is None and namespace_name("a") == "a"
    names = {
        namespace_name(e, s) for e in ("a", "ab", "b") for s in (None, "x", "bx", "y")
    }  # fmt: skip
    assert len(names) == 12
