// int4's AVX-512 (F, BW, VL, DQ, VNNI) leaf kernels (int4_gemm_cpu.h: Int4CpuKernels). Every
// function carries the target attribute QF_AVX512 (gemm/cpu_simd_avx512.h; no global -m flags);
// int4_cpu_kernels() hands this table out only when gemm/cpu_isa.h reports the instruction set.
#include "formats/int4/int4_gemm_cpu.h"

#if QF_GEMM_X86
#include "gemm/cpu_simd_avx512.h"

namespace qf::gemm::k_avx512 {
namespace {

QF_AVX512 void decode_int4(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t gs, int64_t i0,
                           int64_t len, float* out) {
  if (((i0 | len | gs) & 31)) return k_scalar::int4_kernels().decode(qweight, scales, zeros, gs, i0, len, out);
  // Codes as floats: 0..15 (asymmetric, then - zero), or the signed nibbles 0..7, -8..-1.
  const __m512 lut = zeros ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                           : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  int64_t g = i0 / gs, r = i0 % gs;
  for (int64_t t = 0; t < len; t += 32) {
    const __m512 s = _mm512_set1_ps(scales[g]);
    __m512i c0, c1;
    nibbles32<false>(qweight + ((i0 + t) >> 1), &c0, &c1);
    __m512 v0 = _mm512_permutexvar_ps(c0, lut), v1 = _mm512_permutexvar_ps(c1, lut);
    if (zeros) {  // (q - zero) * scale: q - zero is exact in float32, as int4's decode_asym
      const __m512 z = _mm512_set1_ps(static_cast<float>(zeros[g]));
      v0 = _mm512_sub_ps(v0, z);
      v1 = _mm512_sub_ps(v1, z);
    }
    _mm512_storeu_ps(out + t, _mm512_mul_ps(v0, s));
    _mm512_storeu_ps(out + t + 16, _mm512_mul_ps(v1, s));
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

}  // namespace qf::gemm::k_avx512

#endif  // QF_GEMM_X86
