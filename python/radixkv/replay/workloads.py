"""A built-in workload: multi-turn chat sessions over a few shared system prompts."""

from __future__ import annotations

import random
from typing import List

from radixkv.replay.traces import Request


def chat_sessions(
    num_sessions: int = 400, block_size: int = 16, seed: int = 0, system_prompts: int = 4
) -> List[Request]:
    """Requests in the Mooncake format, interleaved in time across sessions.

    Each session starts from one of `system_prompts` shared system prompts
    (8 to 32 blocks). Turn k's prompt is the previous turn's prompt, the
    previous reply and a new user message, so every turn reuses the whole
    conversation so far; replies are 1 to 8 blocks, user messages 1 to 6.
    Sessions have 1 to 8 turns and start at random times.
    """
    rng = random.Random(seed)
    next_id = 0

    def new_blocks(n: int) -> List[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [new_blocks(rng.randint(8, 32)) for _ in range(system_prompts)]
    events = []
    for session in range(num_sessions):
        t = rng.uniform(0, 600.0)
        history = list(rng.choice(systems))
        for _turn in range(rng.randint(1, 8)):
            history = history + new_blocks(rng.randint(1, 6))
            tail = rng.randint(1, block_size)  # the last block is partial
            input_length = (len(history) - 1) * block_size + tail
            output_blocks = rng.randint(1, 8)
            events.append(
                Request(
                    t, input_length, output_blocks * block_size, list(history), f"chat-{session}"
                )
            )
            # The reply joins the history as blocks of its own.
            history = history + new_blocks(output_blocks)
            t += rng.uniform(5.0, 60.0)
    events.sort(key=lambda r: r.timestamp)
    return events
