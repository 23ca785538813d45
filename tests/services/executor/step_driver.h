#pragma once
// StepDriver: a scripted stand-in for the router, so that tests can drive a real
// kvcm-executor process before kvcm-router exists. Test support only.
//
// It binds the ROUTER socket the executor's DEALER connects to, answers ExecutorHello
// (assigning executor id 1), Heartbeat and Goodbye, and talks to a real cache manager as a
// Router (CacheManagerClient) to get block tables: Allocate with the prompt's block hashes,
// then per step Commit what the executor reported and Append room for the next token, all of
// a step's cache-manager ops in one round trip. Generate() prefills every prompt in one step
// and then decodes one token per sequence per step (greedy), the prompts batched together.
//
//   StepDriver::Options options;
//   options.router_endpoint = "ipc://" + dir + "/router-executors.sock";
//   options.cache_manager_endpoint = cache_manager->endpoint();
//   KVCM_ASSIGN_OR_RETURN(auto driver, StepDriver::Start(options));
//   ... start kvcm-executor with --router options.router_endpoint ...
//   KVCM_ASSIGN_OR_RETURN(ExecutorHello hello, driver->AwaitHello(deadline));
//   KVCM_ASSIGN_OR_RETURN(auto seqs, driver->Generate({{1, 5, 9}, {1, 7}}, 8));
//
// Every StepBatch sent is kept (sent_steps()) so that a test can replay the same steps on
// a local pool. One executor at a time (the last that said Hello).
// Thread safety: none; one owner thread.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/block/block_hash.h"
#include "common/client/cache_manager_client.h"
#include "common/wire/executor_codec.h"
#include "schemas/kvcm_executor_generated.h"
#include "zmq.hpp"

namespace kvcm::testing {

class StepDriver {
 public:
  struct Options {
    std::string router_endpoint;         // bound here, e.g. ipc://DIR/router-executors.sock
    std::string cache_manager_endpoint;  // "" = no cache manager (raw traffic only)
    uint32_t heartbeat_interval_ms = 0;  // announced in ExecutorHelloReply
    absl::Duration step_timeout = absl::Seconds(60);  // RunStep's wait for the reply
    SamplingParams sampling;                          // for Generate (default greedy)
  };

  // A sequence as the router tracks it.
  struct Sequence {
    uint64_t id = 0;
    std::vector<int32_t> tokens;  // prompt + generated, in order
    int32_t prompt_len = 0;
    int32_t committed = 0;           // tokens whose KV the executor reported written
    std::vector<int32_t> blocks;     // the block table
    std::vector<BlockHash> hashes;   // hashes of full blocks sent so far
    std::vector<int32_t> generated;  // tokens the executor returned
  };

  // An inbound message, verified; `frame` holds the bytes `envelope` points into.
  struct Inbound {
    zmq::message_t frame;
    const wire::ExecutorEnvelope* envelope = nullptr;
  };

  // Binds the ROUTER and, when an endpoint is given, connects to the cache manager as a
  // Router. Errors: the bind's (UNAVAILABLE), Connect's.
  static absl::StatusOr<std::unique_ptr<StepDriver>> Start(const Options& options);
  ~StepDriver();

  // Waits for an ExecutorHello (answering it). DEADLINE_EXCEEDED naming what did arrive.
  absl::StatusOr<ExecutorHello> AwaitHello(absl::Time deadline);

  // ---- Raw traffic ----------------------------------------------------------------------------

  // Sends `bytes` as one frame to the executor. FAILED_PRECONDITION before any Hello.
  absl::Status SendRaw(std::span<const uint8_t> bytes);
  // The executor's message with envelope request id `request_id` (0: its answer to a message
  // it could not read), answering Hello, Heartbeat and Goodbye meanwhile.
  absl::StatusOr<Inbound> AwaitReply(uint64_t request_id, absl::Time deadline);
  // Serves the executor's own requests (Hello, Heartbeat, Goodbye) until `deadline` or until
  // a Goodbye arrives, whichever is first.
  void ServeUntil(absl::Time deadline, bool stop_at_goodbye = true);

  // ---- Steps ----------------------------------------------------------------------------------

  // Sends `step` (recorded in sent_steps()) and returns its request id. A step without a
  // router_session gets this driver's cache-manager session id (1 without one).
  absl::StatusOr<uint64_t> SendStep(const StepBatch& step);
  // The StepResult of request `request_id`. An ErrorReply becomes its status (FromWire; a
  // StaleEpoch is ABORTED).
  absl::StatusOr<StepResult> AwaitStep(uint64_t request_id, absl::Time deadline);
  // SendStep + AwaitStep with options.step_timeout.
  absl::StatusOr<StepResult> RunStep(const StepBatch& step);

  // ---- Sequences, with the cache manager --------------------------------------------------------

  // Allocates a new sequence holding `tokens` (with the hashes of its full blocks).
  // RESOURCE_EXHAUSTED when the pool is full.
  absl::StatusOr<Sequence> Allocate(std::vector<int32_t> tokens);
  // The work of `seq`'s uncommitted tokens (at least the last one), for a step.
  SeqWork WorkFor(const Sequence& seq, bool sample) const;
  // Frees the sequences at the cache manager.
  absl::Status Free(std::span<const Sequence> seqs);
  // Generates `new_tokens` tokens for each prompt, batched (one prefill step for all, then
  // one decode step per token). The sequences stay allocated unless `free_at_end`.
  absl::StatusOr<std::vector<Sequence>> Generate(const std::vector<std::vector<int32_t>>& prompts,
                                                 int32_t new_tokens, bool free_at_end = true);

  CacheManagerClient& cache_manager() { return *cache_manager_; }
  uint64_t epoch() const { return cache_manager_ == nullptr ? 0 : cache_manager_->epoch(); }
  int32_t block_size() const;
  const std::vector<StepBatch>& sent_steps() const { return sent_steps_; }
  bool goodbye_received() const { return goodbye_received_; }
  int hellos() const { return hellos_; }
  const ExecutorHello& last_hello() const { return last_hello_; }
  // The epoch in the last ExecutorHello's envelope.
  uint64_t hello_epoch() const { return hello_epoch_; }

 private:
  explicit StepDriver(const Options& options);

  // Receives one message until `deadline`; answers the executor's own requests. Returns the
  // message (null envelope after answering a request of the executor, or at the deadline).
  absl::StatusOr<Inbound> ReceiveOne(absl::Time deadline, bool* timed_out);
  absl::Status Send(const std::string& identity, std::span<const uint8_t> bytes);
  // Commit(seq, committed) with the hashes of newly full blocks, added to `batch`.
  void AddCommit(Sequence& seq, int32_t committed, BlockOps* batch) const;

  const Options options_;
  zmq::context_t context_;
  zmq::socket_t router_;
  std::unique_ptr<CacheManagerClient> cache_manager_;
  std::string executor_identity_;  // routing id of the executor that said Hello last
  uint64_t next_request_id_ = 1;
  uint64_t next_seq_ = 1;
  uint64_t next_step_ = 1;
  std::vector<StepBatch> sent_steps_;
  bool goodbye_received_ = false;
  int hellos_ = 0;
  ExecutorHello last_hello_;
  uint64_t hello_epoch_ = 0;
};

}  // namespace kvcm::testing
