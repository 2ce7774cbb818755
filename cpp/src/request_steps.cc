#include "radixkv/request_steps.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "radixkv/status.h"

namespace radixkv {
namespace {

constexpr ErrorCode kInvalid = ErrorCode::kInvalidArgument;

// Entries of `r.slots` for `tokens` tokens (whole pages): slots or pages.
int64_t Units(const FinishedRequest& r, int64_t tokens, int64_t page_size) noexcept {
  return r.pages ? tokens / page_size : tokens;
}

// Where the request's own entries start: after the cache's part.
int64_t OwnStart(const FinishedRequest& r, int64_t page_size) noexcept {
  return Units(r, r.handle->cached_len, page_size);
}

// The name of the request's own entries in messages: `name[k:]` from their
// start k, so that "indices[12:][1]" is indices[13].
std::string OwnName(const std::string& name, int64_t start) {
  return start > 0 ? StrCat(name, "[", start, ":]") : name;
}

// Returns the request's entries [from, to) to `pages`.
void FreeRange(PageAllocator* pages, const RadixTree& tree, const FinishedRequest& r,
               int64_t from, int64_t to) {
  if (to <= from) return;
  if (r.pages) {
    pages->FreePages(r.slots + from, to - from, &tree.stored_slots());
  } else {
    pages->Free(r.slots + from, to - from, &tree.stored_slots());
  }
}

// The insert, the frees and the unlock of a request CheckFinish passed.
int64_t Apply(RadixTree* tree, PageAllocator* pages, const FinishedRequest& r) {
  const int64_t ps = tree->page_size();
  const int64_t cached = OwnStart(r, ps);
  // CheckFinish compared the handle's path with the tokens: the insert walks on from it.
  const int64_t in_cache = tree->InsertPrefix(r.tokens, SlotSource(r.slots, r.pages), r.n,
                                              r.priority, r.handle->ns, r.handle);
  // Its copies of tokens another request cached meanwhile.
  FreeRange(pages, *tree, r, cached, Units(r, in_cache, ps));
  // Its partial last page, never cached.
  FreeRange(pages, *tree, r, Units(r, r.n - r.n % ps, ps), r.m);
  tree->Unlock(r.handle);
  return in_cache;
}

}  // namespace

void CheckFinish(const RadixTree& tree, PageAllocator* pages, const FinishedRequest& r,
                 const std::string& where) {
  const int64_t ps = tree.page_size();
  tree.RequireAligned(r.pages);
  RADIXKV_CHECK(pages == nullptr || pages->page_size() == ps, kInvalid, "pages has page_size ",
                pages == nullptr ? 0 : pages->page_size(), " but the tree has ", ps);
  RADIXKV_CHECK(r.n >= 0, kInvalid, where, "input_ids length must be >= 0, got ", r.n);
  const int64_t whole = (r.n + ps - 1) / ps * (r.pages ? 1 : ps);
  const char* name = r.pages ? "page_ids" : "indices";
  RADIXKV_CHECK(r.m == whole, kInvalid, where, name, " has length ", r.m, " but must cover ",
                where, "input_ids (length ", r.n, ") in whole pages of ", ps, ": expected ", whole);
  const Handle& h = *r.handle;
  RADIXKV_CHECK(tree.IsValid(h), kInvalid, where,
                "old_handle is stale or belongs to another cache manager");
  RADIXKV_CHECK(h.lock_count >= 1, kInvalid, where,
                "old_handle is not locked: lock it after the match");
  RADIXKV_CHECK(h.cached_len <= r.n, kInvalid, where, "old_handle covers ", h.cached_len,
                " tokens but ", where, "input_ids has only ", r.n);
  if (h.cached_len > 0) {
    // The insert must start where the match ended (or later), or it could
    // refuse after a batch's earlier requests finished; and slots other than
    // the match's would be stored or freed as if they were the cache's.
    bool same = false;
    try {
      same = tree.HandleMatches(h, r.tokens, SlotSource(r.slots, r.pages));
    } catch (const Error& e) {
      throw Error(e.code(), StrCat(where, "old_handle: ", e.what()));
    }
    if (!same) {
      RADIXKV_CHECK(tree.HandleMatches(h, r.tokens), kInvalid, where, "input_ids[:", h.cached_len,
                    "] are not the tokens ", where, "old_handle matched");
      throw Error(kInvalid, StrCat(where, name, "[:", Units(r, h.cached_len, ps), "] must be the cache's ",
                                   r.pages ? "pages" : "slots", " that the match returned with ",
                                   where, "old_handle"));
    }
  }
  const std::string own_name = OwnName(where + name, OwnStart(r, ps));
  const int32_t* own = r.slots + OwnStart(r, ps);
  const int64_t count = r.m - OwnStart(r, ps);
  if (pages != nullptr) {
    if (r.pages) {
      pages->CheckFreePages(own, count, own_name.c_str(), &tree.stored_slots());
    } else {
      pages->CheckFree(own, count, own_name.c_str(), &tree.stored_slots());
    }
  }
  if (tree.max_slots() != RadixTree::kAnySlot) {
    const int64_t step = r.pages ? 1 : ps;
    for (int64_t i = 0; i < count; i += step) {
      const int64_t first = r.pages ? int64_t{own[i]} * ps : own[i];
      RADIXKV_CHECK(first + ps <= tree.max_slots(), kInvalid, own_name, "[", i, "] = ", own[i],
                    " starts a page that ends past the cache's max_slots ", tree.max_slots());
    }
  }
}

int64_t FinishRequest(RadixTree* tree, PageAllocator* pages, const FinishedRequest& r) {
  CheckFinish(*tree, pages, r);
  return Apply(tree, pages, r);
}

int64_t CacheRequest(RadixTree* tree, PageAllocator* pages, const FinishedRequest& r,
                     Handle* new_handle, SlotSink out) {
  CheckFinish(*tree, pages, r);
  const int64_t ps = tree->page_size();
  const int64_t cached = OwnStart(r, ps);
  const int64_t in_cache = tree->InsertPrefix(r.tokens, SlotSource(r.slots, r.pages), r.n,
                                              r.priority, r.handle->ns, r.handle);
  // Past the insert only `out` can throw (a failed allocation): the request
  // is cached then, and still holds its old handle.
  int32_t* slots = nullptr;
  auto into_out = [&](int64_t) { return slots = out(r.m); };
  const SlotSink match_out = into_out;
  *new_handle =
      tree->MatchPrefix(r.tokens, r.n, r.pages ? match_out.Pages() : match_out, r.handle->ns);
  if (slots == nullptr) slots = out(r.m);
  const int64_t now_cached = Units(r, new_handle->cached_len, ps);
  std::copy(r.slots + now_cached, r.slots + r.m, slots + now_cached);
  // Its copies of tokens another request cached meanwhile (now the match's).
  FreeRange(pages, *tree, r, cached, std::min(Units(r, in_cache, ps), now_cached));
  tree->Lock(new_handle);
  tree->Unlock(r.handle);
  return in_cache;
}

void FinishRequests(RadixTree* tree, PageAllocator* pages, const FinishedRequest* batch, int64_t k,
                    int64_t* in_cache, const char* what) {
  RADIXKV_CHECK(tree->tier_sizes().loading == 0, kInvalid,
                "a load from host is in flight: wait for it (loading_check) before finishing "
                "a batch");
  RADIXKV_CHECK(pages->page_size() == tree->page_size(), kInvalid, "pages has page_size ",
                pages->page_size(), " but the tree has ", tree->page_size());
  // Each request alone, then its own pages as one (no page in two
  // requests), then its unlocks (a handle as often as it is locked).
  std::vector<PageAllocator::Span> own(static_cast<size_t>(k));
  std::vector<std::pair<Handle*, int64_t>> unlocks;
  for (int64_t i = 0; i < k; ++i) {
    const FinishedRequest& r = batch[i];
    const std::string where = StrCat(what, "[", i, "] ");
    CheckFinish(*tree, nullptr, r, where);
    const int64_t from = OwnStart(r, tree->page_size());
    own[i] = {r.slots + from, r.m - from, where + (r.pages ? "page_ids" : "indices"), r.pages};
    unlocks.emplace_back(r.handle, i);
  }
  std::sort(unlocks.begin(), unlocks.end());
  for (size_t j = 0; j < unlocks.size();) {
    size_t e = j;
    while (e < unlocks.size() && unlocks[e].first == unlocks[j].first) ++e;
    const int64_t uses = static_cast<int64_t>(e - j);
    RADIXKV_CHECK(uses <= unlocks[j].first->lock_count, kInvalid, what, "[", unlocks[j].second,
                  "] old_handle appears ", uses, " times in the batch but holds ",
                  unlocks[j].first->lock_count, " locks");
    j = e;
  }
  pages->CheckFreeAll(own.data(), k, &tree->stored_slots());
  for (int64_t i = 0; i < k; ++i) in_cache[i] = Apply(tree, pages, batch[i]);
}

}  // namespace radixkv
