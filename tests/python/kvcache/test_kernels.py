"""radixkv.kernel: store_cache and first-mismatch, on every device, against plain
torch / Python references; their torch fallbacks; the optional _cuda extension."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from radixkv import kernel
from radixkv.kernel import compare as compare_mod
from radixkv.kernel import store as store_mod

from float8_reference import to_float8, torch_casts_like_this
from devices import DEVICES



def rand_bytes(shape, dtype, g):
    shape = tuple(shape)
    raw = torch.randint(
        0, 256, shape[:-1] + (shape[-1] * dtype.itemsize,), dtype=torch.uint8, generator=g
    )
    return raw.view(dtype)


def b(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


# --- store_cache -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.uint8],
    ids=lambda d: str(d).removeprefix("torch."),
)
@pytest.mark.parametrize("head_dim", [1, 3, 80, 100, 256])
def test_store_cache_flat_cache(device, dtype, head_dim):
    """A [num_slots, H, D] cache, the shape mini-SGLang's store takes."""
    g = torch.Generator().manual_seed(head_dim)
    H, S, n = 3, 50, 20
    kc = rand_bytes((S, H, head_dim), dtype, g).to(device)
    vc = rand_bytes((S, H, head_dim), dtype, g).to(device)
    k = rand_bytes((n, H, head_dim), dtype, g).to(device)
    v = rand_bytes((n, H, head_dim), dtype, g).to(device)
    loc = torch.randperm(S, generator=g)[:n].to(device)
    ek, ev = b(kc), b(vc)
    ek.view(S, H, -1)[loc.cpu()] = b(k)
    ev.view(S, H, -1)[loc.cpu()] = b(v)
    kernel.store_cache(kc, vc, loc, k, v)
    assert torch.equal(b(kc), ek) and torch.equal(b(vc), ev)


@pytest.mark.parametrize("device", DEVICES)
def test_store_cache_padded_heads_and_paged_cache(device):
    """Cache heads that do not follow each other (a view into a wider buffer) and
    pages that are not adjacent: the kernel's generic path."""
    g = torch.Generator().manual_seed(5)
    P, page, H, D, n = 6, 4, 3, 10, 17
    big = rand_bytes((P, 2, page, H, D + 6), torch.float16, g).to(device)
    kc, vc = big[:, 0, :, :, :D], big[:, 1, :, :, 3 : 3 + D]
    k = rand_bytes((n, H, D), torch.float16, g).to(device)
    v = rand_bytes((n, H, D), torch.float16, g).to(device)
    loc = torch.randperm(P * page, generator=g)[:n].to(torch.int32).to(device)
    before = b(big).clone()
    ref = big.clone()
    l64 = loc.long()
    ref[l64 // page, 0, l64 % page, :, :D] = k
    ref[l64 // page, 1, l64 % page, :, 3 : 3 + D] = v
    kernel.store_cache(kc, vc, loc, k, v)
    assert torch.equal(b(big), b(ref))
    assert not torch.equal(b(big), before)


@pytest.mark.parametrize("device", DEVICES)
def test_store_cache_error_names_each_argument(device):
    kc = torch.zeros(8, 2, 4, device=device)
    k = torch.ones(3, 2, 4, device=device)
    loc = torch.tensor([0, 1, 2], device=device)
    args = dict(k_cache=kc, v_cache=kc.clone(), out_loc=loc, k=k, v=k)
    cases = [
        (dict(k_cache=kc.view(64)), ValueError, r"^k_cache must have shape"),
        (
            dict(k_cache=kc.view(8, 8), v_cache=kc.view(8, 8)),
            ValueError,
            r"^k must have shape \[num_tokens, 8\]",
        ),
        (dict(k_cache=torch.zeros(8, 2, 4, 1, 1, device=device)), ValueError, r"^k_cache"),
        (
            dict(v_cache=torch.zeros(9, 2, 4, device=device)),
            ValueError,
            r"^v_cache has shape \[9, 2, 4\] but k_cache has shape \[8, 2, 4\]",
        ),
        (dict(v_cache=kc.half()), TypeError, r"^v_cache has dtype float16"),
        (
            dict(k_cache=torch.zeros(8, 2, 8, device=device)[:, :, ::2]),
            ValueError,
            r"^k_cache must have a contiguous last dimension",
        ),
        (dict(k_cache="cache"), TypeError, r"^k_cache must be a torch\.Tensor, got str"),
        (dict(v=None), TypeError, r"^v must be a torch\.Tensor, got NoneType"),
        (dict(out_loc=loc.view(3, 1)), ValueError, r"^out_loc must be 1-D"),
    ]
    for bad, exc, pattern in cases:
        before = (kc.clone(), args["v_cache"].clone())
        with pytest.raises(exc, match=pattern):
            kernel.store_cache(**{**args, **bad})
        assert torch.equal(kc, before[0]) and torch.equal(args["v_cache"], before[1])


def test_store_cache_non_contiguous_out_loc_is_read_on_cpu():
    kc = torch.zeros(8, 2, 4)
    k = torch.ones(3, 2, 4)
    loc = torch.tensor([0, 9, 1, 9, 2, 9])[::2]
    kernel.store_cache(kc, kc.clone(), loc, k, k)
    assert kc[:3].eq(1).all() and kc[3:].eq(0).all()


def test_store_cache_cpu_rejects_out_of_range_with_value():
    kc = torch.zeros(8, 1, 4)
    k = torch.ones(2, 1, 4)
    for loc, msg in (
        ([3, 8], r"out_loc\[1\] = 8 is out of range for a cache of 8 slots"),
        ([-3, 1], r"out_loc\[0\] = -3 is out of range"),
    ):
        for dtype in (torch.int32, torch.int64):
            with pytest.raises(ValueError, match=msg):
                kernel.store_cache(kc, kc.clone(), torch.tensor(loc, dtype=dtype), k, k)
            assert kc.eq(0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_store_cache_refuses_repeated_slots(device):
    """Two tokens for one slot is a scheduler bug; which row would win is not
    defined (torch's index_put_ says the same), so the store refuses it."""
    kc = torch.zeros(4, 1, 2, device=device)
    vc = torch.zeros(4, 1, 2, device=device)
    k = torch.tensor([[[1.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]], device=device)
    with pytest.raises(ValueError, match=r"^out_loc\[2\] = 3 repeats an earlier slot"):
        kernel.store_cache(kc, vc, torch.tensor([3, 1, 3], device=device), k, -k)
    assert kc.eq(0).all() and vc.eq(0).all()


def test_store_torch_fallback_matches_native():
    """The torch path used where no native kernel exists (CUDA without _cuda, other
    devices), run here on CPU tensors against the native CPU kernel."""
    g = torch.Generator().manual_seed(3)
    for shape in ((5, 16, 2, 24), (80, 2, 24)):
        kc = rand_bytes(shape, torch.bfloat16, g)
        vc = rand_bytes(shape, torch.bfloat16, g)
        k = rand_bytes((30, 2, 24), torch.bfloat16, g)
        v = rand_bytes((30, 2, 24), torch.bfloat16, g)
        loc = torch.randperm(80, generator=g)[:30]
        kn, vn = kc.clone(), vc.clone()
        kernel.store_cache(kn, vn, loc, k, v)
        store_mod._store_torch(kc, vc, loc.int(), k, v)
        assert torch.equal(b(kc), b(kn)) and torch.equal(b(vc), b(vn))
    with pytest.raises(ValueError, match=r"^out_loc\[0\] = 80 is out of range"):
        store_mod._store_torch(kc, vc, torch.tensor([80]), k[:1], v[:1])
    with pytest.raises(TypeError, match=r"^k has dtype"):
        store_mod._store_torch(kc, vc, loc, k.float(), v)
    with pytest.raises(ValueError, match=r"^out_loc has length"):
        store_mod._store_torch(kc, vc, loc[:3], k, v)


@pytest.mark.cuda
def test_store_cache_runs_on_the_current_stream():
    g = torch.Generator().manual_seed(1)
    kc = torch.zeros(4096, 8, 128, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    k = rand_bytes((2048, 8, 128), torch.bfloat16, g).cuda()
    v = rand_bytes((2048, 8, 128), torch.bfloat16, g).cuda()
    loc = torch.randperm(4096, generator=g)[:2048].cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kernel.store_cache(kc, vc, loc, k, v)
    s.synchronize()
    assert torch.equal(b(kc[loc]), b(k)) and torch.equal(b(vc[loc]), b(v))


@pytest.mark.cuda
def test_store_cache_cuda_uses_the_native_kernel_when_built():
    if not kernel.cuda_available():
        pytest.skip("radixkv._cuda was not built (no nvcc at build time)")
    kc = torch.zeros(4, 1, 2, device="cuda")
    with pytest.raises(TypeError, match=r"^k must be on cuda:0 like k_cache, got cpu"):
        kernel.store_cache(
            kc,
            kc,
            torch.tensor([0], device="cuda"),
            torch.ones(1, 1, 2),
            torch.ones(1, 1, 2, device="cuda"),
        )


# --- the _cuda extension without a GPU ------------------------------------------------------


def test_import_radixkv_does_not_load_cuda_extension():
    code = (
        "import sys, radixkv, radixkv.kvcache, radixkv.kernel; "
        "assert 'radixkv._cuda' not in sys.modules, 'imported _cuda'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cuda_available_is_a_bool():
    assert isinstance(kernel.cuda_available(), bool)


def test_cuda_extension_checks_arguments_like_the_cpu():
    """_cuda shares the argument checks; it can be exercised without a GPU."""
    if not kernel.cuda_built():
        pytest.skip("radixkv._cuda was not built (no nvcc at build time)")
    from radixkv import _cuda

    kc = torch.zeros(8, 2, 4)
    k = torch.ones(3, 2, 4)
    with pytest.raises(TypeError, match=r"^k_cache must be a CUDA tensor, got one on cpu"):
        _cuda.store_cache(kc, kc, torch.tensor([0, 1, 2]), k, k)
    with pytest.raises(TypeError, match=r"^k_cache must be a torch\.Tensor"):
        _cuda.store_cache([0], kc, torch.tensor([0, 1, 2]), k, k)
    q = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^query must be a CUDA tensor"):
        _cuda.first_mismatch_batched(q, q.view(1, 4), None, q[:1])


# --- first mismatch --------------------------------------------------------------------------


def test_first_mismatch_cpu():
    assert kernel.first_mismatch([1, 2, 3], [1, 2, 4]) == 2
    assert kernel.first_mismatch([1, 2, 3], [1, 2]) == 2
    assert (
        kernel.first_mismatch(
            torch.arange(100, dtype=torch.int32), torch.arange(100, dtype=torch.int64)
        )
        == 100
    )
    with pytest.raises(TypeError, match="^a"):
        kernel.first_mismatch(torch.zeros(3), [0, 0, 0])


def reference_batched(query, keys, key_lens):
    out = []
    q = query.tolist()
    for row, n in zip(keys.tolist(), key_lens):
        n = min(len(q), max(0, min(n, len(row))))
        i = 0
        while i < n and q[i] == row[i]:
            i += 1
        out.append(i)
    return out


def batched_case(g, B, L, Lq, device, misaligned=False, padded=False):
    query = torch.randint(0, 3, (Lq + 1,), generator=g, dtype=torch.int32)
    query = query[1:] if misaligned else query[:Lq]
    keys = query[: min(L, Lq)].repeat(B, 1)
    if keys.shape[1] < L:
        keys = torch.cat(
            [keys, torch.randint(0, 3, (B, L - keys.shape[1]), generator=g, dtype=torch.int32)],
            dim=1,
        )
    # Put one mismatch at a random place in most rows, none in some.
    for r in range(B):
        if r % 4 and L:
            c = int(torch.randint(0, L, (1,), generator=g))
            keys[r, c] += 1
    if padded:  # rows strided: a slice of a wider tensor
        wide = torch.randint(0, 3, (B, L + 5), generator=g, dtype=torch.int32)
        wide[:, :L] = keys
        keys = wide[:, :L]
    return query.to(device), keys.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "B,L,Lq",
    [
        (1, 1, 1),
        (7, 200, 200),
        (33, 1000, 700),
        (5, 64, 1500),
        (64, 129, 129),
        (3, 0, 5),
        (0, 8, 8),
        (10, 300, 0),
    ],
)
@pytest.mark.parametrize("layout", ["plain", "misaligned", "padded"])
def test_first_mismatch_batched(device, B, L, Lq, layout):
    g = torch.Generator().manual_seed(B * 1000 + L)
    query, keys = batched_case(
        g, B, L, Lq, device, misaligned=layout == "misaligned", padded=layout == "padded"
    )
    got = kernel.first_mismatch_batched(query, keys)
    assert got.dtype == torch.int32 and got.device == query.device
    assert got.tolist() == reference_batched(query.cpu(), keys.cpu(), [L] * B)
    lens = torch.randint(0, L + 1, (B,), generator=g)
    for lens_t in (lens, lens.int()):
        got = kernel.first_mismatch_batched(query, keys, lens_t.to(device))
        assert got.tolist() == reference_batched(query.cpu(), keys.cpu(), lens.tolist())
    out = torch.full((B,), -5, dtype=torch.int32, device=device)
    assert kernel.first_mismatch_batched(query, keys, out=out) is out


@pytest.mark.parametrize("device", DEVICES)
def test_first_mismatch_batched_errors(device):
    q = torch.zeros(8, dtype=torch.int32, device=device)
    keys = torch.zeros(3, 8, dtype=torch.int32, device=device)
    cases = [
        (dict(query=q.long()), TypeError, r"^query must have dtype int32, got int64"),
        (dict(keys=keys.float()), TypeError, r"^keys must have dtype int32"),
        (dict(query=q.view(2, 4)), ValueError, r"^query must be 1-D"),
        (dict(keys=q), ValueError, r"^keys must be 2-D"),
        (
            dict(key_lens=torch.zeros(2, dtype=torch.int32, device=device)),
            ValueError,
            r"^key_lens must have shape \[3\]",
        ),
        (dict(key_lens=torch.zeros(3, device=device)), TypeError, r"^key_lens must have dtype"),
        (
            dict(out=torch.zeros(3, dtype=torch.int32, device=device)[:2]),
            ValueError,
            r"^out must have shape \[3\]",
        ),
        (
            dict(keys=torch.zeros(3, 16, dtype=torch.int32, device=device)[:, ::2]),
            ValueError,
            r"^keys must have a contiguous last dimension",
        ),
        (dict(query=[0] * 8), TypeError, r"^query must be a torch\.Tensor"),
    ]
    for bad, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            kernel.first_mismatch_batched(**{**dict(query=q, keys=keys), **bad})


def test_first_mismatch_batched_cpu_rejects_bad_lengths():
    q = torch.zeros(8, dtype=torch.int32)
    keys = torch.zeros(3, 8, dtype=torch.int32)
    for lens in ([1, 9, 0], [1, -1, 0]):
        with pytest.raises(ValueError, match=r"^key_lens\[1\] = -?\d+ is outside \[0, 8\]"):
            kernel.first_mismatch_batched(q, keys, torch.tensor(lens))


@pytest.mark.cuda
def test_first_mismatch_batched_cuda_clamps_lengths():
    q = torch.zeros(8, dtype=torch.int32, device="cuda")
    keys = torch.zeros(3, 8, dtype=torch.int32, device="cuda")
    got = kernel.first_mismatch_batched(q, keys, torch.tensor([1, 9, -1], device="cuda"))
    assert got.tolist() == [1, 8, 0]


def test_first_mismatch_torch_fallback_matches_native():
    g = torch.Generator().manual_seed(11)
    for B, L, Lq in ((9, 50, 40), (4, 10, 30), (3, 0, 4), (2, 5, 0)):
        query, keys = batched_case(g, B, L, Lq, "cpu")
        lens = torch.randint(0, L + 1, (B,), generator=g)
        for key_lens in (None, lens):
            out = torch.empty(B, dtype=torch.int32)
            compare_mod._first_mismatch_torch(query, keys, key_lens, out)
            assert out.tolist() == kernel.first_mismatch_batched(query, keys, key_lens).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_store_cache_two_dimensional_rows(device, index):
    """mini-SGLang's caches: [num_slots, row], k and v [n, row]; rows may be
    strided (a slice of a wider buffer)."""
    g = torch.Generator().manual_seed(5)
    S, R, n = 40, 48, 17
    wide = rand_bytes((S, 2 * R), torch.bfloat16, g).to(device)
    kc, vc = wide[:, :R], rand_bytes((S, R), torch.bfloat16, g).to(device)
    k = rand_bytes((n, R), torch.bfloat16, g).to(device)
    v = rand_bytes((n, R), torch.bfloat16, g).to(device)
    loc = torch.randperm(S, generator=g)[:n].to(index).to(device)
    ek, ev, other = b(kc).clone(), b(vc).clone(), b(wide[:, R:]).clone()
    ek.view(S, -1)[loc.cpu().long()] = b(k)
    ev.view(S, -1)[loc.cpu().long()] = b(v)
    kernel.store_cache(kc, vc, loc, k, v)
    assert torch.equal(b(kc), ek) and torch.equal(b(vc), ev)
    assert torch.equal(b(wide[:, R:]), other)  # the rest of the wide rows untouched
    before = b(kc).clone()
    with pytest.raises(ValueError, match=r"^k must have shape \[num_tokens, 48\]"):
        kernel.store_cache(kc, vc, loc, k.view(n, 2, R // 2), v.view(n, 2, R // 2))
    with pytest.raises(ValueError, match="out of range"):
        kernel.store_cache(kc, vc, torch.full((n,), S, dtype=index, device=device), k, v)
    assert torch.equal(b(kc), before)
    # The torch fallback agrees.
    kt, vt = kc.clone().zero_(), vc.clone().zero_()
    kn, vn = kt.clone(), vt.clone()
    store_mod._store_torch(kt, vt, loc, k, v)
    kernel.store_cache(kn, vn, loc, k, v)
    assert torch.equal(b(kt), b(kn)) and torch.equal(b(vt), b(vn))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("native", [True, False])
def test_store_refuses_one_cache_twice_and_expanded_or_overlapping_rows(device, native):
    store = kernel.store_cache if native else store_mod._store_torch
    kc = torch.zeros(8, 2, 4, device=device)
    vc = torch.zeros(8, 2, 4, device=device)
    k = torch.ones(3, 2, 4, device=device)
    loc = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match="v_cache is the same memory as k_cache"):
        store(kc, kc, loc, k, k)
    with pytest.raises(ValueError, match="stride 0"):
        store(torch.zeros(1, 2, 4, device=device).expand(8, 2, 4), vc, loc, k, k)
    with pytest.raises(ValueError, match="lies in the memory of k_cache"):
        store(kc, vc, loc, kc[:3], k)
    # Interleaved K and V caches (a page holding both) are not the same memory.
    kv = torch.zeros(8, 2, 2, 4, device=device)
    store(kv[:, 0], kv[:, 1], loc, k, 2 * k)
    assert torch.equal(kv[:3, 0], k) and torch.equal(kv[:3, 1], 2 * k)
    assert not bool(kc.any()) and not bool(vc.any())


# --- float8 conversion in the store -------------------------------------------------------

FLOAT8 = [
    d
    for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
    if d is not None
]


def _float8_inputs():
    """Every float16 and every bfloat16 bit pattern, and float32 bit patterns:
    every 4099th of all 2^32 (a prime stride, so every low-bit residue, both
    signs, subnormals, infinities and NaNs) plus windows around every
    float8 value and midpoint."""
    every16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    stride = torch.arange(0, 1 << 32, 4099, dtype=torch.int64)
    near = []
    for dtype in FLOAT8:
        values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
        values = values[torch.isfinite(values)].unique()
        mids = (values[1:] + values[:-1]) / 2
        points = torch.cat([values, mids]).view(torch.int32).long()
        near.append((points[:, None] + torch.arange(-2, 3)).flatten() & 0xFFFFFFFF)
    f32 = torch.cat([stride] + near)
    f32 = torch.where(f32 >= 1 << 31, f32 - (1 << 32), f32).to(torch.int32).view(torch.float32)
    return [every16.view(torch.float16), every16.view(torch.bfloat16), f32]


def _store_converted(x, cache_dtype, scale, device):
    """x (1-D) stored as one row of a float8 cache through store_cache, as bytes."""
    n = x.numel()
    kc = torch.zeros(2, n, dtype=cache_dtype, device=device)
    vc = torch.zeros(2, n, dtype=cache_dtype, device=device)
    row = x.to(device).view(1, n)
    kernel.store_cache(
        kc, vc, torch.tensor([1], device=device), row, row, k_scale=scale, v_scale=scale
    )
    assert torch.equal(b(kc[1]), b(vc[1]))
    assert b(kc[0]).eq(0).all()
    return b(kc[1])


@pytest.mark.skipif(not FLOAT8, reason="this torch has no float8 dtypes")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FLOAT8, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("scale", [1.0, 0.37, 1 / 448, 3e-5, 700.0, 2.0**-20, "tensor"])
def test_float8_conversion_is_bit_identical_to_torch(device, cache_dtype, scale):
    """`(x.float() / scale).to(float8)` as torch computes it on the CPU, over
    every half and bfloat16 and ~1M float32 bit patterns: rounding ties,
    subnormals, overflow (e4m3fn saturates, e5m2 goes to inf), NaN and its
    sign. On CUDA the kernel must do the same arithmetic."""
    value = 0.0123 if scale == "tensor" else scale
    arg = torch.tensor([value], device=device) if scale == "tensor" else scale
    for x in _float8_inputs():
        want = to_float8(x, cache_dtype, value).view(torch.uint8)
        if torch_casts_like_this():  # and torch itself agrees, where it saturates
            assert torch.equal(want, (x.float() / value).to(cache_dtype).view(torch.uint8))
        got = _store_converted(x, cache_dtype, arg, device)
        bad = (got != want).nonzero().flatten()
        assert bad.numel() == 0, (
            f"{x.dtype}: {bad.numel()} differ, first x={x[bad[0]].item()!r} "
            f"got 0x{got[bad[0]].item():02x} want 0x{want[bad[0]].item():02x}"
        )


@pytest.mark.skipif(not FLOAT8, reason="this torch has no float8 dtypes")
def test_float8_torch_fallback_matches_native():
    """The torch path (devices without a native kernel) converts as the kernel does."""
    g = torch.Generator().manual_seed(4)
    for cache_dtype in FLOAT8:
        kc = torch.zeros(6, 2, 8, dtype=cache_dtype)
        a = (kc.clone(), kc.clone())
        t = (kc.clone(), kc.clone())
        k = (torch.randn(4, 2, 8, generator=g) * 300).bfloat16()
        v = (torch.randn(4, 2, 8, generator=g) * 1e-3).half()
        loc = torch.tensor([5, 0, 2, 3])
        kernel.store_cache(a[0], a[1], loc, k, v, k_scale=0.3, v_scale=torch.tensor([2e-5]))
        store_mod._store_torch(t[0], t[1], loc, k, v, 0.3, torch.tensor([2e-5]))
        assert torch.equal(b(a[0]), b(t[0])) and torch.equal(b(a[1]), b(t[1]))
        with pytest.raises(ValueError, match="^k_scale must be positive"):
            store_mod._store_torch(t[0], t[1], loc, k, v, -1.0)
        with pytest.raises(TypeError, match="^k has dtype float64"):
            store_mod._store_torch(t[0], t[1], loc, k.double(), v)


@pytest.mark.cuda
def test_float8_store_cuda_device_scale_skips_checks_without_check_bounds():
    """A device scale tensor is read by the kernel; with check_bounds it is
    checked first (one sync), without it the store is graph-capturable."""
    if not kernel.cuda_available() or not FLOAT8:
        pytest.skip("radixkv._cuda was not built, or this torch has no float8")
    kc = torch.zeros(16, 2, 8, dtype=FLOAT8[0], device="cuda")
    vc = torch.zeros_like(kc)
    k = torch.full((3, 2, 8), 4.0, device="cuda")
    loc = torch.tensor([1, 2, 3], device="cuda")
    with pytest.raises(ValueError, match="^k_scale must be positive and finite"):
        kernel.store_cache(kc, vc, loc, k, k, k_scale=torch.tensor([0.0], device="cuda"))
    assert b(kc).eq(0).all()
    with pytest.raises(TypeError, match="^k_scale on cuda:0 must have dtype float32"):
        kernel.store_cache(kc, vc, loc, k, k, k_scale=torch.tensor([2.0], device="cuda").half())
    scale = torch.tensor([2.0], device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.store_cache(kc, vc, loc, k, k, k_scale=scale, v_scale=0.5, check_bounds=False)
    graph.replay()
    torch.cuda.synchronize()
    assert kc[1:4].float().eq(2.0).all() and vc[1:4].float().eq(8.0).all()
