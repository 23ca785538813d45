#include "common/wire/executor_codec.h"

#include <cmath>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/wire/convert.h"

namespace kvcm {
namespace {

std::string ReasonOf(const flatbuffers::String* reason) {
  return reason == nullptr ? std::string() : reason->str();
}

template <typename T>
std::vector<T> ToVector(const flatbuffers::Vector<T>* values) {
  return values == nullptr ? std::vector<T>() : std::vector<T>(values->begin(), values->end());
}

std::string SeqName(size_t index, uint64_t seq) {
  return absl::StrCat("seq[", index, "] (id ", seq, ")");
}

}  // namespace

void FinishExecutorEnvelope(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                            uint64_t executor_id, uint64_t epoch, wire::ExecutorMessage type,
                            flatbuffers::Offset<void> payload) {
  wire::ExecutorEnvelopeBuilder envelope(builder);
  envelope.add_version(kProtocolVersion);
  envelope.add_request_id(request_id);
  envelope.add_executor_id(executor_id);
  envelope.add_epoch(epoch);
  envelope.add_payload_type(type);
  envelope.add_payload(payload);
  builder.Finish(envelope.Finish(), kExecutorEnvelopeIdentifier);
}

void FinishExecutorError(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                         uint64_t executor_id, uint64_t epoch, wire::ErrorCode code,
                         std::string_view reason) {
  auto text = builder.CreateString(reason.data(), reason.size());
  auto error = wire::CreateErrorReply(builder, code, text);
  FinishExecutorEnvelope(builder, request_id, executor_id, epoch, wire::ExecutorMessage::ErrorReply,
                         error.Union());
}

std::string_view ExecutorMessageName(wire::ExecutorMessage type) {
  const char* name = wire::EnumNameExecutorMessage(type);
  return name != nullptr && *name != '\0' ? std::string_view(name) : "Unknown";
}

// ---- Steps ----------------------------------------------------------------------------------

void EncodeStepBatch(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                     uint64_t executor_id, const StepBatch& step) {
  std::vector<flatbuffers::Offset<wire::SeqWork>> seqs;
  seqs.reserve(step.seqs.size());
  for (const SeqWork& s : step.seqs) {
    auto tokens = builder.CreateVector(s.tokens);
    auto table = builder.CreateVector(s.block_table);
    auto sampling = wire::CreateSamplingParams(
        builder, s.sampling.temperature, s.sampling.top_p, s.sampling.top_k, s.sampling.seed,
        s.sampling.repetition_penalty, s.sampling.frequency_penalty, s.sampling.presence_penalty,
        s.sampling.min_tokens);
    flatbuffers::Offset<flatbuffers::Vector<int32_t>> penalty_tokens;
    if (!s.penalty_tokens.empty()) penalty_tokens = builder.CreateVector(s.penalty_tokens);
    flatbuffers::Offset<flatbuffers::Vector<uint64_t>> fork_seeds;
    if (!s.fork_seeds.empty()) fork_seeds = builder.CreateVector(s.fork_seeds);
    flatbuffers::Offset<flatbuffers::Vector<int32_t>> group_tables;
    if (!s.group_tables.empty()) group_tables = builder.CreateVector(s.group_tables);
    seqs.push_back(wire::CreateSeqWork(builder, s.seq, tokens, s.context_len, table, sampling,
                                       s.sample, s.sample_index, penalty_tokens,
                                       s.penalty_prompt_len, s.logprobs, s.top_n, s.input_logprobs,
                                       s.score_next, fork_seeds, group_tables));
  }
  std::vector<wire::CopyOrder> copies;
  copies.reserve(step.copies.size());
  for (const CopyOrder& copy : step.copies) copies.emplace_back(copy.src, copy.dst);
  auto seq_vector = builder.CreateVector(seqs);
  auto copy_vector = builder.CreateVectorOfStructs(copies);
  auto batch = wire::CreateStepBatch(builder, step.step_id, step.epoch, seq_vector, copy_vector,
                                     step.router_session);
  FinishExecutorEnvelope(builder, request_id, executor_id, step.epoch,
                         wire::ExecutorMessage::StepBatch, batch.Union());
}

namespace {

// A SeqWork's fields as they are (checked by CheckSeqWork).
SeqWork SeqWorkOf(const wire::SeqWork& w) {
  SeqWork s;
  s.seq = w.seq();
  s.tokens = ToVector(w.tokens());
  s.context_len = w.context_len();
  s.block_table = ToVector(w.block_table());
  s.sample = w.sample();
  s.sample_index = w.sample_index();
  if (const wire::SamplingParams* p = w.sampling()) {
    s.sampling.temperature = p->temperature();
    s.sampling.top_p = p->top_p();
    s.sampling.top_k = p->top_k();
    s.sampling.seed = p->seed();
    s.sampling.repetition_penalty = p->repetition_penalty();
    s.sampling.frequency_penalty = p->frequency_penalty();
    s.sampling.presence_penalty = p->presence_penalty();
    s.sampling.min_tokens = p->min_tokens();
  }
  s.penalty_tokens = ToVector(w.penalty_tokens());
  s.penalty_prompt_len = w.penalty_prompt_len();
  s.logprobs = w.logprobs();
  s.top_n = w.top_n();
  s.input_logprobs = w.input_logprobs();
  s.score_next = w.score_next();
  s.fork_seeds = CopyScalars(w.fork_seeds());
  s.group_tables = ToVector(w.group_tables());
  return s;
}

// What the executor relies on of one sequence's work; `name` says which it is in errors.
absl::Status CheckSeqWork(const SeqWork& s, const std::string& name) {
  if (s.tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has no new tokens"));
  }
  if (s.context_len < static_cast<int64_t>(s.tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has context_len ", s.context_len,
                                                   " below its ", s.tokens.size(), " new tokens"));
  }
  // -1: a block released behind the sequence's sliding window (the executor checks where).
  for (size_t j = 0; j < s.block_table.size(); ++j) {
    if (s.block_table[j] < -1) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " has block id ", s.block_table[j], " at block_table[", j, "]"));
    }
  }
  // Groups 1..'s tables, each as long as group 0's (how many groups: the pool's business).
  if (!s.group_tables.empty() &&
      (s.block_table.empty() || s.group_tables.size() % s.block_table.size() != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has ", s.group_tables.size(),
                                                   " group table entries, not a multiple of its ",
                                                   s.block_table.size(), " block table entries"));
  }
  for (size_t j = 0; j < s.group_tables.size(); ++j) {
    if (s.group_tables[j] < -1) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " has block id ", s.group_tables[j], " at group_tables[", j, "]"));
    }
  }
  if (absl::Status sampling = ValidateSamplingParams(s.sampling); !sampling.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", sampling.message()));
  }
  if (s.top_n < 0 || s.top_n > kMaxTopN) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has top_n ", s.top_n, "; must be in [0, ", kMaxTopN, "]"));
  }
  if (s.penalty_prompt_len < 0 ||
      s.penalty_prompt_len > static_cast<int64_t>(s.penalty_tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has penalty_prompt_len ",
                                                   s.penalty_prompt_len, " for ",
                                                   s.penalty_tokens.size(), " penalty tokens"));
  }
  if (static_cast<int64_t>(s.fork_seeds.size()) > kMaxForkSeeds ||
      (!s.fork_seeds.empty() && !s.sample)) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has ", s.fork_seeds.size(),
                                                   " fork seeds; at most ", kMaxForkSeeds,
                                                   ", and only when it samples"));
  }
  for (int32_t token : s.penalty_tokens) {
    if (token < 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, " has penalty token ", token));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StepBatch> DecodeStepBatch(const wire::StepBatch& step) {
  StepBatch out;
  out.step_id = step.step_id();
  out.epoch = step.epoch();
  out.router_session = step.router_session();
  if (out.router_session == 0) {
    return absl::InvalidArgumentError(
        "the step names no router_session: the router's cache-manager session is required");
  }
  if (const auto* seqs = step.seqs()) {
    out.seqs.reserve(seqs->size());
    absl::flat_hash_set<uint64_t> ids;
    for (flatbuffers::uoffset_t i = 0; i < seqs->size(); ++i) {
      SeqWork s = SeqWorkOf(*seqs->Get(i));
      const std::string name = SeqName(i, s.seq);
      if (!ids.insert(s.seq).second) {
        return absl::InvalidArgumentError(absl::StrCat(name, " appears twice in the step"));
      }
      if (absl::Status checked = CheckSeqWork(s, name); !checked.ok()) return checked;
      out.seqs.push_back(std::move(s));
    }
  }
  if (const auto* copies = step.copies()) {
    out.copies.reserve(copies->size());
    for (flatbuffers::uoffset_t i = 0; i < copies->size(); ++i) {
      const wire::CopyOrder* copy = copies->Get(i);
      if (copy->src() < 0 || copy->dst() < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "copies[", i, "] names block ", copy->src() < 0 ? copy->src() : copy->dst()));
      }
      out.copies.push_back(CopyOrder{copy->src(), copy->dst()});
    }
  }
  return out;
}

void EncodeStepResult(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                      uint64_t executor_id, uint64_t epoch, const StepResult& report) {
  std::vector<flatbuffers::Offset<wire::SeqResult>> results;
  results.reserve(report.results.size());
  for (const SeqResult& outcome : report.results) {
    flatbuffers::Offset<flatbuffers::String> reason;
    if (!outcome.status.ok()) {
      const absl::string_view message = outcome.status.message();
      reason = builder.CreateString(message.data(), message.size());
    }
    flatbuffers::Offset<flatbuffers::Vector<int32_t>> top_ids;
    flatbuffers::Offset<flatbuffers::Vector<float>> top_logprobs;
    flatbuffers::Offset<flatbuffers::Vector<float>> input_logprobs;
    if (!outcome.top_ids.empty()) {
      top_ids = builder.CreateVector(outcome.top_ids);
      top_logprobs = builder.CreateVector(outcome.top_logprobs);
    }
    if (!outcome.input_logprobs.empty()) {
      input_logprobs = builder.CreateVector(outcome.input_logprobs);
    }
    flatbuffers::Offset<flatbuffers::Vector<int32_t>> fork_tokens;
    flatbuffers::Offset<flatbuffers::Vector<float>> fork_logprobs;
    if (!outcome.fork_tokens.empty()) fork_tokens = builder.CreateVector(outcome.fork_tokens);
    if (!outcome.fork_logprobs.empty()) {
      fork_logprobs = builder.CreateVector(outcome.fork_logprobs);
    }
    results.push_back(
        wire::CreateSeqResult(builder, outcome.seq, outcome.status.ok() ? outcome.token : -1,
                              ToWireCode(outcome.status.code()), reason, outcome.logprob, top_ids,
                              top_logprobs, input_logprobs, fork_tokens, fork_logprobs));
  }
  auto vector = builder.CreateVector(results);
  auto result = wire::CreateStepResult(builder, report.step_id, vector, report.prefill_tokens,
                                       report.decode_tokens, report.duration_us);
  FinishExecutorEnvelope(builder, request_id, executor_id, epoch, wire::ExecutorMessage::StepResult,
                         result.Union());
}

StepResult DecodeStepResult(const wire::StepResult& result) {
  StepResult out;
  out.step_id = result.step_id();
  out.prefill_tokens = result.prefill_tokens();
  out.decode_tokens = result.decode_tokens();
  out.duration_us = result.duration_us();
  if (const auto* results = result.results()) {
    out.results.reserve(results->size());
    for (const wire::SeqResult* r : *results) {
      SeqResult outcome;
      outcome.seq = r->seq();
      outcome.token = r->token();
      outcome.logprob = r->logprob();
      outcome.top_ids = ToVector(r->top_ids());
      outcome.top_logprobs = ToVector(r->top_logprobs());
      outcome.top_logprobs.resize(outcome.top_ids.size(), -std::numeric_limits<float>::infinity());
      outcome.input_logprobs = ToVector(r->input_logprobs());
      outcome.fork_tokens = ToVector(r->fork_tokens());
      outcome.fork_logprobs = ToVector(r->fork_logprobs());
      const std::string reason = ReasonOf(r->reason());
      outcome.status = FromWire(r->code(), reason);
      out.results.push_back(std::move(outcome));
    }
  }
  return out;
}

// ---- Registration ---------------------------------------------------------------------------

void EncodeExecutorHello(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                         uint64_t executor_id, uint64_t epoch, const ExecutorHello& hello) {
  const ModelSummary& m = hello.model;
  auto model_name = builder.CreateString(m.name);
  auto eos = builder.CreateVector(m.eos_token_ids);
  auto model = wire::CreateModelSummary(
      builder, model_name, m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads,
      m.head_dim, m.vocab_size, m.max_position_embeddings, eos, ToWire(m.weight_dtype));
  auto name = builder.CreateString(hello.name);
  auto spec = ToWire(builder, hello.kv_spec);
  auto metrics_url = builder.CreateString(hello.metrics_url);
  auto payload = wire::CreateExecutorHello(
      builder, name, hello.pid, model, spec, hello.num_blocks,
      hello.backend == PoolBackend::kCuda ? wire::PoolBackend::Cuda : wire::PoolBackend::Shm,
      metrics_url);
  FinishExecutorEnvelope(builder, request_id, executor_id, epoch,
                         wire::ExecutorMessage::ExecutorHello, payload.Union());
}

absl::StatusOr<ExecutorHello> DecodeExecutorHello(const wire::ExecutorHello& hello) {
  ExecutorHello out;
  out.name = ReasonOf(hello.name());
  out.pid = hello.pid();
  const wire::ModelSummary* m = hello.model();
  if (m == nullptr) return absl::InvalidArgumentError("ExecutorHello has no model summary");
  out.model.name = ReasonOf(m->name());
  out.model.num_layers = m->num_layers();
  out.model.hidden_size = m->hidden_size();
  out.model.num_attention_heads = m->num_attention_heads();
  out.model.num_kv_heads = m->num_kv_heads();
  out.model.head_dim = m->head_dim();
  out.model.vocab_size = m->vocab_size();
  out.model.max_position_embeddings = m->max_position_embeddings();
  out.model.eos_token_ids = ToVector(m->eos_token_ids());
  auto weight_dtype = FromWire(m->weight_dtype());
  if (!weight_dtype.ok()) return weight_dtype.status();
  out.model.weight_dtype = *weight_dtype;
  if (out.model.num_layers <= 0 || out.model.num_kv_heads <= 0 || out.model.head_dim <= 0 ||
      out.model.vocab_size <= 0) {
    return absl::InvalidArgumentError("ExecutorHello's model summary has a non-positive shape");
  }
  auto spec = FromWire(hello.kv_spec());
  if (!spec.ok()) return spec.status();
  out.kv_spec = *spec;
  out.num_blocks = hello.num_blocks();
  out.backend = hello.backend() == wire::PoolBackend::Cuda ? PoolBackend::kCuda : PoolBackend::kShm;
  out.metrics_url = ReasonOf(hello.metrics_url());
  return out;
}

}  // namespace kvcm
