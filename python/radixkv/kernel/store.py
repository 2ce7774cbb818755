"""The KV store: scatter rows of k and v into token slots of two caches (MHA),
or of k_nope and k_rope into two column ranges of one cache (MLA), in one
kernel call; float8 caches fed float32/float16/bfloat16 are scaled and rounded
in the kernel."""

from __future__ import annotations

import torch

from radixkv import _core
from radixkv._native import cuda_extension

_INDEX_DTYPES = (torch.int32, torch.int64)


def cuda_built() -> bool:
    """Whether the CUDA kernels were built (`radixkv._cuda` imports), GPU or not."""
    return cuda_extension() is not None


def cuda_available() -> bool:
    """Whether the CUDA kernels can run here: they were built and torch sees a GPU."""
    return cuda_built() and torch.cuda.is_available()


def store_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    k_scale=None,
    v_scale=None,
    side=None,
    check_bounds: bool = True,
) -> None:
    """Write `k[i]` and `v[i]` to token slot `out_loc[i]` of `k_cache` and `v_cache`.

    The caches are `[num_pages, page_size, H, D]` (any strides but a contiguous
    last dimension; slot `s` is page `s // page_size`, row `s % page_size`),
    `[num_slots, H, D]`, or `[num_slots, row]` (mini-SGLang's flat rows; then
    `k` and `v` are `[n, row]`); `k` and `v` are `[n, H, D]` with the caches' dtype, and
    their rows may be strided (slices of a fused qkv output); `out_loc` has
    length n: on the CPU any 1-D integer tensor, NumPy array or list, on a
    device a 1-D int32 or int64 tensor there (a list or array is moved there).
    The caches, k and v on one device. Equivalent to
    `k_cache.view(-1, H, D)[out_loc] = k` (and the same for v) for a
    contiguous cache, and like torch's in-place ops it bumps the caches'
    version counters.

    Bad arguments raise TypeError (type, dtype, device) or ValueError (shape,
    stride, slot) naming the argument, with nothing written: a slot out of
    range or used twice in out_loc (which row would win is not defined), a
    cache that requires grad, a tensor that is a lazy negation. On the CPU
    every slot is read once and checked before anything is written. On CUDA
    the kernel runs on torch's current stream; checking the slots first costs
    one synchronization, which `check_bounds=False` skips (for CUDA graph
    capture or an engine that guarantees its slots): the kernel then skips an
    out-of-range slot (never writes it) and does not look for repeats. Where
    no native kernel exists (other devices, or CUDA when `radixkv._cuda` was
    not built) the store runs as torch indexing and always checks first.

    Float8: a float8 cache (float8_e4m3fn, float8_e5m2) also takes k and v in
    float32, float16 or bfloat16; the kernel writes `(k.float() / k_scale).to(
    k_cache.dtype)` bit for bit as torch computes it on the CPU (float32
    division, round to nearest even; e4m3fn saturates at 448, e5m2 overflows to
    inf, NaN stays NaN), likewise v with `v_scale`. A scale is a Python number
    or a one-element floating tensor, rounded to float32 like a Python scalar
    in torch (a float64 tensor too, where torch would divide in float64); None
    means 1. On CUDA a float32 scale tensor on the cache's
    device is read by the kernel (no synchronization; its value is checked
    only with `check_bounds`). A scale that is not positive and finite, a
    scale where nothing is converted (a non-float8 cache, or k already in the
    cache's dtype) raises ValueError; any other dtype pair raises TypeError.
    Same-dtype stores copy bytes as they are.

    `side`: more rows written by the same kernel call, a sequence of up to 6
    `(name, buffer, source)`: `buffer` `[num_slots, W]` (the caches' slots),
    `source` `[n, W]` of its dtype, so `buffer[out_loc[i]] = source[i]`.
    Errors name `side[<name>]` and `side buffer <name>`.
    """
    if getattr(k_cache, "is_cuda", False):
        if not isinstance(out_loc, torch.Tensor):
            out_loc = _core.int32_tensor(out_loc, "out_loc").to(k_cache.device)
        module = cuda_extension()
        if module is None:
            return _store_torch(k_cache, v_cache, out_loc, k, v, k_scale, v_scale, side=side)
        if check_bounds:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "store_cache cannot check slots while a CUDA graph is being "
                    "captured (it would synchronize): pass check_bounds=False"
                )
            _check_slots(k_cache, out_loc)
            _check_device_scales(("k_scale", k_scale), ("v_scale", v_scale))
        return module.store_cache(k_cache, v_cache, out_loc, k, v, k_scale, v_scale, side)
    if getattr(k_cache, "is_cpu", True):
        return _core.store_cache(k_cache, v_cache, out_loc, k, v, False, k_scale, v_scale, side)
    return _store_torch(k_cache, v_cache, out_loc, k, v, k_scale, v_scale, side=side)


def store_mla(
    kv_cache: torch.Tensor,
    out_loc: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    kv_lora_rank: int,
    *,
    k_scale=None,
    side=None,
    check_bounds: bool = True,
) -> None:
    """Write `k_nope[i]` and `k_rope[i]` side by side into token slot
    `out_loc[i]` of an MLA cache, in one kernel call.

    `kv_cache` is `[num_pages, page_size, 1, R]`, `[num_slots, 1, R]` or
    `[num_slots, R]` (any strides but a contiguous last dimension);
    `k_nope` is `[n, 1, kv_lora_rank]` or `[n, kv_lora_rank]` and goes into
    columns `[0, kv_lora_rank)` of each row, `k_rope` is `[n, 1, R -
    kv_lora_rank]` or `[n, R - kv_lora_rank]` and goes into the rest; their
    rows may be strided (slices of a fused projection). Equivalent to
    `rows = kv_cache.view(-1, R); rows[out_loc, :kv_lora_rank] = k_nope;
    rows[out_loc, kv_lora_rank:] = k_rope`. A float8 cache fed floats
    divides both by `k_scale` (see store_cache). Slots, errors, streams and
    `check_bounds` and `side` as in store_cache; errors name k_nope, k_rope,
    kv_cache.
    """
    if getattr(kv_cache, "is_cuda", False):
        if not isinstance(out_loc, torch.Tensor):
            out_loc = _core.int32_tensor(out_loc, "out_loc").to(kv_cache.device)
        module = cuda_extension()
        if module is None:
            return _store_mla_torch(kv_cache, out_loc, k_nope, k_rope, kv_lora_rank, k_scale, side)
        if check_bounds:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "store_mla cannot check slots while a CUDA graph is being "
                    "captured (it would synchronize): pass check_bounds=False"
                )
            _check_slots(kv_cache, out_loc)
            _check_device_scales(("k_scale", k_scale))
        return module.store_mla(kv_cache, out_loc, k_nope, k_rope, kv_lora_rank, k_scale, side)
    if getattr(kv_cache, "is_cpu", True):
        return _core.store_mla(
            kv_cache, out_loc, k_nope, k_rope, kv_lora_rank, False, k_scale, side
        )
    return _store_mla_torch(kv_cache, out_loc, k_nope, k_rope, kv_lora_rank, k_scale, side)


def _check_device_scales(*scales) -> None:
    """Raise ValueError for a device scale tensor that is not positive and
    finite in float32 (synchronizes); numbers are checked by the kernel's
    binding."""
    for name, s in scales:
        if isinstance(s, torch.Tensor) and s.is_cuda and s.numel() == 1 and s.is_floating_point():
            value = float(s.float())
            if not (value > 0 and value != float("inf")):
                raise ValueError(f"{name} must be positive and finite in float32, got {value}")


_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_FLOAT_SOURCES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _scaled(
    x: torch.Tensor, cache: torch.Tensor, scale, name: str, scale_name: str, cache_name: str
):
    """`x` in `cache`'s dtype: as it is, or converted as the kernel does."""
    if x.dtype == cache.dtype:
        if scale is not None:
            raise ValueError(
                f"{scale_name} is given, but {name} already has {cache_name}'s "
                f"dtype {_dtype_name(cache.dtype)} and is copied as it is"
            )
        return x
    if cache.dtype not in _FLOAT8 or x.dtype not in _FLOAT_SOURCES:
        raise TypeError(
            f"{name} has dtype {_dtype_name(x.dtype)} but {cache_name} has dtype "
            f"{_dtype_name(cache.dtype)}"
        )
    if scale is None:
        scale = 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"{scale_name} must be a number or a one-element tensor, got a "
                f"tensor of {scale.numel()} elements"
            )
        scale = scale.item()
    value = torch.tensor(float(scale), dtype=torch.float32)
    if not (float(value) > 0 and float(value) != float("inf")):
        raise ValueError(f"{scale_name} must be positive and finite in float32, got {scale}")
    y = x.float() / value.to(x.device)
    if cache.dtype == torch.float8_e4m3fn:
        # Saturate as the kernels do (and torch's own cast from 2.12; before it,
        # an e4m3fn overflow became NaN). clamp keeps NaN.
        y = y.clamp_(-448.0, 448.0)
    return y.to(cache.dtype)


def _store_mla_torch(kv_cache, out_loc, k_nope, k_rope, kv_lora_rank, k_scale, side=None) -> None:
    """store_mla through torch indexing, for devices without a native kernel."""
    for name, t in (
        ("kv_cache", kv_cache),
        ("out_loc", out_loc),
        ("k_nope", k_nope),
        ("k_rope", k_rope),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if kv_cache.dim() not in (2, 3, 4) or (kv_cache.dim() > 2 and kv_cache.shape[-2] != 1):
        raise ValueError(
            "kv_cache must have shape [num_pages, page_size, 1, row], "
            f"[num_slots, 1, row] or [num_slots, row], got {list(kv_cache.shape)}"
        )
    row = kv_cache.shape[-1]
    if not 0 < kv_lora_rank < row:
        raise ValueError(
            f"kv_lora_rank={kv_lora_rank} must leave both parts of kv_cache's rows "
            f"of {row} non-empty"
        )
    rope_dim = row - kv_lora_rank
    parts = []
    for name, x, width in (("k_nope", k_nope, kv_lora_rank), ("k_rope", k_rope, rope_dim)):
        if x.dim() not in (2, 3) or tuple(x.shape[1:]) not in ((width,), (1, width)):
            raise ValueError(
                f"{name} must have shape [num_tokens, 1, {width}] or "
                f"[num_tokens, {width}], got {list(x.shape)}"
            )
        parts.append(_scaled(x, kv_cache, k_scale, name, "k_scale", "kv_cache"))
    if parts[1].shape[0] != parts[0].shape[0]:
        raise ValueError(
            f"k_rope has {parts[1].shape[0]} tokens but k_nope has " f"{parts[0].shape[0]}"
        )
    caches = (kv_cache[..., :kv_lora_rank], kv_cache[..., kv_lora_rank:])
    shaped = [
        x.reshape((x.shape[0],) + tuple(c.shape[2:] if c.dim() == 4 else c.shape[1:]))
        for x, c in zip(parts, caches)
    ]
    _store_torch(
        caches[0], caches[1], out_loc, shaped[0], shaped[1], side=side, _widths_differ=True
    )


def _num_slots(cache: torch.Tensor) -> int:
    return cache.shape[0] * cache.shape[1] if cache.dim() == 4 else cache.shape[0]


def _check_slots(k_cache: torch.Tensor, out_loc: torch.Tensor) -> None:
    """Raise ValueError naming the first slot of `out_loc` outside the cache, or
    the first that repeats an earlier one (synchronizes). Leaves malformed
    arguments to the kernel's checks."""
    if not (
        isinstance(out_loc, torch.Tensor)
        and out_loc.dim() == 1
        and out_loc.dtype in _INDEX_DTYPES
        and out_loc.device == k_cache.device
        and k_cache.dim() in (2, 3, 4)
        and out_loc.numel() > 0
    ):
        return
    num_slots = _num_slots(k_cache)
    bad = (out_loc < 0) | (out_loc >= num_slots)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"out_loc[{i}] = {int(out_loc[i])} is out of range for a cache of {num_slots} slots"
        )
    order = torch.argsort(out_loc, stable=True)
    ranked = out_loc[order]
    same = ranked[1:] == ranked[:-1]
    if bool(same.any()):
        i = int(order[1:][same].min())
        raise ValueError(
            f"out_loc[{i}] = {int(out_loc[i])} repeats an earlier slot of out_loc: each token "
            "needs its own slot"
        )


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of `a` and `b` intersect (as the kernel checks)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t):
        lo = hi = t.data_ptr()
        for size, stride in zip(t.shape, t.stride()):
            reach = (size - 1) * stride * t.element_size()
            lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
        return lo, hi + t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _store_torch(
    k_cache, v_cache, out_loc, k, v, k_scale=None, v_scale=None, *, side=None, _widths_differ=False
) -> None:
    """The same store through torch indexing, for devices without a native kernel
    (`_widths_differ`: MLA's two halves, whose caches differ in width)."""
    names = ("k_cache", "v_cache", "out_loc", "k", "v")
    args = (k_cache, v_cache, out_loc, k, v)
    for name, t in zip(names, args):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != k_cache.device:
            raise TypeError(f"{name} must be on {k_cache.device} like k_cache, got {t.device}")
    if k_cache.dim() not in (2, 3, 4):
        raise ValueError(
            "k_cache must have shape [num_pages, page_size, heads, head_dim], "
            f"[num_slots, heads, head_dim] or [num_slots, row], got {list(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape and not _widths_differ:
        raise ValueError(
            f"v_cache has shape {list(v_cache.shape)} but k_cache has shape {list(k_cache.shape)}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache has dtype {v_cache.dtype} but k_cache has dtype {k_cache.dtype}")
    k = _scaled(k, k_cache, k_scale, "k", "k_scale", "k_cache")
    v = _scaled(v, v_cache, v_scale, "v", "v_scale", "v_cache")
    for name, t, c in (("k", k, k_cache), ("v", v, v_cache)):
        row = tuple(c.shape[-2:]) if c.dim() > 2 else tuple(c.shape[-1:])
        if t.dim() != 1 + len(row) or tuple(t.shape[1:]) != row:
            want = ", ".join(str(d) for d in row)
            raise ValueError(f"{name} must have shape [num_tokens, {want}], got {list(t.shape)}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v has {v.shape[0]} tokens but k has {k.shape[0]}")
    if out_loc.dim() != 1:
        raise ValueError(f"out_loc must be 1-D, got shape {list(out_loc.shape)}")
    if out_loc.dtype not in _INDEX_DTYPES:
        raise TypeError(f"out_loc must have dtype int32 or int64, got {out_loc.dtype}")
    if out_loc.shape[0] != k.shape[0]:
        raise ValueError(f"out_loc has length {out_loc.shape[0]} but k has {k.shape[0]} tokens")
    for c in (k_cache, v_cache):
        name = "k_cache" if c is k_cache else "v_cache"
        for d in range(c.dim()):
            if c.stride(d) == 0 and c.shape[d] > 1:
                raise ValueError(
                    f"{name} has stride 0 in dimension {d}: an expanded tensor "
                    "would write one place many times"
                )
        for x, xname in ((k, "k"), (v, "v")):
            if _overlaps(x, c):
                raise ValueError(
                    f"{xname} lies in the memory of {name}: the store would "
                    "overwrite rows it has yet to read"
                )
    if (
        k_cache.data_ptr() == v_cache.data_ptr()
        and k_cache.stride() == v_cache.stride()
        and k_cache.numel() > 0
        and not _widths_differ
    ):
        raise ValueError("v_cache is the same memory as k_cache: the store would write v over k")
    if k_cache.requires_grad or v_cache.requires_grad:
        name = "k_cache" if k_cache.requires_grad else "v_cache"
        raise ValueError(
            f"{name} requires grad, and a KV cache is written in place: pass " f"{name}.detach()"
        )
    _check_slots(k_cache, out_loc)
    sides = _check_sides_torch(side, k_cache, k.shape[0])
    loc = out_loc.long()
    for buf, src in sides:
        buf[loc] = src
    if k_cache.dim() == 4:
        page = k_cache.shape[1]
        k_cache[loc // page, loc % page] = k
        v_cache[loc // page, loc % page] = v
    else:
        k_cache[loc] = k
        v_cache[loc] = v


def _check_sides_torch(side, k_cache, num_tokens):
    """The (buffer, source) pairs of `side` for the torch path, checked as the
    kernel checks them."""
    if side is None:
        return []
    if not isinstance(side, (list, tuple)):
        raise TypeError(
            f"side must be a sequence of (name, buffer, source), got " f"{type(side).__name__}"
        )
    if len(side) > 6:
        raise ValueError(
            f"side has {len(side)} buffers; a store writes at most 6 beside its " "caches"
        )
    pairs = []
    slots = _num_slots(k_cache)
    for i, entry in enumerate(side):
        if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)):
            raise TypeError(f"side[{i}] must be a (name, buffer, source) tuple")
        name, buf, src = entry
        for what, t in ((f"side buffer {name}", buf), (f"side[{name}]", src)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
            if t.device != k_cache.device:
                raise TypeError(f"{what} must be on {k_cache.device}, got {t.device}")
        if buf.dim() != 2 or buf.shape[0] != slots:
            raise ValueError(f"side buffer {name} must be [{slots}, row], got {list(buf.shape)}")
        if src.dtype != buf.dtype:
            raise TypeError(
                f"side[{name}] has dtype {_dtype_name(src.dtype)} but side buffer "
                f"{name} has dtype {_dtype_name(buf.dtype)}"
            )
        if src.dim() != 2 or src.shape[1] != buf.shape[1]:
            raise ValueError(
                f"side[{name}] must have shape [num_tokens, {buf.shape[1]}], got "
                f"{list(src.shape)}"
            )
        if src.shape[0] != num_tokens:
            raise ValueError(f"side[{name}] has {src.shape[0]} tokens but k has {num_tokens}")
        pairs.append((buf, src))
    return pairs
