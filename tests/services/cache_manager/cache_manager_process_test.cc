// The real kvcm-cache-manager process: a second instance on the same run directory, garbage
// on the real socket, SIGTERM, a taken metrics port, and its /metrics through promtool and
// a real Prometheus server. Every test checks that the pool is whole afterwards.

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_join.h"
#include "common/base/run_dir.h"
#include "common/memory/fd_channel.h"
#include "common/transport/zmq_util.h"
#include "common/wire/step_codec.h"
#include "gmock/gmock.h"
#include "tests/services/cache_manager/live_cache_manager.h"
#include "tests/support/status_matchers.h"

namespace kvcm::live_test {
namespace {

TEST(CacheManagerProcessTest, SecondInstanceOnTheSameRunDirectoryRefusesToStart) {
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  auto second = kvcm::testing::RunProgram(
      {kvcm::testing::KvcmBinaryPath("kvcm-cache-manager"), "--run-dir", manager->run_dir(),
       "--backend", "shm", "--num-blocks", "16", "--layers", "1", "--kv-heads", "1", "--head-dim",
       "8", "--metrics-address", "127.0.0.1:0"},
      "", absl::Seconds(30));
  ASSERT_THAT(second, IsOk());
  EXPECT_NE(second->exit_code, 0);
  EXPECT_NE(second->output.find("already running"), std::string::npos) << second->output;
  // The first keeps serving on its socket.
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  auto stats = client->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->epoch, manager->epoch());
}

TEST(CacheManagerProcessTest, BadFlagsAreNamedBeforeAnythingIsAcquired) {
  // A running instance holds the run directory and its metrics port: a second one whose
  // flags are wrong must say what is wrong with them, not that the lock or port is taken.
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  const std::string port = manager->metrics_url().substr(
      manager->metrics_url().rfind(':') + 1,
      manager->metrics_url().find("/metrics") - manager->metrics_url().rfind(':') - 1);
  struct Case {
    std::vector<std::string> flags;
    const char* message;
  };
  const Case cases[] = {
      {{"--num-blocks", "0"}, "--num-blocks 0: a pool needs at least one block"},
      {{"--num-blocks", "16", "--tcp-address", "tcp://127.0.0.1:99999"},
       "port 99999 is outside 1-65535"},
      {{"--num-blocks", "16", "--tcp-address", "tcp://garbage"}, "expected tcp://HOST:PORT"},
      {{"--num-blocks", "16", "--tcp-address", "tcp://0.0.0.0:5557"}, "--tcp-allow-remote"},
      {{"--num-blocks", "16", "--sliding-window-tokens", "-2"}, "give a window in tokens"},
      {{"--num-blocks", "16", "--heartbeat-timeout-ms", "100"}, "must be longer than"},
      {{"--num-blocks", "16", "--max-ops-per-step", "0"}, "limits must be positive"},
      {{"--num-blocks", "16", "--max-pinned-blocks", "17"}, "max_pinned_blocks"},
      {{"--num-blocks", "16", "--memory-fraction", "1.5"}, "--memory-fraction"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrJoin(c.flags, " "));
    std::vector<std::string> argv = {kvcm::testing::KvcmBinaryPath("kvcm-cache-manager"),
                                     "--run-dir",
                                     manager->run_dir(),
                                     "--backend",
                                     "shm",
                                     "--layers",
                                     "1",
                                     "--kv-heads",
                                     "1",
                                     "--head-dim",
                                     "8",
                                     "--metrics-address",
                                     "127.0.0.1:" + port};
    argv.insert(argv.end(), c.flags.begin(), c.flags.end());
    auto run = kvcm::testing::RunProgram(argv, "", absl::Seconds(30));
    ASSERT_THAT(run, IsOk());
    EXPECT_EQ(run->exit_code, 1);
    EXPECT_NE(run->output.find(c.message), std::string::npos) << run->output;
    EXPECT_EQ(run->output.find("already running"), std::string::npos) << run->output;
  }
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  EXPECT_THAT(client->Stats(), IsOk());
}

TEST(CacheManagerProcessTest, TheReadyLineNamesTheTcpEndpointItBound) {
  CacheManagerOptions options;
  // Its clients send no heartbeats: none may expire while a loaded machine is slow.
  options.heartbeat_timeout_ms = kGenerousHeartbeatTimeoutMs;
  options.extra_args = {"--tcp-address", "tcp://127.0.0.1:0"};
  auto manager = CacheManagerProcess::Start(options);
  ASSERT_THAT(manager, IsOk());
  auto ready = (*manager)->process().WaitForLine(" tcp=(tcp://127\\.0\\.0\\.1:[0-9]+)",
                                                 absl::Now() + absl::Seconds(5));
  ASSERT_THAT(ready, IsOk()) << "\n" << (*manager)->Output();
  EXPECT_EQ((*ready)[1].find(":0"), std::string::npos);
  // A client reaches the cache manager there.
  CacheManagerClient::Options client_options;
  client_options.endpoint = (*ready)[1];
  client_options.role = wire::Role::Control;
  client_options.heartbeats = false;
  auto client = CacheManagerClient::Connect(client_options);
  ASSERT_THAT(client, IsOk());
  EXPECT_THAT((*client)->Stats(), IsOk());
}

TEST(CacheManagerProcessTest, ASymlinkedRunDirectoryIsRefused) {
  auto dir = kvcm::testing::TempDir::Create("kvcm-link");
  ASSERT_THAT(dir, IsOk());
  const std::string real = dir->path() + "/real";
  const std::string link = dir->path() + "/link";
  ASSERT_EQ(::mkdir(real.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(real.c_str(), link.c_str()), 0);
  auto run = kvcm::testing::RunProgram(
      {kvcm::testing::KvcmBinaryPath("kvcm-cache-manager"), "--run-dir", link, "--backend", "shm",
       "--num-blocks", "16", "--layers", "1", "--kv-heads", "1", "--head-dim", "8",
       "--metrics-address", "127.0.0.1:0"},
      "", absl::Seconds(30));
  ASSERT_THAT(run, IsOk());
  EXPECT_EQ(run->exit_code, 1);
  EXPECT_NE(run->output.find("is a symbolic link"), std::string::npos) << run->output;
  struct stat st {};
  EXPECT_NE(::stat((real + "/cache-manager.lock").c_str(), &st), 0) << "it used the link";
}

TEST(CacheManagerProcessTest, ClientsRefuseARunDirectoryOthersCanWrite) {
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  ASSERT_EQ(::chmod(manager->run_dir().c_str(), 0777), 0);
  CacheManagerClient::Options options;
  options.endpoint = manager->endpoint();
  options.role = wire::Role::Router;
  auto refused = CacheManagerClient::Connect(options);
  EXPECT_TRUE(absl::IsPermissionDenied(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("mode 0777"));
  ASSERT_EQ(::chmod(manager->run_dir().c_str(), 0700), 0);
  auto accepted = CacheManagerClient::Connect(options);
  EXPECT_THAT(accepted, IsOk());
}

TEST(CacheManagerProcessTest, OverTcpOnlyPeersWithTheSecretMayUseThePool) {
  CacheManagerOptions options;
  // Its clients send no heartbeats: none may expire while a loaded machine is slow.
  options.heartbeat_timeout_ms = kGenerousHeartbeatTimeoutMs;
  options.extra_args = {"--tcp-address", "tcp://127.0.0.1:0"};
  auto started = CacheManagerProcess::Start(options);
  ASSERT_THAT(started, IsOk());
  CacheManagerProcess& manager = **started;
  auto ready =
      manager.process().WaitForLine(" tcp=(tcp://[0-9.:]+)", absl::Now() + absl::Seconds(5));
  ASSERT_THAT(ready, IsOk());
  const std::string tcp = (*ready)[1];
  const std::string secret_file = manager.run_dir() + "/tcp-secret";
  struct stat st {};
  ASSERT_EQ(::stat(secret_file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  auto connect = [&](wire::Role role, const std::string& secret) {
    CacheManagerClient::Options client;
    client.endpoint = tcp;
    client.role = role;
    client.heartbeats = false;
    client.secret = secret;
    return CacheManagerClient::Connect(client);
  };
  // A router or executor without the secret, or with a wrong one, is refused.
  for (wire::Role role : {wire::Role::Router, wire::Role::Executor}) {
    auto refused = connect(role, "");
    EXPECT_TRUE(absl::IsPermissionDenied(refused.status())) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("tcp-secret"));
    auto wrong = connect(role, std::string(64, '0'));
    EXPECT_TRUE(absl::IsPermissionDenied(wrong.status())) << wrong.status();
  }
  // A control session without it reads, but may not attach, pin or step.
  auto reader = connect(wire::Role::Control, "");
  ASSERT_THAT(reader, IsOk());
  EXPECT_THAT((*reader)->Stats(), IsOk());
  EXPECT_TRUE(absl::IsPermissionDenied((*reader)->Attach().status()));
  EXPECT_TRUE(absl::IsPermissionDenied((*reader)->Pin("p", {})));
  BlockOps step;
  step.Allocate(1, 8);
  EXPECT_TRUE(absl::IsPermissionDenied((*reader)->Step(step).status()));

  // With the secret file, a router steps.
  CacheManagerClient::Options with_file;
  with_file.endpoint = tcp;
  with_file.role = wire::Role::Router;
  with_file.heartbeats = false;
  with_file.secret_file = secret_file;
  auto router = CacheManagerClient::Connect(with_file);
  ASSERT_THAT(router, IsOk());
  auto stepped = (*router)->Step(step);
  ASSERT_THAT(stepped, IsOk());
  EXPECT_THAT((*stepped)[0].status, IsOk());
  // A secret file others can read is refused by the client itself.
  ASSERT_EQ(::chmod(secret_file.c_str(), 0644), 0);
  auto loose = CacheManagerClient::Connect(with_file);
  EXPECT_TRUE(absl::IsPermissionDenied(loose.status())) << loose.status();
  auto stats = (*reader)->Stats();
  ASSERT_THAT(stats, IsOk());
  ExpectWhole(*stats);
}

TEST(CacheManagerProcessTest, GarbageOnTheRealSocketGetsErrorRepliesAndChangesNothing) {
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  BlockOps setup;
  setup.Allocate(1, 40);
  ASSERT_THAT(client->Step(setup), IsOk());
  setup.Clear();
  setup.Commit(1, 40);
  ASSERT_THAT(client->Step(setup), IsOk());
  auto before = client->Stats();
  ASSERT_THAT(before, IsOk());

  zmq::context_t context(1);
  zmq::socket_t dealer = RawDealer(context, *manager);
  const uint32_t seed = 424242;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  std::vector<std::vector<uint8_t>> messages;
  for (int i = 0; i < 50; ++i) {
    std::vector<uint8_t> garbage(rng() % 512);
    for (uint8_t& byte : garbage) byte = static_cast<uint8_t>(rng());
    messages.push_back(std::move(garbage));
  }
  // A well-formed Stats request of another version, and one truncated.
  flatbuffers::FlatBufferBuilder b;
  auto payload = wire::CreateStats(b);
  wire::EnvelopeBuilder envelope(b);
  envelope.add_version(kProtocolVersion + 7);
  envelope.add_payload_type(wire::Message::Stats);
  envelope.add_payload(payload.Union());
  b.Finish(envelope.Finish(), kEnvelopeIdentifier);
  messages.emplace_back(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize());
  messages.emplace_back(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize() / 2);
  // A Step naming a sequence of another session, sent without a session.
  for (const auto& message : messages) {
    dealer.send(zmq::buffer(message), zmq::send_flags::none);
    zmq::message_t reply;
    ASSERT_TRUE(dealer.recv(reply)) << "no reply to a bad message";
    AlignFrame(reply);
    const VerifiedEnvelope verified = VerifyEnvelope(FrameBytes(reply));
    ASSERT_EQ(verified.fault, EnvelopeFault::kNone) << verified.reason;
    ASSERT_EQ(verified.envelope->payload_type(), wire::Message::ErrorReply);
    EXPECT_FALSE(verified.envelope->payload_as_ErrorReply()->reason()->str().empty());
  }
  auto after = client->Stats();
  ASSERT_THAT(after, IsOk());
  EXPECT_EQ(after->in_use_blocks, before->in_use_blocks);
  EXPECT_EQ(after->free_blocks, before->free_blocks);
  EXPECT_EQ(after->blocks_allocated, before->blocks_allocated);
  EXPECT_EQ(after->rejected_messages, before->rejected_messages + messages.size());
  ExpectWhole(*after);

  auto metrics = kvcm::testing::HttpGet(manager->metrics_url());
  ASSERT_THAT(metrics, IsOk());
  auto parsed = kvcm::testing::ParseMetricsText(metrics->body);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_GE(*parsed->Value("kvcm_cache_manager_rejected_messages_total", {{"reason", "malformed"}}),
            50);
  EXPECT_EQ(*parsed->Value("kvcm_cache_manager_rejected_messages_total",
                           {{"reason", "unsupported_version"}}),
            1);
}

TEST(CacheManagerProcessTest, AMultiFrameMessageIsRefusedWholeAndNoFrameIsTakenForAnother) {
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  auto before = client->Stats();
  ASSERT_THAT(before, IsOk());

  zmq::context_t context(1);
  zmq::socket_t dealer = RawDealer(context, *manager);
  // Five frames, each a well-formed Stats request of its own id: read whole as one
  // malformed message, none of its frames may pass for a routing id or a request.
  std::vector<std::vector<uint8_t>> frames;
  for (uint64_t id = 101; id <= 105; ++id) {
    flatbuffers::FlatBufferBuilder b;
    FinishEnvelope(b, id, client->session_id(), client->epoch(), wire::Message::Stats,
                   wire::CreateStats(b).Union());
    frames.emplace_back(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize());
  }
  for (size_t i = 0; i < frames.size(); ++i) {
    dealer.send(zmq::buffer(frames[i]),
                i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
  // Then one proper request: its reply must be the next thing to arrive after the refusal.
  dealer.send(zmq::buffer(frames[0]), zmq::send_flags::none);
  for (const auto& [id, type] :
       {std::pair{101u, wire::Message::ErrorReply}, std::pair{101u, wire::Message::StatsReply}}) {
    zmq::message_t reply;
    ASSERT_TRUE(dealer.recv(reply)) << "no reply";
    AlignFrame(reply);
    const VerifiedEnvelope verified = VerifyEnvelope(FrameBytes(reply));
    ASSERT_EQ(verified.fault, EnvelopeFault::kNone) << verified.reason;
    EXPECT_EQ(verified.envelope->request_id(), id);
    ASSERT_EQ(verified.envelope->payload_type(), type);
    if (type == wire::Message::ErrorReply) {
      EXPECT_EQ(verified.envelope->payload_as_ErrorReply()->code(), wire::ErrorCode::Malformed);
      EXPECT_NE(verified.envelope->payload_as_ErrorReply()->reason()->str().find("had 5"),
                std::string::npos);
    }
  }
  auto after = client->Stats();
  ASSERT_THAT(after, IsOk());
  EXPECT_EQ(after->rejected_messages, before->rejected_messages + 1);
  ExpectWhole(*after);
}

// VmHWM (peak resident memory) of `pid` in KiB, from /proc; -1 when unreadable.
int64_t PeakResidentKib(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    int64_t kib = 0;
    if (line.rfind("VmHWM:", 0) == 0 &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(6, line.size() - 6 - 3)), &kib)) {
      return kib;
    }
  }
  return -1;
}

TEST(CacheManagerProcessTest, AMessageFarOverTheLimitIsDroppedBeforeItIsBuffered) {
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  const int64_t peak_before = PeakResidentKib(manager->process().pid());
  ASSERT_GT(peak_before, 0);

  // 40 MiB against the default limit of 16 MiB (the socket drops past 32 MiB).
  zmq::context_t context(1);
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(manager->endpoint());
  const std::vector<uint8_t> huge(size_t{40} << 20, 0x5a);
  dealer.send(zmq::buffer(huge), zmq::send_flags::none);
  // Then small garbage from the same socket until something is answered: by then the huge
  // message was read (and answered Oversized, had it been buffered) or its connection
  // dropped (the DEALER connects again by itself).
  // Each try waits 200 ms for an answer before sending again; the deadline bounds them all.
  dealer.set(zmq::sockopt::rcvtimeo, 200);
  const std::vector<uint8_t> small(16, 0x5a);
  const absl::Status answered = kvcm::testing::WaitFor(
      [&] {
        dealer.send(zmq::buffer(small), zmq::send_flags::dontwait);
        zmq::message_t reply;
        return dealer.recv(reply).has_value();
      },
      absl::Seconds(60), "an answer to small garbage");
  ASSERT_THAT(answered, IsOk()) << "the cache manager stopped answering: " << answered;
  auto stats = client->Stats();
  ASSERT_THAT(stats, IsOk());
  ExpectWhole(*stats);
  const int64_t grew_kib = PeakResidentKib(manager->process().pid()) - peak_before;
  std::printf("peak resident memory grew by %lld KiB\n", static_cast<long long>(grew_kib));
  EXPECT_LT(grew_kib, 16 << 10) << "the 40 MiB message was buffered";
}

TEST(CacheManagerProcessTest, AnotherUserIsRefusedThePoolAndTheRefusalIsCountedAlike) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "acting as a second Unix user needs root (setuid to nobody in a child)";
  }
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  // The file modes would stop another user at connect(); open them, so that what is tested
  // is the cache manager's own check of the peer's credentials.
  const std::string channel = manager->run_dir() + "/" + kFdChannelSocket;
  ASSERT_EQ(::chmod(manager->run_dir().c_str(), 0711), 0);
  ASSERT_EQ(::chmod(channel.c_str(), 0777), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    auto received = ReceiveFdFromChannel(channel, absl::Seconds(60));
    ::_exit(received.ok() ? 1 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "another user received the pool's memfd";

  // StatsReply and /metrics count the refusal once, the same.
  auto stats = client->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->rejected_messages, 1u);
  EXPECT_EQ(MetricValue(manager->metrics_url(), "kvcm_cache_manager_rejected_messages_total",
                        {{"reason", "permission_denied"}}),
            1);
  ExpectWhole(*stats);
}

// Whether this kernel has SO_PEERPIDFD (Linux 6.5+): asked on a socketpair.
bool KernelHasPeerPidfd() {
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) return false;
  int pidfd = -1;
  socklen_t len = sizeof(pidfd);
  const bool has = ::getsockopt(pair[0], SOL_SOCKET, 77 /* SO_PEERPIDFD */, &pidfd, &len) == 0;
  if (has && pidfd >= 0) ::close(pidfd);
  ::close(pair[0]);
  ::close(pair[1]);
  return has;
}

// kvcm_cache_manager_process_watches_total by source: the watches whose pidfd was taken
// from the connection, and those looked up by pid.
struct WatchSources {
  double from_connect = 0;
  double by_pid = 0;
};
WatchSources ReadWatchSources(const CacheManagerProcess& manager) {
  constexpr char kName[] = "kvcm_cache_manager_process_watches_total";
  return {MetricValue(manager.metrics_url(), kName, {{"source", "connect_pidfd"}}),
          MetricValue(manager.metrics_url(), kName, {{"source", "pid_lookup"}})};
}

TEST(CacheManagerProcessTest, AClientIsWatchedThroughThePidfdOfItsConnection) {
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  const auto [from_connect, by_pid] = ReadWatchSources(*manager);
  const bool kernel_has_it = KernelHasPeerPidfd();
  std::printf("SO_PEERPIDFD %s; watches: %g from the connection, %g by pid\n",
              kernel_has_it ? "available" : "absent", from_connect, by_pid);
  EXPECT_EQ(from_connect + by_pid, 1);
  EXPECT_EQ(from_connect, kernel_has_it ? 1 : 0);
}

// The server reads its connection monitor before a request only when the request's
// connection is not one it has seen (services/cache_manager/seen_connections.h; the rule
// itself is tested in seen_connections_test.cc). Connections made one after another reuse
// descriptors, beside one that stays: each Hello must still find the pidfd taken when its
// own connection was accepted, never fall back to a lookup by pid.
TEST(CacheManagerProcessTest, EveryNewConnectionOnAReusedDescriptorIsWatchedThroughItsPidfd) {
  if (!KernelHasPeerPidfd()) GTEST_SKIP() << "this kernel has no SO_PEERPIDFD (Linux 6.5+)";
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  constexpr int kConnections = 20;
  auto keeper = Connect(*manager);
  ASSERT_NE(keeper, nullptr);
  for (int i = 0; i < kConnections; ++i) {
    auto client = Connect(*manager);
    ASSERT_NE(client, nullptr) << "connection " << i;
    ASSERT_THAT(keeper->Stats(), IsOk());
    ASSERT_THAT(client->Goodbye(), IsOk()) << "connection " << i;
  }
  const auto [from_connect, by_pid] = ReadWatchSources(*manager);
  std::printf("watches: %g from the connection, %g by pid\n", from_connect, by_pid);
  EXPECT_EQ(from_connect, kConnections + 1);
  EXPECT_EQ(by_pid, 0);
  auto stats = keeper->Stats();
  ASSERT_THAT(stats, IsOk());
  ExpectWhole(*stats);
}

TEST(CacheManagerProcessTest, SigtermAnswersAndCleansUp) {
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  ASSERT_THAT(client->Stats(), IsOk());
  const std::string run_dir = manager->run_dir();
  auto exit_code = manager->Terminate(absl::Seconds(10));
  ASSERT_THAT(exit_code, IsOk());
  EXPECT_EQ(*exit_code, 0) << manager->Output();
  EXPECT_NE(manager->Output().find("stopped"), std::string::npos);
  struct stat st {};
  for (const char* name : {"cache-manager.sock", "events.sock", "pool-fd.sock"}) {
    EXPECT_NE(::stat((run_dir + "/" + name).c_str(), &st), 0) << name << " left behind";
  }
}

TEST(CacheManagerProcessTest, SigtermUnderLoadRefusesStepsWithUnavailableAndExitsInTime) {
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  // Routers stepping as fast as they can, each on its own thread and client.
  constexpr int kRouters = 3;
  std::vector<std::unique_ptr<CacheManagerClient>> clients;
  for (int i = 0; i < kRouters; ++i) {
    clients.push_back(Connect(*manager));
    ASSERT_NE(clients.back(), nullptr);
  }
  std::atomic<bool> stop{false};
  std::vector<absl::Status> last(kRouters);
  std::vector<std::atomic<int>> steps(kRouters);
  std::vector<std::thread> loaders;
  for (int i = 0; i < kRouters; ++i) {
    loaders.emplace_back([&, i] {
      uint64_t seq = 1;
      while (!stop.load()) {
        BlockOps batch;
        batch.Allocate(seq, 8).Free(seq);
        ++seq;
        auto outcome = clients[i]->Step(batch);
        if (!outcome.ok()) {
          last[i] = outcome.status();
          return;
        }
        ++steps[i];
      }
    });
  }
  // Under load for real before the signal.
  const absl::Status loaded = kvcm::testing::WaitFor(
      [&] {
        return std::all_of(steps.begin(), steps.end(), [](const auto& n) { return n >= 50; });
      },
      absl::Seconds(60), "50 steps of every router");
  EXPECT_THAT(loaded, IsOk());  // not ASSERT: the loaders are joined below
  const absl::Time signalled = absl::Now();
  // A bound, not a measure (docs/RELIABILITY.md, "Timing in tests"): a cache manager that
  // drained for ever under load fails it; its drain deadline (2 s) is its own clock's
  // business, and how long the exit took is printed.
  auto exit_code = manager->Terminate(absl::Seconds(60));
  const absl::Duration took = absl::Now() - signalled;
  stop = true;
  for (std::thread& loader : loaders) loader.join();
  ASSERT_THAT(exit_code, IsOk()) << "\n" << manager->Output();
  EXPECT_EQ(*exit_code, 0) << manager->Output();
  std::printf("exited %s after SIGTERM under load\n", absl::FormatDuration(took).c_str());
  // Each router's last step was refused as the protocol says: Unavailable while draining,
  // or (its request sent after the exit) no answer / nothing listening.
  int unavailable = 0;
  for (const absl::Status& status : last) {
    EXPECT_FALSE(status.ok());
    if (absl::IsUnavailable(status) &&
        status.message().find("shutting down") != std::string_view::npos) {
      ++unavailable;
    } else {
      EXPECT_TRUE(absl::IsDeadlineExceeded(status) || absl::IsUnavailable(status)) << status;
    }
  }
  EXPECT_GT(unavailable, 0) << "no step was refused with the documented Unavailable";
  EXPECT_NE(manager->Output().find("while draining"), std::string::npos) << manager->Output();
}

TEST(CacheManagerProcessTest, TakenMetricsPortIsAClearError) {
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  const std::string url = manager->metrics_url();  // http://127.0.0.1:PORT/metrics
  const std::string address = url.substr(7, url.find("/metrics") - 7);
  auto dir = kvcm::testing::TempDir::Create("kvcm-port");
  ASSERT_THAT(dir, IsOk());
  auto second = kvcm::testing::RunProgram(
      {kvcm::testing::KvcmBinaryPath("kvcm-cache-manager"), "--run-dir", dir->path() + "/run",
       "--backend", "shm", "--num-blocks", "16", "--layers", "1", "--kv-heads", "1", "--head-dim",
       "8", "--metrics-address", address},
      "", absl::Seconds(30));
  ASSERT_THAT(second, IsOk());
  EXPECT_NE(second->exit_code, 0);
  EXPECT_NE(second->output.find(address), std::string::npos) << second->output;
  EXPECT_NE(second->output.find("in use"), std::string::npos) << second->output;
}

TEST(CacheManagerProcessTest, CudaBackendWithoutADeviceIsAClearError) {
  if (CudaDeviceCount().ok()) GTEST_SKIP() << "a CUDA device is present";
  auto dir = kvcm::testing::TempDir::Create("kvcm-cuda");
  ASSERT_THAT(dir, IsOk());
  auto run = kvcm::testing::RunProgram(
      {kvcm::testing::KvcmBinaryPath("kvcm-cache-manager"), "--run-dir", dir->path() + "/run",
       "--backend", "cuda", "--num-blocks", "16", "--layers", "1", "--kv-heads", "1", "--head-dim",
       "8", "--metrics-address", "127.0.0.1:0"},
      "", absl::Seconds(30));
  ASSERT_THAT(run, IsOk());
  EXPECT_EQ(run->exit_code, 1) << run->output;
  EXPECT_NE(run->output.find("--backend cuda needs a CUDA device"), std::string::npos)
      << run->output;
}

TEST(CacheManagerProcessTest, ModelConfigAndMemoryFractionSizeThePool) {
  auto dir = kvcm::testing::TempDir::Create("kvcm-config");
  ASSERT_THAT(dir, IsOk());
  const std::string config = dir->path() + "/config.json";
  {
    std::ofstream out(config);
    out << R"({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_size": 64, "torch_dtype": "float16"})";
  }
  CacheManagerOptions options;
  options.layers = 0;  // the shape comes from the config
  options.kv_heads = 0;
  options.head_dim = 0;
  options.dtype = "";
  options.num_blocks = 0;
  options.extra_args = {"--model-config", config, "--memory-fraction", "0.001"};
  auto manager = CacheManagerProcess::Start(options);
  ASSERT_THAT(manager, IsOk());
  EXPECT_NE((*manager)->Output().find("2 layers x 2 KV heads x head dim 16, fp16"),
            std::string::npos)
      << (*manager)->Output();
  auto client = Connect(**manager);
  ASSERT_NE(client, nullptr);
  auto stats = client->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->spec.num_layers, 2);
  EXPECT_EQ(stats->spec.head_dim, 16);
  EXPECT_GT(stats->num_blocks, 0);
  EXPECT_EQ(stats->pool_bytes, static_cast<uint64_t>(stats->num_blocks) * stats->block_bytes);
}

TEST(CacheManagerMetricsLiveTest, ScrapePassesPromtoolAndPrometheusSeesTheBlocks) {
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  auto client = Connect(*manager);
  ASSERT_NE(client, nullptr);
  BlockOps step;
  step.Allocate(1, 40).Allocate(2, 13);
  ASSERT_THAT(client->Step(step), IsOk());
  step.Clear();
  step.Commit(1, 40);
  ASSERT_THAT(client->Step(step), IsOk());
  ASSERT_THAT(client->Stats(), IsOk());

  // The block and session gauges come from the snapshot the server publishes after a turn
  // of its loop, and one turn may answer several requests: a scrape right after a reply can
  // still show the state before it (read once, it did in 2 of about 30 runs of this test):
  // scraped until they show the new state.
  absl::StatusOr<kvcm::testing::HttpResponse> metrics;
  absl::StatusOr<kvcm::testing::MetricsText> parsed;
  (void)kvcm::testing::WaitFor(
      [&] {
        metrics = kvcm::testing::HttpGet(manager->metrics_url());
        if (!metrics.ok()) return true;  // fails below
        parsed = kvcm::testing::ParseMetricsText(metrics->body);
        return !parsed.ok() ||
               parsed->Value("kvcm_cache_blocks", {{"state", "in_use"}}).value_or(-1) == 14;
      },
      absl::Seconds(60));
  ASSERT_THAT(metrics, IsOk());
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(*parsed->Value("kvcm_cache_blocks", {{"state", "in_use"}}), 14);
  EXPECT_EQ(*parsed->Value("kvcm_cache_manager_sessions", {{"role", "router"}}), 1);
  auto promtool = kvcm::testing::PromtoolCheckMetrics(metrics->body);
  ASSERT_THAT(promtool, IsOk());
  EXPECT_EQ(promtool->exit_code, 0) << promtool->output;
  EXPECT_EQ(promtool->output, "") << promtool->output;

  const std::string url = manager->metrics_url();
  kvcm::testing::PrometheusServer::Options options;
  options.targets = {url.substr(7, url.find("/metrics") - 7)};
  auto prometheus = kvcm::testing::PrometheusServer::Start(options);
  ASSERT_THAT(prometheus, IsOk());
  EXPECT_THAT((*prometheus)->WaitForValue("sum(kvcm_cache_blocks)", kBlocks, absl::Seconds(60)),
              IsOk())
      << (*prometheus)->LogTail();
  EXPECT_TRUE((*prometheus)
                  ->WaitForValue("kvcm_cache_blocks{state=\"in_use\"}", 14, absl::Seconds(30))
                  .ok());
}

// A client that stops reading: its replies fill its queue and cannot be delivered. The loss
// is visible (counted as queue_full, logged), and a Step whose reply was lost is learnt by
// retrying it with the same request id: answered from the replay cache, applied once.
TEST(CacheManagerProcessTest, RepliesAClientDoesNotReadAreCountedAndItsStepIsLearntByRetry) {
  auto manager = StartManager();
  ASSERT_NE(manager, nullptr);
  zmq::context_t context(1);
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.set(zmq::sockopt::rcvtimeo, 60000);  // a bound on each wait for a reply
  dealer.set(zmq::sockopt::rcvhwm, 1);        // its own queue: one message
  dealer.set(zmq::sockopt::rcvbuf, 4096);
  dealer.connect(manager->endpoint());
  auto receive = [&]() -> const wire::Envelope* {
    static zmq::message_t reply;
    reply = zmq::message_t();
    if (!dealer.recv(reply)) return nullptr;
    AlignFrame(reply);
    const VerifiedEnvelope verified = VerifyEnvelope(FrameBytes(reply));
    return verified.envelope;
  };
  flatbuffers::FlatBufferBuilder b;
  FinishEnvelope(
      b, 1, 0, 0, wire::Message::Hello,
      wire::CreateHello(b, wire::Role::Router, ::getpid(), b.CreateString("deaf")).Union());
  dealer.send(zmq::const_buffer(b.GetBufferPointer(), b.GetSize()), zmq::send_flags::none);
  const wire::Envelope* hello = receive();
  ASSERT_NE(hello, nullptr);
  ASSERT_EQ(hello->payload_type(), wire::Message::HelloReply);
  const uint64_t session = hello->payload_as_HelloReply()->session_id();
  const uint64_t epoch = hello->payload_as_HelloReply()->epoch();

  // Heartbeats it never reads replies to, until the cache manager counts replies it could
  // not deliver; then a Step.
  const std::string metrics = manager->metrics_url();
  uint64_t request = 2;
  for (int round = 0; round < 40; ++round) {
    for (int i = 0; i < 2000; ++i, ++request) {
      b.Clear();
      FinishEnvelope(b, request, session, epoch, wire::Message::Heartbeat,
                     wire::CreateHeartbeat(b).Union());
      if (!dealer.send(zmq::const_buffer(b.GetBufferPointer(), b.GetSize()),
                       zmq::send_flags::dontwait)) {
        break;  // our own send queue is full too
      }
    }
    if (MetricValue(metrics, "kvcm_cache_manager_undelivered_replies_total",
                    {{"reason", "queue_full"}}) > 0) {
      break;
    }
  }
  ASSERT_GT(MetricValue(metrics, "kvcm_cache_manager_undelivered_replies_total",
                        {{"reason", "queue_full"}}),
            0)
      << manager->Output();
  const std::vector<BlockOp> ops = {BlockOp::Allocate(7, 24)};
  const uint64_t step_request = request++;
  b.Clear();
  ASSERT_THAT(EncodeStep(b, step_request, session, epoch, ops), IsOk());
  const std::string step(reinterpret_cast<const char*>(b.GetBufferPointer()), b.GetSize());
  ASSERT_TRUE(dealer.send(zmq::buffer(step), zmq::send_flags::none));
  EXPECT_TRUE(manager->process()
                  .WaitForLine("a reply could not be delivered", absl::Now() + absl::Seconds(60))
                  .ok());

  // Reading again: whatever was queued, then the retried Step's reply. The drain stops at
  // 200 ms of quiet; what a slow cache manager sends later is skipped by the loop below,
  // which looks for the retried Step's request id.
  dealer.set(zmq::sockopt::rcvtimeo, 200);
  int drained = 0;
  while (receive() != nullptr) ++drained;
  dealer.set(zmq::sockopt::rcvtimeo, 60000);
  ASSERT_TRUE(dealer.send(zmq::buffer(step), zmq::send_flags::none));
  const wire::Envelope* retried = nullptr;
  for (const wire::Envelope* e = receive(); e != nullptr; e = receive()) {
    if (e->request_id() == step_request) {
      retried = e;
      break;
    }
  }
  ASSERT_NE(retried, nullptr) << "no reply to the retried Step (" << drained << " drained)";
  ASSERT_EQ(retried->payload_type(), wire::Message::StepReply);
  // Applied once: 24 tokens in blocks of the pool's size, not twice.
  auto control = Connect(*manager);
  ASSERT_NE(control, nullptr);
  auto stats = control->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->in_use_blocks, (24 + stats->block_size - 1) / stats->block_size);
  EXPECT_EQ(stats->live_sequences, 1);
  ExpectWhole(*stats);
}

}  // namespace
}  // namespace kvcm::live_test
