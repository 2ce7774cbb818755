#include "torch_api.h"

#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace radixkv::bindings {
namespace {

PyTypeObject* g_tensor_type = nullptr;
const DLPackExchangeAPI* g_api = nullptr;

void Load() {
  py::object tensor_type = py::module_::import("torch").attr("Tensor");
  py::object capsule = tensor_type.attr("__dlpack_c_exchange_api__");
  auto* api = static_cast<const DLPackExchangeAPI*>(
      PyCapsule_GetPointer(capsule.ptr(), "dlpack_exchange_api"));
  if (api == nullptr) throw py::error_already_set();
  if (api->header.version.major != DLPACK_MAJOR_VERSION) {
    throw py::import_error("torch's DLPack exchange API has major version " +
                           std::to_string(api->header.version.major) + ", expected " +
                           std::to_string(DLPACK_MAJOR_VERSION));
  }
  // Both live as long as torch is loaded, that is, for the process.
  g_tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type.release().ptr());
  g_api = api;
}

[[noreturn]] void RaiseUnreadable(const char* name) {
  py::error_already_set cause;
  std::string why = py::str(cause.value());
  why = why.substr(0, why.find('\n'));  // torch appends a C++ backtrace
  PyErr_SetString(
      PyExc_TypeError,
      (std::string(name) + " must be a dense tensor that DLPack can export (" + why + ")").c_str());
  throw py::error_already_set();
}

}  // namespace

const DLPackExchangeAPI& TorchApi() {
  if (g_api == nullptr) Load();
  return *g_api;
}

bool IsTorchTensor(PyObject* o) {
  if (g_tensor_type == nullptr) Load();
  return PyObject_TypeCheck(o, g_tensor_type);
}

TorchTensorView::TorchTensorView(PyObject* o, const char* name) {
  const DLPackExchangeAPI& api = TorchApi();
  if (api.dltensor_from_py_object_no_sync != nullptr) {
    if (api.dltensor_from_py_object_no_sync(o, &tensor_) != 0) RaiseUnreadable(name);
  } else {
    if (api.managed_tensor_from_py_object_no_sync(o, &owner_) != 0) RaiseUnreadable(name);
    tensor_ = owner_->dl_tensor;
  }
}

TorchTensorView::~TorchTensorView() {
  if (owner_ != nullptr && owner_->deleter != nullptr) owner_->deleter(owner_);
}

std::string DTypeName(const DLDataType& d) {
  std::string name;
  switch (d.code) {
    case kDLInt:
      name = "int" + std::to_string(d.bits);
      break;
    case kDLUInt:
      name = "uint" + std::to_string(d.bits);
      break;
    case kDLFloat:
      name = "float" + std::to_string(d.bits);
      break;
    case kDLBfloat:
      name = "bfloat" + std::to_string(d.bits);
      break;
    case kDLComplex:
      name = "complex" + std::to_string(d.bits);
      break;
    case kDLBool:
      name = "bool";
      break;
    case kDLFloat8_e4m3fn:
      name = "float8_e4m3fn";
      break;
    case kDLFloat8_e4m3fnuz:
      name = "float8_e4m3fnuz";
      break;
    case kDLFloat8_e5m2:
      name = "float8_e5m2";
      break;
    case kDLFloat8_e5m2fnuz:
      name = "float8_e5m2fnuz";
      break;
    case kDLFloat8_e8m0fnu:
      name = "float8_e8m0fnu";
      break;
    default:
      name = "dtype code " + std::to_string(d.code) + " of " + std::to_string(d.bits) + " bits";
  }
  if (d.lanes != 1) name += "x" + std::to_string(d.lanes);
  return name;
}

std::string DeviceName(const DLDevice& d) {
  switch (d.device_type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      return "cuda:" + std::to_string(d.device_id);
    case kDLMetal:
      return "mps";
    default:
      return "device type " + std::to_string(static_cast<int>(d.device_type));
  }
}

}  // namespace radixkv::bindings
