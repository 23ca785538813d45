// EventLoop: sockets, descriptors, signals, timers and cross-thread posts each reach their
// handler, in the documented order, and Stop() ends Run() at the end of the turn.

#include "common/transport/event_loop.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/monotonic_clock.h"
#include "common/base/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait_for.h"
#include "zmq.hpp"

namespace kvcm {
namespace {

using ::kvcm::testing::ThreadSleeps;
using ::kvcm::testing::WaitFor;
using ::testing::ElementsAre;

struct Pipe {
  Pipe() {
    int fds[2];
    EXPECT_EQ(::pipe2(fds, O_CLOEXEC | O_NONBLOCK), 0);
    read_end = UniqueFd(fds[0]);
    write_end = UniqueFd(fds[1]);
  }
  void Put() { EXPECT_EQ(::write(write_end.get(), "x", 1), 1); }
  void Take() {
    char c;
    while (::read(read_end.get(), &c, 1) == 1) {
    }
  }
  UniqueFd read_end;
  UniqueFd write_end;
};

TEST(EventLoopTest, ReadySocketsAndDescriptorsRunInTheOrderTheyWereAdded) {
  zmq::context_t context;
  zmq::socket_t in(context, zmq::socket_type::pair);
  zmq::socket_t out(context, zmq::socket_type::pair);
  in.bind("inproc://event-loop-test");
  out.connect("inproc://event-loop-test");
  Pipe first;
  Pipe idle;

  EventLoop loop;
  ASSERT_THAT(loop.Init(), IsOk());
  std::vector<std::string> calls;
  loop.WatchFd(first.read_end.get(), [&] {
    calls.push_back("pipe");
    first.Take();
  });
  loop.WatchFd(idle.read_end.get(), [&] { calls.push_back("idle pipe"); });
  loop.WatchSocket(in, [&] {
    zmq::message_t message;
    while (in.recv(message, zmq::recv_flags::dontwait)) calls.push_back(message.to_string());
  });
  loop.SetAfterTurn([&] { calls.push_back("after"); });

  out.send(zmq::str_buffer("hello"), zmq::send_flags::none);
  first.Put();
  const absl::Time deadline = MonotonicNow() + absl::Seconds(10);
  while (calls.size() < 3 && MonotonicNow() < deadline) {
    ASSERT_THAT(loop.RunOnce(absl::Seconds(1)), IsOk());
  }
  // Both were ready in one turn (the pipe and the inproc message were there before it).
  EXPECT_THAT(calls, ElementsAre("pipe", "hello", "after"));
}

TEST(EventLoopTest, AWatchCancelledByAnEarlierHandlerIsNotCalledInTheSameTurn) {
  Pipe a;
  Pipe b;
  EventLoop loop;
  ASSERT_THAT(loop.Init(), IsOk());
  int b_calls = 0;
  EventLoop::Id b_id = 0;
  int a_calls = 0;
  loop.WatchFd(a.read_end.get(), [&] {
    ++a_calls;
    a.Take();
    loop.Cancel(b_id);
  });
  b_id = loop.WatchFd(b.read_end.get(), [&] { ++b_calls; });
  a.Put();
  b.Put();
  ASSERT_THAT(loop.RunOnce(absl::Seconds(5)), IsOk());
  // b is readable already, so a live watch would be called at once: the short turn can only
  // miss a wrong call on a slow machine, not report one.
  ASSERT_THAT(loop.RunOnce(absl::Milliseconds(10)), IsOk());
  EXPECT_EQ(a_calls, 1);
  EXPECT_EQ(b_calls, 0);  // b stays readable, but its watch is gone
}

TEST(EventLoopTest, TimersRepeatReportLatenessAndStopWhenCancelled) {
  EventLoop loop;
  ASSERT_THAT(loop.Init(), IsOk());
  std::vector<absl::Duration> lateness;
  EventLoop::Id timer = 0;
  timer = loop.AddTimer(absl::Milliseconds(20), [&](absl::Duration late) {
    lateness.push_back(late);
    if (lateness.size() == 3) loop.Cancel(timer);
  });
  const absl::Time start = MonotonicNow();
  while (lateness.size() < 3 && MonotonicNow() - start < absl::Seconds(10)) {
    ASSERT_THAT(loop.RunOnce(absl::Seconds(1)), IsOk());
  }
  ASSERT_EQ(lateness.size(), 3u);
  // Three periods passed at least, and none of the calls came early.
  EXPECT_GE(MonotonicNow() - start, absl::Milliseconds(60));
  for (absl::Duration late : lateness) EXPECT_GE(late, absl::ZeroDuration());
  // Cancelled: a turn that waits longer than a period calls it no more (a fixed turn, to
  // show that something does not happen: a slow machine cannot make it fail).
  ASSERT_THAT(loop.RunOnce(absl::Milliseconds(50)), IsOk());
  EXPECT_EQ(lateness.size(), 3u);

  // A loop stopped past its due time reports the delay.
  std::vector<absl::Duration> late_once;
  loop.AddTimer(absl::Milliseconds(1), [&](absl::Duration late) { late_once.push_back(late); });
  // The lateness itself, not a wait for a peer; checked one-sided (a longer sleep is later).
  absl::SleepFor(absl::Milliseconds(30));
  ASSERT_THAT(loop.RunOnce(absl::ZeroDuration()), IsOk());
  ASSERT_EQ(late_once.size(), 1u);
  EXPECT_GE(late_once[0], absl::Milliseconds(25));
}

TEST(EventLoopTest, PostFromAnotherThreadWakesALoopWaitingForever) {
  EventLoop loop;
  ASSERT_THAT(loop.Init(), IsOk());
  // The loop's thread, once a turn has called the before-poll hook.
  std::atomic<pid_t> turning{0};
  loop.SetBeforePoll([&] { turning.store(static_cast<pid_t>(::syscall(SYS_gettid))); });
  std::thread::id ran_on;
  std::thread poster([&] {
    // Until the loop waits: its thread, past the hook, asleep in the kernel (in its poll; a
    // post that still came first would be taken by that turn, and the test pass the same way).
    EXPECT_THAT(WaitFor(
                    [&] {
                      const pid_t tid = turning.load();
                      return tid != 0 && ThreadSleeps(tid);
                    },
                    absl::Seconds(60), "the loop to wait in its poll"),
                IsOk());
    loop.Post([&] {
      ran_on = std::this_thread::get_id();
      loop.Stop();
    });
  });
  ASSERT_THAT(loop.Run(), IsOk());  // no watch, no timer: only the post can end it
  poster.join();
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_TRUE(loop.stopped());
}

TEST(EventLoopTest, SignalsArriveThroughTheSignalfdAndStopEndsTheTurn) {
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGUSR1);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &mask, nullptr), 0);
  UniqueFd signal_fd(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK));
  ASSERT_TRUE(signal_fd.valid());

  EventLoop loop;
  ASSERT_THAT(loop.Init(), IsOk());
  std::vector<int> signals;
  bool after_turn = false;
  loop.WatchSignals(signal_fd.get(), [&](int signo) {
    signals.push_back(signo);
    loop.Stop();
  });
  loop.SetAfterTurn([&] { after_turn = true; });
  ASSERT_EQ(::kill(::getpid(), SIGUSR1), 0);
  ASSERT_THAT(loop.Run(), IsOk());
  EXPECT_THAT(signals, ElementsAre(SIGUSR1));
  EXPECT_TRUE(after_turn);  // the turn that stopped still finished
}

// A loop set up on one thread, run on another and torn down on the first: the owner hands
// it over whole, which the thread check allows.
TEST(EventLoopTest, SetUpOnOneThreadRunOnAnotherAndCancelledAfterOnTheFirst) {
  EventLoop loop;
  ASSERT_THAT(loop.Init(), IsOk());
  int turns = 0;
  const EventLoop::Id timer = loop.AddTimer(absl::ZeroDuration(), [&](absl::Duration) {
    if (++turns == 3) loop.Stop();
  });
  std::thread runner([&] { EXPECT_THAT(loop.Run(), IsOk()); });
  runner.join();
  EXPECT_EQ(turns, 3);
  loop.Cancel(timer);
  loop.Post([] {});  // Post is for any thread, running or not
}

// While the loop runs, a loop-only call from another thread is a check failure naming it:
// it would race the loop's own lists (docs/architecture.md, "Processes").
TEST(EventLoopDeathTest, ALoopOnlyCallFromAnotherThreadWhileItRunsIsACheckFailure) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        EventLoop loop;
        if (!loop.Init().ok()) std::abort();
        std::atomic<bool> running = false;
        loop.Post([&] { running = true; });
        std::thread runner([&] { (void)loop.Run(); });
        while (!running) std::this_thread::yield();  // the loop's first turn ran the post
        loop.AddTimer(absl::Seconds(1), [](absl::Duration) {});
        loop.Post([&] { loop.Stop(); });  // without the check, the statement ends here
        runner.join();
      },
      "EventLoop::AddTimer called from a thread other than the one running the loop");
}

}  // namespace
}  // namespace kvcm
