#include "radixkv/fork_list.h"

#include <pthread.h>

#include <algorithm>
#include <mutex>
#include <system_error>
#include <vector>

namespace radixkv {
namespace {

// Never destroyed: an object of static lifetime made before them may
// outlive them at exit.
std::mutex& ListMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

std::vector<ForkAware*>& List() {
  static auto* list = new std::vector<ForkAware*>;
  return *list;
}

// The list stays locked across the fork, so none is added or taken off
// meanwhile; the child has the forking thread's lock to release.
void Prepare() {
  ListMutex().lock();
  for (bool waits : {true, false}) {
    for (ForkAware* object : List()) {
      if (object->WaitsAtFork() == waits) object->BeforeFork();
    }
  }
}

void Parent() {
  for (ForkAware* object : List()) object->AfterForkInParent();
  ListMutex().unlock();
}

void Child() {
  for (ForkAware* object : List()) object->AfterForkInChild();
  ListMutex().unlock();
}

}  // namespace

void AddToForkList(ForkAware* object) {
  static std::once_flag handlers;
  std::call_once(handlers, [] {
    const int rc = pthread_atfork(Prepare, Parent, Child);
    if (rc != 0) throw std::system_error(rc, std::generic_category(), "pthread_atfork");
  });
  std::lock_guard<std::mutex> lock(ListMutex());
  List().push_back(object);
}

void RemoveFromForkList(ForkAware* object) noexcept {
  std::lock_guard<std::mutex> lock(ListMutex());
  List().erase(std::remove(List().begin(), List().end(), object), List().end());
}

}  // namespace radixkv
