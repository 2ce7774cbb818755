"""CacheManager.metrics: counters that follow what the manager did, and their
Prometheus text (each line checked against the exposition format)."""

import re

import pytest
import torch

from radixkv.kvcache import MHAKVCache
from radixkv.scheduler import CacheManager, CacheMetrics

SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
                    r'(,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*\})? -?[0-9]+(\.[0-9]+)?$')


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


def parse(text):
    out, helps, types = {}, set(), {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helps.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        else:
            assert SAMPLE.match(line), line
            name = re.split(r"[{ ]", line)[0]
            out[name] = int(line.rsplit(" ", 1)[1])
    assert set(out) == helps == set(types)
    for name, kind in types.items():
        assert name.endswith("_total") == (kind == "counter")
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


def test_host_tier_counters_and_prometheus_text():
    pool = MHAKVCache(1, 1, 8, 4, torch.float16, page_size=4)
    cm = CacheManager(4, page_size=4, kv_cache=pool, host_num_pages=8)
    a, b = torch.arange(13), torch.arange(100, 113)
    serve(cm, a), serve(cm, b), serve(cm, a)  # a comes back from host
    m = cm.metrics
    assert m.host_hit_tokens == 12 and m.loaded_back_tokens == 12 and m.backed_up_tokens > 0
    text = m.prometheus(labels={"instance": 'a "quoted"\\name'})
    samples = parse(text)
    assert samples["radixkv_host_hit_tokens_total"] == 12
    assert samples["radixkv_queries_total"] == 3
    assert 'instance="a \\"quoted\\"\\\\name"' in text
    assert set(parse(CacheMetrics().prometheus("engine_kv"))) == {
        n.replace("radixkv", "engine_kv") for n in samples}
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
