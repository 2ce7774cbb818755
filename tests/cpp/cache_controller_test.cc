// The copy controller: its thread, its batches of loads copied layer by
// layer, its acknowledgements, and manual mode (a test decides when each copy
// finishes). Also run under ThreadSanitizer in CI (.ci/test).
#include "radixkv/cache_controller.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <set>
#include <thread>
#include <vector>

#include "radixkv/transfer_index.h"

namespace radixkv {
namespace {

// Two small pools, layer_first on the "device" and page_first on the host:
// L layers of P pages of S slots, rows of R bytes.
struct Pools {
  static constexpr int64_t L = 3, P = 8, S = 4, R = 16;
  std::vector<uint8_t> device, host;
  PoolLayout d{}, h{};

  Pools() : device(2 * L * P * S * R), host(2 * L * P * S * R) {
    d = PoolLayout{
        reinterpret_cast<char*>(device.data()), L * P * S * R, P * S * R, S * R, R, S, P * S};
    h = PoolLayout{
        reinterpret_cast<char*>(host.data()), L * S * R, S * R, 2 * L * S * R, R, S, P * S};
    for (size_t i = 0; i < device.size(); ++i) device[i] = static_cast<uint8_t>(i * 7 + 1);
  }
  const uint8_t* Row(const PoolLayout& l, int64_t side, int64_t layer, int64_t slot) const {
    return reinterpret_cast<const uint8_t*>(l.base + PoolRowOffset(l, side, layer, slot));
  }
  bool SameRows(int64_t dslot, int64_t hslot, int64_t layers = L) const {
    for (int64_t side = 0; side < 2; ++side) {
      for (int64_t layer = 0; layer < layers; ++layer) {
        if (std::memcmp(Row(d, side, layer, dslot), Row(h, side, layer, hslot), R) != 0) {
          return false;
        }
      }
    }
    return true;
  }
};

std::vector<int32_t> Page(int32_t page) {
  std::vector<int32_t> v(Pools::S);
  std::iota(v.begin(), v.end(), page * static_cast<int32_t>(Pools::S));
  return v;
}

TEST(CacheControllerTest, ThreadedBackupsCopyEveryLayerAndAck) {
  Pools pools;
  CacheController c(MakeCpuCopyEngine(pools.d, pools.h, Pools::R, Pools::L), false);
  const uint64_t a = c.Backup(Page(1), Page(5));
  const uint64_t b = c.Backup(Page(2), Page(0));
  c.Drain();
  std::vector<CopyAck> acks = c.TakeBackupAcks();
  ASSERT_EQ(acks.size(), 2u);
  EXPECT_EQ(acks[0].id, a);
  EXPECT_EQ(acks[1].id, b);
  EXPECT_TRUE(acks[0].ok && acks[1].ok);
  for (int32_t i = 0; i < Pools::S; ++i) {
    EXPECT_TRUE(pools.SameRows(1 * Pools::S + i, 5 * Pools::S + i));
    EXPECT_TRUE(pools.SameRows(2 * Pools::S + i, 0 * Pools::S + i));
  }
  EXPECT_TRUE(c.TakeBackupAcks().empty());
  EXPECT_EQ(c.in_flight(), 0);
}

TEST(CacheControllerTest, LoadsRunAsOneBatchAndAckEach) {
  Pools pools;
  for (size_t i = 0; i < pools.host.size(); ++i) pools.host[i] = static_cast<uint8_t>(i * 3 + 2);
  CacheController c(MakeCpuCopyEngine(pools.d, pools.h, Pools::R, Pools::L), false);
  const uint64_t a = c.Load(Page(3), Page(6));
  const uint64_t b = c.Load(Page(4), Page(7));
  EXPECT_EQ(c.in_flight(), 2);
  c.WaitLayer(Pools::L - 1);
  c.Drain();
  std::vector<CopyAck> acks = c.TakeLoadAcks();
  ASSERT_EQ(acks.size(), 2u);
  EXPECT_EQ(std::set<uint64_t>({acks[0].id, acks[1].id}), std::set<uint64_t>({a, b}));
  for (int32_t i = 0; i < Pools::S; ++i) {
    EXPECT_TRUE(pools.SameRows(6 * Pools::S + i, 3 * Pools::S + i));
    EXPECT_TRUE(pools.SameRows(7 * Pools::S + i, 4 * Pools::S + i));
  }
  EXPECT_THROW(c.WaitLayer(Pools::L), std::out_of_range);
}

TEST(CacheControllerTest, PageIdsCopyTheRowsOfTheirSlots) {
  // Copies handed over as page ids (unit S) move what the same copies as
  // slots move; loads of both kinds in one batch too.
  for (bool manual : {false, true}) {
    Pools pools;
    for (size_t i = 0; i < pools.host.size(); ++i) pools.host[i] = static_cast<uint8_t>(i * 3 + 2);
    CacheController c(MakeCpuCopyEngine(pools.d, pools.h, Pools::R, Pools::L), manual);
    const int32_t unit = static_cast<int32_t>(Pools::S);
    c.Backup({1, 2}, {5, 0}, unit);
    c.Load({3}, {6}, unit);
    c.Load(Page(4), Page(7));  // slots: the batch is merged as slots
    c.Drain();
    std::vector<CopyAck> backups = c.TakeBackupAcks(), loads = c.TakeLoadAcks();
    ASSERT_EQ(backups.size(), 1u);
    ASSERT_EQ(loads.size(), 2u);
    EXPECT_TRUE(backups[0].ok && loads[0].ok && loads[1].ok);
    for (int32_t i = 0; i < Pools::S; ++i) {
      EXPECT_TRUE(pools.SameRows(1 * Pools::S + i, 5 * Pools::S + i)) << manual << i;
      EXPECT_TRUE(pools.SameRows(2 * Pools::S + i, 0 * Pools::S + i)) << manual << i;
      EXPECT_TRUE(pools.SameRows(6 * Pools::S + i, 3 * Pools::S + i)) << manual << i;
      EXPECT_TRUE(pools.SameRows(7 * Pools::S + i, 4 * Pools::S + i)) << manual << i;
    }
    // Loads of one unit stay pages in their batch.
    ASSERT_FALSE(pools.SameRows(0, 6 * Pools::S));
    c.Load({6}, {0}, unit);
    c.Load({7}, {1}, unit);
    c.WaitLoads();
    ASSERT_EQ(c.TakeLoadAcks().size(), 2u);
    for (int32_t i = 0; i < Pools::S; ++i) {
      EXPECT_TRUE(pools.SameRows(0 * Pools::S + i, 6 * Pools::S + i)) << manual << i;
      EXPECT_TRUE(pools.SameRows(1 * Pools::S + i, 7 * Pools::S + i)) << manual << i;
    }
  }
}

TEST(CacheControllerTest, AUnitBelowOneIsRefused) {
  CacheController c(MakeNullCopyEngine(1), true);
  EXPECT_THROW(c.Backup({0}, {0}, 0), std::invalid_argument);
  EXPECT_THROW(c.Load({0}, {0}, -1), std::invalid_argument);
  EXPECT_EQ(c.in_flight(), 0);
  CopyJob job;
  job.unit = 0;
  job.src = job.dst = {1};
  EXPECT_FALSE(job.ExpandToSlots());
  EXPECT_EQ(job.src, std::vector<int32_t>{1});
}

TEST(CacheControllerTest, AJobExpandsItsPagesOnce) {
  CopyJob job;
  job.unit = 3;
  job.src = {2, 0};
  job.dst = {1, 4};
  ASSERT_TRUE(job.ExpandToSlots());
  EXPECT_EQ(job.unit, 1);
  EXPECT_EQ(job.src, (std::vector<int32_t>{6, 7, 8, 0, 1, 2}));
  EXPECT_EQ(job.dst, (std::vector<int32_t>{3, 4, 5, 12, 13, 14}));
  ASSERT_TRUE(job.ExpandToSlots());  // slots already: unchanged
  EXPECT_EQ(job.src.size(), 6u);
}

TEST(CacheControllerTest, WaitLoadsLeavesEveryLoadAcknowledgedAndBackupsAlone) {
  Pools pools;
  for (bool manual : {false, true}) {
    CacheController c(MakeCpuCopyEngine(pools.d, pools.h, Pools::R, Pools::L), manual);
    const uint64_t backup = c.Backup(Page(0), Page(1));
    const uint64_t load = c.Load(Page(2), Page(3));
    c.WaitLoads();
    std::vector<CopyAck> acks = c.TakeLoadAcks();
    ASSERT_EQ(acks.size(), 1u);
    EXPECT_EQ(acks[0].id, load);
    EXPECT_TRUE(acks[0].ok);
    if (manual) EXPECT_EQ(c.Waiting(), std::vector<uint64_t>({backup}));
    c.Drain();
    EXPECT_EQ(c.TakeBackupAcks().size(), 1u);
    EXPECT_EQ(c.in_flight(), 0);
  }
}

// An engine whose layers after the first (and with `gate_backups`, whose
// backups) wait for the test to let them go; `held` counts the copies that
// waited.
class GatedEngine final : public CopyEngine {
 public:
  int64_t num_layers() const override { return 4; }
  bool CopyLayers(CopyJob* job, int64_t begin, int64_t) override {
    if (begin > 0 || (gate_backups && job->kind == CopyJob::Kind::kBackup)) {
      held.fetch_add(1);
      while (!open.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    done.fetch_add(1);
    return !fail.load();
  }
  std::atomic<bool> open{false}, fail{false};
  bool gate_backups = false;
  std::atomic<int> done{0}, held{0};
};

TEST(CacheControllerTest, LayerZeroIsReadyWhileTheLastLayerStillLoads) {
  auto engine = std::make_unique<GatedEngine>();
  GatedEngine* e = engine.get();
  CacheController c(std::move(engine), false);
  c.Load(Page(0), Page(1));
  c.WaitLayer(0);  // returns although layers 1..3 are held back
  EXPECT_EQ(e->done.load(), 1);
  EXPECT_EQ(c.in_flight(), 1);
  EXPECT_TRUE(c.TakeLoadAcks().empty());
  e->open = true;
  c.WaitLayer(3);
  c.Drain();
  EXPECT_EQ(e->done.load(), 4);
  ASSERT_EQ(c.TakeLoadAcks().size(), 1u);
}

TEST(CacheControllerTest, FailedCopiesAckNotOk) {
  auto engine = std::make_unique<GatedEngine>();
  engine->open = true;
  engine->fail = true;
  CacheController c(std::move(engine), false);
  c.Backup(Page(0), Page(1));
  c.Load(Page(2), Page(3));
  c.Drain();
  std::vector<CopyAck> b = c.TakeBackupAcks(), l = c.TakeLoadAcks();
  ASSERT_EQ(b.size(), 1u);
  ASSERT_EQ(l.size(), 1u);
  EXPECT_FALSE(b[0].ok);
  EXPECT_FALSE(l[0].ok);
}

TEST(CacheControllerTest, ManualModeRunsWhatTheTestSays) {
  Pools pools;
  CacheController c(MakeCpuCopyEngine(pools.d, pools.h, Pools::R, Pools::L), true);
  const uint64_t a = c.Backup(Page(1), Page(2));
  const uint64_t b = c.Backup(Page(3), Page(4));
  const uint64_t l = c.Load(Page(5), Page(6));
  EXPECT_EQ(c.Waiting(), std::vector<uint64_t>({a, b, l}));
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_TRUE(c.TakeBackupAcks().empty());  // nothing runs by itself
  const std::vector<uint8_t> host_before = pools.host;
  EXPECT_TRUE(c.Complete(b, false));  // fails: nothing copied
  EXPECT_EQ(pools.host, host_before);
  EXPECT_TRUE(c.Complete(a, true));
  EXPECT_TRUE(pools.SameRows(1 * Pools::S, 2 * Pools::S));
  EXPECT_FALSE(c.Complete(a, true));  // already done
  std::vector<CopyAck> acks = c.TakeBackupAcks();
  ASSERT_EQ(acks.size(), 2u);
  EXPECT_EQ(acks[0].id, b);
  EXPECT_FALSE(acks[0].ok);
  EXPECT_EQ(acks[1].id, a);
  EXPECT_TRUE(acks[1].ok);
  c.Drain();  // runs the load
  ASSERT_EQ(c.TakeLoadAcks().size(), 1u);
  EXPECT_EQ(c.in_flight(), 0);
}

TEST(CacheControllerTest, ManyThreadsQueueingAtOnce) {
  CacheController c(MakeNullCopyEngine(2), false);
  std::vector<std::thread> threads;
  std::atomic<int> queued{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        if (i % 3 == 0) {
          c.Load({t, i}, {i, t});
          if (i % 9 == 0) c.WaitLayer(1);
        } else {
          c.Backup({t}, {i});
        }
        queued.fetch_add(1);
      }
    });
  }
  std::set<uint64_t> seen;
  while (queued.load() < 800 || c.in_flight() > 0) {
    c.StartLoading();
    for (const CopyAck& a : c.TakeBackupAcks()) EXPECT_TRUE(seen.insert(a.id).second);
    for (const CopyAck& a : c.TakeLoadAcks()) EXPECT_TRUE(seen.insert(a.id).second);
  }
  for (std::thread& t : threads) t.join();
  c.Drain();
  for (const CopyAck& a : c.TakeBackupAcks()) EXPECT_TRUE(seen.insert(a.id).second);
  for (const CopyAck& a : c.TakeLoadAcks()) EXPECT_TRUE(seen.insert(a.id).second);
  EXPECT_EQ(seen.size(), 800u);
}

TEST(CacheControllerTest, DestroyedWithCopiesQueued) {
  auto engine = std::make_unique<GatedEngine>();
  engine->open = true;
  {
    CacheController c(std::move(engine), false);
    for (int i = 0; i < 50; ++i) c.Backup({i}, {i});
  }  // must not hang or crash
  SUCCEED();
}

// A fork while a load is under way (held at layer 1), a backup is queued
// behind it and another load waits for its batch. The child has no copy
// thread: the load under way, half copied there, fails; what was queued runs
// on a thread the child starts when it waits; destroying the controller does
// not wait for the parent's thread. The parent's copies go on untouched.
// (Before, the child's Drain and its destructor waited for ever.)
TEST(CacheControllerTest, AForkedChildFailsTheCopyUnderWayAndRunsTheRest) {
  auto engine = std::make_unique<GatedEngine>();
  GatedEngine* e = engine.get();
  auto c = std::make_unique<CacheController>(std::move(engine), false);
  const uint64_t under_way = c->Load(Page(0), Page(1));
  c->WaitLayer(0);  // the batch is under way, held before layer 1
  const uint64_t backup = c->Backup(Page(2), Page(3));
  const uint64_t queued = c->Load(Page(4), Page(5));
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(20);  // a hang fails the test instead of stalling it
    e->open = true;
    c->Drain();
    const std::vector<CopyAck> loads = c->TakeLoadAcks(), backups = c->TakeBackupAcks();
    bool ok = loads.size() == 2 && loads[0].id == under_way && !loads[0].ok &&
              loads[1].id == queued && loads[1].ok;
    ok = ok && backups.size() == 1 && backups[0].id == backup && backups[0].ok;
    ok = ok && c->in_flight() == 0;
    c.reset();
    _exit(ok ? 0 : 1);
  }
  e->open = true;
  c->Drain();
  std::vector<CopyAck> loads = c->TakeLoadAcks();
  ASSERT_EQ(loads.size(), 2u);
  EXPECT_TRUE(loads[0].id == under_way && loads[0].ok);
  EXPECT_TRUE(loads[1].id == queued && loads[1].ok);
  ASSERT_EQ(c->TakeBackupAcks().size(), 1u);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed (signal " << WTERMSIG(status) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// Forks from a thread while `under_way` is held in the engine; the child runs
// `child_check` (under alarm: a hang fails the test) and exits with its
// answer. Then lets the copy go in the parent and returns the child's status.
template <typename ChildCheck>
int ForkWhileHeld(CacheController* c, GatedEngine* e, ChildCheck child_check) {
  while (e->held.load() == 0) std::this_thread::yield();
  const pid_t child = fork();
  if (child == 0) {
    alarm(20);
    e->open = true;
    _exit(child_check() ? 0 : 1);
  }
  e->open = true;
  c->Drain();
  int status = -1;
  if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// The batch under way is the last: the child's WaitLayer for it returns, its
// load failed (it counts as finished there).
TEST(CacheControllerTest, AForkedChildsWaitForTheBatchUnderWayReturns) {
  auto engine = std::make_unique<GatedEngine>();
  GatedEngine* e = engine.get();
  CacheController c(std::move(engine), false);
  const uint64_t id = c.Load(Page(0), Page(1));
  c.StartLoading();
  const int status = ForkWhileHeld(&c, e, [&] {
    c.WaitLayer(3);
    const std::vector<CopyAck> acks = c.TakeLoadAcks();
    return acks.size() == 1 && acks[0].id == id && !acks[0].ok && c.in_flight() == 0;
  });
  EXPECT_EQ(status, 0);
  const std::vector<CopyAck> acks = c.TakeLoadAcks();
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_TRUE(acks[0].ok);
}

// A backup under way fails in the child alone; the next one runs there.
TEST(CacheControllerTest, AForkedChildFailsTheBackupUnderWay) {
  auto engine = std::make_unique<GatedEngine>();
  GatedEngine* e = engine.get();
  e->gate_backups = true;
  CacheController c(std::move(engine), false);
  const uint64_t first = c.Backup(Page(0), Page(1));
  const int status = ForkWhileHeld(&c, e, [&] {
    const uint64_t second = c.Backup(Page(2), Page(3));
    c.Drain();
    const std::vector<CopyAck> acks = c.TakeBackupAcks();
    return acks.size() == 2 && acks[0].id == first && !acks[0].ok && acks[1].id == second &&
           acks[1].ok && c.in_flight() == 0;
  });
  EXPECT_EQ(status, 0);
  const std::vector<CopyAck> acks = c.TakeBackupAcks();
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_TRUE(acks[0].id == first && acks[0].ok);
}

// Manual mode: a copy another thread runs (Complete) is under way too.
TEST(CacheControllerTest, AForkedChildFailsTheCopyAnotherThreadCompletes) {
  auto engine = std::make_unique<GatedEngine>();
  GatedEngine* e = engine.get();
  e->gate_backups = true;
  CacheController c(std::move(engine), true);
  const uint64_t first = c.Backup(Page(0), Page(1));
  const uint64_t second = c.Backup(Page(2), Page(3));
  std::thread completing([&] { c.Complete(first, true); });
  const int status = ForkWhileHeld(&c, e, [&] {
    c.Drain();  // (manual: runs the second)
    const std::vector<CopyAck> acks = c.TakeBackupAcks();
    return acks.size() == 2 && acks[0].id == first && !acks[0].ok && acks[1].id == second &&
           acks[1].ok && c.in_flight() == 0;
  });
  completing.join();
  EXPECT_EQ(status, 0);
  EXPECT_EQ(c.TakeBackupAcks().size(), 2u);
}

}  // namespace
}  // namespace radixkv
