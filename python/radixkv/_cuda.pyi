"""Type stubs of the private CUDA module radixkv._cuda (built only with CUDA)."""

from typing import Optional

import torch

def store_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> None: ...
def first_mismatch_batched(query: torch.Tensor, keys: torch.Tensor,
                           key_lens: Optional[torch.Tensor], out: torch.Tensor) -> None: ...
