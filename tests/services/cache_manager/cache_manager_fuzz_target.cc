// The fuzz target of the cache manager's inbound path (tests/support/fuzz_target.h): whole
// requests through CacheManagerService::Handle, the envelope check, the session checks,
// DecodeStep, ValidateStep and the real BlockLedger behind them, in one process.
//
// Each input builds a new service (32 blocks of 4 tokens, 16 ops a step) and registers two
// routers (pids 1000 and 1001), an executor (2000) and a control client over tcp:// (no
// credentials, pid 3000), then handles the input's records (tests/support/fuzz_records.h), each one
// message. Flags of a record:
//   bits 0-1  the sender: router A, router B, the executor, the control client
//   bit 2     send the envelope as written; otherwise its session_id and epoch (when the
//             envelope verifies and carries them) are set to the sender's, so a mutated
//             Step still reaches validation and the ledger
//   bit 3     first move the clock past the heartbeat timeout and expire silent sessions
//   bit 4     afterwards the sender's process exits (not the control client's: its pid is
//             not known to the kernel's credentials); it registers again at once
//   bit 5     afterwards take the KV event batch, which must verify
// Checked after every message (the contract of cache_manager_service.h):
//   - exactly one reply, an envelope that verifies;
//   - the ledger's invariants (BlockLedger::CheckInvariants);
//   - a message answered with an ErrorReply changed nothing in the ledger;
// and at the end, once every client process exited: no live sequence and no block in use
// (fenced sequences freed when the executor went), only free, cached and pinned blocks.
// An input is accepted when a message of its own got an answer other than an ErrorReply.
// Seeds: tests/services/cache_manager/fuzz/cache_manager/ (tests/services/fuzz_seeds.cc).

#include <sys/types.h>
#include <unistd.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/wire/envelope.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"
#include "services/cache_manager/cache_manager_service.h"
#include "tests/support/fuzz_records.h"
#include "tests/support/fuzz_target.h"

namespace kvcm::cache_manager {
namespace {

using fuzz::Check;

class FakeWatcher : public ProcessWatcher {
 public:
  absl::Status Watch(uint64_t session, pid_t pid) override {
    sessions_[session] = pid;
    return absl::OkStatus();
  }
  void Unwatch(uint64_t session) override { sessions_.erase(session); }

 private:
  absl::flat_hash_map<uint64_t, pid_t> sessions_;
};

constexpr int32_t kBlocks = 32;

struct Client {
  wire::Role role;
  pid_t pid;
  bool over_tcp = false;  // no peer credentials
  uint64_t session = 0;
};

// What the ledger shows of its blocks: to compare before and after a refused message.
std::string LedgerState(const BlockLedger& ledger) {
  const LedgerStats s = ledger.Stats();
  std::string out =
      absl::StrCat(s.free_blocks, "/", s.in_use_blocks, "/", s.cached_blocks, "/", s.pinned_blocks,
                   "/", s.live_sequences, "/", s.blocks_allocated, "/", s.blocks_released, ":");
  for (BlockId b = 0; b < kBlocks; ++b) absl::StrAppend(&out, ledger.RefCount(b), ",");
  return out;
}

class Harness {
 public:
  Harness() {
    CacheManagerService::Options options;
    options.spec.num_layers = 2;
    options.spec.num_kv_heads = 2;
    options.spec.head_dim = 8;
    options.spec.dtype = DType::kFloat16;
    options.spec.block_size = 4;
    options.ledger.num_blocks = kBlocks;
    options.epoch = 777;
    options.heartbeat_interval = absl::Seconds(1);
    options.heartbeat_timeout = absl::Seconds(3);
    options.max_ops_per_step = 16;
    options.max_hashes_per_message = 256;
    options.max_sessions_per_process = 4;
    options.max_sequences_per_session = 64;
    options.pool.backend = wire::PoolBackend::Shm;
    options.pool.layout.total_bytes = 4096;
    options.pool.fd_channel_path = "/run/kvcm/pool-fd.sock";
    absl::StatusOr<std::unique_ptr<CacheManagerService>> service =
        CacheManagerService::Create(options, &watcher_, nullptr, now_);
    Check(service.ok(), "the service starts");
    service_ = *std::move(service);
    for (Client& c : clients_) Register(c);
  }

  // Handles one record; true when it got an answer other than an ErrorReply.
  bool Handle(const fuzz::Record& record) {
    Client& sender = clients_[record.flags & 3];
    if (record.flags & 8) {
      now_ += absl::Seconds(4);
      service_->ExpireSessions(now_);
    }
    std::vector<uint8_t> request(record.bytes.begin(), record.bytes.end());
    if ((record.flags & 4) == 0 && VerifyEnvelope(request).envelope != nullptr) {
      auto* table = flatbuffers::GetMutableRoot<flatbuffers::Table>(request.data());
      table->SetField<uint64_t>(wire::Envelope::VT_SESSION_ID, sender.session, 0);
      table->SetField<uint64_t>(wire::Envelope::VT_EPOCH, service_->epoch(), 0);
    }
    const std::string before = LedgerState(service_->ledger());
    const bool answered = Send(sender, request);
    if (!answered) {
      Check(LedgerState(service_->ledger()) == before,
            "a message answered with an ErrorReply changes nothing in the ledger");
    }
    if ((record.flags & 16) && !sender.over_tcp) {
      service_->OnProcessExited(sender.pid);
      CheckLedger();
      Register(sender);
    }
    if (record.flags & 32) {
      flatbuffers::FlatBufferBuilder batch;
      if (service_->TakeEventBatch(&batch) != 0) {
        flatbuffers::Verifier verifier(batch.GetBufferPointer(), batch.GetSize());
        Check(verifier.VerifyBuffer<wire::EventBatch>(nullptr), "an event batch verifies");
      }
    }
    return answered;
  }

  // Every client process exits: nothing may stay in use.
  void End() {
    for (const Client& c : clients_) {
      if (!c.over_tcp) service_->OnProcessExited(c.pid);
    }
    CheckLedger();
    const LedgerStats s = service_->ledger().Stats();
    Check(s.live_sequences == 0, "no live sequence once every client exited");
    Check(s.in_use_blocks == 0, "no block in use once every client exited");
  }

 private:
  // Sends `request` as `sender`; true for an answer other than an ErrorReply.
  bool Send(const Client& sender, std::span<const uint8_t> request) {
    const std::optional<PeerCredentials> peer =
        sender.over_tcp ? std::nullopt
                        : std::optional<PeerCredentials>({::geteuid(), 1, sender.pid});
    service_->Handle(peer, request, now_, &reply_);
    const VerifiedEnvelope verified = VerifyEnvelope(BufferSpan(reply_));
    Check(verified.envelope != nullptr, "the reply is an envelope that verifies");
    CheckLedger();
    return verified.envelope->payload_type() != wire::Message::ErrorReply;
  }

  void CheckLedger() {
    Check(service_->ledger().CheckInvariants().ok(), "the ledger's invariants hold");
  }

  void Register(Client& client) {
    flatbuffers::FlatBufferBuilder hello;
    FinishEnvelope(
        hello, 1, 0, 0, wire::Message::Hello,
        wire::CreateHello(hello, client.role, client.pid, hello.CreateString("fuzz")).Union());
    Check(Send(client, BufferSpan(hello)), "a client registers");
    client.session =
        wire::GetEnvelope(reply_.GetBufferPointer())->payload_as_HelloReply()->session_id();
  }

  FakeWatcher watcher_;
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
  std::unique_ptr<CacheManagerService> service_;
  flatbuffers::FlatBufferBuilder reply_;
  std::array<Client, 4> clients_ = {
      Client{wire::Role::Router, 1000}, Client{wire::Role::Router, 1001},
      Client{wire::Role::Executor, 2000}, Client{wire::Role::Control, 3000, true}};
};

}  // namespace
}  // namespace kvcm::cache_manager

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvcm::cache_manager::Harness harness;
  bool accepted = false;
  for (const kvcm::fuzz::Record& record : kvcm::fuzz::SplitRecords({data, size})) {
    accepted = harness.Handle(record) || accepted;
  }
  harness.End();
  if (accepted) kvcm::fuzz::NoteAccepted();
  return 0;
}
