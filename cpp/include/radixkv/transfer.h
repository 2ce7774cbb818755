// The K/V transfer on the CPU: copy the rows of tokens between two pools (the
// device pool and the host pool). The CUDA twin is cuda/transfer.cuh; both take
// TransferParams (transfer_index.h) and share its index arithmetic.
#pragma once

#include <cstdint>

#include "radixkv/transfer_index.h"

namespace radixkv {

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

}  // namespace radixkv
