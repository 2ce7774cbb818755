#include "radixkv/job_thread.h"

#include <chrono>
#include <new>
#include <utility>

namespace radixkv {
namespace {

// How long the idle thread polls for a job before it sleeps: longer than the
// gap between a scheduler's calls within a step, far shorter than a step. A
// wake-up costs the waker a system call, and the woken tens of microseconds
// on a virtual machine.
constexpr std::chrono::microseconds kIdlePoll{30};
// How long Wait polls for the last jobs before it sleeps: they are usually a
// few microseconds' work, less than a wake-up.
constexpr std::chrono::microseconds kWaitPoll{100};

// A spin-wait hint that leaves the core's other thread the pipeline.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#else
  std::this_thread::yield();
#endif
}

// Spins while `busy()` holds, for `limit` at most.
template <typename Busy>
void PollWhile(Busy busy, std::chrono::microseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (busy() && std::chrono::steady_clock::now() < until) CpuRelax();
}

}  // namespace

JobThread::~JobThread() {
  if (registered_) RemoveFromForkList(this);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void JobThread::BeforeFork() {
  std::unique_lock<std::mutex> lock(mu_);
  ++waiters_;
  idle_.wait(lock, [&] { return jobs_.empty() && !running_; });
  --waiters_;
  lock.release();  // (held across the fork)
}

void JobThread::AfterForkInParent() { mu_.unlock(); }

void JobThread::AfterForkInChild() {
  // This thread is the child's only one: the job thread, and whoever waited
  // on the condition variables, stayed in the parent. Their objects are
  // made anew over the old ones (whose destructors would join or wake them).
  new (&thread_) std::thread();
  new (&work_) std::condition_variable();
  new (&idle_) std::condition_variable();
  sleeping_ = running_ = false;
  waiters_ = 0;
  mu_.unlock();
}

void JobThread::Post(std::function<void()>&& job) {
  if (!registered_) {  // (before any thread, and not under mu_: a fork takes the list, then mu_)
    AddToForkList(this);
    registered_ = true;
  }
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
    jobs_.push_back(std::move(job));
    queued_.fetch_add(1, std::memory_order_release);
    wake = sleeping_;
  }
  if (wake) work_.notify_one();
}

void JobThread::Wait() {
  PollWhile([&] { return queued_.load(std::memory_order_acquire) != 0; }, kWaitPoll);
  std::unique_lock<std::mutex> lock(mu_);
  ++waiters_;
  idle_.wait(lock, [&] { return jobs_.empty() && !running_; });
  --waiters_;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void JobThread::Run() {
  std::vector<std::function<void()>> batch;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (jobs_.empty()) {
      if (stop_) return;
      // Poll a while without the lock, then sleep until a job comes.
      lock.unlock();
      PollWhile([&] { return queued_.load(std::memory_order_acquire) == 0; }, kIdlePoll);
      lock.lock();
      sleeping_ = true;
      work_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      sleeping_ = false;
      continue;
    }
    batch.assign(std::make_move_iterator(jobs_.begin()), std::make_move_iterator(jobs_.end()));
    jobs_.clear();
    running_ = true;
    lock.unlock();
    std::exception_ptr error;
    for (std::function<void()>& job : batch) {
      try {
        job();
      } catch (...) {
        if (!error) error = std::current_exception();
      }
      // One by one, so that queued() runs ahead of the jobs' effects by at
      // most the job under way, not by the whole batch.
      queued_.fetch_sub(1, std::memory_order_release);
    }
    batch.clear();  // the jobs' captures go here, off the caller's thread
    lock.lock();
    running_ = false;
    if (error && !error_) error_ = error;
    if (waiters_ > 0) idle_.notify_all();
  }
}

}  // namespace radixkv
