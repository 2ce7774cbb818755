"""What the storage tests share: a serving instance with host and storage
tiers that checks every cached row it is handed, prompts, fingerprints, a
host pool of random pages, page keys, and a second user to attack a store
as."""

import hashlib
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from radixkv.kvcache import MHAKVCache
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.replay.replay import KVShape
from radixkv.scheduler import CacheManager, StorageFaultPolicy
from radixkv.storage import config_fingerprint

KV = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)
PAGE = 4

HAS_MOONCAKE = importlib.util.find_spec("mooncake") is not None
# CI installs Mooncake and sets this: there its tests must run, not skip.
needs_mooncake = pytest.mark.skipif(
    not HAS_MOONCAKE and not os.environ.get("RADIXKV_REQUIRE_MOONCAKE"),
    reason="Mooncake Store is not installed (pip install 'radixkv[mooncake]')",
)


def fingerprint(**change):
    base = dict(
        model="test",
        dtype=KV.dtype,
        page_size=PAGE,
        layout="page_first",
        num_layers=KV.num_layers,
        kv_heads=KV.num_kv_heads,
        head_dim=KV.head_dim,
    )
    return config_fingerprint(**{**base, **change})


class Instance:
    """A serving instance: pool, manager with host and storage tiers, and the
    request loop of the replay, checking every cached row it is handed."""

    def __init__(
        self,
        backend,
        *,
        pages=12,
        host_pages=24,
        policy="wait_complete",
        seed=None,
        kv=KV,
        retry_after_s=None,
        faults=None,
    ):
        self.kv = kv
        self.pool = MHAKVCache(
            kv.num_kv_heads, kv.num_layers, kv.head_dim, pages, kv.dtype, page_size=PAGE
        )
        if retry_after_s is not None:
            faults = StorageFaultPolicy(retry_after_s=retry_after_s)
        self.cm = CacheManager(
            pages,
            page_size=PAGE,
            host_num_pages=host_pages,
            kv_cache=self.pool,
            storage=backend,
            storage_seed=fingerprint() if seed is None else seed,
            prefetch_policy=policy,
            storage_faults=faults,
        )
        self.device = self.host = self.storage = 0

    def store(self, slots, ids, start):
        for layer in range(self.kv.num_layers):
            self.pool.store_kv(
                self.kv.rows(ids, start, layer, 0), self.kv.rows(ids, start, layer, 1), slots, layer
            )

    def rows_ok(self, slots, ids):
        for layer in range(self.kv.num_layers):
            for side, cache in ((0, self.pool.k_cache(layer)), (1, self.pool.v_cache(layer))):
                rows = cache.reshape(-1, self.kv.num_kv_heads, self.kv.head_dim)[slots.long()]
                if not torch.equal(
                    rows.view(torch.uint8), self.kv.rows(ids, 0, layer, side).view(torch.uint8)
                ):
                    return False
        return True

    def serve(self, ids, drain=True):
        ids = torch.as_tensor(ids, dtype=torch.int32)
        cm = self.cm
        op = cm.prefetch(ids)
        got = cm.wait_prefetch(op) if op is not None else 0
        h, idx = cm.match_req(ids)
        device = h.cached_len
        h, idx = cm.load_back(h)
        assert self.rows_ok(idx, ids[: h.cached_len]), "a cached row differs from the stored one"
        own = cm.allocate(len(ids) - h.cached_len)
        self.store(own[: len(ids) - h.cached_len], ids[h.cached_len :], h.cached_len)
        cm.free_and_cache_finished_req(h, ids, torch.cat([idx, own]))
        if drain:
            assert cm.drain() == []
        cm.check_integrity()
        self.device += device
        self.storage += min(got, h.cached_len - device)
        self.host += h.cached_len - device - min(got, h.cached_len - device)
        return device, h.cached_len - device, got

    def evict_everything(self):
        cm = self.cm
        cm.drain()
        cm.make_room(cm.num_pages * PAGE)
        tier = cm._tiers.host
        tier.free_host_slots(tier.num_pages * PAGE, all_or_nothing=False)
        cm.check_integrity()

    def close(self):
        self.cm.close()


def prompt(seed, pages, tail=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (pages * PAGE + tail,), generator=g, dtype=torch.int32)


def host_pool(pages=8):
    dev = MHAKVCache(KV.num_kv_heads, KV.num_layers, KV.head_dim, 4, KV.dtype, page_size=PAGE)
    pool = HostKVCache(dev, pages, pin_memory=False)
    g = torch.Generator().manual_seed(0)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(KV.dtype))
    return pool


def keys(n, salt="k"):
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


NOBODY = 65534  # the uid and gid of user nobody (and group nogroup)


def as_nobody(directory, script):
    """Runs Python `script` as another user, nobody (uid and gid 65534, no
    other group): a child that opens `directory` while it still may, as
    `top` (a descriptor, `os` imported), then drops to nobody, so the
    directories above `directory` need not be open to nobody. Needs root
    (CAP_SETUID and CAP_SETGID). Returns the script's output."""
    prelude = (
        "import os, sys\n"
        "top = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
        f"os.setgroups([])\nos.setgid({NOBODY})\nos.setuid({NOBODY})\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script), str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout
