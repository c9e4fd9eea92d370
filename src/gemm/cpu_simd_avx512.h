// The AVX-512 (F, BW, VL, DQ, VNNI) target attribute and the inline helpers shared by the avx512 leaf kernels:
// gemm/cpu_kernels_avx512.cpp and the formats' formats/<fmt>/<fmt>_gemm_cpu_avx512.cpp. Only functions
// carrying QF_AVX512 may call them (no global -m flags: the rest of the library stays runnable on
// any x86-64).
#pragma once
#include "gemm/cpu_isa.h"

#if QF_GEMM_X86
#include <immintrin.h>

#include <cstdint>

#define QF_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define QF_AVX512_INLINE QF_AVX512 __attribute__((always_inline)) inline

namespace qf::gemm::k_avx512 {

QF_AVX512_INLINE __mmask16 tail_mask16(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
QF_AVX512_INLINE __mmask64 tail_mask64(int64_t n) {
  return n >= 64 ? ~__mmask64(0) : static_cast<__mmask64>((uint64_t(1) << n) - 1u);
}

QF_AVX512_INLINE float fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

// ---- helpers of the 4-bit decoders (nf4, int4) -------------------------------------------------

// 16 packed bytes -> 32 codes in element order, as two vectors of 16 int32. hi_first: element 2t
// is the high nibble of byte t (nf4), else the low nibble (int4).
template <bool hi_first>
QF_AVX512_INLINE void nibbles32(const uint8_t* p, __m512i* c0, __m512i* c1) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i lo = _mm256_and_si256(w, _mm256_set1_epi16(0x0F));
  const __m256i hi = _mm256_srli_epi16(w, 4);
  // 16-bit lane t = first | second << 8: the bytes of elements 2t, 2t + 1 in order.
  const __m256i t =
      hi_first ? _mm256_or_si256(hi, _mm256_slli_epi16(lo, 8)) : _mm256_or_si256(lo, _mm256_slli_epi16(hi, 8));
  *c0 = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(t));
  *c1 = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(t, 1));
}

}  // namespace qf::gemm::k_avx512

#endif  // QF_GEMM_X86
