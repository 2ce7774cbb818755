"""MLA pages through the tiers: the host tier copies one latent row per token
and layer, and the storage tier is written by one tensor-parallel rank and read
by all of them."""

from __future__ import annotations

import os

import pytest
import torch

from radixkv import _core
from radixkv.kvcache import MHAKVCache, MLAKVCache
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.scheduler import CacheManager
from radixkv.storage import FileStorage, pool_fingerprint
from devices import EXT_DEVICES

LORA, ROPE, LAYERS = 6, 2, 3




def _pool(pages=16, page_size=2, layout="LayerFirst", dtype=torch.float32, device="cpu"):
    from radixkv.kvcache import KVCacheLayout

    return MLAKVCache(
        LORA,
        ROPE,
        LAYERS,
        pages,
        dtype,
        kv_layout=KVCacheLayout[layout],
        page_size=page_size,
        device=device,
    )


def _store(pool, ids_len, idx, value):
    """Writes rows whose values name the request and the token, in every layer."""
    for layer in range(LAYERS):
        base = torch.arange(ids_len, dtype=torch.float32)[:, None] + 100 * layer + value
        base = base.to(pool.device)
        nope = base.expand(ids_len, LORA).reshape(ids_len, 1, LORA).contiguous()
        rope = (-base).expand(ids_len, ROPE).reshape(ids_len, 1, ROPE).contiguous()
        pool.store_kv(nope, rope, idx[:ids_len], layer)


def _rows(pool, idx):
    return torch.stack(
        [
            pool.k_cache(layer).reshape(-1, LORA + ROPE)[idx.long().to(pool.device)]
            for layer in range(LAYERS)
        ]
    ).cpu()


def test_host_pool_of_an_mla_pool_has_one_side():
    for layout in ("page_first", "layer_first"):
        host = HostKVCache(_pool(), 4, layout=layout, pin_memory=False)
        assert host.copy_layout().sides == 1
        assert host.row_bytes == (LORA + ROPE) * 4
        assert host.k_cache(1).shape == (4, 2, 1, LORA + ROPE)
        v = host.v_cache(1)
        assert v.shape == (4, 2, 1, LORA) and v.data_ptr() == host.k_cache(1).data_ptr()
    # page_first keeps a page in one region: L rows of page_size tokens.
    host = HostKVCache(_pool(), 4, pin_memory=False)
    assert host.page(3).numel() == LAYERS * 2 * (LORA + ROPE)


def test_transfers_between_pools_of_different_sides_are_refused():
    mla, mha = _pool(), MHAKVCache(1, LAYERS, LORA + ROPE, 16, torch.float32, page_size=2)
    with pytest.raises(ValueError, match="sides"):
        _core.transfer_rows(
            mla.kv_buffer,
            list(mla.copy_layout()),
            mha.kv_buffer,
            list(mha.copy_layout()),
            (LORA + ROPE) * 4,
            LAYERS,
            [0],
            [0],
        )
    before = mha.kv_buffer.clone()
    assert torch.equal(mha.kv_buffer, before)


@pytest.mark.parametrize("device", EXT_DEVICES)
@pytest.mark.parametrize("layout", ["LayerFirst", "PageFirst"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_mla_rows_come_back_from_host(layout, host_layout, device):
    pool = _pool(pages=8, layout=layout, device=device)
    cm = CacheManager(
        8,
        2,
        device=device,
        host_num_pages=16,
        kv_cache=pool,
        host_layout=host_layout,
        write_policy="write_through",
    )
    prompts = [list(range(100 * r, 100 * r + 9)) for r in range(3)]
    want = {}
    for r, ids in enumerate(prompts):  # each fills 5 of the 8 pages: the older ones go to host
        h, _ = cm.match_req(ids)
        cm.lock(h)
        idx = cm.allocate(len(ids))
        _store(pool, len(ids), idx, 1000 * (r + 1))
        want[r] = _rows(pool, idx[:8])
        cm.free_and_cache_finished_req(h, ids, idx)
        cm.drain()
    h, _ = cm.match_req(prompts[0])
    assert h.cached_len == 0 and h.host_hit_len == 8
    loaded, idx = cm.load_back(h)
    cm.drain()
    assert torch.equal(_rows(pool, idx), want[0])  # every layer's whole latent row
    cm.unlock(loaded)
    cm.check_integrity()


def test_one_rank_writes_mla_pages_and_every_rank_reads_them(tmp_path):
    ids = list(range(9))

    def manager(rank):
        pool = _pool()
        seed = pool_fingerprint(pool, model="m", tp_rank=rank)
        storage = FileStorage(str(tmp_path), fingerprint=seed)
        cm = CacheManager(
            16,
            2,
            host_num_pages=16,
            kv_cache=pool,
            storage=storage,
            prefetch_policy="wait_complete",
            tp_rank=rank,
        )
        return cm, pool

    def files():
        return sum(len(f) for _, _, f in os.walk(tmp_path))

    rank1, pool1 = manager(1)  # computes first, writes nothing
    h, _ = rank1.match_req(ids)
    rank1.lock(h)
    idx = rank1.allocate(len(ids))
    _store(pool1, len(ids), idx, 7000)
    rank1.free_and_cache_finished_req(h, ids, idx)
    rank1.drain()
    assert rank1.storage_counters.written_pages == 0 and files() == 0
    rank1.close()
    rank0, pool0 = manager(0)
    h, _ = rank0.match_req(ids)
    rank0.lock(h)
    idx0 = rank0.allocate(len(ids))
    _store(pool0, len(ids), idx0, 7000)
    want = _rows(pool0, idx0[:8])
    rank0.free_and_cache_finished_req(h, ids, idx0)
    rank0.drain()
    assert rank0.storage_counters.written_pages == 4 and files() == 4
    rank0.close()
    # A fresh rank 3 finds rank 0's pages under the same keys and reads them.
    rank3, pool3 = manager(3)
    op = rank3.prefetch(ids)
    assert rank3.wait_prefetch(op) == 8
    h, _ = rank3.match_req(ids)
    loaded, idx3 = rank3.load_back(h)
    rank3.drain()
    assert torch.equal(_rows(pool3, idx3), want)
    rank3.unlock(loaded)
    rank3.check_integrity()
    rank3.close()


def test_mla_fingerprints_leave_the_rank_out_and_name_the_page_kind():
    mla = _pool()
    assert pool_fingerprint(mla, model="m", tp_rank=0) == pool_fingerprint(
        mla, model="m", tp_rank=5
    )
    mha = MHAKVCache(1, LAYERS, LORA + ROPE, 16, torch.float32, page_size=2)
    assert pool_fingerprint(mha, model="m") != pool_fingerprint(mla, model="m")
    assert pool_fingerprint(mha, model="m", tp_rank=0) != pool_fingerprint(
        mha, model="m", tp_rank=1
    )
    other_split = MLAKVCache(LORA + 1, ROPE - 1, LAYERS, 16, torch.float32, page_size=2)
    assert pool_fingerprint(other_split, model="m") != pool_fingerprint(mla, model="m")
    fp8 = _pool(dtype=torch.float8_e4m3fn)
    assert pool_fingerprint(fp8, model="m") != pool_fingerprint(mla, model="m")
    with pytest.raises(ValueError, match="^tp_rank must be >= 0"):
        CacheManager(4, tp_rank=-1)
