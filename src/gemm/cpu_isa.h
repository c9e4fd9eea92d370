// Run-time choice of the CPU GEMM kernels' instruction set. Every GEMM kernel exists in a plain
// C++ version (any CPU) and, on x86-64, in AVX2+FMA+F16C and AVX-512 (F, BW, VL, DQ, VNNI)
// versions compiled with per-function target attributes (gemm/cpu_kernels_*.cpp); the best one
// the CPU (and OS) supports is used, as checked by __builtin_cpu_supports. The environment
// variable QFORMATS_GEMM_ISA = scalar | avx2 | avx512 lowers the choice (tests run every path on
// one machine; asking for more than the CPU has gives what it has).
#pragma once

namespace qf::gemm {

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

// The best instruction set this CPU supports and this build has kernels for (cached).
Isa detected_isa();
// detected_isa(), lowered by QFORMATS_GEMM_ISA when set (read at every call: cheap).
Isa active_isa();
const char* isa_name(Isa isa);

}  // namespace qf::gemm
