"""vLLM 0.32's real Scheduler (or the AsyncScheduler's order: step N+1
planned before step N's output comes back) driving RadixkvConnector's
scheduler half, its worker half over a CPU "KV cache" of one layer called
as vLLM's model runner calls it (handle_preemptions, bind, start_load_kv
before the forward with synchronous loads and after it without,
wait_for_layer_load, wait_for_save, get_finished, the load errors, stats
and the worker metadata), and a toy model whose K/V at position p is
computed from the cached K/V at p - 1, so a wrong block spoils everything
computed after it. Before a request computes, every block it already has
must hold the true values; every ready host page and store page can be
checked against them too. Used by connector_steps.py (run by run.sh, in
the vLLM venv, beside vLLM's own tests: it uses their helpers)."""

import os
import sys
import tempfile
import time

sys.path.insert(
    0,
    os.environ.get("RADIXKV_VLLM_TESTS_DIR")
    or os.path.expanduser("~/.cache/radixkv-engines/vllm-tests-0.32.0"),
)

import torch  # noqa: E402
from tests.v1.kv_connector.unit.utils import (
    create_request,
    create_scheduler,  # noqa: E402
    create_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402

from radixkv.compat.vllm import RadixkvConnector  # noqa: E402

BS = 16
M = 1000003
TOK_OUT = 7


def truth(tokens, upto):
    v, out = 0, []
    for p in range(upto):
        v = (v * 31 + tokens[p] + 1) % M
        out.append(v)
    return out


class Sim:
    def __init__(
        self,
        host_bytes=64 << 20,
        backend="file",
        async_sched=False,
        num_blocks=200,
        batched=64,
        prefix_caching=True,
        directory=None,
        extra=None,
        policy="fail",
    ):
        self.dir = directory or tempfile.mkdtemp(prefix="rkstore")
        config = {"host_bytes": host_bytes, **(extra or {})}
        if backend == "file":
            config.update(backend="file", directory=self.dir)
        else:
            config.update(backend="none")
        cfg = create_vllm_config(
            block_size=BS,
            max_num_batched_tokens=batched,
            kv_connector="RadixkvConnector",
            kv_connector_module_path="radixkv.compat.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=config,
            kv_load_failure_policy=policy,
        )
        cfg.scheduler_config.async_scheduling = async_sched
        cfg.cache_config.enable_prefix_caching = prefix_caching
        self.sched = create_scheduler(cfg, num_blocks=num_blocks)
        self.sc = self.sched.connector.scheduler  # the scheduler half
        self.wconn = RadixkvConnector(cfg, KVConnectorRole.WORKER, self.sched.kv_cache_config)
        self.wc = self.wconn.worker  # the worker half
        self.num_blocks = num_blocks
        self.kv = torch.full((2, num_blocks, BS, 1, 1), -1.0)
        self.wconn.register_kv_caches({"layer": self.kv})
        self.wreqs = {}  # req_id -> [tokens, block_ids]
        self.problems = []
        self.hook_before_load = None
        self.recved = set()  # requests whose asynchronous load was reported

    def tokens_of(self, req_id):
        r = self.sched.requests.get(req_id)
        return list(r.prompt_token_ids) + [TOK_OUT] * 10000

    def _check_prefix(self, rid, upto):
        """The first of blocks [0, upto // BS) of `rid` that does not hold
        the true K/V, as (block id, what went wrong); None if all do."""
        toks, bids = self.wreqs[rid]
        full = upto // BS
        want = truth(toks, full * BS)
        for k in range(full):
            got = self.kv[0, bids[k], :, 0, 0].tolist()
            if got != [float(x) for x in want[k * BS : (k + 1) * BS]]:
                return bids[k], (
                    f"WRONG K/V before compute: req {rid} block#{k} (id {bids[k]}) got "
                    f"{got[:3]} want {want[k * BS : k * BS + 3]}"
                )
        return None

    def execute(self, so):
        conn = self.wconn
        meta = so.kv_connector_metadata
        conn.handle_preemptions(meta)
        for new in so.scheduled_new_reqs:
            self.wreqs[new.req_id] = [
                list(new.prompt_token_ids) + [TOK_OUT] * 10000,
                list(new.block_ids[0]),
            ]
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            nb = c.new_block_ids[i]
            if rid in c.resumed_req_ids:
                self.wreqs[rid][1] = list(nb[0])
            elif nb is not None:
                self.wreqs[rid][1] += nb[0]
        for load in meta.loads:  # an asynchronous load's request is scheduled later
            if load.req_id not in self.wreqs:
                r = self.sched.requests[load.req_id]
                blocks = self.sched.kv_cache_manager.get_block_ids(load.req_id)[0]
                self.wreqs[load.req_id] = [list(r.prompt_token_ids) + [TOK_OUT] * 10000, blocks]
        conn.bind_connector_metadata(meta)
        if self.hook_before_load:
            self.hook_before_load(self, so, meta)
        if so.has_sync_kv_loads:
            conn.start_load_kv(None)
        # toy forward: the layer's loads, then every scheduled token
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        for i, rid in enumerate(c.req_ids):
            computed[rid] = c.num_computed_tokens[i]
        if so.total_num_scheduled_tokens:
            conn.wait_for_layer_load("layer")
        suspect = []  # wrong K/V found before computing: fine only if its load failed
        for rid, n in so.num_scheduled_tokens.items():
            toks, bids = self.wreqs[rid]
            start = computed[rid]
            bad = self._check_prefix(rid, start)
            if bad is not None:
                suspect.append(bad)
            for p in range(start, start + n):
                prev = 0 if p == 0 else int(self.kv[0, bids[(p - 1) // BS], (p - 1) % BS, 0, 0])
                v = (prev * 31 + toks[p] + 1) % M
                self.kv[0, bids[p // BS], p % BS, 0, 0] = v
                self.kv[1, bids[p // BS], p % BS, 0, 0] = -v
        if not so.has_sync_kv_loads:
            conn.start_load_kv(None)
        conn.wait_for_save()
        sending, recving = conn.get_finished(so.finished_req_ids)
        invalid = conn.get_block_ids_with_load_errors()
        self.problems += [why for block, why in suspect if block not in invalid]
        stats = conn.get_kv_connector_stats()
        worker_meta = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        self.recved |= recving or set()
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            r = self.sched.requests.get(rid)
            done = computed[rid] + so.num_scheduled_tokens[rid]
            sampled.append([TOK_OUT] if r is None or done >= r.num_prompt_tokens else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                invalid_block_ids=invalid,
                kv_connector_stats=stats,
                kv_connector_worker_meta=worker_meta,
            ),
        )

    def step_sync(self):
        so = self.sched.schedule()
        out = self.execute(so)
        self.sched.update_from_output(so, out)
        return so

    def run_async(self, max_steps=400, between=None):
        """vLLM's batch queue: schedule N+1 before update_from_output(N)."""
        pending = None
        for step in range(max_steps):
            so = self.sched.schedule() if self.sched.has_requests() else None
            if between:
                between(self, step, so)
            if pending is not None:
                pso, pout = pending
                self.sched.update_from_output(pso, pout)
                pending = None
            if so is None:
                break
            if so.total_num_scheduled_tokens == 0:
                out = self.execute(so)
                self.sched.update_from_output(so, out)
                time.sleep(0.001)  # (the engine's pause on an empty step)
                continue
            pending = (so, self.execute(so))  # the worker runs N before N+1 in any case
        if pending:
            self.sched.update_from_output(*pending)

    def run_sync(self, max_steps=400):
        for _ in range(max_steps):
            if not self.sched.has_requests():
                break
            so = self.step_sync()
            if so.total_num_scheduled_tokens == 0:
                time.sleep(0.001)
        assert not self.sched.has_requests(), "the engine never went idle"

    def names(self, toks):
        r = type("R", (), {"prompt_token_ids": toks, "cache_salt": None, "lora_request": None})()
        return self.sc._names(r)

    def check_store(self, prompts):
        """Every store page of these prompts' names holds the true bytes."""
        from radixkv.storage.staged import StagedStorage

        page_elems = 2 * BS
        st = StagedStorage(
            {"backend": "file", "directory": self.dir}, self.wc.seed, page_elems, torch.float32
        )
        try:
            for toks in prompts:
                names = self.names(toks)
                tr = truth(list(toks), len(names) * BS)
                for i, n in enumerate(names):
                    got = {}

                    def take(j, page, i=i):
                        if page is not None:
                            got[i] = page[:BS].tolist()
                        return True

                    st.read([n], take)
                    if i in got and got[i] != [float(x) for x in tr[i * BS : (i + 1) * BS]]:
                        self.problems.append(
                            f"WRONG BYTES IN STORE: block #{i} got {got[i][:3]} "
                            f"want {tr[i * BS : i * BS + 3]}"
                        )
        finally:
            st.close()

    def check_host(self, prompts):
        """Every ready host page of these prompts' names holds the true bytes."""
        idx = self.sc.index
        if idx is None:
            return
        rows = self.wc.host.kv_buffer.view(self.wc.host_pages, -1)
        for toks in prompts:
            names = self.names(toks)
            tr = truth(list(toks), len(names) * BS)
            for i, n in enumerate(names):
                p = idx.page(n)
                if p is None or not idx.ready(p):
                    continue
                got = rows[p][:BS].tolist()
                if got != [float(x) for x in tr[i * BS : (i + 1) * BS]]:
                    self.problems.append(f"WRONG BYTES IN READY HOST PAGE {p}: block #{i}")


def add(sim, req_id, tokens, max_tokens=2):
    from vllm import SamplingParams
    from vllm.v1.request import Request
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.utils.hashing import sha256

    create_request(num_tokens=1)  # init none-hash
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, 999999)
    r = Request(
        request_id=req_id,
        prompt_token_ids=list(tokens),
        sampling_params=sp,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )
    sim.sched.add_request(r)
    return r
