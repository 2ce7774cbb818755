// Walk, split and evict on trees of 1k to 1M leaves. Each tree is a shared
// 512-token prefix with one unique 128-token suffix per leaf (page size 1).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "radixkv/radix_tree.h"

namespace {

constexpr int64_t kPrefix = 512;
constexpr int64_t kSuffix = 128;
constexpr int32_t kVocab = 32000;

struct Fixture {
  std::unique_ptr<radixkv::RadixTree> tree;
  std::vector<std::vector<int32_t>> seqs;
  int32_t next_slot = 0;

  void Insert(const std::vector<int32_t>& s) {
    std::vector<int32_t> slots(s.size());
    for (auto& x : slots) x = next_slot++;
    tree->InsertPrefix(s.data(), slots.data(), static_cast<int64_t>(s.size()));
  }
};

// One tree per size, built once and shared by the benchmarks of that size.
Fixture& TreeOf(int64_t leaves) {
  static std::map<int64_t, std::unique_ptr<Fixture>> trees;
  auto& f = trees[leaves];
  if (!f) {
    f = std::make_unique<Fixture>();
    f->tree = std::make_unique<radixkv::RadixTree>(1);
    std::mt19937 rng(42);
    std::uniform_int_distribution<int32_t> tok(0, kVocab - 1);
    std::vector<int32_t> prefix(kPrefix);
    for (auto& t : prefix) t = tok(rng);
    f->seqs.reserve(leaves);
    for (int64_t i = 0; i < leaves; ++i) {
      std::vector<int32_t> s = prefix;
      for (int64_t j = 0; j < kSuffix; ++j) s.push_back(tok(rng));
      f->Insert(s);
      f->seqs.push_back(std::move(s));
    }
  }
  return *f;
}

void BM_Walk(benchmark::State& state) {
  Fixture& f = TreeOf(state.range(0));
  std::vector<int32_t> slots;
  size_t i = 0;
  for (auto _ : state) {
    const auto& s = f.seqs[i++ % f.seqs.size()];
    auto h = f.tree->MatchPrefix(s.data(), static_cast<int64_t>(s.size()), &slots);
    benchmark::DoNotOptimize(h);
  }
  state.SetItemsProcessed(state.iterations());
}

// Matches that end inside a leaf: each leaf is split once, mid-suffix; when
// every leaf has been split, a fresh tree is built (untimed).
void BM_Split(benchmark::State& state) {
  const int64_t leaves = state.range(0);
  auto tree = std::make_unique<Fixture>();
  std::vector<int32_t> slots;
  size_t i = 0;
  for (auto _ : state) {
    if (i == 0) {
      state.PauseTiming();
      Fixture& shared = TreeOf(leaves);
      tree = std::make_unique<Fixture>();
      tree->tree = std::make_unique<radixkv::RadixTree>(1);
      for (const auto& s : shared.seqs) tree->Insert(s);
      state.ResumeTiming();
    }
    const auto& s = TreeOf(leaves).seqs[i];
    auto h = tree->tree->MatchPrefix(s.data(), kPrefix + kSuffix / 2, &slots);
    benchmark::DoNotOptimize(h);
    if (++i == TreeOf(leaves).seqs.size()) i = 0;
  }
}

// Evicts 1,024 tokens (8 leaves), then puts them back untimed.
void BM_Evict(benchmark::State& state) {
  Fixture& f = TreeOf(state.range(0));
  std::vector<int32_t> slots;
  static int32_t unique = 0;
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    f.tree->Evict(1024, &slots);
    auto t1 = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    // Put 8 fresh leaves back under the prefix, reusing the freed slots (the
    // prefix part of `tail` is cached: its slots are the tree's own).
    for (size_t k = 0; k + kSuffix <= slots.size(); k += kSuffix) {
      std::vector<int32_t> s(f.seqs[0].begin(), f.seqs[0].begin() + kPrefix);
      // The first sequence stored the prefix with slots [0, kPrefix).
      std::vector<int32_t> tail(kPrefix);
      for (int64_t j = 0; j < kPrefix; ++j) tail[j] = static_cast<int32_t>(j);
      for (int64_t j = 0; j < kSuffix; ++j) s.push_back(kVocab + (unique++ % (1 << 30)));
      tail.insert(tail.end(), slots.begin() + k, slots.begin() + k + kSuffix);
      f.tree->InsertPrefix(s.data(), tail.data(), static_cast<int64_t>(s.size()));
    }
  }
}

}  // namespace

BENCHMARK(BM_Walk)->Arg(1000)->Arg(10000)->Arg(100000)->Arg(1000000);
BENCHMARK(BM_Split)->Arg(1000)->Arg(10000)->Arg(100000)->Arg(1000000);
BENCHMARK(BM_Evict)->UseManualTime()->Arg(1000)->Arg(10000)->Arg(100000)->Arg(1000000);
BENCHMARK_MAIN();
