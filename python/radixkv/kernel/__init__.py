"""The KV kernels: the paged store and first-mismatch comparison.

Every function takes torch tensors and runs where they live: the native CPU
kernels in `radixkv._core`, the CUDA kernels in `radixkv._cuda` when that
extension was built (see `cuda_available`), and plain torch indexing on any
other device (or on CUDA when `_cuda` is absent).
"""

from radixkv.kernel.compare import first_mismatch, first_mismatch_batched
from radixkv.kernel.store import cuda_available, cuda_built, store_cache, store_mla

__all__ = [
    "cuda_available",
    "cuda_built",
    "first_mismatch",
    "first_mismatch_batched",
    "store_cache",
    "store_mla",
]
