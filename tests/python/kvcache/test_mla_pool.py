"""The MLA KV pool (radixkv.kvcache.MLAKVCache) and its one-call store
(radixkv.kernel.store_mla): layouts, views, store_kv against a plain torch
reference, float8 with a scale, and bad arguments.

Every comparison is bytewise (caches and inputs viewed as uint8), so float8 and
random bit patterns (NaNs included) compare exactly.
"""

from __future__ import annotations

import pytest
import torch

from radixkv import kernel
from radixkv.kvcache import (
    BaseKVCache,
    CopyLayout,
    KVCacheLayout,
    KVCacheType,
    MLAKVCache,
    create_kvcache,
)

from float8_reference import to_float8, torch_casts_like_this
from devices import DEVICES

LAYOUTS = [KVCacheLayout.LayerFirst, KVCacheLayout.PageFirst]
FLOAT8 = [
    d
    for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
    if d is not None
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16] + FLOAT8
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]
needs_float8 = pytest.mark.skipif(not FLOAT8, reason="this torch has no float8 dtypes")


def random_bytes(shape, dtype, g) -> torch.Tensor:
    shape = tuple(shape)
    raw = torch.randint(
        0, 256, shape[:-1] + (shape[-1] * dtype.itemsize,), dtype=torch.uint8, generator=g
    )
    return raw.view(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def layer_rows(cache: MLAKVCache, layer: int) -> torch.Tensor:
    """Layer `layer` as `[num_slots, R]` bytes (a copy)."""
    return as_bytes(cache.k_cache(layer)).reshape(cache.num_slots, -1)


def snapshot(cache: MLAKVCache):
    return [layer_rows(cache, i) for i in range(cache.num_layers)]


def reference_store(before, cache, k_nope, k_rope, out_loc, layer, scale=None):
    """The contract: `rows[loc, :lora] = k_nope; rows[loc, lora:] = k_rope` on a copy,
    after `(x.float() / scale).to(dtype)` when the pool converts."""
    expected = [rows.clone() for rows in before]
    item = cache.dtype.itemsize
    lora = cache.kv_lora_rank
    loc = out_loc.cpu().long()

    def cast(x):
        x = x.cpu().reshape(x.shape[0], -1)
        if x.dtype != cache.dtype:
            x = to_float8(x, cache.dtype, 1.0 if scale is None else scale)
        return as_bytes(x)

    expected[layer][loc, : lora * item] = cast(k_nope)
    expected[layer][loc, lora * item :] = cast(k_rope)
    return expected


def assert_same(cache, expected):
    for i, rows in enumerate(expected):
        assert torch.equal(layer_rows(cache, i), rows), f"layer {i} differs"


def fill_random(cache, g):
    cache.kv_buffer.view(torch.uint8).copy_(
        as_bytes(random_bytes(cache.kv_buffer.shape, cache.dtype, g))
    )


# --- construction, views, layouts ---------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_views_and_properties(device, layout, page_size):
    c = MLAKVCache(
        512,
        64,
        num_layers=3,
        num_pages=5,
        dtype=torch.bfloat16,
        kv_layout=layout,
        device=device,
        page_size=page_size,
    )
    assert isinstance(c, BaseKVCache)
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.row_dim) == (512, 64, 576)
    assert c.num_layers == 3 and c.num_pages == 5 and c.page_size == page_size
    assert c.num_slots == 5 * page_size and c.dtype == torch.bfloat16
    assert c.device.type == device and c.kv_layout is layout
    assert c.nbytes == 3 * 5 * page_size * 576 * 2 and c.row_bytes == 1152
    assert torch.count_nonzero(c.kv_buffer) == 0
    for i in range(3):
        k, v = c.k_cache(i), c.v_cache(i)
        assert k.shape == (5, page_size, 1, 576) and v.shape == (5, page_size, 1, 512)
        # v_cache is a view of k_cache's memory: same start, same strides, no copy.
        assert v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
        assert k.stride(-1) == 1
        assert k.untyped_storage().data_ptr() == c.kv_buffer.untyped_storage().data_ptr()
    if layout is KVCacheLayout.LayerFirst:
        assert c.kv_buffer.shape == (3, 5, page_size, 1, 576) and c.k_cache(1).is_contiguous()
    else:
        assert c.kv_buffer.shape == (5, 3, page_size, 1, 576)
        assert c.k_cache(1).stride(0) == 3 * page_size * 576
    assert "MLAKVCache(" in repr(c) and "kv_lora_rank=512" in repr(c)
    assert f"kv_layout={layout.name}" in repr(c)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_views_index_the_one_buffer_in_storage_order(layout):
    c = MLAKVCache(6, 2, 3, 5, torch.float32, kv_layout=layout, page_size=2)
    buf = c.kv_buffer
    buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view(buf.shape))
    for layer in range(3):
        for page in range(5):
            want = buf[layer, page] if layout is KVCacheLayout.LayerFirst else buf[page, layer]
            assert torch.equal(c.k_cache(layer)[page], want)
            assert torch.equal(c.v_cache(layer)[page], want[..., :6])
    c.k_cache(2)[4, 1, 0, 3] = -1.0  # a write through k_cache shows in v_cache
    assert c.v_cache(2)[4, 1, 0, 3] == -1.0


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("page_size", [1, 4])
def test_copy_layout_locates_every_row(layout, page_size):
    c = MLAKVCache(8, 4, 3, 5, torch.float16, kv_layout=layout, page_size=page_size)
    cl = c.copy_layout()
    assert isinstance(cl, CopyLayout)
    assert cl.side_stride == 0 and cl.sides == 1 and c.sides == 1 and c.row_shape == (1, 12)
    assert c.row_bytes == 12 * 2 and cl.page_size == page_size and cl.num_slots == c.num_slots
    base = c.kv_buffer.data_ptr()
    for layer in range(3):
        rows = c.k_cache(layer).view(-1, 12) if layout is KVCacheLayout.LayerFirst else None
        for slot in range(c.num_slots):
            at = (
                layer * cl.layer_stride
                + (slot // page_size) * cl.page_stride
                + (slot % page_size) * cl.row_stride
            )
            want = c.k_cache(layer)[slot // page_size, slot % page_size, 0].data_ptr()
            assert base + at == want
            if rows is not None:
                assert rows[slot].data_ptr() == want


def test_copy_layout_is_what_the_copy_engine_reads():
    """The native row copy of the host tier takes an MLA pool's layout as it is
    (one side: side_stride 0), here between two pools of different layouts."""
    from radixkv import _core

    g = torch.Generator().manual_seed(12)
    src = MLAKVCache(8, 4, 3, 6, torch.bfloat16, page_size=4)
    dst = MLAKVCache(8, 4, 3, 6, torch.bfloat16, kv_layout=KVCacheLayout.PageFirst, page_size=4)
    fill_random(src, g)
    fill_random(dst, g)
    before = snapshot(dst)
    a, b = [3, 10, 22], [0, 17, 5]
    _core.transfer_rows(
        src.kv_buffer,
        list(src.copy_layout()),
        dst.kv_buffer,
        list(dst.copy_layout()),
        src.row_bytes,
        3,
        torch.tensor(a, dtype=torch.int32),
        torch.tensor(b, dtype=torch.int32),
    )
    for layer in range(3):
        want = before[layer].clone()
        want[b] = layer_rows(src, layer)[a]
        assert torch.equal(layer_rows(dst, layer), want)


def test_tp_size_splits_nothing():
    a = MLAKVCache(64, 16, 2, 3, torch.bfloat16, tp_size=8)
    b = MLAKVCache(64, 16, 2, 3, torch.bfloat16, tp_size=1)
    assert a.tp_size == 8 and a.kv_buffer.shape == b.kv_buffer.shape
    assert a.k_cache(0).shape == (3, 1, 1, 80)


@pytest.mark.parametrize(
    "name", ["kv_lora_rank", "qk_rope_head_dim", "num_layers", "num_pages", "page_size", "tp_size"]
)
def test_bad_sizes_name_the_argument(name):
    args = dict(kv_lora_rank=8, qk_rope_head_dim=4, num_layers=1, num_pages=1, dtype=torch.float32)
    with pytest.raises(ValueError, match=name):
        MLAKVCache(**{**args, name: 0})
    with pytest.raises(TypeError, match=name):
        MLAKVCache(**{**args, name: 1.5})


def test_bad_dtype_and_layout():
    with pytest.raises(TypeError, match="dtype"):
        MLAKVCache(8, 4, 1, 1, torch.int32)
    with pytest.raises(ValueError, match="kv_layout"):
        MLAKVCache(8, 4, 1, 1, torch.float32, kv_layout="row_first")


def test_create_kvcache_mla():
    c = create_kvcache(
        num_layers=2,
        num_kv_heads=1,
        num_pages=3,
        head_dim=576,
        dtype=torch.bfloat16,
        page_size=16,
        cache_layout=KVCacheLayout.PageFirst,
        cache_type=KVCacheType.MLA,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
    )
    assert isinstance(c, MLAKVCache) and c.kv_layout is KVCacheLayout.PageFirst
    assert c.k_cache(1).shape == (3, 16, 1, 576) and c.v_cache(1).shape == (3, 16, 1, 512)
    assert (
        create_kvcache(
            1, 1, 1, 12, torch.float32, cache_type="mla", kv_lora_rank=8, qk_rope_head_dim=4
        ).row_dim
        == 12
    )
    with pytest.raises(ValueError, match="kv_lora_rank is required"):
        create_kvcache(1, 1, 1, 12, torch.float32, cache_type="mla", qk_rope_head_dim=4)
    with pytest.raises(ValueError, match="head_dim=10"):
        create_kvcache(
            1, 1, 1, 10, torch.float32, cache_type="mla", kv_lora_rank=8, qk_rope_head_dim=4
        )
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        create_kvcache(
            1, 2, 1, 12, torch.float32, cache_type="mla", kv_lora_rank=8, qk_rope_head_dim=4
        )
    with pytest.raises(ValueError, match="kv_lora_rank is an MLA size"):
        create_kvcache(1, 1, 1, 12, torch.float32, kv_lora_rank=8)


# --- store_kv against the torch reference -------------------------------------------


def make_inputs(n, lora, rope, dtype, num_slots, index_dtype, device, g, form):
    """k_nope, k_rope in one of the accepted forms, and n distinct slots."""
    if form == "fused":  # slices of one projection output: [n, lora + 96 + rope]
        fused = random_bytes((n, lora + 96 + rope), dtype, g).to(device)
        k_nope, k_rope = fused[:, :lora], fused[:, lora + 96 :]
        assert n < 2 or not k_nope.is_contiguous()
    elif form == "heads":  # [n, 1, lora] and [n, 1, rope]
        k_nope = random_bytes((n, 1, lora), dtype, g).to(device)
        k_rope = random_bytes((n, 1, rope), dtype, g).to(device)
    elif form == "misaligned":  # rows one element off: narrowest accesses
        flat = random_bytes((n, lora + rope + 1), dtype, g).to(device)
        k_nope, k_rope = flat[:, 1 : 1 + lora], flat[:, 1 + lora :].unsqueeze(1)
    else:
        k_nope = random_bytes((n, lora), dtype, g).to(device)
        k_rope = random_bytes((n, rope), dtype, g).to(device)
    out_loc = torch.randperm(num_slots, generator=g)[:n].to(index_dtype).to(device)
    return k_nope, k_rope, out_loc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dims", [(512, 64), (128, 64), (100, 30), (7, 3)], ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("form", ["flat", "heads", "fused", "misaligned"])
def test_store_kv_matches_reference(device, layout, dtype, dims, page_size, form):
    lora, rope = dims
    g = torch.Generator().manual_seed(lora * 7 + page_size)
    c = MLAKVCache(lora, rope, 3, 7, dtype, kv_layout=layout, device=device, page_size=page_size)
    fill_random(c, g)
    for index_dtype, (layer, n) in zip(
        (torch.int32, torch.int64, torch.int32),
        ((1, min(5, c.num_slots)), (2, c.num_slots), (0, 1)),
    ):
        k_nope, k_rope, out_loc = make_inputs(
            n, lora, rope, dtype, c.num_slots, index_dtype, device, g, form
        )
        expected = reference_store(snapshot(c), c, k_nope, k_rope, out_loc, layer)
        c.store_kv(k_nope, k_rope, out_loc, layer)
        assert_same(c, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_large_batch(device):
    """Past the CPU kernel's streaming threshold and its GIL release."""
    g = torch.Generator().manual_seed(9)
    c = MLAKVCache(512, 64, 2, 400, torch.bfloat16, device=device, page_size=16)
    k_nope, k_rope, out_loc = make_inputs(
        5000, 512, 64, torch.bfloat16, c.num_slots, torch.int64, device, g, "fused"
    )
    expected = reference_store(snapshot(c), c, k_nope, k_rope, out_loc, 1)
    c.store_kv(k_nope, k_rope, out_loc, 1)
    assert_same(c, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_empty_batch_and_edge_slots(device):
    c = MLAKVCache(4, 2, 1, 3, torch.float32, device=device, page_size=16)
    before = snapshot(c)
    c.store_kv(
        torch.empty(0, 4, device=device),
        torch.empty(0, 2, device=device),
        torch.empty(0, dtype=torch.int32, device=device),
        0,
    )
    assert_same(c, before)
    k_nope = torch.arange(8, dtype=torch.float32, device=device).view(2, 4)
    k_rope = -torch.arange(1, 5, dtype=torch.float32, device=device).view(2, 2)
    c.store_kv(k_nope, k_rope, torch.tensor([0, 47], device=device), 0)
    assert c.k_cache(0)[2, 15, 0].tolist() == [4.0, 5.0, 6.0, 7.0, -3.0, -4.0]
    assert c.v_cache(0)[0, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_store_mla_kernel_on_caller_caches():
    """radixkv.kernel.store_mla on a cache the caller made: [num_slots, R] and
    [num_slots, 1, R], and a padded cache whose rows are wider than R."""
    g = torch.Generator().manual_seed(3)
    for shape in ((40, 24), (40, 1, 24)):
        kv = random_bytes(shape, torch.float16, g)
        k_nope = random_bytes((9, 16), torch.float16, g)
        k_rope = random_bytes((9, 8), torch.float16, g)
        loc = torch.randperm(40, generator=g)[:9]
        want = kv.clone().view(40, 24)
        want[loc, :16], want[loc, 16:] = k_nope, k_rope
        kernel.store_mla(kv, loc, k_nope, k_rope, 16)
        assert torch.equal(as_bytes(kv).view(40, -1), as_bytes(want))
    padded = random_bytes((40, 1, 30), torch.float16, g)
    kv = padded[..., 2:26]
    loc = torch.randperm(40, generator=g)[:9]
    want = padded.clone()
    want[loc, 0, 2:18], want[loc, 0, 18:26] = k_nope, k_rope
    kernel.store_mla(kv, loc, k_nope, k_rope, 16)
    assert torch.equal(as_bytes(padded), as_bytes(want))


def test_store_mla_torch_fallback_matches_native():
    """The torch path (devices without a native kernel) writes what the kernel writes."""
    from radixkv.kernel.store import _store_mla_torch

    g = torch.Generator().manual_seed(11)
    for dtype, scale in [(torch.bfloat16, None)] + [(d, 0.25) for d in FLOAT8]:
        src_dtype = torch.bfloat16
        base = random_bytes((3, 8, 1, 20), dtype, g)
        a, b = base.clone(), base.clone()
        k_nope = torch.randn(11, 1, 16, generator=g).to(src_dtype)
        k_rope = torch.randn(11, 4, generator=g).to(src_dtype)
        if dtype == src_dtype:
            scale = None
        loc = torch.randperm(24, generator=g)[:11]
        kernel.store_mla(a, loc, k_nope, k_rope, 16, k_scale=scale)
        _store_mla_torch(b, loc, k_nope, k_rope, 16, scale)
        assert torch.equal(as_bytes(a), as_bytes(b)), dtype


# --- float8 -----------------------------------------------------------------------------


@needs_float8
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("cache_dtype", FLOAT8, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    "src_dtype",
    [torch.float32, torch.float16, torch.bfloat16],
    ids=lambda d: str(d).removeprefix("torch."),
)
@pytest.mark.parametrize("scale", [None, 0.5, 3.7, "tensor"])
def test_float8_pool_converts_with_one_scale(device, layout, cache_dtype, src_dtype, scale):
    g = torch.Generator().manual_seed(5)
    c = MLAKVCache(64, 16, 2, 4, cache_dtype, kv_layout=layout, device=device, page_size=8)
    fill_random(c, g)
    n = 20
    fused = (torch.randn(n, 96, generator=g) * 300).to(src_dtype).to(device)
    k_nope, k_rope = fused[:, :64], fused[:, 80:]
    loc = torch.randperm(c.num_slots, generator=g)[:n].to(device)
    value = 1.0 if scale is None else 0.37 if scale == "tensor" else scale
    k_scale = torch.tensor([value], device=device) if scale == "tensor" else scale
    expected = reference_store(snapshot(c), c, k_nope, k_rope, loc, 1, value)
    c.store_kv(k_nope, k_rope, loc, 1, k_scale=k_scale)
    assert_same(c, expected)


@needs_float8
def test_float8_specials_match_torch():
    """NaN, infinities, overflow, subnormals and ties go as torch (>= 2.12) sends them."""
    specials = [
        float("nan"),
        -float("nan"),
        float("inf"),
        -float("inf"),
        1e30,
        -1e30,
        448.0,
        464.0,
        465.0,
        57344.0,
        61440.0,
        61441.0,
        2.0**-9,
        2.0**-10,
        3 * 2.0**-11,
        2.0**-16,
        2.0**-17,
        0.0,
        -0.0,
        1e-40,
    ]
    x = torch.tensor(specials * 2, dtype=torch.float32)
    for dtype in FLOAT8:
        c = MLAKVCache(len(specials), len(specials), 1, 1, dtype)
        c.store_kv(
            x[: len(specials)].view(1, -1),
            x[len(specials) :].view(1, -1),
            torch.tensor([0]),
            0,
            k_scale=1.0,
        )
        want = to_float8(x, dtype).view(torch.uint8)
        if torch_casts_like_this():
            assert torch.equal(want, x.to(dtype).view(torch.uint8))
        assert torch.equal(c.kv_buffer.view(torch.uint8).view(-1), want), dtype


@needs_float8
def test_float8_fingerprint_differs():
    """The dtype is part of the storage tier's fingerprint: float8 pools never
    read or write a bfloat16 pool's pages, nor each other's."""
    from radixkv.storage import config_fingerprint

    def fingerprint(pool):
        return config_fingerprint(
            model="m",
            dtype=pool.dtype,
            page_size=pool.page_size,
            layout="page_first",
            num_layers=pool.num_layers,
            kv_heads=1,
            head_dim=pool.row_dim,
        )

    prints = {
        fingerprint(MLAKVCache(16, 4, 1, 1, d, page_size=4))
        for d in [torch.bfloat16, torch.float16] + FLOAT8
    }
    assert len(prints) == 2 + len(FLOAT8)
    assert fingerprint(MLAKVCache(16, 4, 1, 1, FLOAT8[0])) == config_fingerprint(
        model="m",
        dtype=str(FLOAT8[0]).removeprefix("torch."),
        page_size=1,
        layout="page_first",
        num_layers=1,
        kv_heads=1,
        head_dim=20,
    )


# --- bad arguments: a clear error naming the argument, nothing written --------------------


def error_cases(device, dtype):
    dev = torch.device(device)
    other = torch.device("cpu") if dev.type == "cuda" else torch.device("meta")
    nope = torch.ones(3, 8, dtype=dtype, device=dev)
    rope = torch.ones(3, 4, dtype=dtype, device=dev)
    loc = torch.tensor([1, 2, 3], device=dev)
    wrong = torch.float16 if dtype != torch.float16 else torch.bfloat16
    cases = [
        ("k_nope not a tensor", dict(k_nope=nope.tolist()), TypeError, r"^k_nope must be a torch"),
        ("k_nope rank", dict(k_nope=nope.view(3, 1, 1, 8)), ValueError, r"^k_nope must have shape"),
        (
            "k_nope width",
            dict(k_nope=torch.ones(3, 7, dtype=dtype, device=dev)),
            ValueError,
            r"^k_nope must have shape \[num_tokens, 8\]",
        ),
        (
            "k_nope heads",
            dict(k_nope=torch.ones(3, 2, 4, dtype=dtype, device=dev)),
            ValueError,
            r"^k_nope has shape \[3, 2, 4\]",
        ),
        (
            "k_rope width",
            dict(k_rope=torch.ones(3, 5, dtype=dtype, device=dev)),
            ValueError,
            r"^k_rope must have shape \[num_tokens, 4\]",
        ),
        (
            "k_rope tokens",
            dict(k_rope=rope[:2]),
            ValueError,
            r"^k_rope has 2 tokens but k_nope has 3",
        ),
        ("k_rope dtype", dict(k_rope=rope.to(torch.int32)), TypeError, r"^k_rope has dtype int32"),
        ("k_nope device", dict(k_nope=nope.to(other)), TypeError, r"^k_nope must"),
        ("out_loc rank", dict(out_loc=loc.view(1, 3)), ValueError, r"^out_loc must be 1-D"),
        (
            "out_loc length",
            dict(out_loc=loc[:2]),
            ValueError,
            r"^out_loc has length 2 but k_nope has 3 tokens",
        ),
        (
            "out_loc range",
            dict(out_loc=torch.tensor([1, 16, 3], device=dev)),
            ValueError,
            r"^out_loc\[1\] = 16 is out of range for a cache of 16 slots",
        ),
        (
            "out_loc negative",
            dict(out_loc=torch.tensor([1, -1, 3], device=dev)),
            ValueError,
            r"^out_loc\[1\] = -1 is out of range",
        ),
        (
            "out_loc repeated",
            dict(out_loc=torch.tensor([1, 2, 1], device=dev)),
            ValueError,
            r"^out_loc\[2\] = 1 repeats an earlier slot",
        ),
        (
            "k_nope strided last",
            dict(k_nope=torch.ones(3, 16, dtype=dtype, device=dev)[:, ::2]),
            ValueError,
            r"^k_nope must have a contiguous last dimension",
        ),
        ("layer_id range", dict(layer_id=2), ValueError, r"^layer_id=2 is out of range"),
        ("layer_id float", dict(layer_id=1.0), TypeError, r"^layer_id must be an int"),
    ]
    if dtype in FLOAT8:
        cases += [
            (
                "k_scale zero",
                dict(k_nope=nope.float(), k_rope=rope.float(), k_scale=0.0),
                ValueError,
                r"^k_scale must be positive and finite",
            ),
            (
                "k_scale negative",
                dict(k_nope=nope.float(), k_rope=rope.float(), k_scale=-2.0),
                ValueError,
                r"^k_scale must be positive",
            ),
            (
                "k_scale inf",
                dict(k_nope=nope.float(), k_rope=rope.float(), k_scale=float("inf")),
                ValueError,
                r"^k_scale must be positive",
            ),
            (
                "k_scale nan",
                dict(k_nope=nope.float(), k_rope=rope.float(), k_scale=float("nan")),
                ValueError,
                r"^k_scale must be positive",
            ),
            (
                "k_scale underflows",
                dict(k_nope=nope.float(), k_rope=rope.float(), k_scale=1e-50),
                ValueError,
                r"^k_scale must be positive and finite in float32",
            ),
            (
                "k_scale 2 elements",
                dict(k_nope=nope.float(), k_rope=rope.float(), k_scale=torch.tensor([1.0, 2.0])),
                ValueError,
                r"^k_scale must be a number or a one-element tensor",
            ),
            (
                "k_scale int tensor",
                dict(k_nope=nope.float(), k_rope=rope.float(), k_scale=torch.tensor([2])),
                TypeError,
                r"^k_scale must be a floating tensor",
            ),
            (
                "k_scale str",
                dict(k_nope=nope.float(), k_rope=rope.float(), k_scale="2"),
                TypeError,
                r"^k_scale must be a number",
            ),
            (
                "k_scale on a same-dtype store",
                dict(k_scale=2.0),
                ValueError,
                r"^k_scale is given, but k_nope already has",
            ),
            (
                "k_nope float64",
                dict(k_nope=nope.double()),
                TypeError,
                r"^k_nope has dtype float64 but kv_cache has dtype float8",
            ),
        ]
    else:
        cases += [
            (
                "k_scale on a non-float8 cache",
                dict(k_scale=2.0),
                ValueError,
                r"^k_scale is given, but k_nope already has",
            ),
            (
                "k_nope other float",
                dict(k_nope=nope.to(wrong)),
                TypeError,
                r"^k_nope has dtype \w+ but kv_cache has dtype",
            ),
        ]
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16] + FLOAT8[:1], ids=lambda d: str(d).removeprefix("torch.")
)
def test_store_kv_bad_arguments(device, layout, dtype):
    c = MLAKVCache(8, 4, 2, 1, dtype, kv_layout=layout, device=device, page_size=16)
    good = dict(
        k_nope=torch.full((3, 8), 5.0, device=device).to(dtype),
        k_rope=torch.full((3, 4), 6.0, device=device).to(dtype),
        out_loc=torch.tensor([1, 2, 3], device=device),
        layer_id=1,
    )
    g = torch.Generator().manual_seed(1)
    fill_random(c, g)
    before = snapshot(c)
    for name, bad, exc, pattern in error_cases(device, dtype):
        with pytest.raises(exc, match=pattern):
            c.store_kv(**{**good, **bad})
        assert_same(c, before)
    c.store_kv(**good)  # and the good call still works
    assert as_bytes(c.k_cache(1)[0, 3, 0, :8]).equal(as_bytes(good["k_nope"][0]))
    assert as_bytes(c.k_cache(1)[0, 1, 0, 8:]).equal(as_bytes(good["k_rope"][0]))


def test_store_mla_kernel_bad_arguments():
    kv = torch.zeros(16, 1, 12)
    nope, rope, loc = torch.ones(3, 8), torch.ones(3, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"^kv_lora_rank=12 must leave both parts"):
        kernel.store_mla(kv, loc, nope, rope, 12)
    with pytest.raises(ValueError, match=r"^kv_lora_rank=0"):
        kernel.store_mla(kv, loc, nope, rope, 0)
    with pytest.raises(ValueError, match=r"^kv_cache must have shape"):
        kernel.store_mla(torch.zeros(16, 2, 12), loc, nope, rope, 8)
    with pytest.raises(ValueError, match=r"^k_nope lies in the memory of kv_cache"):
        kernel.store_mla(kv, loc, kv[:3, 0, :8], rope, 8)
    with pytest.raises(ValueError, match=r"^kv_cache requires grad"):
        kernel.store_mla(torch.zeros(16, 12, requires_grad=True), loc, nope, rope, 8)
    with pytest.raises(TypeError, match=r"^kv_cache must be a torch\.Tensor"):
        kernel.store_mla([0.0], loc, nope, rope, 8)
    assert torch.count_nonzero(kv) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_cuda_store_mla_reads_a_device_scale_without_check_bounds():
    """On CUDA a float32 scale tensor on the device is read by the kernel: no
    synchronization, so the store can be captured in a CUDA graph."""
    if not kernel.cuda_available() or not FLOAT8:
        pytest.skip("radixkv._cuda was not built, or this torch has no float8")
    c = MLAKVCache(64, 16, 1, 4, FLOAT8[0], device="cuda", page_size=16, check_bounds=False)
    g = torch.Generator().manual_seed(2)
    k_nope = torch.randn(10, 64, generator=g).cuda()
    k_rope = torch.randn(10, 16, generator=g).cuda()
    loc = torch.randperm(64, generator=g)[:10].cuda()
    scale = torch.tensor([0.05], device="cuda")
    expected = reference_store(snapshot(c), c, k_nope, k_rope, loc, 0, 0.05)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.store_kv(k_nope, k_rope, loc, 0, k_scale=scale)
    graph.replay()
    torch.cuda.synchronize()
    assert_same(c, expected)
