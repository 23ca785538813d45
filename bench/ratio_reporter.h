#pragma once

// RatioReporter: Google Benchmark console output plus, at the end, a table of each
// benchmark's time per unit (block, token, ...) divided by its baseline's, both measured in
// the same run. Shared machines are noisy; only same-run ratios are comparable.
//
// A benchmark reports its units per iteration with `state.counters["units"] = n`. Pairs are
// declared with AddPair(candidate_prefix, baseline_prefix, goal): "candidate/16" is compared
// with "baseline/16". With repetitions, the median is used.

#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace kvcm::bench {

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  struct Pair {
    std::string candidate;
    std::string baseline;
    double goal;  // the candidate should take at most goal × the baseline's time per unit;
                  // 0: informative, no goal
    std::string unit;
  };

  void AddPair(std::string candidate, std::string baseline, double goal, std::string unit) {
    pairs_.push_back({std::move(candidate), std::move(baseline), goal, std::move(unit)});
  }

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred) continue;
      const bool median = run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      if (run.run_type == Run::RT_Aggregate && !median) continue;
      auto units = run.counters.find("units");
      const double per_iter = units == run.counters.end() ? 1.0 : units->second.value;
      const double ns_per_unit = run.GetAdjustedRealTime() / per_iter;
      const std::string name = run.run_name.str();
      // A median overrides single repetitions of the same name.
      if (median || !ns_per_unit_.contains(name)) ns_per_unit_[name] = ns_per_unit;
    }
  }

  // Prints the table. Misses are reported, not failed: benchmarks inform, tests decide.
  void PrintRatios() const {
    std::printf("\n%-44s %-34s %12s %12s %8s %6s\n", "benchmark", "baseline", "ns/unit",
                "base ns/unit", "ratio", "goal");
    for (const auto& [name, ns] : ns_per_unit_) {
      for (const Pair& pair : pairs_) {
        if (name.rfind(pair.candidate, 0) != 0) continue;
        const std::string suffix = name.substr(pair.candidate.size());
        auto base = ns_per_unit_.find(pair.baseline + suffix);
        if (base == ns_per_unit_.end()) continue;
        const double ratio = ns / base->second;
        if (pair.goal <= 0) {  // informative: no goal
          std::printf("%-44s %-34s %12.2f %12.2f %7.2fx %6s (per %s)\n", name.c_str(),
                      (pair.baseline + suffix).c_str(), ns, base->second, ratio, "-",
                      pair.unit.c_str());
          continue;
        }
        const bool ok = ratio <= pair.goal;
        std::printf("%-44s %-34s %12.2f %12.2f %7.2fx %5.2fx %s (per %s)\n", name.c_str(),
                    (pair.baseline + suffix).c_str(), ns, base->second, ratio, pair.goal,
                    ok ? "met" : "MISSED", pair.unit.c_str());
      }
    }
  }

 private:
  std::vector<Pair> pairs_;
  std::map<std::string, double> ns_per_unit_;
};

// Runs the registered benchmarks with `reporter` (3 repetitions, medians, unless the
// command line says otherwise) and prints the ratio table.
inline int RunWithRatios(int argc, char** argv, RatioReporter& reporter) {
  std::vector<char*> args(argv, argv + argc);
  bool has_reps = false;
  for (int i = 1; i < argc; ++i) {
    has_reps |= std::string(argv[i]).rfind("--benchmark_repetitions", 0) == 0;
  }
  std::string reps = "--benchmark_repetitions=3";
  std::string aggregates = "--benchmark_report_aggregates_only=true";
  if (!has_reps) {
    args.push_back(reps.data());
    args.push_back(aggregates.data());
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintRatios();
  benchmark::Shutdown();
  return 0;
}

}  // namespace kvcm::bench
