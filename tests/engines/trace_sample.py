"""The public Mooncake conversation trace at a size a tiny model serves: the
requests of a seeded sample of its conversations, in trace order, each
512-token block as `block` tokens, prompts cut to `max_blocks` blocks.

A conversation is the requests that share the first block fewer than 200
requests of the whole trace use (every request starts with the same system
blocks). The sample is written as a trace file (`radixkv replay` reads it
with `--block-size block`) and as the token ids a server is sent: block `h`
is `block` tokens drawn from a generator seeded with `h`, within the tiny
model's vocabulary, so equal blocks are equal tokens and different blocks
differ."""

import collections
import json
import os
import random
from typing import Dict, List, Optional

import pytest

TRACE_NAMES = ("mooncake_fast25_conversation_trace.jsonl", "conversation_trace.jsonl")


def trace_path() -> str:
    """The conversation trace in RADIXKV_TRACES (skips, saying so, without it)."""
    root = os.environ.get("RADIXKV_TRACES")
    if root:
        for name in TRACE_NAMES:
            if os.path.exists(os.path.join(root, name)):
                return os.path.join(root, name)
    pytest.skip("RADIXKV_TRACES names no directory holding the Mooncake conversation trace")


def sample(
    path: str, conversations: int = 80, seed: int = 0, max_blocks: int = 40, rare: int = 200
) -> List[dict]:
    """The trace's requests of `conversations` conversations (seeded), in
    order, hash ids cut to `max_blocks`."""
    with open(path) as f:
        requests = [json.loads(line) for line in f if line.strip()]
    uses: Dict[int, int] = collections.Counter()
    for r in requests:
        uses.update(set(r["hash_ids"]))

    def root(r) -> Optional[int]:
        return next((h for h in r["hash_ids"] if uses[h] < rare), None)

    groups = collections.defaultdict(list)
    for i, r in enumerate(requests):
        groups[root(r)].append(i)
    keys = [k for k in groups if k is not None and len(groups[k]) >= 2]
    random.Random(seed).shuffle(keys)
    chosen = sorted(i for k in keys[:conversations] for i in groups[k])
    return [{**requests[i], "hash_ids": requests[i]["hash_ids"][:max_blocks]} for i in chosen]


def write_scaled(requests: List[dict], out: str, block: int, output_length: int) -> None:
    """The sample as a trace of `block`-token blocks."""
    with open(out, "w") as f:
        for r in requests:
            h = r["hash_ids"]
            row = {
                "timestamp": r["timestamp"],
                "input_length": len(h) * block,
                "output_length": output_length,
                "hash_ids": h,
            }
            f.write(json.dumps(row) + "\n")


def tokens(hash_ids: List[int], block: int, vocab: int = 1000) -> List[int]:
    out: List[int] = []
    for h in hash_ids:
        rng = random.Random(h)
        out += [rng.randrange(3, vocab) for _ in range(block)]
    return out
