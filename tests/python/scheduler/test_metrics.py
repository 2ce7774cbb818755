"""CacheManager.metrics: counters that follow what the manager did, their
Prometheus text (each line checked against the exposition format) and the
prometheus_client collector that serves the same figures."""

import re
import subprocess
import sys

import pytest
import torch

from radixkv.scheduler import CacheManager, CacheMetrics

SAMPLE = re.compile(
    r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
    r'(,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*\})? -?[0-9]+(\.[0-9]+)?$'
)


def serve(cm, ids):
    h, idx = cm.match_req(ids)
    if cm.host_pool is not None:
        h, idx = cm.load_back(h)
    else:
        cm.lock(h)
    own = cm.allocate(len(ids) - h.cached_len)
    cm.free_and_cache_finished_req(h, ids, torch.cat([idx, own]))
    cm.drain()
    return h.cached_len


def exposition(text):
    """{name: [kind, help, {labels text: value}]} of a Prometheus text
    exposition (radixkv's own or prometheus_client's), every sample line
    checked against the format, every name with one HELP and one TYPE, and
    counters, and only counters, named *_total."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            _, _, name, doc = line.split(" ", 3)
            assert name not in out, line
            out[name] = [None, doc, {}]
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert out[name][0] is None, line
            out[name][0] = kind
        else:
            assert SAMPLE.match(line), line
            name, rest = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(.*)", line).groups()
            labels, value = rest.rsplit(" ", 1)
            out[name][2][labels] = float(value)
    for name, (kind, _, samples) in out.items():
        assert kind is not None and samples, name
        assert name.endswith("_total") == (kind == "counter"), name
    return out


def values(text):
    """{name: value} of an exposition whose metrics have one sample each."""
    out = {}
    for name, (_, _, samples) in exposition(text).items():
        (out[name],) = samples.values()
    return out


def test_counters_follow_the_requests():
    cm = CacheManager(8, page_size=4)
    a, b = torch.arange(17), torch.arange(100, 117)
    serve(cm, a), serve(cm, a), serve(cm, b)  # b evicts part of a
    m = cm.metrics
    assert (m.queries, m.query_tokens) == (3, 48)
    assert m.device_hit_tokens == 16 and m.host_hit_tokens == 0
    assert m.evicted_tokens > 0 and m.hit_rate == pytest.approx(16 / 48)
    assert m.device_free_tokens + m.device_cached_tokens == 32
    cm.match_req_batch([a, b])
    assert cm.metrics.queries == 5


def test_host_tier_counters_and_prometheus_text(tiered_manager):
    cm = tiered_manager(4, 4, 8, kv_shape=(1, 1, 8, torch.float16))
    a, b = torch.arange(13), torch.arange(100, 113)
    serve(cm, a), serve(cm, b), serve(cm, a)  # a comes back from host
    m = cm.metrics
    assert m.host_hit_tokens == 12 and m.loaded_back_tokens == 12 and m.backed_up_tokens > 0
    text = m.prometheus(labels={"instance": 'a "quoted"\\name'})
    samples = values(text)
    counts = [line.rsplit(" ", 1)[1] for line in text.splitlines() if not line.startswith("#")]
    assert all(re.fullmatch(r"-?[0-9]+", c) for c in counts)  # counts are written as ints
    assert samples["radixkv_host_hit_tokens_total"] == 12
    assert samples["radixkv_queries_total"] == 3
    assert 'instance="a \\"quoted\\"\\\\name"' in text
    assert set(values(CacheMetrics().prometheus("engine_kv"))) == {
        n.replace("radixkv", "engine_kv") for n in samples
    }
    with pytest.raises(ValueError, match="prefix"):
        m.prometheus("9bad")
    with pytest.raises(ValueError, match="labels"):
        m.prometheus(labels={"bad-name": "x"})
    for bad in ("radixkvé", "x\u0661"):  # letters and digits outside ASCII
        with pytest.raises(ValueError, match="prefix"):
            m.prometheus(bad)
    with pytest.raises(ValueError, match="labels"):
        m.prometheus(labels={"\u00f1ame": "x"})
    for bad in ("instance", [("instance", "a")]):
        with pytest.raises(TypeError, match="labels must be a dict"):
            m.prometheus(labels=bad)


# --- prometheus_client: radixkv.prometheus.CacheMetricsCollector ----------------------------


def scrape(registry):
    """The exposition prometheus_client writes for `registry`."""
    from prometheus_client import generate_latest

    return exposition(generate_latest(registry).decode())


def test_the_collector_exposes_what_prometheus_writes(tiered_manager):
    """A real run with a host tier: the engine's registry serves radixkv's
    figures under the names, kinds and help texts of the hand-written text,
    with the same values and labels."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry

    from radixkv.prometheus import CacheMetricsCollector

    cm = tiered_manager(4, 4, 8, kv_shape=(1, 1, 8, torch.float16))
    registry = CollectorRegistry()
    labels = {"instance": 'a "quoted"\\name', "model": "m"}
    collector = CacheMetricsCollector(cm, labels=labels, registry=registry)
    a, b = torch.arange(13), torch.arange(100, 113)
    serve(cm, a), serve(cm, b), serve(cm, a)  # a comes back from host
    got = scrape(registry)
    want = exposition(cm.metrics.prometheus(labels=labels))
    assert got == want
    assert got["radixkv_host_hit_tokens_total"][2] == {
        '{instance="a \\"quoted\\"\\\\name",model="m"}': 12.0
    }
    assert got["radixkv_device_free_tokens"][0] == "gauge"
    assert {n for n, (kind, _, _) in got.items() if kind == "counter"} == {
        n for n in got if n.endswith("_total")
    }
    # Read afresh at each scrape.
    serve(cm, torch.arange(200, 213))
    assert scrape(registry)["radixkv_queries_total"][2] == {
        '{instance="a \\"quoted\\"\\\\name",model="m"}': 4.0
    }
    # One collector per prefix and registry: the names are taken.
    with pytest.raises(ValueError):
        CacheMetricsCollector(cm, registry=registry)
    registry.unregister(collector)
    assert scrape(registry) == {}


def test_the_collector_takes_a_snapshot_source_and_checks_its_arguments():
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from radixkv.prometheus import CacheMetricsCollector

    latest = CacheMetrics(queries=7, device_free_tokens=32)
    registry = CollectorRegistry()
    collector = CacheMetricsCollector(lambda: latest, prefix="engine_kv", registry=None)
    assert generate_latest(registry) == b""  # registry=None: not registered
    registry.register(collector)
    got = scrape(registry)
    assert got == exposition(latest.prometheus("engine_kv"))
    assert got["engine_kv_queries_total"][2] == {"": 7.0}
    assert got["engine_kv_device_free_tokens"][2] == {"": 32.0}
    with pytest.raises(TypeError, match="source must be"):
        CacheMetricsCollector(42, registry=None)
    with pytest.raises(ValueError, match="prefix"):
        CacheMetricsCollector(lambda: latest, prefix="9bad", registry=None)
    with pytest.raises(ValueError, match="labels"):
        CacheMetricsCollector(lambda: latest, labels={"bad-name": "x"}, registry=None)
    with pytest.raises(TypeError, match="labels must be a dict"):
        CacheMetricsCollector(lambda: latest, labels=[("a", "b")], registry=None)
    wrong = CacheMetricsCollector(lambda: {"queries": 1}, prefix="wrong", registry=None)
    with pytest.raises(TypeError, match="not CacheMetrics"):
        list(wrong.collect())


def test_the_plain_text_needs_no_prometheus_client():
    """Without prometheus_client, CacheMetrics.prometheus() still writes the
    text and radixkv.prometheus names the extra to install."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from radixkv.scheduler import CacheMetrics\n"
        "assert 'radixkv_queries_total 3' in CacheMetrics(queries=3).prometheus()\n"
        "try:\n"
        "    import radixkv.prometheus\n"
        "except ModuleNotFoundError as e:\n"
        "    assert e.name == 'prometheus_client' and 'radixkv[prometheus]' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('imported without prometheus_client')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
