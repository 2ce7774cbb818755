#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "copy_engine.cuh"
#include "radixkv/transfer.h"
#include "transfer.cuh"

namespace radixkv::cuda {
namespace {

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e) + " (" +
                             cudaGetErrorString(e) + ")");
  }
}

// Makes `device` current on this thread for the scope.
class OnDevice {
 public:
  explicit OnDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess || previous_ == device) {
      previous_ = -1;
    } else {
      Check(cudaSetDevice(device), "cudaSetDevice");
    }
  }
  ~OnDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  int previous_ = -1;
};

// What one copy needs on the device, from Fence to Finish.
struct JobState {
  cudaEvent_t fence = nullptr;  // recorded on the compute stream when queued
  cudaEvent_t done = nullptr;   // recorded on the copy stream after the copy
  cudaStream_t stream = nullptr;
  int32_t* slots = nullptr;  // src slots, then dst slots, on the device
  bool staged = false;
  bool failed = false;
  int device = 0;

  // Marks the job failed; returns false, what CopyLayers returns then.
  bool Fail() {
    failed = true;
    return false;
  }

  ~JobState() {
    OnDevice on(device);
    if (slots != nullptr) {
      cudaStreamSynchronize(stream);
      cudaFree(slots);
    }
    if (fence != nullptr) cudaEventDestroy(fence);
    if (done != nullptr) cudaEventDestroy(done);
  }
};

class CudaCopyEngine final : public CopyEngine {
 public:
  CudaCopyEngine(std::vector<CopyPlane> planes, int64_t layers, int device, int max_blocks)
      : planes_(std::move(planes)), layers_(layers), device_(device), max_blocks_(max_blocks) {
    OnDevice on(device_);
    // The kernels read a pool's plane table on the device: a copy of each,
    // owned here (the host's is the caller's).
    for (CopyPlane& plane : planes_) {
      for (PoolLayout* l : {&plane.device, &plane.host}) {
        if (l->planes != nullptr) l->planes = DeviceTable(*l);
      }
    }
    Check(cudaStreamCreateWithFlags(&backup_stream_, cudaStreamNonBlocking), "backup stream");
    Check(cudaStreamCreateWithFlags(&load_stream_, cudaStreamNonBlocking), "load stream");
    layer_events_.resize(static_cast<size_t>(layers_));
    for (cudaEvent_t& e : layer_events_) {
      Check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "layer event");
    }
  }

  ~CudaCopyEngine() override {
    OnDevice on(device_);
    cudaStreamSynchronize(backup_stream_);
    cudaStreamSynchronize(load_stream_);
    for (cudaEvent_t e : layer_events_) cudaEventDestroy(e);
    cudaStreamDestroy(backup_stream_);
    cudaStreamDestroy(load_stream_);
    for (char** table : tables_) cudaFree(table);
  }

  int64_t num_layers() const override { return layers_; }

  void SetComputeStream(void* stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    compute_ = static_cast<cudaStream_t>(stream);
  }

  void Fence(CopyJob* job) override {
    OnDevice on(device_);
    auto state = std::make_shared<JobState>();
    state->device = device_;
    Check(cudaEventCreateWithFlags(&state->fence, cudaEventDisableTiming), "fence event");
    std::lock_guard<std::mutex> lock(mu_);
    Check(cudaEventRecord(state->fence, compute_), "fence record");
    job->fence = std::move(state);
  }

  bool CopyLayers(CopyJob* job, int64_t begin, int64_t end) override {
    auto* state = static_cast<JobState*>(job->fence.get());
    if (state == nullptr || state->failed) return false;
    OnDevice on(device_);
    const bool backup = job->kind == CopyJob::Kind::kBackup;
    if (!job->ExpandToSlots()) return state->Fail();
    const int64_t n = static_cast<int64_t>(job->src.size());
    if (!state->staged) {
      state->stream = backup ? backup_stream_ : load_stream_;
      const size_t bytes = static_cast<size_t>(n) * sizeof(int32_t);
      cudaError_t e = cudaStreamWaitEvent(state->stream, state->fence, 0);
      if (e == cudaSuccess && n > 0) {
        e = cudaMallocAsync(reinterpret_cast<void**>(&state->slots), 2 * bytes, state->stream);
      }
      if (e == cudaSuccess && n > 0) {
        e = cudaMemcpyAsync(state->slots, job->src.data(), bytes, cudaMemcpyHostToDevice,
                            state->stream);
      }
      if (e == cudaSuccess && n > 0) {
        e = cudaMemcpyAsync(state->slots + n, job->dst.data(), bytes, cudaMemcpyHostToDevice,
                            state->stream);
      }
      state->staged = true;
      if (e != cudaSuccess) return state->Fail();
    }
    for (const CopyPlane& plane : planes_) {
      TransferParams p{backup ? plane.device : plane.host,
                       backup ? plane.host : plane.device,
                       plane.row_bytes,
                       layers_,
                       job->src.data(),
                       job->dst.data(),
                       n,
                       begin,
                       end};
      // An encoded plane moves whole pages only: checked on the host's
      // copy of the slots, as the CPU engine checks them.
      if (plane.encoded && FindNotWholePages(p) >= 0) return state->Fail();
      p.src_slots = state->slots;
      p.dst_slots = state->slots + n;
      const cudaError_t e =
          plane.encoded ? LaunchCodecTransfer(p, plane.codes, backup, state->stream, max_blocks_)
                        : LaunchTransfer(p, state->stream, max_blocks_);
      if (e != cudaSuccess) return state->Fail();
    }
    if (!backup) {
      std::lock_guard<std::mutex> lock(mu_);
      for (int64_t layer = begin; layer < end; ++layer) {
        if (cudaEventRecord(layer_events_[layer], state->stream) != cudaSuccess) {
          return state->Fail();
        }
      }
    }
    return true;
  }

  bool Finish(CopyJob* job) override {
    auto* state = static_cast<JobState*>(job->fence.get());
    if (state == nullptr) return false;
    if (!state->staged) return !state->failed;
    OnDevice on(device_);
    cudaError_t e = cudaEventCreateWithFlags(&state->done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(state->done, state->stream);
    if (e == cudaSuccess) e = cudaEventSynchronize(state->done);
    if (state->slots != nullptr) {
      cudaFreeAsync(state->slots, state->stream);
      state->slots = nullptr;
    }
    return e == cudaSuccess && !state->failed;
  }

  void AfterLayer(int64_t layer) override {
    OnDevice on(device_);
    std::lock_guard<std::mutex> lock(mu_);
    cudaStreamWaitEvent(compute_, layer_events_[layer], 0);
  }

  void BeforeFork() override { mu_.lock(); }
  void AfterFork() override { mu_.unlock(); }

 private:
  // A device copy of `l`'s plane table, freed with the engine.
  char* const* DeviceTable(const PoolLayout& l) {
    const size_t bytes = static_cast<size_t>(l.sides * l.plane_layers) * sizeof(char*);
    char** table = nullptr;
    Check(cudaMalloc(reinterpret_cast<void**>(&table), bytes), "plane table");
    tables_.push_back(table);
    Check(cudaMemcpy(table, l.planes, bytes, cudaMemcpyHostToDevice), "plane table copy");
    return table;
  }

  std::vector<CopyPlane> planes_;
  const int64_t layers_;
  const int device_, max_blocks_;
  cudaStream_t backup_stream_ = nullptr, load_stream_ = nullptr;
  std::mutex mu_;                          // compute_ and the layer events
  cudaStream_t compute_ = nullptr;         // the forward pass's stream (0: legacy default)
  std::vector<cudaEvent_t> layer_events_;  // the latest load of each layer
  std::vector<char**> tables_;             // device copies of plane tables
};

}  // namespace

std::unique_ptr<CopyEngine> MakeCudaCopyEngine(std::vector<CopyPlane> planes, int64_t layers,
                                               int device, int max_blocks) {
  if (planes.empty() || layers < 1 || max_blocks < 1) {
    throw std::invalid_argument("planes must not be empty; layers and max_blocks must be >= 1");
  }
  for (const CopyPlane& plane : planes) {
    if (plane.row_bytes < 1) throw std::invalid_argument("row_bytes must be >= 1");
  }
  return std::make_unique<CudaCopyEngine>(std::move(planes), layers, device, max_blocks);
}

}  // namespace radixkv::cuda
