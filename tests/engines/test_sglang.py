"""radixkv inside a real SGLang 0.5.23 server (`--radix-cache-backend
radixkv`), against the same server with its own cache, on a seeded
multi-turn chat workload: greedy outputs token for token equal (float32),
cached-token counts per request equal, eviction happening, extra_key and
cache_salt namespaces kept apart, SGLang's own idle leak check passing, no
error in the log, and a clean shutdown."""

import json
import os
import random
import subprocess
import textwrap
import time

import pytest

from engine_env import (
    CHAT_MAX_TOTAL_TOKENS,
    free_port,
    generate,
    run_chat,
    server_problems,
    sglang_server,
)

MAX_TOTAL_TOKENS = CHAT_MAX_TOTAL_TOKENS  # the chat's pool: eviction happens


@pytest.fixture(scope="module")
def python(sglang_python):
    return sglang_python


@pytest.fixture(scope="module")
def model(sglang_model):
    return sglang_model


def serve(python, model, log_path, page_size, backend=None, extra_args=(), env=None):
    return sglang_server(
        python, model, log_path, backend, MAX_TOTAL_TOKENS, page_size, extra_args, env
    )


def run_workload(python, model, tmp_path, page_size, backend="radixkv"):
    server = serve(python, model, str(tmp_path / f"{backend}-p{page_size}.log"), page_size, backend)
    turns, code = run_chat(server)
    return turns, server.log(), code


@pytest.mark.parametrize("page_size", [1, 4])
def test_radixkv_serves_what_sglang_serves_with_its_own_cache(
    python, model, tmp_path, page_size, sglang_own_chat
):
    ours, our_log, our_code = run_workload(python, model, tmp_path, page_size)
    own = sglang_own_chat(page_size)
    theirs, their_log, their_code = own["turns"], own["log"], own["code"]

    assert "Tree cache initialized: source=registered('radixkv')" in our_log
    assert "source=default" in their_log
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.output_ids == b.output_ids, (a, b)  # greedy, float32: token for token
        assert a.cached_tokens == b.cached_tokens, (a, b)
    hits = sum(t.cached_tokens for t in ours)
    assert hits > len(ours) * 100  # the shared system prompts and the growing conversations
    # The second namespace never reuses the first's system prompt: its first
    # turn is a miss although the same tokens are cached in the default one.
    first_b = next(t for t in ours if t.namespace and "tenant-b" in t.namespace)
    assert first_b.cached_tokens == 0
    # The first turn once more at the end: evicted meanwhile (the pool holds
    # less than the workload), a partial hit at most.
    assert ours[-1].cached_tokens < ours[-1].prompt_len - 1
    assert server_problems(our_log) == [] and server_problems(their_log) == []
    assert our_code == their_code == 0  # SIGTERM: drained and exited cleanly


def test_unsupported_combinations_are_refused_by_name(python):
    script = textwrap.dedent("""
        from types import SimpleNamespace
        from radixkv.compat.sglang.plugin import build
        params = SimpleNamespace(is_eagle=False, enable_kv_cache_events=False)
        base = dict(is_hybrid_swa=False, is_hybrid_ssm=False, is_dsa=False,
                    enable_hierarchical_cache=False, disable_radix_cache=False, params=params)
        for change, word in [({"enable_hierarchical_cache": True, "tp_size": 2}, "--tp-size 2"),
                             ({"is_hybrid_swa": True}, "is_hybrid_swa"),
                             ({"is_hybrid_ssm": True}, "is_hybrid_ssm"),
                             ({"server_args": SimpleNamespace(enable_lmcache=True)},
                              "--enable-lmcache")]:
            try:
                build(SimpleNamespace(**{**base, **change}))
            except ValueError as e:
                assert word in str(e), e
            else:
                raise AssertionError(f"{change} was not refused")
        print("ok")
    """)
    r = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_the_plugin_is_registered_in_sglangs_group(python):
    script = textwrap.dedent("""
        from importlib.metadata import entry_points
        eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
        assert eps.get("radixkv") == "radixkv.compat.sglang.plugin:register", eps
        from sglang.srt.mem_cache.registry import get_radix_cache_factory
        from radixkv.compat.sglang.plugin import register, build
        register(); register()  # twice, as SGLang's processes may: registered once
        assert get_radix_cache_factory("radixkv") is build
        print("ok")
    """)
    r = subprocess.run(
        [python, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"},
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def stored_pages(python, model, tmp_path, backend):
    """The token pages of the BlockStored events a server publishes over a
    short workload, and the event types seen (a flush clears all)."""
    import msgpack
    import zmq

    port = free_port()
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "topic": "kv",
        "bind": True,
    }
    name = backend or "sglang"
    server = serve(
        python,
        model,
        str(tmp_path / f"{name}-events.log"),
        4,
        backend,
        ["--kv-events-config", json.dumps(config)],
    )
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(1.0)  # the subscription reaches the publisher
        rng = random.Random(7)
        system = [rng.randrange(3, 1000) for _ in range(40)]
        for k in range(3):
            generate(server, system + [rng.randrange(3, 1000) for _ in range(9)], {})
        server.post("/flush_cache?timeout=60", {})
        generate(server, system, {})
        pages, kinds, stores = [], [], []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not sub.poll(500):
                if kinds and kinds[-1] == "BlockStored" and "AllBlocksCleared" in kinds:
                    break
                continue
            *_, payload = sub.recv_multipart()
            _, events, *_ = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            for event in events:  # SGLang's events are tagged maps
                kinds.append(event["type"])
                if event["type"] == "BlockStored":
                    ids, size = event["token_ids"], event["block_size"]
                    assert len(event["block_hashes"]) * size == len(ids), event
                    pages += [tuple(ids[i : i + size]) for i in range(0, len(ids), size)]
                    stores.append(len(event["block_hashes"]))
    finally:
        sub.close(0)
        server.stop()
    assert server_problems(server.log()) == []
    return pages, kinds, stores


def test_kv_events_name_the_same_pages_as_sglangs_own(python, model, tmp_path):
    """The same pages stored, in events of as many pages as SGLang's own
    cache publishes (a chain of pages per event), and a flush clears all."""
    ours, our_kinds, our_stores = stored_pages(python, model, tmp_path, "radixkv")
    theirs, their_kinds, their_stores = stored_pages(python, model, tmp_path, None)
    assert ours and all(len(p) == 4 for p in ours) and max(our_stores) > 1
    assert sorted(ours) == sorted(theirs)
    assert sorted(our_stores) == sorted(their_stores), (our_stores, their_stores)
    assert "AllBlocksCleared" in our_kinds and "AllBlocksCleared" in their_kinds


def test_review_cases_of_the_backend_without_a_server(python):
    """What a review found, on the backend class itself: SGLang's default
    priorities (sys.maxsize) insert; dfs-weight order is SGLang's on a tree
    of distinct weights and takes paths of any length; event hashes are
    signed int64."""
    script = textwrap.dedent("""
        import sys, torch
        from types import SimpleNamespace
        from radixkv.compat.sglang.radix_cache import RadixKey, _event_types
        from radixkv.compat.sglang.plugin import _cache_class
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, _dfs_weight_order
        from sglang.srt.mem_cache.radix_cache import RadixCache as Theirs, RadixKey as TheirKey

        class Alloc:
            device = torch.device("cpu")
            def free(self, idx): pass
            def free_segment(self, idx, start_pos): pass

        def ours(page_size=1, events=False):
            return _cache_class()(SimpleNamespace(
                disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=Alloc(),
                page_size=page_size, enable_kv_cache_events=events, eviction_policy="lru"))

        c = ours()
        for p in (sys.maxsize, -sys.maxsize - 1):
            c.insert(SimpleNamespace(key=RadixKey([p % 7 + 10, 1, 2]),
                                     value=torch.tensor([1, 2, 3]) + (p > 0) * 3, priority=p))
        # dfs-weight: a shared prefix with branches of 3, 2 and 1 requests, a request on the
        # prefix itself, and one on nothing.
        seqs = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 8], [9, 9]]
        queries = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 4], [1, 2], [1, 2, 3, 4],
                   [1, 2, 5, 6], [1, 2, 7, 8], [4, 4], [9, 9]]
        a, b = ours(), Theirs.create_simulated()
        slot = 100
        for s in seqs:
            a.insert(SimpleNamespace(key=RadixKey(s), value=torch.arange(slot, slot + len(s)),
                                     priority=0))
            b.insert(SimpleNamespace(key=TheirKey(s), value=torch.arange(slot, slot + len(s)),
                                     priority=0, inserted_len=0))
            slot += 10
        mine = a.dfs_weight_order([a.match_prefix(MatchPrefixParams(key=RadixKey(q)))
                                   .last_device_node for q in queries])
        their_nodes = [b.match_prefix(MatchPrefixParams(key=TheirKey(q))).last_device_node
                       for q in queries]
        theirs = _dfs_weight_order(b.root_node, their_nodes, lambda n: n)
        assert mine == theirs, (mine, theirs)
        deep = ours()
        deep.insert(SimpleNamespace(key=RadixKey(list(range(20000))),
                                    value=torch.arange(20000), priority=0))
        h = deep.match_prefix(MatchPrefixParams(key=RadixKey(list(range(20000))))).last_device_node
        assert deep.dfs_weight_order([h, h, None]) == [0, 1, 2]
        ev = ours(page_size=4, events=True)
        for k in range(64):
            ev.insert(SimpleNamespace(key=RadixKey([k, 1, 2, 3, 4, 5, 6, 7]),
                                      value=torch.arange(8 * k, 8 * k + 8), priority=0))
        hashes = [h for e in ev.take_events() if hasattr(e, "block_hashes")
                  for h in e.block_hashes]
        assert len(hashes) == 128 and all(-(1 << 63) <= h < (1 << 63) for h in hashes)
        assert any(h < 0 for h in hashes)
        print("ok")
    """)
    r = subprocess.run(
        [python, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"},
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_priority_scheduling_with_radixkv(python, model, tmp_path):
    """SGLang gives requests without a priority sys.maxsize (or its
    negative) under --enable-priority-scheduling; radixkv's tree keeps int32
    priorities, clamped in order. Requests with and without one are served
    and cached."""
    server = serve(
        python,
        model,
        str(tmp_path / "radixkv-priority.log"),
        1,
        "radixkv",
        ["--enable-priority-scheduling"],
    )
    try:
        rng = random.Random(3)
        prompt = [rng.randrange(3, 1000) for _ in range(60)]
        generate(server, prompt, {})
        _, cached = generate(server, prompt, {"priority": 5})
        assert cached == len(prompt) - 1
        generate(server, prompt + [7, 8, 9], {"priority": -(1 << 40)})
        time.sleep(2)  # idle: SGLang's leak check
        generate(server, [5, 6, 7], {})
    finally:
        code = server.stop()
    assert server_problems(server.log()) == [] and code == 0


# -- radixkv's store as HiCache's L3 ------------------------------------------------------

# Stock HiCache with an L3. A prefetch waits until it completes: under the
# default policy (a deadline of about a second) a server's first read of a
# store it has just connected to may miss it on a loaded machine, and these
# tests count the tokens L3 serves.
HICACHE = [
    "--enable-hierarchical-cache",
    "--hicache-size",
    "1",
    "--hicache-io-backend",
    "direct",
    "--hicache-mem-layout",
    "layer_first",
    "--hicache-storage-prefetch-policy",
    "wait_complete",
]


def radixkv_l3(directory):
    return HICACHE + [
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        json.dumps(
            {
                "backend_name": "radixkv",
                "interface_v1": 1,
                "module_path": "radixkv.compat.sglang.hicache_storage",
                "class_name": "RadixkvHiCacheStorage",
                "backend": "file",
                "directory": str(directory),
            }
        ),
    ]


def pages_in(directory):
    return [
        os.path.join(d, f)
        for d, _, files in os.walk(directory)
        for f in files
        if f.endswith((".page", ".bin"))
    ]


def wait_for_pages(directory, n, limit_s=60.0):
    deadline = time.monotonic() + limit_s
    while len(pages_in(directory)) < n:
        assert time.monotonic() < deadline, f"{len(pages_in(directory))} of {n} pages written"
        time.sleep(0.5)


def test_radixkv_store_as_hicache_l3_serves_after_a_flush_and_across_servers(
    python, model, tmp_path
):
    """Stock SGLang HiCache with radixkv's file store as its L3: a long
    prompt computed, written, flushed from the device and host tiers and
    served again from L3; a second server on the same store hits it; pages
    damaged in the store are misses, recomputed, never served; SGLang's own
    file backend on the same requests hits no more."""
    rng = random.Random(11)
    ids = [rng.randrange(3, 1000) for _ in range(600)]
    other = [rng.randrange(3, 1000) for _ in range(300)]
    store = tmp_path / "l3"
    a = serve(python, model, str(tmp_path / "l3-a.log"), 1, extra_args=radixkv_l3(store))
    b = None
    try:
        out, cached = generate(a, ids, {}, 4)
        assert cached == 0
        wait_for_pages(store, 599)
        a.post("/flush_cache?timeout=60", {})
        again, cached = generate(a, ids, {}, 4)
        assert (again, cached) == (out, 599)  # every page but the last token's from L3
        assert "radixkv.compat.sglang.hicache_storage" in a.log()
        b = serve(python, model, str(tmp_path / "l3-b.log"), 1, extra_args=radixkv_l3(store))
        shared, cached = generate(b, ids, {}, 4)
        assert (shared, cached) == (out, 599)  # written by the other server
        before = set(pages_in(store))
        want, _ = generate(a, other, {}, 4)
        wait_for_pages(store, len(before) + 299)
        for path in set(pages_in(store)) - before:  # damage the new pages' K/V bytes
            with open(path, "r+b") as f:
                f.seek(-8, os.SEEK_END)
                f.write(b"\xff" * 8)
        got, cached = generate(b, other, {}, 4)
        assert (got, cached) == (want, 0)  # a damaged first page: a miss, recomputed
    finally:
        codes = [s.stop() for s in (a, b) if s is not None]
    assert codes == [0, 0]
    for s in (a, b):
        assert server_problems(s.log()) == [], s.log_path

    theirs_dir = tmp_path / "sglang-file"
    c = serve(
        python,
        model,
        str(tmp_path / "l3-sglang.log"),
        1,
        extra_args=HICACHE + ["--hicache-storage-backend", "file"],
        env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(theirs_dir)},
    )
    try:
        theirs, cached = generate(c, ids, {}, 4)
        wait_for_pages(theirs_dir, 599)
        c.post("/flush_cache?timeout=60", {})
        theirs_again, their_cached = generate(c, ids, {}, 4)
    finally:
        c.stop()
    assert theirs == theirs_again == out
    assert 599 >= their_cached  # radixkv's L3 hits at least what SGLang's own does


def test_mooncake_store_through_radixkv_as_hicache_l3_is_shared_by_two_servers(
    python, model, tmp_path
):
    """The same with a real Mooncake master on 127.0.0.1 (radixkv's
    MooncakeStorage): served again from L3 after a flush, and by a second
    server."""
    from radixkv.storage import MooncakeMaster

    rng = random.Random(12)
    ids = [rng.randrange(3, 1000) for _ in range(400)]
    with MooncakeMaster() as master:
        config = {
            "backend_name": "radixkv",
            "interface_v1": 1,
            "module_path": "radixkv.compat.sglang.hicache_storage",
            "class_name": "RadixkvHiCacheStorage",
            "backend": "mooncake",
            "master_address": master.master_address,
            "metadata_server": master.metadata_server,
            "listen_on_all_interfaces": True,
        }
        args = HICACHE + [
            "--hicache-storage-backend",
            "dynamic",
            "--hicache-storage-backend-extra-config",
            json.dumps(config),
        ]
        a = serve(python, model, str(tmp_path / "mooncake-a.log"), 1, extra_args=args)
        b = None
        try:
            out, cached = generate(a, ids, {}, 4)
            assert cached == 0
            time.sleep(8)  # the write-through backup reaches L3
            a.post("/flush_cache?timeout=60", {})
            assert generate(a, ids, {}, 4) == (out, 399)
            b = serve(python, model, str(tmp_path / "mooncake-b.log"), 1, extra_args=args)
            assert generate(b, ids, {}, 4) == (out, 399)
        finally:
            codes = [s.stop() for s in (a, b) if s is not None]
    assert codes == [0, 0]
    for s in (a, b):
        assert server_problems(s.log()) == [], s.log_path


def test_the_l3_adapter_keeps_configurations_apart_and_round_trips_pages(python, tmp_path):
    """Without a server: pages written by one configuration are never found
    by another (tensor, pipeline rank, host layout, namespace, a secret), a
    page read back is the page written, and what the adapter cannot serve
    is refused at start-up."""
    script = textwrap.dedent(f"""
        import torch
        from types import SimpleNamespace
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from radixkv.compat.sglang.hicache_storage import RadixkvHiCacheStorage

        class MHATokenToKVPoolHost:  # SGLang's host pool, layer_first, as the adapter uses it
            def __init__(self, layout="layer_first", dtype=torch.float32, pages=16, ps=4):
                self.layout, self.dtype, self.page_size = layout, dtype, ps
                self.layer_num, self.head_num, self.head_dim = 2, 2, 8
                self.buf = torch.randn(2, 2, pages * ps, 2, 8).to(dtype)
            def get_data_page(self, index, flat=True):
                return self.buf[:, :, index:index + self.page_size].flatten()
            def set_from_flat_data_page(self, index, data):
                self.buf[:, :, index:index + self.page_size] = data.reshape(
                    2, 2, self.page_size, 2, 8)

        def adapter(directory, tp_rank=0, pp_rank=0, layout="layer_first", dtype=torch.float32,
                    **extra):
            cfg = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=2, pp_rank=pp_rank, pp_size=2,
                                       attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                                       enable_storage_metrics=False, is_page_first_layout=False,
                                       model_name="tiny", extra_config=dict(
                                           backend="file", directory=directory, **extra))
            a = RadixkvHiCacheStorage(cfg, {{}})
            host = MHATokenToKVPoolHost(layout, dtype)
            a.register_mem_pool_host(host)
            return a, host

        d = {str(tmp_path / "l3")!r}
        keys = [f"{{k:064x}}" for k in range(1, 4)]
        a, host = adapter(d)
        assert a.batch_set_v1(keys, torch.arange(0, 12)) == [True] * 3
        assert a.batch_exists(keys) == 3
        b, other = adapter(d)  # the same configuration, another instance
        assert b.batch_get_v1(keys, torch.arange(16, 28)) == [True] * 3
        assert torch.equal(other.buf[:, :, 16:28], host.buf[:, :, 0:12])
        # The older calls: flat pages by value.
        vals = [torch.randn(2 * 2 * 4 * 2 * 8) for _ in range(2)]
        lk = [f"{{k:064x}}" for k in (100, 101)]
        assert a.batch_set(lk, vals)
        assert all(torch.equal(g, v) for g, v in zip(b.batch_get(lk), vals))
        dst = [torch.empty(2 * 2 * 4 * 2 * 8) for _ in range(2)]
        got = b.batch_get(lk, dst)
        assert got[0] is dst[0] and torch.equal(dst[1], vals[1])
        assert b.get(f"{{999:064x}}") is None and b.exists(lk[0])
        for kw in (dict(tp_rank=1), dict(pp_rank=1), dict(layout="page_first"),
                   dict(namespace="other-weights"), dict(secret="a deployment secret")):
            c, _ = adapter(d, **kw)
            assert c.batch_exists(keys) == 0, kw
        assert a.get_stats() is None and a.counts()["errors"] == 0
        for bad, word in ((dict(dtype=torch.uint8), "float8"),):
            try:
                adapter(d, **bad)
            except ValueError as e:
                assert word in str(e), e
            else:
                raise AssertionError(f"{{bad}} was not refused")
        a.registered_pools = {{"kv": host, "draft": host}}
        try:
            a.on_host_pools_registered()
        except ValueError as e:
            assert "draft" in str(e)
        else:
            raise AssertionError("an extra pool was not refused")
        print("ok")
    """)
    r = subprocess.run(
        [python, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"},
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
