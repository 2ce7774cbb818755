"""Test-only: SGLang's HiCache on a CPU. Four spots of it assume CUDA:
host-pool memory is registered with cudaHostRegister, the direct
host<->device copy of K/V layers is a CUDA kernel, torch.cpu.Stream has no
synchronize, and the staging page an L3 read lands in is pinned memory
(which a CPU-only torch refuses, so no page is ever read back). An SGLang
plug-in (this venv's only) replaces them with plain torch in each SGLang
process."""

import torch


def _alloc(dims, dtype, device, pin_memory, allocator, *args, **kwargs):
    return torch.zeros(dims, dtype=dtype, device="cpu")


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=1, **kw):
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices] = src[src_indices].to(dst.device)


def patch() -> None:
    from sglang.srt.mem_cache.pool_host import common, mha

    common.ALLOC_MEMORY_FUNCS["cpu"] = _alloc
    mha.transfer_kv_direct = _transfer_kv_direct
    try:
        from sglang.srt.mem_cache import memory_pool_host

        memory_pool_host.transfer_kv_direct = _transfer_kv_direct
    except ImportError:
        pass

    def dummy_page(self):
        return torch.zeros(
            (2, self.layer_num, self.page_size, self.head_num, self.head_dim),
            dtype=self.dtype,
            device="cpu",
        ).flatten()

    mha.MHATokenToKVPoolHost.get_dummy_flat_data_page = dummy_page
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None
