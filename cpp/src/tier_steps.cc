#include "radixkv/tier_steps.h"

namespace radixkv {

BackupStart StartBackup(RadixTree* tree, PageAllocator* host_pages, const int32_t* tokens,
                        int64_t n, uint32_t min_hits, bool through_partial, uint64_t ns,
                        TierCopy* copy, SlotSink device, SlotSink host) {
  tree->RequireAligned(device.pages() || host.pages());
  if (!tree->FindBackup(tokens, n, min_hits, copy, through_partial, ns)) {
    return BackupStart::kNothing;
  }
  const int64_t pages = (copy->length() + tree->page_size() - 1) / tree->page_size();
  if (pages > host_pages->num_free_pages()) return BackupStart::kNoRoom;
  int32_t* slots = nullptr;
  auto take = [&](int64_t k) { return slots = host(k); };
  const SlotSink into = take;
  host_pages->Allocate(copy->length(), host.pages() ? into.Pages() : into);
  try {
    tree->BeginBackup(*copy, device);
  } catch (...) {
    if (host.pages()) {
      host_pages->FreePages(slots, pages);
    } else {
      host_pages->Free(slots, copy->length());
    }
    throw;
  }
  return BackupStart::kStarted;
}

int64_t FinishBackup(RadixTree* tree, PageAllocator* host_pages, const TierCopy& copy,
                     SlotSource host, bool ok, SlotSink rejected) {
  // Every slot must be able to go back before the tree changes: what the
  // tree does not take is freed after it changed. (So they are whole pages
  // in range, which the tree need not check again.)
  const int64_t ps = tree->page_size();
  if (host.pages) {
    host_pages->CheckFreePages(host.data, copy.length() / ps, "host_pages",
                               &tree->stored_host_slots());
  } else {
    host_pages->CheckFree(host.data, copy.length(), "host_slots", &tree->stored_host_slots());
  }
  int32_t* out = nullptr;
  auto take = [&](int64_t m) { return out = rejected(m); };
  const int64_t k = tree->FinishBackup(copy, host, ok, take, /*host_checked=*/true);
  if (k > 0 && host.pages) {
    host_pages->FreePages(out, k / ps, &tree->stored_host_slots());
  } else if (k > 0) {
    host_pages->Free(out, k, &tree->stored_host_slots());
  }
  return k;
}

LoadStart StartLoad(RadixTree* tree, PageAllocator* device_pages, const Handle& handle,
                    TierCopy* copy, Handle* loaded, SlotSink host, SlotSink indices) {
  tree->RequireAligned(host.pages() || indices.pages());
  *copy = tree->FindLoad(handle);
  if (copy->end == handle.cached_len) return LoadStart::kNothing;
  const int64_t ps = tree->page_size();
  const int64_t pages = (copy->length() + ps - 1) / ps;
  if (pages > device_pages->num_free_pages()) return LoadStart::kNoRoom;
  // `indices` takes the prefix's entries, then the new pages' (slots or ids).
  const bool as_pages = indices.pages();
  int32_t* out = nullptr;
  auto prefix = [&](int64_t k) { return out = indices(k + (as_pages ? pages : pages * ps)); };
  const SlotSink prefix_sink = prefix;
  tree->BeginLoad(*copy, host, as_pages ? prefix_sink.Pages() : prefix_sink, loaded);
  // The pages are there: taking them cannot fail.
  auto fresh = [&](int64_t) { return out + (as_pages ? copy->start / ps : copy->start); };
  const SlotSink fresh_sink = fresh;
  device_pages->Allocate(copy->length(), as_pages ? fresh_sink.Pages() : fresh_sink);
  return LoadStart::kStarted;
}

}  // namespace radixkv
