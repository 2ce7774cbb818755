#include "radixkv/radix_tree.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "radix_node.h"
#include "radixkv/status.h"
#include "tree_test_util.h"

namespace radixkv {
namespace {

using testing_util::Insert;
using testing_util::Ints;
using testing_util::Iota;

Ints Concat(Ints a, const Ints& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct MatchResult {
  Handle handle;
  Ints slots;
};

MatchResult Match(RadixTree* tree, const Ints& tokens) {
  MatchResult r;
  r.slots = {-99, -99};  // must be replaced, not appended to
  r.handle = tree->MatchPrefix(tokens.data(), static_cast<int64_t>(tokens.size()), &r.slots);
  EXPECT_EQ(r.handle.cached_len, static_cast<int64_t>(r.slots.size()));
  EXPECT_EQ(r.handle.lock_count, 0);
  EXPECT_TRUE(tree->IsValid(r.handle));
  return r;
}

Ints Evict(RadixTree* tree, int64_t size) {
  Ints out{-99};  // must be cleared first
  tree->Evict(size, &out);
  return out;
}

template <typename Fn>
::testing::AssertionResult Throws(ErrorCode code, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    if (e.code() == code) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "threw code " << static_cast<int>(e.code()) << ": " << e.what();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-radixkv exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

#define EXPECT_INVALID(stmt) EXPECT_TRUE(Throws(ErrorCode::kInvalidArgument, [&] { stmt; }))
#define EXPECT_OUT_OF_CAPACITY(stmt) EXPECT_TRUE(Throws(ErrorCode::kOutOfCapacity, [&] { stmt; }))

// One node of a dump, addressed by its full token path from the root.
struct NodeView {
  Ints key, value;
  int64_t ref_count = 0;
  uint64_t timestamp = 0;
};

// Order-independent view of Dump(): full path -> node.
std::map<Ints, NodeView> Nodes(const RadixTree& tree) {
  std::vector<NodeInfo> dump = tree.Dump();
  std::vector<Ints> paths(dump.size());
  std::map<Ints, NodeView> out;
  for (size_t i = 0; i < dump.size(); ++i) {
    const NodeInfo& n = dump[i];
    EXPECT_LT(n.parent, static_cast<int64_t>(i)) << "parent listed after its child";
    if (n.parent >= 0) paths[i] = paths[static_cast<size_t>(n.parent)];
    paths[i].insert(paths[i].end(), n.key.begin(), n.key.end());
    EXPECT_TRUE(out.emplace(paths[i], NodeView{n.key, n.value, n.ref_count, n.timestamp}).second);
  }
  return out;
}

std::vector<Ints> Paths(const RadixTree& tree) {
  std::vector<Ints> out;
  for (auto& [path, node] : Nodes(tree)) out.push_back(path);
  return out;
}

// Everything observable about a tree except its clock.
std::string State(const RadixTree& tree) {
  std::ostringstream os;
  os << "evictable=" << tree.evictable_size() << " protected=" << tree.protected_size()
     << " nodes=" << tree.num_nodes() << " leaves=" << tree.num_evictable_leaves()
     << " stored=" << tree.stored_slots().Count() << "\n";
  for (const NodeInfo& n : tree.Dump()) {
    os << n.parent << " k=";
    for (int32_t x : n.key) os << x << ",";
    os << " v=";
    for (int32_t x : n.value) os << x << ",";
    os << " r=" << n.ref_count << " t=" << n.timestamp << "\n";
  }
  return os.str();
}

// Matches `tokens` (which must be cached) and returns the time given to its last node: the
// clock value after this call.
uint64_t TouchTime(RadixTree* tree, const Ints& tokens) {
  MatchResult r = Match(tree, tokens);
  EXPECT_EQ(r.handle.cached_len, static_cast<int64_t>(tokens.size()));
  return Nodes(*tree).at(tokens).timestamp;
}

// Runs `bad`, which must throw `code`, and checks that neither the tree nor its clock moved.
void ExpectFailsAndChangesNothing(RadixTree* tree, const Ints& probe, ErrorCode code,
                                  const std::function<void()>& bad) {
  const uint64_t t0 = TouchTime(tree, probe);
  const std::string before = State(*tree);
  EXPECT_TRUE(Throws(code, bad));
  EXPECT_EQ(State(*tree), before);
  EXPECT_NO_THROW(tree->CheckIntegrity());
  EXPECT_EQ(TouchTime(tree, probe), t0 + 1) << "a failed call advanced the clock";
}

// ---------------------------------------------------------------------------------------------
// Construction and the empty tree.

TEST(RadixTreeTest, RejectsBadPageSize) {
  EXPECT_INVALID(RadixTree(0));
  EXPECT_INVALID(RadixTree(-4));
  RadixTree a(1), b(16);
  EXPECT_EQ(a.page_size(), 1);
  EXPECT_EQ(b.page_size(), 16);
  EXPECT_NE(a.id(), b.id());
}

TEST(RadixTreeTest, EmptyTree) {
  RadixTree tree;
  MatchResult r = Match(&tree, {1, 2, 3});
  EXPECT_EQ(r.handle.cached_len, 0);
  EXPECT_TRUE(r.slots.empty());
  EXPECT_EQ(Match(&tree, {}).handle.cached_len, 0);
  EXPECT_EQ(tree.num_nodes(), 0);
  EXPECT_EQ(tree.evictable_size(), 0);
  EXPECT_EQ(tree.protected_size(), 0);
  EXPECT_TRUE(Evict(&tree, 0).empty());
  EXPECT_OUT_OF_CAPACITY(Evict(&tree, 1));
  // The root handle can be locked and unlocked; it protects nothing.
  tree.Lock(&r.handle);
  EXPECT_EQ(r.handle.lock_count, 1);
  EXPECT_EQ(tree.protected_size(), 0);
  tree.Unlock(&r.handle);
  EXPECT_INVALID(tree.Unlock(&r.handle));
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, NegativeLengthThrows) {
  RadixTree tree;
  Ints tokens{1}, slots{0};
  std::vector<int32_t> out;
  EXPECT_INVALID(tree.MatchPrefix(tokens.data(), -1, &out));
  EXPECT_INVALID(tree.InsertPrefix(tokens.data(), slots.data(), -1));
  EXPECT_EQ(tree.num_nodes(), 0);
}

// ---------------------------------------------------------------------------------------------
// Match, insert and split.

TEST(RadixTreeTest, MatchAndSplitPageSize1) {
  RadixTree tree;
  EXPECT_EQ(Insert(&tree, {1, 2, 3, 4, 5}, {10, 11, 12, 13, 14}), 0);
  EXPECT_EQ(tree.num_nodes(), 1);
  EXPECT_EQ(tree.evictable_size(), 5);

  MatchResult full = Match(&tree, {1, 2, 3, 4, 5, 6, 7});
  EXPECT_EQ(full.slots, (Ints{10, 11, 12, 13, 14}));
  EXPECT_EQ(tree.num_nodes(), 1);  // a match ending at a node's end does not split

  MatchResult mid = Match(&tree, {1, 2, 3, 9});
  EXPECT_EQ(mid.slots, (Ints{10, 11, 12}));
  EXPECT_EQ(tree.num_nodes(), 2);
  EXPECT_EQ(Paths(tree), (std::vector<Ints>{{1, 2, 3}, {1, 2, 3, 4, 5}}));

  MatchResult shorter = Match(&tree, {1});
  EXPECT_EQ(shorter.slots, (Ints{10}));
  EXPECT_EQ(Paths(tree), (std::vector<Ints>{{1}, {1, 2, 3}, {1, 2, 3, 4, 5}}));
  auto nodes = Nodes(tree);
  EXPECT_EQ(nodes.at({1}).value, (Ints{10}));
  EXPECT_EQ(nodes.at({1, 2, 3}).key, (Ints{2, 3}));
  EXPECT_EQ(nodes.at({1, 2, 3}).value, (Ints{11, 12}));
  EXPECT_EQ(nodes.at({1, 2, 3, 4, 5}).value, (Ints{13, 14}));

  EXPECT_EQ(Match(&tree, {2, 1}).handle.cached_len, 0);
  EXPECT_EQ(Match(&tree, {1, 2, 3, 4, 5}).slots, (Ints{10, 11, 12, 13, 14}));
  EXPECT_EQ(tree.evictable_size(), 5);  // splitting never changes what is cached
  EXPECT_EQ(tree.num_evictable_leaves(), 1);
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, InsertReturnsCachedLengthAndNeverOverwrites) {
  RadixTree tree;
  EXPECT_EQ(Insert(&tree, {1, 2, 3}, {0, 1, 2}), 0);
  EXPECT_EQ(Insert(&tree, {1, 2, 3, 4, 5}, {100, 101, 102, 3, 4}), 3);
  EXPECT_EQ(Match(&tree, {1, 2, 3, 4, 5}).slots, (Ints{0, 1, 2, 3, 4}));
  EXPECT_EQ(tree.evictable_size(), 5);

  // A prefix of a node: split, nothing stored.
  EXPECT_EQ(Insert(&tree, {1, 2}, {200, 201}), 2);
  EXPECT_EQ(tree.evictable_size(), 5);
  EXPECT_EQ(Paths(tree), (std::vector<Ints>{{1, 2}, {1, 2, 3}, {1, 2, 3, 4, 5}}));
  // Exactly cached: nothing changes.
  EXPECT_EQ(Insert(&tree, {1, 2, 3, 4, 5}, {300, 301, 302, 303, 304}), 5);
  EXPECT_EQ(tree.num_nodes(), 3);

  // Slots of the cached part are not stored; they may be the tree's own (from a match).
  EXPECT_EQ(Insert(&tree, {1, 2, 3, 9}, {0, 1, 2, 7}), 3);
  EXPECT_EQ(Match(&tree, {1, 2, 3, 9}).slots, (Ints{0, 1, 2, 7}));
  EXPECT_EQ(Match(&tree, {1, 2, 3, 4}).slots, (Ints{0, 1, 2, 3}));
  EXPECT_EQ(tree.evictable_size(), 6);

  // Diverging at the first token: a new child of the root.
  EXPECT_EQ(Insert(&tree, {7, 2, 3}, {8, 9, 10}), 0);
  EXPECT_EQ(Match(&tree, {7, 2, 3}).slots, (Ints{8, 9, 10}));
  EXPECT_EQ(Insert(&tree, {}, {}), 0);
  EXPECT_EQ(tree.evictable_size(), 9);
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, NodesCopyCallerMemory) {
  RadixTree tree;
  Ints tokens{1, 2, 3}, slots{4, 5, 6};
  Insert(&tree, tokens, slots);
  tokens = {9, 9, 9};
  slots = {0, 0, 0};
  EXPECT_EQ(Match(&tree, {1, 2, 3}).slots, (Ints{4, 5, 6}));
}

TEST(RadixTreeTest, PageSize4RoundsDownToWholePages) {
  RadixTree tree(4);
  EXPECT_EQ(Insert(&tree, Iota(1, 10), Iota(100, 10)), 0);
  EXPECT_EQ(tree.evictable_size(), 8);  // tokens 9 and 10 are not a whole page
  EXPECT_EQ(Match(&tree, Iota(1, 10)).slots, Iota(100, 8));
  EXPECT_EQ(Match(&tree, Iota(1, 3)).handle.cached_len, 0);  // less than a page
  EXPECT_EQ(tree.num_nodes(), 1);

  // A mismatch inside the second page matches only the first.
  MatchResult r = Match(&tree, {1, 2, 3, 4, 5, 6, 7, 99});
  EXPECT_EQ(r.slots, Iota(100, 4));
  EXPECT_EQ(Paths(tree), (std::vector<Ints>{Iota(1, 4), Iota(1, 8)}));

  // Input ending inside a page: rounded down before matching.
  EXPECT_EQ(Match(&tree, Iota(1, 7)).slots, Iota(100, 4));
  EXPECT_EQ(tree.num_nodes(), 2);

  // An insert shorter than a page stores nothing, but its indices are checked all the same.
  EXPECT_EQ(Insert(&tree, {50, 51, 52}, {60, 61, 62}), 0);
  EXPECT_INVALID(Insert(&tree, {50, 51, 52}, {60, -1, 62}));
  EXPECT_INVALID(Insert(&tree, Iota(1, 6), {100, 101, 102, 103, 7, 7}));
  EXPECT_EQ(tree.num_nodes(), 2);
  // An insert diverging inside a page stores from the page start.
  EXPECT_EQ(Insert(&tree, {1, 2, 3, 4, 5, 6, 0, 0, 7}, {100, 101, 102, 103, 40, 41, 42, 43, 44}),
            4);
  EXPECT_EQ(Match(&tree, {1, 2, 3, 4, 5, 6, 0, 0}).slots,
            (Ints{100, 101, 102, 103, 40, 41, 42, 43}));
  EXPECT_EQ(Match(&tree, Iota(1, 8)).slots, Iota(100, 8));
  EXPECT_EQ(tree.evictable_size(), 12);
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, PageSize4ChildrenShareFirstTokenButNotFirstPage) {
  RadixTree tree(4);
  EXPECT_EQ(Insert(&tree, {1, 2, 3, 4, 5, 6, 7, 8}, Iota(0, 8)), 0);
  EXPECT_EQ(Insert(&tree, {1, 2, 3, 9, 5, 6, 7, 8}, Iota(10, 8)), 0);  // differs in page 1
  EXPECT_EQ(tree.num_nodes(), 2);
  EXPECT_EQ(tree.evictable_size(), 16);
  EXPECT_EQ(Paths(tree), (std::vector<Ints>{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 9, 5, 6, 7, 8}}));
  EXPECT_EQ(Match(&tree, {1, 2, 3, 4, 5, 6, 7, 8}).slots, Iota(0, 8));
  EXPECT_EQ(Match(&tree, {1, 2, 3, 9, 5, 6, 7, 8}).slots, Iota(10, 8));
  EXPECT_EQ(Match(&tree, {1, 2, 3, 5}).handle.cached_len, 0);
  EXPECT_EQ(tree.num_nodes(), 2);

  // Sharing page 1 and three tokens of page 2: a page-aligned split into two children whose
  // first pages share their first three tokens.
  EXPECT_EQ(Insert(&tree, {1, 2, 3, 4, 5, 6, 7, 0, 1, 1, 1, 1}, Iota(20, 12)), 4);
  EXPECT_EQ(Paths(tree), (std::vector<Ints>{{1, 2, 3, 4},
                                            {1, 2, 3, 4, 5, 6, 7, 0, 1, 1, 1, 1},
                                            {1, 2, 3, 4, 5, 6, 7, 8},
                                            {1, 2, 3, 9, 5, 6, 7, 8}}));
  EXPECT_EQ(Match(&tree, {1, 2, 3, 4, 5, 6, 7, 0, 1, 1, 1, 1}).slots,
            (Ints{0, 1, 2, 3, 24, 25, 26, 27, 28, 29, 30, 31}));
  EXPECT_EQ(Match(&tree, {1, 2, 3, 4, 5, 6, 7, 8}).slots, Iota(0, 8));
  EXPECT_EQ(Match(&tree, {1, 2, 3, 4, 5, 6, 7, 9}).slots, Iota(0, 4));
  EXPECT_EQ(tree.evictable_size(), 24);
  EXPECT_EQ(tree.num_evictable_leaves(), 3);
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, PageSize4ManySiblingsUnderOneParent) {
  RadixTree tree(4);
  // 64 children of the root whose first pages all start with the same token.
  for (int32_t i = 0; i < 64; ++i) {
    EXPECT_EQ(Insert(&tree, {7, 7, i / 8, i % 8}, Iota(4 * i, 4)), 0);
  }
  EXPECT_EQ(tree.num_nodes(), 64);
  for (int32_t i = 0; i < 64; ++i) {
    EXPECT_EQ(Match(&tree, {7, 7, i / 8, i % 8, 0}).slots, Iota(4 * i, 4)) << i;
  }
  EXPECT_EQ(Evict(&tree, 4), Iota(0, 4));  // the oldest sibling
  for (int32_t i = 1; i < 64; ++i) {
    EXPECT_EQ(Match(&tree, {7, 7, i / 8, i % 8}).slots, Iota(4 * i, 4)) << i;
  }
  EXPECT_EQ(Match(&tree, {7, 7, 0, 0}).handle.cached_len, 0);
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, HandleStaysValidAfterFurtherSplits) {
  RadixTree tree;
  Insert(&tree, Iota(1, 8), Iota(0, 8));
  MatchResult r = Match(&tree, Iota(1, 6));  // splits [1..8] at 6
  EXPECT_EQ(r.slots, Iota(0, 6));
  Match(&tree, {1, 2});        // splits the handle's node at 2
  Match(&tree, {1, 2, 3, 4});  // and again at 4
  EXPECT_EQ(tree.num_nodes(), 4);
  EXPECT_TRUE(tree.IsValid(r.handle));
  tree.Lock(&r.handle);
  EXPECT_EQ(tree.protected_size(), 6);
  EXPECT_EQ(tree.evictable_size(), 2);
  Match(&tree, {1, 2, 3});  // split inside a locked node
  EXPECT_EQ(tree.protected_size(), 6);
  auto nodes = Nodes(tree);
  EXPECT_EQ(nodes.at({1, 2, 3}).ref_count, 1);
  EXPECT_EQ(nodes.at({1, 2, 3, 4}).ref_count, 1);
  EXPECT_EQ(nodes.at(Iota(1, 8)).ref_count, 0);
  EXPECT_NO_THROW(tree.CheckIntegrity());
  EXPECT_EQ(Evict(&tree, 1), (Ints{6, 7}));
  tree.Unlock(&r.handle);
  EXPECT_EQ(tree.protected_size(), 0);
  EXPECT_EQ(tree.evictable_size(), 6);
  EXPECT_EQ(r.handle.lock_count, 0);
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

// ---------------------------------------------------------------------------------------------
// Locks.

TEST(RadixTreeTest, LocksNestAndEachHandleCountsItsOwn) {
  RadixTree tree;
  Insert(&tree, {1, 2, 3, 4}, Iota(0, 4));
  MatchResult a = Match(&tree, {1, 2, 3, 4});
  MatchResult b = Match(&tree, {1, 2, 3, 4});
  tree.Lock(&a.handle);
  tree.Lock(&a.handle);
  tree.Lock(&b.handle);
  EXPECT_EQ(a.handle.lock_count, 2);
  EXPECT_EQ(b.handle.lock_count, 1);
  EXPECT_EQ(Nodes(tree).at({1, 2, 3, 4}).ref_count, 3);
  EXPECT_EQ(tree.protected_size(), 4);
  EXPECT_EQ(tree.evictable_size(), 0);
  EXPECT_EQ(tree.num_evictable_leaves(), 0);

  tree.Unlock(&b.handle);
  ExpectFailsAndChangesNothing(&tree, {1, 2, 3, 4}, ErrorCode::kInvalidArgument,
                               [&] { tree.Unlock(&b.handle); });  // a still holds the node
  EXPECT_EQ(b.handle.lock_count, 0);
  EXPECT_EQ(Nodes(tree).at({1, 2, 3, 4}).ref_count, 2);

  tree.Unlock(&a.handle);
  EXPECT_EQ(tree.protected_size(), 4);
  tree.Unlock(&a.handle);
  EXPECT_EQ(tree.protected_size(), 0);
  EXPECT_EQ(tree.evictable_size(), 4);
  EXPECT_EQ(tree.num_evictable_leaves(), 1);
  EXPECT_INVALID(tree.Unlock(&a.handle));
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, ProtectedAndEvictableSizes) {
  RadixTree tree;
  Insert(&tree, {1, 2, 3, 4}, Iota(0, 4));
  Insert(&tree, {1, 2, 5, 6}, Iota(4, 4));
  Insert(&tree, {9}, {8});
  EXPECT_EQ(tree.evictable_size(), 7);
  MatchResult deep = Match(&tree, {1, 2, 3, 4});
  MatchResult shallow = Match(&tree, {1, 2});
  tree.Lock(&deep.handle);
  EXPECT_EQ(tree.protected_size(), 4);
  EXPECT_EQ(tree.evictable_size(), 3);
  tree.Lock(&shallow.handle);  // already protected through deep
  EXPECT_EQ(tree.protected_size(), 4);
  EXPECT_EQ(tree.evictable_size(), 3);
  auto nodes = Nodes(tree);
  EXPECT_EQ(nodes.at({1, 2}).ref_count, 2);
  EXPECT_EQ(nodes.at({1, 2, 3, 4}).ref_count, 1);
  EXPECT_EQ(nodes.at({1, 2, 5, 6}).ref_count, 0);

  EXPECT_OUT_OF_CAPACITY(Evict(&tree, 4));
  Ints evicted = Evict(&tree, 3);
  std::sort(evicted.begin(), evicted.end());
  EXPECT_EQ(evicted, (Ints{6, 7, 8}));
  EXPECT_EQ(tree.evictable_size(), 0);
  EXPECT_OUT_OF_CAPACITY(Evict(&tree, 1));

  tree.Unlock(&deep.handle);
  EXPECT_EQ(tree.protected_size(), 2);
  EXPECT_EQ(tree.evictable_size(), 2);
  tree.Unlock(&shallow.handle);
  EXPECT_EQ(tree.protected_size(), 0);
  EXPECT_EQ(tree.evictable_size(), 4);
  EXPECT_EQ(Evict(&tree, 4), (Ints{2, 3, 0, 1}));  // the leaf, then its parent
  EXPECT_EQ(tree.num_nodes(), 0);
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, LockedInnerNodeBecomesEvictableOnUnlock) {
  RadixTree tree;
  Insert(&tree, {5, 6, 7}, {0, 1, 2});
  MatchResult h = Match(&tree, {5, 6});
  tree.Lock(&h.handle);
  EXPECT_EQ(Evict(&tree, 1), (Ints{2}));
  EXPECT_EQ(tree.evictable_size(), 0);
  EXPECT_EQ(tree.protected_size(), 2);
  EXPECT_EQ(tree.num_evictable_leaves(), 0);
  EXPECT_NO_THROW(tree.CheckIntegrity());
  tree.Unlock(&h.handle);
  EXPECT_EQ(tree.num_evictable_leaves(), 1);
  EXPECT_EQ(tree.evictable_size(), 2);
  EXPECT_EQ(Evict(&tree, 2), (Ints{0, 1}));
  EXPECT_FALSE(tree.IsValid(h.handle));
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

// ---------------------------------------------------------------------------------------------
// The clock and exact LRU.

TEST(RadixTreeTest, ClockTicksOncePerSuccessfulCall) {
  RadixTree tree;
  Insert(&tree, {1}, {0});  // 1
  EXPECT_EQ(Nodes(tree).at({1}).timestamp, 1u);
  MatchResult r = Match(&tree, {1});  // 2
  EXPECT_EQ(Nodes(tree).at({1}).timestamp, 2u);
  tree.Lock(&r.handle);    // 3 (no refresh)
  tree.Unlock(&r.handle);  // 4 (no refresh)
  EXPECT_EQ(Nodes(tree).at({1}).timestamp, 2u);
  Evict(&tree, 0);          // 5
  Match(&tree, {7});        // 6, matches nothing
  Insert(&tree, {1}, {5});  // 7, fully cached: refreshes
  EXPECT_EQ(Nodes(tree).at({1}).timestamp, 7u);
  EXPECT_EQ(TouchTime(&tree, {1}), 8u);
  tree.Reset();                   // 9
  Insert(&tree, {2, 3}, {0, 1});  // 10
  EXPECT_EQ(Nodes(tree).at({2, 3}).timestamp, 10u);
}

TEST(RadixTreeTest, MatchRefreshesExactlyTheMatchedTokens) {
  RadixTree tree;
  Insert(&tree, {1, 1}, {0, 1});  // t1
  Insert(&tree, {2, 2}, {2, 3});  // t2
  Insert(&tree, {3, 3}, {4, 5});  // t3
  Insert(&tree, {4}, {6});        // t4
  Match(&tree, {2, 2, 7});        // t5
  Match(&tree, {1});              // t6: splits {1,1}; only the first token is refreshed
  auto nodes = Nodes(tree);
  EXPECT_EQ(nodes.at({1}).timestamp, 6u);
  EXPECT_EQ(nodes.at({1, 1}).timestamp, 1u);
  EXPECT_EQ(nodes.at({2, 2}).timestamp, 5u);
  EXPECT_EQ(nodes.at({3, 3}).timestamp, 3u);
  EXPECT_EQ(nodes.at({4}).timestamp, 4u);

  const std::vector<Ints> want{{1}, {4, 5}, {6}, {2, 3}, {0}};
  int64_t left = 7;
  for (const Ints& slots : want) {
    EXPECT_EQ(Evict(&tree, 1), slots);  // whole nodes: may be more than asked
    left -= static_cast<int64_t>(slots.size());
    EXPECT_EQ(tree.evictable_size(), left);
    EXPECT_NO_THROW(tree.CheckIntegrity());
  }
  EXPECT_EQ(tree.num_nodes(), 0);
}

// Builds a tree whose exact eviction order is known (see the comments for timestamps).
void BuildParentsAndLeaves(RadixTree* tree) {
  Insert(tree, {9}, {10});                // t1
  Insert(tree, {5, 6, 7}, {0, 1, 2});     // t2
  Insert(tree, {5, 6, 8}, {0, 1, 3});     // t3: {5,6} t3, {7} t2, {8} t3
  Insert(tree, {4}, {11});                // t4
  Insert(tree, {1, 2, 3}, {20, 21, 22});  // t5
  Insert(tree, {1, 2, 4}, {20, 21, 23});  // t6: {1,2} t6, {3} t5, {4} t6
  Insert(tree, {0}, {30});                // t7
}

// Oldest unlocked leaf first; a parent that becomes an unlocked leaf competes with its old time.
const std::vector<Ints> kParentsAndLeavesOrder{{10}, {2},  {3},      {0, 1}, {11},
                                               {22}, {23}, {20, 21}, {30}};

TEST(RadixTreeTest, ExactLruOrderOneLeafAtATime) {
  RadixTree tree;
  BuildParentsAndLeaves(&tree);
  EXPECT_EQ(tree.evictable_size(), 11);
  EXPECT_EQ(Nodes(tree).at({5, 6}).timestamp, 3u);
  EXPECT_EQ(Nodes(tree).at({1, 2}).timestamp, 6u);
  for (const Ints& slots : kParentsAndLeavesOrder) {
    EXPECT_EQ(Evict(&tree, 1), slots);
    EXPECT_NO_THROW(tree.CheckIntegrity());
  }
  EXPECT_EQ(tree.num_nodes(), 0);
  EXPECT_EQ(tree.evictable_size(), 0);
}

TEST(RadixTreeTest, ExactLruOrderInOneCall) {
  RadixTree tree;
  BuildParentsAndLeaves(&tree);
  Ints want;
  for (const Ints& slots : kParentsAndLeavesOrder) want = Concat(want, slots);
  EXPECT_EQ(Evict(&tree, 11), want);
  EXPECT_EQ(tree.num_nodes(), 0);
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, EvictStopsAtFirstNodeThatReachesSize) {
  RadixTree tree;
  BuildParentsAndLeaves(&tree);
  EXPECT_EQ(Evict(&tree, 3), (Ints{10, 2, 3}));
  EXPECT_EQ(Evict(&tree, 1), (Ints{0, 1}));  // asked 1, a 2-token node goes
  EXPECT_EQ(Evict(&tree, 3), (Ints{11, 22, 23}));
  EXPECT_EQ(tree.evictable_size(), 3);
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, LockedLeafIsSkippedAndUnlockDoesNotRefresh) {
  RadixTree tree;
  Insert(&tree, {1}, {0});            // t1
  Insert(&tree, {2}, {1});            // t2
  Insert(&tree, {3}, {2});            // t3
  MatchResult h = Match(&tree, {1});  // t4
  Insert(&tree, {4}, {3});            // t5
  tree.Lock(&h.handle);               // t6
  EXPECT_EQ(tree.evictable_size(), 3);
  EXPECT_OUT_OF_CAPACITY(Evict(&tree, 4));
  EXPECT_EQ(Evict(&tree, 1), (Ints{1}));
  tree.Unlock(&h.handle);
  EXPECT_EQ(Nodes(tree).at({1}).timestamp, 4u);
  EXPECT_EQ(Evict(&tree, 1), (Ints{2}));
  EXPECT_EQ(Evict(&tree, 1), (Ints{0}));  // t4, older than {4}
  EXPECT_EQ(Evict(&tree, 1), (Ints{3}));
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, InsertRefreshesItsWholePath) {
  RadixTree tree(2);
  Insert(&tree, {1, 1, 2, 2}, {0, 1, 2, 3});  // t1
  Insert(&tree, {7, 7}, {4, 5});              // t2
  Insert(&tree, {1, 1, 3, 3}, {0, 1, 6, 7});  // t3: {1,1} t3, {2,2} t1, {3,3} t3
  auto nodes = Nodes(tree);
  EXPECT_EQ(nodes.at({1, 1}).timestamp, 3u);
  EXPECT_EQ(nodes.at({1, 1, 2, 2}).timestamp, 1u);
  EXPECT_EQ(nodes.at({1, 1, 3, 3}).timestamp, 3u);
  EXPECT_EQ(Evict(&tree, 1), (Ints{2, 3}));
  EXPECT_EQ(Evict(&tree, 1), (Ints{4, 5}));
  EXPECT_EQ(Evict(&tree, 1), (Ints{6, 7}));
  EXPECT_EQ(Evict(&tree, 1), (Ints{0, 1}));
}

// ---------------------------------------------------------------------------------------------
// Bad input changes nothing.

TEST(RadixTreeTest, EvictArgumentErrors) {
  RadixTree tree;
  BuildParentsAndLeaves(&tree);
  MatchResult h = Match(&tree, {1, 2, 3});
  tree.Lock(&h.handle);
  EXPECT_EQ(tree.evictable_size(), 8);
  ExpectFailsAndChangesNothing(&tree, {9}, ErrorCode::kInvalidArgument, [&] { Evict(&tree, -1); });
  ExpectFailsAndChangesNothing(&tree, {9}, ErrorCode::kOutOfCapacity, [&] { Evict(&tree, 9); });
  ExpectFailsAndChangesNothing(&tree, {9}, ErrorCode::kOutOfCapacity,
                               [&] { Evict(&tree, INT64_MAX); });
  try {
    Evict(&tree, 9);
    ADD_FAILURE() << "did not throw";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("9"), std::string::npos) << msg;  // both numbers are named
    EXPECT_NE(msg.find("8"), std::string::npos) << msg;
  }
  Ints out{1, 2, 3};
  tree.Evict(0, &out);
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(tree.evictable_size(), 8);
  EXPECT_EQ(Evict(&tree, 8).size(), 8u);  // exactly everything evictable
  EXPECT_EQ(tree.protected_size(), 3);
  EXPECT_EQ(tree.num_nodes(), 2);
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, InsertWithBadSlotsChangesNothing) {
  RadixTree tree;
  Insert(&tree, {1, 2, 3, 4}, {0, 1, 2, 3});
  const Ints probe{1, 2, 3, 4};
  auto bad_insert = [&](Ints tokens, Ints slots) {
    return [&tree, tokens, slots] { Insert(&tree, tokens, slots); };
  };
  const ErrorCode kInvalid = ErrorCode::kInvalidArgument;
  ExpectFailsAndChangesNothing(&tree, probe, kInvalid, bad_insert({5, 6, 7}, {10, -1, 11}));
  ExpectFailsAndChangesNothing(&tree, probe, kInvalid, bad_insert({5, 6, 7}, {10, 11, 10}));
  ExpectFailsAndChangesNothing(&tree, probe, kInvalid, bad_insert({5, 6, 7}, {10, 11, 2}));
  // Diverging inside a node: the error comes before the split.
  ExpectFailsAndChangesNothing(&tree, probe, kInvalid, bad_insert({1, 2, 9, 9}, {0, 1, 12, 3}));
  ExpectFailsAndChangesNothing(&tree, probe, kInvalid,
                               bad_insert({1, 2, 9, 9}, {0, 1, 12, INT32_MIN}));
  // Every index is checked, not only the stored ones: the caller frees the others, so a negative
  // or repeated one there is a bug too.
  ExpectFailsAndChangesNothing(&tree, probe, kInvalid, bad_insert({1, 2, 9, 9}, {-1, 1, 12, 13}));
  ExpectFailsAndChangesNothing(&tree, probe, kInvalid, bad_insert({1, 2, 9, 9}, {12, 1, 12, 13}));
  ExpectFailsAndChangesNothing(&tree, probe, kInvalid, bad_insert({1, 2, 3, 4}, {0, 1, 2, -3}));
  EXPECT_EQ(tree.num_nodes(), 1);
  // The slots the failed calls checked are still free to store.
  EXPECT_EQ(Insert(&tree, {5, 6, 7}, {10, 11, 12}), 0);
  EXPECT_EQ(Insert(&tree, {1, 2, 9, 9}, {20, 21, 1000000, 13}), 2);
  EXPECT_EQ(Match(&tree, {1, 2, 9, 9}).slots, (Ints{0, 1, 1000000, 13}));
  EXPECT_EQ(tree.evictable_size(), 9);
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(RadixTreeTest, EvictedSlotsCanBeStoredAgain) {
  RadixTree tree;
  Insert(&tree, {1, 2}, {5, 6});
  EXPECT_INVALID(Insert(&tree, {3}, {5}));
  EXPECT_EQ(Evict(&tree, 2), (Ints{5, 6}));
  EXPECT_EQ(Insert(&tree, {3, 4}, {6, 5}), 0);
  EXPECT_EQ(Match(&tree, {3, 4}).slots, (Ints{6, 5}));
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

// ---------------------------------------------------------------------------------------------
// Stale and foreign handles, Reset.

TEST(RadixTreeTest, HandleOfEvictedNodeIsStale) {
  RadixTree tree;
  Insert(&tree, {1, 2}, {0, 1});
  MatchResult h = Match(&tree, {1, 2});
  Evict(&tree, 2);
  EXPECT_FALSE(tree.IsValid(h.handle));
  EXPECT_INVALID(tree.Lock(&h.handle));
  EXPECT_INVALID(tree.Unlock(&h.handle));
  // A new node reusing the freed node at the same depth must not revive the handle.
  Insert(&tree, {3, 4}, {0, 1});
  Insert(&tree, {1, 2}, {2, 3});
  EXPECT_FALSE(tree.IsValid(h.handle));
  ExpectFailsAndChangesNothing(&tree, {3, 4}, ErrorCode::kInvalidArgument,
                               [&] { tree.Lock(&h.handle); });
  EXPECT_EQ(h.handle.lock_count, 0);
  EXPECT_EQ(tree.protected_size(), 0);
}

// A hot node id is freed and reused once per insert/evict cycle. With 32-bit
// generations a stale handle became valid again after 2^32 cycles (an hour
// at a million operations a second) and unlocked someone else's prefix; 64
// bits take centuries. The cycles below show the id really is reused.
TEST(RadixTreeTest, GenerationsOfAHotIdNeverWrapToAStaleHandle) {
  EXPECT_EQ(sizeof(Handle{}.generation), 8u);
  EXPECT_EQ(sizeof(Node{}.generation), 8u);
  RadixTree tree;
  Insert(&tree, {1, 2}, {0, 1});
  MatchResult first = Match(&tree, {1, 2});
  for (int cycle = 0; cycle < 100000; ++cycle) {
    Evict(&tree, 2);
    Insert(&tree, {1, 2}, {0, 1});
    MatchResult now = Match(&tree, {1, 2});
    ASSERT_EQ(now.handle.node_id, first.handle.node_id);
    ASSERT_EQ(now.handle.generation, first.handle.generation + cycle + 1);
    ASSERT_FALSE(tree.IsValid(first.handle));
  }
  EXPECT_INVALID(tree.Unlock(&first.handle));
}

TEST(RadixTreeTest, MaxSlotsBoundsEverySlot) {
  RadixTree tree(2, 8);
  EXPECT_INVALID(Insert(&tree, {1, 2, 3, 4}, {4, 5, 6, 8}));
  EXPECT_EQ(tree.evictable_size(), 0);
  EXPECT_EQ(Insert(&tree, {1, 2, 3, 4}, {4, 5, 6, 7}), 0);
  EXPECT_INVALID(RadixTree(1, -2));
  EXPECT_INVALID(RadixTree(1, (int64_t{1} << 31) + 1));
  RadixTree any(1, RadixTree::kAnySlot);
  EXPECT_EQ(Insert(&any, {1}, {2147483647}), 0);
}

TEST(RadixTreeTest, StoredSlotsMemoryFollowsWhatIsStored) {
  RadixTree tree;
  Insert(&tree, {1, 2}, {3, 2147483646});
  EXPECT_LT(tree.stored_slots().MemoryBytes(), size_t{1} << 20);
  Evict(&tree, 2);
  EXPECT_EQ(tree.stored_slots().MemoryBytes(), 0u);
  tree.CheckIntegrity();
}

TEST(RadixTreeTest, HandleOfAnotherTreeIsRejected) {
  RadixTree a, b;
  Insert(&a, {1, 2}, {0, 1});
  Insert(&b, {1, 2}, {0, 1});
  MatchResult ha = Match(&a, {1, 2});
  MatchResult hb = Match(&b, {1, 2});
  EXPECT_FALSE(b.IsValid(ha.handle));
  ExpectFailsAndChangesNothing(&b, {1, 2}, ErrorCode::kInvalidArgument,
                               [&] { b.Lock(&ha.handle); });
  a.Lock(&ha.handle);
  ExpectFailsAndChangesNothing(&b, {1, 2}, ErrorCode::kInvalidArgument,
                               [&] { b.Unlock(&ha.handle); });
  EXPECT_EQ(ha.handle.lock_count, 1);
  EXPECT_EQ(b.protected_size(), 0);
  MatchResult root_a = Match(&a, {});
  EXPECT_INVALID(b.Lock(&root_a.handle));
  a.Unlock(&ha.handle);
  EXPECT_TRUE(b.IsValid(hb.handle));
}

TEST(RadixTreeTest, ResetClearsEverything) {
  for (int64_t page : {1, 4}) {
    RadixTree tree(page);
    Insert(&tree, Iota(0, 8), Iota(0, 8));
    Insert(&tree, Iota(0, 4), Iota(0, 4));
    Insert(&tree, Concat(Iota(0, 4), Iota(50, 4)), Iota(10, 8));
    MatchResult locked = Match(&tree, Iota(0, 8));
    MatchResult root = Match(&tree, {99});
    tree.Lock(&locked.handle);
    tree.Reset();
    EXPECT_EQ(tree.num_nodes(), 0);
    EXPECT_EQ(tree.evictable_size(), 0);
    EXPECT_EQ(tree.protected_size(), 0);
    EXPECT_EQ(tree.num_evictable_leaves(), 0);
    EXPECT_TRUE(tree.Dump().empty());
    EXPECT_EQ(Match(&tree, Iota(0, 8)).handle.cached_len, 0);
    EXPECT_FALSE(tree.IsValid(locked.handle));
    EXPECT_FALSE(tree.IsValid(root.handle));  // even the root handle of the old generation
    EXPECT_INVALID(tree.Unlock(&locked.handle));
    EXPECT_INVALID(tree.Lock(&root.handle));
    EXPECT_OUT_OF_CAPACITY(Evict(&tree, 1));
    EXPECT_NO_THROW(tree.CheckIntegrity());
    // Slots are free again, and the tree works as new.
    EXPECT_EQ(Insert(&tree, Iota(0, 8), Iota(10, 8)), 0);
    EXPECT_EQ(Match(&tree, Iota(0, 8)).slots, Iota(10, 8));
    EXPECT_EQ(Evict(&tree, 1), Iota(10, 8));
    EXPECT_NO_THROW(tree.CheckIntegrity());
  }
}

// Dump's contract: parents before children, children in ascending key order.
TEST(RadixTreeTest, DumpListsSiblingsInAscendingKeyOrder) {
  RadixTree tree;
  Insert(&tree, {3}, {0});
  Insert(&tree, {1, 5}, {1, 2});
  Insert(&tree, {2}, {3});
  Insert(&tree, {1, 4}, {0, 4});
  std::vector<NodeInfo> dump = tree.Dump();
  ASSERT_EQ(dump.size(), 5u);
  std::map<int64_t, std::vector<Ints>> siblings;
  for (size_t i = 0; i < dump.size(); ++i) {
    EXPECT_LT(dump[i].parent, static_cast<int64_t>(i));
    siblings[dump[i].parent].push_back(dump[i].key);
  }
  for (auto& [parent, keys] : siblings) {
    EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end())) << "children of dump entry " << parent;
  }
  EXPECT_EQ(dump[0].key, (Ints{1}));
}

// ---------------------------------------------------------------------------------------------
// Randomized: the tree against a page-level reference trie.

// The reference caches whole pages in a plain trie, with per-page slots, LRU time and lock count.
class ReferenceCache {
 public:
  struct Page {
    Page* parent = nullptr;
    Ints tokens, slots;
    uint64_t time = 0;
    int64_t locks = 0;
    uint64_t serial = 0;
    std::map<Ints, std::unique_ptr<Page>> children;
  };

  explicit ReferenceCache(int64_t page_size) : page_size_(page_size) {}

  int64_t page_size() const { return page_size_; }
  uint64_t clock() const { return clock_; }
  void Tick() { ++clock_; }
  int64_t total() const { return static_cast<int64_t>(by_slot_.size()); }
  int64_t protected_tokens() const { return protected_; }
  bool IsStored(int32_t slot) const { return by_slot_.count(slot) != 0; }
  bool IsAlive(uint64_t serial) const { return alive_.count(serial) != 0; }
  int32_t AnyStoredSlot() const { return by_slot_.begin()->first; }
  const Page* PageOfSlot(int32_t slot) const { return by_slot_.at(slot); }

  int64_t Round(int64_t n) const { return n - n % page_size_; }

  // The pages of the longest cached whole-page prefix of tokens[0, n).
  std::vector<Page*> Walk(const Ints& tokens, int64_t n) {
    std::vector<Page*> path;
    Page* cur = &root_;
    for (int64_t pos = 0; pos + page_size_ <= n; pos += page_size_) {
      auto it = cur->children.find(Ints(tokens.begin() + pos, tokens.begin() + pos + page_size_));
      if (it == cur->children.end()) break;
      cur = it->second.get();
      path.push_back(cur);
    }
    return path;
  }

  // The pages of the longest cached prefix, refreshed to the new tick.
  std::vector<Page*> Match(const Ints& tokens) {
    std::vector<Page*> path = Walk(tokens, Round(static_cast<int64_t>(tokens.size())));
    ++clock_;
    for (Page* p : path) p->time = clock_;
    return path;
  }

  // Which tokens would be stored new: [cached, Round(n)).
  int64_t CachedLen(const Ints& tokens) {
    return static_cast<int64_t>(Walk(tokens, Round(static_cast<int64_t>(tokens.size()))).size()) *
           page_size_;
  }

  int64_t Insert(const Ints& tokens, const Ints& slots) {
    const int64_t n = Round(static_cast<int64_t>(tokens.size()));
    std::vector<Page*> path = Walk(tokens, n);
    ++clock_;
    for (Page* p : path) p->time = clock_;
    Page* cur = path.empty() ? &root_ : path.back();
    const int64_t cached = static_cast<int64_t>(path.size()) * page_size_;
    for (int64_t pos = cached; pos < n; pos += page_size_) {
      auto page = std::make_unique<Page>();
      page->parent = cur;
      page->tokens.assign(tokens.begin() + pos, tokens.begin() + pos + page_size_);
      page->slots.assign(slots.begin() + pos, slots.begin() + pos + page_size_);
      page->time = clock_;
      page->serial = ++next_serial_;
      alive_.insert(page->serial);
      for (int32_t s : page->slots) by_slot_[s] = page.get();
      Page* raw = page.get();
      cur->children.emplace(page->tokens, std::move(page));
      cur = raw;
    }
    return cached;
  }

  void AddLocks(const std::vector<Page*>& path, int64_t delta) {
    ++clock_;
    for (Page* p : path) {
      if (p->locks == 0) protected_ += page_size_;
      p->locks += delta;
      if (p->locks == 0) protected_ -= page_size_;
    }
  }

  // Removes the page holding `slot` (must be an unlocked leaf page).
  void RemovePage(int32_t slot) {
    Page* p = by_slot_.at(slot);
    for (int32_t s : p->slots) by_slot_.erase(s);
    alive_.erase(p->serial);
    p->parent->children.erase(p->tokens);
  }

  uint64_t MinUnlockedTime() const {
    uint64_t best = UINT64_MAX;
    for (auto& [slot, page] : by_slot_) {
      if (page->locks == 0) best = std::min(best, page->time);
    }
    return best;
  }

  void Reset() {
    root_.children.clear();
    by_slot_.clear();
    alive_.clear();
    protected_ = 0;
    ++clock_;
  }

  // Every page with its full token path.
  void ForEachPage(const std::function<void(const Ints&, const Page&)>& fn) const {
    std::vector<std::pair<const Page*, Ints>> stack{{&root_, {}}};
    while (!stack.empty()) {
      auto [p, path] = stack.back();
      stack.pop_back();
      if (p != &root_) fn(path, *p);
      for (auto& [key, child] : p->children) stack.push_back({child.get(), Concat(path, key)});
    }
  }

 private:
  const int64_t page_size_;
  uint64_t clock_ = 0;
  uint64_t next_serial_ = 0;
  int64_t protected_ = 0;
  Page root_;
  std::unordered_map<int32_t, Page*> by_slot_;
  std::set<uint64_t> alive_;
};

// The tree's nodes, page by page, must be exactly the reference's pages.
void ExpectSameContents(const RadixTree& tree, const ReferenceCache& ref) {
  const int64_t ps = ref.page_size();
  std::map<Ints, std::tuple<Ints, uint64_t, int64_t>> tree_pages;  // path -> slots, time, refs
  for (auto& [path, node] : Nodes(tree)) {
    const int64_t start = static_cast<int64_t>(path.size()) - static_cast<int64_t>(node.key.size());
    ASSERT_EQ(node.key.size() % static_cast<size_t>(ps), 0u);
    for (size_t off = 0; off < node.key.size(); off += static_cast<size_t>(ps)) {
      Ints page_path(path.begin(), path.begin() + start + static_cast<int64_t>(off) + ps);
      Ints slots(node.value.begin() + off, node.value.begin() + off + ps);
      tree_pages[page_path] = {slots, node.timestamp, node.ref_count};
    }
  }
  std::map<Ints, std::tuple<Ints, uint64_t, int64_t>> ref_pages;
  ref.ForEachPage([&](const Ints& path, const ReferenceCache::Page& p) {
    ref_pages[path] = {p.slots, p.time, p.locks};
  });
  ASSERT_EQ(tree_pages.size(), ref_pages.size());
  for (auto& [path, want] : ref_pages) {
    auto it = tree_pages.find(path);
    ASSERT_NE(it, tree_pages.end()) << "page missing from the tree";
    ASSERT_EQ(std::get<0>(it->second), std::get<0>(want)) << "slots";
    ASSERT_EQ(std::get<1>(it->second), std::get<1>(want)) << "timestamp";
    ASSERT_EQ(std::get<2>(it->second), std::get<2>(want)) << "ref_count";
  }
}

// What Evict(size) must return, computed from a dump: pop the unlocked leaf with the smallest
// timestamp until `size` tokens are freed; a parent left an unlocked leaf joins the candidates.
Ints PredictEviction(const RadixTree& tree, int64_t size) {
  std::vector<NodeInfo> dump = tree.Dump();
  std::vector<int64_t> num_children(dump.size(), 0);
  for (const NodeInfo& n : dump) {
    if (n.parent >= 0) ++num_children[static_cast<size_t>(n.parent)];
  }
  std::set<std::pair<uint64_t, size_t>> leaves;
  for (size_t i = 0; i < dump.size(); ++i) {
    if (num_children[i] == 0 && dump[i].ref_count == 0) leaves.insert({dump[i].timestamp, i});
  }
  Ints out;
  int64_t freed = 0;
  while (freed < size && !leaves.empty()) {
    size_t i = leaves.begin()->second;
    leaves.erase(leaves.begin());
    out = Concat(out, dump[i].value);
    freed += static_cast<int64_t>(dump[i].value.size());
    const int64_t parent = dump[i].parent;
    if (parent >= 0 && --num_children[static_cast<size_t>(parent)] == 0 &&
        dump[static_cast<size_t>(parent)].ref_count == 0) {
      leaves.insert({dump[static_cast<size_t>(parent)].timestamp, static_cast<size_t>(parent)});
    }
  }
  return out;
}

struct HandleRecord {
  Handle handle;
  Ints tokens;          // the matched prefix
  uint64_t serial = 0;  // of its last page; 0 for the root
  uint64_t epoch = 0;   // resets seen when it was made
};

void RunRandomized(int64_t page_size, uint64_t seed, int steps) {
  SCOPED_TRACE(::testing::Message() << "page_size=" << page_size << " seed=" << seed);
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) {  // inclusive
    return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1));
  };
  RadixTree tree(page_size);
  ReferenceCache ref(page_size);
  // Slots come in whole pages, as from a paged pool: a random free page each,
  // given back when its first slot is.
  const int32_t pages_total = static_cast<int32_t>(std::max<int64_t>(64, (1 << 10) / page_size));
  std::vector<int32_t> free_pages(static_cast<size_t>(pages_total));
  std::iota(free_pages.begin(), free_pages.end(), 0);
  auto free_slot = [&](int32_t s) {
    if (s % page_size == 0) free_pages.push_back(static_cast<int32_t>(s / page_size));
  };
  std::vector<Ints> history{{}};  // recent inputs, to draw shared prefixes from
  std::vector<HandleRecord> handles;
  uint64_t epoch = 0;

  auto random_tokens = [&]() {
    const Ints& base = history[rng() % history.size()];
    Ints t(base.begin(), base.begin() + uniform(0, static_cast<int64_t>(base.size())));
    const int64_t extra = uniform(0, 5 * page_size);
    for (int64_t i = 0; i < extra; ++i) {
      // A wide first token gives nodes many children; then a narrow alphabet for shared runs.
      t.push_back(static_cast<int32_t>(i == 0 ? uniform(-1, 40) : uniform(-1, 2)));
    }
    const size_t cap = static_cast<size_t>(std::max<int64_t>(40, 6 * page_size));
    if (t.size() > cap) t.resize(cap);
    return t;
  };
  auto take_slots = [&](size_t n) {
    Ints out;
    while (out.size() < n) {
      size_t j = rng() % free_pages.size();
      for (int64_t i = 0; i < page_size && out.size() < n; ++i) {
        out.push_back(static_cast<int32_t>(free_pages[j] * page_size + i));
      }
      free_pages[j] = free_pages.back();
      free_pages.pop_back();
    }
    return out;
  };
  auto free_slots_cover = [&](size_t n) {
    return free_pages.size() * static_cast<size_t>(page_size) >= n + page_size;
  };
  auto stale = [&](const HandleRecord& h) {
    return h.epoch != epoch || (h.serial != 0 && !ref.IsAlive(h.serial));
  };
  auto unlock_all = [&](HandleRecord* h) {
    while (h->handle.lock_count > 0) {
      tree.Unlock(&h->handle);
      ref.AddLocks(ref.Walk(h->tokens, h->handle.cached_len), -1);
    }
  };

  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const int64_t op = uniform(0, 99);
    if (op < 35) {  // insert
      Ints tokens = random_tokens();
      if (!free_slots_cover(tokens.size())) continue;
      const int64_t size = static_cast<int64_t>(tokens.size());
      Ints slots = take_slots(tokens.size());
      const int64_t cached = ref.CachedLen(tokens);
      const int64_t n = ref.Round(size);
      // Half the time the cached part carries the tree's own slots, as after a match.
      const bool own_prefix = uniform(0, 1) == 0;
      if (own_prefix) {
        Ints own;
        for (auto* p : ref.Walk(tokens, cached)) own = Concat(own, p->slots);
        for (int64_t i = 0; i < cached; ++i) {
          free_slot(slots[i]);
          slots[i] = own[i];
        }
      }
      if (size > 0 && uniform(0, 9) == 0) {  // a bad slot: the call must fail and change nothing
        Ints bad = slots;
        const int64_t at = uniform(0, size - 1);
        const int64_t kind = uniform(0, 3);
        bad[at] = static_cast<int32_t>(-1 - uniform(0, 5));          // negative, anywhere
        if (kind == 1 && at > 0) bad[at] = bad[uniform(0, at - 1)];  // repeated, anywhere
        if (kind == 2 && cached < n && ref.total() > 0) {
          bad[at] = slots[at];
          bad[uniform(cached, n - 1)] = ref.AnyStoredSlot();  // stored, in the part to store
        }
        if (kind == 3 && page_size > 1 && at < n) {  // a page's slots out of order, anywhere
          bad = slots;
          const int64_t first = at - at % page_size;
          std::swap(bad[first], bad[first + 1]);
        }
        const std::string before = State(tree);
        ASSERT_TRUE(Throws(ErrorCode::kInvalidArgument, [&] { Insert(&tree, tokens, bad); }));
        ASSERT_EQ(State(tree), before);
      }
      const int64_t got = Insert(&tree, tokens, slots);
      ASSERT_EQ(got, ref.Insert(tokens, slots));
      // The caller keeps (and here frees) its own slots of the cached part and the partial page.
      for (int64_t i = own_prefix ? cached : 0; i < size; ++i) {
        if (i < got || i >= n) free_slot(slots[i]);
      }
      history.push_back(tokens);
    } else if (op < 60) {  // match
      Ints tokens = random_tokens();
      MatchResult r = Match(&tree, tokens);
      std::vector<ReferenceCache::Page*> path = ref.Match(tokens);
      Ints want;
      for (auto* p : path) want = Concat(want, p->slots);
      ASSERT_EQ(r.slots, want);
      ASSERT_EQ(r.handle.cached_len, static_cast<int64_t>(want.size()));
      HandleRecord rec{r.handle, Ints(tokens.begin(), tokens.begin() + r.handle.cached_len),
                       path.empty() ? 0 : path.back()->serial, epoch};
      if (handles.size() < 24) {
        handles.push_back(rec);
      } else {
        HandleRecord& old = handles[rng() % handles.size()];
        if (!stale(old)) unlock_all(&old);
        old = rec;
      }
      history.push_back(tokens);
    } else if (op < 73 && !handles.empty()) {  // lock
      HandleRecord& h = handles[rng() % handles.size()];
      if (stale(h)) {
        ASSERT_FALSE(tree.IsValid(h.handle));
        ASSERT_TRUE(Throws(ErrorCode::kInvalidArgument, [&] { tree.Lock(&h.handle); }));
      } else {
        ASSERT_TRUE(tree.IsValid(h.handle));
        tree.Lock(&h.handle);
        ref.AddLocks(ref.Walk(h.tokens, h.handle.cached_len), +1);
      }
    } else if (op < 86 && !handles.empty()) {  // unlock
      HandleRecord& h = handles[rng() % handles.size()];
      if (stale(h) || h.handle.lock_count == 0) {
        ASSERT_TRUE(Throws(ErrorCode::kInvalidArgument, [&] { tree.Unlock(&h.handle); }));
      } else {
        tree.Unlock(&h.handle);
        ref.AddLocks(ref.Walk(h.tokens, h.handle.cached_len), -1);
      }
    } else if (op < 98) {  // evict
      const int64_t evictable = ref.total() - ref.protected_tokens();
      ASSERT_EQ(tree.evictable_size(), evictable);
      if (uniform(0, 19) == 0) {
        const int64_t size = uniform(0, 1) ? -1 : evictable + uniform(1, 8);
        const std::string before = State(tree);
        ASSERT_TRUE(Throws(size < 0 ? ErrorCode::kInvalidArgument : ErrorCode::kOutOfCapacity,
                           [&] { Evict(&tree, size); }));
        ASSERT_EQ(State(tree), before);
      } else {
        const int64_t size = uniform(0, 19) == 0
                                 ? evictable
                                 : uniform(0, std::min<int64_t>(evictable, 3 * page_size));
        const Ints want = PredictEviction(tree, size);
        const Ints got = Evict(&tree, size);
        ref.Tick();
        ASSERT_EQ(got, want);
        ASSERT_GE(static_cast<int64_t>(got.size()), size);
        std::set<int32_t> seen;
        uint64_t newest_evicted = 0;
        std::vector<std::pair<size_t, int32_t>> pages;  // (depth in pages, first slot)
        for (size_t i = 0; i < got.size(); ++i) {
          const int32_t s = got[i];
          ASSERT_TRUE(seen.insert(s).second) << "slot " << s << " evicted twice";
          ASSERT_TRUE(ref.IsStored(s)) << "slot " << s << " was not stored";
          const ReferenceCache::Page* p = ref.PageOfSlot(s);
          ASSERT_EQ(p->locks, 0) << "locked slot " << s << " evicted";
          newest_evicted = std::max(newest_evicted, p->time);
          if (i % static_cast<size_t>(page_size) == 0) {
            // Whole pages, in order.
            ASSERT_LE(i + static_cast<size_t>(page_size), got.size());
            ASSERT_EQ(p->slots, Ints(got.begin() + i, got.begin() + i + page_size));
            size_t depth = 0;
            for (const ReferenceCache::Page* q = p; q->parent != nullptr; q = q->parent) ++depth;
            pages.push_back({depth, s});
          }
        }
        // Whole subtrees: every child of an evicted page is evicted too.
        for (auto& [depth, s] : pages) {
          for (auto& [key, child] : ref.PageOfSlot(s)->children) {
            ASSERT_TRUE(seen.count(child->slots.front())) << "evicted a page but not its child";
          }
        }
        std::sort(pages.rbegin(), pages.rend());
        for (auto& [depth, s] : pages) ref.RemovePage(s);
        for (int32_t s : got) free_slot(s);
        if (!got.empty()) {
          ASSERT_LE(newest_evicted, ref.MinUnlockedTime()) << "a newer token was evicted first";
        }
      }
    } else if (uniform(0, 49) == 0) {  // reset, rarely
      tree.Reset();
      ref.Reset();
      ++epoch;
      free_pages.resize(static_cast<size_t>(pages_total));
      std::iota(free_pages.begin(), free_pages.end(), 0);
    }
    ASSERT_EQ(tree.evictable_size() + tree.protected_size(), ref.total());
    ASSERT_EQ(tree.protected_size(), ref.protected_tokens());
    ASSERT_NO_THROW(tree.CheckIntegrity());
    if (step % 50 == 0) ASSERT_NO_FATAL_FAILURE(ExpectSameContents(tree, ref));
    ASSERT_FALSE(::testing::Test::HasFailure());
    if (history.size() > 64) history.erase(history.begin(), history.begin() + 32);
  }
  ExpectSameContents(tree, ref);
  for (HandleRecord& h : handles) {
    if (!stale(h)) unlock_all(&h);
  }
  EXPECT_EQ(tree.protected_size(), 0);
  Ints all = Evict(&tree, tree.evictable_size());
  EXPECT_EQ(static_cast<int64_t>(all.size()), ref.total());
  EXPECT_EQ(tree.num_nodes(), 0);
  EXPECT_NO_THROW(tree.CheckIntegrity());
  // The tree's clock kept pace with the reference's: the next call gets the next tick.
  Insert(&tree, Iota(0, static_cast<int>(page_size)), Iota(0, static_cast<int>(page_size)));
  EXPECT_EQ(Nodes(tree).at(Iota(0, static_cast<int>(page_size))).timestamp, ref.clock() + 2);
}

class RadixTreeRandomTest : public ::testing::TestWithParam<std::pair<int64_t, uint64_t>> {};

TEST_P(RadixTreeRandomTest, AgreesWithReference) {
  // Big pages hold more tokens a step (and the integrity walk is per token).
  RunRandomized(GetParam().first, GetParam().second, GetParam().first >= 512 ? 4000 : 20000);
}

INSTANTIATE_TEST_SUITE_P(PageSizes, RadixTreeRandomTest,
                         ::testing::Values(std::make_pair(int64_t{1}, uint64_t{1}),
                                           std::make_pair(int64_t{3}, uint64_t{2}),
                                           std::make_pair(int64_t{4}, uint64_t{3}),
                                           std::make_pair(int64_t{16}, uint64_t{4}),
                                           std::make_pair(int64_t{512}, uint64_t{5})),
                         [](const auto& info) {
                           return "page" + std::to_string(info.param.first) + "_seed" +
                                  std::to_string(info.param.second);
                         });

}  // namespace
TEST(RadixTreeTest, NamespacesNeverShareAPrefix) {
  for (int64_t page : {1, 4}) {
    RadixTree tree(page);
    const Ints ids = Iota(0, 8), slots_a = Iota(0, 8), slots_b = Iota(100, 8);
    EXPECT_EQ(tree.InsertPrefix(ids.data(), slots_a.data(), 8, 0, 1), 0);
    EXPECT_EQ(tree.InsertPrefix(ids.data(), slots_b.data(), 8, 0, 2), 0);
    std::vector<int32_t> got;
    EXPECT_EQ(tree.MatchPrefix(ids.data(), 8, &got, 1).cached_len, 8);
    EXPECT_EQ(got, slots_a);
    EXPECT_EQ(tree.MatchPrefix(ids.data(), 8, &got, 2).cached_len, 8);
    EXPECT_EQ(got, slots_b);
    EXPECT_EQ(tree.MatchPrefix(ids.data(), 8, &got).cached_len, 0);
    // A split inside one namespace keeps the parts there.
    EXPECT_EQ(tree.MatchPrefix(ids.data(), 4, &got, 2).cached_len, 4);
    EXPECT_EQ(tree.num_nodes(), 3);
    for (const NodeInfo& n : tree.Dump()) EXPECT_NE(n.ns, 0u);
    tree.CheckIntegrity();
    // One eviction order over both: namespace 1 was used least recently.
    std::vector<int32_t> freed;
    tree.Evict(8, &freed);
    EXPECT_EQ(freed, slots_a);
    EXPECT_EQ(tree.MatchPrefix(ids.data(), 8, &got, 2).cached_len, 8);
    tree.CheckIntegrity();
  }
}

// A node's rarely used fields (its namespace, claims, host copy) live in a
// column the tree makes the first time a call needs one: the nodes made
// before it read the defaults, and keep them across splits and reuse.
TEST(RadixTreeTest, TheRareFieldsColumnIsMadeWhenFirstNeeded) {
  for (int64_t page : {1, 4}) {
    RadixTree tree(page);
    const Ints a = Iota(0, 16), b = Concat(Iota(0, 8), Iota(50, 8));
    EXPECT_EQ(tree.InsertPrefix(a.data(), Iota(0, 16).data(), 16), 0);
    EXPECT_EQ(tree.InsertPrefix(b.data(), Concat(Iota(0, 8), Iota(100, 8)).data(), 16), 8);
    EXPECT_EQ(Evict(&tree, 8), Iota(8, 8));  // a free id, made before the column
    tree.CheckIntegrity();
    // The first namespace other than the default makes the column.
    EXPECT_EQ(tree.InsertPrefix(a.data(), Iota(200, 16).data(), 16, 0, 5), 0);
    EXPECT_EQ(tree.InsertPrefix(b.data(), Concat(Iota(200, 8), Iota(300, 8)).data(), 16, 0, 5), 8);
    tree.CheckIntegrity();
    std::vector<int32_t> got;
    EXPECT_EQ(tree.MatchPrefix(b.data(), 16, &got).cached_len, 16);
    EXPECT_EQ(got, Concat(Iota(0, 8), Iota(100, 8)));
    EXPECT_EQ(tree.MatchPrefix(a.data(), 16, &got, 5).cached_len, 16);
    EXPECT_EQ(got, Iota(200, 16));
    // Splits on both sides of the root keep each part in its namespace.
    EXPECT_EQ(tree.MatchPrefix(a.data(), 4, &got).cached_len, 4);
    EXPECT_EQ(tree.MatchPrefix(a.data(), 4, &got, 5).cached_len, 4);
    int64_t in_default = 0, in_five = 0;
    for (const NodeInfo& n : tree.Dump()) {
      EXPECT_TRUE(n.ns == 0 || n.ns == 5) << n.ns;
      (n.ns == 0 ? in_default : in_five) += static_cast<int64_t>(n.key.size());
    }
    EXPECT_EQ(in_default, 16);
    EXPECT_EQ(in_five, 24);
    tree.CheckIntegrity();
    // A claim on a path of the default namespace, held and released.
    Handle h = tree.MatchPrefix(b.data(), 16, &got);
    int64_t added = 0;
    const TierCopy claim = tree.AddClaim(h, false, 0, &added);
    EXPECT_EQ(added, 16);
    EXPECT_EQ(tree.claimed_size(), 16);
    tree.CheckIntegrity();
    EXPECT_EQ(tree.ReleaseClaim(claim), 16);
    // Freed ids are reused with the defaults: everything evicted, then cached
    // again in the default namespace.
    Evict(&tree, tree.evictable_size());
    EXPECT_EQ(tree.num_nodes(), 0);
    EXPECT_EQ(tree.InsertPrefix(a.data(), Iota(0, 16).data(), 16), 0);
    EXPECT_EQ(tree.MatchPrefix(a.data(), 16, &got, 5).cached_len, 0);
    for (const NodeInfo& n : tree.Dump()) EXPECT_EQ(n.ns, 0u);
    tree.CheckIntegrity();
  }
}

TEST(RadixTreeTest, AClaimMakesTheColumnOnATreeWithoutIt) {
  RadixTree tree(2);
  const Ints ids = Iota(0, 8);
  tree.InsertPrefix(ids.data(), Iota(0, 8).data(), 8);
  std::vector<int32_t> got;
  Handle h = tree.MatchPrefix(ids.data(), 8, &got);
  EXPECT_EQ(tree.ClaimCost(h, false), 8);
  int64_t added = 0;
  const TierCopy claim = tree.AddClaim(h, false, 3, &added);
  EXPECT_EQ(added, 8);
  EXPECT_EQ(tree.ClaimCost(h, false), 0);
  EXPECT_EQ(tree.evictable_size(), 0);  // a device claim locks its path
  tree.CheckIntegrity();
  EXPECT_EQ(tree.ReleaseClaim(claim), 8);
  EXPECT_EQ(tree.evictable_size(), 8);
  tree.CheckIntegrity();
}

// A device claim released twice, while a host claim holds the same path,
// is refused: the path holds no device claim any more (the host claim's
// count and lock are not the device claim's to give back).
TEST(RadixTreeTest, AClaimIsReleasedOnlyAgainstAClaimOfItsKind) {
  RadixTree tree(1);
  const Ints ids = Iota(1, 4);
  tree.InsertPrefix(ids.data(), Iota(10, 4).data(), 4);
  std::vector<int32_t> got;
  Handle h = tree.MatchPrefix(ids.data(), 4, &got);
  int64_t added = 0;
  const TierCopy host_claim = tree.AddClaim(h, true, 0, &added);
  const TierCopy device_claim = tree.AddClaim(h, false, 0, &added);
  EXPECT_EQ(tree.ReleaseClaim(device_claim), 0);  // the host claim still holds the tokens
  EXPECT_INVALID(tree.ReleaseClaim(device_claim));
  tree.CheckIntegrity();
  EXPECT_EQ(tree.claimed_size(), 4);
  EXPECT_EQ(tree.ReleaseClaim(host_claim), 4);
  EXPECT_INVALID(tree.ReleaseClaim(host_claim));
  EXPECT_EQ(tree.claimed_size(), 0);
  tree.CheckIntegrity();
}

TEST(RadixTreeTest, NamespacesOfManyIdsKeepTheRootConsistent) {
  RadixTree tree(1);
  int32_t slot = 0;
  for (uint64_t ns = 0; ns < 300; ++ns) {
    const Ints ids{static_cast<int32_t>(ns % 5), 7};
    const Ints slots{slot, slot + 1};
    slot += 2;
    EXPECT_EQ(tree.InsertPrefix(ids.data(), slots.data(), 2, 0, ns * 0x9E3779B9ull), 0);
  }
  tree.CheckIntegrity();
  EXPECT_EQ(tree.num_nodes(), 300);
  std::vector<int32_t> got;
  const Ints probe{3, 7};
  EXPECT_EQ(tree.MatchPrefix(probe.data(), 2, &got, 8 * 0x9E3779B9ull).cached_len, 2);
  EXPECT_EQ(got, (Ints{16, 17}));
}

}  // namespace radixkv
