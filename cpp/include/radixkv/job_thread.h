// Jobs run one after another, in the order given, on a thread of their own.
//
// For work a caller hands off and reads back later: the caller posts a job
// (which owns everything it reads), goes on, and waits only when it needs
// the jobs' results. The thread starts with the first job. Once idle it
// polls for a while before it sleeps, so a caller that posts every few
// microseconds (a scheduler's step) does not pay a wake-up each time.
//
// One caller thread at a time: Post and Wait are not for concurrent callers.
//
// A fork() waits for every JobThread's queued jobs first, so the child gets
// the results whole; in the child the thread is gone, and the next Post
// starts one of its own there.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "radixkv/fork_list.h"

namespace radixkv {

class JobThread final : private ForkAware {
 public:
  JobThread() = default;
  /// Runs the jobs still queued, then stops the thread.
  ~JobThread();
  JobThread(const JobThread&) = delete;
  JobThread& operator=(const JobThread&) = delete;

  /// Queues `job` after the others (starting the thread on the first).
  /// Throws std::system_error where no thread can start, leaving `job` as
  /// it was and nothing queued.
  void Post(std::function<void()>&& job);
  /// Returns once every job posted has run. A job that threw does not stop
  /// the others; the first exception is rethrown here, once.
  void Wait();
  /// Jobs posted and not finished yet.
  int64_t queued() const noexcept { return queued_.load(std::memory_order_acquire); }

 private:
  void Run();
  // Around a fork() (the fork list, for every JobThread posted to): before
  // it, waits for the jobs and keeps `mu_` locked across the fork; the
  // parent unlocks it, the child forgets the thread, which it does not have.
  void BeforeFork() override;
  void AfterForkInParent() override;
  void AfterForkInChild() override;
  bool WaitsAtFork() const override { return true; }

  std::mutex mu_;
  std::condition_variable work_;  // the thread sleeps for jobs
  std::condition_variable idle_;  // Wait sleeps for the thread
  std::deque<std::function<void()>> jobs_;
  std::atomic<int64_t> queued_{0};
  bool sleeping_ = false;  // the thread waits on work_
  bool running_ = false;   // the thread runs jobs taken off jobs_
  int waiters_ = 0;
  bool stop_ = false;
  bool registered_ = false;  // in the fork handlers' list (from the first Post)
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace radixkv
