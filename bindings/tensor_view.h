// The tensor boundary: Python integer sequences in, torch int32 tensors out.
//
// Inputs (torch tensors of any integer dtype on the CPU, objects exporting the
// buffer protocol such as NumPy arrays, lists and tuples of ints) are viewed
// without a copy when they already are contiguous int32, and converted into
// an owned buffer otherwise. Torch tensors are read through the DLPack C
// exchange API, so the extension never links libtorch.
//
// Borrowed memory is only safe while no Python code runs: any Python code
// (a list item's __index__, say) may free or replace a tensor's storage. So a
// view is made in two steps. The constructor does everything that can run
// Python code: it converts lists and tuples, exports buffers (an export pins
// the memory until it is released), and asks torch whether a tensor has its
// lazy negation bit set. `Finish` then borrows tensor memory through DLPack,
// which runs no Python code. An adapter constructs every view of a call
// first, then finishes them all (`FinishViews`), and from then on runs no
// Python code until it has used them, or calls `Own` before it lets the GIL go.
#pragma once

#include <Python.h>
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace radixkv::bindings {

namespace py = pybind11;

/// A read-only 1-D int32 view of a Python input (see the file comment).
class Int32View {
 public:
  /// Step one; `name` is the argument name used in error messages. Raises
  /// TypeError for a non-integer dtype, a non-CPU tensor or another type,
  /// ValueError for a rank other than 1 or a value outside int32.
  Int32View(py::handle obj, const char* name);
  Int32View(const Int32View&) = delete;
  Int32View& operator=(const Int32View&) = delete;

  /// Step two: borrows (or, when it is not contiguous int32 or is a lazy
  /// negation, converts) a torch tensor's memory. Raises as the constructor.
  void Finish();

  const int32_t* data() const noexcept { return data_; }
  int64_t size() const noexcept { return size_; }
  /// Copies borrowed data into the view, so it can be read without the GIL
  /// whatever other threads do to the input.
  void Own();

 private:
  void FromDLTensor(const DLTensor& t);
  void FromBuffer(py::handle obj);
  void FromSequence(py::handle obj);

  const char* name_;
  PyObject* tensor_ = nullptr;  // a torch tensor to borrow in Finish (the call's argument)
  bool negated_ = false;        // the tensor's lazy negation bit
  bool finished_ = false;
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

/// Finishes every view of a call, after all of them are constructed.
template <typename... Views>
void FinishViews(Views&... views) {
  (views.Finish(), ...);
}

/// A new 1-D torch int32 CPU tensor of `n` elements; `*data` receives where
/// to write them. Needs the GIL.
py::object NewInt32Tensor(int64_t n, int32_t** data);

/// A new 1-D torch int32 CPU tensor holding `n` values copied from `src`.
py::object NewInt32Tensor(const int32_t* src, int64_t n);

/// A SlotSink (radixkv/slot_sink.h) that writes into a new torch int32
/// tensor. It may be called without the GIL (a call that let it go): it takes
/// the GIL back for the allocation, which is safe while holding a tree's
/// mutex, since no thread waits for that mutex holding the GIL.
class TensorSink {
 public:
  int32_t* operator()(int64_t n);
  /// The tensor (an empty one if the sink was never called). Needs the GIL.
  py::object take();

 private:
  py::object tensor_;
};

/// Reads a Python int (or an object with `__index__`, bools excluded) as
/// int64; raises TypeError naming `name` otherwise.
int64_t ToInt64(py::handle obj, const char* name);

/// Whether torch reports the tensor `o` as a lazy negation (`is_neg()`).
/// Runs torch's query, which runs Python code only for tensor subclasses and
/// torch function modes.
bool IsNegView(PyObject* o);

}  // namespace radixkv::bindings
