// torch tensors through DLPack: the one place the bindings reach torch.
//
// torch.Tensor carries `__dlpack_c_exchange_api__`, a table of C functions
// that view a tensor as a DLTensor, allocate new tensors and report the
// current stream, at about 100 ns a call and without linking libtorch.
#pragma once

#include <Python.h>
#include <dlpack/dlpack.h>

#include <string>

namespace radixkv::bindings {

/// torch's exchange API, read from torch.Tensor on first use (importing torch
/// then). Raises ImportError if its DLPack major version differs from ours.
/// Needs the GIL.
const DLPackExchangeAPI& TorchApi();

/// Whether `o` is a torch.Tensor (or a subclass). Needs the GIL.
bool IsTorchTensor(PyObject* o);

/// A DLTensor view of a torch tensor for the length of one call: the caller
/// keeps the tensor object, and so its memory, alive. No copy, no sync.
class TorchTensorView {
 public:
  /// Raises TypeError naming `name` when torch cannot export `o` (a meta or
  /// sparse tensor, say).
  TorchTensorView(PyObject* o, const char* name);
  ~TorchTensorView();
  TorchTensorView(const TorchTensorView&) = delete;
  TorchTensorView& operator=(const TorchTensorView&) = delete;

  const DLTensor& get() const noexcept { return tensor_; }

 private:
  DLTensor tensor_{};
  DLManagedTensorVersioned* owner_ = nullptr;
};

/// "int32", "bfloat16", "float8_e4m3fn", ...: a dtype as a message names it.
std::string DTypeName(const DLDataType& dtype);

/// "cpu", "cuda:1", ...: a device as a message names it.
std::string DeviceName(const DLDevice& device);

}  // namespace radixkv::bindings
