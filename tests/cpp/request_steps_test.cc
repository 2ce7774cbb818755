#include "radixkv/request_steps.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "radixkv/status.h"
#include "tree_test_util.h"

namespace radixkv {
namespace {

using testing_util::Ints;

// What a scheduler holds for one request: its tokens, its slots (the
// cache's part, then pages of its own) and its locked handle.
struct Request {
  Ints tokens;
  Ints slots;
  Handle handle;
};

// Matches `tokens`, locks the handle and allocates pages for the rest.
Request Admit(RadixTree* tree, PageAllocator* pages, const Ints& tokens) {
  Request r{tokens, {}, {}};
  r.handle = tree->MatchPrefix(tokens.data(), static_cast<int64_t>(tokens.size()), &r.slots);
  tree->Lock(&r.handle);
  Ints own;
  pages->Allocate(static_cast<int64_t>(tokens.size()) - r.handle.cached_len, &own);
  r.slots.insert(r.slots.end(), own.begin(), own.end());
  return r;
}

FinishedRequest Finished(Request* r, int32_t priority = 0) {
  return {&r->handle,
          r->tokens.data(),
          static_cast<int64_t>(r->tokens.size()),
          r->slots.data(),
          static_cast<int64_t>(r->slots.size()),
          priority};
}

std::string MessageOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no radixkv::Error thrown";
  return "";
}

// Everything a failed call must leave as it was.
struct Snapshot {
  int64_t free_pages, nodes, evictable, protected_size, lock_count;
  bool operator==(const Snapshot& o) const {
    return free_pages == o.free_pages && nodes == o.nodes && evictable == o.evictable &&
           protected_size == o.protected_size && lock_count == o.lock_count;
  }
};
Snapshot Take(const RadixTree& t, const PageAllocator& p, const Handle& h) {
  return {p.num_free_pages(), t.num_nodes(), t.evictable_size(), t.protected_size(), h.lock_count};
}

TEST(HandleMatches, ComparesTokensAndEverySlotOfEachPage) {
  RadixTree tree(4, 64);
  const Ints tokens = testing_util::Iota(1, 12), slots = testing_util::Iota(20, 12);
  testing_util::Insert(&tree, Ints(tokens.begin(), tokens.begin() + 8),
                       Ints(slots.begin(), slots.begin() + 8));
  testing_util::Insert(&tree, tokens, slots);  // a second node below the first
  Ints got;
  const Handle h = tree.MatchPrefix(tokens.data(), 12, &got);
  ASSERT_EQ(h.cached_len, 12);
  EXPECT_TRUE(tree.HandleMatches(h, tokens.data()));
  EXPECT_TRUE(tree.HandleMatches(h, tokens.data(), slots.data()));
  for (int i : {0, 5, 11}) {  // a slot inside a page, in either node
    Ints other = slots;
    other[i] += 1;
    EXPECT_FALSE(tree.HandleMatches(h, tokens.data(), other.data())) << i;
    Ints other_tokens = tokens;
    other_tokens[i] = 99;
    EXPECT_FALSE(tree.HandleMatches(h, other_tokens.data())) << i;
  }
  Handle stale = h;
  stale.generation += 1;
  EXPECT_NE(MessageOf([&] { tree.HandleMatches(stale, tokens.data()); }).find("stale"),
            std::string::npos);
}

TEST(FinishRequest, CachesWholePagesFreesTheRestAndUnlocks) {
  RadixTree tree(4, 64);
  PageAllocator pages(16, 4);
  Request r = Admit(&tree, &pages, testing_util::Iota(100, 10));  // 2 whole pages + 2 tokens
  ASSERT_EQ(r.slots.size(), 12u);
  EXPECT_EQ(FinishRequest(&tree, &pages, Finished(&r)), 0);
  EXPECT_EQ(r.handle.lock_count, 0);
  EXPECT_EQ(tree.evictable_size(), 8);
  EXPECT_EQ(tree.protected_size(), 0);
  EXPECT_EQ(pages.num_free_pages(), 16 - 2);  // the partial page came back
  tree.CheckIntegrity();
  pages.CheckDisjoint(tree.stored_slots());
}

TEST(FinishRequest, FreesCopiesOfTokensCachedMeanwhile) {
  RadixTree tree(2, 64);
  PageAllocator pages(32, 2);
  const Ints tokens = testing_util::Iota(7, 8);
  Request a = Admit(&tree, &pages, tokens);
  Request b = Admit(&tree, &pages, tokens);  // both computed the same prefix
  EXPECT_EQ(FinishRequest(&tree, &pages, Finished(&a)), 0);
  const int64_t free_before = pages.num_free_pages();
  EXPECT_EQ(FinishRequest(&tree, &pages, Finished(&b)), 8);  // a cached it all
  EXPECT_EQ(pages.num_free_pages(), free_before + 4);        // b's four pages came back
  EXPECT_EQ(tree.evictable_size(), 8);
  tree.CheckIntegrity();
  pages.CheckDisjoint(tree.stored_slots());
}

TEST(FinishRequest, RefusesWhatCannotFinishChangingNothing) {
  RadixTree tree(2, 64);
  PageAllocator pages(32, 2);
  Request seed = Admit(&tree, &pages, {1, 2, 3, 4});
  FinishRequest(&tree, &pages, Finished(&seed));
  Request r = Admit(&tree, &pages, {1, 2, 3, 4, 5, 6, 7});  // 4 cached, 2 pages of its own
  ASSERT_EQ(r.handle.cached_len, 4);
  const Snapshot before = Take(tree, pages, r.handle);
  auto refused = [&](FinishedRequest f, const std::string& says) {
    const std::string msg = MessageOf([&] { FinishRequest(&tree, &pages, f); });
    EXPECT_NE(msg.find(says), std::string::npos) << msg;
    EXPECT_TRUE(Take(tree, pages, r.handle) == before) << msg;
    tree.CheckIntegrity();
  };
  FinishedRequest f = Finished(&r);
  f.m -= 2;  // not whole pages of input_ids
  refused(f, "indices has length 6 but must cover input_ids (length 7)");
  Ints wrong_cached = r.slots;
  wrong_cached[1] = 40;
  f = Finished(&r);
  f.slots = wrong_cached.data();
  refused(f, "indices[:4] must be the cache's slots");
  Ints free_page = r.slots;
  free_page[6] = 60;  // a page nobody allocated
  free_page[7] = 61;
  f = Finished(&r);
  f.slots = free_page.data();
  refused(f, "which is free");
  Ints repeated = r.slots;
  repeated[6] = repeated[4];
  repeated[7] = repeated[5];
  f = Finished(&r);
  f.slots = repeated.data();
  refused(f, "indices");
  Handle stale = r.handle;
  stale.generation += 1;
  f = Finished(&r);
  f.handle = &stale;
  refused(f, "old_handle is stale");
  Handle unlocked = r.handle;
  unlocked.lock_count = 0;
  f = Finished(&r);
  f.handle = &unlocked;
  refused(f, "old_handle is not locked");
  Ints other_tokens = r.tokens;
  other_tokens[3] = 99;  // not what the handle matched
  f = Finished(&r);
  f.tokens = other_tokens.data();
  refused(f, "input_ids[:4] are not the tokens old_handle matched");
  f = Finished(&r);
  f.n = 2;  // fewer tokens than the handle covers
  f.m = 2;
  refused(f, "old_handle covers 4 tokens but input_ids has only 2");
  RadixTree small(2, 6);  // pages past max_slots
  PageAllocator wide(32, 2);
  Request s = Admit(&small, &wide, {9, 9, 9, 9, 9, 9, 9, 9});
  const std::string msg = MessageOf([&] { FinishRequest(&small, &wide, Finished(&s)); });
  EXPECT_NE(msg.find("max_slots 6"), std::string::npos) << msg;
  EXPECT_EQ(s.handle.lock_count, 1);
  EXPECT_EQ(FinishRequest(&tree, &pages, Finished(&r)), 4);  // and the real one still finishes
}

TEST(CacheRequest, GoesOnWithTheCachesSlotsThenItsOwn) {
  RadixTree tree(2, 64);
  PageAllocator pages(32, 2);
  const Ints tokens = testing_util::Iota(5, 7);  // 3 whole pages and 1 token
  Request a = Admit(&tree, &pages, tokens);
  Request b = Admit(&tree, &pages, tokens);
  FinishRequest(&tree, &pages, Finished(&a));  // a caches the 3 pages first
  const int64_t free_before = pages.num_free_pages();
  Handle next;
  Ints out;
  EXPECT_EQ(CacheRequest(&tree, &pages, Finished(&b), &next, SlotSink::Into(&out)), 6);
  EXPECT_EQ(next.cached_len, 6);
  EXPECT_EQ(next.lock_count, 1);
  EXPECT_EQ(b.handle.lock_count, 0);
  ASSERT_EQ(out.size(), 8u);
  EXPECT_EQ(Ints(out.begin(), out.begin() + 6), Ints(a.slots.begin(), a.slots.begin() + 6));
  EXPECT_EQ(Ints(out.begin() + 6, out.end()), Ints(b.slots.begin() + 6, b.slots.end()));
  EXPECT_EQ(pages.num_free_pages(), free_before + 3);  // its copies of a's pages
  EXPECT_EQ(tree.protected_size(), 6);
  // A refusal changes nothing: the handle is not locked any more.
  const Snapshot before = Take(tree, pages, b.handle);
  const std::string msg =
      MessageOf([&] { CacheRequest(&tree, &pages, Finished(&b), &next, SlotSink::Into(&out)); });
  EXPECT_NE(msg.find("old_handle is not locked"), std::string::npos) << msg;
  EXPECT_TRUE(Take(tree, pages, b.handle) == before);
  tree.CheckIntegrity();
}

TEST(FinishRequests, ABatchEqualsItsRequestsOneByOne) {
  // The same admissions finished one by one and as a batch leave the same
  // tree and the same free pages.
  const std::vector<Ints> prompts = {
      {1, 2, 3, 4, 5}, {1, 2, 3, 4, 6, 7, 8}, {9, 9}, {1, 2, 3, 4, 5, 6}, {3}};
  RadixTree one(2, 64), many(2, 64);
  PageAllocator one_pages(32, 2), many_pages(32, 2);
  std::vector<Request> a, b;
  for (const Ints& p : prompts) {
    a.push_back(Admit(&one, &one_pages, p));
    b.push_back(Admit(&many, &many_pages, p));
  }
  std::vector<int64_t> singles;
  for (Request& r : a) singles.push_back(FinishRequest(&one, &one_pages, Finished(&r, 3)));
  std::vector<FinishedRequest> batch;
  for (Request& r : b) batch.push_back(Finished(&r, 3));
  std::vector<int64_t> counts(batch.size());
  FinishRequests(&many, &many_pages, batch.data(), static_cast<int64_t>(batch.size()),
                 counts.data());
  EXPECT_EQ(counts, singles);
  EXPECT_EQ(many_pages.num_free_pages(), one_pages.num_free_pages());
  EXPECT_EQ(many.num_nodes(), one.num_nodes());
  EXPECT_EQ(many.evictable_size(), one.evictable_size());
  EXPECT_EQ(many.protected_size(), 0);
  many.CheckIntegrity();
  many_pages.CheckDisjoint(many.stored_slots());
}

// The end of a request as it was before the insert walked on from the
// handle: the same checks, an insert walked from the root, the same frees.
int64_t FinishFromTheRoot(RadixTree* tree, PageAllocator* pages, const FinishedRequest& r) {
  CheckFinish(*tree, pages, r);
  const int64_t cached = r.handle->cached_len;
  const int64_t in_cache = tree->InsertPrefix(r.tokens, r.slots, r.n, r.priority, r.handle->ns);
  if (in_cache > cached) pages->Free(r.slots + cached, in_cache - cached, &tree->stored_slots());
  const int64_t full = r.n - r.n % tree->page_size();
  if (r.m > full) pages->Free(r.slots + full, r.m - full, &tree->stored_slots());
  tree->Unlock(r.handle);
  return in_cache;
}

void ExpectSameTrees(const RadixTree& a, const RadixTree& b) {
  const std::vector<NodeInfo> x = a.Dump(), y = b.Dump();
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i].parent, y[i].parent) << i;
    EXPECT_EQ(x[i].key, y[i].key) << i;
    EXPECT_EQ(x[i].value, y[i].value) << i;
    EXPECT_EQ(x[i].ref_count, y[i].ref_count) << i;
    EXPECT_EQ(x[i].timestamp, y[i].timestamp) << i;
  }
}

TEST(FinishRequest, WalkingOnFromTheHandleEqualsWalkingFromTheRoot) {
  // Requests share prefixes, finish in random order (so earlier finishes
  // split and extend the paths of later ones), and evictions come between
  // rounds: every finish leaves the tree, the counts and the free pages of
  // an insert walked from the root.
  for (const int64_t ps : {1, 2, 4, 16}) {
    std::mt19937 rng(static_cast<uint32_t>(ps));
    RadixTree a(ps), b(ps);
    PageAllocator a_pages(4096 / ps, ps), b_pages(4096 / ps, ps);
    int64_t most_nodes = 0;
    std::vector<Ints> bases;
    for (int k = 0; k < 4; ++k) {
      Ints base;
      for (int64_t i = 0; i < 3 * ps + k; ++i) base.push_back(static_cast<int32_t>(rng() % 3));
      bases.push_back(base);
    }
    for (int round = 0; round < 60; ++round) {
      std::vector<Request> ra, rb;
      const int count = 1 + static_cast<int>(rng() % 6);
      for (int j = 0; j < count; ++j) {
        Ints tokens = bases[rng() % bases.size()];
        const int64_t extra = static_cast<int64_t>(rng() % (3 * ps + 2));
        for (int64_t i = 0; i < extra; ++i) tokens.push_back(static_cast<int32_t>(rng() % 3));
        ra.push_back(Admit(&a, &a_pages, tokens));
        rb.push_back(Admit(&b, &b_pages, tokens));
        ASSERT_EQ(ra.back().slots, rb.back().slots);
      }
      std::vector<size_t> order(static_cast<size_t>(count));
      std::iota(order.begin(), order.end(), size_t{0});
      std::shuffle(order.begin(), order.end(), rng);
      for (size_t j : order) {
        EXPECT_EQ(FinishRequest(&a, &a_pages, Finished(&ra[j])),
                  FinishFromTheRoot(&b, &b_pages, Finished(&rb[j])));
        ExpectSameTrees(a, b);
        ASSERT_EQ(a_pages.num_free_pages(), b_pages.num_free_pages());
        most_nodes = std::max(most_nodes, a.num_nodes());
      }
      if (round % 5 == 4 && a.evictable_size() > 0) {
        const int64_t size = 1 + static_cast<int64_t>(rng() % a.evictable_size());
        Ints fa, fb;
        a.Evict(size, &fa);
        b.Evict(size, &fb);
        ASSERT_EQ(fa, fb);
        a_pages.Free(fa.data(), static_cast<int64_t>(fa.size()));
        b_pages.Free(fb.data(), static_cast<int64_t>(fb.size()));
      }
    }
    a.CheckIntegrity();
    EXPECT_GT(most_nodes, 8) << "page_size " << ps;
  }
}

TEST(FinishRequests, RefusesPagesOrUnlocksTwoRequestsShareChangingNothing) {
  RadixTree tree(2, 64);
  PageAllocator pages(32, 2);
  Request a = Admit(&tree, &pages, {1, 2, 3, 4});
  Request b = Admit(&tree, &pages, {5, 6, 7, 8});
  Ints stolen = b.slots;
  stolen[2] = a.slots[0];  // b claims a's first page too
  stolen[3] = a.slots[1];
  std::vector<FinishedRequest> batch = {Finished(&a), Finished(&b)};
  batch[1].slots = stolen.data();
  const int64_t free_before = pages.num_free_pages();
  std::vector<int64_t> counts(2, -1);
  std::string msg =
      MessageOf([&] { FinishRequests(&tree, &pages, batch.data(), 2, counts.data()); });
  EXPECT_NE(msg.find("batch[0] indices and batch[1] indices both hold page"), std::string::npos)
      << msg;
  batch = {Finished(&a), Finished(&a)};  // one lock, two unlocks
  msg = MessageOf([&] { FinishRequests(&tree, &pages, batch.data(), 2, counts.data()); });
  EXPECT_NE(msg.find("appears 2 times in the batch but holds 1 locks"), std::string::npos) << msg;
  batch = {Finished(&a), Finished(&b)};
  batch[1].m = 2;
  msg = MessageOf([&] { FinishRequests(&tree, &pages, batch.data(), 2, counts.data()); });
  EXPECT_NE(msg.find("batch[1] indices has length 2"), std::string::npos) << msg;
  EXPECT_EQ(counts, (std::vector<int64_t>{-1, -1}));
  EXPECT_EQ(pages.num_free_pages(), free_before);
  EXPECT_EQ(tree.num_nodes(), 0);
  EXPECT_EQ(a.handle.lock_count, 1);
  EXPECT_EQ(b.handle.lock_count, 1);
  batch = {Finished(&a), Finished(&b)};
  FinishRequests(&tree, &pages, batch.data(), 2, counts.data());
  EXPECT_EQ(counts, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(tree.evictable_size(), 8);
}

}  // namespace
}  // namespace radixkv
