"""The request-to-token table: for engines that keep each request's slots on the device."""

from __future__ import annotations

from typing import List

import torch


class ReqToTokenPool:
    """A `[max_requests, max_context_len]` int32 table, one row per live request.

    Row `r`, column `i` holds the KV slot of token `i` of the request in row
    `r`; attention kernels read a batch's rows directly. Rows are handed out
    by `alloc` and returned by `free`; `write` fills a slice of a row.
    """

    def __init__(self, max_requests: int, max_context_len: int,
                 device: torch.device | str = "cpu"):
        for name, v in (("max_requests", max_requests), ("max_context_len", max_context_len)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.table = torch.zeros(max_requests, max_context_len, dtype=torch.int32, device=device)
        self._free: List[int] = list(range(max_requests - 1, -1, -1))
        self._live = [False] * max_requests

    @property
    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, count: int) -> List[int]:
        """`count` free rows; raises RuntimeError, taking none, if too few are free."""
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"count must be an int, got {type(count).__name__}")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._free):
            raise RuntimeError(f"cannot allocate {count} request rows: {len(self._free)} free")
        rows = [self._free.pop() for _ in range(count)]
        for r in rows:
            self._live[r] = True
        return rows

    def free(self, rows) -> None:
        """Return rows; each must be live and listed once."""
        rows = [int(r) for r in rows]
        if len(set(rows)) != len(rows):
            raise ValueError("rows lists a row twice")
        for r in rows:
            if not 0 <= r < len(self._live) or not self._live[r]:
                raise ValueError(f"rows: row {r} is not allocated")
        for r in rows:
            self._live[r] = False
            self._free.append(r)

    def write(self, row: int, start: int, values: torch.Tensor) -> None:
        """`table[row, start:start + len(values)] = values`."""
        if not 0 <= row < len(self._live) or not self._live[row]:
            raise ValueError(f"row {row} is not allocated")
        n = int(values.shape[0])
        if start < 0 or start + n > self.table.shape[1]:
            raise ValueError(
                f"start={start} with {n} values exceeds max_context_len={self.table.shape[1]}"
            )
        self.table[row, start:start + n] = values.to(self.table.device, torch.int32)
