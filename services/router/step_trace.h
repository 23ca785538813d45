#pragma once
// StepTrace: `kvcm-router --step-trace FILE` writes one JSON line per step the router turned
// (docs/router.md, "Step trace"), for looking at a step's parts and at the pace tokens are
// made: when it was planned, how long the cache manager took, when the executors were sent
// their batches and when the last one answered, and when the tokens went to the HTTP thread.
// Times are CLOCK_MONOTONIC nanoseconds (MonotonicNow), so they compare with those of any
// other process on the machine, never with the wall clock.
//
// One line, written and flushed as the step finishes (a write(2) per step, so it is meant for
// diagnosis and benchmarks, not left on by default):
//   {"step":12,"planned_ns":…,"cache_manager_ns":…,"dispatched_ns":…,"answered_ns":…,
//    "delivered_ns":…,"sequences":256,"prefill_tokens":0,"decode_tokens":256,"tokens":256,
//    "executors":2}
// `cache_manager_ns` is a duration (0 when the step had no block ops); the other *_ns are
// instants. `tokens` counts the generated tokens handed to the HTTP thread.
//
// Thread safety: used by the scheduling thread only.

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvcm::router {

struct StepTraceEntry {
  uint64_t step = 0;
  int64_t planned_ns = 0;
  int64_t cache_manager_ns = 0;
  int64_t dispatched_ns = 0;
  int64_t answered_ns = 0;
  int64_t delivered_ns = 0;
  int32_t sequences = 0;
  int32_t prefill_tokens = 0;
  int32_t decode_tokens = 0;
  int32_t tokens = 0;
  int32_t executors = 0;
};

class StepTrace {
 public:
  // Creates or truncates `path`.
  static absl::StatusOr<std::unique_ptr<StepTrace>> Open(const std::string& path);
  StepTrace(const StepTrace&) = delete;
  StepTrace& operator=(const StepTrace&) = delete;
  ~StepTrace();

  // Appends one line and flushes it; a failed write is counted, never fatal.
  void Record(const StepTraceEntry& entry);
  uint64_t write_errors() const { return write_errors_; }

 private:
  explicit StepTrace(std::FILE* file) : file_(file) {}
  std::FILE* file_;
  uint64_t write_errors_ = 0;
};

}  // namespace kvcm::router
