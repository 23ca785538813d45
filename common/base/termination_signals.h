#pragma once
// How a service's socket thread learns of SIGTERM and SIGINT: through a signalfd it polls
// with its sockets.

#include <signal.h>
#include <sys/signalfd.h>

#include "common/base/unique_fd.h"

namespace kvcm {

// Blocks SIGTERM and SIGINT in the calling thread and returns a signalfd (non-blocking,
// close-on-exec) that delivers them; invalid on failure. Also ignores SIGPIPE, so that a
// peer that vanishes cannot kill the process through a write on its socket.
// REQUIRES: called in main() before any thread starts (ZeroMQ's I/O threads, the metrics
// server, worker pools), so that every thread inherits the mask.
inline UniqueFd BlockTerminationSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return UniqueFd(::signalfd(-1, &signals, SFD_CLOEXEC | SFD_NONBLOCK));
}

}  // namespace kvcm
