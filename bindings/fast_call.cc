#include "fast_call.h"

#include <cstring>
#include <string>

#include "errors.h"
#include "radixkv/status.h"

namespace radixkv::bindings {
namespace {

bool NameIs(PyObject* keyword, const char* name) {
  const char* text = PyUnicode_AsUTF8(keyword);
  return text != nullptr && std::strcmp(text, name) == 0;
}

bool Fail(const Params& p, const std::string& message) {
  PyErr_SetString(PyExc_TypeError, (std::string(p.function) + "() " + message).c_str());
  return false;
}

}  // namespace

bool BindArgs(const Params& p, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
              PyObject** out) {
  if (nargs > p.count && p.count == 0) return Fail(p, "takes no arguments");
  if (nargs > p.count) {
    return Fail(p, "takes at most " + std::to_string(p.count) +
                       (p.count == 1 ? " argument (" : " arguments (") + std::to_string(nargs) +
                       " given)");
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) out[i] = args[i];
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    int slot = -1;
    for (int i = 0; i < p.count && slot < 0; ++i) {
      if (NameIs(key, p.names[i])) slot = i;
    }
    if (slot < 0) {
      py::object repr = py::reinterpret_steal<py::object>(PyObject_Repr(key));
      const char* text = repr ? PyUnicode_AsUTF8(repr.ptr()) : nullptr;
      PyErr_Clear();
      return Fail(p, std::string("got an unexpected keyword argument ") +
                         (text != nullptr ? text : "(unprintable)"));
    }
    if (out[slot] != nullptr) {
      return Fail(p, std::string("got multiple values for argument '") + p.names[slot] + "'");
    }
    out[slot] = args[nargs + k];
  }
  for (int i = 0; i < p.required; ++i) {
    if (out[i] == nullptr) {
      return Fail(p, std::string("missing required argument '") + p.names[i] + "'");
    }
  }
  return true;
}

void SetErrorFromException() noexcept {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const Error& e) {
    SetError(e);
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception");
  }
}

PyTypeObject* AddType(py::module_& m, PyType_Spec* spec) {
  py::object type =
      py::reinterpret_steal<py::object>(PyType_FromModuleAndSpec(m.ptr(), spec, nullptr));
  if (!type) throw py::error_already_set();
  const char* dot = std::strrchr(spec->name, '.');
  m.add_object(dot != nullptr ? dot + 1 : spec->name, type);
  return reinterpret_cast<PyTypeObject*>(type.ptr());
}

}  // namespace radixkv::bindings
