"""A tiny serving engine on radixkv: the shortest complete example of wiring it in.

A decoder-only transformer (2 layers, grouped-query attention, RoPE; random
weights from a fixed seed, torch only) serves a stream of multi-turn
conversations with continuous batching: each step admits waiting requests
(prefill of what the cache does not hold) and decodes one token for every
running one. K/V live in an MHAKVCache; a CacheManager hands out pages, shares
prefixes between requests through the radix tree, backs pages up to a host
tier and loads them back, and (with --storage) writes them to a file store
that a second engine reads. Attention reads K/V through the pool's slots.

`check=True` (the default) recomputes every request's whole sequence without
any cache and compares the logits of each prefill and decode step: the
engine is right only if reusing cached K/V changes nothing.

    python examples/tiny_engine.py [--conversations 6] [--host-codec float8]
        [--storage DIR [--storage-codec float8]]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from radixkv import OutOfCapacityError
from radixkv.kvcache import MHAKVCache
from radixkv.kvcache.page_codec import CODECS
from radixkv.scheduler import CacheManager

VOCAB, D_MODEL, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 512, 64, 2, 4, 2, 16


class TinyModel:
    """Weights and the math; `forward` takes the K/V of earlier positions
    from a callback, so the same code runs with and without a cache."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)

        def w(*shape):
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

        self.embed = torch.randn(VOCAB, D_MODEL, generator=g)
        self.layers = [
            dict(
                q=w(D_MODEL, HEADS * HEAD_DIM),
                k=w(D_MODEL, KV_HEADS * HEAD_DIM),
                v=w(D_MODEL, KV_HEADS * HEAD_DIM),
                o=w(HEADS * HEAD_DIM, D_MODEL),
                up=w(D_MODEL, 4 * D_MODEL),
                down=w(4 * D_MODEL, D_MODEL),
            )
            for _ in range(LAYERS)
        ]
        self.out = w(D_MODEL, VOCAB)
        inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.inv_freq = inv

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None].float() * self.inv_freq[None, :]  # [n, dim/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward(self, tokens: torch.Tensor, start: int, kv_for_layer) -> torch.Tensor:
        """Logits of `tokens`, which sit at positions start.. of their
        sequence. `kv_for_layer(layer, k, v)` receives the new tokens' K/V
        ([n, KV_HEADS, HEAD_DIM]) and returns K/V of the whole sequence so
        far, positions 0..start+n."""
        n = len(tokens)
        positions = torch.arange(start, start + n)
        x = self.embed[tokens.long()]
        for i, p in enumerate(self.layers):
            h = self.norm(x)
            q = self.rope((h @ p["q"]).view(n, HEADS, HEAD_DIM), positions)
            k = self.rope((h @ p["k"]).view(n, KV_HEADS, HEAD_DIM), positions)
            v = (h @ p["v"]).view(n, KV_HEADS, HEAD_DIM)
            keys, values = kv_for_layer(i, k, v)  # [start + n, KV_HEADS, HEAD_DIM]
            group = HEADS // KV_HEADS
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(HEAD_DIM)
            causal = torch.arange(start + n)[None, :] > positions[:, None]
            scores = scores.masked_fill(causal[None], float("-inf"))
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
            x = x + attn.reshape(n, HEADS * HEAD_DIM) @ p["o"]
            x = x + torch.nn.functional.gelu(self.norm(x) @ p["up"]) @ p["down"]
        return self.norm(x) @ self.out

    def logits_without_cache(self, tokens: torch.Tensor) -> torch.Tensor:
        """The reference: the whole sequence computed from scratch."""
        return self.forward(tokens, 0, lambda layer, k, v: (k, v))


@dataclass
class Request:
    rid: int
    prompt: torch.Tensor
    max_new_tokens: int
    tokens: torch.Tensor = None  # prompt + generated so far
    handle: object = None
    indices: torch.Tensor = None  # a slot per token of `tokens` (cached, then own)
    logits: List[torch.Tensor] = field(default_factory=list)  # per computed position run
    starts: List[int] = field(default_factory=list)
    from_cache: int = 0  # prompt tokens reused (device + host)
    from_host: int = 0


class Engine:
    """Continuous batching over one CacheManager and one K/V pool."""

    def __init__(
        self,
        model: TinyModel,
        num_pages: int = 48,
        page_size: int = 4,
        host_pages: int = 96,
        storage_dir: Optional[str] = None,
        storage_codec: Optional[str] = None,
        host_codec: Optional[str] = None,
    ):
        self.model, self.page_size = model, page_size
        self.pool = MHAKVCache(
            KV_HEADS, LAYERS, HEAD_DIM, num_pages, torch.float32, page_size=page_size
        )
        storage = seed = None
        if storage_dir is not None:
            from radixkv.storage import FileStorage, config_fingerprint

            seed = config_fingerprint(
                model="tiny-engine",
                dtype=torch.float32,
                page_size=page_size,
                layout="page_first",
                num_layers=LAYERS,
                kv_heads=KV_HEADS,
                head_dim=HEAD_DIM,
            )
            # An encoded host's pages are stored as they are, with its codec.
            storage = FileStorage(storage_dir, seed, codec=storage_codec or host_codec)
        self.cm = CacheManager(
            num_pages,
            page_size=page_size,
            kv_cache=self.pool,
            host_num_pages=host_pages,
            host_codec=host_codec,
            storage=storage,
            storage_seed=seed,
            prefetch_policy="wait_complete",
        )
        self.waiting: List[Request] = []
        self.running: List[Request] = []
        self.done: Dict[int, Request] = {}

    # -- the model over the pool ------------------------------------------------------

    def _run(self, req: Request, new: torch.Tensor, start: int, slots: torch.Tensor) -> None:
        """Computes `new` (positions start..), storing its K/V at `slots`;
        earlier positions' K/V are read from the pool at req.indices."""

        def kv_for_layer(layer, k, v):
            self.pool.store_kv(k, v, slots, layer)
            every = torch.cat([req.indices[:start], slots]).long()
            keys = self.pool.k_cache(layer).reshape(-1, KV_HEADS, HEAD_DIM)[every]
            values = self.pool.v_cache(layer).reshape(-1, KV_HEADS, HEAD_DIM)[every]
            return keys, values

        logits = self.model.forward(new, start, kv_for_layer)
        req.logits.append(logits)
        req.starts.append(start)

    def _pages_for(self, n: int) -> Optional[torch.Tensor]:
        if self.cm.available_size < n:
            return None
        return self.cm.allocate(n)

    # -- scheduling ---------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        req.tokens = req.prompt.clone()
        self.waiting.append(req)

    def _admit(self, req: Request) -> bool:
        cm = self.cm
        op = cm.prefetch(req.tokens)  # pages other engines wrote, into host
        if op is not None:
            cm.wait_prefetch(op)
        handle, _ = cm.match_req(req.tokens)
        device = handle.cached_len
        try:
            handle, cached = cm.load_back(handle)  # locks; the host part comes back
        except OutOfCapacityError:  # no device room now: wait for a finished request
            return False
        new = len(req.tokens) - handle.cached_len
        own = self._pages_for(new + req.max_new_tokens)  # its decode fits too
        if own is None:
            cm.unlock(handle)
            return False
        req.handle, req.from_cache = handle, handle.cached_len
        req.from_host = handle.cached_len - device
        req.indices = torch.cat([cached, own])
        start = handle.cached_len
        self._run(req, req.tokens[start:], start, own[:new])
        return True

    def _decode(self, req: Request) -> None:
        token = req.logits[-1][-1].argmax().view(1).to(torch.int32)
        req.tokens = torch.cat([req.tokens, token])
        pos = len(req.tokens) - 1
        if pos >= len(req.indices):  # the last page is full: one more
            more = self._pages_for(1)
            if more is None:
                raise RuntimeError("out of pages while decoding")
            req.indices = torch.cat([req.indices, more])
        self._run(req, token, pos, req.indices[pos : pos + 1])

    def step(self) -> None:
        for req in list(self.waiting):  # admit what fits
            if self._admit(req):
                self.waiting.remove(req)
                self.running.append(req)
        for req in list(self.running):  # one token for each running request
            if len(req.tokens) - len(req.prompt) >= req.max_new_tokens:
                # Cache the tokens whose K/V exist (all but the last one
                # generated), in whole pages; a page beyond them goes back.
                n = len(req.tokens) - 1
                whole = -(-n // self.page_size) * self.page_size
                self.cm.free_and_cache_finished_req(req.handle, req.tokens[:n], req.indices[:whole])
                if len(req.indices) > whole:
                    self.cm.free(req.indices[whole:])
                self.running.remove(req)
                self.done[req.rid] = req
            else:
                self._decode(req)
        self.cm.writing_check()  # once per round: backups land
        self.cm.loading_check()  # loads land
        self.cm.storage_check()  # writes to storage land

    def run(self) -> None:
        while self.waiting or self.running:
            idle = not self.running
            self.step()
            if idle and not self.running:
                raise RuntimeError("a waiting request does not fit the pool even alone")
        self.cm.drain()
        self.cm.check_integrity()


def serve_conversations(
    engine: Engine, n: int, turns: int = 3, new_tokens: int = 5, seed: int = 1
) -> List[Request]:
    """Serves turn t of every conversation as one batch, then turn t + 1
    (whose prompt holds turn t's answer), through the engine."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, VOCAB, (13,), generator=g, dtype=torch.int32)
    history = [system.clone() for _ in range(n)]
    served = []
    for t in range(turns):
        for c in range(n):
            user = torch.randint(
                0,
                VOCAB,
                (int(torch.randint(3, 12, (1,), generator=g)),),
                generator=g,
                dtype=torch.int32,
            )
            history[c] = torch.cat([history[c], user])
            engine.submit(
                Request(rid=t * n + c, prompt=history[c].clone(), max_new_tokens=new_tokens)
            )
        engine.run()
        for c in range(n):
            req = engine.done[t * n + c]
            history[c] = req.tokens.clone()  # the answer is part of the next prompt
            served.append(req)
    return served


def check(model: TinyModel, requests: List[Request], atol: float = 1e-4) -> float:
    """Every logit the engine produced against a from-scratch recompute;
    returns the largest difference (raises past `atol`)."""
    worst = 0.0
    for req in requests:
        reference = model.logits_without_cache(req.tokens)
        for start, logits in zip(req.starts, req.logits):
            want = reference[start : start + len(logits)]
            diff = float((logits - want).abs().max())
            worst = max(worst, diff)
            if diff > atol:
                raise AssertionError(
                    f"request {req.rid}: logits from position {start} differ "
                    f"by {diff:.2e} from a recompute without cache"
                )
    return worst


def logit_errors(model: TinyModel, requests: List[Request]) -> tuple:
    """What a lossy codec costs, over every logit the engine produced
    against a recompute without cache: the largest and the mean absolute
    difference, the mean absolute logit (for scale), and the share of
    positions whose most likely token is the same."""
    worst, total, size, count, same, positions = 0.0, 0.0, 0.0, 0, 0, 0
    for req in requests:
        reference = model.logits_without_cache(req.tokens)
        for start, logits in zip(req.starts, req.logits):
            want = reference[start : start + len(logits)]
            diff = (logits - want).abs()
            worst = max(worst, float(diff.max()))
            total += float(diff.sum())
            size += float(want.abs().sum())
            count += diff.numel()
            same += int((logits.argmax(-1) == want.argmax(-1)).sum())
            positions += len(logits)
    count = max(count, 1)
    return worst, total / count, size / count, same / max(positions, 1)


def report(model: TinyModel, requests: List[Request], codec: Optional[str]) -> str:
    """The engine's logits against a recompute without cache: checked
    (within 1e-4) without a codec; with one, what it costs."""
    if codec is None:
        return f"logits within {check(model, requests):.1e} of a recompute without cache"
    worst, mean, size, same = logit_errors(model, requests)
    return (
        f"logits off by {worst:.1e} at most and {mean:.1e} on average (mean |logit| "
        f"{size:.2f}) through the {codec} codec, the same most likely token at {same:.1%} "
        "of positions"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument(
        "--storage",
        metavar="DIR",
        help="also a file storage tier in DIR, and a "
        "second engine that serves the same conversations from it",
    )
    ap.add_argument(
        "--storage-codec",
        choices=CODECS,
        help="with --storage: pages written as float8 (half the bytes); the "
        "second engine reports the logit error the codec costs instead of checking",
    )
    ap.add_argument(
        "--host-codec",
        choices=CODECS,
        help="host pages held as float8 (half the bytes; a store then keeps them as "
        "they are); both engines report the logit error the codec costs",
    )
    args = ap.parse_args(argv)
    if args.storage_codec and not args.storage:
        ap.error("--storage-codec needs --storage")
    if args.storage_codec and args.host_codec not in (None, args.storage_codec):
        ap.error("--storage-codec must be --host-codec's codec (or left out)")
    codec = args.host_codec or args.storage_codec
    model = TinyModel()
    engine = Engine(
        model,
        storage_dir=args.storage,
        storage_codec=args.storage_codec,
        host_codec=args.host_codec,
    )
    served = serve_conversations(engine, args.conversations, args.turns)
    reused = sum(r.from_cache for r in served)
    host = sum(r.from_host for r in served)
    print(
        f"{len(served)} requests, {reused} prompt tokens from the cache ({host} from host), "
        + report(model, served, args.host_codec)
    )
    if args.storage:
        engine.cm.close()
        second = Engine(
            model,
            storage_dir=args.storage,
            storage_codec=args.storage_codec,
            host_codec=args.host_codec,
        )
        again = serve_conversations(second, args.conversations, args.turns)
        print(
            f"second engine: {sum(r.from_host for r in again)} prompt tokens came back "
            "through storage and host, " + report(model, again, codec)
        )
        second.cm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
