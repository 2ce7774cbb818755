// The steps of a backup to the host tier that touch both the tree and the
// host pool's pages, each one call: what write_through does per request.
#pragma once

#include <cstdint>

#include "radixkv/page_allocator.h"
#include "radixkv/radix_tree.h"
#include "radixkv/slot_sink.h"

namespace radixkv {

/// How StartBackup ended.
enum class BackupStart : uint8_t {
  kNothing,  ///< nothing of the path needs a host copy
  kNoRoom,   ///< `*copy` needs more host pages than are free; nothing changed
  kStarted,  ///< begun: the host pages are taken, the nodes pinned
};

/// FindBackup, then, when `host_pages` has the pages for the range, takes
/// them and BeginBackup: writes the range's device slots (the copy's source)
/// to `device` and its new host slots to `host`. Arguments as FindBackup's.
/// Throws what they throw, and then changes nothing (the host pages go back).
BackupStart StartBackup(RadixTree* tree, PageAllocator* host_pages, const int32_t* tokens,
                        int64_t n, uint32_t min_hits, bool through_partial, uint64_t ns,
                        TierCopy* copy, SlotSink device, SlotSink host);

/// FinishBackup, then the host slots the tree did not take go back to
/// `host_pages`; they are also written to `rejected`. Returns how many.
/// Throws kInvalidArgument, changing nothing, unless every one of `host[0,
/// copy.length())` could go back (whole pages of `host_pages`, allocated,
/// none twice, none cached).
int64_t FinishBackup(RadixTree* tree, PageAllocator* host_pages, const TierCopy& copy,
                     const int32_t* host, bool ok, SlotSink rejected);

}  // namespace radixkv
