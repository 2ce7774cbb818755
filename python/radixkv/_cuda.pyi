"""Type stubs of the private CUDA module radixkv._cuda (built only with CUDA)."""

from typing import Any, Optional, Sequence, Tuple, Union

import torch

# The kernels' argument types are _core's (its CPU twins take the same).
from radixkv._core import _Scale, _Sides

def store_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: _Scale = None,
    v_scale: _Scale = None,
    side: _Sides = None,
) -> None: ...
def store_mla(
    kv_cache: torch.Tensor,
    out_loc: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    kv_lora_rank: int,
    k_scale: _Scale = None,
    side: _Sides = None,
) -> None: ...
def first_mismatch_batched(
    query: torch.Tensor, keys: torch.Tensor, key_lens: Optional[torch.Tensor], out: torch.Tensor
) -> None: ...
def copy_engine(
    device: Union[torch.Tensor, Sequence[torch.Tensor]],
    device_layout: Sequence[int],
    host: torch.Tensor,
    host_layout: Sequence[int],
    row_bytes: int,
    layers: int,
    max_blocks: int = 16,
    side_planes: Optional[Sequence[Tuple[Any, ...]]] = None,
    codec: Optional[Tuple[str, int, int, torch.Tensor, Sequence[int]]] = None,
) -> Any: ...
