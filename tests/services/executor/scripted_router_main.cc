// kvcm-test-router: a router that allocates one sequence, sends its executor one step and
// then does nothing but answer heartbeats until it is killed. The fencing tests kill it
// with SIGKILL while its executor is still writing that step. Test support only.
//
//   kvcm-test-router --router ipc://DIR/router-executors.sock
//       --cache-manager ipc://RUN_DIR/cache-manager.sock --prompt-tokens 48
//
// Prints, one line each: "router: session=S", "router: blocks=B0,B1,...", "router: step
// sent". With --drain-when PATH it then gives up on the step once the file PATH exists, as a
// router does whose executor hung, frees the sequence with drain and prints "router: freed
// with drain" (it lives on): the test decides when, rather than a timer racing the test's
// own steps (docs/RELIABILITY.md, "Timing in tests"). Exits 1 with a message on any failure.

#include <sys/stat.h>

#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "tests/services/executor/step_driver.h"

namespace {

int Fail(std::string_view what) {
  std::fprintf(stderr, "router: %.*s\n", static_cast<int>(what.size()), what.data());
  return 1;
}

void Say(const std::string& line) {
  std::printf("router: %s\n", line.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string router, cache_manager;
  int32_t prompt_tokens = 0;
  std::string drain_when;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--router") {
      router = argv[i + 1];
    } else if (flag == "--cache-manager") {
      cache_manager = argv[i + 1];
    } else if (flag == "--drain-when") {
      drain_when = argv[i + 1];
    } else if (flag != "--prompt-tokens" || !absl::SimpleAtoi(argv[i + 1], &prompt_tokens)) {
      return Fail(absl::StrCat("bad flag ", flag));
    }
  }
  if (router.empty() || cache_manager.empty() || prompt_tokens <= 0) {
    return Fail("needs --router, --cache-manager and --prompt-tokens");
  }
  kvcm::testing::StepDriver::Options options;
  options.router_endpoint = router;
  options.cache_manager_endpoint = cache_manager;
  options.heartbeat_interval_ms = 200;
  auto driver = kvcm::testing::StepDriver::Start(options);
  if (!driver.ok()) return Fail(driver.status().ToString());
  Say(absl::StrCat("session=", (*driver)->cache_manager().session_id()));
  auto hello = (*driver)->AwaitHello(absl::Now() + absl::Seconds(60));
  if (!hello.ok()) return Fail(hello.status().ToString());
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < prompt_tokens; ++i) prompt.push_back(1 + (i * 37) % 200);
  auto seq = (*driver)->Allocate(prompt);
  if (!seq.ok()) return Fail(seq.status().ToString());
  Say(absl::StrCat("blocks=", absl::StrJoin(seq->blocks, ",")));
  kvcm::StepBatch step;
  step.step_id = 1;
  step.epoch = (*driver)->epoch();
  step.seqs.push_back((*driver)->WorkFor(*seq, /*sample=*/true));
  auto sent = (*driver)->SendStep(step);
  if (!sent.ok()) return Fail(sent.status().ToString());
  Say("step sent");
  if (!drain_when.empty()) {
    struct stat st {};
    while (::stat(drain_when.c_str(), &st) != 0) {
      (*driver)->ServeUntil(absl::Now() + absl::Milliseconds(10), /*stop_at_goodbye=*/false);
    }
    kvcm::BlockOps free;
    free.Free(seq->id, /*drain=*/true);
    auto freed = (*driver)->cache_manager().Step(free);
    if (!freed.ok() || !(*freed)[0].status.ok()) {
      return Fail(absl::StrCat("free with drain: ",
                               (freed.ok() ? (*freed)[0].status : freed.status()).ToString()));
    }
    Say("freed with drain");
  }
  while (true) (*driver)->ServeUntil(absl::Now() + absl::Seconds(3600), /*stop_at_goodbye=*/false);
}
