"""A stand-in for sgl_kernel in the SGLang test venv. SGLang's CPU engine
imports it, and PyPI has no CPU build of it (its CPU kernels exist only as
source). On a CPU without AMX, Llama takes SGLang's native torch paths, so
the one kernel called is assign_req_to_token_pool_cpu, written here in plain
torch; every other name is a placeholder that raises when called."""

from _engine_placeholders import install, placeholder

__version__ = "0.0.0"
install(__name__)


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """Row req_pool_indices[i] of req_to_token takes, from column
    start_offset[i] to end_offset[i], the next slots of out_cache_loc."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    at = 0
    for row, s, e in zip(req_pool_indices.tolist(), starts, ends):
        n = e - s
        req_to_token[row, s:e] = out_cache_loc[at : at + n].to(req_to_token.dtype)
        at += n


def __getattr__(attr):
    return placeholder(__name__, attr)
