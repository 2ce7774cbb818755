"""The paged KV pool (radixkv.kvcache.MHAKVCache): layouts, views, store_kv against
a plain torch reference, tensor parallelism, sizing, and bad arguments.

Every comparison is bytewise (caches and inputs viewed as uint8), so float8 and
random bit patterns (NaNs included) compare exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixkv.kvcache import (
    BaseKVCache,
    KVCacheLayout,
    KVCacheType,
    MHAKVCache,
    create_kvcache,
    kv_bytes_per_page,
    num_pages_for_memory,
)
from radixkv.kvcache.mha_pool import SUPPORTED_DTYPES

from float8_reference import to_float8
from devices import DEVICES

LAYOUTS = [KVCacheLayout.LayerFirst, KVCacheLayout.PageFirst]
DTYPES = list(SUPPORTED_DTYPES)
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]


def random_bytes(shape, dtype, g) -> torch.Tensor:
    """A CPU tensor of `shape` and `dtype` holding random bit patterns."""
    shape = tuple(shape)
    item = dtype.itemsize
    raw = torch.randint(0, 256, shape[:-1] + (shape[-1] * item,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def snapshot(cache: MHAKVCache):
    return [
        (as_bytes(cache.k_cache(i)), as_bytes(cache.v_cache(i))) for i in range(cache.num_layers)
    ]


def reference_store(before, k, v, out_loc, layer):
    """The contract: `cache.view(-1, H, D)[out_loc] = k` on a copy of the layer."""
    expected = [(kb.clone(), vb.clone()) for kb, vb in before]
    kb, vb = expected[layer]
    H, D = kb.shape[-2], kb.shape[-1]
    loc = out_loc.cpu().long()
    kb.view(-1, H, D)[loc] = as_bytes(k)
    vb.view(-1, H, D)[loc] = as_bytes(v)
    return expected


def assert_same(cache, expected):
    for i, (kb, vb) in enumerate(expected):
        assert torch.equal(as_bytes(cache.k_cache(i)), kb), f"k_cache({i}) differs"
        assert torch.equal(as_bytes(cache.v_cache(i)), vb), f"v_cache({i}) differs"


# --- construction, views, layouts ---------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_views_and_properties(device, layout, page_size):
    c = MHAKVCache(
        num_kv_heads=4,
        num_layers=3,
        head_dim=80,
        num_pages=5,
        dtype=torch.float16,
        kv_layout=layout,
        device=device,
        page_size=page_size,
    )
    assert isinstance(c, BaseKVCache)
    assert c.num_layers == 3 and c.dtype == torch.float16
    assert c.device.type == device
    assert c.num_slots == 5 * page_size and c.local_kv_heads == 4 and c.tp_size == 1
    for i in range(3):
        for t in (c.k_cache(i), c.v_cache(i)):
            assert t.shape == (5, page_size, 4, 80)
            assert t.dtype == torch.float16 and t.device.type == device
            assert t.stride()[-2:] == (80, 1)
            assert t.untyped_storage().data_ptr() == c.kv_buffer.untyped_storage().data_ptr()
    assert c.nbytes == 2 * 3 * 5 * page_size * 4 * 80 * 2
    assert torch.count_nonzero(c.kv_buffer) == 0  # zero-filled
    if layout is KVCacheLayout.LayerFirst:
        assert c.kv_buffer.shape == (2, 3, 5, page_size, 4, 80)
        assert c.k_cache(1).is_contiguous()
    else:
        assert c.kv_buffer.shape == (2, 5, 3, page_size, 4, 80)
        assert c.k_cache(1).stride(0) == 3 * page_size * 4 * 80


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_views_index_the_one_buffer_in_storage_order(layout):
    c = MHAKVCache(4, 3, 8, 5, torch.float32, kv_layout=layout, page_size=2)
    buf = c.kv_buffer
    buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view(buf.shape))
    for kv, view in ((0, c.k_cache), (1, c.v_cache)):
        for layer in range(3):
            for page in range(5):
                want = (
                    buf[kv, layer, page]
                    if layout is KVCacheLayout.LayerFirst
                    else buf[kv, page, layer]
                )
                assert torch.equal(view(layer)[page], want)


def test_layout_accepts_its_value_and_rejects_others():
    assert (
        MHAKVCache(1, 1, 4, 1, torch.float32, kv_layout="page_first").kv_layout
        is KVCacheLayout.PageFirst
    )
    with pytest.raises(ValueError, match="kv_layout"):
        MHAKVCache(1, 1, 4, 1, torch.float32, kv_layout="row_first")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_supported_dtype(dtype):
    c = MHAKVCache(2, 1, 16, 2, dtype)
    assert c.dtype == dtype and c.k_cache(0).dtype == dtype


def test_float8_kinds_are_supported():
    names = {str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES}
    assert {"float32", "float16", "bfloat16"} <= names
    for fp8 in ("float8_e4m3fn", "float8_e5m2"):
        assert (fp8 in names) == hasattr(torch, fp8)


def test_dtype_by_name_and_bad_dtype():
    assert MHAKVCache(1, 1, 4, 1, "bfloat16").dtype == torch.bfloat16
    assert MHAKVCache(1, 1, 4, 1, "torch.float16").dtype == torch.float16
    for bad in (torch.int32, torch.float64, "int8", None):
        with pytest.raises(TypeError, match="dtype"):
            MHAKVCache(1, 1, 4, 1, bad)


@pytest.mark.parametrize(
    "name", ["num_kv_heads", "num_layers", "head_dim", "num_pages", "page_size", "tp_size"]
)
def test_bad_sizes_name_the_argument(name):
    args = dict(num_kv_heads=2, num_layers=1, head_dim=4, num_pages=1, dtype=torch.float32)
    with pytest.raises(ValueError, match=name):
        MHAKVCache(**{**args, name: 0})
    with pytest.raises(TypeError, match=name):
        MHAKVCache(**{**args, name: 1.5})
    with pytest.raises(TypeError, match=name):
        MHAKVCache(**{**args, name: True})


def test_create_kvcache():
    c = create_kvcache(
        num_layers=2,
        num_kv_heads=4,
        num_pages=3,
        head_dim=32,
        dtype=torch.bfloat16,
        page_size=16,
        cache_layout=KVCacheLayout.PageFirst,
        cache_type=KVCacheType.MHA,
    )
    assert isinstance(c, MHAKVCache)
    assert c.kv_layout is KVCacheLayout.PageFirst and c.k_cache(1).shape == (3, 16, 4, 32)
    assert create_kvcache(1, 1, 1, 4, torch.float32, cache_type="mha").num_layers == 1
    with pytest.raises(ValueError, match="cache_type"):
        create_kvcache(1, 1, 1, 4, torch.float32, cache_type="mla")


# --- tensor parallelism and sizing ----------------------------------------------------


def test_tp_size_divides_heads():
    c = MHAKVCache(8, 1, 16, 2, torch.float16, tp_size=4)
    assert c.local_kv_heads == 2 and c.num_kv_heads == 8 and c.tp_size == 4
    assert c.k_cache(0).shape == (2, 1, 2, 16)
    with pytest.raises(ValueError, match=r"num_kv_heads=8 .*tp_size=3"):
        MHAKVCache(8, 1, 16, 2, torch.float16, tp_size=3)
    with pytest.raises(ValueError, match=r"num_kv_heads=2 .*tp_size=4"):
        MHAKVCache(2, 1, 16, 2, torch.float16, tp_size=4)


def test_tp_size_defaults_to_world_size(monkeypatch):
    assert not torch.distributed.is_initialized()
    assert MHAKVCache(8, 1, 16, 2, torch.float16).tp_size == 1
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    c = MHAKVCache(8, 1, 16, 2, torch.float16)
    assert c.tp_size == 4 and c.local_kv_heads == 2
    assert MHAKVCache(8, 1, 16, 2, torch.float16, tp_size=2).local_kv_heads == 4
    with pytest.raises(ValueError, match="tp_size=4"):
        MHAKVCache(6, 1, 16, 2, torch.float16)


def test_tp_size_from_a_real_process_group(tmp_path):
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        c = MHAKVCache(8, 1, 16, 2, torch.float16)
        assert c.tp_size == 1 and c.local_kv_heads == 8
    finally:
        dist.destroy_process_group()


def test_num_pages_for_memory():
    per_page = kv_bytes_per_page(
        num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16
    )
    assert per_page == 2 * 32 * 16 * 8 * 128 * 2
    gib = 1 << 30
    assert (
        num_pages_for_memory(
            gib, num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16
        )
        == gib // per_page
    )
    assert (
        num_pages_for_memory(
            gib + per_page - 1,
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            dtype="bfloat16",
            page_size=16,
        )
        == gib // per_page
    )
    # Each of 2 ranks holds half the heads, so twice the pages fit.
    assert num_pages_for_memory(
        gib,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        page_size=16,
        tp_size=2,
    ) == 2 * (gib // per_page)
    if hasattr(torch, "float8_e4m3fn"):
        assert num_pages_for_memory(
            gib,
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            dtype=torch.float8_e4m3fn,
            page_size=16,
        ) == 2 * (gib // per_page)
    with pytest.raises(ValueError, match="memory_bytes"):
        num_pages_for_memory(
            per_page - 1,
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            dtype=torch.bfloat16,
            page_size=16,
        )
    with pytest.raises(ValueError, match="tp_size=3"):
        num_pages_for_memory(
            gib, num_layers=1, num_kv_heads=8, head_dim=8, dtype=torch.float16, tp_size=3
        )


def test_pool_sized_from_memory_fills_it():
    budget = 10 << 20
    kw = dict(num_layers=4, num_kv_heads=4, head_dim=96, dtype=torch.float16, page_size=16)
    pages = num_pages_for_memory(budget, **kw)
    c = MHAKVCache(
        kw["num_kv_heads"], kw["num_layers"], kw["head_dim"], pages, kw["dtype"], page_size=16
    )
    assert c.nbytes == pages * kv_bytes_per_page(**kw)
    assert budget - kv_bytes_per_page(**kw) < c.nbytes <= budget


# --- store_kv against the torch reference -------------------------------------------


def make_inputs(n, H, D, dtype, num_slots, index_dtype, device, g, strided=None):
    """k, v of [n, H, D] (plain or `strided`) and n distinct slots."""
    if strided == "qkv":  # slices of a fused qkv projection output: rows strided
        qkv = random_bytes((n, (3 * H + 2) * D), dtype, g).to(device)
        k = qkv[:, 2 * D : (2 + H) * D].view(n, H, D)
        v = qkv[:, (2 + 2 * H) * D : (2 + 3 * H) * D].view(n, H, D)
        assert not k.is_contiguous()
    elif strided == "interleaved":  # [n, H, 2, D]: k and v alternate per head
        kv = random_bytes((n, H, 2, D), dtype, g).to(device)
        k, v = kv[:, :, 0], kv[:, :, 1]
    elif strided == "misaligned":  # rows start one element off: narrowest vectors
        flat = random_bytes((n, H * D + 1), dtype, g).to(device)
        k = flat[:, 1:].view(n, H, D)
        v = random_bytes((n, H, D), dtype, g).to(device)
    else:
        k = random_bytes((n, H, D), dtype, g).to(device)
        v = random_bytes((n, H, D), dtype, g).to(device)
    out_loc = torch.randperm(num_slots, generator=g)[:n].to(index_dtype).to(device)
    return k, v, out_loc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [80, 96, 100, 128])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_store_kv_matches_reference(device, layout, dtype, head_dim, page_size, index_dtype):
    g = torch.Generator().manual_seed(head_dim * 7 + page_size)
    H, L = 2, 3
    c = MHAKVCache(H, L, head_dim, 7, dtype, kv_layout=layout, device=device, page_size=page_size)
    c.kv_buffer.view(torch.uint8).copy_(as_bytes(random_bytes(c.kv_buffer.shape, dtype, g)))
    for layer, n in ((1, min(5, c.num_slots)), (2, c.num_slots), (0, 1)):
        k, v, out_loc = make_inputs(n, H, head_dim, dtype, c.num_slots, index_dtype, device, g)
        expected = reference_store(snapshot(c), k, v, out_loc, layer)
        c.store_kv(k, v, out_loc, layer)
        assert_same(c, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("strided", ["qkv", "interleaved", "misaligned"])
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16] + DTYPES[3:4],
    ids=lambda d: str(d).removeprefix("torch."),
)
@pytest.mark.parametrize("head_dim", [64, 100])
def test_store_kv_strided_inputs(device, layout, strided, dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    H = 4
    c = MHAKVCache(H, 2, head_dim, 8, dtype, kv_layout=layout, device=device, page_size=16)
    for index_dtype in (torch.int32, torch.int64):
        k, v, out_loc = make_inputs(
            37, H, head_dim, dtype, c.num_slots, index_dtype, device, g, strided=strided
        )
        expected = reference_store(snapshot(c), k, v, out_loc, 1)
        c.store_kv(k, v, out_loc, 1)
        assert_same(c, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_large_batch(device):
    """Past the CPU kernel's streaming threshold (1 MiB written)."""
    g = torch.Generator().manual_seed(9)
    c = MHAKVCache(8, 2, 128, 400, torch.bfloat16, device=device, page_size=16)
    k, v, out_loc = make_inputs(5000, 8, 128, torch.bfloat16, c.num_slots, torch.int64, device, g)
    expected = reference_store(snapshot(c), k, v, out_loc, 1)
    c.store_kv(k, v, out_loc, 1)
    assert_same(c, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_edge_slots_and_empty_batch(device):
    c = MHAKVCache(1, 1, 4, 3, torch.float32, device=device, page_size=16)
    before = snapshot(c)
    empty = torch.empty(0, 1, 4, device=device)
    c.store_kv(empty, empty, torch.empty(0, dtype=torch.int32, device=device), 0)
    assert_same(c, before)
    k = torch.arange(8, dtype=torch.float32, device=device).view(2, 1, 4)
    c.store_kv(k, -k, torch.tensor([0, 47], device=device), 0)
    assert torch.equal(c.k_cache(0)[0, 0], k[0]) and torch.equal(c.k_cache(0)[2, 15], k[1])
    assert torch.equal(c.v_cache(0)[2, 15], -k[1])


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_layer_id_accepts_integers(device):
    import numpy as np

    c = MHAKVCache(1, 2, 4, 2, torch.float32, device=device)
    k = torch.ones(1, 1, 4, device=device)
    c.store_kv(k, k, torch.tensor([1], device=device), np.int64(1))
    assert c.k_cache(1)[1, 0].tolist() == [[1.0] * 4]


# --- bad arguments: a clear error naming the argument, nothing written --------------------


def error_cases(device):
    """(name, kwargs for store_kv, exception type, message pattern) against a pool of
    H=2, D=8, float16, 2 layers, 16 slots."""
    dev = torch.device(device)
    other = torch.device("cpu") if dev.type == "cuda" else torch.device("meta")
    k = torch.ones(3, 2, 8, dtype=torch.float16, device=dev)
    loc = torch.tensor([1, 2, 3], device=dev)
    return (
        [
            ("k not a tensor", dict(k=k.tolist()), TypeError, r"^k must be a torch\.Tensor"),
            (
                "k rank",
                dict(k=k.view(3, 16)),
                ValueError,
                r"^k must have shape \[num_tokens, 2, 8\]",
            ),
            (
                "k heads",
                dict(k=torch.ones(3, 1, 8, dtype=torch.float16, device=dev)),
                ValueError,
                r"^k has shape \[3, 1, 8\]",
            ),
            (
                "k head_dim",
                dict(k=torch.ones(3, 2, 4, dtype=torch.float16, device=dev)),
                ValueError,
                r"^k has shape",
            ),
            ("k dtype", dict(k=k.float()), TypeError, r"^k has dtype float32 but k_cache"),
            ("v dtype", dict(v=k.bfloat16()), TypeError, r"^v has dtype bfloat16"),
            ("v tokens", dict(v=k[:2]), ValueError, r"^v has 2 tokens but k has 3"),
            ("k device", dict(k=k.to(other)), TypeError, r"^k must"),
            ("out_loc device", dict(out_loc=loc.to(other)), TypeError, r"^out_loc must"),
            (
                "out_loc dtype",
                dict(out_loc=loc.float()),
                TypeError,
                r"^out_loc must have dtype int32 or int64, got float32"
                if dev.type != "cpu"
                else r"^out_loc must have an integer dtype, got float32",
            ),
        ]
        + (
            [("out_loc int16", dict(out_loc=loc.short()), TypeError, r"^out_loc must have dtype")]
            if dev.type != "cpu"
            else []
        )
        + [
            ("out_loc rank", dict(out_loc=loc.view(1, 3)), ValueError, r"^out_loc must be 1-D"),
            (
                "out_loc length",
                dict(out_loc=loc[:2]),
                ValueError,
                r"^out_loc has length 2 but k has 3 tokens",
            ),
            (
                "k last dim strided",
                dict(k=torch.ones(3, 2, 16, dtype=torch.float16, device=dev)[:, :, ::2]),
                ValueError,
                r"^k must have a contiguous last dimension",
            ),
            ("layer_id range", dict(layer_id=2), ValueError, r"^layer_id=2 is out of range"),
            ("layer_id negative", dict(layer_id=-1), ValueError, r"^layer_id=-1"),
            ("layer_id float", dict(layer_id=1.0), TypeError, r"^layer_id must be an int"),
            ("layer_id bool", dict(layer_id=True), TypeError, r"^layer_id must be an int"),
        ]
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_store_kv_bad_arguments(device, layout):
    c = MHAKVCache(2, 2, 8, 1, torch.float16, kv_layout=layout, device=device, page_size=16)
    good = dict(
        k=torch.full((3, 2, 8), 5.0, dtype=torch.float16, device=device),
        v=torch.full((3, 2, 8), 6.0, dtype=torch.float16, device=device),
        out_loc=torch.tensor([1, 2, 3], device=device),
        layer_id=1,
    )
    before = snapshot(c)
    for name, bad, exc, pattern in error_cases(device):
        with pytest.raises(exc, match=pattern):
            c.store_kv(**{**good, **bad})
        assert_same(c, before)
    c.store_kv(**good)  # and the good call still works
    assert c.k_cache(1)[0, 3].eq(5).all() and c.v_cache(1)[0, 1].eq(6).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("bad_slot", [16, -1, 1 << 20])
def test_store_kv_out_of_range_slot_writes_nothing(device, index_dtype, bad_slot):
    c = MHAKVCache(2, 2, 8, 1, torch.float16, device=device, page_size=16, check_bounds=True)
    k = torch.ones(3, 2, 8, dtype=torch.float16, device=device)
    out_loc = torch.tensor([1, bad_slot, 3], dtype=index_dtype, device=device)
    before = snapshot(c)
    with pytest.raises(
        ValueError,
        match=rf"^out_loc\[1\] = {bad_slot} is out of range for a " r"cache of 16 slots",
    ):
        c.store_kv(k, k, out_loc, 0)
    assert_same(c, before)


@pytest.mark.parametrize("device", DEVICES)
def test_views_reject_bad_layer_index(device):
    c = MHAKVCache(1, 2, 4, 1, torch.float32, device=device)
    for view in (c.k_cache, c.v_cache):
        with pytest.raises(ValueError, match="index=2"):
            view(2)
        with pytest.raises(ValueError, match="index=-1"):
            view(-1)
        with pytest.raises(TypeError, match="index"):
            view("0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_cuda_out_of_range_slot_is_skipped_without_check_bounds():
    """Without check_bounds the CUDA store never synchronizes: a bad slot is
    skipped (nothing written out of bounds), the other rows land."""
    c = MHAKVCache(2, 1, 8, 1, torch.float16, device="cuda", page_size=16, check_bounds=False)
    k = torch.full((3, 2, 8), 7.0, dtype=torch.float16, device="cuda")
    c.store_kv(k, k, torch.tensor([1, 99, 3], device="cuda"), 0)
    torch.cuda.synchronize()
    written = c.k_cache(0)[0].eq(7).all(dim=(1, 2)).nonzero().flatten().tolist()
    assert written == [1, 3]
    assert c.kv_buffer.eq(7).sum() == 2 * 2 * 2 * 8


# --- float8 pools fed float32 / float16 / bfloat16, with scales ------------------------

FLOAT8 = [
    d
    for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
    if d is not None
]
FLOAT8_IDS = [str(d).removeprefix("torch.") for d in FLOAT8]
SOURCES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.skipif(not FLOAT8, reason="this torch has no float8 dtypes")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("cache_dtype", FLOAT8, ids=FLOAT8_IDS)
@pytest.mark.parametrize("src_dtype", SOURCES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("scales", [(None, None), (0.5, 3.25), ("tensor", 0.01)], ids=str)
@pytest.mark.parametrize("strided", [None, "qkv"])
def test_float8_store_kv_scales_and_rounds_like_torch(
    device, layout, cache_dtype, src_dtype, scales, strided
):
    g = torch.Generator().manual_seed(17)
    H, D = 2, 80
    c = MHAKVCache(H, 3, D, 5, cache_dtype, kv_layout=layout, device=device, page_size=4)
    c.kv_buffer.view(torch.uint8).copy_(as_bytes(random_bytes(c.kv_buffer.shape, cache_dtype, g)))
    n = 13
    if strided == "qkv":
        qkv = (torch.randn(n, 3 * H + 1, D, generator=g) * 200).to(src_dtype).to(device)
        k, v = qkv[:, 1 : 1 + H], qkv[:, 1 + 2 * H :]
    else:
        k = (torch.randn(n, H, D, generator=g) * 200).to(src_dtype).to(device)
        v = (torch.randn(n, H, D, generator=g) * 0.01).to(src_dtype).to(device)
    k_scale, v_scale = scales
    k_value = 1.0 if k_scale is None else 0.37 if k_scale == "tensor" else k_scale
    v_value = 1.0 if v_scale is None else v_scale
    if k_scale == "tensor":
        k_scale = torch.tensor([k_value], device=device)
    out_loc = torch.randperm(c.num_slots, generator=g)[:n].to(device)
    ref_k = to_float8(k.cpu(), cache_dtype, k_value)
    ref_v = to_float8(v.cpu(), cache_dtype, v_value)
    expected = reference_store(snapshot(c), ref_k, ref_v, out_loc, 1)
    c.store_kv(k, v, out_loc, 1, k_scale=k_scale, v_scale=v_scale)
    assert_same(c, expected)


@pytest.mark.skipif(not FLOAT8, reason="this torch has no float8 dtypes")
@pytest.mark.parametrize("device", DEVICES)
def test_float8_bad_scales_and_dtype_pairs_name_the_argument(device):
    fp8 = FLOAT8[0]
    c = MHAKVCache(2, 1, 8, 1, fp8, device=device, page_size=16)
    plain = MHAKVCache(2, 1, 8, 1, torch.bfloat16, device=device, page_size=16)
    k = torch.ones(3, 2, 8, device=device)
    loc = torch.tensor([1, 2, 3], device=device)
    cases = [
        (c, dict(k_scale=0.0), ValueError, r"^k_scale must be positive and finite"),
        (c, dict(v_scale=-1.0), ValueError, r"^v_scale must be positive and finite"),
        (c, dict(k_scale=float("nan")), ValueError, r"^k_scale must be positive"),
        (c, dict(v_scale=float("inf")), ValueError, r"^v_scale must be positive"),
        (c, dict(k_scale=1e39), ValueError, r"^k_scale must be positive and finite in float32"),
        (c, dict(k_scale=torch.tensor([0.0], device=device)), ValueError, r"^k_scale must be"),
        (c, dict(v_scale=torch.ones(2)), ValueError, r"^v_scale must be a number or a one-element"),
        (c, dict(k_scale=True), TypeError, r"^k_scale must be a number"),
        (c, dict(k_scale=np.bool_(True)), TypeError, r"^k_scale must be a number"),
        (c, dict(v_scale=2**2000), ValueError, r"^v_scale must be positive and finite in float32"),
        (
            c,
            dict(k_scale=torch.ones(1, device="meta")),
            TypeError,
            r"^k_scale is a tensor on the " "meta device",
        ),
        (c, dict(k=k.double()), TypeError, r"^k has dtype float64 but k_cache has dtype float8"),
        (c, dict(v=k.to(torch.int32)), TypeError, r"^v has dtype int32 but v_cache"),
        (c, dict(k=k.to(fp8), k_scale=2.0), ValueError, r"^k_scale is given, but k already has"),
        (
            plain,
            dict(k=k.bfloat16(), v=k.bfloat16(), k_scale=2.0),
            ValueError,
            r"^k_scale is given, but k already has k_cache's dtype bfloat16",
        ),
        (
            plain,
            dict(k=k.bfloat16(), v=k.bfloat16(), v_scale=2.0),
            ValueError,
            r"^v_scale is given",
        ),
        (plain, dict(), TypeError, r"^k has dtype float32 but k_cache has dtype bfloat16"),
    ]
    for pool, bad, exc, pattern in cases:
        before = snapshot(pool)
        args = {**dict(k=k, v=k, out_loc=loc, layer_id=0), **bad}
        with pytest.raises(exc, match=pattern):
            pool.store_kv(**args)
        assert_same(pool, before)
    c.store_kv(k, k, loc, 0, k_scale=0.5)  # and a good call works
    assert c.k_cache(0)[0, 1].float().eq(2.0).all() and c.v_cache(0)[0, 1].float().eq(1.0).all()


@pytest.mark.skipif(not FLOAT8, reason="this torch has no float8 dtypes")
def test_float8_pools_get_their_own_storage_fingerprint():
    """The K/V dtype is part of the storage tier's fingerprint: float8 pages never
    mix with bfloat16 pages, nor e4m3fn with e5m2."""
    from radixkv.storage import config_fingerprint

    def fingerprint(pool):
        return config_fingerprint(
            model="m",
            dtype=pool.dtype,
            page_size=pool.page_size,
            layout="page_first",
            num_layers=pool.num_layers,
            kv_heads=pool.local_kv_heads,
            head_dim=pool.head_dim,
        )

    pools = [MHAKVCache(2, 2, 16, 1, d, page_size=4) for d in [torch.bfloat16] + FLOAT8]
    assert len({fingerprint(p) for p in pools}) == len(pools)
    assert fingerprint(pools[1]) == fingerprint(
        MHAKVCache(2, 2, 16, 1, pools[1].dtype, page_size=4)
    )
