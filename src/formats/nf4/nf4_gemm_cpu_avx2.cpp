// nf4's AVX2 + FMA + F16C leaf kernels (nf4_gemm_cpu.h: Nf4CpuKernels). Every function carries the
// target attribute QF_AVX2 (gemm/cpu_simd_avx2.h; no global -m flags); nf4_cpu_kernels() hands this
// table out only when gemm/cpu_isa.h reports the instruction set.
#include "formats/nf4/nf4_gemm_cpu.h"

#if QF_GEMM_X86
#include "formats/nf4/nf4.h"
#include "gemm/cpu_simd_avx2.h"

namespace qf::gemm::k_avx2 {
namespace {

QF_AVX2 void decode_nf4(const uint8_t* packed, const float* absmax, int log2_bs, int64_t i0, int64_t len, float* out) {
  if ((i0 | len) & 31) return k_scalar::nf4_kernels().decode(packed, absmax, log2_bs, i0, len, out);
  const __m256 lut_lo = _mm256_loadu_ps(nf4::kCode), lut_hi = _mm256_loadu_ps(nf4::kCode + 8);
  for (int64_t t = 0; t < len; t += 32) {
    const int64_t i = i0 + t;
    const __m256 am = _mm256_set1_ps(absmax[i >> log2_bs]);
    __m256i c[4];
    widen32(nibbles32<true>(packed + (i >> 1)), c);
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(out + t + 8 * q, _mm256_mul_ps(lookup16(c[q], lut_lo, lut_hi), am));
  }
}

}  // namespace

const Nf4CpuKernels& nf4_kernels() {
  static const Nf4CpuKernels k{decode_nf4};
  return k;
}

}  // namespace qf::gemm::k_avx2

#endif  // QF_GEMM_X86
