// The tensor boundary: Python integer sequences in, torch int32 tensors out.
//
// Inputs (torch tensors of any integer dtype on the CPU, objects exporting the
// buffer protocol such as NumPy arrays, lists and tuples of ints) are viewed
// without a copy when they already are contiguous int32, and converted into
// an owned buffer otherwise. Torch tensors are read through the DLPack C
// exchange API, so the extension never links libtorch.
//
// Borrowed memory is only safe while no Python code runs: any Python code
// (a list item's __index__, a tensor subclass's method) may free or replace a
// tensor's storage. So a view is made in three steps, each taken for every
// view of a call before the next. The constructor converts lists and tuples
// and exports buffers (an export pins the memory until it is released).
// `Query` asks torch about a tensor's lazy negation bit, which runs Python code
// for a tensor subclass. `Borrow` then takes the tensor's memory through
// DLPack, which runs none. An adapter constructs every view of a call first,
// then finishes them all (`FinishViews`, `FinishAll`: every Query, then every
// Borrow), and from then on runs no Python code until it has used them, or
// calls `Own` before it lets the GIL go. Results are built the same way: into
// an Int32Block (no Python code), made a tensor only once the core call is
// over.
#pragma once

#include <Python.h>
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
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

  /// Step two: asks torch whether a tensor is a lazy negation. Runs Python
  /// code for a tensor subclass (its `is_neg`), so a call queries every view
  /// before it borrows any. Raises what that code raises.
  void Query();
  /// Step three: borrows (or, when it is not contiguous int32 or is a lazy
  /// negation, converts) a tensor's memory through DLPack, running no Python
  /// code. Raises as the constructor.
  void Borrow();
  /// Both steps, for a call that reads this one view only.
  void Finish() {
    Query();
    Borrow();
  }

  const int32_t* data() const noexcept { return data_; }
  int64_t size() const noexcept { return size_; }
  /// Copies borrowed data into the view, so it can be read without the GIL
  /// whatever other threads do to the input (short of resizing its storage).
  void Own();

 private:
  void FromDLTensor(const DLTensor& t, bool negated);
  void FromBuffer(py::handle obj);
  void FromSequence(py::handle obj);

  const char* name_;
  PyObject* tensor_ = nullptr;  // a torch tensor to borrow (the call's argument)
  bool queried_ = false, negated_ = false, finished_ = false;
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

/// Finishes every view of a call, after all of them are constructed: every
/// Query, then every Borrow.
template <typename... Views>
void FinishViews(Views&... views) {
  (views.Query(), ...);
  (views.Borrow(), ...);
}

/// The same for a call's views held in a vector.
void FinishAll(const std::vector<std::unique_ptr<Int32View>>& views);

/// An int32 buffer allocated without running Python code (so it can be
/// filled while a tree's mutex is held, or from memory borrowed from an
/// argument), later given to torch as a 1-D int32 CPU tensor without a copy.
/// Freed by its destructor unless it became a tensor.
class Int32Block {
 public:
  Int32Block() = default;
  /// Room for `n` values. Throws std::bad_alloc.
  explicit Int32Block(int64_t n);
  Int32Block(Int32Block&& other) noexcept { *this = std::move(other); }
  Int32Block& operator=(Int32Block&& other) noexcept;
  ~Int32Block();
  int32_t* data() const noexcept { return data_; }
  /// Makes the tensor the first `n` values only (`n` at most the room the
  /// block was made with); the rest of the room goes with it.
  void Truncate(int64_t n) noexcept;
  /// The tensor; torch takes the block. Needs the GIL (Python code may run).
  py::object ToTensor();

 private:
  void* raw_ = nullptr;
  int32_t* data_ = nullptr;
};

/// A new 1-D torch int32 CPU tensor holding `n` values copied from `src`
/// (copied before any Python code runs). Needs the GIL.
py::object NewInt32Tensor(const int32_t* src, int64_t n);

/// A SlotSink (radixkv/slot_sink.h) that writes into an Int32Block: it runs
/// no Python code, so it may be called holding a tree's mutex, with or
/// without the GIL. `take()` makes the tensor afterwards.
class TensorSink {
 public:
  int32_t* operator()(int64_t n) {
    block_ = Int32Block(n);
    return block_.data();
  }
  /// The tensor (an empty one if the sink was never called). Call it after
  /// the core call returned and any mutex was released: it runs Python code.
  py::object take();

 private:
  Int32Block block_;
  bool called_ = false;
};

/// Reads a Python int (or an object with `__index__`, bools excluded) as
/// int64; raises TypeError naming `name` otherwise.
int64_t ToInt64(py::handle obj, const char* name);

/// Reads `obj` as 32 bytes (a seed or a key), or empty for None; raises
/// TypeError or ValueError naming `name` otherwise.
std::string Bytes32(py::handle obj, const std::string& name);
/// Those bytes as the core's key or seed pointer (check `empty()` first).
inline const uint8_t* U8(const std::string& s) {
  return reinterpret_cast<const uint8_t*>(s.data());
}

/// Whether torch reports the tensor `o` as a lazy negation (`is_neg()`).
/// Runs torch's query, which runs Python code only for tensor subclasses and
/// torch function modes.
bool IsNegView(PyObject* o);

}  // namespace radixkv::bindings
