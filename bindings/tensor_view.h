// The tensor boundary: Python integer sequences in, torch int32 tensors out.
//
// Inputs (torch tensors of any integer dtype on the CPU, objects exporting the
// buffer protocol such as NumPy arrays, lists and tuples of ints) are viewed
// without a copy when they already are contiguous int32, and converted into
// an owned buffer otherwise. Torch tensors are read through the DLPack C
// exchange API, so the extension never links libtorch.
#pragma once

#include <Python.h>
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace radixkv::bindings {

namespace py = pybind11;

/// A read-only 1-D int32 view of a Python input, valid while the input object
/// lives and nobody changes it: hold the GIL while reading it, or call `Own()`
/// first. A buffer export is released when the view dies.
class Int32View {
 public:
  /// Reads `obj`; `name` is the argument name used in error messages.
  /// Raises TypeError for a non-integer dtype, a non-CPU tensor or another
  /// type, ValueError for a rank other than 1 or a value outside int32.
  Int32View(py::handle obj, const char* name);
  Int32View(const Int32View&) = delete;
  Int32View& operator=(const Int32View&) = delete;

  const int32_t* data() const noexcept { return data_; }
  int64_t size() const noexcept { return size_; }
  /// Copies borrowed data into the view, so it can be read without the GIL
  /// whatever other threads do to the input.
  void Own();

 private:
  void FromDLTensor(const DLTensor& t, const char* name);
  void FromBuffer(py::handle obj, const char* name);
  void FromSequence(py::handle obj, const char* name);

  const int32_t* data_ = nullptr;
  int64_t size_ = 0;
  std::vector<int32_t> owned_;
  // Released by its destructor, which also runs when the constructor throws.
  struct Buffer {
    Py_buffer view{};
    bool held = false;
    ~Buffer() {
      if (held) PyBuffer_Release(&view);
    }
  } buffer_;
};

/// A new 1-D torch int32 CPU tensor holding `n` values copied from `src`.
py::object NewInt32Tensor(const int32_t* src, int64_t n);

/// Reads a Python int (or an object with `__index__`, bools excluded) as
/// int64; raises TypeError naming `name` otherwise.
int64_t ToInt64(py::handle obj, const char* name);

}  // namespace radixkv::bindings
