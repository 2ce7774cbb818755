#include "tensor_view.h"

#include <dlpack/dlpack.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <type_traits>

#include "errors.h"
#include "radixkv/page_hash.h"
#include "torch_api.h"

namespace radixkv::bindings {
namespace {

[[noreturn]] void Raise(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw py::error_already_set();
}

std::string TypeName(py::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

// Slot indices are int32, so no input can usefully be longer; refusing here
// also keeps a stride-0 view of 2**40 elements from being copied out.
void CheckLength(int64_t n, const char* name) {
  if (n > std::numeric_limits<int32_t>::max()) {
    Raise(PyExc_ValueError, std::string(name) + " has " + std::to_string(n) +
                                " elements, more than the 2**31 - 1 supported");
  }
}

void SetError(void*, const char* kind, const char* message) {
  PyErr_Format(PyExc_RuntimeError, "%s: %s", kind, message);
}

// The Python error being raised, as "Type: message" (its first line).
std::string CurrentError() {
  py::error_already_set e;
  std::string text = py::str(e.type().attr("__name__")).cast<std::string>() + ": " +
                     py::str(e.value()).cast<std::string>();
  e.restore();
  return text.substr(0, text.find('\n'));
}

// Raises `type` with `message`, chained to the Python error being raised.
[[noreturn]] void RaiseFrom(PyObject* type, const std::string& message) {
  py::raise_from(type, message.c_str());
  throw py::error_already_set();
}

template <typename T>
void Convert(const char* base, int64_t n, int64_t stride_bytes, bool negate, const char* name,
             std::vector<int32_t>* out) {
  out->resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    T raw;
    std::memcpy(&raw, base + i * stride_bytes, sizeof(T));
    if (negate) {
      // What torch's resolve_neg() gives: negation in the dtype, wrapping.
      using U = std::make_unsigned_t<T>;
      raw = static_cast<T>(static_cast<U>(U{0} - static_cast<U>(raw)));
    }
    bool fits = true;
    if constexpr (std::is_unsigned_v<T>) {
      fits = raw <= static_cast<T>(std::numeric_limits<int32_t>::max());
    } else {
      fits =
          raw >= std::numeric_limits<int32_t>::min() && raw <= std::numeric_limits<int32_t>::max();
    }
    if (!fits) {
      Raise(PyExc_ValueError, std::string(name) + "[" + std::to_string(i) +
                                  "] = " + std::to_string(raw) + " does not fit in int32");
    }
    (*out)[i] = static_cast<int32_t>(raw);
  }
}

// Converts `n` integers of `bits` width and signedness at `base` with the
// given byte stride, negating them when `negate`.
void ConvertInts(const char* base, int64_t n, int64_t stride_bytes, bool is_signed, int bits,
                 bool negate, const char* name, std::vector<int32_t>* out) {
  switch (bits * (is_signed ? 1 : -1)) {
    case 8:
      return Convert<int8_t>(base, n, stride_bytes, negate, name, out);
    case 16:
      return Convert<int16_t>(base, n, stride_bytes, negate, name, out);
    case 32:
      return Convert<int32_t>(base, n, stride_bytes, negate, name, out);
    case 64:
      return Convert<int64_t>(base, n, stride_bytes, negate, name, out);
    case -8:
      return Convert<uint8_t>(base, n, stride_bytes, negate, name, out);
    case -16:
      return Convert<uint16_t>(base, n, stride_bytes, negate, name, out);
    case -32:
      return Convert<uint32_t>(base, n, stride_bytes, negate, name, out);
    case -64:
      return Convert<uint64_t>(base, n, stride_bytes, negate, name, out);
  }
  Raise(PyExc_TypeError, std::string(name) + " has an unsupported integer width of " +
                             std::to_string(bits) + " bits");
}

}  // namespace

bool IsNegView(PyObject* o) {
  static PyObject* name = PyUnicode_InternFromString("is_neg");  // lives with the module
  PyObject* args[2] = {nullptr, o};  // args[0] is room the callee may use
  PyObject* result =
      PyObject_VectorcallMethod(name, args + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  if (result == nullptr) throw py::error_already_set();
  if (result == Py_False || result == Py_True) {
    Py_DECREF(result);
    return result == Py_True;
  }
  const int truth = PyObject_IsTrue(result);
  Py_DECREF(result);
  if (truth < 0) throw py::error_already_set();
  return truth != 0;
}

Int32View::Int32View(py::handle obj, const char* name) : name_(name) {
  PyObject* o = obj.ptr();
  if (IsTorchTensor(o)) {
    tensor_ = o;
    return;
  }
  finished_ = true;
  if (PyList_Check(o) || PyTuple_Check(o)) {
    FromSequence(obj);
  } else if (PyObject_CheckBuffer(o)) {
    FromBuffer(obj);
  } else {
    Raise(PyExc_TypeError, std::string(name) +
                               " must be a 1-D integer torch.Tensor, NumPy array or list, got " +
                               TypeName(obj));
  }
}

void Int32View::Query() {
  if (finished_ || queried_) return;
  negated_ = IsNegView(tensor_);
  queried_ = true;
}

void Int32View::Borrow() {
  if (finished_) return;
  if (!queried_) Query();  // (a caller with one view)
  finished_ = true;
  TorchTensorView t(tensor_, name_);
  FromDLTensor(t.get(), negated_);
}

void FinishAll(const std::vector<std::unique_ptr<Int32View>>& views) {
  for (const auto& v : views) v->Query();
  for (const auto& v : views) v->Borrow();
}

void Int32View::Own() {
  if (data_ == nullptr || data_ == owned_.data()) return;
  owned_.assign(data_, data_ + size_);
  data_ = owned_.data();
}

void Int32View::FromDLTensor(const DLTensor& t, bool negated) {
  const char* name = name_;
  if (t.device.device_type != kDLCPU) {
    Raise(PyExc_TypeError,
          std::string(name) + " must be a CPU tensor, got a tensor on " + DeviceName(t.device));
  }
  if (t.ndim != 1) {
    Raise(PyExc_ValueError,
          std::string(name) + " must be 1-D, got " + std::to_string(t.ndim) + " dimensions");
  }
  const bool is_int = t.dtype.code == kDLInt || t.dtype.code == kDLUInt;
  if (!is_int || t.dtype.lanes != 1) {
    Raise(PyExc_TypeError,
          std::string(name) + " must have an integer dtype, got " + DTypeName(t.dtype));
  }
  size_ = t.shape[0];
  CheckLength(size_, name);
  if (size_ > 0 && t.data == nullptr) {
    Raise(PyExc_TypeError, std::string(name) +
                               " has no data (a fake tensor, or one whose "
                               "storage was freed)");
  }
  const int64_t stride = (t.strides == nullptr || size_ <= 1) ? 1 : t.strides[0];
  const char* base = static_cast<const char*>(t.data) + t.byte_offset;
  if (t.dtype.code == kDLInt && t.dtype.bits == 32 && stride == 1 && !negated) {
    data_ = reinterpret_cast<const int32_t*>(base);
    return;
  }
  ConvertInts(base, size_, stride * (t.dtype.bits / 8), t.dtype.code == kDLInt, t.dtype.bits,
              negated, name, &owned_);
  data_ = owned_.data();
}

void Int32View::FromBuffer(py::handle obj) {
  const char* name = name_;
  if (PyObject_GetBuffer(obj.ptr(), &buffer_.view, PyBUF_STRIDES | PyBUF_FORMAT) != 0) {
    // NumPy refuses to export some dtypes (datetime64, say): name the argument.
    RaiseFrom(PyExc_TypeError, std::string(name) +
                                   " must have an integer dtype: its buffer "
                                   "could not be read (" +
                                   CurrentError() + ")");
  }
  buffer_.held = true;
  const Py_buffer& view = buffer_.view;
  if (view.ndim != 1) {
    Raise(PyExc_ValueError,
          std::string(name) + " must be 1-D, got " + std::to_string(view.ndim) + " dimensions");
  }
  std::string format = view.format ? view.format : "B";
  if (!format.empty() && (format[0] == '>' || format[0] == '!')) {
    Raise(PyExc_TypeError, std::string(name) + " must be in native byte order");
  }
  if (!format.empty() && (format[0] == '@' || format[0] == '=' || format[0] == '<')) {
    format = format.substr(1);
  }
  const std::string kInts = "bBhHiIlLqQnN";
  if (format.size() != 1 || kInts.find(format[0]) == std::string::npos) {
    Raise(PyExc_TypeError,
          std::string(name) + " must have an integer dtype, got buffer format '" + format + "'");
  }
  const bool is_signed = std::islower(static_cast<unsigned char>(format[0])) != 0;
  const int bits = static_cast<int>(view.itemsize) * 8;
  size_ = view.shape[0];
  CheckLength(size_, name);
  const int64_t stride = view.strides ? view.strides[0] : view.itemsize;
  const char* base = static_cast<const char*>(view.buf);
  if (is_signed && bits == 32 && (stride == 4 || size_ <= 1)) {
    data_ = reinterpret_cast<const int32_t*>(base);
    return;
  }
  ConvertInts(base, size_, stride, is_signed, bits, /*negate=*/false, name, &owned_);
  data_ = owned_.data();
}

void Int32View::FromSequence(py::handle obj) {
  const char* name = name_;
  // A list is read from a tuple snapshot: an item's __index__ may change it.
  py::object snapshot = PyList_Check(obj.ptr())
                            ? py::reinterpret_steal<py::object>(PyList_AsTuple(obj.ptr()))
                            : py::reinterpret_borrow<py::object>(obj);
  if (!snapshot) throw py::error_already_set();
  PyObject* o = snapshot.ptr();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
  CheckLength(n, name);
  PyObject** items = PySequence_Fast_ITEMS(o);
  owned_.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    const std::string where = std::string(name) + "[" + std::to_string(i) + "]";
    if (PyBool_Check(item) || !(PyLong_Check(item) || PyIndex_Check(item))) {
      Raise(PyExc_TypeError, where + " must be an int, got " + Py_TYPE(item)->tp_name);
    }
    int overflow = 0;
    long long v;
    if (PyLong_Check(item)) {
      v = PyLong_AsLongLongAndOverflow(item, &overflow);
    } else {
      py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(item));
      if (!index) {
        RaiseFrom(PyExc_TypeError,
                  where + " could not be read as an int: its __index__ raised " + CurrentError());
      }
      v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    }
    if (overflow != 0 || v > std::numeric_limits<int32_t>::max() ||
        v < std::numeric_limits<int32_t>::min()) {
      Raise(PyExc_ValueError, where + " does not fit in int32");
    }
    owned_[i] = static_cast<int32_t>(v);
  }
  size_ = n;
  data_ = owned_.data();
}

namespace {

// One allocation holds a result tensor's DLPack header and its data, which
// torch adopts (one TensorImpl, no copy) and frees through the deleter.
struct Int32Header {
  DLManagedTensorVersioned managed;
  int64_t shape[1];
};
constexpr size_t kDataOffset = (sizeof(Int32Header) + 63) / 64 * 64;

void FreeBlock(DLManagedTensorVersioned* self) { std::free(self->manager_ctx); }

}  // namespace

Int32Block::Int32Block(int64_t n) {
  const size_t bytes = kDataOffset + static_cast<size_t>(n) * sizeof(int32_t);
  raw_ = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (raw_ == nullptr) throw std::bad_alloc();
  auto* block = new (raw_) Int32Header{};
  block->shape[0] = n;
  DLManagedTensorVersioned& mt = block->managed;
  mt.version = DLPackVersion{DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
  mt.manager_ctx = raw_;
  mt.deleter = FreeBlock;
  mt.flags = 0;
  DLTensor& t = mt.dl_tensor;
  t.data = static_cast<char*>(raw_) + kDataOffset;
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = DLDataType{kDLInt, 32, 1};
  t.shape = block->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  data_ = static_cast<int32_t*>(t.data);
}

Int32Block& Int32Block::operator=(Int32Block&& other) noexcept {
  std::free(raw_);
  raw_ = other.raw_;
  data_ = other.data_;
  other.raw_ = nullptr;
  other.data_ = nullptr;
  return *this;
}

Int32Block::~Int32Block() { std::free(raw_); }

void Int32Block::Truncate(int64_t n) noexcept {
  if (raw_ != nullptr) static_cast<Int32Header*>(raw_)->shape[0] = n;
}

py::object Int32Block::ToTensor() {
  if (raw_ == nullptr) *this = Int32Block(0);
  void* out = nullptr;
  auto* mt = &static_cast<Int32Header*>(raw_)->managed;
  if (TorchApi().managed_tensor_to_py_object_no_sync(mt, &out) != 0) {
    throw py::error_already_set();  // the block is still ours: the destructor frees it
  }
  raw_ = nullptr;  // torch's now: it frees it through the deleter
  data_ = nullptr;
  return py::reinterpret_steal<py::object>(static_cast<PyObject*>(out));
}

py::object NewInt32Tensor(const int32_t* src, int64_t n) {
  Int32Block block(n);
  if (n > 0) std::memcpy(block.data(), src, static_cast<size_t>(n) * sizeof(int32_t));
  return block.ToTensor();
}

py::object TensorSink::take() { return block_.ToTensor(); }

std::string Bytes32(py::handle obj, const std::string& name) {
  if (obj.is_none()) return {};
  CHECK_TYPE(PyBytes_Check(obj.ptr()), name, " must be bytes or None");
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(obj.ptr(), &data, &size) != 0) throw py::error_already_set();
  CHECK_VALUE(size == radixkv::kPageKeyBytes, name, " must be 32 bytes, got ", size);
  return std::string(data, static_cast<size_t>(size));
}

int64_t ToInt64(py::handle obj, const char* name) {
  PyObject* o = obj.ptr();
  if (PyBool_Check(o) || !(PyLong_Check(o) || PyIndex_Check(o))) {
    Raise(PyExc_TypeError, std::string(name) + " must be an int, got " + TypeName(obj));
  }
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(o));
  if (!index) {
    PyErr_Clear();  // e.g. a tensor of several elements: say which argument
    Raise(PyExc_TypeError, std::string(name) + " must be an int, got " + TypeName(obj));
  }
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0) Raise(PyExc_ValueError, std::string(name) + " is out of the int64 range");
  return v;
}

}  // namespace radixkv::bindings
