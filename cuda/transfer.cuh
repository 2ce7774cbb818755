// The K/V transfer on a CUDA device, the twin of cpp/include/radixkv/transfer.h.
// Framework-free: raw pointers in TransferParams, a stream, an error code back.
#pragma once

#include <cuda_runtime_api.h>

#include "radixkv/transfer_index.h"

namespace radixkv::cuda {

/// Enqueues the transfer of `p` on `stream` and returns at once. One group of
/// up to 32 threads copies a row with the widest aligned vector (16 bytes for
/// rows that are a multiple of 16, as every MHA and MLA row in bf16 or fp8
/// is); the grid is capped at `max_blocks` blocks of 256 threads so a copy
/// running beside the forward pass takes few SMs. Pools may be device or
/// pinned host memory (a host pool is read or written through UVA). A token
/// whose slots are out of range is skipped. Returns the launch error.
cudaError_t LaunchTransfer(const TransferParams& p, cudaStream_t stream, int max_blocks = 16);

/// Enqueues the twin of EncodeTransfer (`encode`: into the float8 host pool
/// `p.dst`) or DecodeTransfer (from it, `p.src`) on `stream`: one warp per
/// (page, side, layer, head) finds the head's largest finite magnitude with
/// a warp reduction and writes its scale and codes, or reads them back, with
/// the per-element conversions of page_codec.h (the CPU's, bit for bit).
/// The caller checks first that the tokens are whole pages in range
/// (FindNotWholePages on the host's slot lists): the kernel trusts them.
cudaError_t LaunchCodecTransfer(const TransferParams& p, const Float8Pool& codes, bool encode,
                                cudaStream_t stream, int max_blocks = 16);

}  // namespace radixkv::cuda
