"""RadixkvConnector step by step under vLLM 0.32's own scheduler (sync, and
async: step N+1 planned before step N's output returns), its worker side
over a toy model whose every value depends on the one before it: every
block loaded, every valid host page and every store page must hold the
true values. The cases are a review's: a block evicted from the store
between the match and the load, with chunked prefill planning the next
step over it; the request aborted in that window; a preempted request and
a new one loading through the same host page in one step.

Not named test_*.py: it runs in the vLLM venv beside vLLM's own tests
(run.sh names it), never in `pytest tests/engines`, which starts servers."""

import os
import time

import pytest

from connector_sim import Sim, add

HOST = 64 << 20
A = list(range(1, 161))  # 10 blocks of 16
B = A[:64] + [3] * 96  # shares A's first 4 blocks


def forget(sim):
    """vLLM's prefix cache and radixkv's host tier forget: loads come from the store."""
    sim.sched.reset_prefix_cache()
    if sim.sc.index is not None:
        for name, page in list(sim.sc.index._pages.items()):
            sim.sc.index.drop(name, page)


def evict_on_first_load(sim):
    """The store loses the second block of the first load planned, after
    the match and before the load."""
    lost = []

    def hook(sim, so, meta):
        if meta.loads:
            os.unlink(sim.wc.storage.backend.path(meta.loads[0].names[1]))
            lost.append(meta.loads[0].req_id)
            sim.hook_before_load = None

    sim.hook_before_load = hook
    return lost


@pytest.mark.parametrize("host", [0, HOST])
def test_saved_blocks_come_back_true_from_host_or_store(host):
    sim = Sim(host_bytes=host)
    add(sim, "a", A)
    sim.run_sync()
    forget(sim) if not host else sim.sched.reset_prefix_cache()
    add(sim, "b", A + [5] * 20)
    sim.run_sync()
    sim.check_store([A])
    sim.check_host([A])
    assert not sim.problems, sim.problems
    source = "loaded from host" if host else "loaded from store"
    assert sim.wc.moved[source] == 10, dict(sim.wc.moved)  # all of A's 10 blocks


@pytest.mark.parametrize("host", [0, HOST])
@pytest.mark.parametrize("async_sched", [False, True])
def test_nothing_computed_over_a_failed_load_is_saved(host, async_sched):
    sim = Sim(host_bytes=host, async_sched=async_sched)
    add(sim, "a", A)
    sim.run_async() if async_sched else sim.run_sync()
    forget(sim)
    lost = evict_on_first_load(sim)
    add(sim, "b", B)

    def check(sim, step, so):  # the store is right after every step the worker ran
        sim.check_store([B])

    sim.run_async(between=check) if async_sched else sim.run_sync()
    sim.check_store([A, B])
    sim.check_host([A, B])
    assert lost == ["b"] and sim.wc.moved["failed to load"] > 0, dict(sim.wc.moved)
    assert not sim.problems, sim.problems[:3]


@pytest.mark.parametrize("host", [0, HOST])
def test_a_request_aborted_after_a_failed_load_leaves_nothing_wrong(host):
    from vllm.v1.request import RequestStatus

    sim = Sim(host_bytes=host, async_sched=True)
    add(sim, "a", A)
    sim.run_async()
    forget(sim)
    lost = evict_on_first_load(sim)
    add(sim, "b", B)

    def abort(sim, step, so):
        if step == 2:
            sim.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)

    sim.run_async(between=abort)
    sim.check_store([B])
    sim.check_host([B])
    # A later prompt refills B's lost block, then one reads all of B's blocks.
    forget(sim)
    add(sim, "d", B[:129])
    sim.run_async()
    forget(sim)
    add(sim, "e", B + [4] * 40)
    sim.run_async()
    assert lost == ["b"] and sim.wc.moved["loaded from store"] > 0, dict(sim.wc.moved)
    assert not sim.problems, sim.problems[:3]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_load_reads_the_host_page_another_load_of_the_step_fills(prefix_caching):
    """One host page. r saves X, w's block takes the page; r is preempted
    and a new request n with X arrives: r's resumed load takes the page for
    X from the store, then n finds X on that page. n is listed first in the
    step, so the page must be filled before any load copies from it."""
    sim = Sim(host_bytes=128, num_blocks=64, prefix_caching=prefix_caching)
    assert sim.sc.host_pages == 1
    x = list(range(1, 17))
    r = add(sim, "r", x + [50], max_tokens=60)
    for _ in range(3):
        sim.step_sync()
    add(sim, "w", list(range(500, 517)), max_tokens=1)
    for _ in range(3):
        sim.step_sync()
    sim.sched.running.remove(r)
    sim.sched._preempt_request(r, time.time())  # what vLLM does under memory pressure
    add(sim, "n", x + [60], max_tokens=2)
    so = sim.sched.schedule()
    loads = [(m.req_id, m.in_host) for m in so.kv_connector_metadata.loads]
    if not prefix_caching:  # with it, n hits r's new blocks in vLLM's own cache
        assert loads == [("n", [True]), ("r", [False])], loads
    sim.sched.update_from_output(so, sim.execute(so))
    sim.run_sync()
    assert not sim.problems, sim.problems
