"""radixkv: the KV-cache memory subsystem of an LLM serving engine."""

import torch as _torch

from radixkv import _core

_core._init_tensor_api(_torch.Tensor, _torch.Tensor.__dlpack_c_exchange_api__)

from radixkv._core import IntegrityError, OutOfCapacityError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["IntegrityError", "OutOfCapacityError", "__version__"]
