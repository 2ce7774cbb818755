// Index arithmetic of the KV store (a row scatter), shared by the CPU kernel
// (cpp/src/store.cc) and the CUDA kernel (cuda/store.cu). Everything here is
// compiled for the host and, under nvcc, for the device too, so the CPU tests
// exercise the exact offsets the GPU uses.
//
// Vocabulary: a *row* is what one token stores in one of the two caches: its
// `heads` runs of `head_bytes` contiguous bytes. Source row i (of `k` or `v`)
// goes to destination row `indices[i]` (a token slot of `k_cache` or
// `v_cache`). All offsets and strides are in bytes.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define RADIXKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define RADIXKV_HOST_DEVICE inline
#endif

namespace radixkv {

/// Where the rows of one tensor lie. Row r starts at
/// `(r / page_size) * page_stride + (r % page_size) * row_stride`; head h of a
/// row starts `h * head_stride` bytes after the row. Sources use
/// `page_size == 1` (row i at `i * page_stride`); a paged cache whose pages do
/// not follow each other (the PageFirst layout) uses `page_size > 1`.
struct RowLayout {
  int64_t page_size;    ///< rows per page, >= 1
  int64_t page_stride;  ///< bytes from one page to the next
  int64_t row_stride;   ///< bytes from one row of a page to the next
  int64_t head_stride;  ///< bytes from one head of a row to the next
};

/// Index dtypes accepted for `indices`.
enum class IndexType : int32_t { kInt32 = 0, kInt64 = 1 };

/// Everything one store needs: side 0 is (k -> k_cache), side 1 is
/// (v -> v_cache). Plain data, passed by value to the CUDA kernel; the
/// pointers are borrowed and must stay valid for the duration of the store.
struct StoreParams {
  const void* src[2];       ///< k, v: `num_tokens` rows
  void* dst[2];             ///< k_cache, v_cache: `num_slots` rows
  RowLayout src_layout[2];  ///< layout of k, v (page_size 1)
  RowLayout dst_layout[2];  ///< layout of k_cache, v_cache
  int64_t heads;            ///< runs per row, >= 1
  int64_t head_bytes;       ///< bytes per run, >= 1
  const void* indices;      ///< `num_tokens` destination slots
  IndexType index_type;     ///< dtype of `indices`
  int64_t num_tokens;       ///< rows to store
  int64_t num_slots;        ///< rows in each cache; valid slots are [0, num_slots)
};

/// Byte offset of row `row` in a tensor laid out as `l`.
RADIXKV_HOST_DEVICE int64_t RowOffset(const RowLayout& l, int64_t row) {
  if (l.page_size == 1) return row * l.page_stride;
  const int64_t page = row / l.page_size;
  return page * l.page_stride + (row - page * l.page_size) * l.row_stride;
}

/// Slot `i` of `indices`, widened to int64.
RADIXKV_HOST_DEVICE int64_t LoadSlot(const void* indices, IndexType type, int64_t i) {
  return type == IndexType::kInt32 ? static_cast<int64_t>(static_cast<const int32_t*>(indices)[i])
                                   : static_cast<const int64_t*>(indices)[i];
}

/// Whether `slot` names a row of a cache with `num_slots` rows.
RADIXKV_HOST_DEVICE bool SlotInRange(int64_t slot, int64_t num_slots) {
  return slot >= 0 && slot < num_slots;
}

/// Rewrites `p` into an equivalent, cheaper form: heads that follow each other
/// in all four tensors become one run, and a cache whose pages follow each
/// other becomes unpaged. Call once before the copy.
RADIXKV_HOST_DEVICE void SimplifyStore(StoreParams* p) {
  bool dense_heads = p->heads > 1;
  for (int s = 0; s < 2; ++s) {
    dense_heads = dense_heads && p->src_layout[s].head_stride == p->head_bytes &&
                  p->dst_layout[s].head_stride == p->head_bytes;
  }
  if (dense_heads) {
    p->head_bytes *= p->heads;
    p->heads = 1;
  }
  for (int s = 0; s < 2; ++s) {
    RowLayout* ls[2] = {&p->src_layout[s], &p->dst_layout[s]};
    for (RowLayout* l : ls) {
      if (p->heads == 1) l->head_stride = p->head_bytes;
      if (l->page_size > 1 && l->page_stride == l->page_size * l->row_stride) {
        l->page_size = 1;
        l->page_stride = l->row_stride;
      }
      if (l->page_size == 1) l->row_stride = l->page_stride;
    }
  }
}

/// The widest access (1, 2, 4, 8 or 16 bytes, at most `max_bytes`, a power of
/// two) that every pointer, every stride and the run length of `p` are
/// multiples of, so each access of that width is aligned.
RADIXKV_HOST_DEVICE int64_t VectorBytes(const StoreParams& p, int64_t max_bytes) {
  uint64_t bits = static_cast<uint64_t>(p.head_bytes) | static_cast<uint64_t>(max_bytes);
  for (int s = 0; s < 2; ++s) {
    bits |= reinterpret_cast<uintptr_t>(p.src[s]) | reinterpret_cast<uintptr_t>(p.dst[s]);
    const RowLayout* ls[2] = {&p.src_layout[s], &p.dst_layout[s]};
    for (const RowLayout* l : ls) {
      bits |= static_cast<uint64_t>(l->page_stride) | static_cast<uint64_t>(l->row_stride);
      if (p.heads > 1) bits |= static_cast<uint64_t>(l->head_stride);
    }
  }
  return static_cast<int64_t>(bits & (~bits + 1));  // lowest set bit
}

/// Copies the part of token `i`'s two rows that lane `lane` of `lanes`
/// cooperating workers owns, `sizeof(Vec)` bytes at a time: run h, vector e
/// goes to the lane with `e % lanes == lane`. A token whose slot is out of
/// range is skipped (never written). `sizeof(Vec)` must not exceed
/// `VectorBytes(p, ...)`. Returns false for a skipped token.
template <typename Vec>
RADIXKV_HOST_DEVICE bool StoreTokenPart(const StoreParams& p, int64_t i, int64_t lane,
                                        int64_t lanes) {
  const int64_t slot = LoadSlot(p.indices, p.index_type, i);
  if (!SlotInRange(slot, p.num_slots)) return false;
  const int64_t vectors = p.head_bytes / static_cast<int64_t>(sizeof(Vec));
  for (int s = 0; s < 2; ++s) {
    const char* src = static_cast<const char*>(p.src[s]) + RowOffset(p.src_layout[s], i);
    char* dst = static_cast<char*>(p.dst[s]) + RowOffset(p.dst_layout[s], slot);
    for (int64_t h = 0; h < p.heads; ++h) {
      const Vec* from = reinterpret_cast<const Vec*>(src + h * p.src_layout[s].head_stride);
      Vec* to = reinterpret_cast<Vec*>(dst + h * p.dst_layout[s].head_stride);
      for (int64_t e = lane; e < vectors; e += lanes) to[e] = from[e];
    }
  }
  return true;
}

}  // namespace radixkv
