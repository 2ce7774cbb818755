#include "radixkv/page_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "radixkv/slot_set.h"
#include "radixkv/status.h"

namespace radixkv {
namespace {

ErrorCode CodeOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  ADD_FAILURE() << "no radixkv::Error thrown";
  return ErrorCode::kIntegrity;
}

TEST(PageAllocator, HandsOutWholePagesInOrder) {
  PageAllocator a(4, 3);
  std::vector<int32_t> slots;
  a.Allocate(4, &slots);  // rounds up to two pages
  EXPECT_EQ(slots, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(a.num_free_pages(), 2);
  a.Allocate(0, &slots);
  EXPECT_TRUE(slots.empty());
  EXPECT_EQ(a.num_free_pages(), 2);
}

TEST(PageAllocator, FreedPagesComeBackFirst) {
  PageAllocator a(4, 2);
  std::vector<int32_t> slots;
  a.Allocate(8, &slots);
  std::vector<int32_t> page2{4, 5};
  a.Free(page2.data(), 2);
  a.Allocate(1, &slots);
  EXPECT_EQ(slots, page2);
}

TEST(PageAllocator, OutOfCapacityTakesNothing) {
  PageAllocator a(2, 2);
  std::vector<int32_t> slots{7};
  EXPECT_EQ(CodeOf([&] { a.Allocate(5, &slots); }), ErrorCode::kOutOfCapacity);
  EXPECT_EQ(a.num_free_pages(), 2);
  EXPECT_EQ(CodeOf([&] { a.Allocate(-1, &slots); }), ErrorCode::kInvalidArgument);
}

TEST(PageAllocator, FreeRejectsBadPagesAndChangesNothing) {
  PageAllocator a(4, 2);
  std::vector<int32_t> slots;
  a.Allocate(4, &slots);  // pages 0 and 1
  const std::vector<std::vector<int32_t>> bad = {
      {0},           // not a whole page
      {1, 2},        // not page-aligned
      {0, 2},        // not consecutive
      {4, 5},        // page 2 is free
      {-2, -1},      // out of range
      {8, 9},        // out of range
      {0, 1, 0, 1},  // repeated page
  };
  for (const auto& b : bad) {
    EXPECT_EQ(CodeOf([&] { a.Free(b.data(), static_cast<int64_t>(b.size())); }),
              ErrorCode::kInvalidArgument);
    EXPECT_EQ(a.num_free_pages(), 2);
  }
  SlotSet cached;
  std::vector<int32_t> page0{0, 1};
  ASSERT_EQ(cached.AddAll(page0.data(), 2), -1);
  EXPECT_EQ(CodeOf([&] { a.Free(page0.data(), 2, &cached); }), ErrorCode::kInvalidArgument);
  a.Free(page0.data(), 2);
  EXPECT_EQ(a.num_free_pages(), 3);
}

TEST(PageAllocator, CheckDisjointFindsAPageBothFreeAndCached) {
  PageAllocator a(3, 2);
  SlotSet cached;
  a.CheckDisjoint(cached);
  std::vector<int32_t> slot{3};
  cached.AddAll(slot.data(), 1);  // page 1 is free but "cached"
  EXPECT_EQ(CodeOf([&] { a.CheckDisjoint(cached); }), ErrorCode::kIntegrity);
}

TEST(PageAllocator, CheckFreeAllNamesAPageTwoSpansShare) {
  PageAllocator a(8, 2);
  std::vector<int32_t> slots;
  a.Allocate(8, &slots);  // pages 0..3
  const std::vector<int32_t> x{0, 1, 2, 3}, y{4, 5, 2, 3}, z{6, 7, 6, 7};
  auto message = [&](std::vector<PageAllocator::Span> spans) {
    try {
      a.CheckFreeAll(spans.data(), static_cast<int64_t>(spans.size()));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(message({{x.data(), 4, "a"}, {y.data(), 4, "b"}}), "a and b both hold page 1");
  EXPECT_EQ(message({{x.data(), 4, "a"}, {z.data(), 4, "c"}}), "c[2] = 6 repeats page 3");
  EXPECT_NE(message({{x.data(), 4, "a"}, {slots.data(), 2, "d"}}).find("both hold page 0"),
            std::string::npos);
  const std::vector<int32_t> free_page{8, 9};
  EXPECT_NE(message({{free_page.data(), 2, "e"}}).find("which is free"), std::string::npos);
  // Nothing stays marked: the spans that are fine together pass, and free.
  const std::vector<int32_t> w{4, 5}, v{6, 7};
  EXPECT_EQ(message({{x.data(), 4, "a"}, {w.data(), 2, "b"}, {v.data(), 2, "c"}}), "");
  EXPECT_EQ(a.num_free_pages(), 4);
  a.Free(slots.data(), 8);
  EXPECT_EQ(a.num_free_pages(), 8);
}

TEST(PageAllocator, RandomAllocateFreeKeepsEveryPageOnce) {
  std::mt19937 rng(7);
  for (int64_t page_size : {1, 4, 16}) {
    PageAllocator a(64, page_size);
    std::vector<std::vector<int32_t>> held;
    for (int step = 0; step < 5000; ++step) {
      if (held.empty() || rng() % 2) {
        int64_t n = rng() % (3 * page_size + 1);
        std::vector<int32_t> slots;
        try {
          a.Allocate(n, &slots);
        } catch (const Error& e) {
          ASSERT_EQ(e.code(), ErrorCode::kOutOfCapacity);
          continue;
        }
        held.push_back(slots);
      } else {
        size_t k = rng() % held.size();
        a.Free(held[k].data(), static_cast<int64_t>(held[k].size()));
        held.erase(held.begin() + k);
      }
      std::set<int32_t> pages;
      int64_t count = 0;
      for (const auto& h : held) {
        for (size_t i = 0; i < h.size(); i += page_size) {
          pages.insert(h[i] / page_size);
          ++count;
        }
      }
      ASSERT_EQ(static_cast<int64_t>(pages.size()), count) << "a page was handed out twice";
      ASSERT_EQ(a.num_free_pages() + count, 64);
      for (int32_t p : pages) ASSERT_FALSE(a.IsFree(p));
    }
  }
}

// Free and CheckFree check runs of consecutive slots a run at a time, and
// fall back to page by page when a run fails. Either way they must accept
// exactly the inputs a page-by-page reading accepts, and change nothing on
// a refusal.
TEST(PageAllocator, RunChecksAcceptExactlyWhatPagesWould) {
  std::mt19937 rng(11);
  for (int64_t ps : {1, 4}) {
    const int64_t num_pages = 64;
    for (int round = 0; round < 400; ++round) {
      PageAllocator a(num_pages, ps);
      std::vector<int32_t> held;
      a.Allocate(48 * ps, &held);  // pages 0..47 allocated, 48..63 free
      SlotSet cached;
      const int32_t cached_page = static_cast<int32_t>(40 + rng() % 8);
      for (int64_t j = 0; j < ps; ++j) {
        const int32_t slot = static_cast<int32_t>(cached_page * ps + j);
        ASSERT_EQ(cached.AddAll(&slot, 1), -1);
      }
      // Runs of whole allocated pages (below the cached one), in random order.
      std::vector<int32_t> input;
      for (int r = 0, runs = 1 + static_cast<int>(rng() % 4); r < runs; ++r) {
        const int64_t first = rng() % 36, len = 1 + rng() % 4;
        for (int64_t s = first * ps; s < (first + len) * ps; ++s) {
          input.push_back(static_cast<int32_t>(s));
        }
      }
      // One defect, or none.
      switch (rng() % 7) {
        case 0:
          input.push_back(static_cast<int32_t>(50 * ps));
          break;  // a free page
        case 1:
          input.push_back(static_cast<int32_t>(num_pages * ps));
          break;  // out of range
        case 2:
          input.push_back(static_cast<int32_t>(cached_page * ps));
          break;  // cached
        case 3:
          input.insert(input.begin(), 1);
          break;  // mid-page or repeat
        case 4:
          if (!input.empty()) input.push_back(input.front());
          break;  // a repeat
        default:
          break;
      }
      if (ps > 1 && input.size() % ps != 0) {
        while (input.size() % ps != 0) input.push_back(input.back() + 1);
      }
      // The reference: whole aligned pages, in range, allocated, not cached, once each.
      bool valid = input.size() % ps == 0;
      std::set<int64_t> pages;
      for (size_t i = 0; valid && i < input.size(); i += ps) {
        const int64_t s = input[i];
        valid = s >= 0 && s < num_pages * ps && s % ps == 0 && !a.IsFree(s / ps) &&
                s / ps != cached_page && pages.insert(s / ps).second;
        for (int64_t j = 1; valid && j < ps; ++j) valid = input[i + j] == s + j;
      }
      std::vector<bool> before(num_pages);
      for (int64_t p = 0; p < num_pages; ++p) before[p] = a.IsFree(p);
      const int64_t n = static_cast<int64_t>(input.size());
      bool refused = false;
      try {
        a.CheckFree(input.data(), n, "indices", &cached);
      } catch (const Error& e) {
        ASSERT_EQ(e.code(), ErrorCode::kInvalidArgument);
        refused = true;
      }
      ASSERT_EQ(refused, !valid) << "page size " << ps << ", round " << round;
      for (int64_t p = 0; p < num_pages; ++p) ASSERT_EQ(a.IsFree(p), before[p]);
      refused = false;
      try {
        a.Free(input.data(), n, &cached);
      } catch (const Error& e) {
        ASSERT_EQ(e.code(), ErrorCode::kInvalidArgument);
        refused = true;
      }
      ASSERT_EQ(refused, !valid);
      for (int64_t p = 0; p < num_pages; ++p) {
        ASSERT_EQ(a.IsFree(p), before[p] || (valid && pages.count(p) > 0)) << "page " << p;
      }
      ASSERT_EQ(a.num_free_pages(), 16 + (valid ? static_cast<int64_t>(pages.size()) : 0));
    }
  }
}

TEST(SlotSet, AnyInAgreesWithContains) {
  std::mt19937 rng(5);
  SlotSet s;
  std::set<int32_t> in;
  // Slots around word and chunk edges, and beyond the last chunk.
  for (int32_t slot : {0, 63, 64, 127, 65535, 65536, 65600, 131071, 200000}) {
    ASSERT_EQ(s.AddAll(&slot, 1), -1);
    in.insert(slot);
  }
  for (int k = 0; k < 3000; ++k) {
    const int64_t lo = rng() % 270000, hi = lo + rng() % (k % 2 ? 200 : 70000);
    const auto it = in.lower_bound(static_cast<int32_t>(lo));
    const bool want = it != in.end() && *it < hi;
    ASSERT_EQ(s.AnyIn(lo, hi), want) << "[" << lo << ", " << hi << ")";
  }
  EXPECT_FALSE(s.AnyIn(5, 5));
  EXPECT_TRUE(s.AnyIn(63, 64));
  EXPECT_FALSE(s.AnyIn(1, 63));
}

TEST(SlotSet, AddAllIsAllOrNothing) {
  SlotSet s;
  std::vector<int32_t> a{1, 2, 3, 200};
  EXPECT_EQ(s.AddAll(a.data(), 4), -1);
  EXPECT_EQ(s.Count(), 4);
  std::vector<int32_t> b{5, 6, 200, 7};
  EXPECT_EQ(s.AddAll(b.data(), 4), 2);  // 200 is present
  EXPECT_EQ(s.Count(), 4);
  EXPECT_FALSE(s.Contains(5));
  std::vector<int32_t> c{9, 64, 9};
  EXPECT_EQ(s.AddAll(c.data(), 3), 2);  // repeats within the run
  EXPECT_EQ(s.Count(), 4);
  s.RemoveAll(a.data(), 4);
  EXPECT_EQ(s.Count(), 0);
}

TEST(SlotSet, FindRepeatAndNegative) {
  SlotSet scratch;
  std::vector<int32_t> x{3, 1, 4, 1, 5};
  EXPECT_EQ(FindRepeat(x.data(), 5, &scratch), 3);
  EXPECT_EQ(scratch.Count(), 0);
  std::vector<int32_t> y{3, 1, 4, 100000};
  EXPECT_EQ(FindRepeat(y.data(), 4, &scratch), -1);
  EXPECT_EQ(scratch.Count(), 0);
  std::vector<int32_t> z{0, 2, -5};
  EXPECT_EQ(FindOutOfRange(z.data(), 3), 2);
  EXPECT_EQ(FindOutOfRange(y.data(), 4), -1);
}


// The page forms: page ids out and in, the same checks as the slot forms.
TEST(PageAllocatorTest, PageIdsComeAndGoAsTheirSlotsDo) {
  PageAllocator pages(8, 4);
  std::vector<int32_t> ids;
  auto fill = SlotSink::Into(&ids);  // (a SlotSink refers to its callable)
  const SlotSink into = fill;
  pages.Allocate(9, into.Pages());  // three pages, ids only
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(pages.num_free_pages(), 5);
  SlotSet cached;
  cached.AddPageIds(ids.data(), 1, 4);  // page 0's slots 0..3
  EXPECT_THROW(pages.FreePages(ids.data(), 3, &cached), Error);  // page 0 is cached
  const std::vector<int32_t> twice{1, 1};
  EXPECT_THROW(pages.FreePages(twice.data(), 2), Error);
  const std::vector<int32_t> outside{8};
  EXPECT_THROW(pages.FreePages(outside.data(), 1), Error);
  const std::vector<int32_t> free_one{5};
  EXPECT_THROW(pages.FreePages(free_one.data(), 1), Error);
  EXPECT_EQ(pages.num_free_pages(), 5);  // every refusal changed nothing
  pages.FreePages(ids.data() + 1, 2, &cached);
  EXPECT_EQ(pages.num_free_pages(), 7);
  pages.CheckDisjoint(cached);
  std::vector<int32_t> slots;
  pages.Allocate(4, &slots);  // the batch freed last comes back first, in its order
  EXPECT_EQ(slots, (std::vector<int32_t>{4, 5, 6, 7}));
}

TEST(PageAllocatorTest, ABatchFreedComesBackAsTheRunItWas) {
  // LIFO by batch, each batch in its own order: pages a node held as a run
  // are handed out as that run again, by page ids and by slots alike.
  PageAllocator pages(16, 4);
  std::vector<int32_t> ids, slots;
  pages.Allocate(64, SlotSink(SlotSink::Into(&ids)).Pages());
  const std::vector<int32_t> run{5, 6, 7}, later{2, 3};
  pages.FreePages(run.data(), 3);
  pages.FreePages(later.data(), 2);
  pages.Allocate(20, SlotSink(SlotSink::Into(&ids)).Pages());
  EXPECT_EQ(ids, (std::vector<int32_t>{2, 3, 5, 6, 7}));
  // Slots: the same order, run by run and page by page.
  std::vector<int32_t> freed;
  for (int32_t s = 40; s < 48; ++s) freed.push_back(s);  // pages 10, 11
  for (int32_t s = 4; s < 8; ++s) freed.push_back(s);    // page 1
  pages.Free(freed.data(), static_cast<int64_t>(freed.size()));
  pages.Allocate(12, &slots);
  EXPECT_EQ(slots, freed);
  // A batch that is no run at all (page by page) keeps its order too.
  const std::vector<int32_t> scattered{12, 13, 14, 15, 0, 1, 2, 3, 8, 9, 10, 11};
  pages.Free(scattered.data(), 12);
  pages.Allocate(12, &slots);
  EXPECT_EQ(slots, scattered);
}

TEST(PageAllocatorTest, APageAtFaultInARunIsNamedByItsPlace) {
  // The checks take a run of consecutive ids at a time; a refusal still
  // names the id at fault by its place in the input.
  PageAllocator pages(16, 4);
  std::vector<int32_t> ids;
  pages.Allocate(40, SlotSink(SlotSink::Into(&ids)).Pages());  // pages 0..9
  const std::vector<int32_t> one{6};
  pages.FreePages(one.data(), 1);
  SlotSet cached;
  cached.AddPageIds(ids.data() + 8, 1, 4);  // page 8
  auto message = [&](std::vector<int32_t> in, const SlotSet* c) {
    try {
      pages.CheckFreePages(in.data(), static_cast<int64_t>(in.size()), "page_ids", c);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(message({9, 3, 4, 5, 6, 7}, nullptr), "page_ids[4] = 6 is free (not allocated)");
  EXPECT_EQ(message({0, 1, 7, 8, 9}, &cached), "page_ids[3] = 8 is owned by the prefix cache");
  EXPECT_EQ(message({2, 3, 9, 16}, nullptr), "page_ids[3] = 16 is out of range [0, 16)");
  EXPECT_EQ(message({-1, 0, 1}, nullptr), "page_ids[0] = -1 is out of range [0, 16)");
  EXPECT_EQ(message({1, 2, 3, 2}, nullptr), "page_ids[3] = 2 repeats page 2");
  EXPECT_EQ(message({0, 1, 2, 3, 4, 5}, &cached), "");
  EXPECT_EQ(pages.num_free_pages(), 7);  // checks free nothing
}

}  // namespace
}  // namespace radixkv
