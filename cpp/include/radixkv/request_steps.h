// The end of a request, one call: the checks, the insert of its whole pages,
// the return of the pages it no longer needs, and its unlock. It touches the
// tree and the device pool's pages, so it lives beside them, not in either.
#pragma once

#include <cstdint>
#include <string>

#include "radixkv/page_allocator.h"
#include "radixkv/radix_tree.h"
#include "radixkv/slot_sink.h"

namespace radixkv {

/// A finished request: it holds `handle` (locked, from MatchPrefix) and the
/// slots `slots[0, m)` of `tokens[0, n)`; the first `handle->cached_len`
/// slots are the cache's (those MatchPrefix wrote), the rest its own pages.
/// With `pages`, `slots[0, m)` are page ids instead (m pages; the first
/// `cached_len / page_size` the cache's).
struct FinishedRequest {
  Handle* handle = nullptr;
  const int32_t* tokens = nullptr;
  int64_t n = 0;
  const int32_t* slots = nullptr;
  int64_t m = 0;
  int32_t priority = 0;
  bool pages = false;
};

/// Throws kInvalidArgument unless `r` can finish: m is n in whole pages, the
/// handle is this tree's, live and locked, covers at most n tokens, which
/// are `tokens[0, cached_len)`, its slots are `slots[0, cached_len)`
/// (on the device), and the rest are whole pages that
/// `pages` allocated, none twice, none cached, below the tree's max_slots.
/// `where` prefixes each argument's name in the message ("" or "batch[3]
/// "). Changes nothing (Free's checks run on `pages`, which they leave as
/// they found it). With `pages` null the request's own pages are left for
/// the caller to check (PageAllocator::CheckFree or CheckFreeAll).
void CheckFinish(const RadixTree& tree, PageAllocator* pages, const FinishedRequest& r,
                 const std::string& where = "");

/// CheckFinish, then InsertPrefix of the request's whole pages (in the
/// handle's namespace, with its priority), then frees into `pages` its copies
/// of tokens another request cached meanwhile and its partial last page, and
/// unlocks the handle. Returns InsertPrefix's count (tokens that were on the
/// device already). Throws what CheckFinish and InsertPrefix throw, and then
/// nothing changed.
int64_t FinishRequest(RadixTree* tree, PageAllocator* pages, const FinishedRequest& r);

/// The same for a request that goes on (a chunk of a chunked prefill):
/// CheckFinish, InsertPrefix, then MatchPrefix of its tokens (`*new_handle`,
/// locked; `old_handle` unlocked), frees its copies of tokens the match now
/// covers, and writes the slots it goes on with to `out(m)`: the cache's
/// for the matched part, then its own. Returns InsertPrefix's count. Throws
/// what CheckFinish and InsertPrefix throw, and then nothing changed; past
/// the insert only `out` can throw, leaving the request cached and still
/// holding `old_handle`.
int64_t CacheRequest(RadixTree* tree, PageAllocator* pages, const FinishedRequest& r,
                     Handle* new_handle, SlotSink out);

/// FinishRequest of each of `batch[0, k)` in order, writing the counts to
/// `in_cache[0, k)`. Every request is checked first, and together: no page
/// held by two of them, no handle unlocked more often than it is locked, no
/// load in flight on the tree (any insert could meet one). Throws, changing
/// nothing, when a check fails; past the checks only a failed allocation
/// can throw, and the requests before the one it stopped are finished.
/// Messages name request i as `what[i]` ("batch[3] indices has length ...").
void FinishRequests(RadixTree* tree, PageAllocator* pages, const FinishedRequest* batch, int64_t k,
                    int64_t* in_cache, const char* what = "batch");

}  // namespace radixkv
