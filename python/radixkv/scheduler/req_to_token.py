"""The request-to-token table: for engines that keep each request's slots on the device."""

from __future__ import annotations

from typing import List

import numpy as np
import torch


def _index(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


class ReqToTokenPool:
    """A `[max_requests, max_context_len]` int32 table, one row per live request.

    Row `r`, column `i` holds the KV slot of token `i` of the request in row
    `r`; attention kernels read a batch's rows directly. Rows are handed out
    by `alloc` and returned by `free`; `write` fills a slice of a row.
    Every call checks its arguments before it changes anything.
    """

    def __init__(self, max_requests: int, max_context_len: int,
                 device: torch.device | str = "cpu"):
        for name, v in (("max_requests", max_requests), ("max_context_len", max_context_len)):
            if _index(v, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.table = torch.zeros(max_requests, max_context_len, dtype=torch.int32, device=device)
        self._free: List[int] = list(range(max_requests - 1, -1, -1))
        self._live = [False] * max_requests

    @property
    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, count: int) -> List[int]:
        """`count` free rows; raises RuntimeError, taking none, if too few are free."""
        count = _index(count, "count")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._free):
            raise RuntimeError(f"cannot allocate {count} request rows: {len(self._free)} free")
        rows = [self._free.pop() for _ in range(count)]
        for r in rows:
            self._live[r] = True
        return rows

    def _check_row(self, row, name: str = "row") -> int:
        row = _index(row, name)
        if not 0 <= row < len(self._live) or not self._live[row]:
            raise ValueError(f"{name} {row} is not an allocated row")
        return row

    def free(self, rows) -> None:
        """Return rows; each must be allocated and listed once."""
        rows = [self._check_row(r, "rows: row") for r in rows]
        if len(set(rows)) != len(rows):
            raise ValueError("rows lists a row twice")
        for r in rows:
            self._live[r] = False
            self._free.append(r)

    def write(self, row: int, start: int, values) -> None:
        """`table[row, start:start + len(values)] = values` (1-D integer slots)."""
        row = self._check_row(row)
        start = _index(start, "start")
        if not isinstance(values, torch.Tensor):
            try:
                values = torch.as_tensor(np.asarray(values))
            except (TypeError, ValueError) as e:
                raise TypeError(f"values must be a 1-D integer tensor, array or list ({e})") \
                    from None
        if values.dim() != 1:
            raise ValueError(f"values must be 1-D, got shape {tuple(values.shape)}")
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"values must have an integer dtype, got {values.dtype}")
        n = int(values.shape[0])
        if start < 0 or start + n > self.table.shape[1]:
            raise ValueError(
                f"start={start} with {n} values exceeds max_context_len={self.table.shape[1]}"
            )
        if n and (int(values.min()) < 0 or int(values.max()) > 2**31 - 1):
            raise ValueError("values must be slot indices in [0, 2**31)")
        self.table[row, start:start + n] = values.to(self.table.device, torch.int32)
