#include "radixkv/transfer.h"

#include <cstring>

#include "radixkv/page_codec.h"
#include "radixkv/status.h"

namespace radixkv {

void CheckPoolLayout(const PoolLayout& l, int64_t row_bytes, int64_t layers, int64_t bytes,
                     std::string_view name) {
  constexpr ErrorCode kBad = ErrorCode::kInvalidArgument;
  RADIXKV_CHECK(row_bytes >= 1 && layers >= 1, kBad, "row_bytes and layers must be >= 1");
  RADIXKV_CHECK(l.sides == 1 || l.sides == 2, kBad, name, "_layout must have 1 or 2 sides, got ",
                l.sides);
  RADIXKV_CHECK(l.page_size >= 1 && l.num_slots >= 0 && l.side_stride >= 0 && l.layer_stride >= 0 &&
                    l.page_stride >= 0 && l.row_stride >= 0,
                kBad, name,
                "_layout has a negative stride, a page size < 1 or a negative slot count");
  RADIXKV_CHECK(l.num_slots <= int64_t{1} << 31, kBad, name,
                "_layout has more slots than int32 can name");
  if (l.num_slots == 0) return;
  // Strides are non-negative, so the farthest row is the last one; its last
  // byte, in 128 bits so that no stride can overflow it.
  const __int128 slot = l.num_slots - 1, page = slot / l.page_size;
  const __int128 end = __int128{l.sides - 1} * l.side_stride +
                       __int128{layers - 1} * l.layer_stride + page * l.page_stride +
                       (slot - page * l.page_size) * l.row_stride + row_bytes;
  RADIXKV_CHECK(end <= bytes, kBad, name, "_layout reaches past the end of ", name, " (", bytes,
                " bytes there)");
}

void CheckPlaneLayout(const PoolLayout& l, int64_t row_bytes, int64_t bytes,
                      std::string_view name) {
  PoolLayout one = l;  // one plane: its rows from its own start
  one.planes = nullptr;
  one.sides = 1;
  one.side_stride = one.layer_stride = 0;
  CheckPoolLayout(one, row_bytes, 1, bytes, name);
}
namespace {

// Whether tokens [i, i + page) map whole pages onto whole pages.
bool WholePage(const TransferParams& p, int64_t i, int64_t page) noexcept {
  if (i + page > p.num_tokens) return false;
  const int32_t s = p.src_slots[i], d = p.dst_slots[i];
  if (s % page != 0 || d % page != 0) return false;
  for (int64_t j = 1; j < page; ++j) {
    if (p.src_slots[i + j] != s + j || p.dst_slots[i + j] != d + j) return false;
  }
  return true;
}

// Encodes (or decodes) the whole pages of `p` between a pool of `codes.type`
// rows and a float8 pool.
int64_t CodecTransfer(const TransferParams& p, const Float8Pool& codes, bool encode) noexcept {
  const int64_t bad = FindNotWholePages(p);
  if (bad >= 0) return bad;
  const PoolLayout& plain = encode ? p.src : p.dst;
  const PoolLayout& packed = encode ? p.dst : p.src;
  const int64_t page = p.src.page_size;
  const CodecRows rows{page,       codes.heads,      codes.head_dim,
                       codes.type, plain.row_stride, packed.row_stride};
  for (int64_t i = 0; i < p.num_tokens; i += page) {
    const int64_t s = p.src_slots[i], d = p.dst_slots[i];
    const int64_t plain_slot = encode ? s : d, packed_slot = encode ? d : s;
    for (int64_t side = 0; side < p.src.sides; ++side) {
      for (int64_t layer = p.layer_begin; layer < p.layer_end; ++layer) {
        char* row = PoolRow(plain, side, layer, plain_slot);
        auto* code = reinterpret_cast<uint8_t*>(PoolRow(packed, side, layer, packed_slot));
        char* scale = codes.scales.base + PoolRowOffset(codes.scales, side, layer, packed_slot);
        if (encode) {
          EncodeFloat8Rows(rows, row, code, scale);
        } else {
          DecodeFloat8Rows(rows, code, scale, row);
        }
      }
    }
  }
  return -1;
}

}  // namespace

int64_t FindNotWholePages(const TransferParams& p) noexcept {
  const int64_t bad = FindTransferSlotOutOfRange(p);
  if (bad >= 0) return bad;
  const int64_t page = p.src.page_size;
  if (p.dst.page_size != page) return p.num_tokens > 0 ? 0 : -1;
  for (int64_t i = 0; i < p.num_tokens; i += page) {
    if (!WholePage(p, i, page)) return i;
  }
  return -1;
}

int64_t EncodeTransfer(const TransferParams& p, const Float8Pool& codes) noexcept {
  return CodecTransfer(p, codes, true);
}

int64_t DecodeTransfer(const TransferParams& p, const Float8Pool& codes) noexcept {
  return CodecTransfer(p, codes, false);
}

int64_t FindTransferSlotOutOfRange(const TransferParams& p) noexcept {
  const auto src_limit = static_cast<uint64_t>(p.src.num_slots);
  const auto dst_limit = static_cast<uint64_t>(p.dst.num_slots);
  for (int64_t i = 0; i < p.num_tokens; ++i) {
    if (static_cast<uint64_t>(static_cast<int64_t>(p.src_slots[i])) >= src_limit ||
        static_cast<uint64_t>(static_cast<int64_t>(p.dst_slots[i])) >= dst_limit) {
      return i;
    }
  }
  return -1;
}

int64_t TransferRows(const TransferParams& p) noexcept {
  const int64_t bad = FindTransferSlotOutOfRange(p);
  if (bad >= 0) return bad;
  const size_t row = static_cast<size_t>(p.row_bytes);
  // Pages move as runs when both pools use the same page size and keep a
  // page's rows together (the common case: slots come from page allocators).
  const bool by_page = p.src.page_size == p.dst.page_size && p.src.page_size > 1 &&
                       RowsContiguousInPage(p.src, p.row_bytes) &&
                       RowsContiguousInPage(p.dst, p.row_bytes);
  const int64_t page = p.src.page_size;
  for (int64_t i = 0; i < p.num_tokens;) {
    const int64_t run = by_page && WholePage(p, i, page) ? page : 1;
    const int64_t s = p.src_slots[i], d = p.dst_slots[i];
    // Side, then layer: a host page holds [side][layer] regions in that order.
    for (int64_t side = 0; side < p.src.sides; ++side) {
      for (int64_t layer = p.layer_begin; layer < p.layer_end; ++layer) {
        std::memcpy(PoolRow(p.dst, side, layer, d), PoolRow(p.src, side, layer, s), row * run);
      }
    }
    i += run;
  }
  return -1;
}

}  // namespace radixkv
