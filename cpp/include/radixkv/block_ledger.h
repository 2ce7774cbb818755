// The blocks each tier of a cache holds, told as KV events.
//
// The tree returns slots, not blocks: an eviction gives back the freed slots,
// a copy between tiers names its slots. The ledger keeps, for every page of
// the device pool and of the host pool, the block it holds (its hash, its
// parent's hash, its page key and its tokens) and turns each change into
// BlockStored / BlockRemoved events, packed as msgpack as they happen
// (radixkv/event_pack.h), so a consumer replaying them holds exactly each
// tier's blocks: a block is announced stored on a medium once while it is
// there, and removed only after it was announced stored. One exception, a
// medium change: a device page evicted while its block is still in host
// memory is announced removed from "GPU" and, right after, stored on
// "CPU_PINNED" again, so a consumer that ignores media sees the block stay.
//
// A block's key is the storage tier's page key (radixkv/page_hash.h): the
// SHA-256 chain over the pages, so a page keeps its hash on every medium; its
// hash is the key's last 8 bytes, big-endian. An insert below a page the
// device holds continues the chain from that page's key instead of hashing the
// prefix again.
//
// A threaded ledger does that work on a thread of its own (radixkv/job_thread.h):
// each call checks its arguments and copies what it reads (the page ids, the
// tokens), then returns; the calls that read the ledger wait for its thread
// first. Then the thread that changes the cache pays a copy per change rather
// than the hashing and the packing.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "radixkv/job_thread.h"

namespace radixkv {

/// The events' names for the tiers' media (vLLM's).
inline constexpr const char* kMediumGpu = "GPU";
inline constexpr const char* kMediumCpuPinned = "CPU_PINNED";

class BlockLedger {
 public:
  /// A ledger for a device pool of `device_pages` and a host pool of
  /// `host_pages` pages of `page_size` tokens. The rows are allocated zeroed
  /// (the memory is touched only as pages are used): per page 56 bytes and 4
  /// a token. Throws kInvalidArgument for a negative count or page_size < 1.
  /// `threaded`: the changes are applied on the ledger's own thread, in
  /// order (see above); one thread at a time calls the ledger either way.
  BlockLedger(int64_t device_pages, int64_t host_pages, int64_t page_size, bool threaded = false);

  int64_t page_size() const noexcept { return page_size_; }
  int64_t device_pages() const noexcept { return device_.pages; }
  int64_t host_pages() const noexcept { return host_.pages; }
  bool threaded() const noexcept { return threaded_; }
  /// The lora_id every BlockStored carries from now on (none: nil).
  std::optional<int64_t> lora_id() const noexcept { return lora_id_; }
  void set_lora_id(std::optional<int64_t> id);

  /// Where a call takes slots it also takes page ids (`ids`: each page named
  /// by its id, page p holding slots p * page_size + [0, page_size), one
  /// entry a page; counts and positions stay in slots).
  ///
  /// `tokens[start, end)` (whole pages) joined the tree on the device with
  /// `slots[start, end)`; `slots[0, known)` are the tree's slots of the
  /// tokens before them. The chain goes on from the device block of the page
  /// before `start` when it holds one, else is hashed from `seed` (32 bytes,
  /// or null: unseeded) over `tokens[0, end)`. One BlockStored ("GPU").
  void DeviceInserted(const int32_t* tokens, const int32_t* slots, int64_t start, int64_t end,
                      int64_t known, const uint8_t* seed, bool ids = false);
  /// The pages of `slots[0, n)` (every page_size-th slot names one) left
  /// the device: one BlockRemoved of those that held a block; then, for
  /// those of them the host still holds, a BlockStored ("CPU_PINNED") per
  /// chain (the medium change).
  void DeviceEvicted(const int32_t* slots, int64_t n, bool ids = false);
  /// The host pages of `host_slots[0, n)` were loaded into the device pages
  /// of `device_slots[0, n)` at the same positions: their blocks are on the
  /// device too, a BlockStored ("GPU") per chain of consecutive blocks.
  void DeviceLoaded(const int32_t* host_slots, const int32_t* device_slots, int64_t n,
                    bool ids = false);

  /// A backup landed: the host pages of `host_slots[0, n)` not among the
  /// pages of `rejected[0, n_rejected)` hold copies of the device pages of
  /// `device_slots[0, n)` at the same positions. A BlockStored
  /// ("CPU_PINNED") per chain of the blocks the device held.
  void HostBackedUp(const int32_t* device_slots, const int32_t* host_slots, int64_t n,
                    const int32_t* rejected, int64_t n_rejected, bool ids = false);
  /// The host pages of `slots[0, n)` were dropped: one BlockRemoved.
  void HostEvicted(const int32_t* slots, int64_t n, bool ids = false);
  /// Pages read from storage joined the tree on the host: `host_slots[0,
  /// n_host)` hold the whole pages of `tokens[start, n)` (hashed from `seed`
  /// over `tokens[0, n)`), those among the pages of `rejected` were not
  /// taken. A BlockStored ("CPU_PINNED") per chain.
  void HostInserted(const int32_t* tokens, int64_t n, int64_t start, const int32_t* host_slots,
                    int64_t n_host, const int32_t* rejected, int64_t n_rejected,
                    const uint8_t* seed);

  /// Both tiers were emptied: a BlockRemoved of the host's blocks, then
  /// AllBlocksCleared for the device's.
  void Reset();

  /// Every block the tiers hold, as the events that store them: a
  /// BlockStored per chain, the device's ("GPU") first, then the host's
  /// ("CPU_PINNED"), each tier's parents before their children. What a
  /// consumer that lost track replays on an empty state. Records nothing.
  std::vector<std::string> Snapshot();

  /// The events packed since the last take, oldest first.
  std::vector<std::string> TakeEvents();
  /// Events packed and not taken, plus (threaded) changes not applied yet
  /// (a lora_id set counts as one).
  int64_t pending() const noexcept {
    return packed_.load(std::memory_order_acquire) + (threaded_ ? jobs_.queued() : 0);
  }

  /// Pages holding a block, per tier (a linear scan: for tests and checks).
  int64_t device_blocks();
  int64_t host_blocks();

  // Every call above throws kInvalidArgument, changing nothing, for a slot
  // outside its pool or ranges that are not whole pages of the input; then
  // nothing was recorded or packed. A threaded ledger's thread can fail only
  // to allocate: the next call that reads the ledger rethrows that.

 private:
  struct Block {
    uint64_t hash;
    uint64_t parent;
    uint8_t key[32];
    bool has_parent;
    bool present;
  };
  // A change as it is applied: what the call read. Its tokens are the
  // caller's (`given`, n_tokens of them) while the call runs; a threaded
  // ledger copies them into `tokens` for its thread.
  struct Change {
    std::vector<int64_t> pages, other, rejected;  // rejected: sorted
    const int32_t* given = nullptr;
    int64_t n_tokens = 0;
    std::vector<int32_t> tokens;
    int64_t token_base = 0;      // the position of the first token held
    int64_t start = 0, end = 0;  // pages of the request's tokens
    int64_t parent = -1;         // the device page before `start`, if known
    bool seeded = false;
    uint8_t seed[32] = {};
    std::optional<int64_t> lora_id;  // the one the changes after it carry
    const int32_t* Tokens() const { return given != nullptr ? given : tokens.data(); }
  };
  struct FreeDeleter {
    void operator()(void* p) const noexcept { std::free(p); }
  };
  // One pool's blocks, by page; its tokens beside them, page_size a page.
  struct Tier {
    int64_t pages = 0;
    std::unique_ptr<Block[], FreeDeleter> blocks;
    std::unique_ptr<int32_t[], FreeDeleter> tokens;
    int64_t Count() const noexcept;
  };

  // The page of each page_size-th of `slots[0, n)` in `pages` (with `ids`,
  // `slots` holds one page id a page: n / page_size of them), each checked
  // to lie in `tier` (the message names `what`[`at` + i]: `slots` may start
  // inside the argument).
  void PagesOf(const Tier& tier, const int32_t* slots, int64_t n, const char* what,
               std::vector<int64_t>* pages, int64_t at = 0, bool ids = false) const;
  // The blocks of `tokens`' pages [first, last) into `blocks_`/`tokens_`, the
  // chain from `seed` or, with `from`, on from that block.
  void Chain(const int32_t* tokens, int64_t first, int64_t last, const Block* from,
             const uint8_t* seed);
  void Put(Tier* tier, int64_t page, const Block& b, const int32_t* tokens);
  // A BlockRemoved of the blocks of `pages` that `tier` holds, which it drops.
  void Remove(Tier* tier, const std::vector<int64_t>& pages, const char* medium);
  // Copies the blocks `from` holds in pages `c.pages` to the pages at the
  // same positions of `c.other` in `to`, but those in `c.rejected`, and
  // gathers them into `blocks_`/`tokens_`.
  void CopyBlocks(const Tier& from, Tier* to, const Change& c);
  // Applies `change` now, or queues it for the ledger's thread (its tokens
  // copied), or applies it now where no thread can start.
  void Submit(void (BlockLedger::*apply)(const Change&), Change change);
  void ApplyDeviceInserted(const Change& c);
  void ApplyDeviceEvicted(const Change& c);
  void ApplyDeviceLoaded(const Change& c);
  void ApplyHostBackedUp(const Change& c);
  void ApplyHostEvicted(const Change& c);
  void ApplyHostInserted(const Change& c);
  void ApplyReset(const Change& c);
  void ApplyLoraId(const Change& c);
  void Emit(std::string event);
  // Waits for the ledger's thread (threaded) to apply every change.
  void Settle();
  // A BlockStored per chain of the gathered blocks (`blocks_`, `tokens_`),
  // into `out` (the pending events unless given).
  void PackStoredChains(const char* medium, std::vector<std::string>* out = nullptr);
  // Gathers `tier`'s blocks into `blocks_`/`tokens_`, parents first.
  void GatherParentsFirst(const Tier& tier);

  // The host page of each block the host holds, by hash: open addressing
  // with linear probing over a table made once (at least twice the host
  // pages, a power of two), so recording a block never allocates. Slots
  // hold page + 1 (0: empty, so the table starts zeroed).
  struct HostIndex {
    struct Slot {
      uint64_t hash;
      int64_t page1;
    };
    std::unique_ptr<Slot[], FreeDeleter> slots;
    uint64_t mask = 0;
    void Init(int64_t pages);
    int64_t Find(uint64_t hash) const noexcept;
    void Insert(uint64_t hash, int64_t page) noexcept;
    void Erase(uint64_t hash) noexcept;
    void Clear() noexcept;
  };

  int64_t page_size_;
  bool threaded_;
  Tier device_, host_;
  HostIndex host_index_;
  std::optional<int64_t> lora_id_;          // the caller's
  std::optional<int64_t> packing_lora_id_;  // the one the changes applied carry
  std::vector<std::string> pending_;
  std::atomic<int64_t> packed_{0};  // pending_.size(), read from any thread
  // (threaded) The caller's view of which device pages hold a block: set by
  // an insert, cleared by an eviction or a reset; a load may set pages it
  // leaves clear. Where it is set, the page holds a block when the changes
  // before are applied, so an insert below it copies only its own tokens.
  std::vector<uint8_t> device_held_;
  // Scratch of the changes applied (no allocation once warm).
  std::vector<Block> blocks_;
  std::vector<int32_t> tokens_;
  std::vector<uint8_t> keys_;
  std::vector<uint64_t> hashes_;
  // Last: it stops (after the changes queued) before the rows go.
  JobThread jobs_;
};

}  // namespace radixkv
