// The AVX2 + FMA + F16C target attribute and the inline helpers shared by the avx2 leaf kernels:
// gemm/cpu_kernels_avx2.cpp and the formats' formats/<fmt>/<fmt>_gemm_cpu_avx2.cpp. Only functions
// carrying QF_AVX2 may call them (no global -m flags: the rest of the library stays runnable on
// any x86-64).
#pragma once
#include "gemm/cpu_isa.h"

#if QF_GEMM_X86
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#define QF_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QF_AVX2_INLINE QF_AVX2 __attribute__((always_inline)) inline

namespace qf::gemm::k_avx2 {

QF_AVX2_INLINE float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Lane sum in wrapping 32-bit arithmetic (exact for results inside int32).
QF_AVX2_INLINE uint32_t hsum_u32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1))));
}

// Lanes < n all ones (n in 0..8): a mask for _mm256_maskload_ps.
QF_AVX2_INLINE __m256i tail_mask8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

QF_AVX2_INLINE float fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

// f(std::integral_constant<int, N>{}) for N = 1..4, nothing otherwise: the fused few-row kernels'
// activation row count as a template argument.
template <class F>
inline void with_rows4(int64_t N, F&& f) {
  switch (N) {
    case 1:
      f(std::integral_constant<int, 1>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    case 3:
      f(std::integral_constant<int, 3>{});
      break;
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    default:
      break;
  }
}

// ---- helpers of the 4-bit decoders (nf4, int4) -------------------------------------------------

// 16 packed bytes -> the 32 codes in element order as 32 bytes (see the AVX-512 version).
template <bool hi_first>
QF_AVX2_INLINE __m256i nibbles32(const uint8_t* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i lo = _mm256_and_si256(w, _mm256_set1_epi16(0x0F));
  const __m256i hi = _mm256_srli_epi16(w, 4);
  return hi_first ? _mm256_or_si256(hi, _mm256_slli_epi16(lo, 8)) : _mm256_or_si256(lo, _mm256_slli_epi16(hi, 8));
}

// The 4 groups of 8 codes of a 32-byte code vector, as int32 lanes.
QF_AVX2_INLINE void widen32(__m256i t, __m256i c[4]) {
  const __m128i lo = _mm256_castsi256_si128(t), hi = _mm256_extracti128_si256(t, 1);
  c[0] = _mm256_cvtepu8_epi32(lo);
  c[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
  c[2] = _mm256_cvtepu8_epi32(hi);
  c[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}

// 16-entry float table lookup: two 8-entry permutes, chosen by bit 3 of the code.
QF_AVX2_INLINE __m256 lookup16(__m256i c, __m256 lut_lo, __m256 lut_hi) {
  const __m256 a = _mm256_permutevar8x32_ps(lut_lo, c), b = _mm256_permutevar8x32_ps(lut_hi, c);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
}

}  // namespace qf::gemm::k_avx2

#endif  // QF_GEMM_X86
