#include "radixkv/cache_controller.h"

#include <algorithm>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "radixkv/slot_set.h"
#include "radixkv/transfer.h"

namespace radixkv {
namespace {

// The CPU engine: memcpy of page runs (transfer.cc) on the controller's thread.
class CpuCopyEngine final : public CopyEngine {
 public:
  CpuCopyEngine(std::vector<CopyPlane> planes, int64_t layers)
      : planes_(std::move(planes)), layers_(layers) {}
  int64_t num_layers() const override { return layers_; }
  bool CopyLayers(CopyJob* job, int64_t begin, int64_t end) override {
    const bool backup = job->kind == CopyJob::Kind::kBackup;
    if (!job->ExpandToSlots()) return false;
    for (const CopyPlane& plane : planes_) {
      TransferParams p{backup ? plane.device : plane.host,
                       backup ? plane.host : plane.device,
                       plane.row_bytes,
                       layers_,
                       job->src.data(),
                       job->dst.data(),
                       static_cast<int64_t>(job->src.size()),
                       begin,
                       end};
      const int64_t bad = !plane.encoded ? TransferRows(p)
                          : backup       ? EncodeTransfer(p, plane.codes)
                                         : DecodeTransfer(p, plane.codes);
      if (bad >= 0) return false;
    }
    return true;
  }

 private:
  std::vector<CopyPlane> planes_;
  int64_t layers_;
};

// Bookkeeping only: no pools, every copy succeeds at once.
class NullCopyEngine final : public CopyEngine {
 public:
  explicit NullCopyEngine(int64_t layers) : layers_(layers) {}
  int64_t num_layers() const override { return layers_; }
  bool CopyLayers(CopyJob*, int64_t, int64_t) override { return true; }

 private:
  int64_t layers_;
};

void CheckUnit(int32_t unit) {
  if (unit < 1) throw std::invalid_argument("unit must be >= 1, got " + std::to_string(unit));
}

// At least `n` capacity, doubling: reserving one more each time would copy
// the whole vector each time.
template <typename T>
void Grow(std::vector<T>* v, size_t n) {
  if (v->capacity() < n) v->reserve(std::max(n, 2 * v->capacity()));
}

// The acknowledgements, leaving `acks` its room for those to come.
std::vector<CopyAck> Take(std::vector<CopyAck>* acks) {
  std::vector<CopyAck> out(acks->begin(), acks->end());
  acks->clear();
  return out;
}

}  // namespace

bool CopyJob::ExpandToSlots() noexcept {
  if (unit == 1) return true;
  if (unit < 1) return false;
  try {
    std::vector<int32_t> s(src.size() * unit), d(dst.size() * unit);
    ExpandPageIds(src.data(), static_cast<int64_t>(src.size()), unit, s.data());
    ExpandPageIds(dst.data(), static_cast<int64_t>(dst.size()), unit, d.data());
    src = std::move(s);
    dst = std::move(d);
  } catch (const std::exception&) {  // (bad_alloc, or length_error past the largest vector)
    return false;
  }
  unit = 1;
  return true;
}

std::unique_ptr<CopyEngine> MakeCpuCopyEngine(std::vector<CopyPlane> planes, int64_t layers) {
  return std::make_unique<CpuCopyEngine>(std::move(planes), layers);
}

std::unique_ptr<CopyEngine> MakeNullCopyEngine(int64_t layers) {
  return std::make_unique<NullCopyEngine>(layers);
}

CacheController::CacheController(std::unique_ptr<CopyEngine> engine, bool manual)
    : engine_(std::move(engine)), manual_(manual) {
  // Manual ones too: a copy another thread runs (Complete) is under way.
  AddToForkList(this);
  try {
    std::lock_guard<std::mutex> lock(mu_);  // (a fork's handlers may see it already)
    StartThreadLocked();
  } catch (...) {
    RemoveFromForkList(this);
    throw;
  }
}

CacheController::~CacheController() {
  RemoveFromForkList(this);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t CacheController::Backup(std::vector<int32_t> device, std::vector<int32_t> host,
                                 int32_t unit) {
  CheckUnit(unit);
  auto job = std::make_unique<CopyJob>();
  job->kind = CopyJob::Kind::kBackup;
  job->unit = unit;
  job->src = std::move(device);
  job->dst = std::move(host);
  engine_->Fence(job.get());
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    StartThreadLocked();
    ReserveLocked(true);
    id = job->id = next_id_++;
    backups_.push_back(std::move(job));
  }
  work_.notify_one();
  return id;
}

uint64_t CacheController::Load(std::vector<int32_t> host, std::vector<int32_t> device,
                               int32_t unit) {
  CheckUnit(unit);
  auto job = std::make_unique<CopyJob>();
  job->kind = CopyJob::Kind::kLoad;
  job->unit = unit;
  job->src = std::move(host);
  job->dst = std::move(device);
  std::lock_guard<std::mutex> lock(mu_);
  ReserveLocked(false);
  const uint64_t id = job->id = next_id_++;
  pending_loads_.push_back(std::move(job));
  return id;
}

void CacheController::StartLoadingLocked() {
  if (pending_loads_.empty()) return;
  // One job for the whole batch, fenced here on the scheduler's thread:
  // layer i of every load, then layer i + 1.
  Batch batch;
  batch.merged.kind = CopyJob::Kind::kLoad;
  // Loads of one unit stay in it; mixed ones (only callers of the
  // controller's own API mix them) are merged as slots, expanded here: a load
  // whose slots cannot be had fails alone, acknowledged at once.
  const int32_t unit = pending_loads_.front()->unit;
  const bool mixed = std::any_of(pending_loads_.begin(), pending_loads_.end(),
                                 [&](const auto& job) { return job->unit != unit; });
  if (mixed) {
    for (auto it = pending_loads_.begin(); it != pending_loads_.end();) {
      if ((*it)->ExpandToSlots()) {
        ++it;
        continue;
      }
      load_acks_.push_back(CopyAck{(*it)->id, false});
      it = pending_loads_.erase(it);
    }
    done_.notify_all();
    if (pending_loads_.empty()) return;
  }
  batch.merged.unit = mixed ? 1 : unit;
  for (const auto& job : pending_loads_) {
    batch.merged.src.insert(batch.merged.src.end(), job->src.begin(), job->src.end());
    batch.merged.dst.insert(batch.merged.dst.end(), job->dst.begin(), job->dst.end());
    batch.ids.push_back(job->id);
  }
  batch.seq = ++last_batch_;
  pending_loads_.clear();
  engine_->Fence(&batch.merged);
  batches_.push_back(std::move(batch));
}

void CacheController::StartLoading() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    StartThreadLocked();
    StartLoadingLocked();
  }
  work_.notify_one();
}

bool CacheController::BatchHasLayer(uint64_t seq, int64_t layer) const {
  return finished_batch_ >= seq || (running_batch_ == seq && running_layers_ > layer);
}

void CacheController::WaitLayer(int64_t layer) {
  if (layer < 0 || layer >= engine_->num_layers()) {
    throw std::out_of_range("layer " + std::to_string(layer) + " is outside [0, " +
                            std::to_string(engine_->num_layers()) + ")");
  }
  std::unique_lock<std::mutex> lock(mu_);
  StartThreadLocked();
  StartLoadingLocked();
  const uint64_t target = last_batch_;
  if (manual_) {
    RunBatchesLocked(target, &lock);
  } else {
    work_.notify_one();
    done_.wait(lock, [&] { return target == 0 || BatchHasLayer(target, layer); });
  }
  lock.unlock();
  if (target != 0) engine_->AfterLayer(layer);
}

void CacheController::RunBatchesLocked(uint64_t upto, std::unique_lock<std::mutex>* lock) {
  while (!batches_.empty() && batches_.front().seq <= upto) {
    Batch batch = std::move(batches_.front());
    batches_.pop_front();
    RunBatch(&batch, lock);
  }
}

void CacheController::WaitLoads() {
  std::unique_lock<std::mutex> lock(mu_);
  StartThreadLocked();
  StartLoadingLocked();
  const uint64_t target = last_batch_;
  if (manual_) {
    RunBatchesLocked(target, &lock);
    return;
  }
  work_.notify_one();
  done_.wait(lock, [&] { return finished_batch_ >= target; });
}

void CacheController::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  StartThreadLocked();
  StartLoadingLocked();
  if (manual_) {
    RunBatchesLocked(last_batch_, &lock);
    while (!backups_.empty()) {
      std::unique_ptr<CopyJob> job = std::move(backups_.front());
      backups_.pop_front();
      RunBackup(job.get(), &lock);
    }
    return;
  }
  const uint64_t batch = last_batch_;
  const uint64_t last_id = next_id_ - 1;
  work_.notify_one();
  done_.wait(lock, [&] {
    if (finished_batch_ < batch) return false;
    for (const auto& job : backups_) {
      if (job->id <= last_id) return false;
    }
    return under_way_.empty();
  });
}

void CacheController::RunBackup(CopyJob* job, std::unique_lock<std::mutex>* lock) {
  Begin(job->id, true);
  lock->unlock();
  bool ok = engine_->CopyLayers(job, 0, engine_->num_layers());
  ok = engine_->Finish(job) && ok;
  lock->lock();
  End(&job->id, 1, ok, true);
  done_.notify_all();
}

void CacheController::Begin(uint64_t id, bool backup) noexcept {
  under_way_.push_back(UnderWay{id, backup});  // (room reserved when it was queued)
}

void CacheController::End(const uint64_t* ids, size_t n, bool ok, bool backup) noexcept {
  // `ids` ascend (ids are given in order, and a batch keeps its loads').
  under_way_.erase(std::remove_if(under_way_.begin(), under_way_.end(),
                                  [&](const UnderWay& u) {
                                    return u.backup == backup &&
                                           std::binary_search(ids, ids + n, u.id);
                                  }),
                   under_way_.end());
  auto& acks = backup ? backup_acks_ : load_acks_;
  for (size_t i = 0; i < n; ++i) acks.push_back(CopyAck{ids[i], ok});
}

void CacheController::RunBatch(Batch* batch, std::unique_lock<std::mutex>* lock) {
  running_batch_ = batch->seq;
  running_layers_ = 0;
  for (uint64_t id : batch->ids) Begin(id, false);
  lock->unlock();
  bool ok = true;
  for (int64_t layer = 0; layer < engine_->num_layers(); ++layer) {
    ok = engine_->CopyLayers(&batch->merged, layer, layer + 1) && ok;
    lock->lock();
    running_layers_ = layer + 1;
    lock->unlock();
    done_.notify_all();
  }
  ok = engine_->Finish(&batch->merged) && ok;
  lock->lock();
  End(batch->ids.data(), batch->ids.size(), ok, false);
  finished_batch_ = batch->seq;
  running_batch_ = 0;
  done_.notify_all();
}

void CacheController::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_.wait(lock, [&] { return stop_ || !batches_.empty() || !backups_.empty(); });
    if (stop_) return;
    // Loads first: a forward pass waits for them, layer by layer.
    if (!batches_.empty()) {
      Batch batch = std::move(batches_.front());
      batches_.pop_front();
      RunBatch(&batch, &lock);
    } else {
      std::unique_ptr<CopyJob> job = std::move(backups_.front());
      backups_.pop_front();
      RunBackup(job.get(), &lock);
    }
  }
}

void CacheController::ReserveLocked(bool backup) {
  const size_t copies = static_cast<size_t>(InFlightLocked()) + 1;
  Grow(&under_way_, copies);
  std::vector<CopyAck>* acks = backup ? &backup_acks_ : &load_acks_;
  Grow(acks, acks->size() + copies);
}

std::vector<CopyAck> CacheController::TakeBackupAcks() {
  std::lock_guard<std::mutex> lock(mu_);
  return Take(&backup_acks_);
}

std::vector<CopyAck> CacheController::TakeLoadAcks() {
  std::lock_guard<std::mutex> lock(mu_);
  return Take(&load_acks_);
}

bool CacheController::Complete(uint64_t id, bool ok) {
  std::unique_lock<std::mutex> lock(mu_);
  std::unique_ptr<CopyJob> job;
  for (auto it = backups_.begin(); it != backups_.end() && !job; ++it) {
    if ((*it)->id == id) {
      job = std::move(*it);
      backups_.erase(it);
      break;
    }
  }
  for (auto it = pending_loads_.begin(); it != pending_loads_.end() && !job; ++it) {
    if ((*it)->id == id) {
      job = std::move(*it);
      pending_loads_.erase(it);
      break;
    }
  }
  if (!job) return false;  // unknown, or in a started batch (it runs with the batch)
  const bool backup = job->kind == CopyJob::Kind::kBackup;
  Begin(id, backup);
  lock.unlock();
  bool copied = true;
  if (ok) {
    engine_->Fence(job.get());
    copied = engine_->CopyLayers(job.get(), 0, engine_->num_layers());
    copied = engine_->Finish(job.get()) && copied;
  }
  lock.lock();
  End(&id, 1, ok && copied, backup);
  done_.notify_all();
  return true;
}

void CacheController::StartThreadLocked() {
  if (!manual_ && !thread_.joinable()) thread_ = std::thread([this] { Run(); });
}

void CacheController::BeforeFork() {  // (both held across the fork)
  mu_.lock();
  engine_->BeforeFork();
}

void CacheController::AfterForkInParent() {
  engine_->AfterFork();
  mu_.unlock();
}

void CacheController::AfterForkInChild() {
  // This thread is the child's only one: the copy thread, and whoever waited
  // on the condition variables, stayed in the parent. Their objects are made
  // anew over the old ones (whose destructors would join or wait for them).
  new (&thread_) std::thread();
  new (&work_) std::condition_variable();
  new (&done_) std::condition_variable();
  engine_->AfterFork();
  // The copies under way are half done here, and nothing will end them.
  // (Their acknowledgements have room: reserved when they were queued.)
  for (const UnderWay& u : under_way_) {
    (u.backup ? backup_acks_ : load_acks_).push_back(CopyAck{u.id, false});
  }
  under_way_.clear();
  if (running_batch_ != 0) {  // (batches finish in order)
    finished_batch_ = running_batch_;
    running_batch_ = 0;
  }
  mu_.unlock();
}

int64_t CacheController::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return InFlightLocked();
}

int64_t CacheController::InFlightLocked() const {
  int64_t n = static_cast<int64_t>(backups_.size() + pending_loads_.size() + under_way_.size());
  for (const Batch& b : batches_) n += static_cast<int64_t>(b.ids.size());
  return n;
}

std::vector<uint64_t> CacheController::Waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> ids;
  for (const auto& job : backups_) ids.push_back(job->id);
  for (const Batch& b : batches_) ids.insert(ids.end(), b.ids.begin(), b.ids.end());
  for (const auto& job : pending_loads_) ids.push_back(job->id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace radixkv
