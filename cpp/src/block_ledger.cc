#include "radixkv/block_ledger.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <new>
#include <system_error>
#include <unordered_map>

#include "radixkv/event_pack.h"
#include "radixkv/page_hash.h"
#include "radixkv/status.h"

namespace radixkv {
namespace {

// A page key's block hash: its last 8 bytes, big-endian.
uint64_t HashOfKey(const uint8_t* key) {
  uint64_t h = 0;
  for (int i = 24; i < 32; ++i) h = (h << 8) | key[i];
  return h;
}

template <typename T>
T* Zeroed(int64_t n) {
  if (n == 0) return nullptr;
  void* p = std::calloc(static_cast<size_t>(n), sizeof(T));
  if (p == nullptr) throw std::bad_alloc();
  return static_cast<T*>(p);
}

template <typename T>
Strided<T> Run(const T* data, int64_t n) {
  return {reinterpret_cast<const unsigned char*>(data), n, sizeof(T)};
}

}  // namespace

int64_t BlockLedger::Tier::Count() const noexcept {
  int64_t n = 0;
  for (int64_t p = 0; p < pages; ++p) n += blocks[p].present ? 1 : 0;
  return n;
}

BlockLedger::BlockLedger(int64_t device_pages, int64_t host_pages, int64_t page_size,
                         bool threaded)
    : page_size_(page_size), threaded_(threaded) {
  RADIXKV_CHECK(page_size >= 1, ErrorCode::kInvalidArgument, "page_size must be >= 1, got ",
                page_size);
  RADIXKV_CHECK(device_pages >= 0, ErrorCode::kInvalidArgument, "device_pages must be >= 0, got ",
                device_pages);
  RADIXKV_CHECK(host_pages >= 0, ErrorCode::kInvalidArgument, "host_pages must be >= 0, got ",
                host_pages);
  for (auto [tier, pages] : {std::pair{&device_, device_pages}, std::pair{&host_, host_pages}}) {
    RADIXKV_CHECK(pages <= INT64_MAX / page_size / 4, ErrorCode::kInvalidArgument,
                  "too many pages for a ledger: ", pages);
    tier->pages = pages;
    tier->blocks.reset(Zeroed<Block>(pages));
    tier->tokens.reset(Zeroed<int32_t>(pages * page_size));
  }
  host_index_.Init(host_pages);
  if (threaded_) device_held_.assign(static_cast<size_t>(device_pages), 0);
}

// --- the host index ------------------------------------------------------------------

void BlockLedger::HostIndex::Init(int64_t pages) {
  if (pages == 0) return;
  uint64_t size = 2;
  while (size < 2 * static_cast<uint64_t>(pages)) size <<= 1;
  slots.reset(Zeroed<Slot>(static_cast<int64_t>(size)));
  mask = size - 1;
}

int64_t BlockLedger::HostIndex::Find(uint64_t hash) const noexcept {
  if (!slots) return -1;
  for (uint64_t i = hash & mask;; i = (i + 1) & mask) {
    if (slots[i].page1 == 0) return -1;
    if (slots[i].hash == hash) return slots[i].page1 - 1;
  }
}

void BlockLedger::HostIndex::Insert(uint64_t hash, int64_t page) noexcept {
  uint64_t i = hash & mask;  // never full: it has twice the room of the host pages
  while (slots[i].page1 != 0 && slots[i].hash != hash) i = (i + 1) & mask;
  slots[i] = Slot{hash, page + 1};
}

void BlockLedger::HostIndex::Erase(uint64_t hash) noexcept {
  if (!slots) return;
  uint64_t i = hash & mask;
  while (slots[i].page1 != 0 && slots[i].hash != hash) i = (i + 1) & mask;
  if (slots[i].page1 == 0) return;
  // Backward shift: each later slot of the run moves into the hole unless
  // its home lies cyclically in (hole, slot].
  for (uint64_t j = (i + 1) & mask; slots[j].page1 != 0; j = (j + 1) & mask) {
    const uint64_t home = slots[j].hash & mask;
    const bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
    if (stays) continue;
    slots[i] = slots[j];
    i = j;
  }
  slots[i] = Slot{0, 0};
}

void BlockLedger::HostIndex::Clear() noexcept {
  for (uint64_t i = 0; slots && i <= mask; ++i) slots[i] = Slot{0, 0};
}

void BlockLedger::PagesOf(const Tier& tier, const int32_t* slots, int64_t n, const char* what,
                          std::vector<int64_t>* pages, int64_t at, bool ids) const {
  pages->clear();
  for (int64_t i = 0; i < n; i += page_size_) {
    const int64_t k = ids ? i / page_size_ : i;  // the entry naming the page
    const int64_t v = slots[k];
    const int64_t page = ids ? v : (v >= 0 ? v / page_size_ : -1);
    RADIXKV_CHECK(page >= 0 && page < tier.pages, ErrorCode::kInvalidArgument, what, "[",
                  (ids ? at / page_size_ : at) + k, "] = ", v, " is not a ",
                  ids ? "page" : "slot", " of a pool of ", tier.pages, " pages of ", page_size_);
    pages->push_back(page);
  }
}

void BlockLedger::Chain(const int32_t* tokens, int64_t first, int64_t last, const Block* from,
                        const uint8_t* seed) {
  const int64_t ps = page_size_, count = last - first;
  blocks_.resize(static_cast<size_t>(count));
  hashes_.resize(static_cast<size_t>(count));
  tokens_.assign(tokens + first * ps, tokens + last * ps);
  const uint8_t* keys;
  std::optional<uint64_t> prev;
  if (from != nullptr) {
    keys_.resize(static_cast<size_t>(count * kPageKeyBytes));
    PageKeys(tokens + first * ps, count * ps, ps, from->key, keys_.data());
    keys = keys_.data();
    prev = from->hash;
  } else {
    keys_.resize(static_cast<size_t>(last * kPageKeyBytes));
    PageKeys(tokens, last * ps, ps, seed, keys_.data());
    keys = keys_.data() + first * kPageKeyBytes;
    if (first > 0) prev = HashOfKey(keys - kPageKeyBytes);
  }
  for (int64_t i = 0; i < count; ++i) {
    Block& b = blocks_[static_cast<size_t>(i)];
    std::memcpy(b.key, keys + i * kPageKeyBytes, kPageKeyBytes);
    b.hash = HashOfKey(b.key);
    b.has_parent = prev.has_value();
    b.parent = prev.value_or(0);
    b.present = true;
    hashes_[static_cast<size_t>(i)] = b.hash;
    prev = b.hash;
  }
}

void BlockLedger::Put(Tier* tier, int64_t page, const Block& b, const int32_t* tokens) {
  if (tier == &host_) {
    if (host_.blocks[page].present) host_index_.Erase(host_.blocks[page].hash);
    host_index_.Insert(b.hash, page);
  }
  tier->blocks[page] = b;
  tier->blocks[page].present = true;
  std::memcpy(&tier->tokens[page * page_size_], tokens,
              static_cast<size_t>(page_size_) * sizeof(int32_t));
}

void BlockLedger::Emit(std::string event) {
  pending_.push_back(std::move(event));
  packed_.fetch_add(1, std::memory_order_release);
}

void BlockLedger::Remove(Tier* tier, const std::vector<int64_t>& pages, const char* medium) {
  hashes_.clear();
  for (int64_t page : pages) {
    Block& b = tier->blocks[page];
    if (!b.present) continue;
    b.present = false;
    hashes_.push_back(b.hash);
    if (tier == &host_) host_index_.Erase(b.hash);
  }
  if (hashes_.empty()) return;
  std::string event;
  PackBlockRemoved(&event, Run(hashes_.data(), static_cast<int64_t>(hashes_.size())), medium);
  Emit(std::move(event));
}

void BlockLedger::PackStoredChains(const char* medium, std::vector<std::string>* out) {
  const int64_t n = static_cast<int64_t>(blocks_.size()), ps = page_size_;
  hashes_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) hashes_[static_cast<size_t>(i)] = blocks_[i].hash;
  for (int64_t a = 0; a < n;) {
    int64_t b = a + 1;
    while (b < n && blocks_[b].has_parent && blocks_[b].parent == blocks_[b - 1].hash) ++b;
    const Block& first = blocks_[a];
    std::optional<uint64_t> parent;
    if (first.has_parent) parent = first.parent;
    std::string event;
    PackBlockStored(&event, Run(hashes_.data() + a, b - a), parent,
                    Run(tokens_.data() + a * ps, (b - a) * ps), ps, packing_lora_id_, medium);
    if (out != nullptr) {
      out->push_back(std::move(event));
    } else {
      Emit(std::move(event));
    }
    a = b;
  }
}

void BlockLedger::Submit(void (BlockLedger::*apply)(const Change&), Change change) {
  if (threaded_) {
    change.tokens.assign(change.given, change.given + change.n_tokens);
    change.given = nullptr;
    std::function<void()> job = [this, apply, c = std::move(change)] { (this->*apply)(c); };
    try {
      jobs_.Post(std::move(job));
      return;
    } catch (const std::system_error&) {
      // No thread: nothing is queued (a thread starts with the first job), so
      // applying it here keeps the order.
      job();
      return;
    }
  }
  (this->*apply)(change);
}

void BlockLedger::Settle() {
  if (!threaded_) return;
  try {
    jobs_.Wait();
  } catch (...) {
    // A change failed (to allocate) part way: which pages hold a block is
    // no longer known here, so every insert copies its prefix again.
    std::fill(device_held_.begin(), device_held_.end(), 0);
    throw;
  }
}

void BlockLedger::set_lora_id(std::optional<int64_t> id) {
  Change c;
  c.lora_id = id;
  Submit(&BlockLedger::ApplyLoraId, std::move(c));
  lora_id_ = id;
}

void BlockLedger::ApplyLoraId(const Change& c) { packing_lora_id_ = c.lora_id; }

void BlockLedger::DeviceInserted(const int32_t* tokens, const int32_t* slots, int64_t start,
                                 int64_t end, int64_t known, const uint8_t* seed, bool ids) {
  const int64_t ps = page_size_;
  RADIXKV_CHECK(start >= 0 && start % ps == 0 && end % ps == 0, ErrorCode::kInvalidArgument,
                "start (", start, ") and end (", end, ") must be whole pages of ", ps);
  if (start >= end) return;
  // The entry of the token at `pos`: its slot, or its page's id.
  auto at = [&](int64_t pos) { return slots + (ids ? pos / ps : pos); };
  Change c;
  PagesOf(device_, at(start), end - start, "slots", &c.pages, start, ids);
  if (start > 0 && start <= known) {
    PagesOf(device_, at(start - ps), 1, "slots", &c.other, start - ps, ids);
    c.parent = c.other[0];
  }
  c.start = start / ps;
  c.end = end / ps;
  // The tokens before `start` only where the chain may start from the seed:
  // a threaded ledger whose parent page holds a block copies its own alone.
  const bool held = threaded_ && c.parent >= 0 && device_held_[c.parent];
  c.token_base = held ? start : 0;
  c.given = tokens + c.token_base;
  c.n_tokens = end - c.token_base;
  c.seeded = seed != nullptr;
  if (c.seeded) std::memcpy(c.seed, seed, sizeof(c.seed));
  std::vector<int64_t> pages = threaded_ ? c.pages : std::vector<int64_t>();
  Submit(&BlockLedger::ApplyDeviceInserted, std::move(c));
  for (int64_t page : pages) device_held_[page] = 1;
}

void BlockLedger::ApplyDeviceInserted(const Change& c) {
  const int64_t ps = page_size_;
  const Block* from = nullptr;
  if (c.parent >= 0 && device_.blocks[c.parent].present) from = &device_.blocks[c.parent];
  if (c.token_base > 0) {
    // Only the new pages' tokens: the caller saw the parent's block held.
    RADIXKV_CHECK(from != nullptr, ErrorCode::kIntegrity, "the ledger lost the block of page ",
                  c.parent, " before an insert below it was applied");
    Chain(c.Tokens(), 0, c.end - c.start, from, nullptr);
  } else {
    Chain(c.Tokens(), c.start, c.end, from, c.seeded ? c.seed : nullptr);
  }
  for (size_t i = 0; i < c.pages.size(); ++i) {
    Put(&device_, c.pages[i], blocks_[i], tokens_.data() + static_cast<int64_t>(i) * ps);
  }
  std::optional<uint64_t> parent;
  if (blocks_[0].has_parent) parent = blocks_[0].parent;
  std::string event;
  PackBlockStored(&event, Run(hashes_.data(), static_cast<int64_t>(hashes_.size())), parent,
                  Run(tokens_.data(), static_cast<int64_t>(tokens_.size())), ps,
                  packing_lora_id_, kMediumGpu);
  Emit(std::move(event));
}

void BlockLedger::DeviceEvicted(const int32_t* slots, int64_t n, bool ids) {
  Change c;
  PagesOf(device_, slots, n, "slots", &c.pages, 0, ids);
  // Cleared first (clear is the safe side): a fork from another thread
  // meanwhile gives its child the eviction applied.
  if (threaded_) {
    for (int64_t page : c.pages) device_held_[page] = 0;
  }
  Submit(&BlockLedger::ApplyDeviceEvicted, std::move(c));
}

void BlockLedger::ApplyDeviceEvicted(const Change& c) {
  // The blocks the host still holds move there: gathered before they go.
  const int64_t ps = page_size_;
  blocks_.clear();
  tokens_.clear();
  for (int64_t page : c.pages) {
    const Block& b = device_.blocks[page];
    const int64_t host = b.present ? host_index_.Find(b.hash) : -1;
    if (host < 0) continue;
    blocks_.push_back(host_.blocks[host]);
    const int32_t* t = &host_.tokens[host * ps];
    tokens_.insert(tokens_.end(), t, t + ps);
  }
  Remove(&device_, c.pages, kMediumGpu);
  if (!blocks_.empty()) PackStoredChains(kMediumCpuPinned);
}

void BlockLedger::HostEvicted(const int32_t* slots, int64_t n, bool ids) {
  Change c;
  PagesOf(host_, slots, n, "slots", &c.pages, 0, ids);
  Submit(&BlockLedger::ApplyHostEvicted, std::move(c));
}

void BlockLedger::ApplyHostEvicted(const Change& c) { Remove(&host_, c.pages, kMediumCpuPinned); }

void BlockLedger::CopyBlocks(const Tier& from, Tier* to, const Change& c) {
  const int64_t ps = page_size_;
  blocks_.clear();
  tokens_.clear();
  for (size_t i = 0; i < c.pages.size(); ++i) {
    const int64_t page = c.pages[i], to_page = c.other[i];
    if (!from.blocks[page].present ||
        std::binary_search(c.rejected.begin(), c.rejected.end(), to_page)) {
      continue;
    }
    blocks_.push_back(from.blocks[page]);
    const int32_t* t = &from.tokens[page * ps];
    tokens_.insert(tokens_.end(), t, t + ps);
    Put(to, to_page, blocks_.back(), t);
  }
}

void BlockLedger::DeviceLoaded(const int32_t* host_slots, const int32_t* device_slots, int64_t n,
                               bool ids) {
  Change c;
  PagesOf(host_, host_slots, n, "host_slots", &c.pages, 0, ids);
  PagesOf(device_, device_slots, n, "device_slots", &c.other, 0, ids);
  Submit(&BlockLedger::ApplyDeviceLoaded, std::move(c));
}

void BlockLedger::ApplyDeviceLoaded(const Change& c) {
  CopyBlocks(host_, &device_, c);
  PackStoredChains(kMediumGpu);
}

void BlockLedger::HostBackedUp(const int32_t* device_slots, const int32_t* host_slots, int64_t n,
                               const int32_t* rejected, int64_t n_rejected, bool ids) {
  Change c;
  PagesOf(device_, device_slots, n, "device_slots", &c.pages, 0, ids);
  PagesOf(host_, host_slots, n, "host_slots", &c.other, 0, ids);
  PagesOf(host_, rejected, n_rejected, "rejected", &c.rejected, 0, ids);
  std::sort(c.rejected.begin(), c.rejected.end());
  Submit(&BlockLedger::ApplyHostBackedUp, std::move(c));
}

void BlockLedger::ApplyHostBackedUp(const Change& c) {
  CopyBlocks(device_, &host_, c);
  PackStoredChains(kMediumCpuPinned);
}

void BlockLedger::HostInserted(const int32_t* tokens, int64_t n, int64_t start,
                               const int32_t* host_slots, int64_t n_host, const int32_t* rejected,
                               int64_t n_rejected, const uint8_t* seed) {
  const int64_t ps = page_size_;
  RADIXKV_CHECK(start >= 0 && start <= n, ErrorCode::kInvalidArgument, "start (", start,
                ") must be in [0, ", n, "]");
  Change c;
  c.start = start / ps;
  c.end = n / ps;
  PagesOf(host_, host_slots, n_host, "host_slots", &c.pages);
  RADIXKV_CHECK(static_cast<int64_t>(c.pages.size()) == c.end - c.start,
                ErrorCode::kInvalidArgument, "host_slots name ", c.pages.size(),
                " pages, the tokens after start hold ", c.end - c.start);
  PagesOf(host_, rejected, n_rejected, "rejected", &c.rejected);
  std::sort(c.rejected.begin(), c.rejected.end());
  if (c.end <= c.start) return;
  c.given = tokens;
  c.n_tokens = c.end * ps;
  c.seeded = seed != nullptr;
  if (c.seeded) std::memcpy(c.seed, seed, sizeof(c.seed));
  Submit(&BlockLedger::ApplyHostInserted, std::move(c));
}

void BlockLedger::ApplyHostInserted(const Change& c) {
  const int64_t ps = page_size_;
  Chain(c.Tokens(), c.start, c.end, nullptr, c.seeded ? c.seed : nullptr);
  // Keep the taken blocks (and their tokens) in place, in order.
  size_t kept = 0;
  for (size_t i = 0; i < c.pages.size(); ++i) {
    if (std::binary_search(c.rejected.begin(), c.rejected.end(), c.pages[i])) continue;
    if (kept != i) {
      blocks_[kept] = blocks_[i];
      std::memcpy(&tokens_[kept * ps], &tokens_[i * ps], static_cast<size_t>(ps) * sizeof(int32_t));
    }
    Put(&host_, c.pages[i], blocks_[kept], &tokens_[kept * ps]);
    ++kept;
  }
  blocks_.resize(kept);
  tokens_.resize(kept * ps);
  PackStoredChains(kMediumCpuPinned);
}

void BlockLedger::Reset() {
  std::fill(device_held_.begin(), device_held_.end(), 0);
  Submit(&BlockLedger::ApplyReset, Change{});
}

void BlockLedger::ApplyReset(const Change&) {
  hashes_.clear();
  for (int64_t p = 0; p < host_.pages; ++p) {
    if (host_.blocks[p].present) hashes_.push_back(host_.blocks[p].hash);
  }
  std::string removed, cleared;
  if (!hashes_.empty()) {
    PackBlockRemoved(&removed, Run(hashes_.data(), static_cast<int64_t>(hashes_.size())),
                     kMediumCpuPinned);
  }
  PackAllBlocksCleared(&cleared);
  pending_.reserve(pending_.size() + 2);
  if (!removed.empty()) Emit(std::move(removed));
  Emit(std::move(cleared));
  for (Tier* tier : {&device_, &host_}) {
    for (int64_t p = 0; p < tier->pages; ++p) tier->blocks[p].present = false;
  }
  host_index_.Clear();
}

void BlockLedger::GatherParentsFirst(const Tier& tier) {
  const int64_t ps = page_size_;
  std::unordered_map<uint64_t, int64_t> page_of;
  for (int64_t p = 0; p < tier.pages; ++p) {
    if (tier.blocks[p].present) page_of.emplace(tier.blocks[p].hash, p);
  }
  std::vector<bool> done(static_cast<size_t>(tier.pages), false);
  std::vector<int64_t> path;
  blocks_.clear();
  tokens_.clear();
  for (int64_t p = 0; p < tier.pages; ++p) {
    // Up the chain to the first block given already (or held nowhere here),
    // then down again: each block after its parent.
    path.clear();
    for (int64_t q = p; q >= 0 && tier.blocks[q].present && !done[static_cast<size_t>(q)];) {
      done[static_cast<size_t>(q)] = true;
      path.push_back(q);
      const Block& b = tier.blocks[q];
      const auto up = b.has_parent ? page_of.find(b.parent) : page_of.end();
      q = up != page_of.end() ? up->second : -1;
    }
    for (auto it = path.rbegin(); it != path.rend(); ++it) {
      blocks_.push_back(tier.blocks[*it]);
      const int32_t* t = &tier.tokens[*it * ps];
      tokens_.insert(tokens_.end(), t, t + ps);
    }
  }
}

std::vector<std::string> BlockLedger::Snapshot() {
  Settle();
  std::vector<std::string> out;
  GatherParentsFirst(device_);
  PackStoredChains(kMediumGpu, &out);
  GatherParentsFirst(host_);
  PackStoredChains(kMediumCpuPinned, &out);
  return out;
}

std::vector<std::string> BlockLedger::TakeEvents() {
  Settle();
  std::vector<std::string> out;
  out.swap(pending_);
  packed_.store(0, std::memory_order_release);
  return out;
}

int64_t BlockLedger::device_blocks() {
  Settle();
  return device_.Count();
}

int64_t BlockLedger::host_blocks() {
  Settle();
  return host_.Count();
}

}  // namespace radixkv
