// Hostile clients against the router's HTTP port of one real stack (docs/RELIABILITY.md,
// "Security" and "Fault injection"): kvcm-launch runs the cache manager, the router and an
// executor of a tiny model, and raw sockets attack the port with every class of request
// that once broke the router (each is fixed; this suite guards them all in one place, on
// the stack an operator runs):
//
//   empty prompts on every generation route; JSON nested 20,000 and 300,000 levels in
//   `inputs`, in `parameters` and in a chat message's `tool_calls`; /tokenize of 1 MB; an
//   unsupported parameter of 500 KB; unstreamed requests whose clients close right after
//   sending; 300 silent connections, then 600 past the router's descriptor limit (the stack
//   runs under RLIMIT_NOFILE 512); a slowloris head trickled byte by byte; ten pipelined
//   requests on one connection; a body over --max-request-body-bytes; two Content-Lengths;
//   a header block over --max-request-header-bytes; a stream whose client stops reading;
//   100 connections each sending a generation request and closing at once.
//
// After each attack, ExpectStillWhole checks: /health answers 200 within a deadline; the
// router is the process that started (no restart by kvcm-launch); its resident memory is
// under a bound fixed before the first attack (its start plus 64 MiB; plus 512 MiB under
// AddressSanitizer); once no request is in flight, the pool's block states sum to its
// capacity and none is in use; and a generation request gets the model's own tokens. At the
// end, SIGTERM stops the stack cleanly.
//
// The model's tokenizer adds no BOS (as SmolLM2's), so that an empty text is a prompt of no
// tokens: the prompt that aborted the router (docs/router.md, "Errors"). Steps are slowed
// (--fault-layer-delay-ms 1) so that a request of a few hundred tokens is still running when
// its client leaves. Nothing here is random. The figures (resident memory at the start,
// the bound, after each attack) are printed.

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/tokenizer/byte_level.h"
#include "gtest/gtest.h"
#include "tests/faults/launched_stack.h"
#include "tests/support/byte_tokenizer.h"
#include "tests/support/metrics_text.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait_for.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVCM_HOSTILE_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(KVCM_HOSTILE_ASAN)
#define KVCM_HOSTILE_ASAN 1
#endif

namespace kvcm::faults {
namespace {

using testing::HttpGet;
using testing::HttpPost;
using testing::HttpResponse;
using testing::WaitFor;

// ---- Raw sockets -----------------------------------------------------------------------

// A TCP connection to 127.0.0.1:`port` made within `timeout` (SO_SNDTIMEO bounds connect()
// too), reads timing out after it; -1 with errno on failure. `receive_buffer` > 0 sets
// SO_RCVBUF before the connect (a small window: a slow reader).
int Connect(int port, int receive_buffer = 0, absl::Duration timeout = absl::Seconds(10)) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (receive_buffer > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
  }
  const timeval limit = absl::ToTimeval(timeout);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
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

bool SendAll(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n <= 0) return false;
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// Everything the server sends until it closes (or a read times out, or the connection is
// reset: what came before is kept).
std::string ReadUntilClosed(int fd) {
  std::string reply;
  char buffer[8192];
  ssize_t n;
  while ((n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0) reply.append(buffer, n);
  return reply;
}

// Sends `request` on a new connection and returns what comes back until the server closes.
std::string Exchange(int port, const std::string& request) {
  const int fd = Connect(port);
  if (fd < 0) return "connect failed";
  SendAll(fd, request);  // the server may answer and close before all of it is sent
  std::string reply = ReadUntilClosed(fd);
  ::close(fd);
  return reply;
}

// One reply of a keep-alive connection, framed by its Content-Length ("" if it broke off).
std::string ReadOneReply(int fd, std::string* pending) {
  char buffer[8192];
  while (true) {
    const size_t head_end = pending->find("\r\n\r\n");
    if (head_end != std::string::npos) {
      const std::string head = absl::AsciiStrToLower(pending->substr(0, head_end));
      const size_t at = head.find("content-length: ");
      size_t length = 0;
      if (at == std::string::npos ||
          !absl::SimpleAtoi(head.substr(at + 16, head.find("\r\n", at) - at - 16), &length)) {
        std::string all = std::move(*pending);
        pending->clear();
        return all;
      }
      if (pending->size() >= head_end + 4 + length) {
        std::string reply = pending->substr(0, head_end + 4 + length);
        pending->erase(0, head_end + 4 + length);
        return reply;
      }
    }
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) return "";
    pending->append(buffer, static_cast<size_t>(n));
  }
}

// The status of a raw reply ("HTTP/1.1 413 ..." gives 413); 0 if it is none.
int StatusOf(const std::string& reply) {
  int status = 0;
  if (!absl::StartsWith(reply, "HTTP/1.") || reply.size() < 12 ||
      !absl::SimpleAtoi(reply.substr(9, 3), &status)) {
    return 0;
  }
  return status;
}
std::string BodyOf(const std::string& reply) {
  const size_t at = reply.find("\r\n\r\n");
  return at == std::string::npos ? "" : reply.substr(at + 4);
}

// Whether the server closed (or reset) `fd`: nothing is read, only looked at.
bool ClosedByServer(int fd) {
  char byte;
  const ssize_t got = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

// A POST of `body` to `path`, framed by Content-Length.
std::string RawPost(const std::string& path, const std::string& body,
                    const std::string& extra_headers = "") {
  return absl::StrCat("POST ", path,
                      " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: ", "application/json\r\n",
                      extra_headers, "Content-Length: ", body.size(), "\r\n\r\n", body);
}

// `levels` arrays, each inside the one before: "[[[...]]]".
std::string Nested(int levels) {
  const auto n = static_cast<size_t>(levels);
  return std::string(n, '[') + std::string(n, ']');
}

// The resident memory of `pid` in bytes (/proc/PID/status VmRSS); -1 if unreadable.
int64_t ResidentBytes(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (!absl::StartsWith(line, "VmRSS:")) continue;
    std::vector<std::string> fields = absl::StrSplit(line.substr(6), ' ', absl::SkipWhitespace());
    int64_t kib = 0;
    if (!fields.empty() && absl::SimpleAtoi(fields[0], &kib)) return kib * 1024;
  }
  return -1;
}

std::string Mib(int64_t bytes) {
  return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
}

class HostileClientTest : public LaunchedStackTest {
 protected:
  static constexpr int kNumBlocks = 1024;
  // RLIMIT_NOFILE of every process of the stack (soft and hard): the router's port sheds
  // connections with fewer than 32 of them left.
  static constexpr int kDescriptorLimit = 512;
  // Above the resident memory at the start: what the attacks may add (printed).
  static constexpr int64_t kRssMarginBytes = int64_t{64} << 20;

  HostileClientTest() : LaunchedStackTest("kvcm-hostile-test") {}

  int Port() const {
    int port = 0;
    EXPECT_TRUE(absl::SimpleAtoi(url_.substr(url_.rfind(':') + 1), &port)) << url_;
    return port;
  }

  // A metric of the router's /metrics; -1 when it cannot be read.
  double RouterMetric(const std::string& name, const testing::MetricLabels& labels = {}) const {
    absl::StatusOr<HttpResponse> scraped = HttpGet(url_ + "/metrics", absl::Seconds(5));
    if (!scraped.ok() || scraped->status != 200) return -1;
    absl::StatusOr<testing::MetricsText> metrics = testing::ParseMetricsText(scraped->body);
    if (!metrics.ok()) return -1;
    absl::StatusOr<double> value = metrics->Value(name, labels);
    return value.ok() ? *value : -1;
  }
  // kvcm_router_requests_total by "api/outcome" (every one, zeros included).
  std::map<std::string, double> RequestCounts() const {
    std::map<std::string, double> counts;
    absl::StatusOr<HttpResponse> scraped = HttpGet(url_ + "/metrics", absl::Seconds(5));
    if (!scraped.ok() || scraped->status != 200) return counts;
    absl::StatusOr<testing::MetricsText> metrics = testing::ParseMetricsText(scraped->body);
    if (!metrics.ok()) return counts;
    for (const testing::MetricSample& s : metrics->Samples("kvcm_router_requests_total")) {
      counts[absl::StrCat(s.labels.at("api"), "/", s.labels.at("outcome"))] = s.value;
    }
    return counts;
  }
  // What `after` counted more than `before`, e.g. "tgi/cancelled 3, openai/ok 1".
  static std::map<std::string, double> Added(const std::map<std::string, double>& before,
                                             const std::map<std::string, double>& after) {
    std::map<std::string, double> added;
    for (const auto& [key, value] : after) {
      const auto it = before.find(key);
      const double delta = value - (it == before.end() ? 0 : it->second);
      if (delta != 0) added[key] = delta;
    }
    return added;
  }
  static double Sum(const std::map<std::string, double>& counts, const std::string& outcome = "") {
    double sum = 0;
    for (const auto& [key, value] : counts) {
      if (outcome.empty() || absl::EndsWith(key, "/" + outcome)) sum += value;
    }
    return sum;
  }
  static std::string Show(const std::map<std::string, double>& counts) {
    std::vector<std::string> parts;
    for (const auto& [key, value] : counts) parts.push_back(absl::StrCat(key, " ", value));
    return parts.empty() ? "none" : absl::StrJoin(parts, ", ");
  }
  // Until `n` more requests than `before` are counted, whatever their outcome; what was
  // added.
  std::map<std::string, double> AwaitCounted(const std::map<std::string, double>& before, double n,
                                             const std::string& what) {
    std::map<std::string, double> added;
    const absl::Status counted = WaitFor(
        [&] {
          added = Added(before, RequestCounts());
          return Sum(added) >= n;
        },
        absl::Seconds(30), what);
    EXPECT_THAT(counted, IsOk()) << "; counted: " << Show(added) << "\n"
                                 << testing::Tail(launch_->Output());
    return added;
  }

  // The model's greedy tokens for `text` (no BOS: one token per byte), cut after an
  // end-of-sequence id as the router does.
  std::vector<int32_t> ReferenceWithoutBos(const std::string& text, int32_t n) const {
    std::vector<int32_t> prompt;
    for (unsigned char c : text) prompt.push_back(3 + c);
    return testing::ReferenceAnswer(*model_, prompt, n);
  }
  static std::string GenerateBody(const std::string& text, int32_t n) {
    return json{{"inputs", text}, {"parameters", {{"max_new_tokens", n}, {"details", true}}}}
        .dump();
  }
  static std::vector<int32_t> TokenIds(const std::string& body) {
    std::vector<int32_t> ids;
    const json reply = json::parse(body, nullptr, false);
    if (!reply.is_object() || !reply.contains("details")) return ids;
    for (const json& t : reply["details"]["tokens"]) ids.push_back(t["id"].get<int32_t>());
    return ids;
  }
  // (5) POST /generate answers the model's own tokens.
  void ExpectModelTokens(const std::string& text, int32_t n) {
    absl::StatusOr<HttpResponse> reply =
        HttpPost(url_ + "/generate", GenerateBody(text, n), absl::Seconds(30));
    ASSERT_THAT(reply, IsOk()) << "\n" << testing::Tail(launch_->Output());
    ASSERT_EQ(reply->status, 200) << reply->body.substr(0, 300);
    EXPECT_EQ(TokenIds(reply->body), ReferenceWithoutBos(text, n)) << reply->body.substr(0, 300);
  }

  bool Healthy() const {
    absl::StatusOr<HttpResponse> health = HttpGet(url_ + "/health", absl::Seconds(2));
    return health.ok() && health->status == 200;
  }

  // The checks after every attack (the file's comment).
  void ExpectStillWhole(const std::string& attack) {
    SCOPED_TRACE("after the attack: " + attack);
    // (1) /health answers 200 within the deadline.
    const absl::Status health =
        WaitFor([&] { return Healthy(); }, absl::Seconds(30), "/health to answer 200");
    EXPECT_THAT(health, IsOk()) << "\n" << testing::Tail(launch_->Output());
    // (2) The same router process: not restarted by kvcm-launch, still running.
    EXPECT_EQ(CurrentPid("router"), router_pid_) << testing::Tail(launch_->Output());
    EXPECT_EQ(::kill(router_pid_, 0), 0) << "the router (pid " << router_pid_ << ") is gone";
    // (3) Its resident memory under the bound fixed before the attacks.
    const int64_t rss = ResidentBytes(router_pid_);
    rss_after_.emplace_back(attack, rss);
    EXPECT_GT(rss, 0);
    EXPECT_LT(rss, rss_bound_) << "the router's resident memory is " << Mib(rss)
                               << ", over the bound " << Mib(rss_bound_);
    // (4) Once nothing is in flight, the pool's block states sum to its capacity, none in
    // use (nor quarantined or draining).
    std::optional<Scrape> last;
    const absl::Status idle = WaitFor(
        [&] {
          if (RouterMetric("kvcm_router_running_sequences") != 0 ||
              RouterMetric("kvcm_router_queue_requests") != 0) {
            return false;
          }
          last = ScrapeCacheManager();
          return last.has_value() && last->blocks["in_use"] == 0 &&
                 last->blocks["quarantined"] == 0 && last->blocks["draining"] == 0;
        },
        absl::Seconds(30), "no request in flight and no block in use");
    EXPECT_THAT(idle, IsOk()) << ": in_use " << (last ? last->blocks["in_use"] : -1)
                              << ", running sequences "
                              << RouterMetric("kvcm_router_running_sequences") << "\n"
                              << testing::Tail(launch_->Output());
    if (last.has_value()) {
      double sum = 0;
      for (const auto& [state, count] : last->blocks) sum += count;
      EXPECT_EQ(sum, last->capacity) << "block states do not sum to the capacity";
      EXPECT_EQ(last->capacity, kNumBlocks);
    }
    // (5) A generation request gets the model's own tokens.
    ExpectModelTokens(absl::StrCat("after ", attack), 4);
  }

  pid_t router_pid_ = 0;
  int64_t rss_start_ = 0;
  int64_t rss_bound_ = 0;
  std::vector<std::pair<std::string, int64_t>> rss_after_;
};

TEST_F(HostileClientTest, EveryAttackLeavesTheSameRouterServingWithinItsMemoryAndTheLedgerWhole) {
  const std::set<std::string> shm_before = DevShmEntries();
  testing::WriteByteTokenizerWithoutBos(model_dir_);
  launch_wrapper_ = {"prlimit", absl::StrCat("--nofile=", kDescriptorLimit, ":", kDescriptorLimit),
                     "--"};
  // A chat template, so that a chat message's extra members reach the template's conversion.
  const std::string chat_template = dir_->path() + "/chat.jinja";
  std::ofstream(chat_template) << "{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
                                  "{% endfor %}";
  constexpr int kRequestDeadlineMs = 2000;
  ASSERT_NO_FATAL_FAILURE(
      Launch(/*executors=*/1, kNumBlocks,
             {"--chat-template", chat_template, "--fault-layer-delay-ms", "1",
              absl::StrCat("--router-arg=--http-request-timeout-ms=", kRequestDeadlineMs)}));
  router_pid_ = CurrentPid("router");
  ASSERT_GT(router_pid_, 0) << testing::Tail(launch_->Output());
  const int port = Port();
  ASSERT_GT(port, 0);
  // Served before any attack, with the model's tokens; then the bound is fixed.
  ASSERT_NO_FATAL_FAILURE(ExpectModelTokens("before the attacks", 4));
  rss_start_ = ResidentBytes(router_pid_);
  ASSERT_GT(rss_start_, 0);
  rss_bound_ = rss_start_ + kRssMarginBytes;
#ifdef KVCM_HOSTILE_ASAN
  // AddressSanitizer keeps freed memory in its quarantine (256 MiB by default) before reusing
  // it, so a router built with it grows by up to that much without leaking anything.
  rss_bound_ += int64_t{512} << 20;
#endif
  std::cout << "hostile clients: the router (pid " << router_pid_
            << ") at the start: " << Mib(rss_start_) << " resident; bound " << Mib(rss_bound_)
            << std::endl;

  const json too_long_value = std::string(500000, 'x');
  struct Attack {
    std::string name;
    std::function<void()> run;
  };
  const std::vector<Attack> attacks = {
      {"empty prompts on every generation route",
       [&] {
         struct Case {
           std::string path;
           std::string body;
           int status;
         };
         const Case cases[] = {
             {"/generate", R"({"inputs": ""})", 422},
             {"/generate_stream", R"({"inputs": "", "parameters": {"max_new_tokens": 2}})", 422},
             {"/", R"({"inputs": ""})", 422},
             {"/", R"({"inputs": "", "stream": true})", 422},
             {"/v1/completions", R"({"prompt": ""})", 400},
             {"/v1/completions", R"({"prompt": [""]})", 400},
             {"/v1/completions", R"({"prompt": [""], "stream": true})", 400},
         };
         for (const Case& c : cases) {
           SCOPED_TRACE(c.path + " " + c.body);
           absl::StatusOr<HttpResponse> reply = HttpPost(url_ + c.path, c.body);
           ASSERT_THAT(reply, IsOk()) << "\n" << testing::Tail(launch_->Output());
           EXPECT_EQ(reply->status, c.status) << reply->body;
           EXPECT_TRUE(absl::StrContains(reply->body, "cannot be empty")) << reply->body;
         }
       }},
      {"JSON nested 20,000 and 300,000 levels in inputs, parameters and a chat message",
       [&] {
         for (const int levels : {20000, 300000}) {
           const std::string deep = Nested(levels);
           struct Case {
             std::string path;
             std::string body;
             int status;
           };
           const Case cases[] = {
               {"/generate", R"({"inputs": )" + deep + "}", 422},
               {"/generate", R"({"inputs": "a", "parameters": )" + deep + "}", 422},
               {"/generate", R"({"inputs": "a", "parameters": {"stop": )" + deep + "}}", 422},
               {"/generate_stream", R"({"inputs": )" + deep + "}", 422},
               {"/", R"({"inputs": "a", "parameters": {"typical_p": )" + deep + "}}", 422},
               {"/v1/completions", R"({"prompt": )" + deep + "}", 400},
               {"/v1/chat/completions",
                R"({"messages": [{"role": "user", "content": "hi", "tool_calls": )" + deep + "}]}",
                400},
           };
           for (const Case& c : cases) {
             SCOPED_TRACE(absl::StrCat(levels, " levels: ", c.path, " ", c.body.substr(0, 60)));
             absl::StatusOr<HttpResponse> reply =
                 HttpPost(url_ + c.path, c.body, absl::Seconds(30));
             ASSERT_THAT(reply, IsOk()) << "\n" << testing::Tail(launch_->Output());
             EXPECT_EQ(reply->status, c.status) << reply->body.substr(0, 300);
             EXPECT_TRUE(absl::StrContains(reply->body, "deeper than 64 levels"))
                 << reply->body.substr(0, 300);
             EXPECT_LT(reply->body.size(), 1024u);
           }
         }
       }},
      {"/tokenize of 1 MB",
       [&] {
         absl::StatusOr<HttpResponse> reply =
             HttpPost(url_ + "/tokenize", json{{"inputs", std::string(1000000, '7')}}.dump(),
                      absl::Seconds(30));
         ASSERT_THAT(reply, IsOk());
         EXPECT_EQ(reply->status, 422) << reply->body.substr(0, 300);
         EXPECT_LT(reply->body.size(), 1024u) << "a reply of " << reply->body.size() << " bytes";
       }},
      {"an unsupported parameter of 500 KB",
       [&] {
         const std::pair<std::string, std::string> cases[] = {
             {"/generate",
              json{{"inputs", "a"}, {"parameters", {{"typical_p", too_long_value}}}}.dump()},
             {"/v1/completions", json{{"prompt", "a"}, {"logit_bias", too_long_value}}.dump()},
         };
         for (const auto& [path, body] : cases) {
           SCOPED_TRACE(path);
           absl::StatusOr<HttpResponse> reply = HttpPost(url_ + path, body, absl::Seconds(30));
           ASSERT_THAT(reply, IsOk());
           EXPECT_TRUE(reply->status == 422 || reply->status == 400) << reply->status;
           EXPECT_LT(reply->body.size(), 1024u)
               << "a reply of " << reply->body.size() << " bytes: " << reply->body.substr(0, 200);
           EXPECT_TRUE(absl::StrContains(reply->body, "is not supported"))
               << reply->body.substr(0, 300);
         }
       }},
      {"unstreamed requests whose clients close right after sending",
       [&] {
         constexpr int kTokens = 400;
         const std::vector<std::string> requests = {
             RawPost("/generate", GenerateBody("leave at once one", kTokens)),
             RawPost("/", json{{"inputs", "leave at once two"},
                               {"stream", false},
                               {"parameters", {{"max_new_tokens", kTokens}}}}
                              .dump()),
             RawPost("/v1/completions", json{{"prompt", "leave at once three"},
                                             {"max_tokens", kTokens},
                                             {"temperature", 0}}
                                            .dump()),
             RawPost("/v1/chat/completions",
                     json{{"messages", {{{"role", "user"}, {"content", "leave at once four"}}}},
                          {"max_tokens", kTokens},
                          {"temperature", 0}}
                         .dump()),
         };
         const std::map<std::string, double> before = RequestCounts();
         const double generated_before = RouterMetric("kvcm_router_generated_tokens_total");
         for (const std::string& request : requests) {
           const int fd = Connect(port);
           ASSERT_GE(fd, 0);
           EXPECT_TRUE(SendAll(fd, request));
           ::close(fd);
         }
         std::map<std::string, double> added =
             AwaitCounted(before, 4, "the four requests to be counted");
         std::cout << "  counted: " << Show(added) << "; "
                   << RouterMetric("kvcm_router_generated_tokens_total") - generated_before
                   << " tokens generated (of " << 4 * kTokens << " asked)" << std::endl;
         EXPECT_EQ(Sum(added, "cancelled"), 4) << Show(added);
         EXPECT_EQ(added["tgi/cancelled"], 2) << Show(added);
         EXPECT_EQ(added["openai/cancelled"], 2) << Show(added);
       }},
      {"300 silent connections",
       [&] {
         std::vector<int> silent;
         absl::Cleanup close_silent = [&silent] {
           for (int fd : silent) ::close(fd);
         };
         for (int i = 0; i < 300; ++i) {
           const int fd = Connect(port);
           ASSERT_GE(fd, 0) << "connection " << i << ": " << std::strerror(errno);
           silent.push_back(fd);
         }
         // While they are held: /health and a generation on fresh connections.
         const absl::Status health =
             WaitFor([&] { return Healthy(); }, absl::Seconds(30), "/health to answer 200");
         EXPECT_THAT(health, IsOk());
         ExpectModelTokens("while 300 connections are silent", 3);
         size_t closed = 0;
         for (int fd : silent) closed += ClosedByServer(fd) ? 1 : 0;
         std::cout << "  " << closed << " of 300 silent connections closed by the router "
                   << "while held" << std::endl;
       }},
      {"600 silent connections past the router's descriptor limit",
       [&] {
         // The stack runs under RLIMIT_NOFILE 512 (kDescriptorLimit). At the limit,
         // libevent's accept() failed with EMFILE and left the socket readable: the loop spun
         // logging each failure. Now, with fewer than 32 descriptors left, the port stops
         // taking connections (each new one is closed at once, counted) and takes them again
         // once enough are free (docs/router.md, "Connections at the descriptor limit").
         constexpr int kFlood = 600;
         const double shed_before = RouterMetric("kvcm_router_http_connections_shed_total");
         const size_t log_before = launch_->Output().size();
         std::vector<int> silent;
         absl::Cleanup close_silent = [&silent] {
           for (int fd : silent) ::close(fd);
           silent.clear();
         };
         int reset_at_connect = 0;
         for (int i = 0; i < kFlood; ++i) {
           const int fd = Connect(port, 0, absl::Seconds(5));
           if (fd >= 0) {
             silent.push_back(fd);
           } else if (errno == ECONNRESET) {
             ++reset_at_connect;
           } else {
             ADD_FAILURE() << "connection " << i << ": " << std::strerror(errno);
             break;
           }
         }
         auto logged_since = [&](std::string_view line) {
           return launch_->Output().find(line, log_before) != std::string::npos;
         };
         const absl::Status stopped =
             WaitFor([&] { return logged_since("not accepting HTTP connections"); },
                     absl::Seconds(30), "the router to stop accepting");
         EXPECT_THAT(stopped, IsOk()) << "\n" << testing::Tail(launch_->Output());
         size_t closed = 0;
         const absl::Status shed = WaitFor(
             [&] {
               closed = static_cast<size_t>(reset_at_connect);
               for (int fd : silent) closed += ClosedByServer(fd) ? 1 : 0;
               return closed >= kFlood - kDescriptorLimit;
             },
             absl::Seconds(30), "the connections past the limit to be closed");
         EXPECT_THAT(shed, IsOk()) << ": " << closed << " closed";
         std::move(close_silent).Invoke();
         const absl::Status again =
             WaitFor([&] { return Healthy() && logged_since("accepting HTTP connections again"); },
                     absl::Seconds(30), "the router to take connections again");
         EXPECT_THAT(again, IsOk()) << "\n" << testing::Tail(launch_->Output());
         const double shed_count =
             RouterMetric("kvcm_router_http_connections_shed_total") - shed_before;
         // The router's lines since (kvcm-launch prefixes each process's lines with its name).
         std::string router_lines;
         for (absl::string_view line : absl::StrSplit(launch_->Output().substr(log_before), '\n')) {
           if (absl::StartsWith(line, "[router]")) absl::StrAppend(&router_lines, line, "\n");
         }
         std::cout << "  " << closed << " of " << kFlood << " closed by the router as they came ("
                   << shed_count << " counted shed); the router logged " << router_lines.size()
                   << " bytes meanwhile" << std::endl;
         EXPECT_GE(shed_count, kFlood - kDescriptorLimit);
         // No spinning: a few lines (stopped, accepting again), where each failed accept()
         // logged one.
         EXPECT_LT(router_lines.size(), 4096u) << router_lines.substr(0, 4096);
       }},
      {"a slowloris head trickled byte by byte",
       [&] {
         const double dropped_before = RouterMetric("kvcm_router_http_slow_requests_dropped_total");
         constexpr int kSlow = 4;
         std::vector<int> slow;
         absl::Cleanup close_slow = [&slow] {
           for (int fd : slow) ::close(fd);
         };
         for (int i = 0; i < kSlow; ++i) {
           const int fd = Connect(port);
           ASSERT_GE(fd, 0);
           slow.push_back(fd);
         }
         // One more byte of the head on every connection at each poll, until the router drops
         // them all (at its request deadline): the attack's pace, not a wait for a peer.
         const std::string head = "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
         size_t sent = 0;
         std::vector<bool> dropped(kSlow, false);
         const absl::Time start = absl::Now();
         const absl::Status all_dropped = WaitFor(
             [&] {
               const char byte = sent < head.size() ? head[sent] : 'a';
               ++sent;
               bool all = true;
               for (int i = 0; i < kSlow; ++i) {
                 if (dropped[i]) continue;
                 dropped[i] = ClosedByServer(slow[i]) || !SendAll(slow[i], {&byte, 1});
                 all = all && dropped[i];
               }
               return all;
             },
             absl::Seconds(10 * kRequestDeadlineMs / 1000),
             "the slowloris connections to be dropped");
         EXPECT_THAT(all_dropped, IsOk());
         std::cout << "  " << kSlow << " slowloris connections dropped after "
                   << absl::FormatDuration(absl::Now() - start) << " and " << sent
                   << " bytes each (request deadline " << kRequestDeadlineMs << " ms)" << std::endl;
         const absl::Status counted = WaitFor(
             [&] {
               return RouterMetric("kvcm_router_http_slow_requests_dropped_total") ==
                      dropped_before + kSlow;
             },
             absl::Seconds(10), "the slow requests to be counted");
         EXPECT_THAT(counted, IsOk());
       }},
      {"ten pipelined requests on one connection",
       [&] {
         const int fd = Connect(port);
         ASSERT_GE(fd, 0);
         absl::Cleanup close_fd = [fd] { ::close(fd); };
         std::string all;
         for (int i = 0; i < 10; ++i) {
           absl::StrAppend(&all,
                           RawPost("/generate", GenerateBody(absl::StrCat("pipelined ", i), 3)));
         }
         ASSERT_TRUE(SendAll(fd, all));
         std::string pending;
         for (int i = 0; i < 10; ++i) {
           SCOPED_TRACE(absl::StrCat("reply ", i));
           const std::string reply = ReadOneReply(fd, &pending);
           ASSERT_EQ(StatusOf(reply), 200) << reply.substr(0, 300);
           EXPECT_EQ(TokenIds(BodyOf(reply)), ReferenceWithoutBos(absl::StrCat("pipelined ", i), 3))
               << "replies out of order, or wrong: " << BodyOf(reply).substr(0, 300);
         }
       }},
      {"a body over --max-request-body-bytes",
       [&] {
         // The headers alone: the router answers at them (1 MiB is its default limit).
         const std::string reply =
             Exchange(port,
                      "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                      "application/json\r\nContent-Length: 1048577\r\n\r\n");
         EXPECT_EQ(StatusOf(reply), 413) << reply.substr(0, 300);
       }},
      {"two Content-Lengths that differ",
       [&] {
         const std::string body = GenerateBody("framing", 2);
         const std::string reply = Exchange(
             port, absl::StrCat("POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: ",
                                body.size(), "\r\nContent-Length: ", body.size() + 5, "\r\n\r\n",
                                body, "GET /"));
         EXPECT_EQ(StatusOf(reply), 400) << reply.substr(0, 300);
         EXPECT_TRUE(absl::StrContains(reply, "ambiguous framing")) << reply.substr(0, 300);
       }},
      {"a header block over --max-request-header-bytes",
       [&] {
         // 17,000 bytes of one header: over the default 16 KiB, and read whole by the router
         // before it answers (so that its close is not a reset that loses the reply).
         const std::string reply =
             Exchange(port, absl::StrCat("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ",
                                         std::string(17000, 'a'), "\r\n\r\n"));
         EXPECT_GE(StatusOf(reply), 400) << reply.substr(0, 300);
         EXPECT_LT(StatusOf(reply), 500) << reply.substr(0, 300);
       }},
      {"a stream whose client stops reading",
       [&] {
         constexpr int kTokens = 1500;
         const std::map<std::string, double> before = RequestCounts();
         const double generated_before = RouterMetric("kvcm_router_generated_tokens_total");
         // A small receive window, so that the router's writes back up soon.
         const int fd = Connect(port, /*receive_buffer=*/4096);
         ASSERT_GE(fd, 0);
         absl::Cleanup close_fd = [fd] { ::close(fd); };
         ASSERT_TRUE(SendAll(
             fd,
             RawPost("/generate_stream",
                     json{{"inputs", "a reader that stops"},
                          {"parameters",
                           {{"max_new_tokens", kTokens}, {"top_n_tokens", 5}, {"details", true}}}}
                         .dump())));
         // Read nothing while it generates a few hundred tokens, and the router serves others.
         const absl::Status generating = WaitFor(
             [&] {
               return RouterMetric("kvcm_router_generated_tokens_total") >= generated_before + 300;
             },
             absl::Seconds(30), "the unread stream to generate 300 tokens");
         EXPECT_THAT(generating, IsOk());
         EXPECT_TRUE(Healthy());
         std::move(close_fd).Invoke();  // with unread bytes: a reset
         std::map<std::string, double> added = AwaitCounted(before, 1, "the stream to be counted");
         const double generated =
             RouterMetric("kvcm_router_generated_tokens_total") - generated_before;
         std::cout << "  counted: " << Show(added) << "; " << generated << " tokens generated "
                   << "(of " << kTokens << " asked)" << std::endl;
         EXPECT_EQ(added["tgi/cancelled"], 1) << Show(added);
         EXPECT_LT(generated, kTokens);
       }},
      {"100 connections each sending a generation request and closing at once",
       [&] {
         constexpr int kClients = 100;
         std::vector<int> clients;
         absl::Cleanup close_clients = [&clients] {
           for (int fd : clients) ::close(fd);
         };
         for (int i = 0; i < kClients; ++i) {
           const int fd = Connect(port);
           ASSERT_GE(fd, 0);
           clients.push_back(fd);
         }
         const std::map<std::string, double> before = RequestCounts();
         for (int i = 0; i < kClients; ++i) {
           SendAll(clients[i],
                   i % 2 == 0
                       ? RawPost("/generate", GenerateBody(absl::StrCat("many ", i), 200))
                       : RawPost("/v1/completions", json{{"prompt", absl::StrCat("many ", i)},
                                                         {"max_tokens", 200},
                                                         {"temperature", 0}}
                                                        .dump()));
         }
         std::move(close_clients).Invoke();
         std::map<std::string, double> added =
             AwaitCounted(before, kClients, "the 100 requests to be counted");
         std::cout << "  counted: " << Show(added) << std::endl;
         EXPECT_EQ(Sum(added), kClients) << Show(added);
         EXPECT_EQ(Sum(added, "cancelled"), kClients) << Show(added);
       }},
  };

  for (const Attack& attack : attacks) {
    std::cout << "attack: " << attack.name << std::endl;
    const absl::Time start = absl::Now();
    {
      SCOPED_TRACE("attack: " + attack.name);
      attack.run();
    }
    ExpectStillWhole(attack.name);
    std::cout << "  the router served on after it (" << absl::FormatDuration(absl::Now() - start)
              << "); resident " << Mib(rss_after_.back().second) << std::endl;
  }

  std::cout << "hostile clients: the router's resident memory: " << Mib(rss_start_)
            << " at the start, bound " << Mib(rss_bound_) << "; after each attack:\n";
  int64_t peak = 0;
  for (const auto& [name, rss] : rss_after_) {
    std::cout << "  " << Mib(rss) << "  " << name << "\n";
    peak = std::max(peak, rss);
  }
  std::cout << "  peak " << Mib(peak) << " (+" << Mib(peak - rss_start_) << ")" << std::endl;

  // SIGTERM: every process ever started is gone, nothing is left behind.
  ExpectCleanShutdown(shm_before);
}

}  // namespace
}  // namespace kvcm::faults
