#include "tests/support/fuzz_target.h"

#include <cstdio>
#include <cstdlib>

namespace kvcm::fuzz {
namespace {
uint64_t accepted = 0;
}  // namespace

void NoteAccepted() { ++accepted; }

uint64_t AcceptedCount() { return accepted; }

void Fail(std::string_view what) {
  std::fprintf(stderr, "fuzz target: broken contract: %.*s\n", static_cast<int>(what.size()),
               what.data());
  std::fflush(stderr);
  std::abort();
}

}  // namespace kvcm::fuzz
