"""The KV store: scatter rows of k and v into token slots of two caches."""

from __future__ import annotations

from typing import Optional

import torch

from radixkv import _core

_INDEX_DTYPES = (torch.int32, torch.int64)
_cuda_module = None
_cuda_tried = False


def _cuda():
    """radixkv._cuda, imported on first use; None when it was not built."""
    global _cuda_module, _cuda_tried
    if not _cuda_tried:
        try:
            from radixkv import _cuda as module
        except ImportError:
            module = None
        _cuda_module, _cuda_tried = module, True
    return _cuda_module


def cuda_built() -> bool:
    """Whether the CUDA kernels were built (`radixkv._cuda` imports), GPU or not."""
    return _cuda() is not None


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
    """
    if getattr(k_cache, "is_cuda", False):
        if not isinstance(out_loc, torch.Tensor):
            out_loc = _core.int32_tensor(out_loc, "out_loc").to(k_cache.device)
        module = _cuda()
        if module is None:
            return _store_torch(k_cache, v_cache, out_loc, k, v)
        if check_bounds:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("store_cache cannot check slots while a CUDA graph is being "
                                   "captured (it would synchronize): pass check_bounds=False")
            _check_slots(k_cache, out_loc)
        return module.store_cache(k_cache, v_cache, out_loc, k, v)
    if getattr(k_cache, "is_cpu", True):
        return _core.store_cache(k_cache, v_cache, out_loc, k, v)
    return _store_torch(k_cache, v_cache, out_loc, k, v)


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


def _store_torch(k_cache, v_cache, out_loc, k, v) -> None:
    """The same store through torch indexing, for devices without a native kernel."""
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
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache has shape {list(v_cache.shape)} but k_cache has shape {list(k_cache.shape)}"
        )
    for name, t in (("v_cache", v_cache), ("k", k), ("v", v)):
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but k_cache has dtype {k_cache.dtype}")
    row = tuple(k_cache.shape[-2:]) if k_cache.dim() > 2 else tuple(k_cache.shape[-1:])
    for name, t in (("k", k), ("v", v)):
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
                raise ValueError(f"{name} has stride 0 in dimension {d}: an expanded tensor "
                                 "would write one place many times")
        for x, xname in ((k, "k"), (v, "v")):
            if _overlaps(x, c):
                raise ValueError(f"{xname} lies in the memory of {name}: the store would "
                                 "overwrite rows it has yet to read")
    if (k_cache.data_ptr() == v_cache.data_ptr() and k_cache.stride() == v_cache.stride()
            and k_cache.numel() > 0):
        raise ValueError("v_cache is the same memory as k_cache: the store would write v over k")
    if k_cache.requires_grad or v_cache.requires_grad:
        name = "k_cache" if k_cache.requires_grad else "v_cache"
        raise ValueError(f"{name} requires grad, and a KV cache is written in place: pass "
                         f"{name}.detach()")
    _check_slots(k_cache, out_loc)
    loc = out_loc.long()
    if k_cache.dim() == 4:
        page = k_cache.shape[1]
        k_cache[loc // page, loc % page] = k
        v_cache[loc // page, loc % page] = v
    else:
        k_cache[loc] = k
        v_cache[loc] = v
