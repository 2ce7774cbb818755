#include "signal_shield.h"

#include <Python.h>
#include <pythread.h>
#include <structmember.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <ctime>
#include <iterator>

#include "fast_call.h"

namespace radixkv::bindings {
namespace {

namespace py = pybind11;

constexpr int kSignals[] = {SIGINT, SIGTERM};
using Handler = void (*)(int);

// How often the front handlers are checked for (and put back in front of a
// handler installed since) when the Python handlers look unchanged: a
// syscall per signal, so not on every call.
constexpr int64_t kRecheckNs = 10'000'000;

std::atomic<int> g_depth{0};        // shielded calls under way on the main thread
int64_t g_next_check_ns = 0;        // main thread only
// _signal.getsignal, each signal as a Python int, and the Python handler each
// had at the last check (held, so a new handler is never at an old address).
PyObject* g_getsignal = nullptr;
PyObject* g_signums[std::size(kSignals)] = {};
PyObject* g_seen[std::size(kSignals)] = {};

// Whether a Python handler changed since the last check (signal.signal()
// puts Python's own C handler back in front of ours): then it is time to
// check. One call of signal.getsignal per signal, far cheaper than asking
// the kernel.
bool HandlersChanged() {
  bool changed = false;
  for (size_t i = 0; i < std::size(kSignals); ++i) {
    PyObject* now = PyObject_Vectorcall(g_getsignal, &g_signums[i], 1, nullptr);
    if (now == nullptr) {
      PyErr_Clear();
      return true;
    }
    if (now != g_seen[i]) {
      changed = true;
      Py_XSETREF(g_seen[i], now);
    } else {
      Py_DECREF(now);
    }
  }
  return changed;
}
std::atomic<int> g_pending[NSIG];   // signals held back, by number
std::atomic<Handler> g_next[NSIG];  // the handler each front handler passes to
unsigned long g_main_thread = 0;

extern "C" void FrontHandler(int sig) {
  if (g_depth.load(std::memory_order_acquire) > 0) {
    g_pending[sig].fetch_add(1, std::memory_order_acq_rel);  // each one counts (a second Ctrl-C)
    return;
  }
  const Handler next = g_next[sig].load(std::memory_order_acquire);
  if (next != nullptr) next(sig);
}

int64_t NowNs() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
  return int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec;
}

// Puts the front handler before each signal's handler, where that is a
// plain function (not SIG_DFL, SIG_IGN, an SA_SIGINFO handler, or ours).
void PlaceFront() {
  for (int sig : kSignals) {
    struct sigaction now;
    if (sigaction(sig, nullptr, &now) != 0) continue;
    if ((now.sa_flags & SA_SIGINFO) || now.sa_handler == SIG_DFL ||
        now.sa_handler == SIG_IGN || now.sa_handler == FrontHandler) {
      continue;
    }
    g_next[sig].store(now.sa_handler, std::memory_order_release);
    struct sigaction front = now;
    front.sa_handler = FrontHandler;
    sigaction(sig, &front, nullptr);
  }
}

// Delivers the signals held back, each as often as it came, running their
// Python handlers after each (Python notes only that a signal came, not how
// often). Returns -1 with the exception set if a handler raised (what came
// after it is dropped), else 0. With `handle` false (an exception is already
// set) each is raised once and left for the interpreter to handle later.
int DeliverHeld(bool handle) {
  for (int sig : kSignals) {
    for (int n = g_pending[sig].exchange(0, std::memory_order_acq_rel); n > 0; --n) {
      std::raise(sig);
      if (!handle) break;
      if (PyErr_CheckSignals() < 0) {
        for (int other : kSignals) g_pending[other].store(0, std::memory_order_release);
        return -1;
      }
    }
  }
  return 0;
}

struct Shielded {
  PyObject_HEAD
  PyObject* fn;
  vectorcallfunc vectorcall;
};

PyObject* Shielded_Call(PyObject* self, PyObject* const* args, size_t nargsf,
                        PyObject* kwnames) {
  PyObject* fn = reinterpret_cast<Shielded*>(self)->fn;
  if (PyThread_get_thread_ident() != g_main_thread) {
    return PyObject_Vectorcall(fn, args, nargsf, kwnames);
  }
  if (g_depth.load(std::memory_order_relaxed) == 0) {
    // What arrived before the call is delivered before it.
    if (DeliverHeld(true) < 0 || PyErr_CheckSignals() < 0) return nullptr;
    const int64_t now = NowNs();
    if (HandlersChanged() || now >= g_next_check_ns) {
      PlaceFront();
      g_next_check_ns = now + kRecheckNs;
    }
  }
  g_depth.fetch_add(1, std::memory_order_acq_rel);
  PyObject* result = PyObject_Vectorcall(fn, args, nargsf, kwnames);
  if (g_depth.fetch_sub(1, std::memory_order_acq_rel) == 1 &&
      DeliverHeld(result != nullptr) < 0) {
    Py_DECREF(result);
    return nullptr;
  }
  return result;
}

PyObject* Shielded_New(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* fn = nullptr;
  static const char* kNames[] = {"fn", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:shielded", const_cast<char**>(kNames),
                                   &fn)) {
    return nullptr;
  }
  if (!PyCallable_Check(fn)) {
    PyErr_Format(PyExc_TypeError, "fn must be callable, got %.100s", Py_TYPE(fn)->tp_name);
    return nullptr;
  }
  auto* self = reinterpret_cast<Shielded*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  Py_INCREF(fn);
  self->fn = fn;
  self->vectorcall = Shielded_Call;
  return reinterpret_cast<PyObject*>(self);
}

int Shielded_Traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(reinterpret_cast<Shielded*>(self)->fn);
  Py_VISIT(Py_TYPE(self));
  return 0;
}

int Shielded_Clear(PyObject* self) {
  Py_CLEAR(reinterpret_cast<Shielded*>(self)->fn);
  return 0;
}

void Shielded_Dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  Shielded_Clear(self);
  type->tp_free(self);
  Py_DECREF(type);
}

// A method when read from an instance, as a function is.
PyObject* Shielded_Get(PyObject* self, PyObject* obj, PyObject*) {
  if (obj == nullptr || obj == Py_None) {
    Py_INCREF(self);
    return self;
  }
  return PyMethod_New(self, obj);
}

// The wrapped function's name, doc and signature show through.
PyObject* Shielded_GetAttr(PyObject* self, PyObject* name) {
  const char* text = PyUnicode_AsUTF8(name);
  if (text == nullptr) return nullptr;
  PyObject* fn = reinterpret_cast<Shielded*>(self)->fn;
  if (std::strcmp(text, "__wrapped__") == 0) {
    Py_INCREF(fn);
    return fn;
  }
  for (const char* shown : {"__doc__", "__name__", "__qualname__", "__module__",
                            "__annotations__"}) {
    if (std::strcmp(text, shown) == 0) return PyObject_GetAttr(fn, name);
  }
  return PyObject_GenericGetAttr(self, name);
}

PyObject* Shielded_Repr(PyObject* self) {
  return PyUnicode_FromFormat("<shielded %R>", reinterpret_cast<Shielded*>(self)->fn);
}

PyMemberDef kShieldedMembers[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Shielded, vectorcall), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyType_Slot kShieldedSlots[] = {
    {Py_tp_new, reinterpret_cast<void*>(Shielded_New)},
    {Py_tp_dealloc, reinterpret_cast<void*>(Shielded_Dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(Shielded_Traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(Shielded_Clear)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_descr_get, reinterpret_cast<void*>(Shielded_Get)},
    {Py_tp_getattro, reinterpret_cast<void*>(Shielded_GetAttr)},
    {Py_tp_repr, reinterpret_cast<void*>(Shielded_Repr)},
    {Py_tp_members, kShieldedMembers},
    {Py_tp_doc, const_cast<char*>(
                    "shielded(fn): calls fn with SIGINT and SIGTERM held back until it returns "
                    "(on the main thread), so their handlers never run in the middle of it; "
                    "used as a method decorator.")},
    {0, nullptr},
};

PyType_Spec kShieldedSpec{
    "radixkv._core.shielded", sizeof(Shielded), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
        Py_TPFLAGS_METHOD_DESCRIPTOR,
    kShieldedSlots};

}  // namespace

void RegisterSignalShield(py::module_& m) {
  g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident")
                      .cast<unsigned long>();
  g_getsignal = py::object(py::module_::import("_signal").attr("getsignal")).release().ptr();
  for (size_t i = 0; i < std::size(kSignals); ++i) {
    g_signums[i] = PyLong_FromLong(kSignals[i]);
    if (g_signums[i] == nullptr) throw py::error_already_set();
  }
  AddType(m, &kShieldedSpec);
}

}  // namespace radixkv::bindings
