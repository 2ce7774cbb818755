#include "radixkv/tier_steps.h"

namespace radixkv {

BackupStart StartBackup(RadixTree* tree, PageAllocator* host_pages, const int32_t* tokens,
                        int64_t n, uint32_t min_hits, bool through_partial, uint64_t ns,
                        TierCopy* copy, SlotSink device, SlotSink host) {
  if (!tree->FindBackup(tokens, n, min_hits, copy, through_partial, ns)) {
    return BackupStart::kNothing;
  }
  const int64_t pages = (copy->length() + tree->page_size() - 1) / tree->page_size();
  if (pages > host_pages->num_free_pages()) return BackupStart::kNoRoom;
  int32_t* slots = nullptr;
  host_pages->Allocate(copy->length(), [&](int64_t k) { return slots = host(k); });
  try {
    tree->BeginBackup(*copy, device);
  } catch (...) {
    host_pages->Free(slots, copy->length());
    throw;
  }
  return BackupStart::kStarted;
}

int64_t FinishBackup(RadixTree* tree, PageAllocator* host_pages, const TierCopy& copy,
                     const int32_t* host, bool ok, SlotSink rejected) {
  // Every slot must be able to go back before the tree changes: what the
  // tree does not take is freed after it changed. (So they are whole pages
  // in range, which the tree need not check again.)
  host_pages->CheckFree(host, copy.length(), "host_slots", &tree->stored_host_slots());
  int32_t* out = nullptr;
  const int64_t k = tree->FinishBackup(
      copy, host, ok, [&](int64_t m) { return out = rejected(m); }, /*host_checked=*/true);
  if (k > 0) host_pages->Free(out, k, &tree->stored_host_slots());
  return k;
}

LoadStart StartLoad(RadixTree* tree, PageAllocator* device_pages, const Handle& handle,
                    TierCopy* copy, Handle* loaded, SlotSink host, SlotSink indices) {
  *copy = tree->FindLoad(handle);
  if (copy->end == handle.cached_len) return LoadStart::kNothing;
  const int64_t ps = tree->page_size();
  const int64_t pages = (copy->length() + ps - 1) / ps;
  if (pages > device_pages->num_free_pages()) return LoadStart::kNoRoom;
  int32_t* out = nullptr;
  tree->BeginLoad(
      *copy, host, [&](int64_t k) { return out = indices(k + pages * ps); }, loaded);
  // The pages are there: taking them cannot fail.
  device_pages->Allocate(copy->length(), [&](int64_t) { return out + copy->start; });
  return LoadStart::kStarted;
}

}  // namespace radixkv
