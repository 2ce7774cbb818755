"""The float8 conversion the store kernels promise, written independently of them.

`(x.float() / scale)` rounded to the nearest even float8; e4m3fn saturates a
finite or infinite overflow at +-448 and keeps NaN, e5m2 overflows to +-inf.
torch's own cast does exactly this from 2.12 on; before that its e4m3fn cast
turned an overflow into NaN, so the tests compare with this function rather
than with whatever torch is installed.
"""

import torch

E4M3_MAX = 448.0


def to_float8(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    y = x.float() / torch.tensor(float(scale), dtype=torch.float32)
    if dtype == torch.float8_e4m3fn:
        y = y.clamp(-E4M3_MAX, E4M3_MAX)  # NaN stays NaN
    return y.to(dtype)


def torch_casts_like_this() -> bool:
    """Whether the installed torch's e4m3fn cast saturates (torch >= 2.12)."""
    x = torch.tensor([float("inf"), 1e30, 465.0])
    return bool((x.to(torch.float8_e4m3fn).view(torch.uint8) == 0x7E).all())


def page_codec_reference(kv: torch.Tensor):
    """radixkv's float8 page codec (kvcache/page_codec.py), written with
    torch's own cast: per (plane, head) scale = max finite |x| / 448 (1 when
    0), codes = (x.float() / scale).to(float8), back = codes * scale."""
    x = kv.float()  # [planes, rows, heads, dim]
    finite = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    amax = finite.amax(dim=(1, 3))  # [planes, heads]
    tiny = float(torch.tensor([1], dtype=torch.int32).view(torch.float32))  # 2^-149
    scale = torch.where(amax > 0, (amax / 448.0).clamp_min(tiny), torch.ones_like(amax))
    s = scale[:, None, :, None]
    codes = (x / s).to(torch.float8_e4m3fn)
    back = (codes.float() * s).to(kv.dtype)
    return scale, codes.view(torch.uint8), back
