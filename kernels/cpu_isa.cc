#include "kernels/cpu_isa.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <atomic>

#include "common/base/check.h"

namespace kvcm::kernels {
namespace {

#if defined(__x86_64__)
// CPUID leaf 1, ECX bit 29. Clang 14's __builtin_cpu_supports does not know "f16c".
bool HasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

CpuIsa DetectCpuIsa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !HasF16c()) {
    return CpuIsa::kPortable;
  }
  // GCC's and Clang's runtimes report AVX-512 only when the OS also saves the ZMM state.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
    return CpuIsa::kAvx512;
  }
  return CpuIsa::kAvx2;
#endif
  return CpuIsa::kPortable;
}

std::atomic<CpuIsa>& ActiveIsa() {
  static std::atomic<CpuIsa> isa{BestCpuIsa()};
  return isa;
}

}  // namespace

std::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kPortable:
      return "portable";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
  }
  return "?";
}

bool ParseCpuIsa(std::string_view name, CpuIsa* isa) {
  for (CpuIsa candidate : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (name == CpuIsaName(candidate)) {
      *isa = candidate;
      return true;
    }
  }
  return false;
}

CpuIsa BestCpuIsa() {
  static const CpuIsa best = DetectCpuIsa();
  return best;
}

bool CpuHasAvx512Vnni() {
#if defined(__x86_64__)
  // CPUID leaf 7, sub-leaf 0, ECX bit 11; the ZMM state is the OS's, checked for kAvx512.
  static const bool vnni = [] {
    if (BestCpuIsa() != CpuIsa::kAvx512) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 11)) != 0;
  }();
  return vnni;
#else
  return false;
#endif
}

CpuIsa ActiveCpuIsa() { return ActiveIsa().load(std::memory_order_relaxed); }

void SetCpuIsaForTest(CpuIsa isa) {
  KVCM_CHECK(static_cast<int>(isa) <= static_cast<int>(BestCpuIsa()))
      << "this CPU does not support " << CpuIsaName(isa);
  ActiveIsa().store(isa, std::memory_order_relaxed);
}

}  // namespace kvcm::kernels
