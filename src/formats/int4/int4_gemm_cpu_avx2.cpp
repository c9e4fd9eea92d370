// int4's AVX2 + FMA + F16C leaf kernels (int4_gemm_cpu.h: Int4CpuKernels). Every function carries
// the target attribute QF_AVX2 (gemm/cpu_simd_avx2.h; no global -m flags); int4_cpu_kernels() hands
// this table out only when gemm/cpu_isa.h reports the instruction set.
#include "formats/int4/int4_gemm_cpu.h"

#if QF_GEMM_X86
#include "gemm/cpu_simd_avx2.h"

namespace qf::gemm::k_avx2 {
namespace {

QF_AVX2 void decode_int4(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t gs, int64_t i0,
                         int64_t len, float* out) {
  if (((i0 | len | gs) & 31)) return k_scalar::int4_kernels().decode(qweight, scales, zeros, gs, i0, len, out);
  int64_t g = i0 / gs, r = i0 % gs;
  const __m256i eight = _mm256_set1_epi32(8);
  for (int64_t t = 0; t < len; t += 32) {
    const __m256 s = _mm256_set1_ps(scales[g]);
    const __m256i z = zeros ? _mm256_set1_epi32(zeros[g]) : eight;
    __m256i c[4];
    widen32(nibbles32<false>(qweight + ((i0 + t) >> 1)), c);
    for (int q = 0; q < 4; ++q) {
      // asymmetric: q - zero; symmetric: (nibble ^ 8) - 8. Exact small integers.
      const __m256i v = zeros ? c[q] : _mm256_xor_si256(c[q], eight);
      _mm256_storeu_ps(out + t + 8 * q, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, z)), s));
    }
    if ((r += 32) == gs) {
      r = 0;
      ++g;
    }
  }
}

}  // namespace

const Int4CpuKernels& int4_kernels() {
  static const Int4CpuKernels k{decode_int4};
  return k;
}

}  // namespace qf::gemm::k_avx2

#endif  // QF_GEMM_X86
