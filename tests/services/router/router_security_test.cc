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
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/status_macros.h"
#include "common/tokenizer/byte_level.h"
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

// The model of `dir`: the tiny model's weights with a byte-level BPE tokenizer.json whose
// prompts get no BOS, as SmolLM2's (its GGUF says add_bos_token false). Its ids are the
// byte tokenizer's (<unk>, <s>, </s>, then byte b as 3 + b), so the executors, which read
// no tokenizer, run the same model.
absl::Status MakeModelWithoutBos(const std::string& dir) {
  KVCM_RETURN_IF_ERROR(MakeTinyModel(dir, kModelSeed));
  json vocab = json::object();
  json added = json::array();
  const char* const specials[] = {"<unk>", "<s>", "</s>"};
  for (int id = 0; id < 3; ++id) {
    vocab[specials[id]] = id;
    added.push_back({{"id", id},
                     {"content", specials[id]},
                     {"special", true},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"single_word", false},
                     {"normalized", false}});
  }
  for (int b = 0; b < 256; ++b) {
    std::string spelled;
    internal::ByteLevelEncode(std::string(1, static_cast<char>(b)), &spelled);
    vocab[spelled] = 3 + b;
  }
  const json tokenizer = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", {{"type", "ByteLevel"}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
  std::ofstream(dir + "/tokenizer.json") << tokenizer.dump();
  std::ofstream(dir + "/tokenizer_config.json")
      << json{{"add_bos_token", false}, {"bos_token", "<s>"}, {"eos_token", "</s>"}}.dump();
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

TEST_F(RouterSecurityTest, AnEmptyPromptIsRefusedAndTheRouterKeepsServing) {
  // Prompts of this model get no BOS: an empty text is a prompt of no tokens, which the
  // planner cannot run (its KVCM_CHECK aborted the router).
  router_model_dir_ = dir_->path() + "/tiny-without-bos";
  ASSERT_TRUE(MakeModelWithoutBos(router_model_dir_).ok());
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1));
  const pid_t pid = router_->pid();
  absl::StatusOr<HttpResponse> tokenized = HttpPost(url_ + "/tokenize", R"({"inputs": "ok"})");
  ASSERT_TRUE(tokenized.ok()) << tokenized.status();
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
    ASSERT_TRUE(reply.ok()) << reply.status() << "\n" << Tail(router_->Output());
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
    ASSERT_TRUE(reply.ok()) << reply.status() << "\n" << Tail(router_->Output());
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
  EXPECT_EQ(
      RouterMetric("kvcm_router_requests_total", {{"api", "openai"}, {"outcome", "invalid"}}),
      openai_before + 2);

  // A prompt of two bytes is two tokens, no BOS, and gets the model's tokens for them.
  absl::StatusOr<HttpResponse> fine = HttpPost(url_ + "/generate", GenerateBody("ok", 3));
  ASSERT_TRUE(fine.ok()) << fine.status();
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
    ASSERT_TRUE(reply.ok()) << reply.status() << "\n" << Tail(router_->Output());
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
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(served->status, 200) << served->body;
  EXPECT_EQ(TokenIds(served->body), Reference("ok", 2));
  const std::string past_limit = R"({"inputs": "ok", "nested": )" + Nested(64) + "}";
  absl::StatusOr<HttpResponse> refused = HttpPost(url_ + "/generate", past_limit);
  ASSERT_TRUE(refused.ok()) << refused.status();
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
       "parameter `typical_p` is not supported by this server (\"" + huge.substr(0, 63) +
           "...)"},
      {"/v1/completions", json{{"prompt", "a"}, {"logit_bias", huge}}.dump(), 400,
       "parameter `logit_bias` is not supported by this server (\"" + huge.substr(0, 63) +
           "...)"},
      {"/v1/completions", json{{"prompt", "a"}, {huge, 1}}.dump(), 400,
       "parameter `" + huge.substr(0, 64) + "...` is not supported by this server (1)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path + " " + c.body.substr(0, 80));
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + c.path, c.body);
    ASSERT_TRUE(reply.ok()) << reply.status();
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
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->status, 200) << fits->body;
  EXPECT_EQ(json::parse(fits->body, nullptr, false).size(), 40u);
  absl::StatusOr<HttpResponse> over =
      HttpPost(url_ + "/tokenize", json{{"inputs", std::string(40, '7')}}.dump());
  ASSERT_TRUE(over.ok()) << over.status();
  EXPECT_EQ(over->status, 422) << over->body;
  EXPECT_THAT(over->body, HasSubstr("less than 40 tokens. Given: 41"));
  // 1 MB of digits (under --max-request-body-bytes) was a 22 MB reply of one entry per id.
  absl::StatusOr<HttpResponse> huge =
      HttpPost(url_ + "/tokenize", json{{"inputs", std::string(1000000, '7')}}.dump(),
               absl::Seconds(30));
  ASSERT_TRUE(huge.ok()) << huge.status();
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
  auto stopped = router_->WaitForLine("not accepting HTTP connections",
                                      absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(stopped.ok()) << stopped.status() << "\n" << Tail(router_->Output());
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
  ASSERT_TRUE(late.ok()) << late.status();
  executors_.push_back(std::move(*late));
  auto registered = router_->WaitForLine(R"(\(exec-late, pid [0-9]+\) registered)",
                                         absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(registered.ok()) << registered.status() << "\n" << Tail(router_->Output());

  // Once the silent connections go, a fresh connection is served again.
  std::move(close_silent).Invoke();
  const absl::Time served_by = absl::Now() + absl::Seconds(30);
  while (true) {
    absl::StatusOr<HttpResponse> health = HttpGet(url_ + "/health", absl::Seconds(2));
    if (health.ok() && health->status == 200) break;
    ASSERT_LT(absl::Now(), served_by) << Tail(router_->Output());
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(router_->WaitForLine("accepting HTTP connections again",
                                   absl::Now() + absl::Seconds(30))
                  .ok());
  ASSERT_TRUE(StillServing(url_, *router_, pid));
  ASSERT_NO_FATAL_FAILURE(AwaitExecutors(2));
  EXPECT_GE(RouterMetric("kvcm_router_http_connections_shed_total"), kFlood - kLimit);
  // No spinning: the flood added a few lines to the log (stopped, the executor, accepting
  // again), where each failed accept() logged one before.
  const size_t log_growth = router_->Output().size() - log_before;
  std::printf("the router's log grew by %zu bytes\n", log_growth);
  EXPECT_LT(log_growth, 4096u) << Tail(router_->Output());

  absl::StatusOr<HttpResponse> fine = HttpPost(url_ + "/generate", GenerateBody("after", 3));
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_EQ(fine->status, 200) << fine->body;
  EXPECT_EQ(TokenIds(fine->body), Reference("after", 3));
  ASSERT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
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
