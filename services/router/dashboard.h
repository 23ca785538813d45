#pragma once
// Dashboard: what the router's GET /dashboard and GET /dashboard/state serve
// (docs/operations.md, "The live pool view"). /dashboard is one self-contained page
// (services/router/dashboard/dashboard.html, embedded into the binary at build time: no
// file, CDN or other fetch at run time); it polls /dashboard/state about once a second.
//
// The state is JSON: the pool as a map from the cache manager's BlockMap (the states of
// every block or run of blocks, and the blocks in each state), its Stats (occupancy, the
// prefix cache's query and hit tokens), and the scheduler's RouterView (running sequences,
// at most Options::max_sequences of them, and the executors). It holds no secrets,
// session ids, handles or paths: while the cache manager cannot be reached, "error" is a
// fixed sentence with the status's code.
//
// Cost. A refresher thread of its own, with its own control session to the cache manager
// (connected at the first poll, never on the step path), fetches BlockMap and Stats and
// asks the core for its view when a poll finds the latest state older than
// Options::refresh: at most one fetch per refresh however many pages are open, one per
// poll for one page, none for a router nobody watches (but for the idle session's
// heartbeats). A poll never waits for the cache manager or the core: it is answered with
// the latest state, which is as old as the previous poll (about a second for one page).
//
// Thread safety: StateJson() from any thread; the rest from the thread that owns it.

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "services/router/router_core.h"

namespace kvcm::router {

class Dashboard {
 public:
  struct Options {
    std::string cache_manager_endpoint;  // the router's own
    std::string name = "router-dashboard";
    // Cells of the pool map: a pool with more blocks shows runs of blocks per cell.
    // More cells show more detail and cost the page more to draw (4096 draws in well under
    // a millisecond).
    int32_t max_cells = 4096;
    // The oldest running sequences listed (all are counted).
    size_t max_sequences = 32;
    // At most one fetch per this: the cache manager's cost is one pass over its ledger.
    absl::Duration refresh = absl::Milliseconds(250);
    // Calls to the cache manager and the wait for the core's view.
    absl::Duration call_timeout = absl::Seconds(1);
  };

  // Starts the refresher thread (it connects at the first poll). `core` outlives this.
  Dashboard(Options options, RouterCore* core);
  ~Dashboard();  // stops and joins the thread
  Dashboard(const Dashboard&) = delete;
  Dashboard& operator=(const Dashboard&) = delete;

  // The latest state (JSON: an object with "error" set while the cache manager cannot be
  // reached, with "pending" before the first fetch); never blocks on the cache manager or
  // the core.
  std::string StateJson();

  // The page, text/html.
  static std::string_view Page();

 private:
  void Run();
  // One fetch: the state, or one with "error" set.
  std::string Fetch();
  // The state of a fetch that failed with `status`: a fixed sentence and its code, never
  // the status's message (it names the run directory); the whole status is logged.
  std::string Failed(const absl::Status& status);

  const Options options_;
  RouterCore* const core_;
  std::unique_ptr<CacheManagerClient> client_;  // the refresher thread's only
  std::string logged_error_;                    // the refresher thread's only

  std::mutex mu_;
  std::condition_variable wake_;
  std::string state_;          // guarded by mu_
  absl::Time state_time_;      // guarded by mu_; of state_
  bool fetch_wanted_ = false;  // guarded by mu_; a poll found state_ old
  bool stop_ = false;          // guarded by mu_
  std::thread thread_;
};

}  // namespace kvcm::router
