"""What every test folder shares: the helpers beside this file on the path,
the `cuda` marker, the state machines' budgets and a tiered manager factory.

Tests live by area (kvcache/, scheduler/, host_tier/, storage/, events/,
compat/, replay/, bindings/, project/), the technique in the file name
(`_stateful`, `_boundary`, `_hostile`, `_faults`, ...). The helpers the
tests import as plain modules (reference.py, storage_env.py, devices.py,
...) sit here, in tests/python; only this folder goes on the path (never
../../python), so `import radixkv` still finds the installed package.
"""

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from devices import cuda_missing  # noqa: E402

# The state machines' budgets (scheduler/test_stateful.py,
# host_tier/test_host_tier_stateful.py): CI runs a bounded one,
# RADIXKV_HYPOTHESIS_PROFILE=long many more.
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # (an engine's venv runs compat/ without hypothesis)
    pass
else:
    settings.register_profile(
        "ci",
        max_examples=40,
        stateful_step_count=60,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        derandomize=True,
    )
    settings.register_profile(
        "long",
        max_examples=2000,
        stateful_step_count=200,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile(os.environ.get("RADIXKV_HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cuda: needs a CUDA GPU (torch.cuda); cuda(extension=True) also radixkv._cuda "
        "(devices.py's DEVICES and EXT_DEVICES carry it); skipped where missing",
    )


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("cuda")
    if marker is not None:
        why = cuda_missing(marker.kwargs.get("extension", False))
        if why:
            pytest.skip(why)


@pytest.fixture
def tiered_manager():
    """A factory of CacheManagers with a host tier over a real MHA pool:
    `tiered_manager(num_pages=16, page_size=4, host_num_pages=32, **kw)`
    (`kv_shape=(layers, heads, head_dim, dtype)`, `device`; other keywords
    go to CacheManager). Each one made is closed after the test."""
    import torch

    from radixkv.kvcache import MHAKVCache
    from radixkv.scheduler import CacheManager

    made = []

    def make(num_pages=16, page_size=4, host_num_pages=32, kv_shape=None, device="cpu", **kw):
        layers, heads, dim, dtype = kv_shape or (2, 1, 8, torch.float16)
        pool = MHAKVCache(heads, layers, dim, num_pages, dtype, device=device, page_size=page_size)
        cm = CacheManager(
            num_pages, page_size, device=device, kv_cache=pool, host_num_pages=host_num_pages, **kw
        )
        made.append(cm)
        return cm

    yield make
    for cm in made:
        cm.close(wait=False)
