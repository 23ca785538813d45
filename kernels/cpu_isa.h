#pragma once
// Which vector instructions the CPU kernels use, chosen once at run time.
//
// The build targets baseline x86-64 (no -march flag), so the hot loops exist twice: portable
// code (GCC vector extensions: SSE2 on x86-64, NEON elsewhere) and, on x86-64, the same code
// compiled through target pragmas for AVX2 + FMA + F16C and for AVX-512 (16-float vectors in
// the hottest loops). The best one the CPU supports is used unless a test forces another.
//
// Thread safety: all functions may be called from any thread.

#include <cstdint>
#include <string_view>

namespace kvcm::kernels {

enum class CpuIsa : uint8_t {
  kPortable,  // always available
  kAvx2,      // x86-64 with AVX2, FMA and F16C
  kAvx512,    // kAvx2 plus AVX-512 F, VL, BW and DQ
};

std::string_view CpuIsaName(CpuIsa isa);

// The ISA named `name` ("portable", "avx2", "avx512"); false if there is none.
bool ParseCpuIsa(std::string_view name, CpuIsa* isa);

// The best ISA this CPU and this build support.
CpuIsa BestCpuIsa();

// The ISA the kernels use now: BestCpuIsa() unless SetCpuIsaForTest chose another.
CpuIsa ActiveCpuIsa();

// Whether kAvx512 also has AVX512_VNNI (vpdpbusd), for MatMulInt8 (kernels/matmul_cpu.h):
// under ActiveCpuIsa() == kAvx512 it runs its VNNI loops when this holds, else its AVX2
// ones. Forcing kAvx2 or kPortable with SetCpuIsaForTest selects those loops.
bool CpuHasAvx512Vnni();

// Makes the kernels use `isa`. REQUIRES: isa <= BestCpuIsa().
void SetCpuIsaForTest(CpuIsa isa);

}  // namespace kvcm::kernels
