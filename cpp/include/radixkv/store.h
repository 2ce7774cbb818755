// The KV store on the CPU: scatter rows of k and v (or of any sides) into
// token slots of the caches. The CUDA twin is cuda/store.cuh; both take a StoreParams
// (store_index.h) and share its index arithmetic.
#pragma once

#include <cstdint>

#include "radixkv/store_index.h"

namespace radixkv {

/// Position of the first of `indices[0, n)` outside `[0, num_slots)`, or -1
/// when all are in range. O(n), vectorized.
int64_t FindSlotOutOfRange(const void* indices, IndexType type, int64_t n,
                           int64_t num_slots) noexcept;

/// What a store found wrong with its indices.
struct StoreCheck {
  enum Kind { kOk, kOutOfRange, kRepeated };
  Kind kind = kOk;
  int64_t position = -1;  ///< the first bad index
  int64_t slot = 0;       ///< its value
};

/// For every token i < p.num_tokens and every side of `p`, writes source row i
/// into row `indices[i]` of the side's cache: bytes copied as they are, or
/// converted to float8 with the side's scale (StoreSide). Each index is read
/// exactly once, into memory of the store's own, and what was read is checked
/// and then used: indices that alias a cache, or that another thread changes
/// during the call, can never make it write out of bounds. When an index is
/// out of range or repeats an earlier one, nothing is written and the first
/// such is reported. Any row size, alignment and dtype width; sources may be
/// strided, the caches paged, and each side has its own row width. Throws
/// std::bad_alloc (nothing written) when the indices cannot be copied.
///
/// Speed (bench/README.md): a batch writing 1 MiB or more whose sides all copy
/// bytes and whose cache rows are whole 64-byte lines is streamed past the
/// cache (AVX2 non-temporal stores) on one thread; other large batches are
/// split over up to `max_threads` threads, at least 2 MiB written each (a
/// converted byte counts as 8 copied ones).
/// O(num_tokens * row bytes).
StoreCheck StoreRows(const StoreParams& p, int max_threads = 1);

}  // namespace radixkv
