// Batched first-mismatch on a CUDA device: one query against many keys. The
// CPU twin is radixkv::FirstMismatch (cpp/include/radixkv/compare.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "radixkv/store_index.h"

namespace radixkv::cuda {

/// One query against `num_keys` keys, all in device memory.
struct CompareBatch {
  const int32_t* query;
  int64_t query_len;
  const int32_t* keys;   ///< key b starts at keys + b * key_stride
  int64_t key_stride;    ///< elements
  int64_t key_cols;      ///< elements per key row
  const void* key_lens;  ///< nullable; else num_keys lengths, clamped to [0, key_cols]
  IndexType len_type;
  int64_t num_keys;
  int32_t* out;  ///< num_keys results
};

/// Enqueues, on `stream`, `out[b] = ` the first i < min(query_len, len_b)
/// where `query[i] != key_b[i]`, or that minimum when there is none. One warp
/// per key, 128 tokens a step with 16-byte loads when the pointers and the
/// stride allow it, stopping at the first step with a mismatch. No
/// synchronization; returns the launch error.
cudaError_t LaunchFirstMismatchBatched(const CompareBatch& c, cudaStream_t stream);

}  // namespace radixkv::cuda
