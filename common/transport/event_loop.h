#pragma once
// EventLoop: the one poll loop of every kvcm service's socket thread (docs/architecture.md,
// "Processes"): ZeroMQ sockets, plain descriptors (pidfds, a listening Unix socket),
// the termination signalfd, repeating timers on the monotonic clock, and a wake-up other
// threads may use.
//
//   EventLoop loop;
//   KVCM_RETURN_IF_ERROR(loop.Init());
//   loop.WatchSocket(requests, [&] { DrainRequests(); });
//   loop.WatchSignals(signal_fd, [&](int signo) { loop.Stop(); });
//   loop.AddTimer(absl::Milliseconds(500), [&](absl::Duration late) { ExpireLeases(); });
//   KVCM_RETURN_IF_ERROR(loop.Run());  // until Stop()
//
// One turn: the before-poll hook; one zmq_poll over everything watched, for at most the
// time to the nearest timer (or Options::max_wait, or not at all when tasks were posted);
// the handler of each ready watch, in the order they were added; the tasks posted since the
// last turn; every due timer (told how late it is, then due again a period after it ran);
// the after-turn hook. A handler may add or cancel watches and timers, and Stop() the loop:
// Run() returns at the end of that turn. Polling is level-triggered, so a handler that
// leaves input unread is called again at the next turn.
//
// Thread safety: everything but Post() and Wake() must be called on the thread that runs
// the loop; those two may be called from any thread. While Run() or RunOnce() runs, a
// loop-only call from another thread is a KVCM_CHECK failure naming the call (as Envoy's
// dispatcher asserts isThreadSafe()), and so is running the loop on two threads at once;
// before the loop runs and after it returns, its owner may set it up or tear it down from
// any one thread.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/base/mutex.h"
#include "common/base/unique_fd.h"
#include "zmq.hpp"

namespace kvcm {

class EventLoop {
 public:
  using Id = uint64_t;
  struct Options {
    // The longest a turn waits when no timer is due sooner.
    absl::Duration max_wait = absl::InfiniteDuration();
  };

  EventLoop() : EventLoop(Options{}) {}
  explicit EventLoop(Options options) : options_(options) {}
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Creates the wake-up eventfd. INTERNAL if it cannot.
  absl::Status Init();

  // Calls `on_readable` in every turn in which `socket` has a message to read. The socket
  // must outlive the watch.
  Id WatchSocket(zmq::socket_t& socket, std::function<void()> on_readable);
  // Calls `on_readable` in every turn in which `fd` is readable (or hung up).
  Id WatchFd(int fd, std::function<void()> on_readable);
  // Reads each signal the signalfd `signal_fd` delivers and calls `on_signal` with its
  // number (see common/base/termination_signals.h).
  Id WatchSignals(int signal_fd, std::function<void(int signo)> on_signal);
  // Calls `on_due` every `period` (the first time a period from now), with how late the
  // call is against when it was due.
  Id AddTimer(absl::Duration period, std::function<void(absl::Duration late)> on_due);
  // Removes a watch or timer; its handler is not called again (also when cancelled by an
  // earlier handler of the same turn). Unknown ids are ignored.
  void Cancel(Id id);

  void SetBeforePoll(std::function<void()> hook) {
    CheckLoopThread("SetBeforePoll");
    before_poll_ = std::move(hook);
  }
  void SetAfterTurn(std::function<void()> hook) {
    CheckLoopThread("SetAfterTurn");
    after_turn_ = std::move(hook);
  }

  // Runs `task` on the loop's thread in its next turn, and wakes the loop. Thread-safe.
  void Post(std::function<void()> task);
  // Makes a waiting turn return at once. Thread-safe.
  void Wake();

  // Turns until Stop(). INTERNAL when zmq_poll fails (a signal interrupting it is not a
  // failure: the turn simply ends early).
  absl::Status Run();
  // One turn, waiting at most `max_wait` (and at most Options::max_wait).
  absl::Status RunOnce(absl::Duration max_wait);
  // Run() returns at the end of the current turn.
  void Stop() {
    CheckLoopThread("Stop");
    stopped_ = true;
  }
  bool stopped() const { return stopped_; }

 private:
  struct Watch {
    Id id = 0;
    void* socket = nullptr;  // a ZeroMQ socket, or
    int fd = -1;             // a descriptor
    std::function<void()> on_readable;
    bool cancelled = false;
  };
  struct Timer {
    Id id = 0;
    absl::Duration period;
    absl::Time due;
    std::function<void(absl::Duration)> on_due;
    bool cancelled = false;
  };

  // A loop-only call: KVCM_CHECK that no other thread is running the loop.
  void CheckLoopThread(const char* call) const;
  // Binds the loop to the calling thread for a Run() or RunOnce(); true if this call bound
  // it (the outermost), which then unbinds it with Unbind().
  bool Bind();
  void Unbind() { running_on_.store(std::thread::id()); }

  Id AddWatch(void* socket, int fd, std::function<void()> on_readable);
  void Compact();
  void RunPosted();

  const Options options_;
  UniqueFd wake_fd_;
  Id next_id_ = 1;
  // unique_ptr: a handler may add watches while another one's handler runs.
  std::vector<std::unique_ptr<Watch>> watches_;
  std::vector<std::unique_ptr<Timer>> timers_;
  bool dirty_ = true;  // watches or timers changed since items_ was built
  std::vector<zmq::pollitem_t> items_;
  std::vector<Watch*> polled_;  // items_[i + 1] is polled_[i]'s (items_[0]: the wake-up)
  std::function<void()> before_poll_;
  std::function<void()> after_turn_;
  bool stopped_ = false;
  // The thread running the loop while Run() or RunOnce() runs; none otherwise.
  std::atomic<std::thread::id> running_on_{};

  Mutex posted_mutex_;
  std::vector<std::function<void()>> posted_ ABSL_GUARDED_BY(posted_mutex_);
  std::vector<std::function<void()>> running_;
};

}  // namespace kvcm
