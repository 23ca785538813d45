// Cache manager round trip and pipelined throughput over ZeroMQ, each beside a bare ZeroMQ
// baseline measured in the same run, and the service's own handling time for the breakdown.
//
//   build/bench/cache_manager_bench                 # ratios at the end
//   build/bench/cache_manager_bench --benchmark_filter=RoundTrip
//
// The candidate is the real kvcm-cache-manager binary (KVCM_CACHE_MANAGER_PATH, compiled in),
// started once per run on a fresh temp run directory with an shm pool of 65536 blocks; the
// baselines are separate processes too: this binary re-executed as a bare ROUTER echo server
// (--echo_server) or a bare PULL counter (--pull_server). Everything talks over ipc:// in
// the same temp directory.
//
// The step message (same bytes in every benchmark): 16 operations, 8 Allocate of a new
// sequence of 16 tokens (one block, no block hashes) followed by 8 Free of the sequences the
// previous step allocated. Steps stay valid when pipelined because a DEALER's messages reach
// the ROUTER and are handled in order. Every reply is checked (StepReply, 16 results, all
// Ok, one block per Allocate) outside the timed region; a bad reply fails the benchmark.
//
// Benchmarks:
//   CacheManagerRoundTrip/P   one step, DEALER send -> poll -> recv of the StepReply; the
//                             P-th percentile (50 or 99) of 20000 round trips after 2000 of
//                             warm-up is the reported time; p50/p99/mean in the counters.
//   BareDealerRouter/P        the same client code against a ROUTER that answers every
//                             request with a reply of the StepReply's size.
//   BarePollLoopRouter/P      the same against an echo server whose loop is shaped like the
//                             cache manager's (zmq_poll over the ROUTER and three more fds,
//                             dontwait receives and sends, Peer-Address): informative, it
//                             splits the difference into loop and service.
//                             The three are measured together: round trips take turns one
//                             by one, and the baselines report their parts of the
//                             measurement CacheManagerRoundTrip/P made in the same
//                             repetition.
//   CacheManagerPipelined/W   20000 steps with W in flight on the DEALER; time per step.
//   BarePushPull              20000 messages of the step's size PUSHed to a PULL process,
//                             which reports over a second PUSH when it has them all.
//   BareDealerRouterPipelined/W  the pipelined client against the echo server: what the
//                             reply path costs without the cache manager (informative).
//   ServiceHandleStep         CacheManagerService::Handle() on the same step bytes, in
//                             process (fake process watcher, real metrics): the service's
//                             own share of a round trip.
//   ServiceHandleStepAndLoop  the same plus what the server's loop does around each
//                             request when requests arrive one at a time: the peer address
//                             parse, clock reads, TakeEventBatch and the metrics snapshot.
//   ServiceHandleStepCold     ServiceHandleStep with the caches overwritten (8 MiB, timer
//                             paused) before every Handle(): what a request pays when it
//                             comes after the context switches of a round trip.
//   ServiceHandleDecodeStep/S/N  Handle() on the router's step shape with N running
//                             sequences (DecodeStepStream below: S = once_a_block, a Commit
//                             and an Append per sequence once a block, the router's; or
//                             once_a_token, one of each per sequence and step, the router's
//                             before; a finished sequence freed and a new one allocated in
//                             its place); time per step. S = once_a_block_window64: the
//                             router's shape to a cache manager releasing blocks behind a
//                             64-token sliding window (goal: <= 1.10x once_a_block).
//                             S = once_a_block_groups2 / _groups7: the same steps to a
//                             cache manager with 2 or 7 KV cache groups (goal: <= 1.10x
//                             once_a_block).
//   LedgerDecodeStep/S/N      the same ops applied straight to a BlockLedger of the same
//                             pool: the baseline, so the ratio is what the service adds
//                             (decode, verification, validation, ownership, the reply).
// Every benchmark against a process also reports server_cpu_us: that process's CPU time, all
// threads, per message (from /proc/PID/task/*/schedstat).
// Goals (issue "Cache manager round trip"): round trip <= 1.10x the bare DEALER/ROUTER
// round trip at p50 and p99; pipelined throughput >= 0.5x bare PUSH/PULL, i.e. time per
// message <= 2.0x. Nothing here is random.

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "bench/ratio_reporter.h"
#include "common/base/check.h"
#include "common/base/status_macros.h"
#include "common/block/block_ledger.h"
#include "common/sizing/kv_cache_groups.h"
#include "common/wire/envelope.h"
#include "common/wire/step_codec.h"
#include "services/cache_manager/cache_manager_metrics.h"
#include "services/cache_manager/cache_manager_service.h"
#include "services/cache_manager/peer_credentials.h"
#include "zmq.hpp"

extern char** environ;

namespace kvcm {
namespace {

using Clock = std::chrono::steady_clock;

// The cache manager's shape and pool: as in docs/PERFORMANCE.md's command.
constexpr int32_t kNumBlocks = 65536;
constexpr int32_t kLayers = 2;
constexpr int32_t kKvHeads = 2;
constexpr int32_t kHeadDim = 64;
constexpr int32_t kBlockSize = 16;

// The step: kSeqsPerStep allocations of kTokensPerSeq tokens and as many frees.
constexpr int kSeqsPerStep = 8;
constexpr int kOpsPerStep = 2 * kSeqsPerStep;
constexpr int32_t kTokensPerSeq = 16;

constexpr int kWarmupRoundTrips = 2000;
constexpr int kRoundTrips = 20000;
constexpr int kPipelinedMessages = 20000;
// How long a reply may take before the peer is declared dead.
constexpr std::chrono::milliseconds kReplyTimeout{10000};
constexpr std::chrono::seconds kStartTimeout{30};

// --- Step messages ---------------------------------------------------------------------------

// Encodes the step stream: each step allocates kSeqsPerStep new sequences and frees those of
// the step before. The first step only allocates (Prime()).
class StepEncoder {
 public:
  void set_session(uint64_t session_id, uint64_t epoch) {
    session_id_ = session_id;
    epoch_ = epoch;
  }

  // The next step of the stream into `builder` (cleared first).
  void Next(flatbuffers::FlatBufferBuilder& builder) { Encode(builder, /*free_previous=*/true); }
  // The first step: allocations only.
  void Prime(flatbuffers::FlatBufferBuilder& builder) { Encode(builder, false); }

 private:
  void Encode(flatbuffers::FlatBufferBuilder& builder, bool free_previous) {
    builder.Clear();
    ops_.clear();
    // Sequence ids start at 1: a 0 would be left out of the table and shrink the message.
    const uint64_t first = next_seq_;
    for (int i = 0; i < kSeqsPerStep; ++i) {
      ops_.push_back(BlockOp::Allocate(next_seq_++, kTokensPerSeq));
    }
    if (free_previous) {
      for (int i = 0; i < kSeqsPerStep; ++i) ops_.push_back(BlockOp::Free(previous_first_ + i));
    }
    previous_first_ = first;
    KVCM_CHECK(EncodeStep(builder, ++request_id_, session_id_, epoch_, ops_).ok());
  }

  std::vector<BlockOp> ops_;
  uint64_t session_id_ = 0;
  uint64_t epoch_ = 0;
  uint64_t request_id_ = 0;
  uint64_t next_seq_ = 1;
  uint64_t previous_first_ = 0;
};

// The router's decode step over N running sequences. Once a block (the router's shape,
// services/router/step_planner.cc): a sequence's Commit after its prefill and when the
// token of the last step filled a block (with that block's hash), its Append when its next
// token falls past what it holds (up to the end of that token's block). Once a token (the
// router's shape before it): per sequence a Commit of every token it had before the step
// (with the hash of the block that completed, when one did) and an Append of one token. A
// sequence that reached kDecodeEndTokens is freed and a new one of kDecodePromptTokens
// allocated in its place (with its prompt's block hashes), as continuous batching does; the
// first N start staggered so that about one in 192 finishes per step. Hashes are distinct (a
// counter), so nothing hits the prefix cache; freed blocks are cached and, once the pool is
// full, evicted.
constexpr int32_t kDecodePromptTokens = 64;
constexpr int32_t kDecodeEndTokens = 256;

class DecodeStepStream {
 public:
  DecodeStepStream(int n, bool once_a_block)
      : live_(static_cast<size_t>(n)), once_a_block_(once_a_block) {}

  // The first step: the N allocations.
  const std::vector<BlockOp>& Prime() {
    ops_.clear();
    const int32_t span = kDecodeEndTokens - kDecodePromptTokens;
    for (size_t i = 0; i < live_.size(); ++i) {
      const int32_t tokens =
          kDecodePromptTokens + static_cast<int32_t>((i * 97) % static_cast<size_t>(span));
      Allocate(&live_[i], tokens);
    }
    return ops_;
  }

  const std::vector<BlockOp>& Next() {
    ops_.clear();
    for (Seq& seq : live_) {
      if (seq.tokens >= kDecodeEndTokens) {
        ops_.push_back(BlockOp::Free(seq.id));
        Allocate(&seq, kDecodePromptTokens);
        continue;
      }
      hashes_.clear();
      const bool filled = seq.tokens % kBlockSize == 0 && seq.tokens > seq.prompt;
      if (filled) hashes_.push_back(NextHash());
      if (!once_a_block_) {
        ops_.push_back(BlockOp::Commit(seq.id, seq.tokens, hashes_));
        ops_.push_back(BlockOp::Append(seq.id, 1));
      } else {
        // The prefill's commit (its full blocks), then one a block.
        const bool prefilled = seq.tokens == seq.prompt && seq.prompt >= kBlockSize;
        if (filled || prefilled) ops_.push_back(BlockOp::Commit(seq.id, seq.tokens, hashes_));
        if (seq.tokens + 1 > seq.held) {
          const int32_t reach = (seq.tokens / kBlockSize + 1) * kBlockSize;
          ops_.push_back(BlockOp::Append(seq.id, reach - seq.held));
          seq.held = reach;
        }
      }
      ++seq.tokens;
    }
    return ops_;
  }

 private:
  struct Seq {
    SeqId id = 0;
    int32_t prompt = 0;
    int32_t tokens = 0;  // after the ops handed out so far
    int32_t held = 0;    // tokens the ledger holds for it
  };

  void Allocate(Seq* seq, int32_t tokens) {
    seq->id = next_seq_++;
    seq->prompt = tokens;
    seq->tokens = tokens;
    seq->held = tokens;
    hashes_.clear();
    for (int32_t b = 0; b < tokens / kBlockSize; ++b) hashes_.push_back(NextHash());
    ops_.push_back(BlockOp::Allocate(seq->id, tokens, hashes_));
  }

  BlockHash NextHash() {
    BlockHash h;
    // Spread over the index's tag bits (the first word), distinct by construction.
    const uint64_t word = ++hash_counter_ * 0x9E3779B97F4A7C15ULL;
    std::memcpy(h.bytes.data(), &word, sizeof(word));
    std::memcpy(h.bytes.data() + 8, &hash_counter_, sizeof(hash_counter_));
    return h;
  }

  std::vector<Seq> live_;
  bool once_a_block_;
  std::vector<BlockOp> ops_;
  std::vector<BlockHash> hashes_;
  SeqId next_seq_ = 1;
  uint64_t hash_counter_ = 0;
};

// Empty when `bytes` is a StepReply to a step of `ops` operations (kSeqsPerStep allocations
// first) with every result Ok and one block per allocation; else what is wrong.
std::string CheckStepReply(std::span<const uint8_t> bytes, int ops) {
  const VerifiedEnvelope verified = VerifyEnvelope(bytes);
  if (verified.fault != EnvelopeFault::kNone) return "reply refused: " + verified.reason;
  const wire::Envelope& envelope = *verified.envelope;
  if (envelope.payload_type() == wire::Message::ErrorReply) {
    const wire::ErrorReply* error = envelope.payload_as_ErrorReply();
    return std::string("ErrorReply ") +
           std::string(WireCodeName(error == nullptr ? wire::ErrorCode::Ok : error->code())) +
           ": " + (error != nullptr && error->reason() != nullptr ? error->reason()->str() : "");
  }
  const wire::StepReply* reply = envelope.payload_as_StepReply();
  if (reply == nullptr || reply->results() == nullptr) return "not a StepReply";
  if (static_cast<int>(reply->results()->size()) != ops) {
    return "StepReply with " + std::to_string(reply->results()->size()) + " results for " +
           std::to_string(ops) + " ops";
  }
  for (flatbuffers::uoffset_t i = 0; i < reply->results()->size(); ++i) {
    const wire::OpResult* result = reply->results()->Get(i);
    if (result == nullptr) return "empty result";
    if (result->code() != wire::ErrorCode::Ok) {
      return "op " + std::to_string(i) + ": " + std::string(WireCodeName(result->code())) + " " +
             (result->reason() != nullptr ? result->reason()->str() : "");
    }
    const size_t blocks = result->blocks() == nullptr ? 0 : result->blocks()->size();
    if (static_cast<int>(i) < kSeqsPerStep && blocks != 1) {
      return "allocation " + std::to_string(i) + " got " + std::to_string(blocks) + " blocks";
    }
  }
  return "";
}

// --- Child processes -------------------------------------------------------------------------

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A child process with stdout and stderr in a log file, SIGTERMed and reaped on Stop().
class Child {
 public:
  // Starts `argv` (argv[0] is the binary) with its output in `log_path`.
  static std::unique_ptr<Child> Spawn(const std::vector<std::string>& argv,
                                      const std::string& log_path, std::string* error) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    std::vector<char*> args;
    for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
    args.push_back(nullptr);
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      *error = "posix_spawn " + argv[0] + ": " + std::strerror(rc);
      return nullptr;
    }
    return std::unique_ptr<Child>(new Child(pid, log_path));
  }

  ~Child() { Stop(); }

  // Waits until a line of the log contains `needle` and returns that line; nullopt (and
  // `error` set) if the child exits or the deadline passes first.
  std::optional<std::string> WaitForLine(std::string_view needle, std::string* error) {
    const auto deadline = Clock::now() + kStartTimeout;
    while (Clock::now() < deadline) {
      const std::string log = ReadFile(log_path_);
      if (const size_t at = log.find(needle); at != std::string::npos) {
        const size_t begin = log.rfind('\n', at);
        const size_t end = log.find('\n', at);
        if (end != std::string::npos) {
          const size_t from = begin == std::string::npos ? 0 : begin + 1;
          return log.substr(from, end - from);
        }
      }
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        *error = "child exited before \"" + std::string(needle) + "\":\n" + log;
        return std::nullopt;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    *error = "no \"" + std::string(needle) + "\" within the deadline:\n" + ReadFile(log_path_);
    return std::nullopt;
  }

  // SIGTERM, then the exit status (-1 if it was already reaped or killed by a signal).
  int Stop() {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGTERM);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  const std::string& log_path() const { return log_path_; }
  pid_t pid() const { return pid_; }

 private:
  Child(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}

  pid_t pid_;
  std::string log_path_;
};

// "key=value" out of a log line.
std::string FieldOf(const std::string& line, const std::string& key) {
  const size_t at = line.find(" " + key + "=");
  if (at == std::string::npos) return "";
  const size_t begin = at + key.size() + 2;
  return line.substr(begin, line.find(' ', begin) - begin);
}

// Nanoseconds all threads of process `pid` have spent on a CPU so far (the first field of
// each /proc/PID/task/TID/schedstat); 0 if unreadable.
uint64_t ProcessCpuNs(pid_t pid) {
  uint64_t total = 0;
  std::error_code error;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  for (const auto& task : std::filesystem::directory_iterator(tasks, error)) {
    std::ifstream in(task.path() / "schedstat");
    uint64_t ns = 0;
    if (in >> ns) total += ns;
  }
  return total;
}

// --- Client ----------------------------------------------------------------------------------

// Waits up to kReplyTimeout for one message on `socket`; false on timeout.
bool Receive(zmq::socket_t& socket, zmq::message_t& message) {
  zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
  if (zmq::poll(&item, 1, kReplyTimeout) == 0) return false;
  return socket.recv(message, zmq::recv_flags::dontwait).has_value();
}

// One DEALER connected to a ROUTER (the cache manager or the echo server), the same code
// for both.
struct DealerClient {
  zmq::socket_t socket;
  bool is_cache_manager = false;
  StepEncoder encoder;
  size_t reply_bytes = 0;  // bare echo: the expected reply size
  pid_t server_pid = 0;    // for its CPU time
};

// Everything the benchmarks share, started on first use and stopped at exit.
class Environment {
 public:
  static Environment& Get() {
    static Environment* environment = new Environment();
    return *environment;
  }

  // Starts the processes and connects the clients; false (and error()) on failure.
  bool Start(const std::string& self) {
    if (started_) return error_.empty();
    started_ = true;
    self_ = self;
    const char* tmp = std::getenv("TMPDIR");
    dir_ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/kvcm-cm-bench-XXXXXX";
    if (::mkdtemp(dir_.data()) == nullptr) {
      return Fail("mkdtemp: " + std::string(std::strerror(errno)));
    }

    // The cache manager.
    cache_manager_ = Child::Spawn({KVCM_CACHE_MANAGER_PATH,
                                   "--run-dir",
                                   dir_ + "/run",
                                   "--backend",
                                   "shm",
                                   "--num-blocks",
                                   std::to_string(kNumBlocks),
                                   "--layers",
                                   std::to_string(kLayers),
                                   "--kv-heads",
                                   std::to_string(kKvHeads),
                                   "--head-dim",
                                   std::to_string(kHeadDim),
                                   "--dtype",
                                   "fp16",
                                   "--block-size",
                                   std::to_string(kBlockSize),
                                   "--metrics-address",
                                   "127.0.0.1:0",
                                   "--heartbeat-interval-ms",
                                   "1000",
                                   "--heartbeat-timeout-ms",
                                   "600000"},
                                  dir_ + "/cache-manager.log", &error_);
    if (cache_manager_ == nullptr) return false;
    auto ready = cache_manager_->WaitForLine("ready epoch=", &error_);
    if (!ready) return false;
    const std::string endpoint = FieldOf(*ready, "endpoint");
    const uint64_t epoch = std::strtoull(FieldOf(*ready, "epoch").c_str(), nullptr, 10);
    if (endpoint.rfind("ipc://", 0) != 0 || epoch == 0) return Fail("bad ready line: " + *ready);

    cm_.socket = zmq::socket_t(context_, zmq::socket_type::dealer);
    cm_.socket.set(zmq::sockopt::linger, 0);
    cm_.socket.connect(endpoint);
    cm_.is_cache_manager = true;
    cm_.server_pid = cache_manager_->pid();
    if (!Hello(epoch)) return false;

    // One primed step (allocations only), then one steady step to learn the sizes.
    flatbuffers::FlatBufferBuilder builder;
    cm_.encoder.Prime(builder);
    zmq::message_t reply;
    cm_.socket.send(zmq::buffer(builder.GetBufferPointer(), builder.GetSize()));
    if (!Receive(cm_.socket, reply)) return Fail("no reply to the first step");
    if (std::string bad = CheckStepReply(Span(reply), kSeqsPerStep); !bad.empty()) {
      return Fail("first step: " + bad);
    }
    cm_.encoder.Next(builder);
    request_bytes_ = builder.GetSize();
    cm_.socket.send(zmq::buffer(builder.GetBufferPointer(), builder.GetSize()));
    if (!Receive(cm_.socket, reply)) return Fail("no reply to the second step");
    if (std::string bad = CheckStepReply(Span(reply), kOpsPerStep); !bad.empty()) {
      return Fail("second step: " + bad);
    }
    reply_bytes_ = reply.size();
    std::printf("step: %d ops, request %zu bytes, StepReply %zu bytes; cache manager %s\n",
                kOpsPerStep, request_bytes_, reply_bytes_, endpoint.c_str());

    // The bare ROUTER echo servers.
    if (!StartEcho("echo", "blocking", &echo_, &bare_) ||
        !StartEcho("echo-poll", "poll", &poll_echo_, &poll_bare_)) {
      return false;
    }

    // The bare PULL counter.
    const std::string pull_endpoint = "ipc://" + dir_ + "/pull.sock";
    const std::string report_endpoint = "ipc://" + dir_ + "/report.sock";
    pull_ = Child::Spawn(
        {self, "--pull_server=" + pull_endpoint, "--report_endpoint=" + report_endpoint},
        dir_ + "/pull.log", &error_);
    if (pull_ == nullptr || !pull_->WaitForLine("ready", &error_)) return false;
    push_ = zmq::socket_t(context_, zmq::socket_type::push);
    push_.set(zmq::sockopt::linger, 0);
    push_.connect(pull_endpoint);
    report_ = zmq::socket_t(context_, zmq::socket_type::pull);
    report_.set(zmq::sockopt::linger, 0);
    report_.connect(report_endpoint);
    return true;
  }

  // Stops the children (the cache manager must exit cleanly) and removes the temp dir.
  void Stop() {
    cm_.socket.close();
    bare_.socket.close();
    poll_bare_.socket.close();
    push_.close();
    report_.close();
    if (cache_manager_ != nullptr) {
      const int status = cache_manager_->Stop();
      if (status != 0) {
        std::printf("kvcm-cache-manager exited with %d:\n%s\n", status,
                    ReadFile(cache_manager_->log_path()).c_str());
      }
    }
    if (echo_ != nullptr) echo_->Stop();
    if (poll_echo_ != nullptr) poll_echo_->Stop();
    if (pull_ != nullptr) pull_->Stop();
    if (!dir_.empty()) {
      std::error_code ignored;
      std::filesystem::remove_all(dir_, ignored);
    }
  }

  const std::string& error() const { return error_; }
  DealerClient& cache_manager() { return cm_; }
  DealerClient& bare() { return bare_; }
  DealerClient& poll_bare() { return poll_bare_; }
  zmq::socket_t& push() { return push_; }
  zmq::socket_t& report() { return report_; }
  pid_t pull_pid() const { return pull_->pid(); }
  size_t request_bytes() const { return request_bytes_; }
  size_t reply_bytes() const { return reply_bytes_; }
  uint64_t session_id() const { return session_id_; }
  uint64_t epoch() const { return epoch_; }

  static std::span<const uint8_t> Span(const zmq::message_t& message) {
    return {static_cast<const uint8_t*>(message.data()), message.size()};
  }

 private:
  Environment() = default;

  bool Fail(std::string error) {
    error_ = std::move(error);
    return false;
  }

  // Starts this binary as an echo server named `name` with loop `loop` and connects
  // `client` to it.
  bool StartEcho(const std::string& name, const std::string& loop, std::unique_ptr<Child>* child,
                 DealerClient* client) {
    const std::string endpoint = "ipc://" + dir_ + "/" + name + ".sock";
    *child = Child::Spawn({self_, "--echo_server=" + endpoint, "--echo_loop=" + loop,
                           "--reply_bytes=" + std::to_string(reply_bytes_)},
                          dir_ + "/" + name + ".log", &error_);
    if (*child == nullptr || !(*child)->WaitForLine("ready", &error_)) return false;
    client->socket = zmq::socket_t(context_, zmq::socket_type::dealer);
    client->socket.set(zmq::sockopt::linger, 0);
    client->socket.connect(endpoint);
    client->reply_bytes = reply_bytes_;
    client->server_pid = (*child)->pid();
    return true;
  }

  bool Hello(uint64_t epoch) {
    flatbuffers::FlatBufferBuilder builder;
    auto name = builder.CreateString("cache_manager_bench");
    auto hello = wire::CreateHello(builder, wire::Role::Router, ::getpid(), name);
    FinishEnvelope(builder, 0, 0, 0, wire::Message::Hello, hello.Union());
    cm_.socket.send(zmq::buffer(builder.GetBufferPointer(), builder.GetSize()));
    zmq::message_t reply;
    if (!Receive(cm_.socket, reply)) return Fail("no HelloReply");
    const VerifiedEnvelope verified = VerifyEnvelope(Span(reply));
    if (verified.fault != EnvelopeFault::kNone) return Fail("HelloReply: " + verified.reason);
    const wire::HelloReply* hello_reply = verified.envelope->payload_as_HelloReply();
    if (hello_reply == nullptr) return Fail("Hello answered with a non-HelloReply");
    if (hello_reply->epoch() != epoch) return Fail("HelloReply epoch differs from ready line");
    session_id_ = hello_reply->session_id();
    epoch_ = epoch;
    cm_.encoder.set_session(session_id_, epoch_);
    return true;
  }

  bool started_ = false;
  std::string self_;
  std::string error_;
  std::string dir_;
  zmq::context_t context_{1};
  std::unique_ptr<Child> cache_manager_;
  std::unique_ptr<Child> echo_;
  std::unique_ptr<Child> poll_echo_;
  std::unique_ptr<Child> pull_;
  DealerClient cm_;
  DealerClient bare_;
  DealerClient poll_bare_;
  zmq::socket_t push_;
  zmq::socket_t report_;
  size_t request_bytes_ = 0;
  size_t reply_bytes_ = 0;
  uint64_t session_id_ = 0;
  uint64_t epoch_ = 0;
};

std::string g_self;  // this binary, for re-executing it as a baseline server

Environment* StartedEnvironment(benchmark::State& state) {
  Environment& environment = Environment::Get();
  if (!environment.Start(g_self)) {
    state.SkipWithError(environment.error().c_str());
    return nullptr;
  }
  return &environment;
}

// Empty if `reply` is what `client` expects; else what is wrong.
std::string CheckReply(const DealerClient& client, const zmq::message_t& reply) {
  if (client.is_cache_manager) return CheckStepReply(Environment::Span(reply), kOpsPerStep);
  if (reply.size() != client.reply_bytes) return "echo reply of " + std::to_string(reply.size());
  return "";
}

// --- Round trip ------------------------------------------------------------------------------

// The round trips of one client in one measurement.
struct LatencySummary {
  double p50 = 0;  // seconds
  double p99 = 0;
  double mean = 0;
  double server_cpu_us = 0;  // the server process's CPU time (all threads) per round trip
};

// The targets measured together, in the order they take turns.
enum Target : int { kCacheManager, kBare, kBarePollLoop, kTargets };

// One round trip of `client` (send -> poll -> recv, timed; the next step is encoded before
// and the reply checked after); false (and `error` set) on a missing or wrong reply.
bool TimedRoundTrip(DealerClient& client, flatbuffers::FlatBufferBuilder& builder,
                    zmq::message_t& reply, std::vector<double>* samples, std::string* error) {
  client.encoder.Next(builder);
  const auto start = Clock::now();
  client.socket.send(zmq::buffer(builder.GetBufferPointer(), builder.GetSize()));
  if (!Receive(client.socket, reply)) {
    *error = "no reply within the timeout";
    return false;
  }
  const auto end = Clock::now();
  if (samples != nullptr) samples->push_back(std::chrono::duration<double>(end - start).count());
  *error = CheckReply(client, reply);
  return error->empty();
}

LatencySummary Summarize(std::vector<double>& samples, uint64_t server_cpu_ns) {
  std::sort(samples.begin(), samples.end());
  auto at = [&](double p) {
    const auto rank =
        static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(samples.size())));
    return samples[std::max<size_t>(rank, 1) - 1];
  };
  const auto n = static_cast<double>(samples.size());
  return {at(50), at(99), std::accumulate(samples.begin(), samples.end(), 0.0) / n,
          static_cast<double>(server_cpu_ns) / 1e3 / n};
}

// kWarmupRoundTrips, then kRoundTrips timed round trips on each target, taking turns one
// round trip at a time, so that all see the same machine: the load on a shared 2-core
// machine drifts by more than the effect measured.
std::optional<std::array<LatencySummary, kTargets>> MeasureTogether(Environment& environment,
                                                                    std::string* error) {
  const std::array<DealerClient*, kTargets> clients = {
      &environment.cache_manager(), &environment.bare(), &environment.poll_bare()};
  flatbuffers::FlatBufferBuilder builder;
  zmq::message_t reply;
  for (int i = 0; i < kWarmupRoundTrips; ++i) {
    for (DealerClient* client : clients) {
      if (!TimedRoundTrip(*client, builder, reply, nullptr, error)) return std::nullopt;
    }
  }
  std::array<std::vector<double>, kTargets> samples;
  std::array<uint64_t, kTargets> cpu{};
  for (int t = 0; t < kTargets; ++t) {
    samples[t].reserve(kRoundTrips);
    cpu[t] = ProcessCpuNs(clients[t]->server_pid);
  }
  for (int i = 0; i < kRoundTrips; ++i) {
    for (int t = 0; t < kTargets; ++t) {
      if (!TimedRoundTrip(*clients[t], builder, reply, &samples[t], error)) return std::nullopt;
    }
  }
  std::array<LatencySummary, kTargets> summaries;
  for (int t = 0; t < kTargets; ++t) {
    summaries[t] = Summarize(samples[t], ProcessCpuNs(clients[t]->server_pid) - cpu[t]);
  }
  return summaries;
}

// The baselines' parts of measurements made by CacheManagerRoundTrip/P, by target and P,
// waiting for the baselines' repetitions (Google Benchmark runs every repetition of one
// benchmark before the next benchmark).
std::deque<LatencySummary>& Pending(Target target, int percentile) {
  static auto* pending = new std::map<std::pair<int, int>, std::deque<LatencySummary>>();
  return (*pending)[{target, percentile}];
}

void ReportLatency(benchmark::State& state, const LatencySummary& summary) {
  state.SetIterationTime(state.range(0) == 99 ? summary.p99 : summary.p50);
  state.counters["p50_us"] = summary.p50 * 1e6;
  state.counters["p99_us"] = summary.p99 * 1e6;
  state.counters["mean_us"] = summary.mean * 1e6;
  state.counters["server_cpu_us"] = summary.server_cpu_us;
  state.counters["units"] = 1;
}

// Reports `target`'s part of a measurement: for the cache manager a new one (whose baseline
// parts wait in Pending()); for a baseline the waiting part, or a new measurement when
// CacheManagerRoundTrip/P did not run (e.g. under a --benchmark_filter).
void RoundTrip(benchmark::State& state, Target target) {
  Environment* environment = StartedEnvironment(state);
  if (environment == nullptr) return;
  const int percentile = static_cast<int>(state.range(0));
  for (auto _ : state) {
    std::deque<LatencySummary>& pending = Pending(target, percentile);
    if (target != kCacheManager && !pending.empty()) {
      ReportLatency(state, pending.front());
      pending.pop_front();
      continue;
    }
    std::string error;
    auto summaries = MeasureTogether(*environment, &error);
    if (!summaries) {
      state.SkipWithError(error.c_str());
      break;
    }
    ReportLatency(state, (*summaries)[target]);
    if (target == kCacheManager) {
      for (Target baseline : {kBare, kBarePollLoop}) {
        Pending(baseline, percentile).push_back((*summaries)[baseline]);
      }
    }
  }
}

void CacheManagerRoundTrip(benchmark::State& state) { RoundTrip(state, kCacheManager); }
void BareDealerRouter(benchmark::State& state) { RoundTrip(state, kBare); }
void BarePollLoopRouter(benchmark::State& state) { RoundTrip(state, kBarePollLoop); }

BENCHMARK(CacheManagerRoundTrip)->Arg(50)->Arg(99)->Iterations(1)->UseManualTime();
BENCHMARK(BareDealerRouter)->Arg(50)->Arg(99)->Iterations(1)->UseManualTime();
BENCHMARK(BarePollLoopRouter)->Arg(50)->Arg(99)->Iterations(1)->UseManualTime();

// --- Pipelined throughput --------------------------------------------------------------------

// Rates per second of wall time; `server_cpu_ns` is the peer process's CPU time over all
// iterations.
void SetThroughputCounters(benchmark::State& state, int messages, uint64_t server_cpu_ns) {
  state.counters["units"] = messages;
  state.counters["msgs_per_s"] =
      benchmark::Counter(messages, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["ops_per_s"] = benchmark::Counter(static_cast<double>(messages) * kOpsPerStep,
                                                   benchmark::Counter::kIsIterationInvariantRate);
  const double total = static_cast<double>(messages) * static_cast<double>(state.iterations());
  state.counters["server_cpu_us"] = static_cast<double>(server_cpu_ns) / 1e3 / total;
}

// kPipelinedMessages steps with state.range(0) in flight; the steps are encoded and the
// replies checked with the timer paused.
void Pipelined(benchmark::State& state, DealerClient& client) {
  const int window = static_cast<int>(state.range(0));
  std::vector<flatbuffers::FlatBufferBuilder> requests(kPipelinedMessages);
  std::vector<zmq::message_t> replies(kPipelinedMessages);
  uint64_t server_cpu_ns = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (auto& request : requests) client.encoder.Next(request);
    const uint64_t cpu_before = ProcessCpuNs(client.server_pid);
    state.ResumeTiming();
    int sent = 0;
    int received = 0;
    bool timed_out = false;
    while (received < kPipelinedMessages) {
      while (sent < kPipelinedMessages && sent - received < window) {
        const auto& request = requests[static_cast<size_t>(sent++)];
        client.socket.send(zmq::buffer(request.GetBufferPointer(), request.GetSize()));
      }
      if (!Receive(client.socket, replies[static_cast<size_t>(received)])) {
        timed_out = true;
        break;
      }
      ++received;
      while (received < sent && client.socket.recv(replies[static_cast<size_t>(received)],
                                                   zmq::recv_flags::dontwait)) {
        ++received;
      }
    }
    state.PauseTiming();
    server_cpu_ns += ProcessCpuNs(client.server_pid) - cpu_before;
    std::string bad = timed_out ? "no reply within the timeout" : "";
    for (int i = 0; i < received && bad.empty(); ++i) {
      bad = CheckReply(client, replies[static_cast<size_t>(i)]);
    }
    state.ResumeTiming();
    if (!bad.empty()) {
      state.SkipWithError(bad.c_str());
      break;
    }
  }
  SetThroughputCounters(state, kPipelinedMessages, server_cpu_ns);
}

void CacheManagerPipelined(benchmark::State& state) {
  if (Environment* environment = StartedEnvironment(state)) {
    Pipelined(state, environment->cache_manager());
  }
}

// The same window against the bare ROUTER echo server: shows what the reply path costs
// apart from the cache manager (informative second baseline).
void BareDealerRouterPipelined(benchmark::State& state) {
  if (Environment* environment = StartedEnvironment(state)) {
    Pipelined(state, environment->bare());
  }
}

// kPipelinedMessages messages of the step's size, then a one-byte marker; the PULL process
// answers the marker with the count it received since the last one.
void BarePushPull(benchmark::State& state) {
  Environment* environment = StartedEnvironment(state);
  if (environment == nullptr) return;
  zmq::socket_t& push = environment->push();
  zmq::socket_t& report = environment->report();
  const std::vector<uint8_t> payload(environment->request_bytes(), 0x5a);
  const uint8_t marker = 0;
  const uint64_t cpu_before = ProcessCpuNs(environment->pull_pid());
  for (auto _ : state) {
    for (int i = 0; i < kPipelinedMessages; ++i) push.send(zmq::buffer(payload));
    push.send(zmq::buffer(&marker, 1));
    zmq::message_t count;
    if (!Receive(report, count) || count.size() != sizeof(uint64_t)) {
      state.SkipWithError("no count from the PULL process");
      break;
    }
    uint64_t received = 0;
    std::memcpy(&received, count.data(), sizeof(received));
    if (received != kPipelinedMessages) {
      state.SkipWithError("the PULL process counted a different number of messages");
      break;
    }
  }
  SetThroughputCounters(state, kPipelinedMessages,
                        ProcessCpuNs(environment->pull_pid()) - cpu_before);
}

BENCHMARK(CacheManagerPipelined)->Arg(64)->Arg(256)->UseRealTime();
BENCHMARK(BareDealerRouterPipelined)->Arg(64)->Arg(256)->UseRealTime();
BENCHMARK(BarePushPull)->UseRealTime();

// --- In process: the service alone -----------------------------------------------------------

class FakeWatcher : public cache_manager::ProcessWatcher {
 public:
  absl::Status Watch(uint64_t, pid_t) override { return absl::OkStatus(); }
  void Unwatch(uint64_t) override {}
};

// A CacheManagerService built like the server's (a fp16 shm pool of kNumBlocks), with the
// metrics and the process watcher it points to; `hash_algorithm` is the metrics' label.
constexpr uint64_t kBenchEpoch = 42;

struct BenchService {
  explicit BenchService(const cache_manager::CacheManagerMetrics::CacheInfo& info)
      : metrics(info) {}
  cache_manager::CacheManagerMetrics metrics;
  FakeWatcher watcher;
  std::unique_ptr<cache_manager::CacheManagerService> service;
};

// `layer_windows` non-empty: a model of those layers' windows, served with KV cache groups
// (the pool's spec the page's).
absl::StatusOr<std::unique_ptr<BenchService>> MakeBenchService(
    std::string hash_algorithm, int32_t sliding_window = 0,
    const std::vector<int32_t>& layer_windows = {}) {
  KvCacheSpec spec;
  spec.num_layers = layer_windows.empty() ? kLayers : static_cast<int32_t>(layer_windows.size());
  spec.num_kv_heads = kKvHeads;
  spec.head_dim = kHeadDim;
  spec.block_size = kBlockSize;
  spec.dtype = DType::kFloat16;
  KvCacheGroups groups;
  if (!layer_windows.empty()) {
    KVCM_ASSIGN_OR_RETURN(groups, GroupLayers(layer_windows));
    spec = PageSpec(spec, groups);
  }
  cache_manager::CacheManagerMetrics::CacheInfo info;
  info.num_blocks = kNumBlocks;
  info.block_size = kBlockSize;
  info.block_bytes = spec.BytesPerBlock();
  info.pool_bytes = static_cast<uint64_t>(info.block_bytes) * kNumBlocks;
  info.dtype = "fp16";
  info.backend = "shm";
  info.hash_algorithm = std::move(hash_algorithm);
  auto bench = std::make_unique<BenchService>(info);
  cache_manager::CacheManagerService::Options options;
  options.spec = spec;
  options.ledger.num_blocks = kNumBlocks;
  options.ledger.sliding_window_tokens = sliding_window;
  options.kv_groups = groups;
  options.epoch = kBenchEpoch;
  options.heartbeat_interval = absl::Seconds(1);
  options.heartbeat_timeout = absl::Seconds(600);
  KVCM_ASSIGN_OR_RETURN(bench->service,
                        cache_manager::CacheManagerService::Create(options, &bench->watcher,
                                                                   &bench->metrics, absl::Now()));
  return bench;
}

// How ServiceHandle() runs each Handle(): back to back (the caches stay warm), with the
// server loop's per-request work around it, or after the caches were overwritten.
enum class HandleMode { kWarm, kLoop, kCold };

// Overwrites kColdBytes (twice a core's L2 here) so that the next Handle() finds its data in
// the last-level cache at best, as it does after the context switches of a round trip.
constexpr size_t kColdBytes = size_t{8} << 20;
void EvictCaches() {
  static auto* buffer = new std::vector<uint8_t>(kColdBytes);
  for (size_t i = 0; i < buffer->size(); i += 64) ++(*buffer)[i];
  benchmark::ClobberMemory();
}

// The step stream handed to an in-process CacheManagerService built like the server's.
void ServiceHandle(benchmark::State& state, HandleMode mode) {
  const bool loop = mode == HandleMode::kLoop;
  absl::StatusOr<std::unique_ptr<BenchService>> bench = MakeBenchService("sha256");
  if (!bench.ok()) {
    state.SkipWithError(std::string(bench.status().message()).c_str());
    return;
  }
  cache_manager::CacheManagerService& service = *(*bench)->service;
  cache_manager::CacheManagerMetrics& metrics = (*bench)->metrics;
  // What libzmq reports for an ipc:// peer: ":uid:gid:pid".
  const std::string peer_address = ":" + std::to_string(::getuid()) + ":" +
                                   std::to_string(::getgid()) + ":" + std::to_string(::getpid());
  const std::optional<cache_manager::PeerCredentials> peer =
      cache_manager::ParseIpcPeerAddress(peer_address);

  flatbuffers::FlatBufferBuilder request;
  flatbuffers::FlatBufferBuilder reply;
  flatbuffers::FlatBufferBuilder events;
  {
    auto hello = wire::CreateHello(request, wire::Role::Router, ::getpid());
    FinishEnvelope(request, 0, 0, 0, wire::Message::Hello, hello.Union());
    service.Handle(peer, BufferSpan(request), absl::Now(), &reply);
    const VerifiedEnvelope verified = VerifyEnvelope(BufferSpan(reply));
    const wire::HelloReply* hello_reply =
        verified.envelope == nullptr ? nullptr : verified.envelope->payload_as_HelloReply();
    if (hello_reply == nullptr) {
      state.SkipWithError("Hello refused");
      return;
    }
    StepEncoder encoder;
    encoder.set_session(hello_reply->session_id(), kBenchEpoch);
    encoder.Prime(request);
    service.Handle(peer, BufferSpan(request), absl::Now(), &reply);
    if (std::string bad = CheckStepReply(BufferSpan(reply), kSeqsPerStep); !bad.empty()) {
      state.SkipWithError(bad.c_str());
      return;
    }
    // Steps are encoded ahead in batches with the timer paused.
    constexpr size_t kBatch = 4096;
    std::vector<flatbuffers::FlatBufferBuilder> steps(kBatch);
    size_t next = kBatch;
    int64_t checked = 0;
    for (auto _ : state) {
      if (next == kBatch) {
        state.PauseTiming();
        for (auto& step : steps) encoder.Next(step);
        next = 0;
        state.ResumeTiming();
      }
      if (loop) {
        std::optional<cache_manager::PeerCredentials> parsed =
            cache_manager::ParseIpcPeerAddress(peer_address);
        benchmark::DoNotOptimize(parsed);
        service.Handle(parsed, BufferSpan(steps[next++]), absl::Now(), &reply);
        benchmark::DoNotOptimize(absl::Now());
        benchmark::DoNotOptimize(service.TakeEventBatch(&events));
        metrics.PublishSnapshot(service.Snapshot());
        benchmark::DoNotOptimize(absl::Now());
      } else {
        if (mode == HandleMode::kCold) {
          state.PauseTiming();
          EvictCaches();
          state.ResumeTiming();
        }
        service.Handle(peer, BufferSpan(steps[next++]), absl::Now(), &reply);
      }
      // The first and every 1024th reply are checked (the check costs about as much as
      // a sixth of Handle itself).
      if ((checked++ & 1023) == 0) {
        if (std::string bad = CheckStepReply(BufferSpan(reply), kOpsPerStep); !bad.empty()) {
          state.SkipWithError(bad.c_str());
          break;
        }
      }
    }
  }
  state.counters["units"] = 1;
  state.counters["ops_per_s"] =
      benchmark::Counter(kOpsPerStep, benchmark::Counter::kIsIterationInvariantRate);
}

// Empty when `bytes` is a StepReply with `ops` results, every one Ok.
std::string CheckAllOk(std::span<const uint8_t> bytes, size_t ops) {
  const VerifiedEnvelope verified = VerifyEnvelope(bytes);
  if (verified.fault != EnvelopeFault::kNone) return "reply refused: " + verified.reason;
  const wire::StepReply* reply = verified.envelope->payload_as_StepReply();
  if (reply == nullptr || reply->results() == nullptr) return "not a StepReply";
  if (reply->results()->size() != ops) return "wrong number of results";
  for (const wire::OpResult* result : *reply->results()) {
    if (result->code() != wire::ErrorCode::Ok) {
      return std::string(WireCodeName(result->code())) + " " +
             (result->reason() != nullptr ? result->reason()->str() : "");
    }
  }
  return "";
}

// ServiceHandleDecodeStep/{once_a_block,once_a_token}/N: Handle() on DecodeStepStream(N)'s
// steps. .../once_a_block_window64/N: the same steps to a cache manager that releases each
// sequence's blocks behind a sliding window of 64 tokens (a block at every block boundary
// past the first 64 tokens: most of each sequence's 16 blocks go back before its Free).
void ServiceHandleDecodeStep(benchmark::State& state, bool once_a_block, int32_t sliding_window = 0,
                             const std::vector<int32_t>& layer_windows = {}) {
  const int n = static_cast<int>(state.range(0));
  absl::StatusOr<std::unique_ptr<BenchService>> bench =
      MakeBenchService("xxh3_v2", sliding_window, layer_windows);
  if (!bench.ok()) {
    state.SkipWithError(std::string(bench.status().message()).c_str());
    return;
  }
  cache_manager::CacheManagerService& service = *(*bench)->service;
  const std::optional<cache_manager::PeerCredentials> peer = cache_manager::ParseIpcPeerAddress(
      ":" + std::to_string(::getuid()) + ":" + std::to_string(::getgid()) + ":" +
      std::to_string(::getpid()));
  flatbuffers::FlatBufferBuilder request;
  flatbuffers::FlatBufferBuilder reply;
  auto hello = wire::CreateHello(request, wire::Role::Router, ::getpid());
  FinishEnvelope(request, 0, 0, 0, wire::Message::Hello, hello.Union());
  service.Handle(peer, BufferSpan(request), absl::Now(), &reply);
  const VerifiedEnvelope verified = VerifyEnvelope(BufferSpan(reply));
  const wire::HelloReply* hello_reply =
      verified.envelope == nullptr ? nullptr : verified.envelope->payload_as_HelloReply();
  if (hello_reply == nullptr) {
    state.SkipWithError("Hello refused");
    return;
  }
  const uint64_t session = hello_reply->session_id();
  DecodeStepStream stream(n, once_a_block);
  uint64_t request_id = 0;
  request.Clear();
  KVCM_CHECK(EncodeStep(request, ++request_id, session, kBenchEpoch, stream.Prime()).ok());
  service.Handle(peer, BufferSpan(request), absl::Now(), &reply);
  if (std::string bad = CheckAllOk(BufferSpan(reply), static_cast<size_t>(n)); !bad.empty()) {
    state.SkipWithError(bad.c_str());
    return;
  }
  constexpr size_t kBatch = 256;  // steps encoded ahead with the timer paused
  std::vector<flatbuffers::FlatBufferBuilder> steps(kBatch);
  std::vector<size_t> sizes(kBatch);
  size_t next = kBatch;
  int64_t handled = 0;
  uint64_t ops = 0;
  for (auto _ : state) {
    if (next == kBatch) {
      state.PauseTiming();
      for (size_t i = 0; i < kBatch; ++i) {
        const std::vector<BlockOp>& step = stream.Next();
        sizes[i] = step.size();
        steps[i].Clear();
        KVCM_CHECK(EncodeStep(steps[i], ++request_id, session, kBenchEpoch, step).ok());
      }
      next = 0;
      state.ResumeTiming();
    }
    service.Handle(peer, BufferSpan(steps[next]), absl::Now(), &reply);
    ops += sizes[next];
    // The first and every 64th reply are checked, outside the timed region.
    if ((handled++ & 63) == 0) {
      state.PauseTiming();
      std::string bad = CheckAllOk(BufferSpan(reply), sizes[next]);
      state.ResumeTiming();
      if (!bad.empty()) {
        state.SkipWithError(bad.c_str());
        break;
      }
    }
    ++next;
  }
  state.counters["units"] = 1;
  state.counters["ops_per_step"] =
      static_cast<double>(ops) / static_cast<double>(std::max<int64_t>(handled, 1));
}

// LedgerDecodeStep/{once_a_block,once_a_token}/N: the same steps' ops applied straight to a
// BlockLedger.
void LedgerDecodeStep(benchmark::State& state, bool once_a_block) {
  const int n = static_cast<int>(state.range(0));
  BlockLedger::Options options;
  options.num_blocks = kNumBlocks;
  options.block_size = kBlockSize;
  BlockLedger ledger = *BlockLedger::Create(options);
  DecodeStepStream stream(n, once_a_block);
  auto apply = [&ledger](const std::vector<BlockOp>& step) {
    for (const BlockOp& op : step) {
      absl::Status status;
      switch (op.kind) {
        case wire::StepOp::AllocateOp:
          status = ledger.Allocate(op.seq, op.num_tokens, op.hashes).status();
          break;
        case wire::StepOp::CommitOp:
          status = ledger.Commit(op.seq, op.num_tokens, op.hashes);
          break;
        case wire::StepOp::AppendOp:
          status = ledger.Append(op.seq, op.num_tokens).status();
          break;
        case wire::StepOp::FreeOp:
          status = ledger.Free(op.seq);
          break;
        default:
          KVCM_CHECK(false) << "op the decode stream does not make";
      }
      KVCM_CHECK(status.ok()) << status;
    }
  };
  apply(stream.Prime());
  constexpr size_t kBatch = 256;  // as ServiceHandleDecodeStep: ops built with the timer paused
  std::vector<std::vector<BlockOp>> steps(kBatch);
  size_t next = kBatch;
  for (auto _ : state) {
    if (next == kBatch) {
      state.PauseTiming();
      for (auto& step : steps) step = stream.Next();
      next = 0;
      state.ResumeTiming();
    }
    apply(steps[next++]);
  }
  state.counters["units"] = 1;
}

void ServiceHandleStep(benchmark::State& state) { ServiceHandle(state, HandleMode::kWarm); }
void ServiceHandleStepAndLoop(benchmark::State& state) { ServiceHandle(state, HandleMode::kLoop); }
void ServiceHandleStepCold(benchmark::State& state) { ServiceHandle(state, HandleMode::kCold); }

BENCHMARK(ServiceHandleStep);
BENCHMARK(ServiceHandleStepAndLoop);
BENCHMARK(ServiceHandleStepCold)->MinTime(0.2);
BENCHMARK_CAPTURE(ServiceHandleDecodeStep, once_a_block, true)->Arg(64)->Arg(256);
BENCHMARK_CAPTURE(ServiceHandleDecodeStep, once_a_block_window64, true, 64)->Arg(64)->Arg(256);
// KV cache groups: a full layer and a window layer of 64 tokens (2 groups), and a Gemma-3-like
// model of one full and six window layers (7 groups); each sequence's ops reach every group.
BENCHMARK_CAPTURE(ServiceHandleDecodeStep, once_a_block_groups2, true, 0,
                  std::vector<int32_t>{0, 64})
    ->Arg(64)
    ->Arg(256);
BENCHMARK_CAPTURE(ServiceHandleDecodeStep, once_a_block_groups7, true, 0,
                  std::vector<int32_t>{64, 64, 64, 64, 64, 0, 64})
    ->Arg(64)
    ->Arg(256);
BENCHMARK_CAPTURE(LedgerDecodeStep, once_a_block, true)->Arg(64)->Arg(256);
BENCHMARK_CAPTURE(ServiceHandleDecodeStep, once_a_token, false)->Arg(64)->Arg(256);
BENCHMARK_CAPTURE(LedgerDecodeStep, once_a_token, false)->Arg(64)->Arg(256);

// --- Baseline servers (this binary re-executed) ----------------------------------------------

// A bare ROUTER: answers every request with `reply_bytes` bytes. Runs until killed.
// With `poll_loop`, its loop is shaped like CacheManagerServer::Run's and does nothing else:
// zmq_poll over the ROUTER and three more file descriptors (an eventfd standing in for the
// signalfd and the fd channel's listening socket, and a pidfd of the client, which is this
// process's parent), then draining with dontwait receives, reading Peer-Address, and
// replying with dontwait sends. Without it, it blocks in recv.
int RunEchoServer(const std::string& endpoint, size_t reply_bytes, bool poll_loop) {
  zmq::context_t context(1);
  zmq::socket_t router(context, zmq::socket_type::router);
  router.bind(endpoint);
  const std::vector<uint8_t> reply(reply_bytes, 0x5a);
  const int signal_like = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  const int listen_like = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  const auto client_pidfd = static_cast<int>(::syscall(SYS_pidfd_open, ::getppid(), 0));
  std::printf("ready\n");
  std::fflush(stdout);
  while (!poll_loop) {
    zmq::message_t identity;
    zmq::message_t body;
    if (!router.recv(identity) || !identity.more() || !router.recv(body)) continue;
    router.send(identity, zmq::send_flags::sndmore);
    router.send(zmq::buffer(reply));
  }
  while (true) {
    zmq::pollitem_t items[] = {{router.handle(), 0, ZMQ_POLLIN, 0},
                               {nullptr, signal_like, ZMQ_POLLIN, 0},
                               {nullptr, listen_like, ZMQ_POLLIN, 0},
                               {nullptr, client_pidfd, ZMQ_POLLIN, 0}};
    zmq::poll(items, client_pidfd >= 0 ? 4 : 3, std::chrono::milliseconds(500));
    if ((items[0].revents & ZMQ_POLLIN) == 0) continue;
    for (int handled = 0; handled < 256; ++handled) {
      zmq::message_t identity;
      zmq::message_t body;
      if (!router.recv(identity, zmq::recv_flags::dontwait)) break;
      if (!identity.more() || !router.recv(body, zmq::recv_flags::dontwait)) continue;
      benchmark::DoNotOptimize(zmq_msg_gets(body.handle(), "Peer-Address"));
      router.send(identity, zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      router.send(zmq::buffer(reply), zmq::send_flags::dontwait);
    }
  }
}

// A bare PULL: counts messages; a one-byte marker is answered on `report_endpoint` with the
// count since the last marker (8 bytes). Runs until killed.
int RunPullServer(const std::string& endpoint, const std::string& report_endpoint) {
  zmq::context_t context(1);
  zmq::socket_t pull(context, zmq::socket_type::pull);
  pull.bind(endpoint);
  zmq::socket_t report(context, zmq::socket_type::push);
  report.bind(report_endpoint);
  std::printf("ready\n");
  std::fflush(stdout);
  uint64_t count = 0;
  while (true) {
    zmq::message_t message;
    if (!pull.recv(message)) continue;
    if (message.size() != 1) {
      ++count;
      continue;
    }
    report.send(zmq::buffer(&count, sizeof(count)));
    count = 0;
  }
}

std::optional<std::string> FlagValue(int argc, char** argv, std::string_view name) {
  const std::string prefix = "--" + std::string(name) + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]).rfind(prefix, 0) == 0)
      return std::string(argv[i] + prefix.size());
  }
  return std::nullopt;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  if (auto endpoint = kvcm::FlagValue(argc, argv, "echo_server")) {
    const auto bytes = kvcm::FlagValue(argc, argv, "reply_bytes");
    const auto loop = kvcm::FlagValue(argc, argv, "echo_loop");
    return kvcm::RunEchoServer(*endpoint, bytes ? std::stoul(*bytes) : 0,
                               loop.has_value() && *loop == "poll");
  }
  if (auto endpoint = kvcm::FlagValue(argc, argv, "pull_server")) {
    const auto report = kvcm::FlagValue(argc, argv, "report_endpoint");
    return report ? kvcm::RunPullServer(*endpoint, *report) : 1;
  }
  // This binary, re-executed for the baseline servers.
  std::error_code error;
  kvcm::g_self = std::filesystem::read_symlink("/proc/self/exe", error).string();
  if (error) kvcm::g_self = argv[0];
  ::signal(SIGPIPE, SIG_IGN);
  kvcm::bench::RatioReporter reporter;
  reporter.AddPair("CacheManagerRoundTrip/", "BareDealerRouter/", 1.10, "round trip");
  // Informative: the bare ROUTER with the cache manager's loop shape, against the plain one
  // (what the loop costs) and the cache manager against it (what the service adds).
  reporter.AddPair("BarePollLoopRouter/", "BareDealerRouter/", 1.10, "round trip");
  reporter.AddPair("CacheManagerRoundTrip/", "BarePollLoopRouter/", 1.10, "round trip");
  reporter.AddPair("CacheManagerPipelined/64/", "BarePushPull/", 2.0, "message");
  reporter.AddPair("CacheManagerPipelined/256/", "BarePushPull/", 2.0, "message");
  // Informative: the same window against the bare ROUTER (the reply path included).
  reporter.AddPair("CacheManagerPipelined/", "BareDealerRouterPipelined/", 2.0, "message");
  // Informative: what the service adds to the ledger's own work on the router's step shape.
  reporter.AddPair("ServiceHandleDecodeStep/", "LedgerDecodeStep/", 0, "step");
  // The window's releases must not cost a second pass over a step.
  reporter.AddPair("ServiceHandleDecodeStep/once_a_block_window64/",
                   "ServiceHandleDecodeStep/once_a_block/", 1.10, "step");
  // KV cache groups against the same sequences in one table.
  reporter.AddPair("ServiceHandleDecodeStep/once_a_block_groups2/",
                   "ServiceHandleDecodeStep/once_a_block/", 1.10, "step");
  reporter.AddPair("ServiceHandleDecodeStep/once_a_block_groups7/",
                   "ServiceHandleDecodeStep/once_a_block/", 1.10, "step");
  const int rc = kvcm::bench::RunWithRatios(argc, argv, reporter);
  kvcm::Environment::Get().Stop();
  return rc;
}
