// The copy controller of the host tier: queues of backups (device to host)
// and loads (host to device), run off the scheduler's thread, and their
// acknowledgements.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "radixkv/fork_list.h"
#include "radixkv/transfer_index.h"

namespace radixkv {

/// One copy between the tiers: the rows of `src` slots to `dst` slots, in
/// every layer (a backup) or layer by layer (a load). With `unit` > 1 the
/// lists name pages of `unit` slots (page p: slots p * unit + [0, unit)), as
/// the scheduler hands them over; an engine that copies by slot expands them
/// first (ExpandToSlots), on its own thread, and one that copies nothing
/// never does. The controller owns the lists.
struct CopyJob {
  enum class Kind : uint8_t { kBackup, kLoad };
  uint64_t id = 0;
  Kind kind = Kind::kBackup;
  int32_t unit = 1;
  std::vector<int32_t> src;
  std::vector<int32_t> dst;
  /// Engine-defined state, e.g. the CUDA events the copy waits for.
  std::shared_ptr<void> fence;

  /// Makes `src` and `dst` name slots (`unit` 1). False, changing nothing,
  /// if the memory for them cannot be had (or `unit` < 1).
  bool ExpandToSlots() noexcept;
};

/// A finished copy: its id and whether it succeeded.
struct CopyAck {
  uint64_t id = 0;
  bool ok = false;
};

/// How copies are made. The CPU engine copies with memcpy on the
/// controller's thread; a CUDA engine queues kernels on its copy streams.
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  /// Layers in both pools.
  virtual int64_t num_layers() const = 0;
  /// On the scheduler's thread, when `job` is queued: captures what the copy
  /// must wait for (on CUDA, an event on the current stream: the forward pass
  /// that writes the rows a backup reads, or still reads the pages a load
  /// writes). Nothing on the CPU.
  virtual void Fence(CopyJob* job) { (void)job; }
  /// On the controller's thread: copies layers [begin, end) of `job` and
  /// returns once they are in place (CPU), or queued behind the job's fence
  /// with an event recorded after them (CUDA). False if the copy failed.
  virtual bool CopyLayers(CopyJob* job, int64_t begin, int64_t end) = 0;
  /// On the controller's thread: waits until every copy of `job` is done
  /// (nothing on the CPU; an event sync on CUDA). False if one failed.
  virtual bool Finish(CopyJob* job) {
    (void)job;
    return true;
  }
  /// On the scheduler's thread, after `Ready` reported layer `layer` of the
  /// loads queued so far: nothing on the CPU; on CUDA, makes the current
  /// stream wait for that layer's copies.
  virtual void AfterLayer(int64_t layer) { (void)layer; }
  /// On the scheduler's thread, before it queues or waits: the stream its
  /// forward pass runs on (CUDA; fences are recorded on it and AfterLayer
  /// makes it wait). Nothing on the CPU.
  virtual void SetComputeStream(void* stream) { (void)stream; }
  /// Around a fork() (from the controller's, which holds its own lock
  /// first): takes whatever lock the engine's calls take, and releases it
  /// after, in the parent and in the child, so that the child never finds it
  /// held by a thread it does not have. Nothing on the CPU.
  virtual void BeforeFork() {}
  virtual void AfterFork() {}
};

/// One pair of buffers a copy moves, slot for slot: rows of `row_bytes`
/// between a device pool and its host pool. A pool's K/V is one plane; each
/// per-token side buffer registered beside it is another.
struct CopyPlane {
  PoolLayout device;
  PoolLayout host;
  int64_t row_bytes;  ///< the device's row
  /// Whether the host holds this plane as float8 pages (`codes`): backups
  /// encode, loads decode, whole pages at a time.
  bool encoded = false;
  Float8Pool codes{};
};

/// The CPU engine: memcpy of whole pages (TransferRows) of every plane
/// between the device pools and the host pools, on the controller's thread;
/// an encoded plane is encoded and decoded (EncodeTransfer, DecodeTransfer).
std::unique_ptr<CopyEngine> MakeCpuCopyEngine(std::vector<CopyPlane> planes, int64_t layers);
/// The same for one plane.
inline std::unique_ptr<CopyEngine> MakeCpuCopyEngine(const PoolLayout& device,
                                                     const PoolLayout& host, int64_t row_bytes,
                                                     int64_t layers) {
  return MakeCpuCopyEngine({CopyPlane{device, host, row_bytes}}, layers);
}
/// An engine for bookkeeping without pools: every copy succeeds at once.
std::unique_ptr<CopyEngine> MakeNullCopyEngine(int64_t layers);

/// Runs the copies of the host tier. Backups and loads queue up and run in
/// order on one controller thread (or, in manual mode, when the caller says
/// so); each finished copy leaves an acknowledgement the scheduler drains.
/// Loads are grouped: `StartLoading` turns the loads queued since the last
/// call into one batch, copied layer by layer, so `WaitLayer(i)` returns as
/// soon as layer i of every request in the batch is in place, while later
/// layers are still being copied. The controller never touches the radix
/// tree: the scheduler applies acknowledgements to it (RadixTree's
/// FinishBackup, FinishLoad).
///
/// Thread-safe: the queue functions may be called from any thread, the
/// controller's own thread runs the copies.
///
/// Across fork() (the fork list): the child's controller holds what was
/// queued and acknowledged at the fork; the copies under way then stay the
/// parent's, and fail in the child. It starts a thread of its own when it
/// next queues or waits.
class CacheController final : private ForkAware {
 public:
  /// `manual`: no thread; copies run only through `Complete` (a test decides
  /// when each finishes, and whether it fails) or `WaitLayer`/`Drain`.
  CacheController(std::unique_ptr<CopyEngine> engine, bool manual);
  ~CacheController();
  CacheController(const CacheController&) = delete;
  CacheController& operator=(const CacheController&) = delete;

  /// Queues a backup of the rows of device slots `device` to host slots
  /// `host` (every layer); with `unit` > 1 both name pages of `unit` slots
  /// (CopyJob). Returns its id. Throws std::invalid_argument for a unit < 1.
  uint64_t Backup(std::vector<int32_t> device, std::vector<int32_t> host, int32_t unit = 1);
  /// Queues a load of host slots `host` to device slots `device` (pages
  /// with `unit` > 1). It runs with the next batch (`StartLoading`), which
  /// merges loads of mixed units as slots (a load whose slots cannot be had
  /// then fails alone). Returns its id; std::invalid_argument for a unit < 1.
  uint64_t Load(std::vector<int32_t> host, std::vector<int32_t> device, int32_t unit = 1);
  /// Makes the loads queued so far one batch and hands it to the thread.
  void StartLoading();
  /// Blocks until layer `layer` of every load queued before the call is in
  /// place (starting the pending batch first); on CUDA also makes the
  /// current stream wait for it. In manual mode, runs the loads queued so
  /// far (they succeed). Throws std::out_of_range for a layer outside the
  /// pools.
  void WaitLayer(int64_t layer);
  /// Blocks until every load queued before the call is acknowledged
  /// (starting the pending batch first; manual mode: runs them, and they
  /// succeed). Backups are left alone.
  void WaitLoads();
  /// Blocks until every copy queued before the call has finished (manual
  /// mode: runs them, and they succeed).
  void Drain();

  /// The acknowledgements of finished backups (or loads) since the last
  /// call, in the order the copies finished.
  std::vector<CopyAck> TakeBackupAcks();
  std::vector<CopyAck> TakeLoadAcks();

  /// Manual mode: runs copy `id` now (when `ok`) or fails it, and leaves its
  /// acknowledgement. Returns false if no such copy is waiting (a load in a
  /// started batch runs with the batch: `WaitLayer`, `Drain`).
  bool Complete(uint64_t id, bool ok);
  /// Copies queued or running, not yet acknowledged.
  int64_t in_flight() const;
  /// The ids of the copies waiting (manual mode), oldest first.
  std::vector<uint64_t> Waiting() const;

  int64_t num_layers() const { return engine_->num_layers(); }

 private:
  struct Batch {
    uint64_t seq = 0;           // batches are numbered from 1
    std::vector<uint64_t> ids;  // its loads
    CopyJob merged;             // their slots, one after the other
  };
  void Run();
  void RunBackup(CopyJob* job, std::unique_lock<std::mutex>* lock);
  void RunBatch(Batch* batch, std::unique_lock<std::mutex>* lock);
  void StartLoadingLocked();
  bool BatchHasLayer(uint64_t seq, int64_t layer) const;
  void RunBatchesLocked(uint64_t upto, std::unique_lock<std::mutex>* lock);
  // A copy taken off the queues (under `mu_`), and the acknowledgements of
  // copies `ids[0, n)` (ascending). Neither allocates: see ReserveLocked.
  void Begin(uint64_t id, bool backup) noexcept;
  void End(const uint64_t* ids, size_t n, bool ok, bool backup) noexcept;
  // Before a copy is queued: room for it in `under_way_` and for its
  // acknowledgement, so that running and acknowledging it never allocates
  // (the copy thread could not report the failure, and an acknowledgement
  // must not be lost). Throws std::bad_alloc, changing nothing.
  void ReserveLocked(bool backup);
  int64_t InFlightLocked() const;
  // (not manual) Starts the thread where it has none: in a forked child.
  void StartThreadLocked();
  void BeforeFork() override;
  void AfterForkInParent() override;
  void AfterForkInChild() override;

  std::unique_ptr<CopyEngine> engine_;
  const bool manual_;
  mutable std::mutex mu_;
  std::condition_variable work_;                         // the thread waits for work
  std::condition_variable done_;                         // waiters wait for progress
  std::deque<std::unique_ptr<CopyJob>> backups_;         // queued, oldest first
  std::vector<std::unique_ptr<CopyJob>> pending_loads_;  // not in a batch yet
  std::deque<Batch> batches_;                            // started, oldest first
  uint64_t next_id_ = 1;
  uint64_t last_batch_ = 0;      // the last batch started
  uint64_t running_batch_ = 0;   // the batch being copied (0: none)
  int64_t running_layers_ = 0;   // its layers in place
  uint64_t finished_batch_ = 0;  // batches fully done: 1 .. finished_batch_
  struct UnderWay {
    uint64_t id;
    bool backup;
  };
  // The copies taken off the queues, not acknowledged yet (a forked child
  // fails them).
  std::vector<UnderWay> under_way_;
  std::vector<CopyAck> backup_acks_, load_acks_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace radixkv
