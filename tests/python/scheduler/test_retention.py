"""Retention claims (CacheManager.retain / release): what they keep, for how
long, within which budget, on which tier, and against a model of claims."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import radixkv
from radixkv.scheduler import CacheManager
from radixkv.scheduler.retention import RetainBudgetError, RetentionClaim


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ids(*values):
    return torch.tensor(values, dtype=torch.int32)


def serve(cm, tokens):
    """One request through the manager: match, allocate, finish and cache."""
    tokens = torch.as_tensor(tokens, dtype=torch.int32)
    handle, cached = cm.match_req(tokens)
    cm.lock(handle)
    own = cm.allocate(len(tokens) - len(cached))
    cm.free_and_cache_finished_req(handle, tokens, torch.cat([cached, own]))
    return handle.cached_len


def cached_len(cm, tokens):
    tokens = torch.as_tensor(list(tokens) + [0], dtype=torch.int32)
    return cm.match_req(tokens)[0].cached_len


def fill(cm, first, n, length):
    """n requests of `length` fresh tokens from `first` on."""
    for i in range(n):
        serve(cm, range(first + i * length, first + (i + 1) * length))


def test_a_claim_keeps_its_prefix_through_eviction():
    cm = CacheManager(16, 4)  # 64 tokens
    prompt = list(range(1000, 1016))
    serve(cm, prompt)
    claim = cm.retain(prompt)
    assert isinstance(claim, RetentionClaim) and claim.tokens == 16 and claim.active
    fill(cm, 0, 12, 16)  # far more than fits
    assert cached_len(cm, prompt) == 16
    cm.check_integrity()
    assert cm.release(claim) is True
    assert cm.release(claim) is False
    fill(cm, 5000, 4, 16)
    assert cached_len(cm, prompt) == 0  # without the claim it goes, as LRU says
    cm.check_integrity()


def test_expiry_is_exact_on_the_managers_clock():
    clock = Clock()
    cm = CacheManager(8, 4, clock=clock, retain_budget_tokens=16)
    prompt = list(range(100, 116))
    serve(cm, prompt)
    claim = cm.retain(prompt, ttl_s=10.0)
    assert claim.expires_at == 10.0
    clock.now = 9.999
    with pytest.raises(radixkv.OutOfCapacityError):
        cm.allocate(32)  # 16 free + 16 claimed: the claim holds
    assert claim.active and cm.retained_tokens == 16
    clock.now = 10.0
    cm.allocate(32)  # the claim ended at its deadline, before the eviction
    assert not claim.active and cm.retained_tokens == 0
    assert cm.metrics.retain_claims_expired == 1
    cm.check_integrity()


@pytest.mark.parametrize("pages", [False, True])
def test_an_allocation_with_free_pages_to_spare_still_ends_a_claim_whose_time_is_up(pages):
    clock = Clock()
    cm = CacheManager(8, 4, clock=clock, retain_budget_tokens=16)
    prompt = list(range(100, 116))
    serve(cm, prompt)
    claim = cm.retain(prompt, ttl_s=10.0)
    allocate = cm.allocate_pages if pages else cm.allocate
    clock.now = 9.999
    held = allocate(4)  # one of the 4 free pages: no eviction needed
    assert claim.active
    clock.now = 10.0
    held = torch.cat([held, allocate(4)])  # still no eviction: the claim ends anyway
    assert not claim.active and cm.retained_tokens == 0
    assert cm.metrics.retain_claims_expired == 1
    (cm.release_pages if pages else cm.free)(held)
    cm.check_integrity()


def test_refresh_on_hit_needs_a_match_of_the_whole_prefix():
    clock = Clock()
    cm = CacheManager(32, 4, clock=clock)
    prompt = list(range(100, 132))
    serve(cm, prompt)
    claim = cm.retain(prompt, ttl_s=10.0, refresh_on_hit=True)
    clock.now = 5.0
    cm.match_req(ids(*prompt[:16], 7))  # covers half of it: no refresh
    assert claim.expires_at == 10.0
    cm.match_req_batch([ids(*prompt, 1, 2)])  # covers it: runs again from now
    assert claim.expires_at == 15.0
    clock.now = 14.0
    cm.match_req(ids(*prompt, 9))
    assert claim.expires_at == 24.0
    plain = cm.retain(prompt[:8], ttl_s=3.0)  # no refresh: ends at 17 whatever matches
    assert plain.expires_at == 17.0
    clock.now = 16.0
    cm.match_req(ids(*prompt, 9))
    assert claim.expires_at == 26.0 and plain.expires_at == 17.0
    clock.now = 17.0
    assert cm.retained_tokens == 32 and claim.active and not plain.active
    clock.now = 26.0
    assert cm.retained_tokens == 0 and not claim.active
    cm.check_integrity()


def test_budgets_count_shared_tokens_once_and_refuse_changing_nothing():
    cm = CacheManager(64, 4, retain_budget_tokens=40)
    system = list(range(100, 124))  # 24 tokens shared by two sessions
    a, b, c = system + [1] * 8, system + [2] * 8, system + [3] * 12
    for x in (a, b, c):
        serve(cm, x)
    cm.retain(a)
    cm.retain(b)
    assert cm.retained_tokens == 40  # 24 + 8 + 8, not 64
    before = cm.manager.size_info
    with pytest.raises(RetainBudgetError, match="retain budget of 40"):
        cm.retain(c)  # 12 more
    assert cm.retained_tokens == 40 and cm.manager.size_info == before
    assert cm.metrics.retain_claims_refused == 1
    assert isinstance(RetainBudgetError("x"), radixkv.OutOfCapacityError)
    cm.check_integrity()


def test_a_namespace_budget_caps_that_namespace_only():
    cm = CacheManager(64, 4)
    for ns in ("tenant-a", "tenant-b"):
        serve_ns(cm, list(range(200, 232)), ns)
    cm.set_retain_budget(16, namespace="tenant-a")
    with pytest.raises(RetainBudgetError, match="tenant-a"):
        cm.retain(list(range(200, 232)), namespace="tenant-a")
    cm.retain(list(range(200, 216)), namespace="tenant-a")
    cm.retain(list(range(200, 232)), namespace="tenant-b")
    assert cm.retained_tokens == 48
    cm.set_retain_budget(None, namespace="tenant-a")
    cm.retain(list(range(200, 232)), namespace="tenant-a")
    assert cm.retained_tokens == 64
    cm.set_retain_budget(64, whole=True)
    cm.check_integrity()


def serve_ns(cm, tokens, ns):
    tokens = torch.as_tensor(tokens, dtype=torch.int32)
    handle, cached = cm.match_req(tokens, namespace=ns)
    cm.lock(handle)
    own = cm.allocate(len(tokens) - len(cached))
    cm.free_and_cache_finished_req(handle, tokens, torch.cat([cached, own]))


def test_claims_never_starve_admission():
    cm = CacheManager(16, 4, retain_budget_tokens=32)  # half the pool
    for i in range(4):
        prompt = list(range(i * 100, i * 100 + 16))
        serve(cm, prompt)
        try:
            cm.retain(prompt)
        except RetainBudgetError:
            assert cm.retained_tokens == 32
    assert cm.available_size >= 64 - 32
    slots = cm.allocate(32)  # what the budget leaves always fits
    cm.free(slots)
    cm.check_integrity()


def test_host_claim_keeps_the_prefix_in_host_memory():
    cm = CacheManager(16, 4, host_num_pages=32, write_policy="write_through")
    prompt = list(range(100, 116))
    serve(cm, prompt)
    cm.writing_check()
    claim = cm.retain(prompt, tier="host")
    fill(cm, 0, 40, 16)  # presses both tiers
    cm.drain()
    handle = cm.match_req(ids(*prompt, 0))[0]
    assert handle.cached_len + handle.host_hit_len == 16
    cm.check_integrity()
    cm.release(claim)
    fill(cm, 9000, 40, 16)
    cm.drain()
    handle = cm.match_req(ids(*prompt, 0))[0]
    assert handle.cached_len + handle.host_hit_len == 0
    cm.check_integrity()


def test_host_claim_without_a_host_copy_stays_on_the_device_and_counts_as_protected():
    cm = CacheManager(16, 4, host_num_pages=16, write_policy="write_back")
    prompt = list(range(100, 116))
    serve(cm, prompt)
    cm.retain(prompt, tier="host")
    assert cm.manager.size_info.evictable_size == 0  # nothing may leave without a copy
    fill(cm, 0, 6, 16)
    handle = cm.match_req(ids(*prompt, 0))[0]
    assert handle.cached_len + handle.host_hit_len == 16
    cm.check_integrity()


def test_reset_drops_claims_but_not_while_a_request_holds_a_lock():
    cm = CacheManager(16, 4)
    prompt = list(range(100, 116))
    serve(cm, prompt)
    claim = cm.retain(prompt)
    handle = cm.match_req(ids(*prompt, 0))[0]
    cm.lock(handle)
    with pytest.raises(RuntimeError, match="locks"):
        cm.reset()
    assert claim.active and cm.retained_tokens == 16
    cm.unlock(handle)
    cm.reset()
    assert not claim.active and cm.retained_tokens == 0
    assert cm.release(claim) is False
    cm.check_integrity()


def test_bad_arguments_name_themselves():
    cm = CacheManager(16, 4)
    other = CacheManager(16, 4)
    serve(cm, range(16))
    with pytest.raises(ValueError, match="ttl_s"):
        cm.retain(list(range(16)), ttl_s=0)
    with pytest.raises(ValueError, match="ttl_s"):
        cm.retain(list(range(16)), ttl_s=float("inf"))
    with pytest.raises(TypeError, match="ttl_s"):
        cm.retain(list(range(16)), ttl_s="10")
    with pytest.raises(ValueError, match="tier"):
        cm.retain(list(range(16)), tier="disk")
    with pytest.raises(ValueError, match="host tier"):
        cm.retain(list(range(16)), tier="host")
    with pytest.raises(ValueError, match="priority"):
        cm.retain(list(range(16)), priority=2**31)
    with pytest.raises(TypeError, match="claim"):
        cm.release("claim")
    with pytest.raises(ValueError, match="another cache manager"):
        other.release(cm.retain(list(range(16))))
    with pytest.raises(ValueError, match="retain_budget_tokens"):
        CacheManager(16, 4, retain_budget_tokens=-1)
    with pytest.raises(TypeError, match="clock"):
        CacheManager(16, 4, clock=3)
    with pytest.raises(TypeError, match="radix"):
        CacheManager(16, 4, type="naive").retain(list(range(16)))
    assert cm.retained_tokens == 16
    cm.check_integrity()


def test_metrics_and_prometheus_carry_the_claims():
    cm = CacheManager(16, 4)
    serve(cm, range(16))
    cm.retain(list(range(16)))
    m = cm.metrics
    assert (m.retain_claims, m.retained_tokens, m.retain_claims_made) == (1, 16, 1)
    text = m.prometheus()
    assert "radixkv_retained_tokens 16" in text
    assert "radixkv_retain_claims_made_total 1" in text


# -- against a model ------------------------------------------------------------

PAGE = 4
op = st.one_of(
    st.tuples(st.just("serve"), st.integers(0, 5), st.integers(1, 6)),
    st.tuples(
        st.just("retain"),
        st.integers(0, 5),
        st.integers(1, 6),
        st.sampled_from([None, 3.0, 7.0]),
        st.booleans(),
    ),
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("tick"), st.sampled_from([1.0, 2.5, 4.0])),
    st.tuples(st.just("allocate"), st.integers(1, 20)),
)


def path(branch, pages):
    """Branches share their first two pages (a system prompt)."""
    tokens = list(range(2 * PAGE))
    for p in range(2, pages + 2):
        tokens += [1000 * (branch + 1) + p * PAGE + j for j in range(PAGE)]
    return tokens[: pages * PAGE + 2 * PAGE]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, max_size=40))
def test_claims_against_a_model(ops):
    clock = Clock()
    cm = CacheManager(24, PAGE, clock=clock, retain_budget_tokens=48)
    live = []  # (claim, tokens tuple, deadline, refresh)
    for o in ops:
        kind = o[0]
        if kind == "serve":
            tokens = path(o[1], o[2])
            hit = cm.match_req(torch.tensor(tokens + [0], dtype=torch.int32))[0]
            for claim, held, deadline, refresh in list(live):
                if refresh and deadline is not None and clock.now < deadline and held:
                    if (
                        len(held) <= hit.cached_len + hit.host_hit_len
                        and tuple(tokens[: len(held)]) == held
                    ):
                        live.remove((claim, held, deadline, refresh))
                        live.append((claim, held, clock.now + claim.ttl_s, refresh))
            try:
                serve(cm, tokens)
            except radixkv.OutOfCapacityError:
                pass
        elif kind == "retain":
            tokens = path(o[1], o[2])
            live = [x for x in live if x[2] is None or clock.now < x[2]]
            try:
                claim = cm.retain(tokens, ttl_s=o[3], refresh_on_hit=o[4])
            except RetainBudgetError:
                assert (
                    model_tokens([x[1] for x in live] + [tuple(tokens[: tree_cached(cm, tokens)])])
                    > 48
                )
                continue
            held = tuple(tokens[: claim.tokens])
            deadline = None if o[3] is None else clock.now + o[3]
            assert claim.expires_at == deadline
            live.append((claim, held, deadline, o[4]))
        elif kind == "release" and live:
            claim, held, deadline, refresh = live[o[1] % len(live)]
            expected = deadline is None or clock.now < deadline
            assert cm.release(claim) is expected
            live = [x for x in live if x[0] is not claim]
        elif kind == "tick":
            clock.now += o[1]
        elif kind == "allocate":
            try:
                cm.free(cm.allocate(o[1] * PAGE))
            except radixkv.OutOfCapacityError:
                pass
        live = [x for x in live if x[2] is None or clock.now < x[2]]
        assert cm.retained_tokens == model_tokens([x[1] for x in live])
        for claim, held, _, _ in live:
            assert claim.active
            assert tree_cached(cm, held) >= len(held)  # kept on the device
        cm.check_integrity()


def tree_cached(cm, tokens):
    """The cached length of `tokens` on the device, asked of the tree (a
    manager's match would refresh the claims it covers)."""
    return cm.manager.tree.match_prefix(torch.tensor(tokens, dtype=torch.int32))[0].cached_len


def model_tokens(prefixes):
    """Distinct tokens of a set of prefixes: the positions of their union trie."""
    seen = set()
    for p in prefixes:
        for k in range(1, len(p) + 1):
            seen.add(p[:k])
    return len(seen)


def test_a_host_claim_without_a_copy_keeps_its_whole_path_and_available_size_exact():
    # The parent has a host copy, the child none (the host pool is full): the
    # child may not leave the device, so neither may the parent.
    cm = CacheManager(8, 4, host_num_pages=2, write_policy="write_through")
    parent = list(range(100, 108))
    serve(cm, parent)
    cm.drain()
    cm.retain(parent, tier="host")
    serve(cm, parent + [200, 201, 202, 203])
    cm.drain()
    cm.retain(parent + [200, 201, 202, 203], tier="host")
    serve(cm, list(range(300, 308)))  # an unrelated leaf that may go
    m = cm.metrics
    assert m.device_locked_tokens == 12
    assert cm.available_size == 32 - 12
    slots = cm.allocate(cm.available_size)  # all it promises
    with pytest.raises(radixkv.OutOfCapacityError):
        cm.allocate(4)
    cm.free(slots)
    cm.check_integrity()


def test_a_refreshed_claim_keeps_one_deadline_entry():
    clock = Clock()
    cm = CacheManager(16, 4, clock=clock)
    serve(cm, list(range(16)))
    claim = cm.retain(list(range(16)), ttl_s=5.0, refresh_on_hit=True)
    for i in range(1000):
        clock.now = i * 0.01
        cm.match_req(ids(*range(16), 99))
    assert claim.expires_at == pytest.approx(9.99 + 5.0)
    assert len(cm._retention._deadlines) == 1
    clock.now = 14.98
    assert claim.active and cm.retained_tokens == 16
    clock.now = 15.0
    assert cm.retained_tokens == 0 and not claim.active


def test_a_failing_clock_claims_nothing():
    def clock():
        raise RuntimeError("no time")

    cm = CacheManager(16, 4, clock=clock)
    serve(cm, list(range(16)))
    with pytest.raises(RuntimeError, match="no time"):
        cm.retain(list(range(16)), ttl_s=5.0)
    assert cm._tree.claimed_size == 0 and cm.manager.size_info.protected_size == 0
    cm.retain(list(range(16)))  # no ttl: no clock needed
    with pytest.raises(TypeError, match="refresh_on_hit"):
        cm.retain(list(range(16)), ttl_s=1.0, refresh_on_hit="no")
    with pytest.raises(TypeError, match="whole"):
        cm.set_retain_budget(8, whole="no")
    cm.check_integrity()


@pytest.mark.parametrize("why", ["budget", "clock"])
def test_a_refused_or_failing_retain_leaves_the_eviction_order_as_it_was(why):
    """A retain that raises (past the budget, or its clock failing) stamps no
    LRU time, counts no hit and splits no node: the next eviction takes what
    it would have taken had the call never been made."""
    clock = Clock()
    cm = CacheManager(12, 4, retain_budget_tokens=8, clock=clock)
    x, y = list(range(100, 117)), list(range(200, 217))
    serve(cm, x)  # 16 tokens cached each, x the least recently used
    serve(cm, y)
    before = cm._tree.dump(tiers=True, namespaces=True)
    if why == "budget":
        with pytest.raises(RetainBudgetError, match="retain budget of 8"):
            cm.retain(x[:12])  # 12 tokens: also a split of x's node, were it matched
    else:

        def broken():
            raise RuntimeError("no time")

        cm._retention.clock = broken
        with pytest.raises(RuntimeError, match="no time"):
            cm.retain(x[:4], ttl_s=5.0)
        cm._retention.clock = clock
    assert cm._tree.dump(tiers=True, namespaces=True) == before
    assert cm.retained_tokens == 0
    cm.allocate(32)  # 4 pages free, 8 wanted: the least recently used 16 tokens go
    assert cached_len(cm, x) == 0 and cached_len(cm, y) == 16
    cm.check_integrity()


def test_a_claims_active_is_true_to_the_managers_clock_when_read():
    """`active` reads the manager's clock: False from the deadline on, with
    no manager call in between, and the read itself changes nothing."""
    clock = Clock()
    cm = CacheManager(8, 4, clock=clock)
    prompt = list(range(100, 116))
    serve(cm, prompt)
    claim = cm.retain(prompt, ttl_s=10.0, refresh_on_hit=True)
    forever = cm.retain(prompt[:8])
    clock.now = 9.5
    assert claim.active
    cm.match_req(ids(*prompt, 0))  # refreshed: until 19.5
    clock.now = 19.4
    assert claim.active and forever.active
    clock.now = 19.5
    assert not claim.active and forever.active
    assert cm._tree.claimed_size == 16  # the read ended nothing: the next call does
    assert cm.retained_tokens == 8 and not claim.active
    assert cm.release(claim) is False and cm.release(forever) is True
    assert not forever.active
    cm.check_integrity()
