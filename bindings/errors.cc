#include "errors.h"

#include "radixkv/status.h"

namespace radixkv::bindings {
namespace {

// Owned for the life of the process, like the module that exports them.
PyObject* g_out_of_capacity = nullptr;
PyObject* g_integrity = nullptr;

PyObject* NewError(pybind11::module_& m, const char* name, const char* doc) {
  std::string qualified = std::string(PyModule_GetName(m.ptr())) + "." + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, PyExc_RuntimeError, nullptr);
  if (type == nullptr) throw pybind11::error_already_set();
  Py_INCREF(type);
  m.add_object(name, pybind11::handle(type));
  return type;
}

}  // namespace

void SetError(const Error& e) {
  PyObject* type = PyExc_RuntimeError;
  switch (e.code()) {
    case ErrorCode::kInvalidArgument:
      type = PyExc_ValueError;
      break;
    case ErrorCode::kWrongType:
      type = PyExc_TypeError;
      break;
    case ErrorCode::kOutOfCapacity:
      type = g_out_of_capacity;
      break;
    case ErrorCode::kIntegrity:
      type = g_integrity;
      break;
  }
  PyErr_SetString(type, e.what());
}

void RegisterErrors(pybind11::module_& m) {
  g_out_of_capacity =
      NewError(m, "OutOfCapacityError", "Asked to evict or allocate more than the cache can free.");
  g_integrity = NewError(m, "IntegrityError", "check_integrity() found a broken invariant.");
  pybind11::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      SetError(e);
    }
  });
}

}  // namespace radixkv::bindings
