"""Per-tier accounting in CacheManager.metrics: each hit attributed to the
tier that serves it at match time, the tiers' hits summing to the total, and
every slot of each pool in exactly one gauge, after every step."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import radixkv
from radixkv.scheduler import RetainBudgetError
from radixkv.storage import FileStorage
from storage_env import PAGE, Instance, fingerprint, prompt


def check_sums(cm, matched: int) -> None:
    """The invariants the metrics keep at every moment."""
    m = cm.metrics
    assert m.hit_tokens == m.device_hit_tokens + m.host_hit_tokens + m.storage_hit_tokens
    assert m.hit_tokens == matched  # what the matches handed out, counted apart
    device = m.device_free_tokens + m.device_cached_tokens + m.device_held_tokens
    assert device + m.device_loading_tokens == m.device_capacity_tokens
    host = m.host_free_tokens + m.host_cached_tokens + m.host_backing_up_tokens
    assert host + m.host_reading_tokens == m.host_capacity_tokens
    assert 0 <= m.device_locked_tokens <= m.device_cached_tokens
    assert 0 <= m.host_only_tokens <= m.host_cached_tokens
    assert 0 <= m.host_storage_writing_tokens <= m.host_cached_tokens
    assert m.retained_tokens <= m.device_cached_tokens + m.host_only_tokens


def test_storage_hits_are_the_storage_tiers_until_the_pages_reach_the_device(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    b = Instance(FileStorage(str(tmp_path), fingerprint()))
    ids = prompt(1, 6)
    a.serve(ids)
    cm = b.cm
    op = cm.prefetch(ids)
    assert cm.wait_prefetch(op) == 6 * PAGE
    handle = cm.match_req(ids)[0]
    assert (handle.cached_len, handle.host_hit_len) == (0, 6 * PAGE)
    m = cm.metrics
    assert (m.device_hit_tokens, m.host_hit_tokens, m.storage_hit_tokens) == (0, 0, 6 * PAGE)
    # Matched again before anything loads it: still storage's pages.
    cm.match_req(ids)
    assert cm.metrics.storage_hit_tokens == 12 * PAGE
    handle, idx = cm.load_back(cm.match_req(ids)[0])
    assert cm.metrics.storage_hit_tokens == 18 * PAGE
    cm.unlock(handle)
    cm.drain()
    # Loaded: a device hit now, and once evicted to host, a host hit.
    cm.match_req(ids)
    assert cm.metrics.device_hit_tokens == 6 * PAGE
    cm.make_room(cm.num_pages * PAGE)
    handle = cm.match_req(ids)[0]
    assert handle.host_hit_len == 6 * PAGE
    m = cm.metrics
    assert (m.host_hit_tokens, m.storage_hit_tokens) == (6 * PAGE, 18 * PAGE)
    check_sums(cm, 30 * PAGE)
    a.close(), b.close()


def test_the_replays_split_is_the_managers(tmp_path):
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "radixkv", "replay", "--json", "--sessions", "120"]
        + ["--capacity-tokens", "4096", "--instances", "2", "--kv", "1,1,4"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    r = json.loads(out)
    assert r["storage_hit_tokens"] > 0 and r["host_hit_tokens"] > 0
    for inst in r["instances"]:
        m = inst["cache_metrics"]
        for key in ("hit_tokens", "device_hit_tokens", "host_hit_tokens", "storage_hit_tokens"):
            assert m[key] == inst[key], key
    for key in ("hit_tokens", "storage_hit_tokens", "device_capacity_tokens"):
        assert r["cache_metrics"][key] == sum(i["cache_metrics"][key] for i in r["instances"])


step = st.one_of(
    st.tuples(st.just("serve"), st.integers(0, 7), st.integers(1, 5)),
    st.tuples(st.just("hold"), st.integers(1, 6)),
    st.tuples(st.just("free"), st.integers(0, 9)),
    st.tuples(st.just("retain"), st.integers(0, 7), st.sampled_from(["device", "host"])),
    st.tuples(st.just("release"), st.integers(0, 9)),
    st.tuples(st.just("evict"), st.integers(1, 12)),
    st.tuples(st.just("check"), st.sampled_from(["writing", "loading", "storage", "drain"])),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=30))
def test_the_sums_hold_after_every_step(tmp_path_factory, steps):
    root = tmp_path_factory.mktemp("store")
    other = Instance(FileStorage(str(root), fingerprint()), pages=16, host_pages=32)
    for seed in range(0, 8, 2):  # another instance fills the store
        other.serve(prompt(seed, 3))
    other.evict_everything()
    other.close()
    inst = Instance(FileStorage(str(root), fingerprint()), pages=16, host_pages=32)
    cm = inst.cm
    matched, held, claims = 0, [], []
    check_sums(cm, matched)
    for s in steps:
        kind = s[0]
        if kind == "serve":
            ids = prompt(s[1], s[2])
            op = cm.prefetch(ids)
            if op is not None:
                cm.wait_prefetch(op)
            h, idx = cm.match_req(ids)
            matched += h.cached_len + h.host_hit_len
            check_sums(cm, matched)
            try:
                h, idx = cm.load_back(h)  # locks what it returns
            except radixkv.OutOfCapacityError:
                continue  # nothing locked, nothing changed
            try:
                own = cm.allocate(len(ids) - h.cached_len)
            except radixkv.OutOfCapacityError:
                cm.unlock(h)
            else:
                cm.free_and_cache_finished_req(h, ids, torch.cat([idx, own]))
        elif kind == "hold":
            try:
                held.append(cm.allocate(s[1] * PAGE))
            except radixkv.OutOfCapacityError:
                pass
        elif kind == "free" and held:
            cm.free(held.pop(s[1] % len(held)))
        elif kind == "retain":
            try:
                claims.append(cm.retain(prompt(s[1], 5), tier=s[2]))
            except RetainBudgetError:
                pass
        elif kind == "release" and claims:
            cm.release(claims.pop(s[1] % len(claims)))
        elif kind == "evict":
            try:
                cm.make_room(s[1] * PAGE)
            except radixkv.OutOfCapacityError:
                pass
        elif kind == "check":
            if s[1] == "writing":
                cm.writing_check()
            elif s[1] == "loading":
                cm.loading_check()
            elif s[1] == "storage":
                cm.storage_check()
            else:
                cm.drain()
        check_sums(cm, matched)
        cm.check_integrity()
    for slots in held:
        cm.free(slots)
    cm.drain()
    check_sums(cm, matched)
    inst.close()
