"""radixkv: the KV-cache memory subsystem of an LLM serving engine."""

import torch as _torch  # noqa: F401  (the extension reads its DLPack exchange API)

from radixkv._core import IntegrityError, OutOfCapacityError

__version__ = "0.1.0"

# The subpackages are light (no extension beyond _core): `import radixkv` gives them all.
from radixkv import kernel, kvcache, scheduler  # noqa: E402

__all__ = ["IntegrityError", "OutOfCapacityError", "__version__", "kernel", "kvcache", "scheduler"]
