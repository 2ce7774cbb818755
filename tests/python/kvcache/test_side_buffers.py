"""Per-token side buffers of a pool (SideBuffers on MHAKVCache and MLAKVCache):
registered rows beside the K/V, written by the same store kernel call, against
a plain torch reference; bad arguments name themselves and write nothing."""

from __future__ import annotations

import pytest
import torch

from radixkv import kernel
from radixkv.kvcache import KVCacheLayout, MHAKVCache, MLAKVCache
from devices import DEVICES

LAYOUTS = [KVCacheLayout.LayerFirst, KVCacheLayout.PageFirst]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def make_pool(kind, device, layout, page_size=4):
    if kind == "mha":
        return MHAKVCache(
            2, 3, 16, 5, torch.bfloat16, kv_layout=layout, device=device, page_size=page_size
        )
    return MLAKVCache(
        32, 8, 3, 5, torch.bfloat16, kv_layout=layout, device=device, page_size=page_size
    )


def kv_inputs(pool, n, g, device):
    if isinstance(pool, MHAKVCache):
        shape = (n, pool.local_kv_heads, pool.head_dim)
        return (
            torch.randn(shape, generator=g).bfloat16().to(device),
            torch.randn(shape, generator=g).bfloat16().to(device),
        )
    return (
        torch.randn(n, pool.kv_lora_rank, generator=g).bfloat16().to(device),
        torch.randn(n, pool.qk_rope_head_dim, generator=g).bfloat16().to(device),
    )


def snapshot(pool):
    out = [as_bytes(pool.kv_buffer).clone()]
    for name in pool.side_buffer_names:
        out.append(
            as_bytes(
                torch.stack([pool.side_buffer(name, i) for i in range(pool.num_layers)])
            ).clone()
        )
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_side_buffers_are_written_with_the_kv(device, layout, kind):
    g = torch.Generator().manual_seed(7)
    pool = make_pool(kind, device, layout)
    scales = pool.register_side_buffer("k_scale", 2, torch.float32)
    index = pool.register_side_buffer(
        "index_k", (4, 8), torch.float8_e4m3fn if hasattr(torch, "float8_e4m3fn") else torch.uint8
    )
    flags = pool.register_side_buffer("flags", 3, torch.uint8)
    assert pool.side_buffer_names == ("k_scale", "index_k", "flags")
    assert scales.shape == (3, 5, 4, 2) and index.shape == (3, 5, 4, 4, 8)
    assert pool.side_buffer("index_k", 1).shape == (5, 4, 4, 8)
    assert pool.side_buffer("flags", 2).data_ptr() == flags[2].data_ptr()
    assert torch.count_nonzero(scales) == 0
    n = 9
    for layer, index_dtype in ((1, torch.int32), (2, torch.int64)):
        a, b = kv_inputs(pool, n, g, device)
        s = torch.rand(n, 2, generator=g).to(device)
        wide = torch.randint(0, 256, (n, 40), dtype=torch.uint8, generator=g)
        ik = wide[:, 3:35].view(index.dtype).view(n, 4, 8).to(device)  # strided rows
        f = torch.randint(0, 256, (n, 3), dtype=torch.uint8, generator=g).to(device)
        loc = torch.randperm(pool.num_slots, generator=g)[:n].to(index_dtype).to(device)
        before = snapshot(pool)
        ref_pool = make_pool(kind, "cpu", layout)
        ref_pool.kv_buffer.copy_(pool.kv_buffer.cpu())
        ref_pool.store_kv(a.cpu(), b.cpu(), loc.cpu(), layer)
        pool.store_kv(a, b, loc, layer, side={"k_scale": s, "index_k": ik, "flags": f})
        assert torch.equal(as_bytes(pool.kv_buffer), as_bytes(ref_pool.kv_buffer))
        for name, rows, i in (("k_scale", s, 1), ("index_k", ik, 2), ("flags", f, 3)):
            want = before[i].view(pool.num_layers, pool.num_slots, -1).clone()
            want[layer, loc.cpu().long()] = as_bytes(rows).view(n, -1)
            got = as_bytes(torch.stack([pool.side_buffer(name, j) for j in range(3)]))
            assert torch.equal(got.view(pool.num_layers, pool.num_slots, -1), want), name
    # Only the buffers named are written.
    before = snapshot(pool)
    a, b = kv_inputs(pool, 1, g, device)
    pool.store_kv(
        a,
        b,
        torch.tensor([0], device=device),
        0,
        side={"flags": torch.full((1, 3), 9, dtype=torch.uint8, device=device)},
    )
    after = snapshot(pool)
    assert torch.equal(after[1], before[1]) and torch.equal(after[2], before[2])
    assert pool.side_buffer("flags", 0)[0, 0].tolist() == [9, 9, 9]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_side_bad_arguments_name_themselves_and_write_nothing(device, kind):
    g = torch.Generator().manual_seed(8)
    pool = make_pool(kind, device, KVCacheLayout.LayerFirst)
    pool.register_side_buffer("s", 2, torch.float32)
    pool.register_side_buffer("t", (2, 3), torch.int32)
    a, b = kv_inputs(pool, 3, g, device)
    loc = torch.tensor([1, 2, 3], device=device)
    good_s = torch.ones(3, 2, device=device)
    cases = [
        (dict(side={"u": good_s}), ValueError, r"^side\['u'\]: no such side buffer"),
        (dict(side=[good_s]), TypeError, r"^side must be a mapping"),
        (dict(side={"s": good_s.tolist()}), TypeError, r"^side\[s\] must be a torch\.Tensor"),
        (
            dict(side={"s": torch.ones(3, 3, device=device)}),
            ValueError,
            r"^side\[s\] must have shape \[num_tokens, 2\]",
        ),
        (
            dict(side={"t": torch.ones(3, 3, 2, dtype=torch.int32, device=device)}),
            ValueError,
            r"^side\[t\] must have shape \[num_tokens, 2, 3\]",
        ),
        (
            dict(side={"s": good_s.double()}),
            TypeError,
            r"^side\[s\] has dtype float64 but side buffer s has dtype float32",
        ),
        (
            dict(side={"s": torch.ones(2, 2, device=device)}),
            ValueError,
            r"^side\[s\] has 2 tokens but \w+ has 3",
        ),
        (
            dict(side={"s": torch.ones(3, 4, device=device)[:, ::2]}),
            ValueError,
            r"^side\[s\] must have a contiguous last dimension",
        ),
        (
            dict(side={"s": good_s}, out_loc=torch.tensor([1, 20, 3], device=device)),
            ValueError,
            r"^out_loc\[1\] = 20 is out of range",
        ),
        (
            dict(side={"s": good_s}, out_loc=torch.tensor([1, 2, 1], device=device)),
            ValueError,
            r"^out_loc\[2\] = 1 repeats",
        ),
    ]
    before = snapshot(pool)
    for bad, exc, pattern in cases:
        args = {**dict(out_loc=loc, layer_id=1), **bad}
        with pytest.raises(exc, match=pattern):
            pool.store_kv(a, b, **args)
        after = snapshot(pool)
        assert all(torch.equal(x, y) for x, y in zip(before, after)), pattern


def test_register_side_buffer_bad_arguments():
    pool = MHAKVCache(1, 1, 4, 2, torch.float32)
    pool.register_side_buffer("a", 1, torch.float32)
    with pytest.raises(ValueError, match="already a side buffer"):
        pool.register_side_buffer("a", 1, torch.float32)
    with pytest.raises(ValueError, match="row_shape"):
        pool.register_side_buffer("b", 0, torch.float32)
    with pytest.raises(ValueError, match="row_shape"):
        pool.register_side_buffer("b", (2, -1), torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        pool.register_side_buffer("b", 1, torch.complex64)
    with pytest.raises(TypeError, match="name"):
        pool.register_side_buffer("", 1, torch.float32)
    with pytest.raises(ValueError, match="not a side buffer"):
        pool.side_buffer("zz", 0)
    with pytest.raises(ValueError, match="layer=1"):
        pool.side_buffer("a", 1)
    for i in range(5):
        pool.register_side_buffer(f"x{i}", 1, torch.uint8)
    with pytest.raises(ValueError, match="at most 6 side buffers"):
        pool.register_side_buffer("y", 1, torch.uint8)


def test_store_cache_side_on_caller_buffers_and_the_torch_fallback():
    """radixkv.kernel.store_cache's `side` and the torch path write the same."""
    from radixkv.kernel.store import _store_torch

    g = torch.Generator().manual_seed(9)
    kc = torch.zeros(10, 2, 4)
    buf = torch.zeros(10, 5, dtype=torch.int16)
    k = torch.randn(3, 2, 4, generator=g)
    src = torch.randint(-100, 100, (3, 5), dtype=torch.int16, generator=g)
    loc = torch.tensor([7, 0, 4])
    results = []
    for store in (kernel.store_cache, _store_torch):
        kc_, vc_, buf_ = kc.clone(), kc.clone(), buf.clone()
        store(kc_, vc_, loc, k, -k, side=(("idx", buf_, src),))
        results.append((kc_, vc_, buf_))
    assert torch.equal(results[0][2], results[1][2])
    assert torch.equal(results[0][2][loc], src) and results[0][2][1].eq(0).all()
    assert torch.equal(results[0][0], results[1][0])
    with pytest.raises(ValueError, match=r"^side\[idx\] lies in the memory of k_cache"):
        kernel.store_cache(
            kc, kc.clone(), loc, k, k, side=(("idx", buf, kc.view(torch.int16)[:3, 0, :5]),)
        )
    with pytest.raises(ValueError, match=r"^side buffer idx must be \[num_slots, row\]"):
        kernel.store_cache(kc, kc.clone(), loc, k, k, side=(("idx", buf.view(10, 5, 1), src),))
    with pytest.raises(ValueError, match=r"^side buffer idx has 9 slots but the cache has 10"):
        kernel.store_cache(kc, kc.clone(), loc, k, k, side=(("idx", buf[:9], src),))
    with pytest.raises(TypeError, match=r"^side\[0\] must be a \(name, buffer, source\) tuple"):
        kernel.store_cache(kc, kc.clone(), loc, k, k, side=[("idx", buf)])
    seven = tuple((f"b{i}", torch.zeros(10, 1), torch.zeros(3, 1)) for i in range(7))
    with pytest.raises(ValueError, match=r"^side has 7 buffers; a store writes at most 6"):
        kernel.store_cache(kc, kc.clone(), loc, k, k, side=seven)
    assert torch.count_nonzero(kc) == 0 and torch.count_nonzero(buf) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_side_buffers_in_a_large_batch(device):
    """Past the CPU kernel's GIL release (its tensors pinned) and thread split."""
    g = torch.Generator().manual_seed(10)
    pool = MHAKVCache(8, 2, 128, 400, torch.bfloat16, device=device, page_size=16)
    pool.register_side_buffer("scale", 8, torch.float32)
    n = 5000
    k = torch.randn(n, 8, 128, generator=g).bfloat16().to(device)
    s = torch.randn(n, 8, generator=g).to(device)
    loc = torch.randperm(pool.num_slots, generator=g)[:n].to(device)
    pool.store_kv(k, k, loc, 1, side={"scale": s})
    assert torch.equal(pool.side_buffer("scale", 1).reshape(-1, 8)[loc], s)
    assert torch.equal(pool.k_cache(1).reshape(-1, 8, 128)[loc], k)
    assert pool.side_buffer("scale", 0).eq(0).all()


def test_side_entries_outlive_python_code_run_while_out_loc_is_read():
    """An out_loc item's __index__ may empty the caller's side list: the store
    keeps the entries it was given, and writes exactly them."""
    import gc

    from radixkv import _core

    kc, vc = torch.zeros(64, 2, 4), torch.zeros(64, 2, 4)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    buf, src = torch.zeros(64, 16), torch.full((3, 16), 7.0)
    side = [("s", buf, src)]
    victims = []

    class Evil:
        def __index__(self):
            side.clear()
            gc.collect()
            for _ in range(50):
                victims.append(torch.full((3, 16), 7.0))
                victims.append(torch.zeros(64, 16))
            return 1

    _core.store_cache(kc, vc, [Evil(), 2, 3], k, v, False, None, None, side)
    assert torch.equal(buf[1:4], src) and buf[0].eq(0).all() and buf[4:].eq(0).all()
    assert all(x.eq(0).all() for x in victims[1::2])


def test_empty_batches_with_side_buffers_and_empty_caches_are_no_ops():
    from radixkv import _core

    pool = MHAKVCache(2, 2, 4, 8, torch.bfloat16, page_size=2)
    pool.register_side_buffer("sc", (2, 3), torch.float32)
    empty = torch.zeros(0, 2, 4, dtype=torch.bfloat16)
    pool.store_kv(
        empty, empty, torch.zeros(0, dtype=torch.int64), 1, side={"sc": torch.zeros(0, 2, 3)}
    )
    assert pool.kv_buffer.eq(0).all()
    _core.store_cache(
        torch.zeros(0, 2, 4), torch.zeros(0, 2, 4), [], torch.zeros(0, 2, 4), torch.zeros(0, 2, 4)
    )
    with pytest.raises(ValueError, match="out_loc"):
        _core.store_cache(
            torch.zeros(0, 2, 4),
            torch.zeros(0, 2, 4),
            [0],
            torch.zeros(1, 2, 4),
            torch.zeros(1, 2, 4),
        )


def test_stores_bump_the_version_of_every_side_buffer_they_write():
    from radixkv import _core

    kc, vc = torch.zeros(8, 1, 4), torch.zeros(8, 1, 4)
    a, b = torch.zeros(8, 2), torch.zeros(8, 3)
    k = torch.ones(2, 1, 4)
    before = (kc._version, vc._version, a._version, b._version)
    _core.store_cache(
        kc,
        vc,
        [1, 2],
        k,
        k,
        False,
        None,
        None,
        [("a", a, torch.ones(2, 2)), ("b", b, torch.ones(2, 3))],
    )
    after = (kc._version, vc._version, a._version, b._version)
    assert all(y > x for x, y in zip(before, after))
    kv, side = torch.zeros(8, 1, 6), torch.zeros(8, 2)
    before = (kv._version, side._version)
    _core.store_mla(
        kv,
        [3],
        torch.ones(1, 1, 4),
        torch.ones(1, 1, 2),
        4,
        False,
        None,
        [("s", side, torch.ones(1, 2))],
    )
    assert kv._version > before[0] and side._version > before[1]
