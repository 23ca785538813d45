// The real kvcm-cache-manager against what a hostile or buggy peer does (docs/RELIABILITY.md,
// "Security"): a process of another Unix user asking for a session and for the pool's
// memfd; every limit on what one message or one peer can make it hold, hit over the real
// socket; and its log, which must never carry the tcp:// secret or the pool's handles.
// Each refusal must be clear (an ErrorReply naming the limit), counted by reason in
// kvcm_cache_manager_rejected_messages_total, and leave the ledger whole.

#include <sys/stat.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"
#include "common/base/run_dir.h"
#include "common/memory/fd_channel.h"
#include "common/transport/zmq_util.h"
#include "common/wire/step_codec.h"
#include "gmock/gmock.h"
#include "tests/services/cache_manager/live_cache_manager.h"
#include "tests/support/gpu_test.h"
#include "tests/support/status_matchers.h"

namespace kvcm::live_test {
namespace {

using ::testing::HasSubstr;

constexpr uid_t kNobody = 65534;

// The command line prefix that runs a program as `nobody`: setpriv when this test runs as
// root, else passwordless sudo. nullopt (with `why`) when neither is possible.
std::optional<std::vector<std::string>> AsNobody(std::string* why) {
  if (::geteuid() == 0) {
    if (auto setpriv = kvcm::testing::FindProgram("setpriv"); setpriv.ok()) {
      return std::vector<std::string>{*setpriv, "--reuid=65534", "--regid=65534", "--clear-groups",
                                      "--"};
    }
  }
  if (auto sudo = kvcm::testing::FindProgram("sudo"); sudo.ok()) {
    auto probe =
        kvcm::testing::RunProgram({*sudo, "-n", "-u", "nobody", "true"}, "", absl::Seconds(10));
    if (probe.ok() && probe->exit_code == 0) {
      return std::vector<std::string>{*sudo, "-n", "-u", "nobody", "--"};
    }
  }
  *why = ::geteuid() == 0 ? "setpriv (util-linux) is not installed"
                          : "neither root nor passwordless sudo (sudo -n -u nobody)";
  return std::nullopt;
}

double Rejected(const CacheManagerProcess& manager, const std::string& reason) {
  return MetricValue(manager.metrics_url(), "kvcm_cache_manager_rejected_messages_total",
                     {{"reason", reason}});
}

TEST(CacheManagerSecurityTest, AnotherUsersClientGetsNoSessionAndNoPoolFdAndIsCounted) {
  std::string why;
  const std::optional<std::vector<std::string>> as_nobody = AsNobody(&why);
  if (!as_nobody) GTEST_SKIP() << "a second Unix user is needed: " << why;
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  auto observer = Connect(*manager, wire::Role::Control);
  ASSERT_NE(observer, nullptr);
  // The run directory's mode 0700 and the sockets' modes stop another user at connect().
  // Open them, as a deployment sharing the directory with a group would, so that what is
  // tested is the cache manager's own check of the uid the kernel reports.
  const std::string request_socket = manager->run_dir() + "/cache-manager.sock";
  const std::string channel = manager->run_dir() + "/" + kFdChannelSocket;
  ASSERT_EQ(::chmod(manager->run_dir().c_str(), 0711), 0);
  ASSERT_EQ(::chmod(request_socket.c_str(), 0777), 0);
  ASSERT_EQ(::chmod(channel.c_str(), 0777), 0);

  std::vector<std::string> argv = *as_nobody;
  argv.push_back(FOREIGN_CLIENT_PATH);
  argv.push_back(manager->endpoint());
  argv.push_back(channel);
  auto run = kvcm::testing::RunProgram(argv, "", absl::Seconds(180));
  ASSERT_THAT(run, IsOk());
  std::printf("%s", run->output.c_str());
  EXPECT_THAT(run->output, HasSubstr(absl::StrCat("uid ", kNobody)));
  EXPECT_EQ(run->exit_code, 0) << "another user was served:\n" << run->output;
  EXPECT_THAT(run->output, HasSubstr("hello: refused PermissionDenied: uid 65534"));
  EXPECT_THAT(run->output, HasSubstr("pool fd: closed without a descriptor"));

  // The real kvcmctl as that user says why, and is refused the same way.
  std::vector<std::string> ctl = *as_nobody;
  ctl.insert(ctl.end(), {kvcm::testing::KvcmBinaryPath("kvcmctl"), "stats", "--endpoint",
                         manager->endpoint(), "--timeout", "60s"});
  auto stats_run = kvcm::testing::RunProgram(ctl, "", absl::Seconds(120));
  ASSERT_THAT(stats_run, IsOk());
  EXPECT_EQ(stats_run->exit_code, 1) << stats_run->output;
  EXPECT_THAT(stats_run->output, HasSubstr("may not use this cache manager")) << stats_run->output;

  // Three refusals (two Hellos, one fd request), counted alike by StatsReply and /metrics;
  // the manager's log names each; no session was opened and nothing changed.
  auto stats = observer->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->rejected_messages, 3u);
  EXPECT_EQ(Rejected(*manager, "permission_denied"), 3);
  EXPECT_EQ(
      MetricValue(manager->metrics_url(), "kvcm_cache_manager_sessions", {{"role", "router"}}), 0);
  EXPECT_THAT(manager->Output(), HasSubstr("peer uid 65534 is not allowed"));
  EXPECT_EQ(stats->in_use_blocks, 0);
  ExpectWhole(*stats);
}

// kvcm-cache-manager on `run_dir`; its exit code and output (it is stopped if it started).
kvcm::testing::RunResult StartOn(const std::string& run_dir) {
  CacheManagerOptions options;
  options.run_dir = run_dir;
  auto manager = CacheManagerProcess::Start(options);
  if (manager.ok()) return {0, (*manager)->Output()};
  return {1, std::string(manager.status().message())};
}

TEST(CacheManagerSecurityTest, ARunDirectoryOthersCanWriteOrOwnIsRefusedAndANarrowOneMadePrivate) {
  auto dir = kvcm::testing::TempDir::Create("kvcm-sec");
  ASSERT_THAT(dir, IsOk());
  // Group- or world-writable: others could have planted files in it.
  for (mode_t mode : {0777, 0770, 01777}) {
    const std::string run = absl::StrCat(dir->path(), "/open", mode);
    ASSERT_EQ(::mkdir(run.c_str(), 0700), 0);
    ASSERT_EQ(::chmod(run.c_str(), mode), 0);
    const kvcm::testing::RunResult refused = StartOn(run);
    EXPECT_EQ(refused.exit_code, 1) << refused.output;
    EXPECT_THAT(refused.output, HasSubstr("can be written by other users")) << refused.output;
    struct stat st {};
    ASSERT_EQ(::stat((run + "/cache-manager.lock").c_str(), &st), -1) << "it used " << run;
  }
  // Readable by others only: made private, then used.
  const std::string narrow = dir->path() + "/narrow";
  ASSERT_EQ(::mkdir(narrow.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(narrow.c_str(), 0755), 0);
  const kvcm::testing::RunResult started = StartOn(narrow);
  EXPECT_EQ(started.exit_code, 0) << started.output;
  struct stat st {};
  ASSERT_EQ(::stat(narrow.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  // Another user's: refused (making one needs root).
  const std::string foreign = dir->path() + "/foreign";
  ASSERT_EQ(::mkdir(foreign.c_str(), 0700), 0);
  if (::chown(foreign.c_str(), kNobody, kNobody) != 0) {
    GTEST_SKIP() << "giving a directory to another user needs root";
  }
  const kvcm::testing::RunResult foreign_run = StartOn(foreign);
  EXPECT_EQ(foreign_run.exit_code, 1) << foreign_run.output;
  EXPECT_THAT(foreign_run.output, HasSubstr("belongs to uid 65534")) << foreign_run.output;
}

// A manager whose limits are small enough to reach with a few messages.
std::unique_ptr<CacheManagerProcess> StartLimited(std::vector<std::string> limits) {
  CacheManagerOptions options;
  options.num_blocks = 256;
  options.block_size = kBlockSize;
  // Raw sessions send no heartbeats: none may expire while a loaded machine is slow.
  options.heartbeat_timeout_ms = kGenerousHeartbeatTimeoutMs;
  options.extra_args = std::move(limits);
  auto manager = CacheManagerProcess::Start(options);
  EXPECT_THAT(manager, IsOk());
  return manager.ok() ? *std::move(manager) : nullptr;
}

// A raw DEALER's own router session (Hello as this process), for messages the client
// library refuses to send.
struct RawSession {
  zmq::socket_t dealer;
  uint64_t session = 0;
  uint64_t epoch = 0;
};

RawSession OpenRaw(zmq::context_t& context, const CacheManagerProcess& manager,
                   wire::Role role = wire::Role::Router) {
  RawSession raw{RawDealer(context, manager)};
  flatbuffers::FlatBufferBuilder b;
  auto hello = wire::CreateHello(b, role, ::getpid());
  FinishEnvelope(b, 1, 0, 0, wire::Message::Hello, hello.Union());
  raw.dealer.send(zmq::const_buffer(b.GetBufferPointer(), b.GetSize()), zmq::send_flags::none);
  zmq::message_t reply;
  EXPECT_TRUE(raw.dealer.recv(reply));
  AlignFrame(reply);
  const VerifiedEnvelope verified = VerifyEnvelope(FrameBytes(reply));
  EXPECT_EQ(verified.fault, EnvelopeFault::kNone);
  if (verified.fault == EnvelopeFault::kNone &&
      verified.envelope->payload_type() == wire::Message::HelloReply) {
    raw.session = verified.envelope->payload_as_HelloReply()->session_id();
    raw.epoch = verified.envelope->payload_as_HelloReply()->epoch();
  }
  EXPECT_NE(raw.session, 0u);
  return raw;
}

// Sends `bytes` and returns the ErrorReply's "CODE: reason", or "" for any other reply.
std::string SendExpectingRefusal(zmq::socket_t& dealer, std::span<const uint8_t> bytes) {
  dealer.send(zmq::const_buffer(bytes.data(), bytes.size()), zmq::send_flags::none);
  zmq::message_t reply;
  if (!dealer.recv(reply)) return "no reply";
  AlignFrame(reply);
  const VerifiedEnvelope verified = VerifyEnvelope(FrameBytes(reply));
  if (verified.fault != EnvelopeFault::kNone) return "unreadable reply";
  const wire::ErrorReply* error = verified.envelope->payload_as_ErrorReply();
  if (error == nullptr) return "";
  return absl::StrCat(wire::EnumNameErrorCode(error->code()), ": ",
                      error->reason() != nullptr ? error->reason()->str() : "");
}

void ExpectWholeAndEmpty(CacheManagerClient& client) {
  auto stats = client.Stats();
  ASSERT_THAT(stats, IsOk());
  ExpectWhole(*stats);
  EXPECT_EQ(stats->in_use_blocks, 0) << "a refused message left blocks allocated";
  EXPECT_EQ(stats->live_sequences, 0);
}

TEST(CacheManagerSecurityTest, ASessionTouchesOnlyItsOwnSequences) {
  auto manager = StartLimited({});
  ASSERT_NE(manager, nullptr);
  auto owner = Connect(*manager);
  ASSERT_NE(owner, nullptr);
  auto other = Connect(*manager);
  ASSERT_NE(other, nullptr);
  BlockOps mine;
  mine.Allocate(5, 3 * kBlockSize);
  auto allocated = owner->Step(mine);
  ASSERT_THAT(allocated, IsOk());
  ASSERT_THAT((*allocated)[0].status, IsOk());
  const std::vector<int32_t> blocks = (*allocated)[0].blocks;
  auto before = owner->Stats();
  ASSERT_THAT(before, IsOk());
  // Each op on sequence 5 from the other session is refused, and nothing changes.
  std::vector<BlockOps> attempts(4);
  attempts[0].Append(5, 1);
  attempts[1].Free(5);
  attempts[2].Commit(5, kBlockSize);
  attempts[3].Fork(5, 6);
  for (const BlockOps& attempt : attempts) {
    auto refused = other->Step(attempt);
    EXPECT_TRUE(absl::IsPermissionDenied(refused.status())) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()),
                HasSubstr("sequence 5 belongs to another session"));
  }
  EXPECT_EQ(Rejected(*manager, "wrong_owner"), 4);
  auto after = owner->Stats();
  ASSERT_THAT(after, IsOk());
  EXPECT_EQ(after->in_use_blocks, before->in_use_blocks);
  EXPECT_EQ(after->live_sequences, 1);
  ExpectWhole(*after);
  // The owner still holds its blocks and frees them.
  BlockOps free;
  free.Free(5);
  auto freed = owner->Step(free);
  ASSERT_THAT(freed, IsOk());
  EXPECT_THAT((*freed)[0].status, IsOk());
  ExpectWholeAndEmpty(*owner);
  EXPECT_EQ(blocks.size(), 3u);
}

TEST(CacheManagerSecurityTest, AMessageOverMaxMessageBytesIsRefusedAsOversized) {
  auto manager = StartLimited({"--max-message-bytes", "65536"});
  ASSERT_NE(manager, nullptr);
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->session().max_message_bytes, 65536u);
  zmq::context_t context(1);
  zmq::socket_t dealer = RawDealer(context, *manager);
  // A Stats request padded past the limit (but under the socket's 2x drop): answered.
  std::vector<uint8_t> big(100 << 10, 0);
  {
    flatbuffers::FlatBufferBuilder b;
    FinishEnvelope(b, 7, client->session_id(), client->epoch(), wire::Message::Stats,
                   wire::CreateStats(b).Union());
    std::memcpy(big.data(), b.GetBufferPointer(), b.GetSize());
  }
  const std::string refusal = SendExpectingRefusal(dealer, big);
  EXPECT_THAT(refusal, HasSubstr("Malformed"));
  EXPECT_THAT(refusal, HasSubstr("65536")) << refusal;
  EXPECT_EQ(Rejected(*manager, "oversized"), 1);

  // A Step whose reply could pass the limit is refused before it runs: nothing allocated.
  BlockOps step;
  for (SeqId seq = 1; seq <= 200; ++seq) step.Allocate(seq, 256 * kBlockSize);
  auto outcome = client->Step(step);
  EXPECT_TRUE(absl::IsInvalidArgument(outcome.status())) << outcome.status();
  EXPECT_THAT(std::string(outcome.status().message()), HasSubstr("65536-byte message limit"));
  EXPECT_EQ(Rejected(*manager, "oversized"), 2);
  ExpectWholeAndEmpty(*client);
}

TEST(CacheManagerSecurityTest, AStepOverMaxOpsPerStepIsRefusedWhole) {
  auto manager = StartLimited({"--max-ops-per-step", "8"});
  ASSERT_NE(manager, nullptr);
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  // The client library refuses it on its own side...
  BlockOps nine;
  for (SeqId seq = 1; seq <= 9; ++seq) nine.Allocate(seq, kBlockSize);
  auto local = client->Step(nine);
  EXPECT_TRUE(absl::IsInvalidArgument(local.status())) << local.status();
  // ... and the cache manager refuses one sent anyway.
  zmq::context_t context(1);
  RawSession raw = OpenRaw(context, *manager);
  flatbuffers::FlatBufferBuilder b;
  ASSERT_THAT(EncodeStep(b, 2, raw.session, raw.epoch, nine.ops()), IsOk());
  const std::string refusal = SendExpectingRefusal(raw.dealer, {b.GetBufferPointer(), b.GetSize()});
  EXPECT_THAT(refusal, HasSubstr("step of 9 ops exceeds the limit of 8")) << refusal;
  EXPECT_EQ(Rejected(*manager, "oversized"), 1);
  // Eight are fine, and freed again.
  BlockOps eight;
  for (SeqId seq = 1; seq <= 8; ++seq) eight.Allocate(seq, kBlockSize);
  ASSERT_THAT(client->Step(eight), IsOk());
  BlockOps free;
  for (SeqId seq = 1; seq <= 8; ++seq) free.Free(seq);
  ASSERT_THAT(client->Step(free), IsOk());
  ExpectWholeAndEmpty(*client);
}

TEST(CacheManagerSecurityTest, MoreBlockHashesThanMaxHashesPerMessageAreRefused) {
  auto manager = StartLimited({"--max-hashes-per-message", "4"});
  ASSERT_NE(manager, nullptr);
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  std::vector<BlockHash> hashes(5);
  for (size_t i = 0; i < hashes.size(); ++i) hashes[i].bytes[0] = static_cast<uint8_t>(i + 1);
  BlockOps step;
  step.Allocate(1, 5 * kBlockSize, hashes);
  auto outcome = client->Step(step);
  EXPECT_FALSE(outcome.ok());
  EXPECT_THAT(std::string(outcome.status().message()), HasSubstr("more than 4 block hashes"))
      << outcome.status();
  auto lookup = client->Lookup(hashes);
  EXPECT_TRUE(absl::IsInvalidArgument(lookup.status())) << lookup.status();
  EXPECT_THAT(std::string(lookup.status().message()), HasSubstr("exceed the limit of 4"));
  EXPECT_EQ(Rejected(*manager, "oversized"), 2);
  // Four pass.
  auto four = client->Lookup(std::span<const BlockHash>(hashes).first(4));
  EXPECT_THAT(four, IsOk());
  ExpectWholeAndEmpty(*client);
}

TEST(CacheManagerSecurityTest, SessionsPastMaxSessionsAndPerProcessAreRefused) {
  auto manager = StartLimited({"--max-sessions", "3", "--max-sessions-per-process", "2"});
  ASSERT_NE(manager, nullptr);
  auto first = Connect(*manager);
  ASSERT_NE(first, nullptr);
  auto second = Connect(*manager, wire::Role::Control);
  ASSERT_NE(second, nullptr);
  // A third session of this process.
  CacheManagerClient::Options options;
  options.endpoint = manager->endpoint();
  options.role = wire::Role::Router;
  options.heartbeats = false;
  auto third = CacheManagerClient::Connect(options);
  EXPECT_TRUE(absl::IsResourceExhausted(third.status())) << third.status();
  EXPECT_THAT(std::string(third.status().message()),
              HasSubstr("holds 2 sessions, the limit per process"));
  // Another process takes the last session; then even a new process is refused.
  absl::flat_hash_set<int32_t> held;
  auto dir = kvcm::testing::TempDir::Create("kvcm-sec");
  ASSERT_THAT(dir, IsOk());
  Subprocess::Options holder_options;
  holder_options.argv = {FAULT_CLIENT_PATH, "--endpoint", manager->endpoint(), "--blocks", "4"};
  holder_options.output_path = dir->path() + "/holder";
  auto holder = Subprocess::Start(holder_options);
  ASSERT_THAT(holder, IsOk());
  ASSERT_THAT((*holder)->WaitForLine("ready session=", absl::Now() + absl::Seconds(30)), IsOk())
      << (*holder)->Output();
  auto ctl = kvcm::testing::RunProgram({kvcm::testing::KvcmBinaryPath("kvcmctl"), "stats",
                                        "--endpoint", manager->endpoint(), "--timeout", "60s"},
                                       "", absl::Seconds(120));
  ASSERT_THAT(ctl, IsOk());
  EXPECT_EQ(ctl->exit_code, 1) << ctl->output;
  EXPECT_THAT(ctl->output, HasSubstr("holds 3 sessions, its limit")) << ctl->output;
  EXPECT_EQ(Rejected(*manager, "limit_exceeded"), 2);
  // When the holder dies its session ends (its pidfd) and its blocks come back; a new
  // process gets a session again, this one still not a third.
  (*holder)->Stop(absl::Seconds(5));
  const absl::Status ended = kvcm::testing::WaitFor(
      [&] {
        return MetricValue(manager->metrics_url(), "kvcm_cache_manager_sessions",
                           {{"role", "router"}}) == 1;
      },
      absl::Seconds(60), "the holder's session to end");
  ASSERT_THAT(ended, IsOk());
  EXPECT_TRUE(absl::IsResourceExhausted(CacheManagerClient::Connect(options).status()));
  EXPECT_EQ(Rejected(*manager, "limit_exceeded"), 3);
  auto from_ctl = kvcm::testing::RunProgram({kvcm::testing::KvcmBinaryPath("kvcmctl"), "stats",
                                             "--endpoint", manager->endpoint(), "--timeout", "60s"},
                                            "", absl::Seconds(120));
  ASSERT_THAT(from_ctl, IsOk());
  EXPECT_EQ(from_ctl->exit_code, 0) << from_ctl->output;
  auto stats = first->Stats();
  ASSERT_THAT(stats, IsOk());
  ExpectWhole(*stats);
  EXPECT_EQ(stats->in_use_blocks, 0);
}

TEST(CacheManagerSecurityTest, AStepPastMaxSequencesPerSessionIsRefusedWhole) {
  auto manager = StartLimited({"--max-sequences-per-session", "3"});
  ASSERT_NE(manager, nullptr);
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  BlockOps two;
  two.Allocate(1, kBlockSize);
  two.Allocate(2, kBlockSize);
  ASSERT_THAT(client->Step(two), IsOk());
  BlockOps more;
  more.Allocate(3, kBlockSize);
  more.Allocate(4, kBlockSize);
  auto outcome = client->Step(more);
  EXPECT_TRUE(absl::IsResourceExhausted(outcome.status())) << outcome.status();
  EXPECT_THAT(std::string(outcome.status().message()), HasSubstr("more than 3 live sequences"));
  EXPECT_EQ(Rejected(*manager, "limit_exceeded"), 1);
  // Refused whole: sequence 3 was not allocated either. Another session is not bounded by
  // this one's sequences.
  auto stats = client->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->live_sequences, 2);
  EXPECT_EQ(stats->in_use_blocks, 2);
  ExpectWhole(*stats);
  BlockOps free;
  free.Free(1);
  free.Free(2);
  ASSERT_THAT(client->Step(free), IsOk());
  ExpectWholeAndEmpty(*client);
}

TEST(CacheManagerSecurityTest, BadLimitFlagsAreNamed) {
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--max-message-bytes", "1000"},
        std::vector<std::string>{"--max-message-bytes", "4294967296"},
        std::vector<std::string>{"--max-sessions", "0"},
        std::vector<std::string>{"--max-sequences-per-session", "-1"}}) {
    SCOPED_TRACE(absl::StrJoin(flags, " "));
    std::vector<std::string> argv = {kvcm::testing::KvcmBinaryPath("kvcm-cache-manager"),
                                     "--backend",
                                     "shm",
                                     "--num-blocks",
                                     "16",
                                     "--layers",
                                     "1",
                                     "--kv-heads",
                                     "1",
                                     "--head-dim",
                                     "8",
                                     "--metrics-address",
                                     "127.0.0.1:0"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto dir = kvcm::testing::TempDir::Create("kvcm-sec");
    ASSERT_THAT(dir, IsOk());
    argv.insert(argv.end(), {"--run-dir", dir->path() + "/run"});
    auto run = kvcm::testing::RunProgram(argv, "", absl::Seconds(30));
    ASSERT_THAT(run, IsOk());
    EXPECT_EQ(run->exit_code, 1) << run->output;
    EXPECT_THAT(run->output, ::testing::AnyOf(HasSubstr("--max-message-bytes"),
                                              HasSubstr("limits must be positive")))
        << run->output;
  }
}

TEST(CacheManagerSecurityTest, TheLogNeverCarriesTheTcpSecretOrThePoolsHandles) {
  CacheManagerOptions options;
  options.backend = "auto";      // a CUDA pool, and its IPC handle, where there is a GPU
  options.num_blocks = kBlocks;  // room for StartHolder's blocks
  options.block_size = kBlockSize;
  // Its sessions send no heartbeats: none may expire while a loaded machine is slow.
  options.heartbeat_timeout_ms = kGenerousHeartbeatTimeoutMs;
  options.extra_args = {"--tcp-address", "tcp://127.0.0.1:0"};
  auto started = CacheManagerProcess::Start(options);
  ASSERT_THAT(started, IsOk());
  CacheManagerProcess& manager = **started;
  auto ready =
      manager.process().WaitForLine(" tcp=(tcp://[0-9.:]+)", absl::Now() + absl::Seconds(5));
  ASSERT_THAT(ready, IsOk());
  const std::string tcp = (*ready)[1];
  const std::string secret = std::string(absl::StripAsciiWhitespace(
      kvcm::testing::ReadFileOrEmpty(manager.run_dir() + "/tcp-secret")));
  ASSERT_GE(secret.size(), 32u);
  // Everything that could make it log a secret or a handle: routers and executors over
  // tcp:// with the secret, one with a wrong secret (whose bytes must not be echoed
  // either), an attach over ipc:// (the pool descriptor: the memfd here, the CUDA IPC
  // handle on a GPU), a session ended by an operator, a client killed mid-session.
  const std::string wrong = "feedfacefeedfacefeedfacefeedfacefeedfacefeedfacefeedfacefeedface";
  auto over_tcp = [&](wire::Role role, const std::string& given) {
    CacheManagerClient::Options client;
    client.endpoint = tcp;
    client.role = role;
    client.heartbeats = false;
    client.secret = given;
    return CacheManagerClient::Connect(client);
  };
  auto router = over_tcp(wire::Role::Router, secret);
  ASSERT_THAT(router, IsOk());
  BlockOps step;
  step.Allocate(1, 8);
  ASSERT_THAT((*router)->Step(step), IsOk());
  auto executor = over_tcp(wire::Role::Executor, secret);
  ASSERT_THAT(executor, IsOk());
  auto tcp_attach = (*executor)->Attach();
  EXPECT_THAT(tcp_attach, IsOk());
  EXPECT_FALSE(over_tcp(wire::Role::Router, wrong).ok());
  auto local = Connect(manager, wire::Role::Executor);
  ASSERT_NE(local, nullptr);
  auto attached = local->Attach();
  ASSERT_THAT(attached, IsOk());
  // The descriptor as sent, for its CUDA IPC handle (64 bytes on a GPU, empty for shm).
  std::string handle;
  {
    zmq::context_t context(1);
    RawSession raw = OpenRaw(context, manager, wire::Role::Executor);
    flatbuffers::FlatBufferBuilder b;
    FinishEnvelope(b, 2, raw.session, raw.epoch, wire::Message::Attach,
                   wire::CreateAttach(b).Union());
    raw.dealer.send(zmq::const_buffer(b.GetBufferPointer(), b.GetSize()), zmq::send_flags::none);
    zmq::message_t reply;
    ASSERT_TRUE(raw.dealer.recv(reply));
    AlignFrame(reply);
    const VerifiedEnvelope verified = VerifyEnvelope(FrameBytes(reply));
    ASSERT_EQ(verified.fault, EnvelopeFault::kNone);
    const wire::AttachReply* attach = verified.envelope->payload_as_AttachReply();
    ASSERT_NE(attach, nullptr);
    if (const auto* bytes = attach->descriptor()->cuda_ipc_handle()) {
      handle.assign(reinterpret_cast<const char*>(bytes->data()), bytes->size());
    }
    flatbuffers::FlatBufferBuilder bye;
    FinishEnvelope(bye, 3, raw.session, raw.epoch, wire::Message::Goodbye,
                   wire::CreateGoodbye(bye).Union());
    raw.dealer.send(zmq::const_buffer(bye.GetBufferPointer(), bye.GetSize()),
                    zmq::send_flags::none);
    ASSERT_TRUE(raw.dealer.recv(reply));
  }
  // scripts/gpu-check.sh runs this test on a GPU machine: there it must have checked a
  // real CUDA IPC handle.
  if (kvcm::testing::GpuRequired()) {
    EXPECT_EQ(handle.size(), 64u) << "KVCM_REQUIRE_GPU=1 but the pool is not a CUDA pool";
  }
  auto control = Connect(manager, wire::Role::Control);
  ASSERT_NE(control, nullptr);
  EXPECT_THAT(control->EndSession((*router)->session_id()), IsOk());
  absl::flat_hash_set<int32_t> held;
  auto dir = kvcm::testing::TempDir::Create("kvcm-sec");
  ASSERT_THAT(dir, IsOk());
  auto holder = StartHolder(manager, &held, dir->path() + "/holder");
  ASSERT_NE(holder, nullptr);
  ASSERT_EQ(holder->Signal(SIGKILL), absl::OkStatus());
  // Its exit logged before the log is read.
  ASSERT_TRUE(manager.process()
                  .WaitForLine(absl::StrCat("client pid ", holder->pid(), " exited"),
                               absl::Now() + absl::Seconds(60))
                  .ok())
      << manager.Output();
  auto stopped = manager.Terminate(absl::Seconds(10));
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(*stopped, 0);

  const std::string log = manager.Output();
  std::printf("%zu bytes of log checked\n", log.size());
  for (const std::string& needle : {secret, wrong, secret.substr(0, 16), wrong.substr(0, 16)}) {
    EXPECT_EQ(log.find(needle), std::string::npos) << "the log carries " << needle << ":\n" << log;
  }
  // On a GPU the pool descriptor carries a 64-byte CUDA IPC handle: neither it nor its hex
  // may appear (with the shm backend it is empty).
  std::printf("backend %s, CUDA IPC handle of %zu bytes\n", handle.empty() ? "shm" : "cuda",
              handle.size());
  if (!handle.empty()) {
    EXPECT_EQ(log.find(handle), std::string::npos);
    const std::string hex = absl::BytesToHexString(handle);
    EXPECT_EQ(log.find(hex.substr(0, 32)), std::string::npos) << log;
  }
}

}  // namespace
}  // namespace kvcm::live_test
