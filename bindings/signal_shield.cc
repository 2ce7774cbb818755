#include "signal_shield.h"

#include <Python.h>
#include <pthread.h>
#include <pythread.h>
#include <structmember.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <ctime>

#include "fast_call.h"

namespace radixkv::bindings {
namespace {

namespace py = pybind11;

using Handler = void (*)(int);

// The signals other than SIGINT are checked for (and put back in front of
// Python's C handler, where C code put that back) at least this often:
// asking the kernel is a system call. SIGINT's is checked on every outermost
// call; a handler installed through signal.signal() is fronted at once.
constexpr int64_t kRecheckNs = 10'000'000;

std::atomic<int> g_depth{0};             // shielded calls under way on the main thread
std::atomic<int> g_pending[NSIG];        // signals held back, by number
std::atomic<bool> g_any_pending{false};  // whether any g_pending may be non-zero
std::atomic<Handler> g_next[NSIG];       // the handler each front handler passes to
// Signals that had a Python handler since radixkv was imported, or may get
// one (SIGINT, SIGTERM): the ones rechecked. Main thread only, after start.
bool g_watched[NSIG];
unsigned long g_main_thread = 0;
// Whether Python's main thread is the process's first thread (its kernel id
// is the process id), as it is where radixkv was imported on it and in a
// fork's child: only then are signals sent on to it (SentToMainThread).
std::atomic<bool> g_main_is_first{false};
// Python's own C handler (what signal.signal() installs for a Python
// callable): the only handler the front is ever placed before, so a handler
// that chains to the one it replaced can never lead back to ours.
Handler g_python_handler = nullptr;
int64_t g_next_check_ns = 0;            // main thread only
PyObject* g_original_signal = nullptr;  // _signal.signal before radixkv wrapped it

// Whether `sig`'s Python handler is held back during a call: not for the
// signals the kernel sends for a fault of the running thread (a handler
// that returns runs the faulting instruction again), abort()'s, or those
// that cannot be caught.
bool Holdable(int sig) {
  switch (sig) {
    case SIGSEGV:
    case SIGBUS:
    case SIGFPE:
    case SIGILL:
    case SIGTRAP:
    case SIGSYS:
    case SIGABRT:
    case SIGKILL:
    case SIGSTOP:
      return false;
    default:
      return sig > 0 && sig < NSIG;
  }
}

extern "C" void FrontHandler(int sig);

pid_t ThreadId() { return static_cast<pid_t>(syscall(SYS_gettid)); }

// Sends `sig` on to the main thread when it came to another one. Python runs
// signal handlers on its main thread only, and a main thread asleep on a
// lock (a server's scheduler waiting for work) wakes only for a signal the
// kernel gives it: one handled on another thread would wait, unseen, until
// the main thread next runs. Not where a handler placed in front of ours
// calls it (it would run again on the main thread); one that chains by
// putting ours back and raising the signal again (faulthandler's) cannot be
// told from the kernel's own delivery, and runs again there. Async-signal-
// safe; errno is kept.
bool SentToMainThread(int sig) {
  if (!g_main_is_first.load(std::memory_order_relaxed)) return false;
  const int saved = errno;
  const pid_t main_tid = getpid();
  struct sigaction now;
  const bool sent = ThreadId() != main_tid && sigaction(sig, nullptr, &now) == 0 &&
                    !(now.sa_flags & SA_SIGINFO) && now.sa_handler == FrontHandler &&
                    syscall(SYS_tgkill, main_tid, main_tid, sig) == 0;
  errno = saved;
  return sent;
}

extern "C" void FrontHandler(int sig) {
  const Handler next = g_next[sig].load(std::memory_order_acquire);
  if (g_depth.load(std::memory_order_acquire) > 0) {
    g_pending[sig].fetch_add(1, std::memory_order_acq_rel);  // each one counts (a second Ctrl-C)
    g_any_pending.store(true, std::memory_order_release);
    // The call may have ended meanwhile, its held signals delivered: then
    // pass this one on now (whoever takes the count delivers it).
    if (g_depth.load(std::memory_order_acquire) > 0 ||
        g_pending[sig].exchange(0, std::memory_order_acq_rel) == 0) {
      return;
    }
  }
  if (SentToMainThread(sig)) return;
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

// Delivers the signals held back, in number order, each as often as it
// came, running their Python handlers after each (Python notes only that a
// signal came, not how often). Returns -1 with the exception set if a handler
// raised; each signal still held is then raised once more, for the
// interpreter to handle after it. With `handle` false (an exception is
// already set) each is raised once and left for the interpreter.
int DeliverHeld(bool handle) {
  if (!g_any_pending.exchange(false, std::memory_order_acq_rel)) return 0;
  for (int sig = 1; sig < NSIG; ++sig) {
    for (int n = g_pending[sig].exchange(0, std::memory_order_acq_rel); n > 0; --n) {
      std::raise(sig);
      if (!handle) break;
      if (PyErr_CheckSignals() < 0) {
        for (int other = 1; other < NSIG; ++other) {
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
  for (int sig = 1; sig < NSIG; ++sig) g_pending[sig].store(0);
  g_any_pending.store(false);
  g_main_thread = PyThread_get_thread_ident();
  g_main_is_first.store(true);  // (the child's one thread is its first)
}

// _signal.signal as radixkv wraps it: the original, then, for a signal whose
// handler is now Python's C handler, the front put back before it at once.
PyObject* WrappedSignal(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  PyObject* previous = PyObject_Vectorcall(g_original_signal, args, nargs, nullptr);
  if (previous == nullptr) return nullptr;
  const long sig = PyLong_AsLong(args[0]);  // (a number the original took)
  if (sig == -1 && PyErr_Occurred()) {
    PyErr_Clear();
  } else if (Holdable(static_cast<int>(sig))) {
    g_watched[sig] = true;
    PlaceFront(static_cast<int>(sig));
  }
  return previous;
}

PyMethodDef kWrappedSignalDef = {
    "signal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(WrappedSignal)),
    METH_FASTCALL,
    "signal($module, signalnum, handler, /)\n--\n\n"
    "Sets the action for the given signal (_signal.signal's own, which it calls); a\n"
    "Python handler's signal is then held back during radixkv's shielded calls at once."};

// Wraps _signal.signal (once: a module loaded again finds it wrapped).
void WrapSignalModule() {
  py::module_ sig = py::module_::import("_signal");
  py::object current = sig.attr("signal");
  if (PyCFunction_Check(current.ptr()) &&
      PyCFunction_GET_FUNCTION(current.ptr()) == kWrappedSignalDef.ml_meth) {
    return;
  }
  g_original_signal = current.release().ptr();
  py::object wrapped = py::reinterpret_steal<py::object>(
      PyCFunction_NewEx(&kWrappedSignalDef, sig.ptr(), py::str("_signal").ptr()));
  if (!wrapped) throw py::error_already_set();
  sig.attr("signal") = wrapped;
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
    if (now >= g_next_check_ns) {
      for (int sig = 1; sig < NSIG; ++sig) {
        if (g_watched[sig] && sig != SIGINT) PlaceFront(sig);
      }
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
     const_cast<char*>("shielded(fn): calls fn with every signal whose handler is a Python "
                       "callable (SIGINT, SIGTERM, SIGALRM, ...; not a fault's) held back until "
                       "it returns (on the main thread), so those handlers never run in the "
                       "middle of it; used as a method decorator.")},
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
  g_main_is_first.store(PyThread_get_thread_ident() == g_main_thread && ThreadId() == getpid());
  g_python_handler = FindPythonHandler();
  if (g_python_handler != nullptr) {
    // The Python handlers installed before radixkv was imported.
    g_watched[SIGINT] = g_watched[SIGTERM] = true;
    struct sigaction now;
    for (int sig = 1; sig < NSIG; ++sig) {
      if (Holdable(sig) && sigaction(sig, nullptr, &now) == 0 && !(now.sa_flags & SA_SIGINFO) &&
          now.sa_handler == g_python_handler) {
        g_watched[sig] = true;
      }
      if (g_watched[sig]) PlaceFront(sig);
    }
    WrapSignalModule();
  }
  pthread_atfork(nullptr, nullptr, AfterForkInChild);
  AddType(m, &kShieldedSpec);
}

}  // namespace radixkv::bindings
