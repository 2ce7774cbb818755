// The private extension radixkv._cuda: the CUDA kernels, built only with CUDA
// and linked with the static CUDA runtime, so `import radixkv` never needs
// libcudart. Arguments are checked by kernels.cc, exactly as on the CPU.
#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "compare.cuh"
#include "controller.h"
#include "copy_engine.cuh"
#include "errors.h"
#include "kernels.h"
#include "radixkv/status.h"
#include "store.cuh"

namespace py = pybind11;
using radixkv::bindings::CheckCompareArgs;
using radixkv::bindings::CheckMlaTensors;
using radixkv::bindings::CheckStoreTensors;
using radixkv::bindings::CurrentStream;
using radixkv::bindings::EngineBox;
using radixkv::bindings::kEngineCapsule;
using radixkv::bindings::MarkWritten;
using radixkv::bindings::ReadPool;
using radixkv::bindings::ScaleArg;
using radixkv::bindings::SetStoreIndices;
using radixkv::bindings::SideArgs;
using radixkv::bindings::Tensor;
using radixkv::bindings::TensorList;

namespace {

void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e) + " (" +
                             cudaGetErrorString(e) + ")");
  }
}

// Makes `device` current for the launch and restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    CheckCuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ == device) {
      previous_ = -1;
    } else {
      CheckCuda(cudaSetDevice(device), "cudaSetDevice");
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Launches a checked store on the current stream of `cache`'s device.
void LaunchStoreOn(const Tensor& cache, const radixkv::StoreParams& p) {
  if (p.num_tokens == 0) return;
  DeviceGuard guard(cache.device().device_id);
  auto stream = static_cast<cudaStream_t>(CurrentStream(cache.device()));
  CheckCuda(radixkv::cuda::LaunchStore(p, stream), "store launch");
}

// Step one, then step two, for every tensor of a call (scales included).
void CheckAndView(const TensorList& tensors, std::initializer_list<ScaleArg*> scales) {
  for (Tensor* t : tensors) t->Check();
  for (ScaleArg* s : scales) {
    if (s->tensor()) s->tensor()->Check();
  }
  for (Tensor* t : tensors) t->View();
  for (ScaleArg* s : scales) {
    if (s->tensor()) s->tensor()->View();
  }
}

// The GIL is held throughout: the launch is asynchronous, and torch's stream
// order keeps the tensors' memory alive for the kernel.
void Kernel_StoreCache(py::handle k_cache, py::handle v_cache, py::handle out_loc, py::handle k,
                       py::handle v, py::handle k_scale, py::handle v_scale, py::handle side) {
  ScaleArg ks(k_scale, "k_scale", kDLCUDA), vs(v_scale, "v_scale", kDLCUDA);
  SideArgs sides(side, Tensor::kWritten);
  Tensor kc(k_cache, "k_cache", Tensor::kWritten), vc(v_cache, "v_cache", Tensor::kWritten);
  Tensor loc(out_loc, "out_loc");
  Tensor kt(k, "k"), vt(v, "v");
  TensorList tensors{&kc, &vc, &loc, &kt, &vt};
  sides.AppendTo(&tensors);
  CheckAndView(tensors, {&ks, &vs});
  radixkv::StoreParams p = CheckStoreTensors(kc, vc, kt, vt, ks, vs, kDLCUDA);
  sides.AddTo(&p, {&kc, &vc}, {&kt, &vt});
  SetStoreIndices(&p, loc, kc);
  if (p.num_tokens == 0) return;
  LaunchStoreOn(kc, p);
  MarkWritten(k_cache, v_cache);
  sides.MarkWritten();
}

void Kernel_StoreMla(py::handle kv_cache, py::handle out_loc, py::handle k_nope, py::handle k_rope,
                     int64_t kv_lora_rank, py::handle k_scale, py::handle side) {
  ScaleArg ks(k_scale, "k_scale", kDLCUDA);
  SideArgs sides(side, Tensor::kWritten);
  Tensor kv(kv_cache, "kv_cache", Tensor::kWritten);
  Tensor loc(out_loc, "out_loc");
  Tensor nope(k_nope, "k_nope"), rope(k_rope, "k_rope");
  TensorList tensors{&kv, &loc, &nope, &rope};
  sides.AppendTo(&tensors);
  CheckAndView(tensors, {&ks});
  radixkv::StoreParams p = CheckMlaTensors(kv, nope, rope, kv_lora_rank, ks, kDLCUDA);
  sides.AddTo(&p, {&kv}, {&nope, &rope});
  SetStoreIndices(&p, loc, kv, "k_nope");
  if (p.num_tokens == 0) return;
  LaunchStoreOn(kv, p);
  MarkWritten(kv_cache);
  sides.MarkWritten();
}

void Kernel_FirstMismatchBatched(py::handle query, py::handle keys, py::handle key_lens,
                                 py::handle out) {
  Tensor q(query, "query"), ks(keys, "keys"), o(out, "out", Tensor::kWritten);
  std::optional<Tensor> lens;
  if (!key_lens.is_none()) lens.emplace(key_lens, "key_lens");
  for (Tensor* t : {&q, &ks, &o}) t->Check();
  if (lens) lens->Check();
  for (Tensor* t : {&q, &ks, &o}) t->View();
  if (lens) lens->View();
  const radixkv::CompareBatch c = CheckCompareArgs(q, ks, lens ? &*lens : nullptr, o, kDLCUDA);
  if (c.num_keys == 0) return;
  DeviceGuard guard(q.device().device_id);
  auto stream = static_cast<cudaStream_t>(CurrentStream(q.device()));
  CheckCuda(radixkv::cuda::LaunchFirstMismatchBatched(c, stream), "first_mismatch_batched launch");
  MarkWritten(out);
}

// The host tier's copy engine on CUDA, for radixkv._core.CacheController(engine).
py::capsule CopyEngine(py::handle device, const std::vector<int64_t>& device_layout,
                       py::handle host, const std::vector<int64_t>& host_layout, int64_t row_bytes,
                       int64_t layers, int max_blocks, py::handle side_planes, py::handle codec) {
  auto box = std::make_unique<EngineBox>();
  box->device = ReadPool(device, device_layout, "device", row_bytes, layers, true);
  std::vector<radixkv::bindings::Pool> scales;  // (after the side planes' pairs, below)
  const radixkv::CopyPlane kv = radixkv::bindings::ReadKvPlane(
      box->device, host, host_layout, row_bytes, layers, codec, &box->host, &scales);
  cudaPointerAttributes attr{};
  const bool host_pinned = cudaPointerGetAttributes(&attr, box->host.layout.base) == cudaSuccess &&
                           attr.type == cudaMemoryTypeHost;
  if (!host_pinned) cudaGetLastError();  // clear the error an unregistered pointer leaves
  CHECK_VALUE(host_pinned, "host must be in pinned memory (HostKVCache(pin_memory=True))");
  std::vector<radixkv::CopyPlane> planes{kv};
  for (radixkv::CopyPlane& p : radixkv::bindings::ReadSidePlanes(
           side_planes, layers, true, box->device, box->host, &box->sides)) {
    planes.push_back(p);
  }
  for (size_t i = 1; i < box->sides.size(); i += 2) {
    const bool pinned = cudaPointerGetAttributes(&attr, box->sides[i].layout.base) == cudaSuccess &&
                        attr.type == cudaMemoryTypeHost;
    if (!pinned) cudaGetLastError();
    CHECK_VALUE(pinned, "side buffers' host copies must be in pinned memory");
  }
  for (auto& pool : scales) {
    const bool pinned = cudaPointerGetAttributes(&attr, pool.layout.base) == cudaSuccess &&
                        attr.type == cudaMemoryTypeHost;
    if (!pinned) cudaGetLastError();
    CHECK_VALUE(pinned, "codec scales must be in pinned memory (the host pool's own)");
    box->sides.push_back(std::move(pool));
  }
  const int dev = box->device.device.device_id;
  DeviceGuard guard(dev);
  box->engine = radixkv::cuda::MakeCudaCopyEngine(std::move(planes), layers, dev, max_blocks);
  return py::capsule(box.release(), kEngineCapsule, [](PyObject* o) {
    delete static_cast<EngineBox*>(PyCapsule_GetPointer(o, kEngineCapsule));
  });
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "radixkv CUDA kernels (private; use radixkv.kernel)";
  // This module throws radixkv::Error from its own copy of the checks.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const radixkv::Error& e) {
      PyErr_SetString(
          e.code() == radixkv::ErrorCode::kWrongType ? PyExc_TypeError : PyExc_ValueError,
          e.what());
    }
  });
  m.def("copy_engine", &CopyEngine, py::arg("device"), py::arg("device_layout"), py::arg("host"),
        py::arg("host_layout"), py::arg("row_bytes"), py::arg("layers"), py::arg("max_blocks") = 16,
        py::arg("side_planes") = py::none(), py::arg("codec") = py::none());
  m.def("store_cache", &Kernel_StoreCache, py::arg("k_cache"), py::arg("v_cache"),
        py::arg("out_loc"), py::arg("k"), py::arg("v"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::arg("side") = py::none());
  m.def("store_mla", &Kernel_StoreMla, py::arg("kv_cache"), py::arg("out_loc"), py::arg("k_nope"),
        py::arg("k_rope"), py::arg("kv_lora_rank"), py::arg("k_scale") = py::none(),
        py::arg("side") = py::none());
  m.def("first_mismatch_batched", &Kernel_FirstMismatchBatched, py::arg("query"), py::arg("keys"),
        py::arg("key_lens"), py::arg("out"));
}
