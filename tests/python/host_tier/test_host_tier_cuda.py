"""The host tier on CUDA: the copy engine's streams, events and fence, end to
end through CacheManager. The CUDA cases skip when no GPU is present."""

import pytest
import torch

from radixkv import _core
from radixkv.kvcache import MHAKVCache
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.replay.replay import KVShape
from radixkv.scheduler import CacheManager

needs_gpu = pytest.mark.cuda
KV = KVShape(num_layers=3, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def test_a_controller_refuses_what_is_not_an_engine():
    with pytest.raises(TypeError):
        _core.CacheController(object())
    fake = _fake_capsule()
    with pytest.raises(TypeError, match="radixkv._cuda.copy_engine"):
        _core.CacheController(fake)


def _fake_capsule():
    import ctypes

    make = ctypes.pythonapi.PyCapsule_New
    make.restype = ctypes.py_object
    make.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return make(ctypes.c_void_p(1), b"something.else", None)


@needs_gpu
def test_the_cuda_engine_needs_a_pinned_host_pool_and_is_taken_once():
    from radixkv import _cuda

    dev = MHAKVCache(
        KV.num_kv_heads, KV.num_layers, KV.head_dim, 8, KV.dtype, page_size=4, device="cuda"
    )
    row = KV.num_kv_heads * KV.head_dim * KV.dtype.itemsize
    pageable = HostKVCache(dev, 8, pin_memory=False)
    with pytest.raises(ValueError, match="pinned"):
        _cuda.copy_engine(
            dev.kv_buffer,
            list(dev.copy_layout()),
            pageable.kv_buffer,
            list(pageable.copy_layout()),
            row,
            KV.num_layers,
        )
    pinned = HostKVCache(dev, 8, pin_memory=True)
    engine = _cuda.copy_engine(
        dev.kv_buffer,
        list(dev.copy_layout()),
        pinned.kv_buffer,
        list(pinned.copy_layout()),
        row,
        KV.num_layers,
    )
    _core.CacheController(engine)
    with pytest.raises(ValueError, match="already"):
        _core.CacheController(engine)


def _store(pool, slots, ids, start):
    for layer in range(KV.num_layers):
        pool.store_kv(
            KV.rows(ids, start, layer, 0).cuda(), KV.rows(ids, start, layer, 1).cuda(), slots, layer
        )


def _rows_ok(pool, slots, ids, start, layers=None):
    for layer in layers if layers is not None else range(KV.num_layers):
        for side, cache in ((0, pool.k_cache(layer)), (1, pool.v_cache(layer))):
            rows = cache.reshape(-1, KV.num_kv_heads, KV.head_dim)[slots.long()].cpu()
            if not torch.equal(
                rows.view(torch.int16), KV.rows(ids, start, layer, side).view(torch.int16)
            ):
                return False
    return True


@needs_gpu
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_requests_get_their_kv_back_from_host_on_cuda(policy, host_layout):
    page, pages = 16, 12
    pool = MHAKVCache(
        KV.num_kv_heads, KV.num_layers, KV.head_dim, pages, KV.dtype, page_size=page, device="cuda"
    )
    cm = CacheManager(
        pages,
        page_size=page,
        device="cuda",
        host_num_pages=3 * pages,
        write_policy=policy,
        kv_cache=pool,
        host_layout=host_layout,
    )
    assert cm.host_pool.pinned
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 1000, (page * 5 + 3,), generator=g, dtype=torch.int32) for _ in range(6)
    ]
    loaded = 0
    for round_ in range(3):
        for ids in prompts:
            h, idx = cm.match_req(ids)
            dev_hit = h.cached_len
            h, idx = cm.load_back(h)
            loaded += h.cached_len - dev_hit
            own = cm.allocate(len(ids) - h.cached_len)
            _store(pool, own[: len(ids) - h.cached_len], ids[h.cached_len :], h.cached_len)
            # k_cache(layer) makes the current stream wait for the layer's load.
            assert _rows_ok(pool, idx, ids[: h.cached_len], 0)
            cm.free_and_cache_finished_req(h, ids, torch.cat([idx, own]))
            assert cm.drain() == []
            cm.check_integrity()
    assert loaded > 0
    assert cm.tier_counters.loaded_back == loaded


@needs_gpu
def test_layer_zero_is_readable_before_the_last_layer_lands_on_cuda():
    page, pages = 16, 64
    layers = 8
    shape = KVShape(layers, KV.num_kv_heads, KV.head_dim, KV.dtype)
    pool = MHAKVCache(
        shape.num_kv_heads,
        layers,
        shape.head_dim,
        pages,
        shape.dtype,
        page_size=page,
        device="cuda",
    )
    cm = CacheManager(pages, page_size=page, device="cuda", host_num_pages=2 * pages, kv_cache=pool)
    ids = torch.arange(page * 40 + 1, dtype=torch.int32)
    h, _ = cm.match_req(ids)
    cm.lock(h)
    own = cm.allocate(len(ids))
    for layer in range(layers):
        pool.store_kv(
            shape.rows(ids, 0, layer, 0).cuda(),
            shape.rows(ids, 0, layer, 1).cuda(),
            own[: len(ids)],
            layer,
        )
    cm.free_and_cache_finished_req(h, ids, own)
    cm.drain()
    cm.make_room(pages * page)  # everything goes to host only
    h, _ = cm.match_req(ids)
    assert h.cached_len == 0 and h.host_hit_len == page * 40
    h, idx = cm.load_back(h)
    cm.wait_layer(0)
    k0 = pool.k_cache(0).reshape(-1, shape.num_kv_heads, shape.head_dim)[idx.long()].cpu()
    assert torch.equal(
        k0.view(torch.int16), shape.rows(ids[: h.cached_len], 0, 0, 0).view(torch.int16)
    )
    cm.wait_layer(layers - 1)
    torch.cuda.synchronize()
    assert cm.drain() == []
    cm.unlock(h)
    cm.check_integrity()
