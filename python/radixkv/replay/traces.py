"""Request traces: the Mooncake JSONL format and its token materialisation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Set

import numpy as np
import torch

# Output tokens get ids above every block token, so they never match a prompt.
OUTPUT_TOKEN_BASE = 1 << 30
# Fields that name a request's conversation, when a trace has one.
SESSION_FIELDS = ("session_id", "session", "conversation_id", "chat_id")


@dataclass(frozen=True)
class Request:
    """One request of a trace. `hash_ids[i]` names block i of the prompt.

    Blocks are `block_size` tokens; the same hash id means the same block
    content *and* the same prefix before it (the ids are chained), so two
    prompts share exactly their leading blocks with equal ids.
    """

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: Sequence[int]
    # The conversation it belongs to, when the trace says (instances route by it).
    session: Optional[str] = None


def load_mooncake(path: str) -> List[Request]:
    """Reads a Mooncake-format JSONL trace (`timestamp`, `input_length`,
    `output_length`, `hash_ids`), ordered by timestamp (stable)."""
    requests = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
                if not isinstance(r, dict):
                    raise TypeError(f"expected a JSON object, got {type(r).__name__}")
                session = next((str(r[k]) for k in SESSION_FIELDS if r.get(k) is not None), None)
                req = Request(
                    float(r["timestamp"]),
                    int(r["input_length"]),
                    int(r["output_length"]),
                    [int(h) for h in r["hash_ids"]],
                    session,
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({e})") from None
            if req.input_length < 1 or req.output_length < 0 or any(h < 0 for h in req.hash_ids):
                raise ValueError(
                    f"{path}:{lineno}: lengths and hash ids must be non-negative "
                    "and input_length >= 1"
                )
            requests.append(req)
    requests.sort(key=lambda r: r.timestamp)
    return requests


class TokenMaker:
    """Turns hash ids into token ids: block `h` is tokens `h * block_size + [0, block_size)`.

    Prompts longer than their blocks (a trace that names too few) get fresh
    tokens for the rest; outputs get fresh tokens from `OUTPUT_TOKEN_BASE`.
    """

    def __init__(self, block_size: int, max_hash_id: int):
        if (max_hash_id + 1) * block_size >= OUTPUT_TOKEN_BASE:
            raise ValueError(
                f"hash ids up to {max_hash_id} with block_size {block_size} do not "
                "fit below the output token range"
            )
        self.block_size = block_size
        self._offsets = np.arange(block_size, dtype=np.int32)
        self._fresh = OUTPUT_TOKEN_BASE

    def _take_fresh(self, n: int) -> int:
        """The first of `n` fresh token ids, taken."""
        if self._fresh + n > 2**31:
            self._fresh = OUTPUT_TOKEN_BASE  # wrap: ids this old are long evicted
        start = self._fresh
        self._fresh += n
        return start

    def _fill(self, out: np.ndarray, req: Request) -> None:
        """Writes the prompt of `req` into `out` (`req.input_length` int32)."""
        n = req.input_length
        h = np.asarray(req.hash_ids, dtype=np.int32)
        named = min(len(h) * self.block_size, n)
        out[:named] = (h[:, None] * self.block_size + self._offsets).reshape(-1)[:named]
        if named < n:
            start = self._take_fresh(n - named)
            out[named:] = np.arange(start, start + n - named, dtype=np.int32)

    def prompt(self, req: Request) -> torch.Tensor:
        out = np.empty(req.input_length, dtype=np.int32)
        self._fill(out, req)
        return torch.from_numpy(out)

    def output(self, n: int) -> torch.Tensor:
        start = self._take_fresh(n)
        return torch.arange(start, start + n, dtype=torch.int32)

    def request_tokens(self, req: Request) -> torch.Tensor:
        """`prompt(req)` then `output(req.output_length)`, in one tensor (the
        prompt is its first `req.input_length` tokens)."""
        n, out = req.input_length, req.output_length
        buf = np.empty(n + out, dtype=np.int32)
        self._fill(buf[:n], req)
        if out:
            start = self._take_fresh(out)
            buf[n:] = np.arange(start, start + out, dtype=np.int32)
        return torch.from_numpy(buf)

    def advance(self, req: Request) -> None:
        """Moves on as `prompt(req)` and `output(req.output_length)` would,
        wrapping the same way, without making the tokens."""
        named = len(req.hash_ids) * self.block_size
        for n in (max(0, req.input_length - named), req.output_length):
            if self._fresh + n > 2**31:
                self._fresh = OUTPUT_TOKEN_BASE
            self._fresh += n

    @property
    def position(self) -> int:
        """Where the next fresh token comes from."""
        return self._fresh

    def seek(self, position: int) -> None:
        """Fresh tokens continue from `position` (a run split over instances
        gives each request the fresh tokens one instance would have)."""
        self._fresh = position


def max_hash_id(requests: Iterable[Request]) -> int:
    return max((max(r.hash_ids) for r in requests if r.hash_ids), default=0)


def optimal_hit_tokens(requests: Sequence[Request], block_size: int) -> int:
    """Hit tokens of an unbounded prefix cache with block-sized pages.

    A request hits block i when an earlier request cached it: the block was
    one of that request's full blocks (its prompt is cached whole pages
    only). Matching stops before the last token, so a request hits at most
    its full blocks before that token. Independent of any cache code.
    """
    seen: Set[int] = set()
    hit = 0
    for r in requests:
        usable = (r.input_length - 1) // block_size
        n = 0
        while n < min(usable, len(r.hash_ids)) and r.hash_ids[n] in seen:
            n += 1
        hit += n * block_size
        seen.update(r.hash_ids[: r.input_length // block_size])
    return hit
