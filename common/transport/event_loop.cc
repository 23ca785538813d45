#include "common/transport/event_loop.h"

#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/base/monotonic_clock.h"

namespace kvcm {

absl::Status EventLoop::Init() {
  if (wake_fd_.valid()) return absl::OkStatus();
  wake_fd_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_.valid()) {
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

void EventLoop::CheckLoopThread(const char* call) const {
  const std::thread::id running = running_on_.load();
  KVCM_CHECK(running == std::thread::id() || running == std::this_thread::get_id())
      << "EventLoop::" << call << " called from a thread other than the one running the loop";
}

bool EventLoop::Bind() {
  std::thread::id expected;
  if (running_on_.compare_exchange_strong(expected, std::this_thread::get_id())) return true;
  KVCM_CHECK(expected == std::this_thread::get_id())
      << "EventLoop run on a second thread while another runs it";
  return false;
}

EventLoop::Id EventLoop::AddWatch(void* socket, int fd, std::function<void()> on_readable) {
  CheckLoopThread("Watch");
  auto watch = std::make_unique<Watch>();
  watch->id = next_id_++;
  watch->socket = socket;
  watch->fd = fd;
  watch->on_readable = std::move(on_readable);
  const Id id = watch->id;
  watches_.push_back(std::move(watch));
  dirty_ = true;
  return id;
}

EventLoop::Id EventLoop::WatchSocket(zmq::socket_t& socket, std::function<void()> on_readable) {
  return AddWatch(socket.handle(), -1, std::move(on_readable));
}

EventLoop::Id EventLoop::WatchFd(int fd, std::function<void()> on_readable) {
  return AddWatch(nullptr, fd, std::move(on_readable));
}

EventLoop::Id EventLoop::WatchSignals(int signal_fd, std::function<void(int)> on_signal) {
  return WatchFd(signal_fd, [signal_fd, on_signal = std::move(on_signal)] {
    signalfd_siginfo info{};
    while (::read(signal_fd, &info, sizeof(info)) == sizeof(info)) {
      on_signal(static_cast<int>(info.ssi_signo));
    }
  });
}

EventLoop::Id EventLoop::AddTimer(absl::Duration period,
                                  std::function<void(absl::Duration)> on_due) {
  CheckLoopThread("AddTimer");
  auto timer = std::make_unique<Timer>();
  timer->id = next_id_++;
  timer->period = period;
  timer->due = MonotonicNow() + period;
  timer->on_due = std::move(on_due);
  const Id id = timer->id;
  timers_.push_back(std::move(timer));
  return id;
}

void EventLoop::Cancel(Id id) {
  CheckLoopThread("Cancel");
  for (auto& watch : watches_) {
    if (watch->id == id && !watch->cancelled) {
      watch->cancelled = true;
      dirty_ = true;
      return;
    }
  }
  for (auto& timer : timers_) {
    if (timer->id == id) {
      timer->cancelled = true;
      dirty_ = true;
      return;
    }
  }
}

void EventLoop::Post(std::function<void()> task) {
  {
    MutexLock lock(&posted_mutex_);
    posted_.push_back(std::move(task));
  }
  Wake();
}

void EventLoop::Wake() {
  const uint64_t one = 1;
  if (wake_fd_.valid()) {
    // EAGAIN only when the counter is already huge: the loop will wake anyway.
    (void)!::write(wake_fd_.get(), &one, sizeof(one));
  }
}

void EventLoop::Compact() {
  std::erase_if(watches_, [](const std::unique_ptr<Watch>& w) { return w->cancelled; });
  std::erase_if(timers_, [](const std::unique_ptr<Timer>& t) { return t->cancelled; });
  items_.clear();
  polled_.clear();
  items_.push_back({nullptr, wake_fd_.get(), ZMQ_POLLIN, 0});
  for (const auto& watch : watches_) {
    items_.push_back({watch->socket, watch->fd, ZMQ_POLLIN, 0});
    polled_.push_back(watch.get());
  }
  dirty_ = false;
}

void EventLoop::RunPosted() {
  {
    MutexLock lock(&posted_mutex_);
    running_.swap(posted_);
  }
  for (auto& task : running_) task();
  running_.clear();
}

absl::Status EventLoop::Run() {
  const bool bound = Bind();
  absl::Cleanup unbind = [this, bound] {
    if (bound) Unbind();
  };
  stopped_ = false;
  while (!stopped_) {
    if (absl::Status turn = RunOnce(absl::InfiniteDuration()); !turn.ok()) return turn;
  }
  return absl::OkStatus();
}

absl::Status EventLoop::RunOnce(absl::Duration max_wait) {
  const bool bound = Bind();
  absl::Cleanup unbind = [this, bound] {
    if (bound) Unbind();
  };
  if (!wake_fd_.valid()) {
    if (absl::Status init = Init(); !init.ok()) return init;
  }
  if (before_poll_) before_poll_();
  if (dirty_) Compact();

  absl::Duration wait = std::min(max_wait, options_.max_wait);
  const absl::Time now = MonotonicNow();
  for (const auto& timer : timers_) {
    if (!timer->cancelled) wait = std::min(wait, timer->due - now);
  }
  {
    MutexLock lock(&posted_mutex_);
    if (!posted_.empty()) wait = absl::ZeroDuration();
  }
  long timeout_ms = -1;
  if (wait != absl::InfiniteDuration()) {
    wait = std::max(wait, absl::ZeroDuration());
    timeout_ms = static_cast<long>(std::min<int64_t>(
        absl::ToInt64Milliseconds(absl::Ceil(wait, absl::Milliseconds(1))), 1 << 30));
  }
  const int rc = zmq_poll(items_.data(), static_cast<int>(items_.size()), timeout_ms);
  if (rc < 0) {
    if (zmq_errno() == EINTR) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("zmq_poll: ", zmq_strerror(zmq_errno())));
  }

  if (items_[0].revents & ZMQ_POLLIN) {
    uint64_t count = 0;
    (void)!::read(wake_fd_.get(), &count, sizeof(count));
  }
  for (size_t i = 0; i < polled_.size(); ++i) {
    Watch* watch = polled_[i];
    if ((items_[i + 1].revents & (ZMQ_POLLIN | ZMQ_POLLERR)) && !watch->cancelled) {
      watch->on_readable();
    }
  }
  RunPosted();
  // By index: a timer's handler may add timers (which are not due yet).
  for (size_t i = 0; i < timers_.size(); ++i) {
    Timer* timer = timers_[i].get();
    const absl::Time at = MonotonicNow();
    if (timer->cancelled || at < timer->due) continue;
    const absl::Duration late = at - timer->due;
    timer->on_due(late);
    timer->due = MonotonicNow() + timer->period;
  }
  if (after_turn_) after_turn_();
  return absl::OkStatus();
}

}  // namespace kvcm
