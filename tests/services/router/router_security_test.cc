// kvcm-router's HTTP port against hostile clients (docs/RELIABILITY.md, "Security"), with the
// real stack (cache manager, router, an executor of the tiny model) and raw sockets: bodies
// and header blocks over their limits, prompts over the token limits, and slowloris clients
// that trickle a request's headers byte by byte. Each is refused or dropped, normal
// requests are answered meanwhile with the model's tokens, and the ledger is whole after.
// By default the port is reachable on loopback only.

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/services/router/router_stack.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using namespace ::kvcm::testing;  // NOLINT: the stack's helpers
using RouterSecurityTest = RouterStackTest;

// A TCP connection to the router's HTTP port (url "http://127.0.0.1:PORT"); -1 on failure.
int ConnectTo(const std::string& url) {
  int port = 0;
  if (!absl::SimpleAtoi(url.substr(url.rfind(':') + 1), &port)) return -1;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    ::close(fd);
    return -1;
  }
  timeval timeout{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  return fd;
}

bool SendAll(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n <= 0) return false;
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// Sends `request` on a new connection and returns what comes back until the server closes
// it (or 10 s pass).
std::string Exchange(const std::string& url, const std::string& request) {
  const int fd = ConnectTo(url);
  if (fd < 0) return "connect failed";
  SendAll(fd, request);  // the server may answer and close before the body is all sent
  std::string reply;
  char buffer[4096];
  ssize_t n;
  while ((n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0) reply.append(buffer, n);
  ::close(fd);
  return reply;
}

TEST_F(RouterSecurityTest, OversizedBodiesHeadersAndPromptsAreRefusedAndTheLedgerStaysWhole) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1,
                                     {"--max-request-body-bytes", "4096",
                                      "--max-request-header-bytes", "2048",
                                      "--max-input-tokens", "40", "--max-total-tokens", "60"}));
  // A body over --max-request-body-bytes: 413 once its Content-Length is read.
  const std::string body = json{{"inputs", std::string(8000, 'x')}}.dump();
  const std::string big_body = Exchange(
      url_, absl::StrCat("POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                         "application/json\r\nContent-Length: ",
                         body.size(), "\r\n\r\n", body));
  EXPECT_THAT(big_body, HasSubstr("HTTP/1.1 413")) << big_body.substr(0, 200);
  // Headers over --max-request-header-bytes: refused before any handler runs (libevent 2.1
  // answers 400 and closes the connection).
  const std::string big_headers = Exchange(
      url_, absl::StrCat("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ",
                         std::string(4000, 'a'), "\r\n\r\n"));
  EXPECT_THAT(big_headers, HasSubstr("HTTP/1.1 400")) << big_headers.substr(0, 200);
  // Just under both limits: answered.
  const std::string fits = Exchange(
      url_, absl::StrCat("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                         "X-Pad: ",
                         std::string(1500, 'a'), "\r\n\r\n"));
  EXPECT_THAT(fits, HasSubstr("HTTP/1.1 200")) << fits.substr(0, 200);

  // Prompts over --max-input-tokens and --max-total-tokens: 422 naming the limit, counted.
  const double invalid_before =
      RouterMetric("kvcm_router_requests_total", {{"api", "tgi"}, {"outcome", "invalid"}});
  absl::StatusOr<HttpResponse> long_prompt =
      HttpPost(url_ + "/generate", json{{"inputs", std::string(50, 'x')}}.dump());
  ASSERT_TRUE(long_prompt.ok());
  EXPECT_EQ(long_prompt->status, 422);
  EXPECT_THAT(long_prompt->body, HasSubstr("less than 40 tokens"));
  absl::StatusOr<HttpResponse> too_many_new =
      HttpPost(url_ + "/generate", R"({"inputs": "a", "parameters": {"max_new_tokens": 59}})");
  ASSERT_TRUE(too_many_new.ok());
  EXPECT_EQ(too_many_new->status, 422);
  EXPECT_THAT(too_many_new->body, HasSubstr("must be <= 60"));
  EXPECT_EQ(RouterMetric("kvcm_router_requests_total", {{"api", "tgi"}, {"outcome", "invalid"}}),
            invalid_before + 2);

  const StatsSnapshot stats = Stats();
  EXPECT_EQ(stats.in_use_blocks, 0);
  EXPECT_EQ(stats.live_sequences, 0);
  ExpectWhole(stats);
  absl::StatusOr<HttpResponse> fine = HttpPost(url_ + "/generate", GenerateBody("ok", 3));
  ASSERT_TRUE(fine.ok());
  EXPECT_EQ(fine->status, 200) << fine->body;
  EXPECT_EQ(TokenIds(fine->body), Reference("ok", 3));
}

TEST_F(RouterSecurityTest, SlowlorisConnectionsAreDroppedAtTheRequestDeadlineWhileOthersAreServed) {
  constexpr int kDeadlineMs = 2000;
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1,
                                     {"--http-request-timeout-ms", absl::StrCat(kDeadlineMs)}));
  ASSERT_EQ(RouterMetric("kvcm_router_http_slow_requests_dropped_total"), 0);
  // Slowloris: many connections, each starting a request and then adding a byte every
  // 50 ms, never finishing: half of them to one more header, half (R.U.D.Y.) to a body
  // whose Content-Length they never reach. Each byte restarts libevent's idle timeout
  // (60 s), so only the request deadline can end them.
  constexpr int kSlow = 32;
  std::vector<int> slow;
  for (int i = 0; i < kSlow; ++i) {
    const int fd = ConnectTo(url_);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, i % 2 == 0 ? "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
                                       : "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                         "Content-Type: application/json\r\n"
                                         "Content-Length: 100000\r\n\r\n{\"inputs\": \""));
    slow.push_back(fd);
  }
  const absl::Time start = absl::Now();
  std::vector<absl::Duration> dropped_after(kSlow, absl::InfiniteDuration());
  int open = kSlow;
  int served = 0;
  int tick = 0;
  while (open > 0 && absl::Now() - start < absl::Seconds(30)) {
    for (int i = 0; i < kSlow; ++i) {
      if (dropped_after[i] != absl::InfiniteDuration()) continue;
      char byte;
      const ssize_t got = ::recv(slow[i], &byte, 1, MSG_DONTWAIT);
      const bool closed = got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK) ||
                          got > 0 ||  // libevent sends nothing before it drops; a reply counts
                          !SendAll(slow[i], "a");
      if (closed) {
        dropped_after[i] = absl::Now() - start;
        --open;
      }
    }
    // A normal client is answered all along, with the model's tokens.
    if (++tick % 4 == 0) {
      absl::StatusOr<HttpResponse> reply =
          HttpPost(url_ + "/generate", GenerateBody(absl::StrCat("hi ", served % 3), 2));
      ASSERT_TRUE(reply.ok()) << reply.status();
      ASSERT_EQ(reply->status, 200) << reply->body;
      EXPECT_EQ(TokenIds(reply->body), Reference(absl::StrCat("hi ", served % 3), 2));
      ++served;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  for (int fd : slow) ::close(fd);
  ASSERT_EQ(open, 0) << "slowloris connections still open after 30 s";
  absl::Duration first = absl::InfiniteDuration();
  absl::Duration last = absl::ZeroDuration();
  for (absl::Duration d : dropped_after) {
    first = std::min(first, d);
    last = std::max(last, d);
  }
  std::printf("%d slowloris connections dropped %s to %s after they started (deadline %d ms); "
              "%d requests served meanwhile\n",
              kSlow, absl::FormatDuration(first).c_str(), absl::FormatDuration(last).c_str(),
              kDeadlineMs, served);
  EXPECT_GT(served, 0);
  EXPECT_EQ(RouterMetric("kvcm_router_http_slow_requests_dropped_total"), kSlow);

  // A request sent slowly but whole within the deadline is answered, on a connection that
  // then idles past the deadline before its next request: each request has its own.
  const int fd = ConnectTo(url_);
  ASSERT_GE(fd, 0);
  const std::string request = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  for (size_t i = 0; i < request.size(); i += 8) {
    ASSERT_TRUE(SendAll(fd, request.substr(i, 8)));
    absl::SleepFor(absl::Milliseconds(20));
  }
  auto read_reply = [fd] {
    std::string reply;
    char buffer[4096];
    while (reply.find("\r\n\r\n") == std::string::npos) {
      const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
      if (n <= 0) break;
      reply.append(buffer, n);
    }
    return reply;
  };
  EXPECT_THAT(read_reply(), HasSubstr("HTTP/1.1 200"));
  absl::SleepFor(absl::Milliseconds(kDeadlineMs + 500));
  ASSERT_TRUE(SendAll(fd, request));
  EXPECT_THAT(read_reply(), HasSubstr("HTTP/1.1 200"));
  ::close(fd);
  EXPECT_EQ(RouterMetric("kvcm_router_http_slow_requests_dropped_total"), kSlow);

  const StatsSnapshot stats = Stats();
  EXPECT_EQ(stats.in_use_blocks, 0);
  ExpectWhole(stats);
}

TEST_F(RouterSecurityTest, NoLogOfAStackWithATcpExecutorCarriesTheSecret) {
  // The cache manager also on tcp://, an executor reaching it there with the secret file,
  // one executor without it (refused), and requests through the router.
  CacheManagerOptions options = ManagerOptions(/*num_blocks=*/64, "");
  options.extra_args = {"--tcp-address", "tcp://127.0.0.1:0"};
  auto started = CacheManagerProcess::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  cm_ = std::move(*started);
  auto tcp = cm_->process().WaitForLine(" tcp=(tcp://[0-9.:]+)", absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  const std::string secret_file = cm_->run_dir() + "/tcp-secret";
  const std::string secret(absl::StripAsciiWhitespace(ReadFileOrEmpty(secret_file)));
  ASSERT_GE(secret.size(), 32u);
  ASSERT_NO_FATAL_FAILURE(StartRouter({}));
  ExecutorArgs args;
  args.model = *model_dir_;
  args.run_dir = cm_->run_dir();
  args.router = IpcEndpointIn(cm_->run_dir(), kRouterExecutorsSocket);
  args.name = "exec-tcp";
  args.threads = 1;
  // Over tcp:// instead of the run directory (whose fd channel still passes the memfd).
  auto over_tcp = [&](std::vector<std::string> flags) {
    std::vector<std::string> argv = ExecutorArgv(args);
    const auto run_dir = std::find(argv.begin(), argv.end(), "--run-dir");
    argv.erase(run_dir, run_dir + 2);
    argv.push_back("--cache-manager");
    argv.push_back((*tcp)[1]);
    argv.insert(argv.end(), flags.begin(), flags.end());
    return argv;
  };
  auto log_dir = TempDir::Create("kvcm-sec");
  ASSERT_TRUE(log_dir.ok());
  Subprocess::Options executor;
  executor.argv = over_tcp({"--cache-manager-secret-file", secret_file});
  executor.output_path = log_dir->path() + "/executor";
  auto with_secret = Subprocess::Start(executor);
  ASSERT_TRUE(with_secret.ok()) << with_secret.status();
  auto ready = (*with_secret)->WaitForLine("kvcm-executor: ready", absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(ready.ok()) << ready.status();
  ASSERT_NO_FATAL_FAILURE(AwaitExecutors(1));
  // Without the secret file: refused, saying why.
  args.name = "exec-nosecret";
  auto refused = RunProgram(over_tcp({}), "", absl::Seconds(60));
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_NE(refused->exit_code, 0);
  EXPECT_THAT(refused->output, HasSubstr("tcp-secret")) << refused->output;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<HttpResponse> reply =
        HttpPost(url_ + "/generate", GenerateBody(absl::StrCat("secret ", i), 3));
    ASSERT_TRUE(reply.ok());
    EXPECT_EQ(reply->status, 200) << reply->body;
    EXPECT_EQ(TokenIds(reply->body), Reference(absl::StrCat("secret ", i), 3));
  }
  const std::vector<std::pair<std::string, std::string>> logs = {
      {"cache manager", cm_->Output()},
      {"router", router_->Output()},
      {"executor", (*with_secret)->Output()},
      {"refused executor", refused->output}};
  size_t bytes = 0;
  for (const auto& [who, log] : logs) {
    bytes += log.size();
    EXPECT_EQ(log.find(secret.substr(0, 16)), std::string::npos) << who << "'s log:\n" << log;
  }
  std::printf("%zu bytes of logs searched for the secret\n", bytes);
}

// The first IPv4 address of this machine that is not loopback; "" when it has none.
std::string NonLoopbackAddress() {
  ifaddrs* addresses = nullptr;
  if (::getifaddrs(&addresses) != 0) return "";
  std::string found;
  for (ifaddrs* a = addresses; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    const in_addr address = reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr;
    if ((ntohl(address.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN];
    if (::inet_ntop(AF_INET, &address, text, sizeof(text)) != nullptr) found = text;
  }
  ::freeifaddrs(addresses);
  return found;
}

TEST_F(RouterSecurityTest, TheHttpPortListensOnLoopbackOnlyByDefault) {
  const std::string other = NonLoopbackAddress();
  if (other.empty()) GTEST_SKIP() << "this machine has no address but loopback";
  // No --hostname: the default.
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1));
  const std::string port = url_.substr(url_.rfind(':') + 1);
  ASSERT_EQ(url_, "http://127.0.0.1:" + port);
  EXPECT_THAT(Exchange(url_, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
              HasSubstr("HTTP/1.1 200"));
  // The same port on the machine's other address refuses the connection.
  const std::string elsewhere = absl::StrCat("http://", other, ":", port);
  {
    int port_number = 0;
    ASSERT_TRUE(absl::SimpleAtoi(port, &port_number));
    const int refused_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port_number));
    ASSERT_EQ(::inet_pton(AF_INET, other.c_str(), &address.sin_addr), 1);
    const int rc =
        ::connect(refused_fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address));
    const int error = errno;
    std::printf("connect to %s: %s\n", elsewhere.c_str(),
                rc == 0 ? "accepted" : std::strerror(error));
    EXPECT_NE(rc, 0) << elsewhere << " accepted a connection";
    EXPECT_EQ(error, ECONNREFUSED);
    ::close(refused_fd);
  }
}

}  // namespace
}  // namespace kvcm
