// Index arithmetic of the K/V transfer between two pools (device and host),
// shared by the CPU copy (cpp/src/transfer.cc) and the CUDA kernel
// (cuda/transfer.cu). Compiled for the host and, under nvcc, for the device,
// so the CPU tests exercise the offsets the GPU uses.
//
// Vocabulary: a *row* is what one token stores for one layer on one side (K or
// V; an MLA pool has one side, its latent row): `row_bytes` contiguous bytes.
// A transfer copies, for every token i, the rows of slot `src_slots[i]` in the
// source pool to slot `dst_slots[i]` in the destination pool, for layers
// [layer_begin, layer_end) and every side.
#pragma once

#include <cstdint>

#include "radixkv/store_index.h"  // RADIXKV_HOST_DEVICE

namespace radixkv {

/// Where the rows of a K/V pool lie: row (side, layer, slot) starts at
/// `side * side_stride + layer * layer_stride + (slot / page_size) *
/// page_stride + (slot % page_size) * row_stride` bytes from `base`. This
/// covers the device pool's LayerFirst `[2, L, P, S, H, D]` and PageFirst
/// `[2, P, L, S, H, D]` and the host pool's `layer_first` (the same as
/// LayerFirst) and `page_first` `[P, 2, L, S, H, D]` (one region per page),
/// and with one side the MLA pools' `[L, P, S, R]` and `[P, L, S, R]`.
///
/// A pool whose (side, layer) planes live in buffers of their own (an
/// engine's per-layer tensors, as SGLang's `k_buffer[l]` / `v_buffer[l]`)
/// names them in `planes`: plane (side, layer) starts at `planes[side *
/// plane_layers + layer]` and `side_stride`, `layer_stride` and `base` are
/// not used for rows. The table is read where the copy runs (on a GPU, a
/// table in device memory); `plane_bits` ORs every plane's address, for the
/// alignment checks made on the host.
struct PoolLayout {
  char* base;
  int64_t side_stride;
  int64_t layer_stride;
  int64_t page_stride;
  int64_t row_stride;
  int64_t page_size;  ///< slots per page, >= 1
  int64_t num_slots;  ///< valid slots: [0, num_slots)
  int64_t sides = 2;  ///< 2 (K and V) or 1 (MLA); both pools of a transfer agree
  char* const* planes = nullptr;  ///< sides x plane_layers plane starts, or nullptr
  int64_t plane_layers = 0;       ///< layers in `planes`
  uint64_t plane_bits = 0;        ///< OR of the planes' addresses
};

/// A host pool that holds its K/V as float8 pages (page_codec.h): its rows
/// are codes, `heads` x `head_dim` bytes each, and page p's `heads` float32
/// scales of (side, layer) start at `PoolRowOffset(scales, side, layer, p *
/// scales.page_size)` (a layout whose row stride is 0). The device pool's
/// rows are `heads` x `head_dim` elements of `type`. Copies move whole pages
/// only: a page's scales are those of all its rows.
struct Float8Pool {
  SourceFloat type = SourceFloat::kNone;
  int64_t heads = 0;
  int64_t head_dim = 0;
  PoolLayout scales{};
};

/// Everything one transfer needs. Plain data; the pointers are borrowed and
/// must stay valid until the transfer is done.
struct TransferParams {
  PoolLayout src;
  PoolLayout dst;
  int64_t row_bytes;         ///< bytes per row, a multiple of 16 on CUDA
  int64_t num_layers;        ///< layers in both pools
  const int32_t* src_slots;  ///< `num_tokens` slots of `src`
  const int32_t* dst_slots;  ///< `num_tokens` slots of `dst`
  int64_t num_tokens;
  int64_t layer_begin;  ///< layers [layer_begin, layer_end) are copied
  int64_t layer_end;
};

/// Byte offset of row (side, layer, slot) in a pool laid out as `l`.
RADIXKV_HOST_DEVICE int64_t PoolRowOffset(const PoolLayout& l, int64_t side, int64_t layer,
                                          int64_t slot) {
  const int64_t page = slot / l.page_size;
  return side * l.side_stride + layer * l.layer_stride + page * l.page_stride +
         (slot - page * l.page_size) * l.row_stride;
}

/// Address of row (side, layer, slot) of a pool laid out as `l`, in its own
/// plane's buffer when the pool has `planes`.
RADIXKV_HOST_DEVICE char* PoolRow(const PoolLayout& l, int64_t side, int64_t layer,
                                  int64_t slot) {
  if (l.planes == nullptr) return l.base + PoolRowOffset(l, side, layer, slot);
  const int64_t page = slot / l.page_size;
  return l.planes[side * l.plane_layers + layer] + page * l.page_stride +
         (slot - page * l.page_size) * l.row_stride;
}

/// Whether a page of `l` holds its rows back to back, so `page_size` rows of
/// one (side, layer) are one run of `page_size * row_bytes` bytes.
RADIXKV_HOST_DEVICE bool RowsContiguousInPage(const PoolLayout& l, int64_t row_bytes) {
  return l.page_size == 1 || l.row_stride == row_bytes;
}

/// The widest access (1 to 16 bytes, a power of two) that both pools' bases
/// and strides and the row size are multiples of.
RADIXKV_HOST_DEVICE int64_t TransferVectorBytes(const TransferParams& p) {
  uint64_t bits = static_cast<uint64_t>(p.row_bytes) | 16u;
  const PoolLayout* ls[2] = {&p.src, &p.dst};
  for (const PoolLayout* l : ls) {
    bits |= reinterpret_cast<uintptr_t>(l->base) | static_cast<uint64_t>(l->side_stride) |
            static_cast<uint64_t>(l->layer_stride) | static_cast<uint64_t>(l->page_stride) |
            static_cast<uint64_t>(l->row_stride) | l->plane_bits;
  }
  return static_cast<int64_t>(bits & (~bits + 1));  // lowest set bit
}

/// Rows a transfer copies: one per token, side and layer.
RADIXKV_HOST_DEVICE int64_t TransferRowCount(const TransferParams& p) {
  return p.num_tokens * p.src.sides * (p.layer_end - p.layer_begin);
}

/// Copies the part of row `r` of `p` (rows are numbered token-major: token
/// `r / (sides * layers)`, then side, then layer within [layer_begin, layer_end))
/// that lane `lane` of `lanes` owns, `sizeof(Vec)` bytes at a time. A token
/// whose slots are out of range is skipped. Returns false for a skipped row.
template <typename Vec>
RADIXKV_HOST_DEVICE bool TransferRowPart(const TransferParams& p, int64_t r, int64_t lane,
                                         int64_t lanes) {
  const int64_t layers = p.layer_end - p.layer_begin;
  const int64_t token = r / (p.src.sides * layers);
  const int64_t rest = r - token * p.src.sides * layers;
  const int64_t side = rest / layers;
  const int64_t layer = p.layer_begin + (rest - side * layers);
  const int64_t s = p.src_slots[token], d = p.dst_slots[token];
  if (s < 0 || s >= p.src.num_slots || d < 0 || d >= p.dst.num_slots) return false;
  const Vec* from = reinterpret_cast<const Vec*>(PoolRow(p.src, side, layer, s));
  Vec* to = reinterpret_cast<Vec*>(PoolRow(p.dst, side, layer, d));
  const int64_t vectors = p.row_bytes / static_cast<int64_t>(sizeof(Vec));
  for (int64_t e = lane; e < vectors; e += lanes) to[e] = from[e];
  return true;
}

}  // namespace radixkv
