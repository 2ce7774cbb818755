// The KV store on a CUDA device, the twin of cpp/include/radixkv/store.h.
// Framework-free: raw pointers in StoreParams, a stream, an error code back.
#pragma once

#include <cuda_runtime_api.h>

#include "radixkv/store_index.h"

namespace radixkv::cuda {

/// Enqueues the store of `p` (see StoreRows) on `stream` and returns at once
/// (no synchronization). Tokens are spread over groups of 1 to 32 threads
/// sized to the widest side's row, each moving the widest aligned vector (up
/// to 16 bytes) that `VectorBytes` allows on the copying sides, so any row
/// size and alignment works; converting sides go one element per thread
/// (StoreTokenPart), with the arithmetic the CPU kernel uses. A token
/// whose slot is out of range is skipped: nothing is written for it and no
/// error is raised (bounds are checked on the host, by the caller, when it
/// asks). Returns the launch error, cudaSuccess when `p.num_tokens == 0`,
/// cudaErrorInvalidValue when `p.num_sides` is outside [1, kMaxStoreSides].
cudaError_t LaunchStore(const StoreParams& p, cudaStream_t stream);

}  // namespace radixkv::cuda
