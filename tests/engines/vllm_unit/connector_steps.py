"""RadixkvConnector step by step under vLLM 0.32's own scheduler (sync, and
async: step N+1 planned before step N's output returns), its worker half
called as vLLM's model runner calls it, over a toy model whose every value
depends on the one before it: before a request computes, every block it
has must hold the true values (unless its load was reported failed), and
every ready host page and store page must too. The cases: blocks back from
the host tier and from the store; a block lost from the store between the
match and its read; a failed load under both failure policies; a request
aborted while its blocks are read; asynchronous loads; saves still in
flight when their blocks are handed out again; many requests into a small
block pool (preemption).

Not named test_*.py: it runs in the vLLM venv beside vLLM's own tests
(run.sh names it), never in `pytest tests/engines`, which starts servers."""

import os
import random

import pytest

from connector_sim import BS, Sim, add

HOST = 64 << 20
A = list(range(1, 161))  # 10 blocks of 16
B = A[:64] + [3] * 96  # shares A's first 4 blocks


def forget(sim, host=True):
    """vLLM's prefix cache forgets (and radixkv's host tier too, with
    `host`): loads come from the host tier, or from the store."""
    sim.sched.reset_prefix_cache()
    if host:
        sim.sc.reset_cache()


def run(sim, async_sched, **kw):
    sim.run_async(**kw) if async_sched else sim.run_sync(**kw)


def settled(sim):
    """Nothing left planned, pinned or in flight once the engine is idle."""
    assert not sim.sched.has_requests()
    assert not sim.sc._ops and not sim.sc._reqs, (sim.sc._ops, list(sim.sc._reqs))
    assert sim.sc.index.pinned() == 0, sim.sc.index.pinned()


@pytest.mark.parametrize("host", [0, HOST])
@pytest.mark.parametrize("async_sched", [False, True])
def test_saved_blocks_come_back_true_from_host_or_store(host, async_sched):
    sim = Sim(host_bytes=host, async_sched=async_sched)
    add(sim, "a", A)
    run(sim, async_sched)
    forget(sim, host=not host)
    add(sim, "b", A + [5] * 20)
    run(sim, async_sched)
    sim.check_store([A])
    sim.check_host([A])
    assert not sim.problems, sim.problems
    source = "loaded from host" if host else "loaded from store"
    assert sim.wc.moved[source] == 10, dict(sim.wc.moved)  # all of A's 10 blocks
    settled(sim)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_block_lost_from_the_store_before_its_read_is_recomputed(policy):
    """The store loses A's second block after the match asked for it: its
    read fails, only the first block is offered, the request computes the
    rest and succeeds under either policy."""
    sim = Sim(policy=policy)
    add(sim, "a", A)
    sim.run_sync()
    forget(sim)
    lost = []

    def hook(sim, so, meta):
        if meta.prefetches:
            os.unlink(sim.wc.io.backend.path(meta.prefetches[0].names[1]))
            lost.append(meta.prefetches[0].names[1])
            sim.hook_before_load = None

    sim.hook_before_load = hook
    r = add(sim, "b", A + [9] * 20)
    sim.run_sync()
    assert lost and r.status.name == "FINISHED_LENGTH_CAPPED", r.status
    assert sim.wc.moved["store reads failed"] >= 1, dict(sim.wc.moved)
    assert sim.wc.moved["loaded from store"] == 1, dict(sim.wc.moved)
    sim.check_store([A])
    sim.check_host([A])
    assert not sim.problems, sim.problems[:3]
    settled(sim)


class FailFirstLoad:
    """The worker's copy controller, with the first load reported failed and
    its blocks overwritten with garbage (what a failed copy may leave)."""

    def __init__(self, sim):
        self.sim, self.ctl, self.failed = sim, sim.wc.controller, []

    def __getattr__(self, name):
        return getattr(self.ctl, name)

    def load(self, pages, blocks):
        cid = self.ctl.load(pages, blocks)
        if not self.failed:
            self.failed.append((cid, list(blocks)))
        return cid

    def take_load_acks(self):
        acks = self.ctl.take_load_acks()
        out = []
        for cid, ok in acks:
            for fid, blocks in self.failed:
                if cid == fid:
                    ok = False
                    for b in blocks:
                        self.sim.kv[:, b] = 12345.0
            out.append((cid, ok))
        return out


@pytest.mark.parametrize("async_sched", [False, True])
@pytest.mark.parametrize("async_load", [False, True])
def test_nothing_computed_over_a_failed_load_is_served_or_saved(async_sched, async_load):
    extra = {"async_load_blocks": 2 if async_load else 1000}
    sim = Sim(async_sched=async_sched, extra=extra, policy="recompute")
    add(sim, "a", A)
    run(sim, async_sched)
    forget(sim, host=False)  # vLLM forgets; the host tier serves
    sim.wc.controller = FailFirstLoad(sim)
    add(sim, "b", B)
    add(sim, "c", A + [7] * 40)
    run(sim, async_sched)
    assert sim.wc.controller.failed and sim.wc.moved["failed to load"] > 0, dict(sim.wc.moved)
    sim.check_store([A, B, A + [7] * 40])
    sim.check_host([A, B, A + [7] * 40])
    assert not sim.problems, sim.problems[:3]
    settled(sim)


def test_under_the_fail_policy_a_failed_load_fails_its_request_only():
    sim = Sim(policy="fail")
    add(sim, "a", A)
    sim.run_sync()
    forget(sim, host=False)
    sim.wc.controller = FailFirstLoad(sim)
    b = add(sim, "b", A + [5] * 20)
    sim.run_sync()
    assert b.status.name == "FINISHED_ERROR", b.status
    sim.check_host([A])
    forget(sim, host=False)
    c = add(sim, "c", A + [6] * 20)
    sim.run_sync()
    assert c.status.name == "FINISHED_LENGTH_CAPPED"
    assert not sim.problems, sim.problems[:3]
    settled(sim)


@pytest.mark.parametrize("when", ["reading", "loading"])
def test_a_request_aborted_while_its_blocks_move_leaves_nothing_behind(when):
    from vllm.v1.request import RequestStatus

    sim = Sim(extra={"async_load_blocks": 2})
    add(sim, "a", A)
    sim.run_sync()
    forget(sim, host=(when == "reading"))
    add(sim, "b", B)
    aborted = []
    for _ in range(50):
        so = sim.step_sync()
        meta = so.kv_connector_metadata
        if (when == "reading" and meta.prefetches) or (
            when == "loading" and any(m.is_async for m in meta.loads)
        ):
            sim.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
            aborted.append(so)
            break
    assert aborted, "the step never came"
    sim.run_sync()
    add(sim, "d", B + [4] * 40)
    sim.run_sync()
    sim.check_store([A, B])
    sim.check_host([A, B])
    assert not sim.problems, sim.problems[:3]
    settled(sim)


@pytest.mark.parametrize("async_sched", [False, True])
def test_asynchronous_loads_wait_for_their_blocks(async_sched):
    sim = Sim(async_sched=async_sched, extra={"async_load_blocks": 2})
    add(sim, "a", A)
    run(sim, async_sched)
    forget(sim, host=False)
    add(sim, "b", A + [5] * 20)
    add(sim, "c", list(range(500, 600)))  # computes meanwhile
    run(sim, async_sched)
    assert "b" in sim.recved, sim.recved
    assert sim.wc.moved["loaded from host"] == 10, dict(sim.wc.moved)
    assert not sim.problems, sim.problems[:3]
    settled(sim)


def test_saves_in_flight_when_their_blocks_are_handed_out_again():
    """Backups finish only when the test says (a manual copy controller),
    some steps late: the flush before a step whose blocks a save still
    reads makes every host page hold what its block held."""
    from radixkv.kvcache.host_pool import copy_controller

    rng = random.Random(0)
    sim = Sim(num_blocks=24, prefix_caching=False)
    manual = copy_controller(sim.wc.pool, sim.wc.host, manual=True)
    sim.wc.controller = manual
    prompts = [[rng.randrange(1, 900) for _ in range(rng.randrange(40, 120))] for _ in range(10)]
    for i, p in enumerate(prompts):
        add(sim, f"r{i}", p, max_tokens=3)
    for _ in range(400):
        if not sim.sched.has_requests():
            break
        waiting = manual.waiting()
        for cid in waiting:
            if rng.random() < 0.3:  # some copies land now, others steps later
                manual.complete(cid)
        sim.step_sync()
    manual.drain()
    sim.run_sync()
    sim.check_host(prompts)
    sim.check_store(prompts)
    assert not sim.problems, sim.problems[:3]
    settled(sim)


@pytest.mark.parametrize("async_sched", [False, True])
def test_many_requests_into_a_small_block_pool(async_sched):
    """Six conversations of four turns at once into 32 blocks: vLLM
    preempts; loads are asynchronous from 4 blocks."""
    rng = random.Random(1)
    sim = Sim(
        num_blocks=32,
        async_sched=async_sched,
        host_bytes=40 * 2 * BS * 4,  # 40 host pages: the host tier evicts too
        extra={"async_load_blocks": 4},
        batched=128,
    )
    preempted = []
    real = sim.sched._preempt_request

    def preempt(request, *args, **kwargs):
        preempted.append(request.request_id)
        return real(request, *args, **kwargs)

    sim.sched._preempt_request = preempt
    convs = [[rng.randrange(1, 900) for _ in range(48 + 16 * c)] for c in range(6)]
    for turn in range(4):
        for c, ids in enumerate(convs):
            ids += [rng.randrange(1, 900) for _ in range(20)]
            add(sim, f"c{c}t{turn}", list(ids), max_tokens=40)
        run(sim, async_sched, max_steps=2000)
        assert not sim.sched.has_requests()
        forget(sim, host=False) if turn % 2 else None
    assert preempted, "the pool never ran short"
    sim.check_host(convs)
    sim.check_store(convs)
    assert not sim.problems, sim.problems[:3]
    settled(sim)
