"""vLLM 0.32's real Scheduler (or the AsyncScheduler's order: step N+1
planned before step N's output comes back) driving RadixkvConnector's
scheduler side, a worker-side RadixkvConnector over a CPU "KV cache" of one
layer, and a toy model whose K/V at position p is computed from the cached
K/V at p - 1, so a wrong block spoils everything computed after it. Every
loaded block, valid host page and store page can be checked against the
true values. Used by connector_steps.py (run by run.sh, in the vLLM
venv, beside vLLM's own tests: it uses their helpers)."""

import os
import sys
import tempfile

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

from radixkv.compat.vllm_connector import RadixkvConnector  # noqa: E402

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
    ):
        self.dir = directory or tempfile.mkdtemp(prefix="rkstore")
        extra = {"host_bytes": host_bytes}
        if backend == "file":
            extra.update(backend="file", directory=self.dir)
        else:
            extra.update(backend="none")
        cfg = create_vllm_config(
            block_size=BS,
            max_num_batched_tokens=batched,
            kv_connector="RadixkvConnector",
            kv_connector_module_path="radixkv.compat.vllm_connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
        cfg.scheduler_config.async_scheduling = async_sched
        cfg.cache_config.enable_prefix_caching = prefix_caching
        self.sched = create_scheduler(cfg, num_blocks=num_blocks)
        self.sc = self.sched.connector
        self.wc = RadixkvConnector(cfg, KVConnectorRole.WORKER, self.sched.kv_cache_config)
        self.num_blocks = num_blocks
        self.kv = torch.full((2, num_blocks, BS, 1, 1), -1.0)
        self.wc.register_kv_caches({"layer": self.kv})
        self.wreqs = {}  # req_id -> [tokens, block_ids]
        self.problems = []
        self.hook_before_load = None

    def tokens_of(self, req_id):
        r = self.sched.requests.get(req_id)
        return list(r.prompt_token_ids) + [TOK_OUT] * 10000

    def execute(self, so):
        wc = self.wc
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
        meta = so.kv_connector_metadata
        wc.bind_connector_metadata(meta)
        if self.hook_before_load:
            self.hook_before_load(self, so, meta)
        wc.start_load_kv(None)
        errors_now = set(wc._load_errors)
        # check loaded blocks
        for load in meta.loads:
            toks, bids = self.wreqs[load.req_id]
            for name, b in zip(load.names, load.block_ids):
                if b in errors_now:
                    continue
                k = bids.index(b)
                want = truth(toks, (k + 1) * BS)[k * BS :]
                got = self.kv[0, b, :, 0, 0].tolist()
                if got != [float(x) for x in want]:
                    self.problems.append(
                        f"WRONG BYTES LOADED: req {load.req_id} block#{k} "
                        f"(id {b}) got {got[:3]} want {want[:3]}"
                    )
        # toy forward
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        for i, rid in enumerate(c.req_ids):
            computed[rid] = c.num_computed_tokens[i]
        for rid, n in so.num_scheduled_tokens.items():
            toks, bids = self.wreqs[rid]
            start = computed[rid]
            for p in range(start, start + n):
                prev = 0 if p == 0 else int(self.kv[0, bids[(p - 1) // BS], (p - 1) % BS, 0, 0])
                v = (prev * 31 + toks[p] + 1) % M
                self.kv[0, bids[p // BS], p % BS, 0, 0] = v
                self.kv[1, bids[p // BS], p % BS, 0, 0] = -v
        wc.wait_for_save()
        invalid = wc.get_block_ids_with_load_errors()
        wc.clear_connector_metadata()
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
            kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid),
        )

    def step_sync(self):
        so = self.sched.schedule()
        out = self.execute(so)
        self.sched.update_from_output(so, out)
        return so

    def run_async(self, max_steps=200, between=None):
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
            if so.total_num_scheduled_tokens == 0 and not so.kv_connector_metadata.loads:
                out = self.execute(so)
                self.sched.update_from_output(so, out)
                continue
            pending = (so, self.execute(so))  # the worker runs N before N+1 in any case
        if pending:
            self.sched.update_from_output(*pending)

    def run_sync(self, max_steps=200):
        for _ in range(max_steps):
            if not self.sched.has_requests():
                break
            self.step_sync()

    def check_store(self, prompts):
        """Every store page of these prompts' names holds the true bytes."""
        st = self.wc.storage
        for toks in prompts:
            names = self.sc._names(
                type(
                    "R", (), {"prompt_token_ids": toks, "cache_salt": None, "lora_request": None}
                )()
            )
            tr = truth(list(toks), len(names) * BS)
            got = {}

            def take(i, page):
                if page is not None:
                    got[i] = page[:BS].tolist()
                return True

            for i, n in enumerate(names):
                got.clear()
                st.read([n], lambda j, page, i=i: take(i, page))
                if i in got and got[i] != [float(x) for x in tr[i * BS : (i + 1) * BS]]:
                    self.problems.append(
                        f"WRONG BYTES IN STORE: block #{i} got {got[i][:3]} "
                        f"want {tr[i*BS:i*BS+3]}"
                    )

    def check_host(self, prompts):
        idx = self.sc.index
        if idx is None:
            return
        for toks in prompts:
            names = self.sc._names(
                type(
                    "R", (), {"prompt_token_ids": toks, "cache_salt": None, "lora_request": None}
                )()
            )
            tr = truth(list(toks), len(names) * BS)
            for i, n in enumerate(names):
                p = idx._pages.get(n)
                if p is None or not self.wc._valid[p]:
                    continue
                got = self.wc.blocks.rows[p].view(2, BS)[0].tolist()
                if got != [float(x) for x in tr[i * BS : (i + 1) * BS]]:
                    self.problems.append(f"WRONG BYTES IN VALID HOST PAGE {p}: block #{i}")


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
