"""pytest plugin: runs vLLM 0.32.0's own scheduler/KV-connector unit tests
(from vLLM's sdist, extracted by fetch_vllm_tests.sh) with radixkv's
`RadixkvConnector` where a test drives a generic connector.

    bash tests/engines/vllm_unit/run.sh [pytest args]

What it changes, per test, with pytest's monkeypatch (no vLLM code is copied):

* tests/v1/core (`create_scheduler(use_kv_connector=True)`,
  `create_scheduler_with_priority(use_kv_connector=True)`): vLLM's
  `ExampleConnector` becomes RadixkvConnector over radixkv's host tier
  (RADIXKV_VLLM_HOST_BYTES, 64 MiB; 0: none) and a file store in the test's
  tmp_path, `kv_load_failure_policy` "recompute".
* the connector-agnostic modules of tests/v1/kv_connector/unit (GENERIC
  below): `create_vllm_config()`'s default (NixlConnector) becomes
  RadixkvConnector, under the policy the test asks for.
* `facebook/opt-125m` resolves offline to the repository's tiny Llama in a
  Hugging Face cache of its own (HF_HOME under the cache dir): these tests
  read a model's config and never run it. The encoder-cache connector
  tests (with a KV connector beside) name a LLaVA model, whose config needs
  torchvision, which the CPU venv has not: skipped, saying so.

RADIXKV_VLLM_SUBSTITUTE=0 runs the same tests unchanged (vLLM's own
connectors): the baseline to tell our failures from the environment's.
RADIXKV_VLLM_CONNECTOR_MODULE picks the module (default
radixkv.compat.vllm_connector, as installed in the venv).
"""

import inspect
import os
import re
import sys

import pytest

CACHE = os.environ.get("RADIXKV_VLLM_TESTS_DIR") or os.path.expanduser(
    "~/.cache/radixkv-engines/vllm-tests-0.32.0"
)
HF_HOME = os.path.join(CACHE, "hf-tiny-llama")
# Before huggingface_hub / transformers / vllm are imported (by vLLM's conftest).
os.environ["HF_HOME"] = HF_HOME
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

SUBSTITUTE = os.environ.get("RADIXKV_VLLM_SUBSTITUTE", "1") != "0"
HOST_BYTES = int(os.environ.get("RADIXKV_VLLM_HOST_BYTES", 64 << 20))
MODULE = os.environ.get("RADIXKV_VLLM_CONNECTOR_MODULE", "radixkv.compat.vllm")

# tests/v1/kv_connector/unit modules whose tests are about the scheduler's
# handling of any connector (they build a scheduler via create_vllm_config /
# create_scheduler, and most then swap a Mock in for its connector).
GENERIC = {
    "tests.v1.kv_connector.unit.test_kv_load_failure_recovery",
    "tests.v1.kv_connector.unit.test_invalid_blocks_correctness",
    "tests.v1.kv_connector.unit.test_error_propagation",
    "tests.v1.kv_connector.unit.test_cache_pollution_prevention",
}
CORE_HELPERS = ("tests.v1.core.utils", "tests.v1.core.test_scheduler")

_REV = "0" * 40


def _fake_repo(repo_id: str) -> None:
    """`repo_id` in a Hugging Face cache, holding the repository's own tiny
    Llama (tests/engines/tiny_model.py): the scheduler tests read only its
    config, and run no model."""
    repo = os.path.join(HF_HOME, "hub", "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", _REV)
    if os.path.exists(os.path.join(snap, "tokenizer_config.json")):
        return
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    os.makedirs(snap, exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(_REV)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tiny_model import build_model, build_tokenizer

    build_model(snap, "float16")
    build_tokenizer(snap)


def _fake_hf_cache() -> None:
    _fake_repo("facebook/opt-125m")  # the model vLLM's scheduler tests name


_fake_hf_cache()


def _radixkv_transfer_config(real, kw: dict, directory: str):
    policy = (
        {"kv_load_failure_policy": kw["kv_load_failure_policy"]}
        if ("kv_load_failure_policy" in kw)
        else {}
    )
    return real(
        kv_connector="RadixkvConnector",
        kv_connector_module_path=MODULE,
        kv_role=kw.get("kv_role", "kv_both"),
        kv_connector_extra_config=_extra(directory),
        **policy,
    )


def _extra(directory: str) -> dict:
    return {"backend": "file", "directory": directory, "host_bytes": HOST_BYTES}


def _skip_if_refused(fn):
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            if str(e).startswith("radixkv's vLLM connector: it serves"):
                pytest.skip(f"RadixkvConnector refuses this layout by design: {e}")
            raise

    return wrapped


@pytest.fixture(autouse=True)
def _radixkv_connector(request, monkeypatch, tmp_path):
    if not SUBSTITUTE:
        yield
        return
    directory = str(tmp_path / "radixkv-store")
    name = request.module.__name__
    if name.startswith("tests.v1.core."):
        for helper in CORE_HELPERS:
            mod = sys.modules.get(helper)
            real = getattr(mod, "KVTransferConfig", None)
            if real is None:
                continue

            def kvt(*args, _real=real, **kw):
                if kw.get("kv_connector") == "ExampleConnector":
                    return _radixkv_transfer_config(_real, kw, directory)
                return _real(*args, **kw)

            monkeypatch.setattr(mod, "KVTransferConfig", kvt)
    elif name in GENERIC:
        mod = request.module
        real_cfg = mod.create_vllm_config

        def create_vllm_config(*args, **kw):
            if kw.get("kv_connector", "NixlConnector") == "NixlConnector":
                kw["kv_connector"] = "RadixkvConnector"
                kw["kv_connector_module_path"] = MODULE
                kw["kv_role"] = "kv_both"
                kw["kv_connector_extra_config"] = _extra(directory)
            return real_cfg(*args, **kw)

        monkeypatch.setattr(mod, "create_vllm_config", create_vllm_config)
        monkeypatch.setattr(mod, "create_scheduler", _skip_if_refused(mod.create_scheduler))
    yield


_BUILT: dict = {}  # nodeid -> connector classes the test's code constructed


@pytest.fixture(autouse=True)
def _record_connectors(request, monkeypatch):
    """Records which connector classes each test really built (the summary
    lists the tests that ran RadixkvConnector)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    real = KVConnectorFactory.create_connector.__func__
    built = _BUILT.setdefault(request.node.nodeid, set())
    ours = []

    def create_connector(cls, *args, **kwargs):
        c = real(cls, *args, **kwargs)
        built.add(type(c).__name__)
        if type(c).__name__ == "RadixkvConnector":
            ours.append(c)
        return c

    monkeypatch.setattr(KVConnectorFactory, "create_connector", classmethod(create_connector))
    yield
    # Our own invariants (not vLLM's): no per-request state is left for a
    # request vLLM has finished (request_finished drops it), and no host page
    # stays pinned once no copy is outstanding and no request holds pages
    # offered to it.
    problems = []
    for c in ours:
        sc = c.scheduler
        if sc is None:
            c.shutdown()
            continue
        left = [rid for rid, st in sc._reqs.items() if st.request.is_finished()]
        if left:
            problems.append(f"state left for finished requests {left}")
        holding = any(st.claim or st.prefetched for st in sc._reqs.values())
        if sc.index is not None and sc.index.pinned() and not sc._ops and not holding:
            problems.append(f"host pages left pinned: {sc.index.pinned()}")
        c.shutdown()
    if problems:
        pytest.fail("RadixkvConnector: " + "; ".join(problems))


def pytest_terminal_summary(terminalreporter):
    ours = sorted(n for n, b in _BUILT.items() if "RadixkvConnector" in b)
    terminalreporter.write_sep("-", f"tests that built RadixkvConnector: {len(ours)}")
    for n in ours:
        terminalreporter.write_line(n)


_USES_GENERIC = re.compile(r"use_kv_connector\s*=\s*(True|use_kv_connector)\b")


def pytest_collection_modifyitems(config, items):
    """In tests/v1/core keeps only the tests whose scheduler has vLLM's
    generic ExampleConnector (`use_kv_connector=True`, or its parameter
    True); the rest never reach a connector, or use vLLM's MockKVConnector."""
    skip = pytest.mark.skip(
        reason="names a LLaVA model, whose config needs torchvision " "(not in the CPU venv)"
    )
    # These assert the base class's default (a producer must deliver its KV);
    # radixkv's connector is a cache, which vLLM's docs say returns False.
    best_effort = pytest.mark.skip(
        reason="asserts requires_kv_delivery is the producer role's default; RadixkvConnector "
        "is a best-effort cache (a dropped save is a future miss) and returns False"
    )
    for item in items:
        if "ec_connector" in item.name:
            item.add_marker(skip)
        if item.name == "test_requires_kv_delivery_defaults_to_producer_role" or (
            item.name == "test_kv_pressure_preempt_mid_handoff[kv_producer-False]"
        ):
            item.add_marker(best_effort)
    if os.environ.get("RADIXKV_VLLM_SELECT", "1") == "0":
        return
    keep, drop = [], []
    for item in items:
        fn = getattr(item, "function", None)
        if not item.nodeid.startswith("tests/v1/core/") or fn is None:
            keep.append(item)
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        try:
            uses = bool(_USES_GENERIC.search(inspect.getsource(fn)))
        except (OSError, TypeError):
            uses = False
        if uses and params.get("use_kv_connector", True) is True:
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config):
    return (
        f"radixkv: RadixkvConnector substituted ({MODULE})"
        if SUBSTITUTE
        else "radixkv: substitution off (vLLM's own connectors)"
    )
