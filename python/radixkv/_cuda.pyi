"""Type stubs of the private CUDA module radixkv._cuda (built only with CUDA)."""

from typing import Any, Optional, Sequence

import torch

def store_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> None: ...
def first_mismatch_batched(query: torch.Tensor, keys: torch.Tensor,
                           key_lens: Optional[torch.Tensor], out: torch.Tensor) -> None: ...
def copy_engine(device: torch.Tensor, device_layout: Sequence[int], host: torch.Tensor,
                host_layout: Sequence[int], row_bytes: int, layers: int,
                max_blocks: int = 16) -> Any: ...
