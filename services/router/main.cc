// kvcm-router: HTTP in (TGI's API), continuous batching over the cache manager's pool, steps
// out to the executors (docs/architecture.md).
//
//   kvcm-router --model DIR|FILE.gguf --run-dir RUN_DIR --port 3000
//
// A flag not on the command line may come from KVCM_ROUTER_<FLAG> or --config FILE
// (common/config/config.h); nothing below main reads flags or the environment.

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/base/command_line.h"
#include "common/base/log.h"
#include "common/base/run_dir.h"
#include "common/base/termination_signals.h"
#include "common/base/unique_fd.h"
#include "common/chat/chat_template.h"
#include "common/config/config.h"
#include "common/model/model_metadata.h"
#include "common/tokenizer/tokenizer.h"
#include "common/transport/accept_guard.h"
#include "common/transport/descriptor_limit.h"
#include "services/router/dashboard.h"
#include "services/router/http_frontend.h"
#include "services/router/router_core.h"

ABSL_FLAG(std::string, model, "",
          "The model: a Hugging Face folder (config.json, tokenizer) or a GGUF file. Required.");
ABSL_FLAG(std::string, chat_template, "",
          "A Jinja chat template file for /v1/chat/completions, instead of the model's own.");
ABSL_FLAG(std::string, run_dir, "", "The cache manager's run directory. Default: as it has.");
ABSL_FLAG(std::string, cache_manager, "",
          "The cache manager's endpoint. Default: ipc://RUN_DIR/cache-manager.sock.");
ABSL_FLAG(std::string, executor_endpoint, "",
          "Where executors connect. Default: ipc://RUN_DIR/router-executors.sock.");
ABSL_FLAG(std::string, hostname, "127.0.0.1", "The HTTP address to listen on.");
ABSL_FLAG(int32_t, port, 3000, "The HTTP port (0: any free one, printed on the ready line).");
ABSL_FLAG(std::string, allowed_hosts, "",
          "Comma-separated host names (or IP literals) a request's Host header may name besides "
          "--hostname, localhost, 127.0.0.1 and [::1] (any IP literal when --hostname is "
          "0.0.0.0 or ::); others get 403, so a page rebound to this address by DNS cannot "
          "read it. *: any. Default: none.");
ABSL_FLAG(int32_t, max_concurrent_requests, 128, "Requests in flight at most; more get 429.");
ABSL_FLAG(int32_t, max_input_tokens, 1024, "Prompt tokens per request at most.");
ABSL_FLAG(int64_t, max_request_body_bytes, 1 << 20,
          "Largest HTTP request body; larger ones get 413.");
ABSL_FLAG(int64_t, max_request_header_bytes, 16 << 10,
          "Largest HTTP request line and headers together; larger ones get 400.");
ABSL_FLAG(int32_t, http_request_timeout_ms, 10000,
          "An HTTP request must arrive whole (headers and body) within this of its first "
          "byte, or its connection is dropped (slow clients, slowloris); 0: no limit.");
ABSL_FLAG(int32_t, http_idle_timeout_seconds, 60,
          "An HTTP connection on which nothing is read or written this long is closed.");
ABSL_FLAG(int32_t, max_total_tokens, 2048, "Prompt plus max_new_tokens per request at most.");
ABSL_FLAG(int32_t, max_batch_prefill_tokens, 4096, "Prompt tokens computed in one step.");
ABSL_FLAG(int64_t, max_batch_total_tokens, 0,
          "KV tokens of the running sequences after a step. Default: what the pool holds.");
ABSL_FLAG(int32_t, max_running, 256, "Sequences in one step at most.");
ABSL_FLAG(int32_t, max_best_of, 4,
          "Most sequences one request may generate (TGI's best_of, OpenAI's n and best_of), "
          "at most 16 and at most --max-running.");
ABSL_FLAG(int32_t, max_top_n_tokens, 5,
          "Most alternatives a request may ask for per token (TGI's top_n_tokens, OpenAI's "
          "logprobs); at most 20.");
ABSL_FLAG(int32_t, drain_timeout_ms, 10000,
          "At SIGTERM/SIGINT, how long running requests may take to finish (new ones get "
          "503). A second signal stops at once.");

ABSL_FLAG(std::string, step_trace, "",
          "A file to write one JSON line per step to (times of its parts, its batch); for "
          "diagnosis and benchmarks (docs/router.md). Default: none.");

namespace kvcm {
namespace {

constexpr char kComponent[] = "kvcm-router";
void Log(std::string_view text) { LogLine(kComponent, text); }

// `value` without the folders of a path in it: "/srv/models/SmolLM2" is "SmolLM2",
// "ipc:///run/kvcm/cache-manager.sock" is "ipc://cache-manager.sock"; a value without a '/'
// is itself.
std::string WithoutFolders(std::string_view value) {
  std::string_view scheme;
  if (const size_t colon = value.find("://"); colon != std::string_view::npos) {
    scheme = value.substr(0, colon + 3);
    value.remove_prefix(colon + 3);
  }
  while (value.size() > 1 && value.back() == '/') value.remove_suffix(1);
  if (const size_t slash = value.rfind('/'); slash != std::string_view::npos && value.size() > 1) {
    value.remove_prefix(slash + 1);
  }
  return std::string(scheme).append(value);
}

// kvcm_router_config_info's settings: every string without the folders of a path in it.
// /metrics is served on the HTTP port to whoever reaches it, and the absolute paths of the
// run directory, the model and the chat template are the operator's, not its clients'
// (docs/router.md, "Metrics"); the configuration logged at start keeps them whole.
std::vector<config::Setting> ExportedSettings(std::vector<config::Setting> settings) {
  for (config::Setting& setting : settings) {
    if (setting.type == config::Type::kString) setting.value = WithoutFolders(setting.value);
  }
  return settings;
}

// The flags whose values are checked on their own, before anything is read or started.
absl::Status CheckFlags() {
  if (absl::GetFlag(FLAGS_max_best_of) < 1 || absl::GetFlag(FLAGS_max_best_of) > 16 ||
      absl::GetFlag(FLAGS_max_best_of) > absl::GetFlag(FLAGS_max_running)) {
    return absl::InvalidArgumentError("--max-best-of must be in [1, 16] and at most --max-running");
  }
  if (absl::GetFlag(FLAGS_max_top_n_tokens) < 0 ||
      absl::GetFlag(FLAGS_max_top_n_tokens) > kMaxTopN) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-top-n-tokens must be in [0, ", kMaxTopN, "]"));
  }
  if (absl::GetFlag(FLAGS_drain_timeout_ms) < 0) {
    return absl::InvalidArgumentError("--drain-timeout-ms must be >= 0");
  }
  if (absl::GetFlag(FLAGS_max_request_body_bytes) < 1024 ||
      absl::GetFlag(FLAGS_max_request_header_bytes) < 1024) {
    return absl::InvalidArgumentError(
        "--max-request-body-bytes and --max-request-header-bytes must be at least 1024");
  }
  if (absl::GetFlag(FLAGS_http_request_timeout_ms) < 0 ||
      absl::GetFlag(FLAGS_http_idle_timeout_seconds) <= 0) {
    return absl::InvalidArgumentError(
        "--http-request-timeout-ms must be >= 0 and --http-idle-timeout-seconds > 0");
  }
  return absl::OkStatus();
}

// The chat template: --chat-template FILE (which replaces the model's in *metadata), else
// the model's; none when there is none or it cannot be parsed (then
// /v1/chat/completions answers 501 saying why). Errors: NOT_FOUND for an unreadable FILE.
absl::StatusOr<std::optional<ChatTemplate>> LoadChatTemplate(ModelMetadata* metadata) {
  if (!absl::GetFlag(FLAGS_chat_template).empty()) {
    const std::string path = absl::GetFlag(FLAGS_chat_template);
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read --chat-template ", path));
    metadata->chat_template = text.str();
    metadata->chat_template_source = path;
  }
  std::optional<ChatTemplate> chat_template;
  if (!metadata->chat_template.empty()) {
    absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse(metadata->chat_template);
    if (!parsed.ok()) {
      // A server without chat is still a server: /v1/chat/completions says why it cannot.
      Log(absl::StrCat("the chat template of ", metadata->chat_template_source, " cannot be used (",
                       parsed.status().message(),
                       "); /v1/chat/completions answers 501 until --chat-template FILE gives one"));
    } else {
      chat_template = *std::move(parsed);
      Log(absl::StrCat("chat template from ", metadata->chat_template_source));
    }
  } else {
    Log("the model has no chat template: /v1/chat/completions answers 501 until "
        "--chat-template FILE gives one");
  }
  return chat_template;
}

// The HTTP front end's options: the flags', the model's and the pool's as the core sees it.
router::HttpFrontend::Options HttpOptions(std::vector<std::string> allowed_hosts,
                                          const ModelMetadata& metadata,
                                          const std::optional<ChatTemplate>& chat_template,
                                          const router::RouterCore& core) {
  router::HttpFrontend::Options http;
  http.host = absl::GetFlag(FLAGS_hostname);
  http.port = absl::GetFlag(FLAGS_port);
  http.allowed_hosts = std::move(allowed_hosts);
  http.max_concurrent_requests = absl::GetFlag(FLAGS_max_concurrent_requests);
  http.max_input_tokens = absl::GetFlag(FLAGS_max_input_tokens);
  http.max_body_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_request_body_bytes));
  http.max_header_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_request_header_bytes));
  http.request_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_http_request_timeout_ms));
  http.timeout_seconds = absl::GetFlag(FLAGS_http_idle_timeout_seconds);
  http.max_total_tokens = absl::GetFlag(FLAGS_max_total_tokens);
  http.max_top_n_tokens = absl::GetFlag(FLAGS_max_top_n_tokens);
  http.max_best_of = absl::GetFlag(FLAGS_max_best_of);
  http.model_id = metadata.name;
  http.chat_template = chat_template.has_value() ? &*chat_template : nullptr;
  http.bos_token = metadata.bos_token;
  http.eos_token = metadata.eos_token;
  http.block_size = core.session().block_size;
  http.num_blocks = core.session().num_blocks;
  http.max_batch_total_tokens = core.planner_options().max_batch_total_tokens;
  http.max_batch_prefill_tokens = core.planner_options().max_batch_prefill_tokens;
  const PoolDescriptorInfo& pool = core.pool();
  http.kv_cache_groups = router::TgiKvCacheGroups(
      pool.spec, pool.kv_groups, pool.sliding_window_tokens, http.max_total_tokens);
  return http;
}

int Main(const std::vector<config::Setting>& settings) {
  Log(config::Describe(settings, config::ConfigFilePath()));
  UniqueFd signal_fd = BlockTerminationSignals();
  if (!signal_fd.valid()) {
    Log("cannot create a signalfd");
    return 1;
  }
  auto fail = [](const absl::Status& status) {
    Log(absl::StrCat("error: ", status.message()));
    return 1;
  };
  // At the descriptor limit, libzmq aborts the process on the EMFILE of an executor's
  // connection; the HTTP port stops accepting before that (docs/router.md, "Connections at
  // the descriptor limit"), and the guard closes what still arrives when none is left.
  // Every connection holds a descriptor: the soft limit (often 1024) goes up to the hard one.
  if (std::optional<RaisedLimit> raised = RaiseDescriptorLimit(); raised.has_value()) {
    Log(absl::StrCat("file descriptor limit raised from ", raised->before, " to ", raised->after));
  }
  if (absl::Status guard = InstallAcceptGuard(); !guard.ok()) return fail(guard);
  if (absl::Status checked = CheckFlags(); !checked.ok()) return fail(checked);
  const std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) return fail(absl::InvalidArgumentError("--model is required"));
  absl::StatusOr<std::vector<std::string>> allowed_hosts =
      router::HttpFrontend::ParseAllowedHosts(absl::GetFlag(FLAGS_allowed_hosts));
  if (!allowed_hosts.ok()) return fail(allowed_hosts.status());
  const std::string run_dir = std::string(absl::StripSuffix(absl::GetFlag(FLAGS_run_dir).empty()
                                                                ? DefaultRunDirFromEnvironment()
                                                                : absl::GetFlag(FLAGS_run_dir),
                                                            "/"));
  absl::StatusOr<ModelMetadata> metadata = ReadModelMetadata(model);
  if (!metadata.ok()) return fail(metadata.status());
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadModelTokenizer(*metadata);
  if (!tokenizer.ok()) return fail(tokenizer.status());
  absl::StatusOr<std::optional<ChatTemplate>> chat_template = LoadChatTemplate(&*metadata);
  if (!chat_template.ok()) return fail(chat_template.status());

  router::RouterCore::Options core_options;
  core_options.cache_manager_endpoint = absl::GetFlag(FLAGS_cache_manager).empty()
                                            ? IpcEndpointIn(run_dir, kCacheManagerSocket)
                                            : absl::GetFlag(FLAGS_cache_manager);
  core_options.executor_endpoint = absl::GetFlag(FLAGS_executor_endpoint).empty()
                                       ? IpcEndpointIn(run_dir, kRouterExecutorsSocket)
                                       : absl::GetFlag(FLAGS_executor_endpoint);
  core_options.name = absl::StrCat("router-", ::getpid());
  core_options.max_batch_prefill_tokens = absl::GetFlag(FLAGS_max_batch_prefill_tokens);
  core_options.max_batch_total_tokens = absl::GetFlag(FLAGS_max_batch_total_tokens);
  core_options.max_running = absl::GetFlag(FLAGS_max_running);
  core_options.drain_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_drain_timeout_ms));
  core_options.eos_token_ids = metadata->eos_token_ids;
  router::RouterMetrics metrics;
  config::ExportInfoMetric(*metrics.registry(), "kvcm_router_config_info",
                           ExportedSettings(settings), WithoutFolders(config::ConfigFilePath()));
  core_options.metrics = &metrics;
  std::unique_ptr<router::StepTrace> step_trace;
  if (!absl::GetFlag(FLAGS_step_trace).empty()) {
    absl::StatusOr<std::unique_ptr<router::StepTrace>> opened =
        router::StepTrace::Open(absl::GetFlag(FLAGS_step_trace));
    if (!opened.ok()) return fail(opened.status());
    step_trace = *std::move(opened);
    core_options.step_trace = step_trace.get();
  }
  if ((*tokenizer)->eos_id() >= 0 && core_options.eos_token_ids.empty()) {
    core_options.eos_token_ids = {(*tokenizer)->eos_id()};
  }
  Log(absl::StrCat(
      "generation ends at token(s) ", absl::StrJoin(core_options.eos_token_ids, ", "),
      metadata->gguf ? " (GGUF eos and eot ids)" : " (config.json, generation_config.json)"));
  std::atomic<router::HttpFrontend*> frontend_ptr{nullptr};
  auto core = router::RouterCore::Create(core_options,
                                         [&frontend_ptr](std::vector<router::TokenEvent> events) {
                                           if (router::HttpFrontend* f = frontend_ptr.load())
                                             f->Deliver(std::move(events));
                                         });
  if (!core.ok()) return fail(core.status());

  router::HttpFrontend::Options http =
      HttpOptions(*std::move(allowed_hosts), *metadata, *chat_template, **core);
  // GET /dashboard: its own control session to the cache manager, opened at the first poll.
  router::Dashboard::Options dashboard_options;
  dashboard_options.cache_manager_endpoint = core_options.cache_manager_endpoint;
  dashboard_options.name = absl::StrCat("router-", ::getpid(), "-dashboard");
  router::Dashboard dashboard(dashboard_options, core->get());
  http.dashboard = &dashboard;
  auto frontend = router::HttpFrontend::Start(http, tokenizer->get(), core->get(), &metrics);
  if (!frontend.ok()) return fail(frontend.status());
  frontend_ptr.store(frontend->get());
  Log(absl::StrCat("ready http=http://", http.host, ":", (*frontend)->port(), " metrics=http://",
                   http.host, ":", (*frontend)->port(), "/metrics",
                   " executors=", core_options.executor_endpoint,
                   " cache_manager=", core_options.cache_manager_endpoint,
                   " block_size=", http.block_size, " num_blocks=", http.num_blocks));
  const absl::Status ran = (*core)->Run(signal_fd.get());
  frontend_ptr.store(nullptr);
  (*frontend)->Stop();
  if (!ran.ok()) return fail(ran);
  Log("stopped");
  return 0;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  return kvcm::config::RunMain(
      argc, argv,
      {.binary = "kvcm-router",
       .section = "router",
       .usage = "serves a model over HTTP (TGI's API) with kvcm's cache manager and executors.\n"
                "  kvcm-router --model DIR --run-dir RUN_DIR --port 3000",
       .defining_file = __FILE__,
       .run = &kvcm::Main});
}
