#include "signal_shield.h"

#include <Python.h>
#include <pthread.h>
#include <pythread.h>
#include <structmember.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <ctime>

#include "fast_call.h"

namespace radixkv::bindings {
namespace {

namespace py = pybind11;

constexpr int kSignals[] = {SIGINT, SIGTERM};
using Handler = void (*)(int);

// SIGTERM's front handler is checked for (and put back in front of Python's
// C handler, which signal.signal() installs) when its Python handler changed,
// and at least this often: asking the kernel is a system call. SIGINT's is
// checked on every outermost call.
constexpr int64_t kRecheckNs = 10'000'000;

std::atomic<int> g_depth{0};        // shielded calls under way on the main thread
std::atomic<int> g_pending[NSIG];   // signals held back, by number
std::atomic<Handler> g_next[NSIG];  // the handler each front handler passes to
unsigned long g_main_thread = 0;
// Python's own C handler (what signal.signal() installs for a Python
// callable): the only handler the front is ever placed before, so a handler
// that chains to the one it replaced can never lead back to ours.
Handler g_python_handler = nullptr;
int64_t g_next_check_ns = 0;  // main thread only
// _signal.getsignal, SIGTERM as a Python int, and its Python handler at the
// last check (held, so a new handler is never at an old address).
PyObject* g_getsignal = nullptr;
PyObject* g_sigterm = nullptr;
PyObject* g_seen_sigterm = nullptr;

extern "C" void FrontHandler(int sig) {
  const Handler next = g_next[sig].load(std::memory_order_acquire);
  if (g_depth.load(std::memory_order_acquire) > 0) {
    g_pending[sig].fetch_add(1, std::memory_order_acq_rel);  // each one counts (a second Ctrl-C)
    // The call may have ended meanwhile, its held signals delivered: then
    // pass this one on now (whoever takes the count delivers it).
    if (g_depth.load(std::memory_order_acquire) > 0 ||
        g_pending[sig].exchange(0, std::memory_order_acq_rel) == 0) {
      return;
    }
  }
  if (next != nullptr) next(sig);
}

// Puts the front handler before Python's C handler for `sig`.
void PlaceFront(int sig) {
  struct sigaction now;
  if (g_python_handler == nullptr || sigaction(sig, nullptr, &now) != 0 ||
      (now.sa_flags & SA_SIGINFO) || now.sa_handler != g_python_handler) {
    return;
  }
  g_next[sig].store(now.sa_handler, std::memory_order_release);
  struct sigaction front = now;
  front.sa_handler = FrontHandler;
  sigaction(sig, &front, nullptr);
}

int64_t NowNs() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
  return int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec;
}

// Whether SIGTERM's Python handler changed since the last check.
bool SigtermHandlerChanged() {
  PyObject* now = PyObject_Vectorcall(g_getsignal, &g_sigterm, 1, nullptr);
  if (now == nullptr) {
    PyErr_Clear();
    return true;
  }
  if (now == g_seen_sigterm) {
    Py_DECREF(now);
    return false;
  }
  Py_XSETREF(g_seen_sigterm, now);
  return true;
}

// Delivers the signals held back, each as often as it came, running their
// Python handlers after each (Python notes only that a signal came, not how
// often). Returns -1 with the exception set if a handler raised; each signal
// still held is then raised once more, for the interpreter to handle after
// it. With `handle` false (an exception is already set) each is raised once
// and left for the interpreter.
int DeliverHeld(bool handle) {
  for (int sig : kSignals) {
    for (int n = g_pending[sig].exchange(0, std::memory_order_acq_rel); n > 0; --n) {
      std::raise(sig);
      if (!handle) break;
      if (PyErr_CheckSignals() < 0) {
        for (int other : kSignals) {
          if (g_pending[other].exchange(0, std::memory_order_acq_rel) > 0) std::raise(other);
        }
        return -1;
      }
    }
  }
  return 0;
}

// In a child made by fork() (from any thread): no call is under way there,
// and the thread that forked is its main thread.
void AfterForkInChild() {
  g_depth.store(0);
  for (int sig : kSignals) g_pending[sig].store(0);
  g_main_thread = PyThread_get_thread_ident();
}

// Python's C handler: what SIGINT has when its Python handler is a
// callable (Python installs one at start), else what signal.signal()
// installs, for a moment, on a spare signal at its default. Null when
// neither can be read (not on the main thread): nothing is held back then.
Handler FindPythonHandler() {
  py::module_ sig = py::module_::import("_signal");
  struct sigaction now;
  if (PyCallable_Check(sig.attr("getsignal")(SIGINT).ptr()) &&
      sigaction(SIGINT, nullptr, &now) == 0 && !(now.sa_flags & SA_SIGINFO) &&
      now.sa_handler != SIG_DFL && now.sa_handler != SIG_IGN) {
    return now.sa_handler;
  }
  const int spare = SIGRTMAX;
  struct sigaction saved;
  py::object old = sig.attr("getsignal")(spare);
  if (sigaction(spare, nullptr, &saved) != 0 || saved.sa_handler != SIG_DFL ||
      !py::isinstance<py::int_>(old)) {
    return nullptr;
  }
  try {
    sig.attr("signal")(spare, sig.attr("default_int_handler"));
  } catch (py::error_already_set&) {
    return nullptr;  // not the main thread
  }
  const bool read = sigaction(spare, nullptr, &now) == 0;
  sig.attr("signal")(spare, old);
  sigaction(spare, &saved, nullptr);
  return read && !(now.sa_flags & SA_SIGINFO) ? now.sa_handler : nullptr;
}

struct Shielded {
  PyObject_HEAD PyObject* fn;
  vectorcallfunc vectorcall;
};

PyObject* Shielded_Call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* fn = reinterpret_cast<Shielded*>(self)->fn;
  if (PyThread_get_thread_ident() != g_main_thread) {
    return PyObject_Vectorcall(fn, args, nargsf, kwnames);
  }
  if (g_depth.load(std::memory_order_relaxed) == 0) {
    // What arrived before the call is delivered before it.
    if (DeliverHeld(true) < 0 || PyErr_CheckSignals() < 0) return nullptr;
    PlaceFront(SIGINT);
    const int64_t now = NowNs();
    if (SigtermHandlerChanged() || now >= g_next_check_ns) {
      PlaceFront(SIGTERM);
      g_next_check_ns = now + kRecheckNs;
    }
  }
  g_depth.fetch_add(1, std::memory_order_acq_rel);
  PyObject* result = PyObject_Vectorcall(fn, args, nargsf, kwnames);
  if (g_depth.fetch_sub(1, std::memory_order_acq_rel) == 1 && DeliverHeld(result != nullptr) < 0) {
    Py_DECREF(result);
    return nullptr;
  }
  return result;
}

PyObject* Shielded_New(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* fn = nullptr;
  static const char* kNames[] = {"fn", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:shielded", const_cast<char**>(kNames), &fn)) {
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
  for (const char* shown :
       {"__doc__", "__name__", "__qualname__", "__module__", "__annotations__"}) {
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
    {Py_tp_doc,
     const_cast<char*>("shielded(fn): calls fn with SIGINT and SIGTERM held back until it returns "
                       "(on the main thread), so their handlers never run in the middle of it; "
                       "used as a method decorator.")},
    {0, nullptr},
};

PyType_Spec kShieldedSpec{"radixkv._core.shielded", sizeof(Shielded), 0,
                          Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                              Py_TPFLAGS_METHOD_DESCRIPTOR,
                          kShieldedSlots};

}  // namespace

void RegisterSignalShield(py::module_& m) {
  g_main_thread =
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  g_getsignal = py::object(py::module_::import("_signal").attr("getsignal")).release().ptr();
  g_sigterm = py::int_(SIGTERM).release().ptr();
  g_python_handler = FindPythonHandler();
  pthread_atfork(nullptr, nullptr, AfterForkInChild);
  AddType(m, &kShieldedSpec);
}

}  // namespace radixkv::bindings
