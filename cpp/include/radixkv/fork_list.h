// The objects that own a thread, brought through fork().
//
// A forked child has one thread, the one that called fork(). An object whose
// thread stayed in the parent would make the child wait on it for ever: a
// join in its destructor, or a wait for work only that thread does. Such an
// object derives from ForkAware and is added to the list while it lives;
// around every fork() (pthread_atfork) the list calls each one:
// BeforeFork brings it to rest and locks it, AfterForkInParent unlocks it,
// and AfterForkInChild makes it whole without the thread (which the object
// may start anew when it next needs one). Those that wait for their
// thread's work before a fork (WaitsAtFork) go first, so that those that
// only lock (a copy controller) are not held while they wait.
#pragma once

namespace radixkv {

class ForkAware {
 public:
  virtual void BeforeFork() = 0;
  virtual void AfterForkInParent() = 0;
  virtual void AfterForkInChild() = 0;
  /// Whether BeforeFork waits for work (then it goes before those that only lock).
  virtual bool WaitsAtFork() const { return false; }

 protected:
  ~ForkAware() = default;
};

/// Adds `object` to the list (the first call installs the fork handlers).
/// Throws std::system_error where the handlers cannot be installed: then an
/// object must not start a thread.
void AddToForkList(ForkAware* object);
/// Takes `object` off the list: call before it starts to go.
void RemoveFromForkList(ForkAware* object) noexcept;

}  // namespace radixkv
