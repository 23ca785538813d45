// kvcm-router's HTTP port against hostile clients (docs/RELIABILITY.md, "Security"), with the
// real stack (cache manager, router, an executor of the tiny model) and raw sockets: bodies
// and header blocks over their limits, prompts over the token limits, and slowloris clients
// that trickle a request's headers byte by byte; empty prompts of a model without BOS,
// bodies nested 300,000 levels deep, unsupported values of 500 KB, /tokenize of 1 MB, and
// more silent connections than the router has descriptors. Each is refused or dropped, the
// router stays up (the same process) and answers meanwhile with the model's tokens, and the
// ledger is whole after. By default the port is reachable on loopback only.

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/base/status_macros.h"
#include "common/tokenizer/byte_level.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/services/router/router_stack.h"
#include "tests/support/byte_tokenizer.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait_for.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
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

// The end of a log, for a failure's message.
std::string Tail(const std::string& log) {
  return log.size() <= 3000 ? log : "..." + log.substr(log.size() - 3000);
}

// After a hostile request: the router that answered it is the same process, still running,
// and /health answers 200 on a fresh connection.
::testing::AssertionResult StillServing(const std::string& url, Subprocess& router, pid_t pid) {
  if (router.pid() != pid) return ::testing::AssertionFailure() << "another router process";
  if (std::optional<int> exit_code = router.Poll(); exit_code.has_value()) {
    return ::testing::AssertionFailure() << "the router exited with " << *exit_code << "\n"
                                         << Tail(router.Output());
  }
  absl::StatusOr<HttpResponse> health = HttpGet(url + "/health");
  if (!health.ok()) return ::testing::AssertionFailure() << "/health: " << health.status();
  if (health->status != 200) {
    return ::testing::AssertionFailure() << "/health: " << health->status << " " << health->body;
  }
  return ::testing::AssertionSuccess();
}

// `levels` arrays, each inside the one before: "[[[...]]]".
std::string Nested(int levels) {
  const auto n = static_cast<size_t>(levels);
  return std::string(n, '[') + std::string(n, ']');
}

// The JSON of an error reply; null when it is not an object.
json ErrorOf(const HttpResponse& reply) {
  json error = json::parse(reply.body, nullptr, false);
  return error.is_object() ? error : json(nullptr);
}

// The model of `dir`: the tiny model's weights with a byte-level tokenizer whose prompts get
// no BOS, as SmolLM2's (tests/support/byte_tokenizer.h).
absl::Status MakeModelWithoutBos(const std::string& dir) {
  KVCM_RETURN_IF_ERROR(MakeTinyModel(dir, kModelSeed));
  testing::WriteByteTokenizerWithoutBos(dir);
  return absl::OkStatus();
}

// A TCP connection to the router's port made within `timeout`, or -1 with errno: a server
// that accepts nothing leaves connections in its listen backlog, and once that is full the
// kernel drops their SYNs, so a connect without a timeout would wait for minutes
// (EINPROGRESS after the timeout: SO_SNDTIMEO bounds connect() too).
int ConnectWithin(const std::string& url, absl::Duration timeout) {
  int port = 0;
  if (!absl::SimpleAtoi(url.substr(url.rfind(':') + 1), &port)) return -1;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const timeval limit = absl::ToTimeval(timeout);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    const int error = errno;
    ::close(fd);
    errno = error;
    return -1;
  }
  return fd;
}

TEST_F(RouterSecurityTest, OversizedBodiesHeadersAndPromptsAreRefusedAndTheLedgerStaysWhole) {
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/64, /*executors=*/1,
                 {"--max-request-body-bytes", "4096", "--max-request-header-bytes", "2048",
                  "--max-input-tokens", "40", "--max-total-tokens", "60"}));
  // A body over --max-request-body-bytes: 413 once its Content-Length is read.
  const std::string body = json{{"inputs", std::string(8000, 'x')}}.dump();
  const std::string big_body =
      Exchange(url_, absl::StrCat("POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                  "application/json\r\nContent-Length: ",
                                  body.size(), "\r\n\r\n", body));
  EXPECT_THAT(big_body, HasSubstr("HTTP/1.1 413")) << big_body.substr(0, 200);
  // Headers over --max-request-header-bytes: refused before any handler runs, 431 in the
  // route's shape, and the connection closed.
  const std::string big_headers =
      Exchange(url_, absl::StrCat("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ",
                                  std::string(4000, 'a'), "\r\n\r\n"));
  EXPECT_THAT(big_headers, HasSubstr("HTTP/1.1 431")) << big_headers.substr(0, 200);
  EXPECT_THAT(big_headers, HasSubstr("--max-request-header-bytes")) << big_headers.substr(0, 200);
  // Just under both limits: answered.
  const std::string fits =
      Exchange(url_, absl::StrCat("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                                  "X-Pad: ",
                                  std::string(1500, 'a'), "\r\n\r\n"));
  EXPECT_THAT(fits, HasSubstr("HTTP/1.1 200")) << fits.substr(0, 200);

  // Prompts over --max-input-tokens and --max-total-tokens: 422 naming the limit, counted.
  const double invalid_before =
      RouterMetric("kvcm_router_requests_total", {{"api", "tgi"}, {"outcome", "invalid"}});
  absl::StatusOr<HttpResponse> long_prompt =
      HttpPost(url_ + "/generate", json{{"inputs", std::string(50, 'x')}}.dump());
  ASSERT_THAT(long_prompt, IsOk());
  EXPECT_EQ(long_prompt->status, 422);
  EXPECT_THAT(long_prompt->body, HasSubstr("less than 40 tokens"));
  absl::StatusOr<HttpResponse> too_many_new =
      HttpPost(url_ + "/generate", R"({"inputs": "a", "parameters": {"max_new_tokens": 59}})");
  ASSERT_THAT(too_many_new, IsOk());
  EXPECT_EQ(too_many_new->status, 422);
  EXPECT_THAT(too_many_new->body, HasSubstr("must be <= 60"));
  EXPECT_EQ(RouterMetric("kvcm_router_requests_total", {{"api", "tgi"}, {"outcome", "invalid"}}),
            invalid_before + 2);

  const StatsSnapshot stats = Stats();
  EXPECT_EQ(stats.in_use_blocks, 0);
  EXPECT_EQ(stats.live_sequences, 0);
  ExpectWhole(stats);
  absl::StatusOr<HttpResponse> fine = HttpPost(url_ + "/generate", GenerateBody("ok", 3));
  ASSERT_THAT(fine, IsOk());
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
      ASSERT_THAT(reply, IsOk());
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
  std::printf(
      "%d slowloris connections dropped %s to %s after they started (deadline %d ms); "
      "%d requests served meanwhile\n",
      kSlow, absl::FormatDuration(first).c_str(), absl::FormatDuration(last).c_str(), kDeadlineMs,
      served);
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

  // The served requests' blocks are freed with the router's next step, after their replies.
  EXPECT_TRUE(AwaitNoBlockInUse());
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
  ASSERT_THAT(started, IsOk());
  cm_ = std::move(*started);
  auto tcp = cm_->process().WaitForLine(" tcp=(tcp://[0-9.:]+)", absl::Now() + absl::Seconds(5));
  ASSERT_THAT(tcp, IsOk());
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
  ASSERT_THAT(log_dir, IsOk());
  Subprocess::Options executor;
  executor.argv = over_tcp({"--cache-manager-secret-file", secret_file});
  executor.output_path = log_dir->path() + "/executor";
  auto with_secret = Subprocess::Start(executor);
  ASSERT_THAT(with_secret, IsOk());
  auto ready = (*with_secret)->WaitForLine("kvcm-executor: ready", absl::Now() + absl::Seconds(60));
  ASSERT_THAT(ready, IsOk());
  ASSERT_NO_FATAL_FAILURE(AwaitExecutors(1));
  // Without the secret file: refused, saying why.
  args.name = "exec-nosecret";
  auto refused = RunProgram(over_tcp({}), "", absl::Seconds(60));
  ASSERT_THAT(refused, IsOk());
  EXPECT_NE(refused->exit_code, 0);
  EXPECT_THAT(refused->output, HasSubstr("tcp-secret")) << refused->output;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<HttpResponse> reply =
        HttpPost(url_ + "/generate", GenerateBody(absl::StrCat("secret ", i), 3));
    ASSERT_THAT(reply, IsOk());
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

TEST_F(RouterSecurityTest, AnEmptyPromptIsRefusedAndTheRouterKeepsServing) {
  // Prompts of this model get no BOS: an empty text is a prompt of no tokens, which the
  // planner cannot run (its KVCM_CHECK aborted the router).
  router_model_dir_ = dir_->path() + "/tiny-without-bos";
  ASSERT_THAT(MakeModelWithoutBos(router_model_dir_), IsOk());
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1));
  const pid_t pid = router_->pid();
  absl::StatusOr<HttpResponse> tokenized = HttpPost(url_ + "/tokenize", R"({"inputs": "ok"})");
  ASSERT_THAT(tokenized, IsOk());
  ASSERT_EQ(tokenized->status, 200) << tokenized->body;
  ASSERT_EQ(json::parse(tokenized->body).size(), 2u) << "the tokenizer adds a BOS";

  const double tgi_before =
      RouterMetric("kvcm_router_requests_total", {{"api", "tgi"}, {"outcome", "invalid"}});
  const double openai_before =
      RouterMetric("kvcm_router_requests_total", {{"api", "openai"}, {"outcome", "invalid"}});
  struct Case {
    std::string path;
    std::string body;
  };
  const Case tgi[] = {
      {"/generate", R"({"inputs": ""})"},
      {"/generate_stream", R"({"inputs": "", "parameters": {"max_new_tokens": 2}})"},
      {"/", R"({"inputs": "", "stream": true})"},
      {"/", R"({"inputs": ""})"}};
  for (const Case& c : tgi) {
    SCOPED_TRACE(c.path + " " + c.body);
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + c.path, c.body);
    ASSERT_THAT(reply, IsOk()) << "\n" << Tail(router_->Output());
    EXPECT_EQ(reply->status, 422) << reply->body;
    const json error = ErrorOf(*reply);
    ASSERT_TRUE(error.is_object()) << reply->body;
    EXPECT_EQ(error.value("error_type", ""), "validation");
    EXPECT_THAT(error.value("error", ""), HasSubstr("`inputs` cannot be empty")) << reply->body;
    ASSERT_TRUE(StillServing(url_, *router_, pid));
  }
  const Case openai[] = {{"/v1/completions", R"({"prompt": ""})"},
                         {"/v1/completions", R"({"prompt": [""], "stream": true})"}};
  for (const Case& c : openai) {
    SCOPED_TRACE(c.path + " " + c.body);
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + c.path, c.body);
    ASSERT_THAT(reply, IsOk()) << "\n" << Tail(router_->Output());
    EXPECT_EQ(reply->status, 400) << reply->body;
    const json error = ErrorOf(*reply);
    ASSERT_TRUE(error.is_object() && error.contains("error") && error["error"].is_object())
        << reply->body;
    EXPECT_EQ(error["error"].value("type", ""), "invalid_request_error");
    EXPECT_EQ(error["error"].value("param", ""), "prompt");
    EXPECT_THAT(error["error"].value("message", ""), HasSubstr("`prompt` cannot be empty"));
    ASSERT_TRUE(StillServing(url_, *router_, pid));
  }
  EXPECT_EQ(RouterMetric("kvcm_router_requests_total", {{"api", "tgi"}, {"outcome", "invalid"}}),
            tgi_before + 4);
  EXPECT_EQ(RouterMetric("kvcm_router_requests_total", {{"api", "openai"}, {"outcome", "invalid"}}),
            openai_before + 2);

  // A prompt of two bytes is two tokens, no BOS, and gets the model's tokens for them.
  absl::StatusOr<HttpResponse> fine = HttpPost(url_ + "/generate", GenerateBody("ok", 3));
  ASSERT_THAT(fine, IsOk());
  ASSERT_EQ(fine->status, 200) << fine->body;
  std::vector<int32_t> want = ReferenceGreedy(*model_, {3 + 'o', 3 + 'k'}, 3);
  const std::vector<int32_t>& eos = model_->config().eos_token_ids;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::find(eos.begin(), eos.end(), want[i]) != eos.end()) {
      want.resize(i + 1);
      break;
    }
  }
  EXPECT_EQ(TokenIds(fine->body), want);
  ASSERT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

TEST_F(RouterSecurityTest, ADeeplyNestedBodyIsRefusedOnEveryRouteAndTheRouterKeepsServing) {
  // A chat template, so that a message's extra members reach jinja::FromJson.
  const std::string chat_template = dir_->path() + "/nested-chat.jinja";
  std::ofstream(chat_template) << "{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
                                  "{% endfor %}";
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/64, /*executors=*/1, {"--chat-template", chat_template}));
  const pid_t pid = router_->pid();
  // 300,000 levels, 600 KB: under --max-request-body-bytes. Dumping the value of an
  // unsupported parameter, copying a prompt and converting a message's tool_calls for the
  // template each recursed once per level and overflowed the stack (SIGSEGV).
  const std::string deep = Nested(300000);
  struct Case {
    std::string path;
    std::string body;
    int status;
  };
  const Case cases[] = {
      {"/generate", R"({"inputs": "a", "parameters": {"typical_p": )" + deep + "}}", 422},
      {"/generate_stream", R"({"inputs": "a", "parameters": {"typical_p": )" + deep + "}}", 422},
      {"/", R"({"inputs": "a", "stream": false, "parameters": {"typical_p": )" + deep + "}}", 422},
      {"/tokenize", R"({"inputs": "a", "nested": )" + deep + "}", 422},
      {"/v1/completions", R"({"prompt": "a", "logit_bias": )" + deep + "}", 400},
      {"/v1/completions", R"({"prompt": )" + deep + "}", 400},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "hi", "tool_calls": )" + deep + "}]}", 400},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path + " " + c.body.substr(0, 80));
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + c.path, c.body);
    ASSERT_THAT(reply, IsOk()) << "\n" << Tail(router_->Output());
    EXPECT_EQ(reply->status, c.status) << reply->body.substr(0, 300);
    const json error = ErrorOf(*reply);
    ASSERT_TRUE(error.is_object()) << reply->body.substr(0, 300);
    const std::string message = c.status == 422 ? error.value("error", "")
                                : error.contains("error") && error["error"].is_object()
                                    ? error["error"].value("message", "")
                                    : "";
    EXPECT_THAT(message, HasSubstr("deeper than 64 levels"));
    EXPECT_LT(reply->body.size(), 1024u);
    ASSERT_TRUE(StillServing(url_, *router_, pid));
  }
  // The limit (docs/router.md, "Errors"): 64 levels, the body's own object the first, are
  // served (TGI ignores a member it does not know at the top level); 65 are not.
  const std::string at_limit = R"({"inputs": "ok", "parameters": {"max_new_tokens": 2, )"
                               R"("details": true}, "nested": )" +
                               Nested(63) + "}";
  absl::StatusOr<HttpResponse> served = HttpPost(url_ + "/generate", at_limit);
  ASSERT_THAT(served, IsOk());
  EXPECT_EQ(served->status, 200) << served->body;
  EXPECT_EQ(TokenIds(served->body), Reference("ok", 2));
  const std::string past_limit = R"({"inputs": "ok", "nested": )" + Nested(64) + "}";
  absl::StatusOr<HttpResponse> refused = HttpPost(url_ + "/generate", past_limit);
  ASSERT_THAT(refused, IsOk());
  EXPECT_EQ(refused->status, 422) << refused->body;
  ASSERT_TRUE(StillServing(url_, *router_, pid));
  ExpectWhole(Stats());
}

TEST_F(RouterSecurityTest, AHugeUnsupportedValueIsEchoedAsAShortPrefix) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1));
  const pid_t pid = router_->pid();
  // 500 KB values (and a 500 KB name) made replies of 500 KB: the message names the
  // parameter and echoes the first 64 bytes of what it refuses, then "...".
  const std::string huge(500000, 'x');
  struct Case {
    std::string path;
    std::string body;
    int status;
    std::string says;
  };
  const Case cases[] = {
      {"/generate", json{{"inputs", "a"}, {"parameters", {{"typical_p", huge}}}}.dump(), 422,
       "parameter `typical_p` is not supported by this server (\"" + huge.substr(0, 63) + "...)"},
      {"/v1/completions", json{{"prompt", "a"}, {"logit_bias", huge}}.dump(), 400,
       "parameter `logit_bias` is not supported by this server (\"" + huge.substr(0, 63) + "...)"},
      {"/v1/completions", json{{"prompt", "a"}, {huge, 1}}.dump(), 400,
       "parameter `" + huge.substr(0, 64) + "...` is not supported by this server (1)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path + " " + c.body.substr(0, 80));
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + c.path, c.body);
    ASSERT_THAT(reply, IsOk());
    EXPECT_EQ(reply->status, c.status);
    EXPECT_LT(reply->body.size(), 1024u) << reply->body.substr(0, 300);
    const json error = ErrorOf(*reply);
    ASSERT_TRUE(error.is_object()) << reply->body.substr(0, 300);
    const std::string message = c.status == 422 ? error.value("error", "")
                                : error.contains("error") && error["error"].is_object()
                                    ? error["error"].value("message", "")
                                    : "";
    EXPECT_EQ(message.substr(0, 2 * c.says.size()), c.says);
    ASSERT_TRUE(StillServing(url_, *router_, pid));
  }
}

TEST_F(RouterSecurityTest, TokenizeRefusesAnInputOverMaxInputTokensInsteadOfAnsweringMegabytes) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1,
                                     {"--max-input-tokens", "40", "--max-total-tokens", "60"}));
  const pid_t pid = router_->pid();
  // 39 bytes and BOS: 40 ids, the most a prompt may have.
  absl::StatusOr<HttpResponse> fits =
      HttpPost(url_ + "/tokenize", json{{"inputs", std::string(39, '7')}}.dump());
  ASSERT_THAT(fits, IsOk());
  EXPECT_EQ(fits->status, 200) << fits->body;
  EXPECT_EQ(json::parse(fits->body, nullptr, false).size(), 40u);
  absl::StatusOr<HttpResponse> over =
      HttpPost(url_ + "/tokenize", json{{"inputs", std::string(40, '7')}}.dump());
  ASSERT_THAT(over, IsOk());
  EXPECT_EQ(over->status, 422) << over->body;
  EXPECT_THAT(over->body, HasSubstr("less than 40 tokens. Given: 41"));
  // 1 MB of digits (under --max-request-body-bytes) was a 22 MB reply of one entry per id.
  absl::StatusOr<HttpResponse> huge = HttpPost(
      url_ + "/tokenize", json{{"inputs", std::string(1000000, '7')}}.dump(), absl::Seconds(30));
  ASSERT_THAT(huge, IsOk());
  EXPECT_EQ(huge->status, 422) << huge->body.substr(0, 300);
  EXPECT_LT(huge->body.size(), 1024u);
  const json error = ErrorOf(*huge);
  ASSERT_TRUE(error.is_object()) << huge->body.substr(0, 300);
  EXPECT_EQ(error.value("error_type", ""), "validation");
  EXPECT_THAT(error.value("error", ""), HasSubstr("less than 40 tokens. Given: 1000001"));
  ASSERT_TRUE(StillServing(url_, *router_, pid));
}

TEST_F(RouterSecurityTest, SilentConnectionsPastTheFdLimitAreShedAndExecutorsStillRegister) {
  // 256 descriptors (soft and hard), then twice as many connections that never send a byte.
  // Before, libevent's accept() failed with EMFILE and left the socket readable: the loop
  // spun at 100% CPU logging each failure, and libzmq aborted the router at the next
  // executor's connection.
  constexpr int kLimit = 256;
  constexpr size_t kFlood = 2 * kLimit;
  router_wrapper_ = {"prlimit", absl::StrCat("--nofile=", kLimit, ":", kLimit), "--"};
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1));
  const pid_t pid = router_->pid();
  const size_t log_before = router_->Output().size();

  std::vector<int> silent;
  absl::Cleanup close_silent = [&silent] {
    for (int fd : silent) ::close(fd);
    silent.clear();
  };
  size_t reset_at_connect = 0;  // closed by the router before connect() returned
  for (size_t i = 0; i < kFlood; ++i) {
    const int fd = ConnectWithin(url_, absl::Seconds(30));
    if (fd >= 0) {
      silent.push_back(fd);
    } else if (errno == ECONNRESET) {
      ++reset_at_connect;
    } else {
      break;  // the router took no more in 30 s: the wait below says why
    }
  }
  auto stopped =
      router_->WaitForLine("not accepting HTTP connections", absl::Now() + absl::Seconds(30));
  ASSERT_THAT(stopped, IsOk()) << "\n" << Tail(router_->Output());
  ASSERT_EQ(silent.size() + reset_at_connect, kFlood)
      << "connections the router did not take in 30 s";
  // Those past what the router keeps are closed as they arrive (a reset), not left waiting
  // in the backlog.
  const auto closed_by_router = [](int fd) {
    char byte;
    const ssize_t got = ::recv(fd, &byte, 1, MSG_DONTWAIT);
    return got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  };
  std::vector<bool> closed(silent.size(), false);
  size_t closed_count = reset_at_connect;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (closed_count < kFlood - kLimit && absl::Now() < deadline) {
    for (size_t i = 0; i < silent.size(); ++i) {
      if (!closed[i] && closed_by_router(silent[i])) {
        closed[i] = true;
        ++closed_count;
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::printf("%zu silent connections made, %zu closed by the router as they came\n", kFlood,
              closed_count);
  EXPECT_GE(closed_count, kFlood - kLimit);

  // The descriptors left are enough for an executor to register meanwhile.
  ExecutorArgs args;
  args.model = *model_dir_;
  args.run_dir = cm_->run_dir();
  args.router = IpcEndpointIn(cm_->run_dir(), kRouterExecutorsSocket);
  args.name = "exec-late";
  args.threads = 1;
  absl::StatusOr<ExecutorProcess> late = StartExecutor(args);
  ASSERT_THAT(late, IsOk());
  executors_.push_back(std::move(*late));
  auto registered = router_->WaitForLine(R"(\(exec-late, pid [0-9]+\) registered)",
                                         absl::Now() + absl::Seconds(30));
  ASSERT_THAT(registered, IsOk()) << "\n" << Tail(router_->Output());

  // Once the silent connections go, a fresh connection is served again.
  std::move(close_silent).Invoke();
  const absl::Time served_by = absl::Now() + absl::Seconds(30);
  while (true) {
    absl::StatusOr<HttpResponse> health = HttpGet(url_ + "/health", absl::Seconds(2));
    if (health.ok() && health->status == 200) break;
    ASSERT_LT(absl::Now(), served_by) << Tail(router_->Output());
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_THAT(
      router_->WaitForLine("accepting HTTP connections again", absl::Now() + absl::Seconds(30)),
      IsOk());
  ASSERT_TRUE(StillServing(url_, *router_, pid));
  ASSERT_NO_FATAL_FAILURE(AwaitExecutors(2));
  EXPECT_GE(RouterMetric("kvcm_router_http_connections_shed_total"), kFlood - kLimit);
  // No spinning: the flood added a few lines to the log (stopped, the executor, accepting
  // again), where each failed accept() logged one before.
  const size_t log_growth = router_->Output().size() - log_before;
  std::printf("the router's log grew by %zu bytes\n", log_growth);
  EXPECT_LT(log_growth, 4096u) << Tail(router_->Output());

  absl::StatusOr<HttpResponse> fine = HttpPost(url_ + "/generate", GenerateBody("after", 3));
  ASSERT_THAT(fine, IsOk());
  EXPECT_EQ(fine->status, 200) << fine->body;
  EXPECT_EQ(TokenIds(fine->body), Reference("after", 3));
  ASSERT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

// A POST of `body` to `path`, framed by Content-Length, as raw bytes.
std::string RawPost(const std::string& path, const std::string& body,
                    const std::string& extra_headers = "") {
  return absl::StrCat("POST ", path,
                      " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: ", "application/json\r\n",
                      extra_headers, "Content-Length: ", body.size(), "\r\n\r\n", body);
}

// One reply of a keep-alive connection, framed by its Content-Length ("" if it broke off).
std::string ReadOneReply(int fd) {
  std::string reply;
  char buffer[4096];
  while (true) {
    const size_t head_end = reply.find("\r\n\r\n");
    if (head_end != std::string::npos) {
      const std::string head = absl::AsciiStrToLower(reply.substr(0, head_end));
      const size_t at = head.find("content-length: ");
      size_t length = 0;
      if (at == std::string::npos ||
          !absl::SimpleAtoi(head.substr(at + 16, head.find("\r\n", at) - at - 16), &length)) {
        return reply;
      }
      if (reply.size() >= head_end + 4 + length) return reply;
    }
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) return reply;
    reply.append(buffer, static_cast<size_t>(n));
  }
}

// The headers of a raw reply ("HTTP/1.1 ..." up to the blank line), lower-cased.
std::string HeadOf(const std::string& reply) {
  return absl::AsciiStrToLower(reply.substr(0, reply.find("\r\n\r\n")));
}

// A chat template at `path` that renders "role: content" lines.
void WriteChatTemplate(const std::string& path) {
  std::ofstream(path) << "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
}

// The OpenAI error object of a reply; null when the reply has none.
json OpenAiErrorOf(const HttpResponse& reply) {
  const json error = ErrorOf(reply);
  return error.is_object() && error.contains("error") && error["error"].is_object() ? error["error"]
                                                                                    : json(nullptr);
}

TEST_F(RouterSecurityTest, UnstreamedRequestsWhoseClientsLeaveAreCancelledAndFreeTheirBlocks) {
  // Slow steps (5 ms a layer): 400 tokens take seconds. Before, libevent read nothing from a
  // connection whose request had arrived, so an unstreamed request (which writes nothing
  // until its reply) ran to its last token after its client closed: a client could fill
  // the batch and the pool and leave.
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/1024, /*executors=*/1, {}, {"--fault-layer-delay-ms", "5"}));
  const pid_t pid = router_->pid();
  const MetricLabels tgi_cancelled = {{"api", "tgi"}, {"outcome", "cancelled"}};
  const MetricLabels openai_cancelled = {{"api", "openai"}, {"outcome", "cancelled"}};
  const MetricLabels tgi_ok = {{"api", "tgi"}, {"outcome", "ok"}};
  const MetricLabels openai_ok = {{"api", "openai"}, {"outcome", "ok"}};
  const double tgi_cancelled_before = RouterMetric("kvcm_router_requests_total", tgi_cancelled);
  const double openai_cancelled_before =
      RouterMetric("kvcm_router_requests_total", openai_cancelled);
  const double ok_before = RouterMetric("kvcm_router_requests_total", tgi_ok) +
                           RouterMetric("kvcm_router_requests_total", openai_ok);
  constexpr int kTokens = 400;
  const std::vector<std::string> requests = {
      RawPost("/generate", GenerateBody("leave one", kTokens)),
      RawPost("/generate", GenerateBody("leave two", kTokens)),
      RawPost("/", json{{"inputs", "leave three"},
                        {"stream", false},
                        {"parameters", {{"max_new_tokens", kTokens}}}}
                       .dump()),
      RawPost("/v1/completions",
              json{{"prompt", "leave four"}, {"max_tokens", kTokens}, {"temperature", 0}}.dump()),
      RawPost("/v1/completions",
              json{{"prompt", "leave five"}, {"max_tokens", kTokens}, {"temperature", 0}}.dump()),
  };
  std::vector<int> clients;
  absl::Cleanup close_clients = [&clients] {
    for (int fd : clients) ::close(fd);
  };
  for (const std::string& request : requests) {
    const int fd = ConnectTo(url_);
    ASSERT_GE(fd, 0);
    clients.push_back(fd);
    ASSERT_TRUE(SendAll(fd, request));
  }
  // Every one generating, holding blocks.
  ASSERT_THAT(WaitFor([&] { return RouterMetric("kvcm_router_running_sequences") == 5; },
                      absl::Seconds(20), "the five requests to run"),
              IsOk())
      << Tail(router_->Output());
  EXPECT_GT(Stats().in_use_blocks, 0);
  const double generated_at_close = RouterMetric("kvcm_router_generated_tokens_total");
  std::move(close_clients).Invoke();
  // Cancelled as a stream's client that leaves is: counted, their sequences freed at the
  // next step, long before their last token.
  const absl::Status counted = WaitFor(
      [&] {
        return RouterMetric("kvcm_router_requests_total", tgi_cancelled) ==
                   tgi_cancelled_before + 3 &&
               RouterMetric("kvcm_router_requests_total", openai_cancelled) ==
                   openai_cancelled_before + 2;
      },
      absl::Seconds(10), "the five requests to be counted cancelled");
  EXPECT_THAT(counted, IsOk()) << "\n" << Tail(router_->Output());
  EXPECT_TRUE(AwaitNoBlockInUse()) << Tail(router_->Output());
  EXPECT_EQ(RouterMetric("kvcm_router_running_sequences"), 0);
  EXPECT_EQ(RouterMetric("kvcm_router_requests_total", tgi_ok) +
                RouterMetric("kvcm_router_requests_total", openai_ok),
            ok_before);
  const double generated = RouterMetric("kvcm_router_generated_tokens_total");
  std::printf("%.0f tokens generated when the clients left, %.0f in all (of %d asked)\n",
              generated_at_close, generated, 5 * kTokens);
  EXPECT_LT(generated, 5 * kTokens / 2);
  EXPECT_THAT(router_->Output(), HasSubstr("the client went away; cancelled"));
  ExpectWhole(Stats());
  ASSERT_TRUE(StillServing(url_, *router_, pid));
  // A keep-alive client that sends its next request only after the reply is not taken for
  // one that left.
  const int fd = ConnectTo(url_);
  ASSERT_GE(fd, 0);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(SendAll(fd, RawPost("/generate", GenerateBody("stay", 3))));
    const std::string reply = ReadOneReply(fd);
    EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << reply;
    EXPECT_EQ(TokenIds(reply.substr(reply.find("\r\n\r\n") + 4)), Reference("stay", 3));
  }
  ::close(fd);
}

TEST_F(RouterSecurityTest, ATinyTemperatureGivesFiniteLogprobsOnEveryApi) {
  // temperature 1e-40 divided the logits by a denormal: every token but the most likely had
  // a log-probability of -inf, written as null where the OpenAPI document promises a
  // number. Such a temperature is greedy now, and a -inf anyway reads -9999.
  const std::string chat_template = dir_->path() + "/tiny-temperature-chat.jinja";
  WriteChatTemplate(chat_template);
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/64, /*executors=*/1, {"--chat-template", chat_template}));
  const pid_t pid = router_->pid();
  size_t checked = 0;
  auto finite = [&checked](const json& value, const std::string& where) {
    ++checked;
    EXPECT_TRUE(value.is_number()) << where << ": " << value.dump();
    if (value.is_number()) {
      EXPECT_GE(value.get<double>(), -9999.0) << where;
      EXPECT_LE(value.get<double>(), 0.0) << where;
    }
  };

  // TGI, with details and top tokens: the greedy tokens.
  absl::StatusOr<HttpResponse> tgi = HttpPost(url_ + "/generate", json{{"inputs", "ok"},
                                                                       {"parameters",
                                                                        {{"max_new_tokens", 4},
                                                                         {"details", true},
                                                                         {"do_sample", true},
                                                                         {"temperature", 1e-40},
                                                                         {"top_n_tokens", 5}}}}
                                                                      .dump());
  ASSERT_THAT(tgi, IsOk());
  ASSERT_EQ(tgi->status, 200) << tgi->body;
  EXPECT_EQ(TokenIds(tgi->body), Reference("ok", 4));
  const json details = json::parse(tgi->body)["details"];
  for (const json& token : details["tokens"]) finite(token["logprob"], "tgi token");
  for (const json& top : details["top_tokens"]) {
    EXPECT_EQ(top.size(), 5u);
    for (const json& token : top) finite(token["logprob"], "tgi top token");
  }
  ASSERT_TRUE(StillServing(url_, *router_, pid));

  // TGI streamed: each event's token and top tokens.
  absl::StatusOr<HttpResponse> stream =
      HttpPost(url_ + "/generate_stream", json{{"inputs", "ok"},
                                               {"parameters",
                                                {{"max_new_tokens", 4},
                                                 {"do_sample", true},
                                                 {"temperature", 1e-40},
                                                 {"top_n_tokens", 5}}}}
                                              .dump());
  ASSERT_THAT(stream, IsOk());
  ASSERT_EQ(stream->status, 200) << stream->body;
  for (absl::string_view line : absl::StrSplit(stream->body, '\n')) {
    if (!absl::ConsumePrefix(&line, "data:")) continue;
    const json event = json::parse(std::string(line), nullptr, false);
    ASSERT_FALSE(event.is_discarded()) << line;
    finite(event["token"]["logprob"], "tgi stream token");
    for (const json& token : event["top_tokens"]) finite(token["logprob"], "tgi stream top");
  }
  ASSERT_TRUE(StillServing(url_, *router_, pid));

  // OpenAI completions: token_logprobs and top_logprobs.
  absl::StatusOr<HttpResponse> completion = HttpPost(
      url_ + "/v1/completions",
      json{{"prompt", "ok"}, {"max_tokens", 4}, {"temperature", 1e-40}, {"logprobs", 5}}.dump());
  ASSERT_THAT(completion, IsOk());
  ASSERT_EQ(completion->status, 200) << completion->body;
  const json logprobs = json::parse(completion->body)["choices"][0]["logprobs"];
  for (const json& value : logprobs["token_logprobs"]) finite(value, "completion token");
  for (const json& top : logprobs["top_logprobs"]) {
    EXPECT_EQ(top.size(), 5u);
    for (const auto& [token, value] : top.items()) finite(value, "completion top " + token);
  }
  ASSERT_TRUE(StillServing(url_, *router_, pid));

  // OpenAI chat: content[].logprob and its top_logprobs.
  absl::StatusOr<HttpResponse> chat = HttpPost(
      url_ + "/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", "ok"}}}},
                                          {"max_tokens", 4},
                                          {"temperature", 1e-40},
                                          {"logprobs", true},
                                          {"top_logprobs", 5}}
                                         .dump());
  ASSERT_THAT(chat, IsOk());
  ASSERT_EQ(chat->status, 200) << chat->body;
  // The parsed reply lives in a variable: a range-for over a member of a temporary reads
  // freed memory (ASan found it).
  const json chat_reply = json::parse(chat->body);
  for (const json& entry : chat_reply["choices"][0]["logprobs"]["content"]) {
    finite(entry["logprob"], "chat token");
    EXPECT_EQ(entry["top_logprobs"].size(), 5u);
    for (const json& top : entry["top_logprobs"]) finite(top["logprob"], "chat top token");
  }
  std::printf("%zu log-probabilities checked\n", checked);
  EXPECT_GT(checked, 20u);
  ASSERT_TRUE(StillServing(url_, *router_, pid));
}

TEST_F(RouterSecurityTest, BestOfGivenBelowNIsRefusedInsteadOfAnsweringNChoices) {
  const std::string chat_template = dir_->path() + "/best-of-chat.jinja";
  WriteChatTemplate(chat_template);
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/64, /*executors=*/1, {"--chat-template", chat_template}));
  const pid_t pid = router_->pid();
  // n = 2 with best_of = 1 was answered with two choices; best_of given is at least n.
  const json completion = {{"prompt", "a"}, {"max_tokens", 2}, {"temperature", 0.5}};
  const json chat = {{"messages", {{{"role", "user"}, {"content", "a"}}}},
                     {"max_tokens", 2},
                     {"temperature", 0.5}};
  for (const auto& [path, base] : {std::pair<std::string, json>{"/v1/completions", completion},
                                   std::pair<std::string, json>{"/v1/chat/completions", chat}}) {
    SCOPED_TRACE(path);
    json refused = base;
    refused["n"] = 2;
    refused["best_of"] = 1;
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + path, refused.dump());
    ASSERT_THAT(reply, IsOk());
    EXPECT_EQ(reply->status, 400) << reply->body;
    const json error = OpenAiErrorOf(*reply);
    ASSERT_TRUE(error.is_object()) << reply->body;
    EXPECT_EQ(error.value("param", ""), "best_of");
    EXPECT_THAT(error.value("message", ""), HasSubstr("`best_of` must be at least `n`"));
    ASSERT_TRUE(StillServing(url_, *router_, pid));
    // Without best_of, or with it at n or more: n choices.
    for (const json& best_of : {json(nullptr), json(2), json(3)}) {
      json served = base;
      served["n"] = 2;
      if (!best_of.is_null()) served["best_of"] = best_of;
      absl::StatusOr<HttpResponse> ok = HttpPost(url_ + path, served.dump());
      ASSERT_THAT(ok, IsOk());
      ASSERT_EQ(ok->status, 200) << ok->body;
      EXPECT_EQ(json::parse(ok->body)["choices"].size(), 2u) << ok->body;
    }
  }
}

TEST_F(RouterSecurityTest, AnEmptyStopStringIsRefusedByBothApis) {
  const std::string chat_template = dir_->path() + "/stop-chat.jinja";
  WriteChatTemplate(chat_template);
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/64, /*executors=*/1, {"--chat-template", chat_template}));
  const pid_t pid = router_->pid();
  // OpenAI's routes dropped an empty stop string silently; TGI's refused it. One rule: 422
  // (OpenAI: 400) naming `stop`.
  struct Case {
    std::string path;
    json body;
  };
  const Case cases[] = {
      {"/generate", {{"inputs", "a"}, {"parameters", {{"stop", {""}}}}}},
      {"/generate", {{"inputs", "a"}, {"parameters", {{"stop", {"x", ""}}}}}},
      {"/v1/completions", {{"prompt", "a"}, {"stop", {""}}}},
      {"/v1/completions", {{"prompt", "a"}, {"stop", ""}}},
      {"/v1/chat/completions",
       {{"messages", {{{"role", "user"}, {"content", "a"}}}}, {"stop", {"x", ""}}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path + " " + c.body.dump());
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + c.path, c.body.dump());
    ASSERT_THAT(reply, IsOk());
    if (c.path == "/generate") {
      EXPECT_EQ(reply->status, 422) << reply->body;
      EXPECT_THAT(ErrorOf(*reply).value("error", ""), HasSubstr("`stop`"));
    } else {
      EXPECT_EQ(reply->status, 400) << reply->body;
      const json error = OpenAiErrorOf(*reply);
      ASSERT_TRUE(error.is_object()) << reply->body;
      EXPECT_EQ(error.value("param", ""), "stop");
      EXPECT_THAT(error.value("message", ""), HasSubstr("empty"));
    }
    ASSERT_TRUE(StillServing(url_, *router_, pid));
  }
  // A non-empty stop string is served on both.
  absl::StatusOr<HttpResponse> served = HttpPost(
      url_ + "/v1/completions",
      json{{"prompt", "a"}, {"stop", {"zz"}}, {"max_tokens", 2}, {"temperature", 0}}.dump());
  ASSERT_THAT(served, IsOk());
  EXPECT_EQ(served->status, 200) << served->body;
}

TEST_F(RouterSecurityTest, MaxCompletionTokensWinsOverMaxTokensInChat) {
  const std::string chat_template = dir_->path() + "/max-chat.jinja";
  WriteChatTemplate(chat_template);
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/64, /*executors=*/1, {"--chat-template", chat_template}));
  // The prompt as the template renders it, without BOS: its greedy tokens must not end
  // before 7, or the lengths below say nothing.
  std::vector<int32_t> prompt;
  for (unsigned char c : std::string("user: count\n")) prompt.push_back(3 + c);
  const std::vector<int32_t> greedy = ReferenceGreedy(*model_, prompt, 7);
  const std::vector<int32_t>& eos = model_->config().eos_token_ids;
  for (int32_t token : greedy) {
    ASSERT_EQ(std::find(eos.begin(), eos.end(), token), eos.end())
        << "the tiny model ends this prompt early: pick another";
  }
  // max_tokens is deprecated in chat for max_completion_tokens: given both, OpenAI and
  // vLLM take max_completion_tokens; kvcm took whichever it read last (max_tokens).
  for (const auto& [max_tokens, max_completion_tokens] :
       {std::pair<int, int>{7, 3}, std::pair<int, int>{3, 7}}) {
    SCOPED_TRACE(absl::StrCat(max_tokens, " ", max_completion_tokens));
    absl::StatusOr<HttpResponse> reply =
        HttpPost(url_ + "/v1/chat/completions",
                 json{{"messages", {{{"role", "user"}, {"content", "count"}}}},
                      {"temperature", 0},
                      {"max_tokens", max_tokens},
                      {"max_completion_tokens", max_completion_tokens}}
                     .dump());
    ASSERT_THAT(reply, IsOk());
    ASSERT_EQ(reply->status, 200) << reply->body;
    const json body = json::parse(reply->body);
    EXPECT_EQ(body["usage"]["completion_tokens"], max_completion_tokens) << reply->body;
    EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  }
}

TEST_F(RouterSecurityTest, HealthNamesNoContentTypeForItsEmptyBody) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1));
  // libevent's default type, "text/html; charset=ISO-8859-1", went on /health's empty 200.
  const std::string reply =
      Exchange(url_, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  EXPECT_THAT(reply, HasSubstr("HTTP/1.1 200")) << reply;
  EXPECT_THAT(HeadOf(reply), HasSubstr("content-length: 0")) << reply;
  EXPECT_THAT(HeadOf(reply), Not(HasSubstr("content-type"))) << reply;
  // Every reply with a body names its own.
  const std::string info =
      Exchange(url_, "GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  EXPECT_THAT(HeadOf(info), HasSubstr("content-type: application/json")) << info;
}

TEST_F(RouterSecurityTest, OpenAiPathsAnswerOpenAiErrorsAndTheModelByItsId) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1));
  const pid_t pid = router_->pid();
  absl::StatusOr<HttpResponse> models = HttpGet(url_ + "/v1/models");
  ASSERT_THAT(models, IsOk());
  ASSERT_EQ(models->status, 200) << models->body;
  const json listed = json::parse(models->body)["data"][0];
  const std::string id = listed["id"].get<std::string>();
  // The official client's models.retrieve(id): GET /v1/models/{id}, the entry the list has.
  absl::StatusOr<HttpResponse> model = HttpGet(url_ + "/v1/models/" + id);
  ASSERT_THAT(model, IsOk());
  ASSERT_EQ(model->status, 200) << model->body;
  EXPECT_EQ(json::parse(model->body), listed);
  // Percent-encoded, as a client encodes an id.
  std::string encoded;
  for (unsigned char c : id) absl::StrAppend(&encoded, "%", absl::Hex(c, absl::kZeroPad2));
  absl::StatusOr<HttpResponse> model_encoded = HttpGet(url_ + "/v1/models/" + encoded);
  ASSERT_THAT(model_encoded, IsOk());
  EXPECT_EQ(model_encoded->status, 200) << model_encoded->body;
  // Another id, another path under /v1/, and another method: OpenAI's shape (they came in
  // TGI's, {"error": "no route ..."}, which the openai client cannot read).
  for (const auto& [method, path, status] :
       {std::tuple<std::string, std::string, int>{"GET", "/v1/models/gpt-4o", 404},
        {"GET", "/v1/models/org/other-model", 404},
        {"GET", "/v1/embeddings", 404},
        {"POST", "/v1/responses", 404},
        {"POST", "/v1/models/" + id, 405}}) {
    SCOPED_TRACE(method + " " + path);
    absl::StatusOr<HttpResponse> reply =
        HttpRequest(method, url_ + path, method == "POST" ? "{}" : "", absl::Seconds(10));
    ASSERT_THAT(reply, IsOk());
    EXPECT_EQ(reply->status, status) << reply->body;
    const json error = OpenAiErrorOf(*reply);
    ASSERT_TRUE(error.is_object()) << reply->body;
    EXPECT_EQ(error.value("type", ""), "invalid_request_error");
    EXPECT_FALSE(error.value("message", "").empty());
    EXPECT_TRUE(error.contains("param") && error.contains("code")) << reply->body;
    ASSERT_TRUE(StillServing(url_, *router_, pid));
  }
  // Elsewhere, TGI's shape.
  absl::StatusOr<HttpResponse> tgi = HttpGet(url_ + "/no/such/route");
  ASSERT_THAT(tgi, IsOk());
  EXPECT_EQ(tgi->status, 404);
  EXPECT_EQ(ErrorOf(*tgi).value("error_type", ""), "validation") << tgi->body;
}

TEST_F(RouterSecurityTest, AmbiguousFramingIsRefusedWith400AndNothingAfterItIsRead) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1));
  const pid_t pid = router_->pid();
  // RFC 9112 wants 400 for each; libevent took the first Content-Length, read "+48" as 48,
  // and took "Transfer-Encoding : chunked" (a space before the colon) for another header,
  // framing by Content-Length. A proxy in front reading the other framing sees another
  // request where the router sees a body (request smuggling). Each is answered 400 in the
  // route's API's shape, and its connection closed: one reply, whatever follows unread.
  const std::string body = GenerateBody("frame", 2);
  const std::string smuggled = "GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  const std::string chunked = absl::StrCat(absl::Hex(body.size()), "\r\n", body, "\r\n0\r\n\r\n");
  struct Case {
    std::string what;
    std::string request;
    bool openai = false;  // the route's API, whose error shape the 400 has
  };
  const std::string head =
      "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n";
  const Case cases[] = {
      {"two Content-Lengths, the first the body's",
       absl::StrCat(head, "Content-Length: ", body.size(), "\r\nContent-Length: ",
                    body.size() + smuggled.size(), "\r\n\r\n", body, smuggled)},
      {"two Content-Lengths, the first the body's and what follows",
       absl::StrCat(head, "Content-Length: ", body.size() + smuggled.size(),
                    "\r\nContent-Length: ", body.size(), "\r\n\r\n", body, smuggled)},
      {"Transfer-Encoding with a space before its colon",
       absl::StrCat(head, "Transfer-Encoding : chunked\r\nContent-Length: ", chunked.size(),
                    "\r\n\r\n", chunked)},
      {"Content-Length: +N",
       absl::StrCat(head, "Content-Length: +", body.size(), "\r\n\r\n", body)},
      {"Content-Length: -0", absl::StrCat(head, "Content-Length: -0\r\n\r\n", smuggled)},
      {"Transfer-Encoding with Content-Length",
       absl::StrCat(head, "Transfer-Encoding: chunked\r\nContent-Length: ", chunked.size(),
                    "\r\n\r\n", chunked)},
      {"Transfer-Encoding twice",
       absl::StrCat(head, "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
                    chunked)},
      {"a HEAD request with a body", absl::StrCat("HEAD /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                                  "Content-Length: ",
                                                  smuggled.size(), "\r\n\r\n", smuggled)},
      {"a header name with a tab before its colon",
       absl::StrCat(head, "Content-Length\t: 5\r\nContent-Length: ", body.size(), "\r\n\r\n",
                    body)},
      {"two Content-Lengths on an OpenAI route",
       absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
                    "Content-Length: 3\r\n\r\n{}"),
       /*openai=*/true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string reply = Exchange(url_, c.request);
    EXPECT_EQ(reply.rfind("HTTP/1.1 400", 0), 0u) << reply.substr(0, 300);
    size_t replies = 0;
    for (size_t at = reply.find("HTTP/1.1 "); at != std::string::npos;
         at = reply.find("HTTP/1.1 ", at + 1)) {
      ++replies;
    }
    EXPECT_EQ(replies, 1u) << "nothing after the refused request is read: " << reply;
    const size_t split = reply.find("\r\n\r\n");
    ASSERT_NE(split, std::string::npos) << reply;
    EXPECT_THAT(HeadOf(reply), HasSubstr("connection: close"));
    const json error = json::parse(reply.substr(split + 4), nullptr, false);
    ASSERT_TRUE(error.is_object()) << reply;
    const std::string message =
        c.openai ? error["error"].value("message", "") : error.value("error", "");
    EXPECT_THAT(message, HasSubstr("ambiguous framing")) << reply;
    ASSERT_TRUE(StillServing(url_, *router_, pid));
  }
  // What RFC 9112 allows is served: chunked alone, and the same Content-Length twice.
  const std::string fine_chunked = Exchange(
      url_, absl::StrCat(head, "Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n", chunked));
  EXPECT_EQ(fine_chunked.rfind("HTTP/1.1 200", 0), 0u) << fine_chunked;
  const std::string fine_twice =
      Exchange(url_, absl::StrCat(head, "Connection: close\r\nContent-Length: ", body.size(),
                                  "\r\nContent-Length: ", body.size(), "\r\n\r\n", body));
  EXPECT_EQ(fine_twice.rfind("HTTP/1.1 200", 0), 0u) << fine_twice;
  ExpectWhole(Stats());
}

// The JSON error of a raw reply in `api`'s shape: its message, or "" when it has none.
std::string RawErrorMessage(const std::string& reply, bool openai) {
  const size_t split = reply.find("\r\n\r\n");
  if (split == std::string::npos) return "";
  const json error = json::parse(reply.substr(split + 4), nullptr, false);
  if (!error.is_object()) return "";
  if (openai) {
    return error.contains("error") && error["error"].is_object()
               ? error["error"].value("message", "")
               : "";
  }
  return error.value("error", "");
}

TEST_F(RouterSecurityTest, BodiesOverTheLimitAndMalformedChunksAreAnsweredInTheRoutesShape) {
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/64, /*executors=*/1, {"--max-request-body-bytes", "4096"}));
  const pid_t pid = router_->pid();
  // libevent 2.1 answered these itself, with its HTML page, before any function of the
  // router's ran: a body over the limit 413, every malformed chunked body and even a legal
  // chunk extension 413 "Request Entity Too Large". The router frames each request before
  // libevent reads it (docs/router.md, "Framing") and answers in the route's API's shape.
  struct Case {
    std::string what;
    std::string body_framing;  // the head's framing header and what follows the head
    int status;
    std::string message;
  };
  const std::string big = std::string(5000, 'x');
  const Case cases[] = {
      {"a Content-Length over the limit, headers only", "Content-Length: 4097\r\n\r\n", 413,
       "--max-request-body-bytes"},
      {"a Content-Length over the limit with its body",
       absl::StrCat("Content-Length: ", big.size(), "\r\n\r\n", big), 413,
       "--max-request-body-bytes"},
      {"chunks over the limit",
       absl::StrCat("Transfer-Encoding: chunked\r\n\r\n", absl::Hex(big.size()), "\r\n", big,
                    "\r\n0\r\n\r\n"),
       413, "--max-request-body-bytes"},
      {"a chunk size that is not hexadecimal",
       "Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", 400, "malformed chunked body"},
      {"chunk data without its CRLF", "Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXY0\r\n\r\n",
       400, "malformed chunked body"},
  };
  for (const std::string path : {"/generate", "/v1/completions"}) {
    const bool openai = path != "/generate";
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat(path, ": ", c.what));
      const std::string reply = Exchange(
          url_, absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: ",
                             "application/json\r\n", c.body_framing));
      EXPECT_EQ(reply.rfind(absl::StrCat("HTTP/1.1 ", c.status), 0), 0u) << reply.substr(0, 300);
      EXPECT_THAT(HeadOf(reply), HasSubstr("content-type: application/json"))
          << reply.substr(0, 300);
      EXPECT_THAT(HeadOf(reply), HasSubstr("connection: close")) << reply.substr(0, 300);
      EXPECT_THAT(RawErrorMessage(reply, openai), HasSubstr(c.message)) << reply.substr(0, 300);
      ASSERT_TRUE(StillServing(url_, *router_, pid));
    }
  }
  // A chunk extension is legal (RFC 9112, 7.1.1): read and left out, and the request served.
  const std::string body = GenerateBody("ext", 3);
  const std::string extended = Exchange(
      url_, absl::StrCat("POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                         "application/json\r\nConnection: close\r\nTransfer-Encoding: "
                         "chunked\r\n\r\n",
                         absl::Hex(body.size()), ";name=value\r\n", body, "\r\n0\r\n\r\n"));
  ASSERT_EQ(extended.rfind("HTTP/1.1 200", 0), 0u) << extended.substr(0, 300);
  EXPECT_EQ(TokenIds(extended.substr(extended.find("\r\n\r\n") + 4)), Reference("ext", 3));
  // The served request's blocks are freed with the router's next step, after its reply.
  EXPECT_TRUE(AwaitNoBlockInUse());
  const StatsSnapshot stats = Stats();
  EXPECT_EQ(stats.in_use_blocks, 0);
  ExpectWhole(stats);
}

TEST_F(RouterSecurityTest, NoReplyQuotesMoreThanAShortPrefixOfWhatTheClientSent) {
  const std::string chat_template = dir_->path() + "/quoting-chat.jinja";
  // A template that refuses by quoting a message, as some do with a role they do not know.
  std::ofstream(chat_template)
      << "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('unknown role "
         "for: ' + m.content) }}{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/64, /*executors=*/1, {"--chat-template", chat_template}));
  const pid_t pid = router_->pid();
  // A 10 KB path (under --max-request-header-bytes) was echoed whole in the 404; a chat
  // template's refusal quoting a 500 KB message, whole in the 400.
  const std::string long_path = "/" + std::string(10000, 'p');
  struct Case {
    std::string method;
    std::string path;
    std::string body;
    int status;
  };
  const Case cases[] = {
      {"GET", long_path, "", 404},
      {"GET", "/v1" + long_path, "", 404},
      {"GET", "/v1/models" + long_path, "", 404},
      {"POST", "/v1/chat/completions",
       json{{"messages", {{{"role", "bad"}, {"content", std::string(500000, 'c')}}}}}.dump(), 400},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.method + " " + c.path.substr(0, 40));
    absl::StatusOr<HttpResponse> reply =
        HttpRequest(c.method, url_ + c.path, c.body, absl::Seconds(10));
    ASSERT_THAT(reply, IsOk());
    EXPECT_EQ(reply->status, c.status) << reply->body.substr(0, 300);
    EXPECT_LT(reply->body.size(), 1024u) << reply->body.substr(0, 300);
    EXPECT_NE(reply->body.find("..."), std::string::npos) << reply->body.substr(0, 300);
    ASSERT_TRUE(StillServing(url_, *router_, pid));
  }
}

TEST_F(RouterSecurityTest, TheDashboardAndConfigInfoShowNoPathOfTheMachine) {
  const std::string chat_template = dir_->path() + "/paths-chat.jinja";
  WriteChatTemplate(chat_template);
  // Leases that outlast the cache manager's pause below.
  CacheManagerOptions options = ManagerOptions(/*num_blocks=*/64, "");
  options.heartbeat_timeout_ms = 30000;
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = CacheManagerProcess::Start(options);
  ASSERT_THAT(cm, IsOk());
  cm_ = std::move(*cm);
  ASSERT_NO_FATAL_FAILURE(StartRouterAndExecutors(1, {"--chat-template", chat_template}, {}));
  const pid_t pid = router_->pid();
  // kvcm_router_config_info carried the model's, the template's and the run directory's
  // absolute paths to whoever reads /metrics; now their last component.
  absl::StatusOr<HttpResponse> scraped = HttpGet(url_ + "/metrics");
  ASSERT_THAT(scraped, IsOk());
  absl::StatusOr<MetricsText> metrics = ParseMetricsText(scraped->body);
  ASSERT_THAT(metrics, IsOk());
  const std::vector<MetricSample> info = metrics->Samples("kvcm_router_config_info");
  ASSERT_EQ(info.size(), 1u);
  for (const auto& [label, value] : info[0].labels) {
    absl::string_view path = value;
    absl::ConsumePrefix(&path, "ipc://");
    EXPECT_EQ(path.find('/'), absl::string_view::npos) << label << "=" << value;
  }
  EXPECT_EQ(info[0].labels.at("model"), "tiny");
  EXPECT_EQ(info[0].labels.at("chat_template"), "paths-chat.jinja");

  // The dashboard's state while the cache manager does not answer: it showed the client's
  // status, "cache manager at ipc:///RUN_DIR/cache-manager.sock did not answer ...".
  auto state = [&] {
    absl::StatusOr<HttpResponse> reply = HttpGet(url_ + "/dashboard/state");
    return reply.ok() && reply->status == 200 ? json::parse(reply->body, nullptr, false)
                                              : json(nullptr);
  };
  ASSERT_THAT(WaitFor([&] { return state().contains("pool"); }, absl::Seconds(10),
                      "the dashboard's first state"),
              IsOk());
  ASSERT_THAT(cm_->process().Signal(SIGSTOP), IsOk());
  absl::Cleanup resume = [this] { (void)cm_->process().Signal(SIGCONT); };
  std::string shown;
  ASSERT_THAT(WaitFor(
                  [&] {
                    const json s = state();
                    if (!s.is_object() || !s.contains("error") || !s["error"].is_string()) {
                      return false;
                    }
                    shown = s["error"].get<std::string>();
                    return true;
                  },
                  absl::Seconds(10), "the dashboard to say the cache manager does not answer"),
              IsOk());
  std::move(resume).Invoke();
  EXPECT_EQ(shown, "the cache manager does not answer (DEADLINE_EXCEEDED)");
  EXPECT_EQ(shown.find('/'), std::string::npos) << shown;
  EXPECT_THAT(router_->Output(), HasSubstr("dashboard: DEADLINE_EXCEEDED"));
  ASSERT_THAT(WaitFor([&] { return state().contains("pool"); }, absl::Seconds(10),
                      "the dashboard's state once the cache manager answers again"),
              IsOk());
  ASSERT_TRUE(StillServing(url_, *router_, pid));
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
  EXPECT_THAT(
      Exchange(url_, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
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

TEST_F(RouterSecurityTest, AStreamThePoolCanNeverHoldIsRefusedBeforeItStartsAsWhenUnstreamed) {
  const std::string chat_template = dir_->path() + "/never-chat.jinja";
  WriteChatTemplate(chat_template);
  // 8 blocks of 4 tokens: 32 tokens in all, far under --max-total-tokens (2048).
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/8, /*executors=*/1, {"--chat-template", chat_template}));
  const pid_t pid = router_->pid();
  // A prompt plus max_new_tokens that the pool can never hold: unstreamed, 422 (OpenAI:
  // 400); streamed, it was a 200 event stream of one error event (OpenAI's without
  // "data: [DONE]"), though the refusal was known before the first byte. Now the same
  // status and body as unstreamed, before the stream starts.
  const json tgi = {{"inputs", "a"}, {"parameters", {{"max_new_tokens", 100}}}};
  json tgi_stream = tgi;
  tgi_stream["stream"] = true;
  const json completion = {{"prompt", "a"}, {"max_tokens", 100}};
  json completion_stream = completion;
  completion_stream["stream"] = true;
  const json chat = {{"messages", {{{"role", "user"}, {"content", "a"}}}}, {"max_tokens", 100}};
  json chat_stream = chat;
  chat_stream["stream"] = true;
  struct Case {
    std::string what;
    std::string path;  // unstreamed
    json unstreamed;
    std::string stream_path;
    json streamed;
    int status;
    bool openai;
  };
  const Case cases[] = {
      {"/generate_stream", "/generate", tgi, "/generate_stream", tgi, 422, false},
      {"/ with stream", "/", tgi, "/", tgi_stream, 422, false},
      {"/v1/completions", "/v1/completions", completion, "/v1/completions", completion_stream, 400,
       true},
      {"/v1/chat/completions", "/v1/chat/completions", chat, "/v1/chat/completions", chat_stream,
       400, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    absl::StatusOr<HttpResponse> unstreamed = HttpPost(url_ + c.path, c.unstreamed.dump());
    ASSERT_THAT(unstreamed, IsOk());
    ASSERT_EQ(unstreamed->status, c.status) << unstreamed->body;
    const json refusal = ErrorOf(*unstreamed);
    ASSERT_TRUE(refusal.is_object()) << unstreamed->body;
    const std::string message =
        c.openai ? OpenAiErrorOf(*unstreamed).value("message", "") : refusal.value("error", "");
    EXPECT_THAT(message, HasSubstr("more KV cache than the pool holds")) << unstreamed->body;
    // Streamed, on a keep-alive connection: the same status and JSON body, no event.
    const int fd = ConnectTo(url_);
    ASSERT_GE(fd, 0);
    absl::Cleanup close_fd = [fd] { ::close(fd); };
    ASSERT_TRUE(SendAll(fd, RawPost(c.stream_path, c.streamed.dump())));
    const std::string reply = ReadOneReply(fd);
    EXPECT_EQ(reply.rfind(absl::StrCat("HTTP/1.1 ", c.status, " "), 0), 0u) << reply.substr(0, 400);
    EXPECT_THAT(HeadOf(reply), HasSubstr("content-type: application/json")) << reply.substr(0, 400);
    EXPECT_THAT(reply, Not(HasSubstr("data:"))) << reply.substr(0, 400);
    const size_t split = reply.find("\r\n\r\n");
    ASSERT_NE(split, std::string::npos) << reply;
    EXPECT_EQ(json::parse(reply.substr(split + 4), nullptr, false), refusal)
        << reply.substr(0, 400);
    // The connection serves its next request.
    ASSERT_TRUE(SendAll(fd, RawPost("/generate", GenerateBody("next", 2))));
    const std::string next = ReadOneReply(fd);
    EXPECT_EQ(next.rfind("HTTP/1.1 200", 0), 0u) << next.substr(0, 400);
    ASSERT_TRUE(StillServing(url_, *router_, pid));
  }
  // A stream the pool holds is still a stream.
  const std::string fits =
      Exchange(url_, RawPost("/generate_stream", GenerateBody("fits", 3), "Connection: close\r\n"));
  EXPECT_EQ(fits.rfind("HTTP/1.1 200", 0), 0u) << fits.substr(0, 400);
  EXPECT_THAT(HeadOf(fits), HasSubstr("content-type: text/event-stream"));
  ASSERT_TRUE(AwaitNoBlockInUse());
  const StatsSnapshot stats = Stats();
  EXPECT_EQ(stats.live_sequences, 0);
  ExpectWhole(stats);
}

// A POST of `body` to `path` with `headers` (each line ending in "\r\n") and no others but
// Host 127.0.0.1, its Content-Length and Connection: close.
std::string PostWithHeaders(const std::string& path, const std::string& headers,
                            const std::string& body) {
  return absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n",
                      headers, "Content-Length: ", body.size(), "\r\n\r\n", body);
}

// The status of a raw reply ("HTTP/1.1 NNN ..."); 0 when it is none.
int StatusOf(const std::string& reply) {
  int status = 0;
  if (reply.rfind("HTTP/1.", 0) != 0 || reply.size() < 12 ||
      !absl::SimpleAtoi(reply.substr(9, 3), &status)) {
    return 0;
  }
  return status;
}

// The JSON body of a raw reply; null when it has none.
json BodyOf(const std::string& reply) {
  const size_t split = reply.find("\r\n\r\n");
  if (split == std::string::npos) return nullptr;
  const json body = json::parse(reply.substr(split + 4), nullptr, false);
  return body.is_discarded() ? json(nullptr) : body;
}

// The message of an error body in either API's shape.
std::string MessageOf(const json& body) {
  if (!body.is_object() || !body.contains("error")) return "";
  if (body["error"].is_object()) return body["error"].value("message", "");
  return body["error"].is_string() ? body["error"].get<std::string>() : "";
}

TEST_F(RouterSecurityTest, APostThatIsNotApplicationJsonIsRefusedWith415AndGeneratesNothing) {
  const std::string chat_template = dir_->path() + "/media-chat.jinja";
  WriteChatTemplate(chat_template);
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/64, /*executors=*/1, {"--chat-template", chat_template}));
  const pid_t pid = router_->pid();
  // A page of any origin the local user opens may POST text/plain, a form or multipart to
  // this port without the browser asking first (a CORS "simple request"): every POST route
  // took such a body as JSON and generated. application/json needs the browser's preflight,
  // which this server never grants.
  struct Route {
    std::string path;
    json body;
    bool openai;
    bool generation;
  };
  const Route routes[] = {
      {"/generate", {{"inputs", "a"}, {"parameters", {{"max_new_tokens", 2}}}}, false, true},
      {"/generate_stream", {{"inputs", "a"}, {"parameters", {{"max_new_tokens", 2}}}}, false, true},
      {"/", {{"inputs", "a"}, {"parameters", {{"max_new_tokens", 2}}}}, false, true},
      {"/tokenize", {{"inputs", "a"}}, false, false},
      {"/v1/completions", {{"prompt", "a"}, {"max_tokens", 2}}, true, true},
      {"/v1/chat/completions",
       {{"messages", {{{"role", "user"}, {"content", "a"}}}}, {"max_tokens", 2}},
       true,
       true},
  };
  const std::string refused[] = {
      "Content-Type: text/plain\r\n",
      "Content-Type: text/plain;charset=UTF-8\r\n",
      "Content-Type: application/x-www-form-urlencoded\r\n",  // curl -d's
      "Content-Type: multipart/form-data; boundary=x\r\n",
      "Content-Type: application/jsonx\r\n",
      "Content-Type: application/json\r\nContent-Type: text/plain\r\n",
      "",  // none
  };
  auto requests = [&](const std::string& api, const std::string& outcome) {
    return RouterMetric("kvcm_router_requests_total", {{"api", api}, {"outcome", outcome}});
  };
  const double generated_before = RouterMetric("kvcm_router_generated_tokens_total");
  const double ok_before = requests("tgi", "ok") + requests("openai", "ok");
  const double tgi_invalid_before = requests("tgi", "invalid");
  const double openai_invalid_before = requests("openai", "invalid");
  int tgi_refused = 0;
  int openai_refused = 0;
  for (const Route& route : routes) {
    for (const std::string& headers : refused) {
      SCOPED_TRACE(route.path + " with " + (headers.empty() ? "no Content-Type" : headers));
      const std::string reply =
          Exchange(url_, PostWithHeaders(route.path, headers, route.body.dump()));
      EXPECT_EQ(StatusOf(reply), 415) << reply.substr(0, 400);
      const json body = BodyOf(reply);
      EXPECT_THAT(MessageOf(body), HasSubstr("application/json")) << reply.substr(0, 400);
      if (route.openai) {
        ASSERT_TRUE(body.contains("error") && body["error"].is_object()) << reply.substr(0, 400);
        EXPECT_EQ(body["error"].value("type", ""), "invalid_request_error");
        EXPECT_TRUE(body["error"].contains("param") && body["error"].contains("code"));
      } else {
        ASSERT_TRUE(body.is_object()) << reply.substr(0, 400);
        EXPECT_EQ(body.value("error_type", ""), "validation") << reply.substr(0, 400);
      }
      if (route.generation) ++(route.openai ? openai_refused : tgi_refused);
    }
    ASSERT_TRUE(StillServing(url_, *router_, pid));
  }
  // Nothing was generated, each refusal of a generation route counted as invalid.
  EXPECT_EQ(RouterMetric("kvcm_router_generated_tokens_total"), generated_before);
  EXPECT_EQ(requests("tgi", "ok") + requests("openai", "ok"), ok_before);
  EXPECT_EQ(requests("tgi", "invalid"), tgi_invalid_before + tgi_refused);
  EXPECT_EQ(requests("openai", "invalid"), openai_invalid_before + openai_refused);
  EXPECT_EQ(Stats().live_sequences, 0);
  // application/json is served, with parameters and in any case.
  for (const std::string& headers :
       {std::string("Content-Type: application/json\r\n"),
        std::string("Content-Type: Application/JSON; charset=utf-8\r\n")}) {
    SCOPED_TRACE(headers);
    const std::string reply =
        Exchange(url_, PostWithHeaders("/generate", headers, GenerateBody("json", 3)));
    ASSERT_EQ(StatusOf(reply), 200) << reply.substr(0, 400);
    EXPECT_EQ(TokenIds(BodyOf(reply).dump()), Reference("json", 3));
    const std::string openai =
        Exchange(url_, PostWithHeaders("/v1/completions", headers,
                                       json{{"prompt", "a"}, {"max_tokens", 2}}.dump()));
    EXPECT_EQ(StatusOf(openai), 200) << openai.substr(0, 400);
  }
  ASSERT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

// A request of `method` to `path` whose headers (each line ending in "\r\n") are
// `host_lines` and no others but Connection: close and, for a POST, application/json's
// Content-Type and its Content-Length.
std::string RequestWithHost(const std::string& method, const std::string& path,
                            const std::string& host_lines, const std::string& body = "",
                            const std::string& version = "HTTP/1.1") {
  std::string request =
      absl::StrCat(method, " ", path, " ", version, "\r\n", host_lines, "Connection: close\r\n");
  if (method == "POST") {
    absl::StrAppend(&request, "Content-Type: application/json\r\nContent-Length: ", body.size(),
                    "\r\n");
  }
  return absl::StrCat(request, "\r\n", body);
}

TEST_F(RouterSecurityTest, ARequestForAnotherHostIsRefusedWith403SoARebindingPageReadsNothing) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1));
  const pid_t pid = router_->pid();
  const std::string port = url_.substr(url_.rfind(':') + 1);
  // A page of evil.example whose DNS name its owner rebinds to 127.0.0.1 reaches this port
  // as its own origin and reads every reply, its Host "evil.example:PORT": any Host was
  // served, /info, the dashboard's state and generations included.
  const std::string completion = json{{"prompt", "a"}, {"max_tokens", 2}}.dump();
  struct Ask {
    std::string method;
    std::string path;
    std::string body;
    bool openai;
  };
  const Ask asks[] = {
      {"GET", "/info", "", false},
      {"GET", "/dashboard/state", "", false},
      {"GET", "/dashboard", "", false},
      {"GET", "/health", "", false},
      {"GET", "/metrics", "", false},
      {"GET", "/openapi.json", "", false},
      {"GET", "/v1/models", "", true},
      {"POST", "/generate", GenerateBody("rebound", 3), false},
      {"POST", "/generate_stream", GenerateBody("rebound", 3), false},
      {"POST", "/tokenize", json{{"inputs", "a"}}.dump(), false},
      {"POST", "/v1/completions", completion, true},
  };
  const double generated_before = RouterMetric("kvcm_router_generated_tokens_total");
  const std::string foreign[] = {
      absl::StrCat("Host: evil.example:", port, "\r\n"),
      "Host: evil.example\r\n",
      absl::StrCat("Host: EVIL.example:", port, "\r\n"),
      absl::StrCat("Host: localhost.evil.example:", port, "\r\n"),
      absl::StrCat("Host: 127.0.0.1.evil.example:", port, "\r\n"),
      // An IP literal other than the listen address's (127.0.0.1) and loopback's.
      absl::StrCat("Host: 10.1.2.3:", port, "\r\n"),
  };
  for (const std::string& host : foreign) {
    for (const Ask& ask : asks) {
      SCOPED_TRACE(ask.method + " " + ask.path + " " + host);
      const std::string reply =
          Exchange(url_, RequestWithHost(ask.method, ask.path, host, ask.body));
      ASSERT_EQ(StatusOf(reply), 403) << reply.substr(0, 400);
      const json body = BodyOf(reply);
      EXPECT_THAT(MessageOf(body), HasSubstr("--allowed-hosts")) << reply.substr(0, 400);
      if (ask.openai) {
        EXPECT_TRUE(body.contains("error") && body["error"].is_object()) << reply.substr(0, 400);
      } else {
        EXPECT_TRUE(body.contains("error_type")) << reply.substr(0, 400);
      }
    }
  }
  EXPECT_EQ(RouterMetric("kvcm_router_generated_tokens_total"), generated_before);
  EXPECT_EQ(Stats().live_sequences, 0);
  // An absolute request target names the host that counts (RFC 9112), whatever Host says:
  // refused (403 by its host, or 400 by the framing, which takes only a path).
  const std::string absolute =
      Exchange(url_, RequestWithHost("GET", absl::StrCat("http://evil.example:", port, "/info"),
                                     absl::StrCat("Host: 127.0.0.1:", port, "\r\n")));
  EXPECT_TRUE(StatusOf(absolute) == 403 || StatusOf(absolute) == 400) << absolute.substr(0, 400);
  // RFC 9112: an HTTP/1.1 request without Host, with two, or with one that is no
  // host[:port], is a 400.
  for (const std::string& host :
       {std::string(""), absl::StrCat("Host: 127.0.0.1:", port, "\r\nHost: evil.example\r\n"),
        std::string("Host: evil example\r\n"), std::string("Host: [::1\r\n"),
        std::string("Host: 127.0.0.1:80x\r\n")}) {
    SCOPED_TRACE(host);
    const std::string reply = Exchange(url_, RequestWithHost("GET", "/info", host));
    EXPECT_EQ(StatusOf(reply), 400) << reply.substr(0, 400);
    EXPECT_TRUE(BodyOf(reply).contains("error_type")) << reply.substr(0, 400);
  }
  // This server's own names are served, with or without a port; so is HTTP/1.0 without Host.
  for (const std::string& host :
       {absl::StrCat("Host: 127.0.0.1:", port, "\r\n"), std::string("Host: 127.0.0.1\r\n"),
        absl::StrCat("Host: localhost:", port, "\r\n"),
        absl::StrCat("Host: LocalHost.:", port, "\r\n"),
        absl::StrCat("Host: [::1]:", port, "\r\n")}) {
    SCOPED_TRACE(host);
    const std::string info = Exchange(url_, RequestWithHost("GET", "/info", host));
    EXPECT_EQ(StatusOf(info), 200) << info.substr(0, 400);
    const std::string state = Exchange(url_, RequestWithHost("GET", "/dashboard/state", host));
    EXPECT_EQ(StatusOf(state), 200) << state.substr(0, 400);
    const std::string generated =
        Exchange(url_, RequestWithHost("POST", "/generate", host, GenerateBody("mine", 3)));
    ASSERT_EQ(StatusOf(generated), 200) << generated.substr(0, 400);
    EXPECT_EQ(TokenIds(BodyOf(generated).dump()), Reference("mine", 3));
  }
  const std::string old_client =
      Exchange(url_, RequestWithHost("GET", "/info", "", "", "HTTP/1.0"));
  EXPECT_EQ(StatusOf(old_client), 200) << old_client.substr(0, 400);
  ASSERT_TRUE(StillServing(url_, *router_, pid));
  ASSERT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

TEST_F(RouterSecurityTest, AllowedHostsAdmitsTheNamesItListsAndAWildcardAddressAnyIpLiteral) {
  // Listening on every address (0.0.0.0): the Host may be any IP literal of the machine;
  // a name must still be localhost or one of --allowed-hosts (which any page could not be).
  ASSERT_NO_FATAL_FAILURE(StartStack(
      /*num_blocks=*/64, /*executors=*/1,
      {"--hostname", "0.0.0.0", "--allowed-hosts", "evil.example, Other.Example."}));
  const pid_t pid = router_->pid();
  const std::string port = url_.substr(url_.rfind(':') + 1);
  for (const std::string& host :
       {absl::StrCat("Host: evil.example:", port, "\r\n"), std::string("Host: other.example\r\n"),
        absl::StrCat("Host: localhost:", port, "\r\n"),
        absl::StrCat("Host: 10.1.2.3:", port, "\r\n"), std::string("Host: [fe80::1]\r\n")}) {
    SCOPED_TRACE(host);
    const std::string info = Exchange(url_, RequestWithHost("GET", "/info", host));
    EXPECT_EQ(StatusOf(info), 200) << info.substr(0, 400);
    const std::string generated =
        Exchange(url_, RequestWithHost("POST", "/generate", host, GenerateBody("allowed", 3)));
    ASSERT_EQ(StatusOf(generated), 200) << generated.substr(0, 400);
    EXPECT_EQ(TokenIds(BodyOf(generated).dump()), Reference("allowed", 3));
  }
  // A name not listed is refused still.
  const std::string other = Exchange(
      url_, RequestWithHost("GET", "/info", absl::StrCat("Host: third.example:", port, "\r\n")));
  EXPECT_EQ(StatusOf(other), 403) << other.substr(0, 400);
  ASSERT_TRUE(StillServing(url_, *router_, pid));
  ASSERT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

}  // namespace
}  // namespace kvcm
