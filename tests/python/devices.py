"""The devices a test runs on: `DEVICES` ("cpu", then "cuda" marked `cuda`:
a CUDA GPU) and `EXT_DEVICES` (the same, "cuda" needing radixkv._cuda
too), for `pytest.mark.parametrize("device", DEVICES)`. conftest.py skips
a `cuda` test where `cuda_missing` says why."""

import pytest

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)
EXT_CUDA = pytest.param("cuda", marks=pytest.mark.cuda(extension=True))
DEVICES = ["cpu", CUDA]
EXT_DEVICES = ["cpu", EXT_CUDA]


def cuda_missing(extension: bool = False) -> str:
    """Why a `cuda` test cannot run here ("" when it can)."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (torch.cuda)"
    if extension:
        from radixkv import kernel

        if not kernel.cuda_available():
            return "no CUDA GPU (or radixkv._cuda not built)"
    return ""
