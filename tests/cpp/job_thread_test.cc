#include "radixkv/job_thread.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

namespace radixkv {
namespace {

TEST(JobThreadTest, RunsJobsInOrderOffTheCallersThread) {
  JobThread jobs;
  std::vector<int> order;
  std::thread::id ran_on;
  for (int i = 0; i < 1000; ++i) {
    jobs.Post([&, i] {
      order.push_back(i);
      ran_on = std::this_thread::get_id();
    });
  }
  jobs.Wait();
  ASSERT_EQ(order.size(), 1000u);
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
  EXPECT_NE(ran_on, std::this_thread::get_id());
  EXPECT_EQ(jobs.queued(), 0);
}

TEST(JobThreadTest, WaitReturnsOnlyOnceTheJobsRan) {
  JobThread jobs;
  std::atomic<bool> go{false};
  int done = 0;
  jobs.Post([&] {
    while (!go.load()) std::this_thread::yield();
    done = 1;
  });
  jobs.Post([&] { done = 2; });
  EXPECT_EQ(jobs.queued(), 2);
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    go = true;
  });
  jobs.Wait();
  EXPECT_EQ(done, 2);
  release.join();
}

// queued() counts a job until it ran, one by one: a reader adding it to the
// jobs' effects (the ledger's pending events) overcounts by the job under way
// at most, not by the rest of a batch the thread took at once.
TEST(JobThreadTest, QueuedDropsAsEachJobOfABatchRuns) {
  JobThread jobs;
  std::atomic<int> open{0};  // jobs 1..3 each wait for open >= their number
  std::atomic<int> seen{-1};
  auto gate = [&](int n) {
    while (open.load() < n) std::this_thread::yield();
  };
  std::atomic<bool> started{false};
  jobs.Post([&] {  // the thread takes this one alone
    started = true;
    gate(1);
  });
  while (!started.load()) std::this_thread::yield();
  jobs.Post([&] { gate(2); });  // these two, together, once it returns
  jobs.Post([&] {
    seen = static_cast<int>(jobs.queued());
    gate(3);
  });
  EXPECT_EQ(jobs.queued(), 3);
  open = 2;  // the first two run; the third reads the count while it runs
  while (seen.load() < 0) std::this_thread::yield();
  EXPECT_EQ(seen.load(), 1);
  open = 3;
  jobs.Wait();
  EXPECT_EQ(jobs.queued(), 0);
}

TEST(JobThreadTest, AThrowingJobStopsNothingAndWaitRethrowsItOnce) {
  JobThread jobs;
  int ran = 0;
  jobs.Post([&] { ++ran; });
  jobs.Post([] { throw std::runtime_error("first"); });
  jobs.Post([] { throw std::runtime_error("second"); });
  jobs.Post([&] { ++ran; });
  try {
    jobs.Wait();
    ADD_FAILURE() << "Wait did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "first");
  }
  EXPECT_EQ(ran, 2);
  jobs.Wait();  // once
}

TEST(JobThreadTest, JobsAfterTheThreadSleptWakeIt) {
  JobThread jobs;
  int ran = 0;
  for (int i = 0; i < 5; ++i) {
    jobs.Post([&] { ++ran; });
    jobs.Wait();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // past the polling
  }
  EXPECT_EQ(ran, 5);
}

TEST(JobThreadTest, TheDestructorRunsWhatIsQueued) {
  int ran = 0;
  {
    JobThread jobs;
    for (int i = 0; i < 100; ++i) jobs.Post([&] { ++ran; });
  }
  EXPECT_EQ(ran, 100);
  JobThread never_used;  // no thread started, none joined
  EXPECT_EQ(never_used.queued(), 0);
}

// A fork waits for the jobs queued, and the child, which has no job thread,
// starts its own on its first job; destroying one never waits for the
// parent's. (Before, the child's Wait and destructor hung on a thread it did
// not have.)
TEST(JobThreadTest, AForkedChildGetsTheJobsDoneAndAThreadOfItsOwn) {
  auto jobs = std::make_unique<JobThread>();
  std::atomic<int> ran{0};
  for (int i = 0; i < 200; ++i) {
    jobs->Post([&] {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      ++ran;
    });
  }
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(20);  // a hang fails the test instead of stalling it
    bool ok = ran.load() == 200;  // every job ran before the fork
    std::thread::id on;
    jobs->Post([&] {
      ++ran;
      on = std::this_thread::get_id();
    });
    jobs->Wait();
    ok = ok && ran.load() == 201 && on != std::this_thread::get_id();
    jobs.reset();
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status)) << "the child was killed (signal " << WTERMSIG(status) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0);
  jobs->Post([&] { ++ran; });  // the parent's thread goes on
  jobs->Wait();
  EXPECT_EQ(ran.load(), 201);
}

// One of static lifetime, made before the fork handlers' list: it is
// destroyed at exit after that list's first use (the list is never
// destroyed; before, ASan saw its destructor use the freed list).
JobThread static_jobs;

TEST(JobThreadTest, OneOfStaticLifetimeOutlivesTheForkHandlersList) {
  int ran = 0;
  static_jobs.Post([&] { ++ran; });
  static_jobs.Wait();
  EXPECT_EQ(ran, 1);
}

}  // namespace
}  // namespace radixkv
