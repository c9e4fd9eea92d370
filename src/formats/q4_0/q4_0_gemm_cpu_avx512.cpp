// q4_0's AVX-512 (F, BW, VL, DQ, VNNI) leaf kernels (q4_0_gemm_cpu.h: Q4_0CpuKernels). Every
// function carries the target attribute QF_AVX512 (gemm/cpu_simd_avx512.h; no global -m flags);
// q4_0_cpu_kernels() hands this table out only when gemm/cpu_isa.h reports the instruction set.
#include "formats/q4_0/q4_0_gemm_cpu.h"

#if QF_GEMM_X86
#include "gemm/cpu_simd_avx512.h"

namespace qf::gemm::k_avx512 {
namespace {
using q4_0::block_q4_0;

QF_AVX512 void decode_q4_0(const block_q4_0* blocks, int64_t n_blocks, float* out) {
  const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);  // q - 8
  for (int64_t b = 0; b < n_blocks; ++b) {
    const __m512 d = _mm512_set1_ps(fp16_to_f32(blocks[b].d.bits));
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[b].qs)));
    const __m512i lo = _mm512_and_si512(c, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(c, 4);
    _mm512_storeu_ps(out + 32 * b, _mm512_mul_ps(_mm512_permutexvar_ps(lo, lut), d));
    _mm512_storeu_ps(out + 32 * b + 16, _mm512_mul_ps(_mm512_permutexvar_ps(hi, lut), d));
  }
}

}  // namespace

const Q4_0CpuKernels& q4_0_kernels() {
  static const Q4_0CpuKernels k{decode_q4_0};
  return k;
}

}  // namespace qf::gemm::k_avx512

#endif  // QF_GEMM_X86
