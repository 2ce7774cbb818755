// Batched first-mismatch on a CUDA device: one query against many keys. The
// CPU twin is radixkv::FirstMismatchBatched (cpp/include/radixkv/compare.h),
// whose CompareBatch both take.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "radixkv/compare.h"

namespace radixkv::cuda {

/// Enqueues, on `stream`, `out[b] = ` the first i < min(query_len, len_b)
/// where `query[i] != key_b[i]`, or that minimum when there is none. One warp
/// per key, 128 tokens a step with 16-byte loads when the pointers and the
/// stride allow it, stopping at the first step with a mismatch. No
/// synchronization; returns the launch error.
cudaError_t LaunchFirstMismatchBatched(const CompareBatch& c, cudaStream_t stream);

}  // namespace radixkv::cuda
