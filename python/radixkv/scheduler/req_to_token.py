"""The request-to-token table: for engines that keep each request's slots on the device."""

from __future__ import annotations

from typing import List

import torch

from radixkv._checks import as_int as _index
from radixkv._checks import int32_tensor


class ReqToTokenPool:
    """A `[max_requests, max_context_len]` int32 table, one row per live request.

    Row `r`, column `i` holds the KV slot of token `i` of the request in row
    `r`; attention kernels read a batch's rows directly. Rows are handed out
    by `alloc` and returned by `free`; `write` fills a slice of a row.
    Every call checks its arguments before it changes anything.
    """

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str = "cpu"):
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
            raise RuntimeError(
                f"cannot allocate count={count} request rows: " f"{len(self._free)} free"
            )
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
        try:
            rows = list(rows)
        except TypeError:
            raise TypeError(f"rows must be a sequence of ints, got {type(rows).__name__}") from None
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
        values = int32_tensor(values, "values", self.table.device)
        n = len(values)
        if start < 0 or start + n > self.table.shape[1]:
            raise ValueError(
                f"start={start} with {n} values exceeds max_context_len={self.table.shape[1]}"
            )
        if n and int(values.min()) < 0:
            raise ValueError("values must be slot indices >= 0")
        self.table[row, start : start + n] = values.to(self.table.device)
