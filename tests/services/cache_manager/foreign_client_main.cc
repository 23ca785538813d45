// A client of the cache manager run as another Unix user (cache_manager_security_test.cc
// starts it through setpriv or sudo). It behaves as a hostile peer would, skipping every
// check the client library makes on its own side (who owns the run directory, who serves
// the fd channel): a bare DEALER sends a router's Hello over ipc://, and a bare Unix socket
// asks the fd channel for the shm pool's memfd. It prints what each got.
//
//   foreign_client ipc://RUN_DIR/cache-manager.sock RUN_DIR/pool-fd.sock
//
// Exit status: 0 when both were refused, 1 when either was granted, 2 on bad arguments or
// when the cache manager did not answer at all.

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/transport/zmq_util.h"
#include "common/wire/envelope.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"
#include "zmq.hpp"

namespace {

// 1: a session was granted, 0: refused (printed), -1: no answer.
int TryHello(const std::string& endpoint) {
  zmq::context_t context(1);
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.set(zmq::sockopt::rcvtimeo, 60000);  // a bound: the refusal comes at once
  dealer.connect(endpoint);
  flatbuffers::FlatBufferBuilder b;
  auto name = b.CreateString("foreign");
  auto hello = kvcm::wire::CreateHello(b, kvcm::wire::Role::Router, ::getpid(), name);
  kvcm::FinishEnvelope(b, 1, 0, 0, kvcm::wire::Message::Hello, hello.Union());
  dealer.send(zmq::const_buffer(b.GetBufferPointer(), b.GetSize()), zmq::send_flags::none);
  zmq::message_t reply;
  if (!dealer.recv(reply)) {
    std::printf("hello: no answer within 60 s\n");
    return -1;
  }
  kvcm::AlignFrame(reply);
  const kvcm::VerifiedEnvelope verified = kvcm::VerifyEnvelope(kvcm::FrameBytes(reply));
  if (verified.fault != kvcm::EnvelopeFault::kNone) {
    std::printf("hello: unreadable reply: %s\n", verified.reason.c_str());
    return -1;
  }
  if (const kvcm::wire::ErrorReply* error = verified.envelope->payload_as_ErrorReply()) {
    std::printf("hello: refused %s: %s\n", kvcm::wire::EnumNameErrorCode(error->code()),
                error->reason() != nullptr ? error->reason()->c_str() : "");
    return 0;
  }
  std::printf("hello: granted session %llu\n",
              static_cast<unsigned long long>(verified.envelope->session_id()));
  return 1;
}

// 1: a descriptor came, 0: the connection was refused or closed without one (printed).
int TryPoolFd(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::snprintf(address.sun_path, sizeof(address.sun_path), "%s", path.c_str());
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    std::printf("pool fd: connect refused: %s\n", std::strerror(errno));
    ::close(fd);
    return 0;
  }
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 60000) <= 0) {  // a bound: the close comes at once
    std::printf("pool fd: nothing within 60 s\n");
    ::close(fd);
    return 0;
  }
  char data[64];
  iovec iov{data, sizeof(data)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  msghdr message{};
  message.msg_iov = &iov;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  const ssize_t n = ::recvmsg(fd, &message, MSG_CMSG_CLOEXEC);
  int received = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&message); c != nullptr; c = CMSG_NXTHDR(&message, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) received = 1;
  }
  std::printf("pool fd: %s (%zd bytes read)\n",
              received ? "received a descriptor" : "closed without a descriptor", n);
  ::close(fd);
  return received;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s ENDPOINT FD_CHANNEL\n", argv[0]);
    return 2;
  }
  std::printf("uid %u pid %d\n", static_cast<unsigned>(::geteuid()), static_cast<int>(::getpid()));
  const int hello = TryHello(argv[1]);
  const int pool_fd = TryPoolFd(argv[2]);
  std::fflush(stdout);
  if (hello < 0) return 2;
  return hello == 1 || pool_fd == 1 ? 1 : 0;
}
