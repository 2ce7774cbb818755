// Objects that own a thread and stay usable across fork().
//
// A child made by fork() has one thread, the one that forked: an object's
// thread stays in the parent, and a child that waited for it, or only joined
// it when the object went at its exit, would hang. Before a fork each object
// on the list is brought to rest (its thread idle, nothing half done) and
// keeps its lock across the fork; after it, the parent releases the lock, and
// the child forgets the thread and starts one of its own when it next needs
// it (pthread_atfork, installed with the first object).
#pragma once

namespace radixkv {

class ForkSafe {
 public:
  ForkSafe(const ForkSafe&) = delete;
  ForkSafe& operator=(const ForkSafe&) = delete;

 protected:
  ForkSafe() = default;
  ~ForkSafe() = default;
  /// Joins the list (once). Throws std::system_error where the fork handlers
  /// cannot be installed: then the object must not start a thread.
  void WatchForks();
  /// Leaves it: first thing in the derived class's destructor.
  void UnwatchForks() noexcept;

 private:
  friend struct ForkList;
  /// With the list locked: waits until the thread is idle and returns with
  /// the object's lock held.
  virtual void BeforeFork() = 0;
  /// Releases that lock.
  virtual void AfterForkInParent() = 0;
  /// In the child: forgets the thread and whoever waited, releases the lock.
  virtual void AfterForkInChild() = 0;

  bool watched_ = false;
};

}  // namespace radixkv
