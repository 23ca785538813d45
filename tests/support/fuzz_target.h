#pragma once
// The contract between a fuzz target and what drives it.
//
// A fuzz target is one function, LLVMFuzzerTestOneInput(data, size), that feeds one input to
// an inbound decoder (and whatever the decoded value reaches) and checks the decoder's
// contract: any bytes are accepted or refused with a status, never a crash, a leak, a hang
// or undefined behaviour; what is accepted holds the invariants the header promises. A
// broken invariant calls Fail(), which aborts.
//
// Each target is built twice (kvcm_fuzz_target in cmake/KvcmFuzz.cmake):
//   - NAME_seed_test, in every build: tests/support/fuzz_driver.cc runs the target over
//     its committed seed corpus and a fixed number of seeded mutations of it (a gtest);
//   - NAME_fuzzer, with KVCM_FUZZERS=ON and clang: a libFuzzer binary (coverage-guided,
//     AddressSanitizer and UndefinedBehaviorSanitizer), run by scripts/fuzz.sh.
//
// Thread safety: a target runs one input at a time on one thread.

#include <cstddef>
#include <cstdint>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace kvcm::fuzz {

// A target calls this once for an input that its decoder accepted and that went the whole
// way (rather than being refused with a status). The seed driver requires every seed of the
// corpus to be accepted, and some but not all mutants.
void NoteAccepted();

// Inputs accepted so far in this process.
uint64_t AcceptedCount();

// A broken contract: prints `what` to stderr and aborts (libFuzzer then saves the input as
// a crash; the seed driver's test fails).
[[noreturn]] void Fail(std::string_view what);

// Fail(what) unless `condition`.
inline void Check(bool condition, std::string_view what) {
  if (!condition) Fail(what);
}

}  // namespace kvcm::fuzz
