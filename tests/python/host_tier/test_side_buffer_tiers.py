"""Per-token side buffers through the tiers: a page's side rows go to host
memory, come back to the device and go through storage with its K/V."""

from __future__ import annotations

import pytest
import torch

from radixkv.kvcache import MHAKVCache, MLAKVCache
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.scheduler import CacheManager
from radixkv.storage import FileStorage, pool_fingerprint
from devices import EXT_DEVICES

LAYERS, PS = 2, 2


def _pool(kind, device="cpu", pages=8):
    if kind == "mha":
        pool = MHAKVCache(2, LAYERS, 4, pages, torch.float32, page_size=PS, device=device)
    else:
        pool = MLAKVCache(6, 2, LAYERS, pages, torch.float32, page_size=PS, device=device)
    pool.register_side_buffer("scale", (2,), torch.float32)
    pool.register_side_buffer("label", (3,), torch.int8)
    return pool


def _write(pool, n, idx, value):
    """K/V and side rows whose values name the request, the layer and the token."""
    dev = pool.device
    for layer in range(LAYERS):
        t = torch.arange(n, dtype=torch.float32, device=dev) + 100 * layer + value
        side = {
            "scale": t[:, None].expand(n, 2).contiguous(),
            "label": (t[:, None].expand(n, 3) % 101).to(torch.int8).contiguous(),
        }
        if isinstance(pool, MHAKVCache):
            kv = t[:, None, None].expand(n, 2, 4).contiguous()
            pool.store_kv(kv, -kv, idx[:n], layer, side=side)
        else:
            pool.store_kv(
                t[:, None, None].expand(n, 1, 6).contiguous(),
                -t[:, None, None].expand(n, 1, 2).contiguous(),
                idx[:n],
                layer,
                side=side,
            )


def _read(pool, idx):
    idx = idx.long().to(pool.device)
    out = []
    for layer in range(LAYERS):
        k = pool.k_cache(layer)
        out.append(k.reshape(k.shape[0] * k.shape[1], -1)[idx].cpu())
        for name in ("scale", "label"):
            s = pool.side_buffer(name, layer)
            out.append(s.reshape(s.shape[0] * s.shape[1], -1)[idx].cpu())
    return out


def _serve(cm, pool, ids, value):
    h, _ = cm.match_req(ids)
    cm.lock(h)
    idx = cm.allocate(len(ids))
    _write(pool, len(ids), idx, value)
    full = len(ids) - len(ids) % PS
    rows = _read(pool, idx[:full])
    cm.free_and_cache_finished_req(h, ids, idx)
    cm.drain()
    return rows


@pytest.mark.parametrize("device", EXT_DEVICES)
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_side_rows_come_back_from_host_with_their_page(kind, host_layout, device):
    pool = _pool(kind, device)
    cm = CacheManager(
        8, PS, device=device, host_num_pages=16, kv_cache=pool, host_layout=host_layout
    )
    prompts = [list(range(100 * r, 100 * r + 9)) for r in range(3)]
    want = [_serve(cm, pool, ids, 1000 * (r + 1)) for r, ids in enumerate(prompts)]
    h, _ = cm.match_req(prompts[0])
    assert h.cached_len == 0 and h.host_hit_len == 8  # evicted from the device
    loaded, idx = cm.load_back(h)
    cm.drain()
    got = _read(pool, idx)
    for a, b in zip(got, want[0]):
        assert torch.equal(a, b)
    cm.unlock(loaded)
    cm.check_integrity()


def test_side_rows_go_through_storage(tmp_path):
    ids = list(range(9))

    def manager():
        pool = _pool("mha", pages=16)
        storage = FileStorage(str(tmp_path), fingerprint=pool_fingerprint(pool, model="m"))
        return CacheManager(
            16,
            PS,
            host_num_pages=16,
            kv_cache=pool,
            storage=storage,
            prefetch_policy="wait_complete",
        ), pool

    first, pool = manager()
    want = _serve(first, pool, ids, 5000)
    assert first.storage_counters.written_pages == 4
    first.close()
    second, pool2 = manager()
    assert second.wait_prefetch(second.prefetch(ids)) == 8
    h, _ = second.match_req(ids)
    loaded, idx = second.load_back(h)
    second.drain()
    for a, b in zip(_read(pool2, idx), want):
        assert torch.equal(a, b)
    second.unlock(loaded)
    second.close()


def test_host_pages_hold_side_rows_inside_each_page():
    pool = _pool("mha")
    host = HostKVCache(pool, 5, pin_memory=False)
    page = host.page(3)
    assert page.dtype == torch.uint8 and page.is_contiguous()
    kv_bytes = 2 * LAYERS * PS * 2 * 4 * 4
    side_bytes = LAYERS * PS * (2 * 4 + 3)
    assert kv_bytes + side_bytes <= page.numel() < kv_bytes + side_bytes + 32
    host.side_buffer("label", 1)[3, 1] = torch.tensor([7, 8, 9], dtype=torch.int8)
    host.k_cache(0)[3, 0] = 2.5
    assert (page == 7).any() and (page.view(torch.float32)[:8] == 2.5).all()
    assert host.dtype == torch.float32
    with pytest.raises(ValueError, match="not a side buffer"):
        host.side_buffer("nope", 0)


def test_side_buffers_are_registered_before_the_host_tier_and_named_in_keys():
    pool = _pool("mha")
    plain = MHAKVCache(2, LAYERS, 4, 8, torch.float32, page_size=PS)
    assert pool_fingerprint(pool, model="m") != pool_fingerprint(plain, model="m")
    cm = CacheManager(8, PS, host_num_pages=8, kv_cache=pool)
    with pytest.raises(ValueError, match="before the pool backs"):
        pool.register_side_buffer("late", (1,), torch.float32)
    assert pool.side_buffer_names == ("scale", "label")
    cm.close()


def test_controller_refuses_side_planes_that_do_not_match_the_kv():
    from radixkv import _core

    pool = _pool("mha")
    host = HostKVCache(pool, 8, pin_memory=False)
    (dev_buf, dev_layout, rb), _ = pool.side_copy_layouts()
    (host_buf, host_layout, _), _ = host.side_copy_layouts()
    kv = (
        pool.kv_buffer,
        list(pool.copy_layout()),
        host.kv_buffer,
        list(host.copy_layout()),
        host.row_bytes,
        LAYERS,
    )
    small = HostKVCache(_pool("mha", pages=4), 4, pin_memory=False)
    (small_buf, small_layout, _), _ = small.side_copy_layouts()
    bad = [
        (
            [(dev_buf, list(dev_layout), small_buf, list(small_layout), rb)],
            ValueError,
            "slots and page size",
        ),
        ([(dev_buf, list(dev_layout), host_buf, list(host_layout), "x")], TypeError, "row_bytes"),
        ([(dev_buf, list(dev_layout), host_buf)], ValueError, "side_planes items"),
        ([(dev_buf, ["a"], host_buf, list(host_layout), rb)], TypeError, "layouts"),
        (5, TypeError, "side_planes must be a sequence"),
    ]
    for planes, error, message in bad:
        with pytest.raises(error, match=message):
            _core.CacheController(*kv, False, planes)
    c = _core.CacheController(
        *kv, True, [(dev_buf, list(dev_layout), host_buf, list(host_layout), rb)]
    )
    assert c.num_layers == LAYERS
