// radixkv._core.shielded: calls that signals cannot cut in two.
//
// A CacheManager call is a run of native calls (the tree, the page
// allocators, the copy controller) glued by Python. A signal whose Python
// handler raises (Ctrl-C's KeyboardInterrupt, a SIGTERM handler that calls
// sys.exit) runs between any two bytecodes of the main thread, so it could
// land after a copy was queued and before it was recorded, and the tiers'
// bookkeeping would never add up again. A shielded call holds such signals
// back while it runs and delivers them the moment it returns:
//
//  - On entry (main thread, outermost call) a signal already pending is
//    delivered first: the call raises before it changes anything.
//  - While it runs, SIGINT and SIGTERM reach a C handler placed in front of
//    the one installed (Python's, or any other), which only notes them.
//  - On return they are raised again and, for Python's handler, handled at
//    once: the exception comes out of the call, whose work is complete.
//
// Outside shielded calls the front handler passes each signal straight on,
// so nothing else changes; `signal.signal()` replaces it as usual, and the
// next shielded call puts it back in front. Other threads never run Python
// signal handlers: their calls are not shielded. Exceptions injected with
// PyThreadState_SetAsyncExc or _thread.interrupt_main() bypass the OS and are
// not held back.
#pragma once

#include <pybind11/pybind11.h>

namespace radixkv::bindings {

/// Registers the `shielded` type on `_core`: `shielded(fn)` is a callable
/// (and a method, used as a decorator in a class) that calls `fn` shielded.
void RegisterSignalShield(pybind11::module_& m);

}  // namespace radixkv::bindings
