#include "radixkv/block_ledger.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <algorithm>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "radixkv/event_pack.h"
#include "radixkv/page_hash.h"
#include "radixkv/status.h"

namespace radixkv {
namespace {

constexpr int64_t kPage = 4;

// The block hashes of the whole pages of `tokens`, chained from `seed`.
std::vector<uint64_t> Hashes(const std::vector<int32_t>& tokens, const uint8_t* seed = nullptr,
                             int64_t page = kPage) {
  const int64_t n = static_cast<int64_t>(tokens.size()) / page;
  std::vector<uint8_t> keys(static_cast<size_t>(n * kPageKeyBytes));
  PageKeys(tokens.data(), n * page, page, seed, keys.data());
  std::vector<uint64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    uint64_t h = 0;
    for (int b = 24; b < 32; ++b) h = (h << 8) | keys[static_cast<size_t>(i * 32 + b)];
    out.push_back(h);
  }
  return out;
}

template <typename T>
Strided<T> Run(const std::vector<T>& v, size_t from = 0, size_t count = SIZE_MAX) {
  count = std::min(count, v.size() - from);
  return {reinterpret_cast<const unsigned char*>(v.data() + from), static_cast<int64_t>(count),
          sizeof(T)};
}

std::string Stored(const std::vector<uint64_t>& hashes, size_t from, size_t count,
                   std::optional<uint64_t> parent, const std::vector<int32_t>& tokens,
                   const char* medium, int64_t page = kPage) {
  std::string out;
  PackBlockStored(&out, Run(hashes, from, count), parent, Run(tokens, from * page, count * page),
                  page, std::nullopt, medium);
  return out;
}

std::string Removed(const std::vector<uint64_t>& hashes, const char* medium) {
  std::string out;
  PackBlockRemoved(&out, Run(hashes), medium);
  return out;
}

std::vector<int32_t> Iota(int32_t n, int32_t from = 0) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), from);
  return v;
}

// Every test runs on a ledger without and with a thread of its own.
class BlockLedgerTest : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(Threads, BlockLedgerTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Threaded" : "Inline"; });

TEST_P(BlockLedgerTest, AnInsertIsOneBlockStoredChainedBelowWhatTheDeviceHolds) {
  BlockLedger ledger(8, 8, kPage, GetParam());
  const std::vector<int32_t> tokens = Iota(16, 100);  // 4 pages
  const std::vector<int32_t> slots = Iota(16, 8);     // pages 2..5
  const std::vector<uint64_t> h = Hashes(tokens);
  ledger.DeviceInserted(tokens.data(), slots.data(), 0, 8, 0, nullptr);
  // The next two pages go on from the stored key of page 1 (slots 12..15).
  ledger.DeviceInserted(tokens.data(), slots.data(), 8, 16, 8, nullptr);
  const auto events = ledger.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0], Stored(h, 0, 2, std::nullopt, tokens, kMediumGpu));
  EXPECT_EQ(events[1], Stored(h, 2, 2, h[1], tokens, kMediumGpu));
  EXPECT_EQ(ledger.device_blocks(), 4);
  EXPECT_EQ(ledger.pending(), 0);
}

TEST_P(BlockLedgerTest, WithoutTheParentOnTheDeviceTheChainIsHashedFromTheSeed) {
  BlockLedger ledger(8, 0, kPage, GetParam());
  std::vector<uint8_t> seed(32, 7);
  const std::vector<int32_t> tokens = Iota(12, 5);
  const std::vector<int32_t> slots = Iota(12, 0);
  const std::vector<uint64_t> h = Hashes(tokens, seed.data());
  // Pages 0 and 1 are the tree's but the ledger never saw them.
  ledger.DeviceInserted(tokens.data(), slots.data(), 8, 12, 8, seed.data());
  const auto events = ledger.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0], Stored(h, 2, 1, h[1], tokens, kMediumGpu));
}

TEST_P(BlockLedgerTest, AnEvictionRemovesWhatWasStoredOnce) {
  BlockLedger ledger(8, 0, kPage, GetParam());
  const std::vector<int32_t> tokens = Iota(8);
  const std::vector<int32_t> slots = {12, 13, 14, 15, 4, 5, 6, 7};  // pages 3 and 1
  const std::vector<uint64_t> h = Hashes(tokens);
  ledger.DeviceInserted(tokens.data(), slots.data(), 0, 8, 0, nullptr);
  ledger.TakeEvents();
  // Page 1 twice in one eviction: its block is removed once.
  const std::vector<int32_t> freed = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7};
  ledger.DeviceEvicted(freed.data(), static_cast<int64_t>(freed.size()));
  ledger.DeviceEvicted(freed.data(), static_cast<int64_t>(freed.size()));  // nothing left
  const auto events = ledger.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0], Removed({h[1], h[0]}, kMediumGpu));
  EXPECT_EQ(ledger.device_blocks(), 0);
}

TEST_P(BlockLedgerTest, CopiesMoveBlocksBetweenTiersAndSplitIntoChains) {
  BlockLedger ledger(8, 8, kPage, GetParam());
  const std::vector<int32_t> tokens = Iota(12, 40);
  const std::vector<int32_t> slots = Iota(12, 0);  // device pages 0..2
  const std::vector<uint64_t> h = Hashes(tokens);
  ledger.DeviceInserted(tokens.data(), slots.data(), 0, 12, 0, nullptr);
  ledger.TakeEvents();
  // Back up pages 0 and 2 (not 1): two chains; host page 6 is rejected.
  const std::vector<int32_t> device = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7};
  const std::vector<int32_t> host = {20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
  const std::vector<int32_t> rejected = {28, 29, 30, 31};  // host page 7: device page 1's copy
  ledger.HostBackedUp(device.data(), host.data(), 12, rejected.data(), 4);
  auto events = ledger.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0], Stored(h, 0, 1, std::nullopt, tokens, kMediumCpuPinned));
  EXPECT_EQ(events[1], Stored(h, 2, 1, h[1], tokens, kMediumCpuPinned));
  EXPECT_EQ(ledger.host_blocks(), 2);

  // Evict device page 0 and load its host copy (host page 5) into page 4.
  const std::vector<int32_t> page0 = {0, 1, 2, 3};
  ledger.DeviceEvicted(page0.data(), 4);
  const std::vector<int32_t> from = {20, 21, 22, 23}, to = {16, 17, 18, 19};
  ledger.DeviceLoaded(from.data(), to.data(), 4);
  events = ledger.TakeEvents();
  ASSERT_EQ(events.size(), 3u);
  // Still on the host: the eviction is a medium change.
  EXPECT_EQ(events[0], Removed({h[0]}, kMediumGpu));
  EXPECT_EQ(events[1], Stored(h, 0, 1, std::nullopt, tokens, kMediumCpuPinned));
  EXPECT_EQ(events[2], Stored(h, 0, 1, std::nullopt, tokens, kMediumGpu));

  // Device page 1 has no host copy: its eviction is a removal only.
  const std::vector<int32_t> page1 = {4, 5, 6, 7};
  ledger.DeviceEvicted(page1.data(), 4);
  events = ledger.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0], Removed({h[1]}, kMediumGpu));

  // A reset: the host's blocks one by one (in page order), the device's at once.
  ledger.Reset();
  events = ledger.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0], Removed({h[0], h[2]}, kMediumCpuPinned));
  std::string cleared;
  PackAllBlocksCleared(&cleared);
  EXPECT_EQ(events[1], cleared);
  EXPECT_EQ(ledger.device_blocks() + ledger.host_blocks(), 0);
}

TEST_P(BlockLedgerTest, SnapshotStoresEveryBlockParentsFirstAndRecordsNothing) {
  BlockLedger ledger(8, 8, kPage, GetParam());
  const std::vector<int32_t> tokens = Iota(16, 40);
  const std::vector<uint64_t> h = Hashes(tokens);
  // Device pages out of order: page 5 holds the first block, page 1 the second, ...
  const std::vector<int32_t> slots = {20, 21, 22, 23, 4, 5, 6, 7, 28, 29, 30, 31, 0, 1, 2, 3};
  ledger.DeviceInserted(tokens.data(), slots.data(), 0, 16, 0, nullptr);
  const std::vector<int32_t> device = {20, 21, 22, 23, 4, 5, 6, 7};
  const std::vector<int32_t> host = {12, 13, 14, 15, 0, 1, 2, 3};  // host pages 3, 0
  ledger.HostBackedUp(device.data(), host.data(), 8, nullptr, 0);
  ledger.TakeEvents();
  const auto snap = ledger.Snapshot();
  EXPECT_EQ(ledger.pending(), 0);
  ASSERT_EQ(snap.size(), 2u);
  EXPECT_EQ(snap[0], Stored(h, 0, 4, std::nullopt, tokens, kMediumGpu));
  EXPECT_EQ(snap[1], Stored(h, 0, 2, std::nullopt, tokens, kMediumCpuPinned));
  EXPECT_EQ(ledger.device_blocks(), 4);
}

TEST_P(BlockLedgerTest, TheHostIndexFollowsEveryHostChange) {
  // Many host blocks in a small table: collisions, erasures and reuse.
  BlockLedger ledger(64, 64, 1, GetParam());
  const std::vector<int32_t> tokens = Iota(64, 7);
  const std::vector<uint64_t> h = Hashes(tokens, nullptr, 1);
  const std::vector<int32_t> slots = Iota(64, 0);
  ledger.DeviceInserted(tokens.data(), slots.data(), 0, 64, 0, nullptr);
  ledger.HostBackedUp(slots.data(), slots.data(), 64, nullptr, 0);
  // Drop every third host block, then evict every device block: exactly
  // those the host still holds move there.
  std::vector<int32_t> dropped;
  for (int32_t p = 0; p < 64; p += 3) dropped.push_back(p);
  ledger.HostEvicted(dropped.data(), static_cast<int64_t>(dropped.size()));
  ledger.TakeEvents();
  for (int32_t p = 0; p < 64; ++p) {
    ledger.DeviceEvicted(&slots[p], 1);
    const auto events = ledger.TakeEvents();
    ASSERT_EQ(events.size(), p % 3 == 0 ? 1u : 2u) << p;
    if (p % 3 == 0) continue;
    const std::optional<uint64_t> parent = h[p - 1];
    EXPECT_EQ(events[1], Stored(h, p, 1, parent, tokens, kMediumCpuPinned, 1)) << p;
  }
}

TEST_P(BlockLedgerTest, PagesFromStorageAreStoredOnTheHostButTheRejected) {
  BlockLedger ledger(0, 8, kPage, GetParam());
  std::vector<uint8_t> seed(32, 1);
  const std::vector<int32_t> tokens = Iota(14, 9);  // 3 whole pages and 2 tokens
  const std::vector<uint64_t> h = Hashes(tokens, seed.data());
  const std::vector<int32_t> host = {0, 1, 2, 3, 4, 5, 6, 7};  // pages 1 and 2 of the tokens
  const std::vector<int32_t> rejected = {4, 5, 6, 7};
  ledger.HostInserted(tokens.data(), 14, 4, host.data(), 8, rejected.data(), 4, seed.data());
  const auto events = ledger.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0], Stored(h, 1, 1, h[0], tokens, kMediumCpuPinned));
  EXPECT_EQ(ledger.host_blocks(), 1);
}

TEST_P(BlockLedgerTest, BadSlotsThrowAndChangeNothing) {
  BlockLedger ledger(4, 2, kPage, GetParam());
  const std::vector<int32_t> tokens = Iota(8);
  const std::vector<int32_t> out_of_pool = {0, 1, 2, 3, 16, 17, 18, 19};  // page 4 of 4
  EXPECT_THROW(ledger.DeviceInserted(tokens.data(), out_of_pool.data(), 0, 8, 0, nullptr), Error);
  const std::vector<int32_t> negative = {-4, -3, -2, -1};
  EXPECT_THROW(ledger.DeviceEvicted(negative.data(), 4), Error);
  EXPECT_THROW(ledger.DeviceInserted(tokens.data(), out_of_pool.data(), 2, 8, 0, nullptr), Error);
  const std::vector<int32_t> slots = Iota(8);
  const std::vector<int32_t> host = {0, 1, 2, 3, 8, 9, 10, 11};  // host page 2 of 2
  ledger.DeviceInserted(tokens.data(), slots.data(), 0, 8, 0, nullptr);
  ledger.TakeEvents();
  EXPECT_THROW(ledger.HostBackedUp(slots.data(), host.data(), 8, nullptr, 0), Error);
  EXPECT_THROW(ledger.HostInserted(tokens.data(), 8, 0, host.data(), 4, nullptr, 0, nullptr),
               Error);  // one page named for two
  EXPECT_EQ(ledger.pending(), 0);
  EXPECT_EQ(ledger.device_blocks(), 2);
  EXPECT_EQ(ledger.host_blocks(), 0);
  EXPECT_THROW(BlockLedger(4, 4, 0), Error);
  EXPECT_THROW(BlockLedger(-1, 4, 1), Error);
}

// The same random changes through an inline and a threaded ledger: the same
// events, snapshots and rows at every read, though the threaded one's calls
// return before their changes are applied.
TEST(BlockLedgerThreadTest, AppliesWhatAnInlineLedgerDoesInTheSameOrder) {
  constexpr int64_t kPages = 12;
  BlockLedger inline_ledger(kPages, kPages, kPage), threaded(kPages, kPages, kPage, true);
  BlockLedger* both[] = {&inline_ledger, &threaded};
  std::mt19937 rng(7);
  auto pick = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint32_t>(n)); };
  // Distinct pages, as page ids (a call's pages never repeat).
  auto pages = [&](int64_t n) {
    std::vector<int32_t> all = Iota(kPages);
    std::shuffle(all.begin(), all.end(), rng);
    return std::vector<int32_t>(all.begin(), all.begin() + n);
  };
  std::vector<uint8_t> seed(32, 3);
  int64_t reads = 0;
  for (int step = 0; step < 3000; ++step) {
    const int64_t n = 1 + pick(4);
    std::vector<int32_t> tokens(static_cast<size_t>(n * kPage));
    for (int32_t& t : tokens) t = static_cast<int32_t>(pick(3));  // shared prefixes are common
    const std::vector<int32_t> a = pages(n), b = pages(n), none;
    switch (pick(9)) {
      case 0:
      case 1: {
        const int64_t start = pick(n) * kPage, known = pick(2) ? start : 0;
        const uint8_t* s = pick(2) ? seed.data() : nullptr;
        for (BlockLedger* l : both) {
          l->DeviceInserted(tokens.data(), a.data(), start, n * kPage, known, s, true);
        }
        break;
      }
      case 2:
        for (BlockLedger* l : both) l->DeviceEvicted(a.data(), n * kPage, true);
        break;
      case 3: {
        const std::vector<int32_t> rejected(b.begin(), b.begin() + pick(n));
        for (BlockLedger* l : both) {
          l->HostBackedUp(a.data(), b.data(), n * kPage, rejected.data(),
                          static_cast<int64_t>(rejected.size()) * kPage, true);
        }
        break;
      }
      case 4:
        for (BlockLedger* l : both) {
          l->DeviceLoaded(a.data(), b.data(), n * kPage, true);
        }
        break;
      case 5:
        for (BlockLedger* l : both) l->HostEvicted(a.data(), n * kPage, true);
        break;
      case 6: {
        std::vector<int32_t> slots;  // host slots of the pages after the first
        for (int64_t i = 1; i < n; ++i) {
          for (int64_t k = 0; k < kPage; ++k) slots.push_back(b[i] * kPage + k);
        }
        for (BlockLedger* l : both) {
          l->HostInserted(tokens.data(), n * kPage, kPage, slots.data(),
                          static_cast<int64_t>(slots.size()), none.data(), 0, seed.data());
        }
        break;
      }
      case 7: {
        const std::optional<int64_t> id =
            pick(2) ? std::optional<int64_t>(pick(5)) : std::optional<int64_t>();
        for (BlockLedger* l : both) l->set_lora_id(id);
        break;
      }
      default:
        if (pick(40) == 0) {
          for (BlockLedger* l : both) l->Reset();
        }
    }
    if (pick(10) == 0) {
      ++reads;
      ASSERT_EQ(threaded.TakeEvents(), inline_ledger.TakeEvents()) << "step " << step;
      ASSERT_EQ(threaded.pending(), 0);
    }
    if (pick(200) == 0) {
      ASSERT_EQ(threaded.Snapshot(), inline_ledger.Snapshot()) << "step " << step;
      ASSERT_EQ(threaded.device_blocks(), inline_ledger.device_blocks());
      ASSERT_EQ(threaded.host_blocks(), inline_ledger.host_blocks());
    }
  }
  EXPECT_GT(reads, 100);
  EXPECT_EQ(threaded.TakeEvents(), inline_ledger.TakeEvents());
  EXPECT_EQ(threaded.Snapshot(), inline_ledger.Snapshot());
  EXPECT_GT(threaded.device_blocks() + threaded.host_blocks(), 0);
}

// A threaded ledger checks each call before it returns: a bad one throws on
// the caller's thread and queues nothing.
TEST(BlockLedgerThreadTest, BadCallsThrowOnTheCallersThread) {
  BlockLedger ledger(4, 2, kPage, true);
  const std::vector<int32_t> tokens = Iota(8), slots = Iota(8);
  ledger.DeviceInserted(tokens.data(), slots.data(), 0, 8, 0, nullptr);
  const std::vector<int32_t> out_of_pool = {0, 1, 2, 3, 16, 17, 18, 19};
  EXPECT_THROW(ledger.DeviceEvicted(out_of_pool.data(), 8), Error);
  EXPECT_THROW(ledger.DeviceInserted(tokens.data(), slots.data(), 1, 8, 0, nullptr), Error);
  EXPECT_EQ(ledger.TakeEvents().size(), 1u);
  EXPECT_EQ(ledger.device_blocks(), 2);
  ledger.DeviceEvicted(slots.data(), 8);
  // Destroyed with a change queued: it is applied first, nothing is read after.
}

// A threaded ledger copies an insert's own tokens alone where it saw the
// parent page's block stored: the prefix is never read (here it lies in
// memory that cannot be read), and the events are the inline ledger's.
TEST(BlockLedgerThreadTest, AnInsertBelowAHeldPageCopiesItsOwnTokensAlone) {
  const int64_t os_page = sysconf(_SC_PAGESIZE), page = os_page / 4 / 4;  // 4 pages a 1st OS page
  void* map = mmap(nullptr, 2 * os_page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                   0);
  ASSERT_NE(map, MAP_FAILED);
  auto* all = static_cast<int32_t*>(map);
  const int64_t start = os_page / 4;  // the tokens of the first OS page: 4 ledger pages
  for (int64_t i = 0; i < start + 2 * page; ++i) all[i] = static_cast<int32_t>(i % 97);
  std::vector<int32_t> tokens(all, all + start + 2 * page);
  std::vector<int32_t> ids = Iota(6);
  BlockLedger inline_ledger(8, 0, page), threaded(8, 0, page, true);
  for (BlockLedger* l : {&inline_ledger, &threaded}) {
    l->DeviceInserted(tokens.data(), ids.data(), 0, start, 0, nullptr, true);
  }
  threaded.TakeEvents();  // applied; the second insert goes through the queue as well
  ASSERT_EQ(mprotect(map, static_cast<size_t>(os_page), PROT_NONE), 0);
  threaded.DeviceInserted(all, ids.data(), start, start + 2 * page, start, nullptr, true);
  inline_ledger.DeviceInserted(tokens.data(), ids.data(), start, start + 2 * page, start, nullptr,
                               true);
  const auto got = threaded.TakeEvents(), want = inline_ledger.TakeEvents();
  munmap(map, 2 * os_page);
  ASSERT_EQ(want.size(), 2u);
  EXPECT_EQ(got, std::vector<std::string>(want.begin() + 1, want.end()));
}

}  // namespace
}  // namespace radixkv
