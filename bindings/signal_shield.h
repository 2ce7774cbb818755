// radixkv._core.shielded: calls that signals cannot cut in two.
//
// A CacheManager call is a run of native calls (the tree, the page
// allocators, the copy controller) glued by Python. A signal whose Python
// handler raises (Ctrl-C's KeyboardInterrupt, a SIGTERM handler that calls
// sys.exit, a SIGALRM timeout, a SIGUSR1 handler) runs between any two
// bytecodes of the main thread, so it could land after a copy was queued and
// before it was recorded, and the tiers' bookkeeping would never add up
// again. A shielded call holds such signals back while it runs and delivers
// them the moment it returns:
//
//  - Held: every signal whose handler is a Python callable, but those the
//    kernel sends for a fault of the running thread (SIGSEGV, SIGBUS, SIGFPE,
//    SIGILL, SIGTRAP, SIGSYS: a handler that returns runs the faulting
//    instruction again) and abort()'s SIGABRT.
//  - On entry (main thread, outermost call) a signal already pending is
//    delivered first: the call raises before it changes anything.
//  - While it runs, those signals reach a C handler placed in front of
//    Python's own C handler, which only notes them (each time they come).
//  - On return they are raised again, in signal number order, each as often
//    as it came, and handled at once: the exception comes out of the call,
//    whose work is complete (a second Ctrl-C is a second signal; one that
//    came after a handler raised is handled by the interpreter after it).
//
// Outside shielded calls the front handler passes each signal straight on,
// but one the kernel gave a thread other than the main one goes on to the
// main thread (where radixkv was imported on it and it is the process's
// first thread): Python runs its handlers there, and a main thread asleep on
// a lock, as a server's is while it waits for work, wakes only for a signal
// sent to it, so a SIGTERM handled on another thread would wait unseen. (A
// main thread that blocks the signal gets it when it unblocks it; a C
// handler placed in front of ours that calls ours keeps the signal where the
// kernel put it, or it would run twice, but one that chains by putting ours
// back and raising the signal again, as faulthandler does, runs again on the
// main thread.) The front is only ever placed before Python's own C handler,
// never before another's (a C library's handler that chains to the one it
// replaced can then never lead back to it). `signal.signal()` installs
// Python's handler in front again; radixkv wraps `_signal.signal`, which
// `signal.signal()` calls, so that ours is put back in front the moment a
// Python handler is installed (no check costs a call anything for it).
// A handler put back by C code (sigaction) is found on the next outermost
// call for SIGINT (the kernel is asked on every one), within 10 ms for the
// others. In a child made by fork() nothing is held back until its first
// shielded call. Other threads never run Python signal handlers: their calls
// are not shielded. Exceptions injected with PyThreadState_SetAsyncExc or
// _thread.interrupt_main() bypass the kernel and are not held back.
#pragma once

#include <pybind11/pybind11.h>

namespace radixkv::bindings {

/// Registers the `shielded` type on `_core`: `shielded(fn)` is a callable
/// (and a method, used as a decorator in a class) that calls `fn` shielded.
void RegisterSignalShield(pybind11::module_& m);

}  // namespace radixkv::bindings
