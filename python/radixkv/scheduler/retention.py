"""Retention claims: a prefix kept cached for a while, within a budget.

An agent pauses between turns (a tool call, a user thinking); its next turn
wants the conversation so far back. A claim keeps a prefix's pages on the
device (or at least in host memory) until it is released or its time runs
out. The tree counts claims per node and keeps claimed pages from eviction
(RadixTree.claim); this class keeps the deadlines, the budgets and the
refreshing, for one CacheManager.

Expiry is lazy and exact: deadlines sit in a min-heap, and every manager call
that may evict (or that reports what is claimed) first ends the claims whose
deadline has passed, in O(log n) each. No thread, no scan: a claim past its
deadline is never honoured, and one before it always is. A claim's `active`
reads the clock itself, so it is never stale.

A claim is admitted before anything changes: its cost is found by a walk of
the tree that stamps no LRU time (`RadixTree.prefix_claim_cost`), so a claim
refused for the budget, or whose clock fails, leaves the eviction order as it
was; only then is the prefix matched and claimed.
"""

from __future__ import annotations

import heapq
from typing import Callable, Dict, List, Optional, Tuple, cast


from radixkv._checks import as_count, as_flag, as_int32, as_seconds
from radixkv import _core

TIERS = ("device", "host")


class RetainBudgetError(_core.OutOfCapacityError):
    """A claim would hold more tokens than the manager's (or its namespace's)
    retention budget allows. Nothing was claimed."""


class RetentionClaim:
    """What `CacheManager.retain` returns: a claim on a cached prefix.

    `tokens` is the prefix's length (whole pages), `tier` where it is kept
    ("device", or "host": at least in host memory), `expires_at` the clock
    time it ends at (None: only `release` ends it), moved forward on each
    hit when `refresh_on_hit`. `active` is False once it was released or
    dropped by a reset, or once the manager's clock, read when `active` is,
    has reached `expires_at`.
    """

    __slots__ = (
        "namespace",
        "tokens",
        "tier",
        "ttl_s",
        "priority",
        "refresh_on_hit",
        "expires_at",
        "_copy",
        "_ns",
        "_active",
        "_owner",
    )

    def __init__(self, owner, copy, ns: int, namespace, tier: str, ttl_s, priority, refresh):
        self._owner = owner
        self._copy = copy
        self._ns = ns
        self._active = True
        self.namespace = namespace
        self.tokens: int = copy.end
        self.tier: str = tier
        self.ttl_s: Optional[float] = ttl_s
        self.priority: int = priority
        self.refresh_on_hit: bool = refresh
        self.expires_at: Optional[float] = None

    @property
    def active(self) -> bool:
        """Whether the claim holds now, by the manager's clock (read here; a
        clock that raises raises here). Changes nothing: a claim past its
        deadline keeps its pages only until the manager's next call that may
        evict, which ends it first."""
        if not self._active:
            return False
        return self.expires_at is None or self._owner.clock() < self.expires_at

    def __repr__(self) -> str:
        state = "active" if self._active else "ended"
        return (
            f"RetentionClaim(tokens={self.tokens}, tier={self.tier!r}, "
            f"expires_at={self.expires_at}, {state})"
        )


class Retention:
    """The claims of one CacheManager: their deadlines, budgets and refreshing."""

    def __init__(
        self,
        tree: _core.RadixTree,
        budget: int,
        clock: Callable[[], float],
        host_tier: bool = False,
    ) -> None:
        self.tree = tree
        self.host_tier = host_tier  # whether tier="host" claims can be kept
        self.clock = clock
        self.budget = budget
        self.ns_budgets: Dict[int, int] = {}
        self.claimed_by_ns: Dict[int, int] = {}
        self._live: Dict[int, RetentionClaim] = {}  # id(claim) -> claim
        # (deadline, seq, claim), one entry a claim: a refresh moves only the
        # claim's expires_at, and expire() puts the entry right when it comes up.
        self._deadlines: List[Tuple[float, int, RetentionClaim]] = []
        self._seq = 0
        # node id -> the live refresh_on_hit claims that end at it
        self._refreshing: Dict[int, List[RetentionClaim]] = {}
        self.made = self.refused = self.expired = self.released = self.refreshed = 0
        self.ended = 0  # claims ended in any way (released, expired, reset)

    def require(self, what: str) -> "Retention":
        """These claims, for the call `what` (NoRetention refuses it)."""
        return self

    def set_budget(self, tokens, ns: Optional[int]) -> None:
        """Sets the most tokens the claims of namespace `ns` may hold together
        (`tokens` None: no budget of its own), or with `ns` None the
        manager's budget for all claims."""
        if ns is None:
            if tokens is None:
                raise ValueError("tokens must be a count for the whole manager's budget")
            self.budget = as_count(tokens, "tokens", minimum=0)
        elif tokens is None:
            self.ns_budgets.pop(ns, None)
        else:
            self.ns_budgets[ns] = as_count(tokens, "tokens", minimum=0)

    def held(self) -> int:
        """Tokens that at least one claim holds (after ending the claims
        whose time is up)."""
        self.expire()
        return self.tree.claimed_size

    # -- claims -----------------------------------------------------------------

    def check_args(
        self, ttl_s, tier, priority, refresh_on_hit
    ) -> Tuple[Optional[float], int, bool]:
        """`CacheManager.retain`'s arguments, checked: (ttl, priority, refresh)."""
        ttl = as_seconds(ttl_s, "ttl_s", positive=True, optional=True)
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        if tier == "host" and not self.host_tier:
            raise ValueError('tier="host" needs a host tier (host_num_pages > 0)')
        return ttl, as_int32(priority, "priority"), as_flag(refresh_on_hit, "refresh_on_hit")

    def admit(self, input_ids, ns: Optional[int], namespace, tier: str, ttl_s) -> Optional[float]:
        """Checks that a claim of the cached prefix of `input_ids` in the
        namespace of id `ns` (None: a name not remembered, which has nothing
        cached) fits the budgets, and reads the clock for its deadline, which
        it returns (None without `ttl_s`). Raises RetainBudgetError, or what
        the clock raises, having changed nothing but ended the claims whose
        time was up: the cost is found without a match. The arguments are
        checked by the manager."""
        self.expire()
        deadline = None if ttl_s is None else float(self.clock()) + ttl_s
        cost = 0
        if ns is not None:
            cost = self.tree.prefix_claim_cost(input_ids, ns, tier == "host")
        if self.tree.claimed_size + cost > self.budget:
            self.refused += 1
            raise RetainBudgetError(
                f"cannot retain {cost} more tokens: claims hold {self.tree.claimed_size} of "
                f"the manager's retain budget of {self.budget} tokens"
            )
        ns_budget = None if ns is None else self.ns_budgets.get(ns)
        held = 0 if ns is None else self.claimed_by_ns.get(ns, 0)
        if ns_budget is not None and held + cost > ns_budget:
            self.refused += 1
            raise RetainBudgetError(
                f"cannot retain {cost} more tokens in namespace {namespace!r}: its claims hold "
                f"{held} of its retain budget of {ns_budget} tokens"
            )
        return deadline

    def claim(
        self,
        input_ids,
        ns: int,
        namespace,
        tier: str,
        ttl_s,
        deadline: Optional[float],
        priority: int,
        refresh: bool,
    ) -> RetentionClaim:
        """Claims the match of `input_ids` in namespace `ns` (its device
        part, or the whole match for tier "host"), which `admit` let in, with
        the deadline it returned."""
        handle, _ = self.tree.match_prefix(input_ids, ns)
        copy, added = self.tree.claim(handle, tier == "host", priority)
        self.claimed_by_ns[ns] = self.claimed_by_ns.get(ns, 0) + added
        claim = RetentionClaim(self, copy, ns, namespace, tier, ttl_s, priority, refresh)
        self._live[id(claim)] = claim
        if deadline is not None:
            self._arm(claim, deadline)
            if refresh:
                self._refreshing.setdefault(copy.node_id, []).append(claim)
        self.made += 1
        return claim

    def release(self, claim: RetentionClaim) -> bool:
        """Ends `claim` (one of this manager's: TypeError or ValueError
        otherwise); False if it had ended already (released, expired or
        reset)."""
        if not isinstance(claim, RetentionClaim):
            raise TypeError(
                f"claim must be a RetentionClaim from retain, got {type(claim).__name__}"
            )
        if claim._owner is not self:
            raise ValueError("claim was made by another cache manager")
        self.expire()
        if not claim._active:
            return False
        self._end(claim)
        self.released += 1
        return True

    def _end(self, claim: RetentionClaim) -> None:
        freed = self.tree.release_claim(claim._copy)
        claim._active = False
        self.ended += 1
        del self._live[id(claim)]
        held = self.claimed_by_ns.get(claim._ns, 0) - freed
        if held:
            self.claimed_by_ns[claim._ns] = held
        else:
            self.claimed_by_ns.pop(claim._ns, None)
        if claim.refresh_on_hit and claim.ttl_s is not None:
            ending = self._refreshing[claim._copy.node_id]
            ending.remove(claim)
            if not ending:
                del self._refreshing[claim._copy.node_id]

    def _arm(self, claim: RetentionClaim, deadline: float) -> None:
        claim.expires_at = deadline
        self._seq += 1
        heapq.heappush(self._deadlines, (deadline, self._seq, claim))

    # -- time -------------------------------------------------------------------

    def expire(self) -> int:
        """Ends every claim whose deadline has passed; returns how many. A
        claim has one entry in the heap: one whose deadline a refresh moved
        goes back in at its new deadline when the old one comes up."""
        heap = self._deadlines
        if not heap:
            return 0
        now = self.clock()
        ended = 0
        while heap and heap[0][0] <= now:
            deadline, _, claim = heapq.heappop(heap)
            if not claim._active:
                continue
            if claim.expires_at is not None and claim.expires_at > deadline:
                self._arm(claim, claim.expires_at)  # refreshed since
                continue
            self._end(claim)
            ended += 1
        self.expired += ended
        return ended

    def hit(self, handle) -> None:
        """A match ended at `handle`: the refresh_on_hit claims it covered to
        their end run for their ttl again from now (those whose time is up
        end first, unrefreshed)."""
        self.expire()
        now = self.clock()
        for node in self.tree.claimed_path(handle):
            for claim in self._refreshing.get(node, ()):
                claim.expires_at = now + cast(float, claim.ttl_s)  # its entry follows lazily
                self.refreshed += 1

    @property
    def refreshing(self) -> bool:
        return bool(self._refreshing)

    @property
    def timed(self) -> bool:
        """Whether a claim has a deadline (else `expire` has nothing to end)."""
        return bool(self._deadlines)

    # -- whole-manager ----------------------------------------------------------

    def release_all(self) -> None:
        """Ends every claim (a reset drops what they hold)."""
        for claim in list(self._live.values()):
            self._end(claim)
        self._deadlines.clear()

    @property
    def claims(self) -> int:
        return len(self._live)

    def figures(self) -> dict:
        """The claims' part of `CacheMetrics` (after ending those whose time is up)."""
        self.expire()
        return dict(
            retain_claims_made=self.made,
            retain_claims_refused=self.refused,
            retain_claims_expired=self.expired,
            retain_claims=len(self._live),
            retained_tokens=self.tree.claimed_size,
        )

    def check(self) -> None:
        """The per-namespace sums against the tree's total."""
        total = sum(self.claimed_by_ns.values())
        if total != self.tree.claimed_size:
            raise _core.IntegrityError(
                f"retention claims count {total} tokens by namespace but the tree "
                f"{self.tree.claimed_size}"
            )


class NoRetention:
    """Retention claims of a prefix cache that keeps nothing (the naive
    cache): none is ever held, and a call that makes or changes one raises
    TypeError naming it."""

    claims = ended = 0
    refreshing = timed = False

    def __init__(self, cache) -> None:
        self._cache = cache

    def require(self, what: str) -> Retention:
        raise TypeError(f"{what} needs the radix cache (type='radix'), not {self._cache!r}")

    def expire(self) -> int:
        return 0

    def held(self) -> int:
        return 0

    def hit(self, handle) -> None:
        pass

    def release_all(self) -> None:
        pass

    def figures(self) -> dict:
        return {}

    def check(self) -> None:
        pass


def check_retention_args(retain_budget_tokens, clock) -> None:
    """CacheManager's arguments of the claims: a count (or None) and a
    callable (or None)."""
    if retain_budget_tokens is not None:
        as_count(retain_budget_tokens, "retain_budget_tokens", minimum=0)
    if clock is not None and not callable(clock):
        raise TypeError(f"clock must be callable (or None), got {type(clock).__name__}")
