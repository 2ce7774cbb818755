#include "radixkv/fork_safe.h"

#include <pthread.h>

#include <algorithm>
#include <mutex>
#include <system_error>
#include <vector>

namespace radixkv {

// The objects watched, and the fork handlers over them.
struct ForkList {
  // Never destroyed: an object of static lifetime made before them may
  // outlive them at exit.
  static std::mutex& Mutex() {
    static auto* mu = new std::mutex;
    return *mu;
  }
  static std::vector<ForkSafe*>& Live() {
    static auto* live = new std::vector<ForkSafe*>;
    return *live;
  }
  // The list stays locked across the fork: none is made or destroyed meanwhile.
  static void Prepare() {
    Mutex().lock();
    for (ForkSafe* o : Live()) o->BeforeFork();
  }
  static void Parent() {
    for (ForkSafe* o : Live()) o->AfterForkInParent();
    Mutex().unlock();
  }
  static void Child() {
    for (ForkSafe* o : Live()) o->AfterForkInChild();
    Mutex().unlock();
  }
};

void ForkSafe::WatchForks() {
  if (watched_) return;
  static std::once_flag handlers;
  std::call_once(handlers, [] {
    const int rc = pthread_atfork(ForkList::Prepare, ForkList::Parent, ForkList::Child);
    if (rc != 0) throw std::system_error(rc, std::generic_category(), "pthread_atfork");
  });
  std::lock_guard<std::mutex> lock(ForkList::Mutex());
  ForkList::Live().push_back(this);
  watched_ = true;
}

void ForkSafe::UnwatchForks() noexcept {
  if (!watched_) return;
  std::lock_guard<std::mutex> lock(ForkList::Mutex());
  auto& live = ForkList::Live();
  live.erase(std::remove(live.begin(), live.end(), this), live.end());
  watched_ = false;
}

}  // namespace radixkv
