"""First-mismatch comparison of token arrays, the inner loop of a prefix match."""

from __future__ import annotations

from typing import Optional

import torch

from radixkv import _core
from radixkv._native import cuda_extension


def first_mismatch(a, b) -> int:
    """Index of the first position where the 1-D integer sequences `a` and `b`
    differ, or the shorter length when one is a prefix of the other. CPU only
    (torch tensors, NumPy arrays or lists); vectorized, O(length)."""
    return _core.first_mismatch(a, b)


def first_mismatch_batched(
    query: torch.Tensor,
    keys: torch.Tensor,
    key_lens: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """For each row b of `keys` (int32 `[B, L]`), the first i < min(len(query),
    len_b) where `query[i] != keys[b, i]`, or that minimum when there is none;
    `len_b` is `key_lens[b]` (int32/int64 `[B]`) or L. `query` is int32 1-D. All
    on one device; the result (int32 `[B]`, written to `out` when given) too.

    On CUDA one warp compares one key, on torch's current stream, without
    synchronizing; `key_lens` there are clamped to [0, L] rather than checked.
    On the CPU each key goes through `first_mismatch` and a length outside
    [0, L] raises ValueError. Bad arguments raise TypeError or ValueError naming
    the argument.
    """
    devices = {t.device for t in (query, keys, key_lens, out) if isinstance(t, torch.Tensor)}
    if len(devices) > 1 or any(d.type == "meta" for d in devices):
        raise TypeError(
            "query, keys, key_lens and out must be on one device with data, got "
            + ", ".join(sorted(str(d) for d in devices))
        )
    if out is None:
        rows = keys.shape[0] if isinstance(keys, torch.Tensor) and keys.dim() >= 1 else 0
        device = keys.device if isinstance(keys, torch.Tensor) else "cpu"
        out = torch.empty(rows, dtype=torch.int32, device=device)
    if getattr(query, "is_cuda", False):
        module = cuda_extension()
        if module is None:
            return _first_mismatch_torch(query, keys, key_lens, out)
        module.first_mismatch_batched(query, keys, key_lens, out)
    elif getattr(query, "is_cpu", True):
        _core.first_mismatch_batched(query, keys, key_lens, out)
    else:
        return _first_mismatch_torch(query, keys, key_lens, out)
    return out


def _first_mismatch_torch(query, keys, key_lens, out) -> torch.Tensor:
    """The same comparison in torch ops, for devices without a native kernel."""
    for name, t in (("query", query), ("keys", keys), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 torch.Tensor")
    if query.dim() != 1 or keys.dim() != 2 or out.shape != (keys.shape[0],):
        raise ValueError(
            f"query must be 1-D, keys 2-D and out [{keys.shape[0] if keys.dim() else 0}]"
        )
    cols = keys.shape[1]
    if key_lens is None:
        lens = torch.full((keys.shape[0],), cols, dtype=torch.int64, device=keys.device)
    else:
        lens = key_lens.to(torch.int64).clamp(0, cols)
    n = torch.clamp(lens, max=query.shape[0])
    width = min(cols, query.shape[0])
    differ = keys[:, :width] != query[:width]
    differ &= torch.arange(width, device=keys.device) < n[:, None]
    first = differ.to(torch.int32).argmax(dim=1) if width else n
    out.copy_(torch.where(differ.any(dim=1), first, n) if width else n)
    return out
