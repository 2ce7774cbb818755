"""EngineKVPool: an engine's own per-layer K/V tensors (SGLang's k_buffer and
v_buffer) as the device pool of a CacheManager's host tier. Rows stored in
the engine's tensors go to host and come back bit for bit, through every
write policy and host layout; the copy engine reads the layers through
their addresses and checks each layer's extent; bad pools are refused by
name; a layer's memory freed under the copies is refused before a copy."""

import pytest
import torch

from radixkv import _core
from radixkv.kvcache import EngineKVPool
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.scheduler import CacheManager
from devices import DEVICES

L, H, D = 3, 2, 8



def planes(pages, page_size, dtype=torch.float32, device="cpu", interleaved=False):
    """Each layer's keys and values, in tensors of their own or (`interleaved`,
    as vLLM's CPU blocks `[slots, 2, ...]`) as the two halves of each slot of
    one tensor per layer."""
    if interleaved:
        layers = [
            torch.zeros(pages * page_size, 2, H, D, dtype=dtype, device=device) for _ in range(L)
        ]
        return [t[:, 0] for t in layers], [t[:, 1] for t in layers]
    make = [torch.zeros(pages * page_size, H, D, dtype=dtype, device=device) for _ in range(2 * L)]
    return make[:L], make[L:]


def rows(ids, layer, side, dtype=torch.float32):
    base = ids.double()[:, None, None] * (layer + 1) * (1.0 if side == 0 else -1.0)
    return (base + torch.arange(H * D, dtype=torch.float64).view(1, H, D) / 64).to(dtype)


def serve(cm, pool, k, v, ids):
    """One request: matched, loaded back, computed, cached. Returns the
    tokens that came from the host tier, after checking every cached row."""
    h, _ = cm.match_req(ids)
    from_host = h.host_hit_len
    h, idx = cm.load_back(h)
    cm.drain()
    n = h.cached_len
    for layer in range(L):
        assert torch.equal(k[layer][idx.long()].cpu(), rows(ids[:n], layer, 0, k[0].dtype))
        assert torch.equal(v[layer][idx.long()].cpu(), rows(ids[:n], layer, 1, k[0].dtype))
    own = cm.allocate(len(ids) - n)
    fresh = ids[n:]
    for layer in range(L):
        pool.store_kv(
            rows(fresh, layer, 0, k[0].dtype).to(k[0].device),
            rows(fresh, layer, 1, k[0].dtype).to(k[0].device),
            own[: len(fresh)],
            layer,
        )
    cm.free_and_cache_finished_req(h, ids, torch.cat([idx, own]))
    cm.drain()
    cm.check_integrity()
    return from_host


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_rows_in_an_engines_layers_come_back_from_host_bit_for_bit(
    device, page_size, policy, host_layout
):
    pages = 8
    k, v = planes(pages, page_size, device=device)
    pool = EngineKVPool(k, v, page_size)
    cm = CacheManager(
        pages,
        page_size=page_size,
        host_num_pages=48,
        kv_cache=pool,
        write_policy=policy,
        host_layout=host_layout,
    )
    g = torch.Generator().manual_seed(page_size)
    prompts = [torch.randint(0, 5000, (6 * page_size + 1,), generator=g) for _ in range(6)]
    from_host = 0
    # The pool holds one prompt: the others come back from host. Each is
    # asked three times in a row (write_through_selective backs up a node
    # matched twice).
    for _ in range(3):
        for ids in prompts:
            for _ in range(3):
                from_host += serve(cm, pool, k, v, ids.to(torch.int32))
    assert from_host > 0
    assert cm.tier_counters.loaded_back > 0
    cm.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_keys_and_values_interleaved_slot_by_slot_come_back_bit_for_bit(
    device, page_size, host_layout
):
    pages = 8
    k, v = planes(pages, page_size, device=device, interleaved=True)
    pool = EngineKVPool(k, v, page_size)
    layout = pool.copy_layout()
    assert layout.row_stride == 2 * H * D * 4 and layout.page_stride == page_size * layout.row_stride
    cm = CacheManager(
        pages, page_size=page_size, host_num_pages=48, kv_cache=pool, host_layout=host_layout
    )
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 5000, (6 * page_size + 1,), generator=g) for _ in range(6)]
    from_host = 0
    for _ in range(2):
        for ids in prompts:
            from_host += serve(cm, pool, k, v, ids.to(torch.int32))
    assert from_host > 0 and cm.tier_counters.loaded_back > 0
    cm.close()


def test_the_copy_engine_reads_each_layer_through_its_own_address():
    k, v = planes(4, 2)
    pool = EngineKVPool(k, v, 2)
    host = HostKVCache(pool, 4, pin_memory=False)
    for layer in range(L):
        k[layer].copy_(rows(torch.arange(8), layer, 0).view_as(k[layer]))
        v[layer].copy_(rows(torch.arange(8), layer, 1).view_as(v[layer]))
    slots = torch.tensor([2, 3, 6, 7], dtype=torch.int32)
    to = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    _core.transfer_rows(
        pool.kv_buffer,
        list(pool.copy_layout()),
        host.copy_buffer,
        list(host.copy_layout()),
        host.row_bytes,
        L,
        slots,
        to,
    )
    for layer in range(L):
        got = host.k_cache(layer).reshape(-1, H, D)[to.long()]
        assert torch.equal(got, k[layer][slots.long()])
        assert torch.equal(host.v_cache(layer).reshape(-1, H, D)[to.long()], v[layer][slots.long()])
    # One layer's tensor shorter than the layout says: refused, naming it.
    short = list(pool.kv_buffer)
    short[L + 1] = torch.zeros(6, H, D)
    with pytest.raises(ValueError, match="src_layout reaches past the end of src"):
        _core.transfer_rows(
            short, list(pool.copy_layout()), host.copy_buffer, list(host.copy_layout()),
            host.row_bytes, L, slots, to,
        )  # fmt: skip
    with pytest.raises(ValueError, match="src must be 6 plane tensors"):
        _core.transfer_rows(
            short[:-1], list(pool.copy_layout()), host.copy_buffer, list(host.copy_layout()),
            host.row_bytes, L, slots, to,
        )  # fmt: skip


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: EngineKVPool(torch.zeros(4, H, D), [torch.zeros(4, H, D)]), TypeError, "k_layers"),
        (lambda: EngineKVPool([], []), ValueError, "at least one layer"),
        (
            lambda: EngineKVPool([torch.zeros(4, H, D)], [torch.zeros(4, H, D)] * 2),
            ValueError,
            "v_layers has 2",
        ),
        (
            lambda: EngineKVPool([torch.zeros(4, H, D)], [torch.zeros(4, H, D + 1)]),
            ValueError,
            "v_layers\\[0\\] must match",
        ),
        (lambda: EngineKVPool([torch.zeros(6, H, D)], [torch.zeros(6, H, D)], 4), ValueError, "multiple of page_size"),
        (lambda: EngineKVPool([torch.zeros(4, H * D)], [torch.zeros(4, H * D)]), ValueError, "num_slots, heads"),
        (
            lambda: EngineKVPool([torch.zeros(4, D, H).transpose(1, 2)], [torch.zeros(4, H, D)]),
            ValueError,
            "contiguous",
        ),
        (
            lambda: EngineKVPool([torch.zeros(4, 2, H, D)[:, 0]], [torch.zeros(4, H, D)]),
            ValueError,
            "v_layers\\[0\\]'s slots must follow each other at k_layers\\[0\\]'s stride",
        ),
        (lambda: EngineKVPool([torch.zeros(4, H, D, dtype=torch.int32)], [torch.zeros(4, H, D)]), TypeError, "floating"),
    ],
)  # fmt: skip
def test_bad_pools_are_refused_by_name(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_a_layer_freed_under_the_copies_raises_in_the_caller():
    k, v = planes(8, 2)
    pool = EngineKVPool(k, v, 2)
    cm = CacheManager(8, page_size=2, host_num_pages=16, kv_cache=pool)
    ids = torch.arange(100, 109, dtype=torch.int32)
    serve(cm, pool, k, v, ids)
    k[1].untyped_storage().resize_(0)  # the engine freed a layer's memory
    cm.make_room(8 * 2)
    h, _ = cm.match_req(ids)
    with pytest.raises(TypeError, match="device has no data .* storage was freed"):
        cm.load_back(h)
    cm.check_integrity()
    cm.close()
