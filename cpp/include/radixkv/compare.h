// First-mismatch comparison of token arrays, the inner loop of every tree walk.
#pragma once

#include <cstddef>
#include <cstdint>

#include "radixkv/store_index.h"

namespace radixkv {

/// Returns the index of the first position where `a` and `b` differ, or `n`
/// when the first `n` elements are equal. Vectorized (32 bytes a step with
/// SSE2 on x86-64, 16 with NEON on AArch64, scalar elsewhere). O(n), reads at
/// most `n` elements.
size_t FirstMismatch(const int32_t* a, const int32_t* b, size_t n) noexcept;

/// One query against `num_keys` keys: `out[b]` receives the first
/// i < min(query_len, len_b) with `query[i] != key_b[i]`, else that minimum,
/// where key b starts at `keys + b * key_stride` and `len_b` is `key_lens[b]`
/// clamped to [0, key_cols], or `key_cols` when `key_lens` is null. Plain
/// data, shared by the CPU loop below and the CUDA kernel (cuda/compare.cuh);
/// the pointers are borrowed.
struct CompareBatch {
  const int32_t* query;
  int64_t query_len;
  const int32_t* keys;
  int64_t key_stride;    ///< elements from one key to the next
  int64_t key_cols;      ///< elements per key row
  const void* key_lens;  ///< nullable; else `num_keys` lengths of `len_type`
  IndexType len_type;
  int64_t num_keys;
  int32_t* out;  ///< `num_keys` results
};

/// Position of the first key whose length lies outside [0, key_cols], or -1
/// (always -1 without `key_lens`). The CPU raises on one; CUDA, where checking
/// would need a sync, clamps. O(num_keys).
int64_t FindBadKeyLength(const CompareBatch& c) noexcept;

/// Fills `c.out` on the CPU as described at CompareBatch, a FirstMismatch per
/// key. O(sum of the compared lengths).
void FirstMismatchBatched(const CompareBatch& c) noexcept;

}  // namespace radixkv
