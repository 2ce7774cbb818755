"""What every test folder shares: the helpers beside this file on the path
and the `cuda` marker.

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
