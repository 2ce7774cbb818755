// The steps of the copies between the tiers that touch both the tree and a
// pool's pages, each one call: what write_through does per request, and
// what loading a match back from host does.
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
/// to `device` and its new host slots to `host` (each in the form its sink
/// takes: slots, or page ids). Arguments as FindBackup's.
/// Throws what they throw, and then changes nothing (the host pages go back).
BackupStart StartBackup(RadixTree* tree, PageAllocator* host_pages, const int32_t* tokens,
                        int64_t n, uint32_t min_hits, bool through_partial, uint64_t ns,
                        TierCopy* copy, SlotSink device, SlotSink host);

/// FinishBackup, then the host slots the tree did not take go back to
/// `host_pages`; they are also written to `rejected`. Returns how many.
/// Throws kInvalidArgument, changing nothing, unless every one of `host[0,
/// copy.length())` could go back (whole pages of `host_pages`, allocated,
/// none twice, none cached). With `host` page ids, `rejected` takes page ids
/// too; the count returned is in tokens either way.
int64_t FinishBackup(RadixTree* tree, PageAllocator* host_pages, const TierCopy& copy,
                     SlotSource host, bool ok, SlotSink rejected);

/// How StartLoad ended.
enum class LoadStart : uint8_t {
  kNothing,  ///< no host part is left to load: lock the handle's device part
  kNoRoom,   ///< `*copy` needs more device pages than are free; nothing changed
  kStarted,  ///< begun (or the part landed meanwhile: an empty copy)
};

/// FindLoad, then, when `device_pages` has the pages for the copy, BeginLoad
/// and takes them: `*loaded` is the new handle for the whole match (locked),
/// the copy's host slots go to `host`, and the slots the request goes on
/// with to `indices`: the device part's, then the new pages' (`copy.start`
/// on), which the copy fills; with a page sink `indices` takes page ids (the
/// copy's start / page_size on are the new pages). Throws what FindLoad and BeginLoad throw, and
/// then nothing changed.
LoadStart StartLoad(RadixTree* tree, PageAllocator* device_pages, const Handle& handle,
                    TierCopy* copy, Handle* loaded, SlotSink host, SlotSink indices);

}  // namespace radixkv
