// Run-time choice of the CPU GEMM kernels' instruction set. Every GEMM kernel exists in a plain
// C++ version (any CPU) and, on x86-64, in AVX2+FMA+F16C and AVX-512 (F, BW, VL, DQ, VNNI)
// versions compiled with per-function target attributes (gemm/cpu_kernels_*.cpp, and each
// format's own kernels in formats/<fmt>/<fmt>_gemm_cpu_*.cpp); the best one
// the CPU (and OS) supports is used, as checked by __builtin_cpu_supports. The environment
// variable QFORMATS_GEMM_ISA = scalar | avx2 | avx512 lowers the choice (tests run every path on
// one machine; asking for more than the CPU has gives what it has).
#pragma once

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define QF_GEMM_X86 1
#else
#define QF_GEMM_X86 0
#endif

namespace qf::gemm {

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

// The best instruction set this CPU supports and this build has kernels for (cached).
Isa detected_isa();
// detected_isa(), lowered by QFORMATS_GEMM_ISA when set (read at every call: cheap).
Isa active_isa();
const char* isa_name(Isa isa);

}  // namespace qf::gemm
