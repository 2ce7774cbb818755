// The K/V transfer on the CPU: copy the rows of tokens between two pools (the
// device pool and the host pool). The CUDA twin is cuda/transfer.cuh; both take
// TransferParams (transfer_index.h) and share its index arithmetic.
#pragma once

#include <cstdint>
#include <string_view>

#include "radixkv/transfer_index.h"

namespace radixkv {

/// Checks a pool layout against the memory it describes: 1 or 2 sides, a page
/// size >= 1, no negative stride or slot count, at most 2^31 slots (an int32
/// names each), `row_bytes` and `layers` >= 1, and every row it names (rows of
/// `row_bytes` bytes in `layers` layers) inside the `bytes` bytes that start
/// at `l.base`, computed without overflow. Throws Error(kInvalidArgument)
/// whose message names `name`. O(1).
void CheckPoolLayout(const PoolLayout& l, int64_t row_bytes, int64_t layers, int64_t bytes,
                     std::string_view name);

/// Checks one plane of a pool with `planes` (PoolLayout): its rows, from
/// the plane's start, lie inside the `bytes` bytes of its buffer; the rest
/// as CheckPoolLayout. Throws Error(kInvalidArgument) naming `name`. O(1).
void CheckPlaneLayout(const PoolLayout& l, int64_t row_bytes, int64_t bytes,
                      std::string_view name);

/// Position of the first token whose source or destination slot is outside
/// its pool, or -1. O(num_tokens).
int64_t FindTransferSlotOutOfRange(const TransferParams& p) noexcept;

/// Copies, for every token i, the rows of slot `src_slots[i]` of `p.src` to
/// slot `dst_slots[i]` of `p.dst`, for layers [layer_begin, layer_end) and both
/// sides. Checks every slot first and copies nothing (returning the first bad
/// token) if one is out of range; returns -1 after the copy. Tokens whose
/// source and destination slots both start a page and run on for a whole page
/// are copied a page at a time (one memcpy of `page_size` rows per side and
/// layer) where both pools keep a page's rows together; the rest row by row.
/// Any `row_bytes`. O(tokens * layers * row_bytes).
int64_t TransferRows(const TransferParams& p) noexcept;

/// Position of the first token that is out of range or does not start a
/// whole page (`page_size` tokens whose source and destination slots both
/// start a page and run on, pages of one size in both pools), or -1.
/// O(num_tokens).
int64_t FindNotWholePages(const TransferParams& p) noexcept;

/// A backup into a float8 host pool (`p.dst`, described by `codes`): for
/// every whole page of tokens (the source and destination slots of a page
/// both start a page and run on), layers [layer_begin, layer_end) and each
/// side, encodes the page's rows (EncodeFloat8Rows) into its codes and
/// scales. `p.row_bytes` is the source's row. Checks every slot first;
/// returns the first token out of range or not starting a whole page
/// (copying nothing), else -1. O(tokens * layers * row elements).
int64_t EncodeTransfer(const TransferParams& p, const Float8Pool& codes) noexcept;

/// A load from a float8 host pool (`p.src`, described by `codes`): decodes
/// whole pages into `p.dst`'s rows, as EncodeTransfer encodes them.
int64_t DecodeTransfer(const TransferParams& p, const Float8Pool& codes) noexcept;

}  // namespace radixkv
