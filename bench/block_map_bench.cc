// BlockMap (schemas/kvcm_protocol.fbs) on a large pool: what one poll of the router's
// /dashboard costs the cache manager's thread, and the reply's size.
//
//   build/bench/block_map_bench                     # ratios at the end
//   build/bench/block_map_bench --benchmark_filter=/1048576
//
// The pool (N blocks of 16 tokens, shapes as in bench/cache_manager_bench.cc) is filled
// through the service by one router session: sequences of 64 blocks, the first half of each
// committed with block hashes and freed (cached, in release order), the rest live (in use),
// one pin over the first sequence's blocks, a quarter of the pool left free; the states
// come in runs, as allocation makes them. Then, in process:
//
//   ServiceHandleBlockMap/N   CacheManagerService::Handle() on a BlockMap request of the
//                             default 4096 cells: the session checks, the blocks held apart,
//                             the pass over the ledger and the reply's encoding. Counters:
//                             reply_bytes (the whole envelope), blocks_per_cell.
//   LedgerFillBlockMap/N      BlockLedger::FillBlockMap alone, into a reused map.
//   BarePassOverRecords/N     the floor: reads N 16-byte records (the size of the ledger's
//                             per-block record) and counts those with a nonzero field.
// The ratio table compares each with the floor, per block. Nothing here is random.

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "absl/time/time.h"
#include "bench/ratio_reporter.h"
#include "common/base/check.h"
#include "common/block/block_map.h"
#include "common/wire/convert.h"
#include "common/wire/envelope.h"
#include "common/wire/step_codec.h"
#include "services/cache_manager/cache_manager_service.h"

namespace kvcm {
namespace {

constexpr int32_t kBlockSize = 16;
constexpr int32_t kBlocksPerSeq = 64;
constexpr pid_t kRouterPid = 1000;

class NoWatcher : public cache_manager::ProcessWatcher {
 public:
  absl::Status Watch(uint64_t, pid_t) override { return absl::OkStatus(); }
  void Unwatch(uint64_t) override {}
};

// A service with a pool of `num_blocks` in the states the header describes.
class FilledService {
 public:
  explicit FilledService(int32_t num_blocks) {
    cache_manager::CacheManagerService::Options options;
    options.spec.num_layers = 2;
    options.spec.num_kv_heads = 2;
    options.spec.head_dim = 64;
    options.spec.dtype = DType::kFloat16;
    options.spec.block_size = kBlockSize;
    options.ledger.num_blocks = num_blocks;
    options.pool.backend = wire::PoolBackend::Shm;
    options.pool.layout.total_bytes = 4096;
    options.pool.fd_channel_path = "/run/kvcm/pool-fd.sock";
    auto service = cache_manager::CacheManagerService::Create(options, &watcher_, nullptr, now_);
    KVCM_CHECK(service.ok()) << service.status();
    service_ = *std::move(service);
    session_ = Hello();
    const int32_t seqs = num_blocks * 3 / 4 / kBlocksPerSeq;
    std::vector<BlockOp> ops;
    std::vector<BlockOp> frees;
    uint32_t next_hash = 1;
    for (int32_t s = 0; s < seqs; ++s) {
      const SeqId seq = static_cast<SeqId>(s) + 1;
      std::vector<BlockHash> hashes;
      if (s % 2 == 0) {  // committed with hashes, then freed: cached
        for (int32_t b = 0; b < kBlocksPerSeq; ++b) {
          BlockHash h;
          const uint32_t v = next_hash++;
          std::memcpy(h.bytes.data(), &v, sizeof(v));
          h.bytes[31] = 0x5a;
          hashes.push_back(h);
        }
      }
      ops.push_back(BlockOp::Allocate(seq, kBlocksPerSeq * kBlockSize, hashes));
      if (s % 2 == 0) {
        frees.push_back(BlockOp::Commit(seq, kBlocksPerSeq * kBlockSize));
        if (s == 0) pin_ = hashes;
      }
      if (ops.size() == 1024 || s + 1 == seqs) {
        Step(ops);
        ops.clear();
      }
    }
    StepInBatches(frees);  // commits
    for (auto& op : frees) op = BlockOp::Free(op.seq);
    StepInBatches(frees);
    request_.Clear();
    const auto pin =
        wire::CreatePin(request_, request_.CreateString("bench"), ToWire(request_, pin_));
    FinishEnvelope(request_, ++request_id_, session_, 1, wire::Message::Pin, pin.Union());
    Send();
    KVCM_CHECK(Reply().payload_type() == wire::Message::PinReply);
    // The BlockMap request the benchmark sends again and again.
    request_.Clear();
    const auto map = wire::CreateBlockMap(request_, 0);
    FinishEnvelope(request_, ++request_id_, session_, 1, wire::Message::BlockMap, map.Union());
    block_map_request_.assign(request_.GetBufferPointer(),
                              request_.GetBufferPointer() + request_.GetSize());
  }

  cache_manager::CacheManagerService& service() { return *service_; }
  // Handles the BlockMap request; the reply stays in reply_.
  void HandleBlockMap() {
    service_->Handle(cache_manager::PeerCredentials{::geteuid(), 1, kRouterPid}, block_map_request_,
                     now_, &reply_);
  }
  const wire::Envelope& Reply() const { return *wire::GetEnvelope(reply_.GetBufferPointer()); }
  size_t reply_bytes() const { return reply_.GetSize(); }

 private:
  uint64_t Hello() {
    request_.Clear();
    const auto hello =
        wire::CreateHello(request_, wire::Role::Router, kRouterPid, request_.CreateString("bench"));
    FinishEnvelope(request_, ++request_id_, 0, 0, wire::Message::Hello, hello.Union());
    Send();
    KVCM_CHECK(Reply().payload_type() == wire::Message::HelloReply);
    return Reply().payload_as_HelloReply()->session_id();
  }
  void StepInBatches(const std::vector<BlockOp>& ops) {
    for (size_t i = 0; i < ops.size(); i += 1024) {
      const auto end = static_cast<ptrdiff_t>(std::min(ops.size(), i + 1024));
      Step(std::vector<BlockOp>(ops.begin() + static_cast<ptrdiff_t>(i), ops.begin() + end));
    }
  }
  void Step(const std::vector<BlockOp>& ops) {
    request_.Clear();
    KVCM_CHECK(EncodeStep(request_, ++request_id_, session_, 1, ops).ok());
    Send();
    KVCM_CHECK(Reply().payload_type() == wire::Message::StepReply)
        << wire::EnumNameMessage(Reply().payload_type());
  }
  void Send() {
    service_->Handle(cache_manager::PeerCredentials{::geteuid(), 1, kRouterPid},
                     std::span<const uint8_t>(request_.GetBufferPointer(), request_.GetSize()),
                     now_, &reply_);
  }

  NoWatcher watcher_;
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
  std::unique_ptr<cache_manager::CacheManagerService> service_;
  uint64_t session_ = 0;
  uint64_t request_id_ = 0;
  std::vector<BlockHash> pin_;
  flatbuffers::FlatBufferBuilder request_;
  flatbuffers::FlatBufferBuilder reply_;
  std::vector<uint8_t> block_map_request_;
};

FilledService& ServiceOf(int32_t num_blocks) {
  static std::map<int32_t, std::unique_ptr<FilledService>> services;
  auto& service = services[num_blocks];
  if (service == nullptr) service = std::make_unique<FilledService>(num_blocks);
  return *service;
}

void ServiceHandleBlockMap(benchmark::State& state) {
  const auto n = static_cast<int32_t>(state.range(0));
  FilledService& filled = ServiceOf(n);
  for (auto _ : state) {
    filled.HandleBlockMap();
    benchmark::DoNotOptimize(filled.reply_bytes());
  }
  const wire::Envelope& reply = filled.Reply();
  KVCM_CHECK(reply.payload_type() == wire::Message::BlockMapReply);
  const auto* map = reply.payload_as_BlockMapReply();
  int64_t sum = 0;
  for (int32_t c : *map->counts()) sum += c;
  KVCM_CHECK(sum == n) << sum;
  state.counters["units"] = n;
  state.counters["reply_bytes"] = static_cast<double>(filled.reply_bytes());
  state.counters["blocks_per_cell"] = map->blocks_per_cell();
  state.counters["in_use"] = map->counts()->Get(1);
  state.counters["cached"] = map->counts()->Get(2);
  state.counters["pinned"] = map->counts()->Get(3);
}

void LedgerFillBlockMap(benchmark::State& state) {
  const auto n = static_cast<int32_t>(state.range(0));
  const BlockLedger& ledger = ServiceOf(n).service().ledger();
  BlockMap map;
  for (auto _ : state) {
    ledger.FillBlockMap(kDefaultBlockMapCells, {}, &map);
    benchmark::DoNotOptimize(map.cells.data());
  }
  state.counters["units"] = n;
}

void BarePassOverRecords(benchmark::State& state) {
  struct Record {
    int32_t ref;
    uint32_t a, b;
    uint16_t pins;
    uint8_t flags, unused;
  };
  static_assert(sizeof(Record) == 16);
  const auto n = static_cast<size_t>(state.range(0));
  std::vector<Record> records(n);
  for (size_t i = 0; i < n; ++i) records[i].ref = static_cast<int32_t>(i % 3 == 0);
  for (auto _ : state) {
    int64_t used = 0;
    for (const Record& r : records) used += r.ref != 0;
    benchmark::DoNotOptimize(used);
  }
  state.counters["units"] = static_cast<double>(n);
}

BENCHMARK(ServiceHandleBlockMap)->Arg(65536)->Arg(1 << 20);
BENCHMARK(LedgerFillBlockMap)->Arg(65536)->Arg(1 << 20);
BENCHMARK(BarePassOverRecords)->Arg(65536)->Arg(1 << 20);

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  kvcm::bench::RatioReporter reporter;
  // Informative goals: a poll should cost a few passes over the records, no more.
  reporter.AddPair("ServiceHandleBlockMap/", "BarePassOverRecords/", 8.0, "block");
  reporter.AddPair("LedgerFillBlockMap/", "BarePassOverRecords/", 8.0, "block");
  return kvcm::bench::RunWithRatios(argc, argv, reporter);
}
