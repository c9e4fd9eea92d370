#include "gemm/cpu_isa.h"

#include <cstdlib>
#include <cstring>

#include "gemm/cpu_kernels.h"

namespace qf::gemm {

Isa detected_isa() {
  static const Isa isa = [] {
#if QF_GEMM_X86
    __builtin_cpu_init();
    // __builtin_cpu_supports also checks that the OS saves the AVX / AVX-512 register state.
    bool f16c = true;  // every AVX2 CPU has F16C; GCC can also check it
#if defined(__GNUC__) && !defined(__clang__)
    f16c = __builtin_cpu_supports("f16c");
#endif
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni"))
      return Isa::avx512;
    if (avx2) return Isa::avx2;
#endif
    return Isa::scalar;
  }();
  return isa;
}

Isa active_isa() {
  Isa isa = detected_isa();
  if (const char* env = std::getenv("QFORMATS_GEMM_ISA")) {
    Isa want = isa;
    if (!std::strcmp(env, "scalar")) want = Isa::scalar;
    else if (!std::strcmp(env, "avx2")) want = Isa::avx2;
    else if (!std::strcmp(env, "avx512")) want = Isa::avx512;
    if (static_cast<int>(want) < static_cast<int>(isa)) isa = want;
  }
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    default:
      return "scalar";
  }
}

#if QF_GEMM_X86
namespace {
// The AVX-512 table with the optional entries it leaves empty taken from the AVX2 table (every
// AVX-512 CPU here also has AVX2, FMA and F16C): a kernel written for AVX2 only serves it too. (The
// formats' own tables do the same in their files: formats/<fmt>/<fmt>_gemm_cpu*.cpp.)
const CpuKernels& avx512_kernels() {
  static const CpuKernels k = [] {
    CpuKernels t = k_avx512::kernels();
    const CpuKernels& a = k_avx2::kernels();
    if (!t.nibble_gemm) t.nibble_gemm = a.nibble_gemm;
    return t;
  }();
  return k;
}
}  // namespace
#endif

const CpuKernels& cpu_kernels(Isa isa) {
#if QF_GEMM_X86
  if (isa == Isa::avx512) return avx512_kernels();
  if (isa == Isa::avx2) return k_avx2::kernels();
#endif
  (void)isa;
  return k_scalar::kernels();
}

const CpuKernels& cpu_kernels() { return cpu_kernels(active_isa()); }

}  // namespace qf::gemm
