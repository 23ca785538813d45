#include "services/router/dashboard.h"

#include <unistd.h>

#include <future>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/log.h"
#include "common/base/monotonic_clock.h"
#include "nlohmann/json.hpp"

// The page's bytes, from services/router/dashboard/dashboard.html (cmake/KvcmEmbed.cmake).
extern "C" const unsigned char kvcm_dashboard_html[];
extern "C" const size_t kvcm_dashboard_html_size;

namespace kvcm::router {
namespace {

using json = nlohmann::json;

double UnixSeconds() { return absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()); }

json ErrorState(std::string_view what) {
  return json{{"error", std::string(what)}, {"time", UnixSeconds()}};
}

// What the page says while the cache manager cannot be reached: a fixed sentence and the
// status's code. The status's own message names the endpoint (the run directory's absolute
// path), and the page is served to whoever reaches the HTTP port (docs/router.md,
// "Metrics"); the router's log has the whole status.
std::string ShownError(const absl::Status& status) {
  if (status.code() == absl::StatusCode::kAborted) {
    return "the cache manager restarted: connecting again";
  }
  return absl::StrCat("the cache manager does not answer (",
                      absl::StatusCodeToString(status.code()), ")");
}

const char* ApiName(Api api) { return api == Api::kOpenAi ? "openai" : "tgi"; }

}  // namespace

Dashboard::Dashboard(Options options, RouterCore* core)
    : options_(std::move(options)), core_(core) {
  state_ = json{{"error", nullptr}, {"pending", true}}.dump();
  thread_ = std::thread([this] { Run(); });
}

Dashboard::~Dashboard() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::string_view Dashboard::Page() {
  return std::string_view(reinterpret_cast<const char*>(kvcm_dashboard_html),
                          kvcm_dashboard_html_size);
}

std::string Dashboard::StateJson() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!fetch_wanted_ && MonotonicNow() - state_time_ >= options_.refresh) {
    fetch_wanted_ = true;
    wake_.notify_all();
  }
  return state_;
}

void Dashboard::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (!fetch_wanted_) {
      wake_.wait(lock);  // until a poll finds the state old
      continue;
    }
    lock.unlock();
    std::string state = Fetch();
    lock.lock();
    state_ = std::move(state);
    state_time_ = MonotonicNow();
    fetch_wanted_ = false;
  }
}

std::string Dashboard::Fetch() {
  if (client_ == nullptr) {
    CacheManagerClient::Options options;
    options.endpoint = options_.cache_manager_endpoint;
    options.role = wire::Role::Control;
    options.name = options_.name;
    options.call_timeout = options_.call_timeout;
    absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
        CacheManagerClient::Connect(options);
    if (!client.ok()) return Failed(client.status());
    client_ = *std::move(client);
  }
  absl::StatusOr<BlockMap> map = client_->GetBlockMap(static_cast<uint32_t>(options_.max_cells));
  absl::StatusOr<StatsSnapshot> stats =
      map.ok() ? client_->Stats() : absl::StatusOr<StatsSnapshot>(map.status());
  if (!stats.ok()) {
    // A restarted cache manager (ABORTED) or one that stopped answering: connect again at
    // the next fetch.
    if (stats.status().code() == absl::StatusCode::kAborted) client_.reset();
    return Failed(stats.status());
  }
  logged_error_.clear();

  // The scheduler's view, taken between steps on its thread.
  auto promise = std::make_shared<std::promise<RouterView>>();
  std::future<RouterView> future = promise->get_future();
  core_->RequestView(options_.max_sequences,
                     [promise](RouterView view) { promise->set_value(std::move(view)); });
  std::optional<RouterView> view;
  if (future.wait_for(absl::ToChronoNanoseconds(options_.call_timeout)) ==
      std::future_status::ready) {
    view = future.get();
  }

  json counts = json::object();
  for (int s = 0; s < kMapStates; ++s) {
    counts[std::string(MapStateName(static_cast<MapState>(s)))] = map->counts[s];
  }
  std::string cells(map->cells.size(), '0');
  for (size_t i = 0; i < cells.size(); ++i) {
    cells[i] = static_cast<char>('0' + static_cast<int>(map->cells[i]));
  }
  json state = {
      {"error", nullptr},
      {"time", UnixSeconds()},
      {"pool",
       {{"num_blocks", map->num_blocks},
        {"block_size", stats->block_size},
        {"blocks_per_cell", map->blocks_per_cell},
        {"states", json::array({"free", "in_use", "cached", "pinned", "quarantined", "draining"})},
        {"cells", cells},
        {"counts", counts}}},
      {"cache",
       {{"usage_ratio", stats->usage_ratio},
        {"occupancy_ratio", stats->occupancy_ratio},
        {"prefix_query_tokens", stats->prefix_query_tokens},
        {"prefix_hit_tokens", stats->prefix_hit_tokens},
        {"live_sequences", stats->live_sequences},
        {"evictions", stats->evictions},
        {"open_fences", stats->open_fences},
        {"epoch", stats->epoch},
        {"uptime_seconds", stats->uptime_seconds}}},
      {"router", nullptr}};
  if (view.has_value()) {
    json sequences = json::array();
    for (const RouterView::Sequence& s : view->sequences) {
      sequences.push_back({{"request", s.request},
                           {"choice", s.choice},
                           {"api", ApiName(s.api)},
                           {"prompt_tokens", s.prompt_tokens},
                           {"generated_tokens", s.generated_tokens},
                           {"blocks", s.blocks},
                           {"executor", s.executor}});
    }
    json executors = json::array();
    for (const RouterView::Executor& e : view->executors) {
      executors.push_back({{"id", e.id},
                           {"name", e.name},
                           {"pid", e.pid},
                           {"connected", true},
                           {"busy", e.busy},
                           {"steps", e.steps},
                           {"last_step_seconds", e.last_step_seconds},
                           {"connected_seconds", e.connected_seconds},
                           {"silent_seconds", e.silent_seconds}});
    }
    state["router"] = {{"pid", ::getpid()},
                       {"steps", view->steps},
                       {"queued", view->queued},
                       {"running", view->running},
                       {"recovering", view->recovering},
                       {"draining", view->draining},
                       {"sequences", std::move(sequences)},
                       {"executors", std::move(executors)}};
  }
  return state.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string Dashboard::Failed(const absl::Status& status) {
  // Logged once while it lasts, not at every fetch.
  const std::string shown = ShownError(status);
  if (shown != logged_error_) {
    LogLine("kvcm-router", absl::StrCat("dashboard: ", status.ToString()));
    logged_error_ = shown;
  }
  return ErrorState(shown).dump();
}

}  // namespace kvcm::router
