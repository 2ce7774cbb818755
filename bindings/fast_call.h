// Vectorcall methods and plain C types for the calls a scheduler makes
// millions of times: the tree's match, insert, lock and evict, and its handle;
// and the CPU store kernels (a model stores K/V once per layer and step).
//
// pybind11's dispatcher costs about 150 ns a call, 300 ns more when an
// argument comes by keyword (`lock_handle(h, unlock=True)`), and its
// instances are registered in a global map on creation; the tree and its
// handles are therefore CPython types whose methods take METH_FASTCALL |
// METH_KEYWORDS arguments directly. Everything else stays on pybind11.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

#include <array>
#include <new>
#include <utility>

namespace radixkv::bindings {

namespace py = pybind11;

/// A fast method's parameters: its name (for messages), the parameter names,
/// how many there are and how many must be given.
/// Most parameters a fast function has.
constexpr int kMaxParams = 9;

struct Params {
  const char* function;
  std::array<const char*, kMaxParams> names;
  int count;
  int required;
};

/// Sorts a vectorcall's arguments (positional ones, then the keywords named
/// by `kwnames`) into `out[0, p.count)` in parameter order, null for an
/// absent optional one. Sets TypeError, as Python does for its own
/// functions, for too many, missing, unknown or repeated arguments, and
/// returns false.
bool BindArgs(const Params& p, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
              PyObject** out);

/// Sets the Python error for the C++ exception being handled: the same types
/// the pybind11 functions of the module raise (radixkv::Error by its code,
/// pybind11's errors as themselves, std::bad_alloc as MemoryError).
void SetErrorFromException() noexcept;

/// A CPython object that holds a `T` right after its header.
template <typename T>
struct Boxed {
  PyObject_HEAD T value;
};

/// The `T` inside a Boxed<T> object.
template <typename T>
T& Unbox(PyObject* o) {
  return reinterpret_cast<Boxed<T>*>(o)->value;
}

/// A vectorcall method of a `T` object: binds the arguments by `P` and calls
/// `Impl(T&, PyObject* const* args)`, which returns a new reference (a
/// py::object) or throws.
template <typename T, py::object (*Impl)(T&, PyObject* const*), const Params& P>
PyObject* FastMethod(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  PyObject* bound[kMaxParams] = {};
  if (!BindArgs(P, args, nargs, kwnames, bound)) return nullptr;
  try {
    return Impl(Unbox<T>(self), bound).release().ptr();
  } catch (...) {
    SetErrorFromException();
    return nullptr;
  }
}

/// tp_dealloc for Boxed<T> of a heap type: destroys the `T`, frees the
/// object and drops its reference to the type.
template <typename T>
void DeallocBoxed(PyObject* o) {
  PyTypeObject* type = Py_TYPE(o);
  Unbox<T>(o).~T();
  type->tp_free(o);
  Py_DECREF(type);
}

/// A new Boxed<T> of `type` holding `T(args...)`; throws on failure.
template <typename T, typename... Args>
py::object NewBoxed(PyTypeObject* type, Args&&... args) {
  PyObject* o = type->tp_alloc(type, 0);
  if (o == nullptr) throw py::error_already_set();
  py::object owner = py::reinterpret_steal<py::object>(o);
  // tp_dealloc destroys a T: construct it before anything can fail, and let
  // the object go without running the destructor if the constructor throws.
  try {
    new (&Unbox<T>(o)) T(std::forward<Args>(args)...);
  } catch (...) {
    type->tp_free(owner.release().ptr());
    Py_DECREF(type);  // the object's reference (tp_alloc took one)
    throw;
  }
  return owner;
}

/// Creates a heap type from `spec`, adds it to `m` under its short name and
/// returns it (a reference the module keeps).
PyTypeObject* AddType(py::module_& m, PyType_Spec* spec);

}  // namespace radixkv::bindings
