#include "services/router/step_trace.h"

#include <cerrno>
#include <cinttypes>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvcm::router {

absl::StatusOr<std::unique_ptr<StepTrace>> StepTrace::Open(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "we");
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot open the step trace ", path, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<StepTrace>(new StepTrace(file));
}

StepTrace::~StepTrace() { std::fclose(file_); }

void StepTrace::Record(const StepTraceEntry& e) {
  const int written = std::fprintf(
      file_,
      "{\"step\":%" PRIu64 ",\"planned_ns\":%" PRId64 ",\"cache_manager_ns\":%" PRId64
      ",\"dispatched_ns\":%" PRId64 ",\"answered_ns\":%" PRId64 ",\"delivered_ns\":%" PRId64
      ",\"sequences\":%d,\"prefill_tokens\":%d,\"decode_tokens\":%d,\"tokens\":%d,"
      "\"executors\":%d}\n",
      e.step, e.planned_ns, e.cache_manager_ns, e.dispatched_ns, e.answered_ns, e.delivered_ns,
      e.sequences, e.prefill_tokens, e.decode_tokens, e.tokens, e.executors);
  if (written < 0 || std::fflush(file_) != 0) ++write_errors_;
}

}  // namespace kvcm::router
