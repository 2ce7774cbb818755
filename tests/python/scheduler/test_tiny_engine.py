"""examples/tiny_engine.py: a transformer served through radixkv gives the same
logits as the same model recomputing every sequence without a cache, with
prefixes shared on the device, loaded back from host and read from storage."""

import importlib.util
import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "tiny_engine.py")


@pytest.fixture(scope="module")
def te():
    spec = importlib.util.spec_from_file_location("tiny_engine", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiny_engine"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_logits_equal_a_recompute_through_every_tier(te, tmp_path):
    model = te.TinyModel()
    engine = te.Engine(model, num_pages=40, host_pages=80, storage_dir=str(tmp_path))
    served = te.serve_conversations(engine, 6, turns=3)
    assert te.check(model, served) < 1e-4
    assert sum(r.from_cache - r.from_host for r in served) > 0  # device hits
    assert sum(r.from_host for r in served) > 0  # loaded back from host
    engine.cm.close()
    second = te.Engine(model, num_pages=40, host_pages=80, storage_dir=str(tmp_path))
    again = te.serve_conversations(second, 6, turns=3)
    assert te.check(model, again) < 1e-4
    assert second.cm.storage_counters.prefetched_tokens > 0  # read from storage
    assert [r.tokens.tolist() for r in again] == [r.tokens.tolist() for r in served]
    second.cm.close()


def test_the_check_catches_wrong_kv(te):
    model = te.TinyModel()
    engine = te.Engine(model, host_pages=0)
    te.serve_conversations(engine, 2, turns=1)
    for layer in range(te.LAYERS):  # damage every cached K row
        engine.pool.k_cache(layer).add_(0.5)
    served = te.serve_conversations(engine, 2, turns=1, seed=1)  # the same prompts again
    assert sum(r.from_cache for r in served) > 0
    with pytest.raises(AssertionError, match="differ"):
        te.check(model, served)


def test_the_example_runs_as_documented(tmp_path):
    out = subprocess.run(
        [sys.executable, EXAMPLE, "--conversations", "3", "--storage", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "logits within" in out and "second engine" in out


def test_the_float8_storage_codec_costs_a_small_logit_error(te, tmp_path):
    model = te.TinyModel()
    engine = te.Engine(
        model, num_pages=40, host_pages=80, storage_dir=str(tmp_path), storage_codec="float8"
    )
    served = te.serve_conversations(engine, 6, turns=3)
    engine.cm.close()
    second = te.Engine(
        model, num_pages=40, host_pages=80, storage_dir=str(tmp_path), storage_codec="float8"
    )
    again = te.serve_conversations(second, 6, turns=3)
    assert second.cm.storage_counters.prefetched_tokens > 0  # read from storage, encoded
    worst, mean, size, same = te.logit_errors(model, again)
    assert 1e-4 < worst < 0.25 * size  # it did go through the codec, and not far
    assert mean < 0.05 * size and same > 0.9
    with pytest.raises(AssertionError, match="differ"):  # the lossless check would fail
        te.check(model, again)
    second.cm.close()
    assert te.logit_errors(model, served)[1] < mean  # the first engine read little back


def test_an_encoded_host_costs_a_small_logit_error_and_holds_pages_in_half_the_bytes(te):
    model = te.TinyModel()
    plain = te.Engine(model, num_pages=40, host_pages=80)
    engine = te.Engine(model, num_pages=40, host_pages=80, host_codec="float8")
    assert engine.cm.host_pool.nbytes < 0.3 * plain.cm.host_pool.nbytes  # float32 K/V: a quarter
    served = te.serve_conversations(engine, 6, turns=3)
    assert sum(r.from_host for r in served) > 0  # pages did come back through the codec
    worst, mean, size, same = te.logit_errors(model, served)
    assert 1e-4 < worst < 0.25 * size
    assert mean < 0.05 * size and same > 0.9
    with pytest.raises(AssertionError, match="differ"):
        te.check(model, served)
    engine.cm.close(), plain.cm.close()
