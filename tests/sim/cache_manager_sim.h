#pragma once
// A deterministic simulation of a kvcm node around the real CacheManagerService
// (docs/RELIABILITY.md, "Deterministic simulation"). One thread, one seeded std::mt19937_64,
// one simulated clock: the service's logic runs unchanged, fed the same FlatBuffers
// envelopes the real clients send (common/wire/), over a simulated network that drops,
// duplicates, delays and reorders them, with a simulated process watcher in place of pidfds.
//
// Around it: 1-2 routers and 2-3 executors modelled on services/router and services/executor
// (Hello, Attach, Step with request ids and same-bytes retries, Heartbeat with fence_acks,
// Goodbye; an executor runs one step at a time, records and acknowledges fences between
// steps, stops a running step a fence names, re-registers only between steps). Routers
// allocate, append, commit and free sequences and send the block tables to executors, which
// "write" those blocks for a while. The scheduler crashes, hangs and restarts clients and
// the cache manager (a restart is a new service with a new epoch and a new pool).
//
// The oracle, after every event: BlockLedger::CheckInvariants(); no block written by two
// steps at once; every block a step may still write (accepted, its executor neither dead
// nor past it) is in use and was last handed to that step's sequence, so no block is
// reissued while a previous writer may still run, hung executors included. After the
// faults stop and the lease bound passed: no fence open, nothing quarantined or draining,
// every block in use held by a sequence a live router holds.
//
// Everything is a function of the seed: the same seed gives the same events, block ids
// included, on every run (SimResult::digest; std::mt19937_64 and no <random>
// distributions, whose results differ between standard libraries). The service's own
// randomness, its session ids, steers nothing here: traces name sessions s1, s2, ...

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace kvcm::sim {

struct SimOptions {
  uint64_t seed = 1;
  // Simulated time with faults, then without them (at least the lease bound).
  absl::Duration fault_time = absl::Seconds(30);
  absl::Duration quiet_time = absl::Seconds(40);
  // A router sends a step of epoch N only to an executor that announced epoch N (its
  // ExecutorHello after attaching to that pool), as services/router does
  // (ExecutorLink::LiveInEpoch). Off: to any executor attached to some pool, as it did
  // before; an executor that registers in the step's epoch
  // only after the step's router session ended (or drained the sequence) is then in no
  // fence of it, and may write blocks already handed to someone else (docs/RELIABILITY.md,
  // "Deterministic simulation").
  bool router_waits_for_epoch = true;
  // Record every event as text (for a failing seed's replay); costs time.
  bool trace = false;
};

// Counts of one run.
struct SimStats {
  int64_t events = 0;
  int64_t messages = 0;
  int64_t dropped = 0;
  int64_t duplicated = 0;
  int64_t delayed = 0;  // held long enough to be overtaken
  int64_t client_crashes = 0;
  int64_t client_hangs = 0;
  int64_t cm_crashes = 0;
  int64_t cm_hangs = 0;
  int64_t goodbyes = 0;
  int64_t steps_written = 0;  // steps an executor accepted and wrote
  int64_t steps_refused = 0;  // refused by an executor (fenced, another epoch, detached)
  int64_t drained_frees = 0;  // FreeOp.drain of a step given up on
  int64_t fence_acks = 0;
  int64_t quarantines = 0;
  int64_t blocks_handed = 0;
  int64_t writer_checks = 0;

  void Add(const SimStats& other);
};

struct SimResult {
  bool ok = true;
  std::string failure;             // the first violation, with the time and event number
  std::vector<std::string> trace;  // with SimOptions::trace
  uint64_t digest = 0;             // of every event: equal digests, equal runs
  SimStats stats;
  int routers = 0;
  int executors = 0;
};

SimResult RunSimulation(const SimOptions& options);

}  // namespace kvcm::sim
