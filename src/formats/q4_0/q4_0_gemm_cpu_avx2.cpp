// q4_0's AVX2 + FMA + F16C leaf kernels (q4_0_gemm_cpu.h: Q4_0CpuKernels). Every function carries
// the target attribute QF_AVX2 (gemm/cpu_simd_avx2.h; no global -m flags); q4_0_cpu_kernels() hands
// this table out only when gemm/cpu_isa.h reports the instruction set.
#include "formats/q4_0/q4_0_gemm_cpu.h"

#if QF_GEMM_X86
#include "gemm/cpu_simd_avx2.h"

namespace qf::gemm::k_avx2 {
namespace {
using q4_0::block_q4_0;

QF_AVX2 void decode_q4_0(const block_q4_0* blocks, int64_t n_blocks, float* out) {
  const __m256i m4 = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const __m256 d = _mm256_set1_ps(fp16_to_f32(blocks[b].d.bits));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[b].qs));
    const __m256i c0 = _mm256_cvtepu8_epi32(qs), c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(qs, 8));
    const __m256i v[4] = {_mm256_and_si256(c0, m4), _mm256_and_si256(c1, m4), _mm256_srli_epi32(c0, 4),
                          _mm256_srli_epi32(c1, 4)};  // elements 0-7, 8-15, 16-23, 24-31
    for (int q = 0; q < 4; ++q)
      _mm256_storeu_ps(out + 32 * b + 8 * q, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v[q], eight)), d));
  }
}

}  // namespace

const Q4_0CpuKernels& q4_0_kernels() {
  static const Q4_0CpuKernels k{decode_q4_0};
  return k;
}

}  // namespace qf::gemm::k_avx2

#endif  // QF_GEMM_X86
