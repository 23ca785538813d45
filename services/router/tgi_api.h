#pragma once
// The TGI-compatible API's replies (docs/router.md, "HTTP API (TGI-compatible)"), formatted
// from plain values: no sockets, no libevent, so each can be tested and fuzzed on its own.
// The front end (http_frontend.h) sends what these return. Request bodies are parsed by
// RequestParser (http_requests.h), whose TGI members (ParseGenerate, ParseTokenize) are
// defined in tgi_api.cc.
//
//   POST /generate         {"generated_text", "details"} (TgiReply; POST / without
//                          streaming: [that], as TGI does)
//   POST /generate_stream  one event per token, the last one with generated_text and
//                          details (AppendTgiTokenEvent, after kTgiEventField)
//   POST /tokenize         [{"id", "text", "start", "stop"}] (TgiTokenizeReply)
//   GET  /info             the model, the pool, its KV cache groups and the limits
//                          (TgiInfoReply, TgiKvCacheGroups)
//
// Errors: {"error": "...", "error_type": "..."} (TgiErrorBody).
//
// Thread safety: pure functions; `tokenizer` is only read.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/sizing/kv_cache_groups.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json_fwd.hpp"
#include "services/router/generation.h"

namespace kvcm::router {

// How TGI writes a server-sent event's field: "data:", no space.
inline constexpr std::string_view kTgiEventField = "data:";

// TGI's error shape.
nlohmann::json TgiErrorBody(const HttpError& error);

// /generate's reply (and POST /'s: [reply] with g.as_list) once every choice is done: the
// best choice's text and, with details, its tokens, prefill, top tokens and the other
// best_of sequences, best first.
std::string TgiReply(const Generation& g, const Tokenizer& tokenizer);

// The stream event (its JSON, without the field and the blank line) of choice `index`'s
// newest token `token` (already in its `generated`) with `logprob`; `piece` the text it
// adds; `finished`: the last event, with generated_text and details. Written without a DOM
// (stream_events.h): the per-token path.
void AppendTgiTokenEvent(const Generation& g, size_t index, int32_t token, float logprob,
                         bool finished, const std::string& piece, const Tokenizer& tokenizer,
                         std::string* out);

// /tokenize's reply for `body` (whose `inputs` RequestParser::ParseTokenize turned into
// `ids`): each id, its text and, when the ids spell `inputs`, the bytes of it the id stands
// for (start and stop: TGI's SimpleToken; docs/router.md, "HTTP API (TGI-compatible)").
std::string TgiTokenizeReply(std::string_view body, const std::vector<int32_t>& ids,
                             const Tokenizer& tokenizer);

// One KV cache group of the pool as /info shows it in kv_cache_groups (docs/architecture.md,
// "The hybrid KV cache"; docs/router.md, "HTTP API (TGI-compatible)").
struct TgiKvCacheGroup {
  int32_t window_tokens = 0;    // tokens its layers attend within; 0: the whole context
  std::vector<int32_t> layers;  // the model's layer ids, ascending
  // Pool bytes one token of a sequence costs in this group: its block's (a page's) bytes
  // over block_size, padding slots included.
  int64_t bytes_per_token = 0;
  // The most blocks one sequence of max_total_tokens tokens holds in this group while it
  // decodes (BlocksHeldByGroups of this group alone).
  int64_t max_blocks_per_sequence = 0;
  friend bool operator==(const TgiKvCacheGroup&, const TgiKvCacheGroup&) = default;
};

// The pool's KV cache groups as /info shows them, from the pool descriptor: `spec` the
// pool's block (with groups, a page of group_size slots), `groups` its kv_groups and
// `sliding_window_tokens` its window. Without groups, one group of every layer of `spec`
// with the pool's window. REQUIRES: spec.Validate().ok(), max_total_tokens >= 0.
std::vector<TgiKvCacheGroup> TgiKvCacheGroups(const KvCacheSpec& spec,
                                              std::span<const KvCacheGroup> groups,
                                              int32_t sliding_window_tokens,
                                              int32_t max_total_tokens);

// What /info shows: the front end's limits and the pool's.
struct TgiInfo {
  std::string model_id;
  int32_t block_size = 0;
  int32_t num_blocks = 0;
  int64_t max_batch_total_tokens = 0;
  int32_t max_batch_prefill_tokens = 0;
  int32_t max_input_tokens = 0;
  int32_t max_total_tokens = 0;
  int32_t max_concurrent_requests = 0;
  int32_t max_top_n_tokens = 0;
  int32_t max_best_of = 0;
  int32_t executors = 0;                         // live ones
  std::vector<TgiKvCacheGroup> kv_cache_groups;  // shown by group, group 0 first
};
std::string TgiInfoReply(const TgiInfo& info);

}  // namespace kvcm::router
