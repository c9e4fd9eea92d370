// nf4's AVX-512 (F, BW, VL, DQ, VNNI) leaf kernels (nf4_gemm_cpu.h: Nf4CpuKernels). Every function
// carries the target attribute QF_AVX512 (gemm/cpu_simd_avx512.h; no global -m flags);
// nf4_cpu_kernels() hands this table out only when gemm/cpu_isa.h reports the instruction set.
#include "formats/nf4/nf4_gemm_cpu.h"

#if QF_GEMM_X86
#include "formats/nf4/nf4.h"
#include "gemm/cpu_simd_avx512.h"

namespace qf::gemm::k_avx512 {
namespace {

QF_AVX512 void decode_nf4(const uint8_t* packed, const float* absmax, int log2_bs, int64_t i0, int64_t len,
                          float* out) {
  if ((i0 | len) & 31) return k_scalar::nf4_kernels().decode(packed, absmax, log2_bs, i0, len, out);
  const __m512 lut = _mm512_loadu_ps(nf4::kCode);
  for (int64_t t = 0; t < len; t += 32) {
    const int64_t i = i0 + t;  // a 32-aligned run lies inside one block (blocksize >= 32)
    const __m512 am = _mm512_set1_ps(absmax[i >> log2_bs]);
    __m512i c0, c1;
    nibbles32<true>(packed + (i >> 1), &c0, &c1);
    _mm512_storeu_ps(out + t, _mm512_mul_ps(_mm512_permutexvar_ps(c0, lut), am));
    _mm512_storeu_ps(out + t + 16, _mm512_mul_ps(_mm512_permutexvar_ps(c1, lut), am));
  }
}

}  // namespace

const Nf4CpuKernels& nf4_kernels() {
  static const Nf4CpuKernels k{decode_nf4};
  return k;
}

}  // namespace qf::gemm::k_avx512

#endif  // QF_GEMM_X86
