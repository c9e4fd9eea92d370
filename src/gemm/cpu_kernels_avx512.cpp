// AVX-512 (F, BW, VL, DQ, VNNI) format-independent leaf kernels (gemm/cpu_kernels.h). Every function here carries
// the target attribute QF_AVX512 (no global -m flags: the rest of the library stays runnable on
// any x86-64); cpu_isa.cpp only hands this table out when __builtin_cpu_supports says the CPU
// has all of these.
//
// Float kernels: register-blocked FMA over 16-float vectors, one horizontal sum per output at
// the end. Integer kernels: VPDPBUSD (u8 x s8 -> s32, 4 products per lane) with the unsigned
// operand made by an exact offset (int8 b + 128, int4 q + 8, q4_0's stored q) and the offset
// times sum(a) subtracted after, in wrapping 32-bit arithmetic: the true sums fit int32.
#include "gemm/cpu_kernels.h"

#if QF_GEMM_X86
#include <immintrin.h>

#include <algorithm>

#include "formats/nf4/nf4.h"
#include "gemm/cpu_simd_avx512.h"

// Software prefetch distance along a q4_0 weight row, in blocks (576 bytes): the hardware
// prefetchers follow the interleaved 18-byte-block row streams of a panel too late
// (benchmarks/README.md has the measurement).
#define QF_PF_BLOCKS 32

namespace qf::gemm::k_avx512 {
namespace {

using q4_0::block_q4_0;

// ---- float32 panel -------------------------------------------------------------------------

template <int MR, int NR>
QF_AVX512 void f32_micro(const float* X, int64_t ldx, const float* W, int64_t ldw, int64_t kc, float* acc,
                         bool accumulate) {
  __m512 c[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) c[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= kc; k += 16) {
    __m512 x[NR];
    for (int j = 0; j < NR; ++j) x[j] = _mm512_loadu_ps(X + j * ldx + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 w = _mm512_loadu_ps(W + i * ldw + k);
      for (int j = 0; j < NR; ++j) c[i][j] = _mm512_fmadd_ps(w, x[j], c[i][j]);
    }
  }
  if (k < kc) {
    const __mmask16 m = tail_mask16(kc - k);
    __m512 x[NR];
    for (int j = 0; j < NR; ++j) x[j] = _mm512_maskz_loadu_ps(m, X + j * ldx + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 w = _mm512_maskz_loadu_ps(m, W + i * ldw + k);
      for (int j = 0; j < NR; ++j) c[i][j] = _mm512_fmadd_ps(w, x[j], c[i][j]);
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int i = 0; i < MR; ++i) {
      const float s = _mm512_reduce_add_ps(c[i][j]);
      float& a = acc[j * kPanelRows + i];
      a = accumulate ? a + s : s;
    }
}

template <int NR>
QF_AVX512 void f32_rows(const float* X, int64_t ldx, const float* W, int64_t ldw, int64_t mr, int64_t kc, float* acc,
                        bool accumulate) {
  switch (mr) {
// One case per macro call, as written:
// clang-format off
#define QF_CASE(R) case R: if constexpr (R * NR <= 24) f32_micro<R, NR>(X, ldx, W, ldw, kc, acc, accumulate); break;
    QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4) QF_CASE(5) QF_CASE(6) QF_CASE(7) QF_CASE(8)
#undef QF_CASE
        // clang-format on
        default : break;
  }
}

QF_AVX512 void f32_panel(const float* X, int64_t ldx, int64_t N, const float* W, int64_t ldw, int64_t MT, int64_t kc,
                         float* acc, bool accumulate) {
  int64_t n = 0;
  for (; n + 4 <= N; n += 4)  // 4 x 4 register blocks: 8 loads per 16 FMAs
    for (int64_t i = 0; i < MT; i += 4)
      f32_rows<4>(X + n * ldx, ldx, W + i * ldw, ldw, std::min<int64_t>(4, MT - i), kc, acc + n * kPanelRows + i,
                  accumulate);
  const int64_t rest = N - n;  // 1..3 activation rows: all 8 weight rows at once when NR <= 2
  if (rest == 3) {
    for (int64_t i = 0; i < MT; i += 4)
      f32_rows<3>(X + n * ldx, ldx, W + i * ldw, ldw, std::min<int64_t>(4, MT - i), kc, acc + n * kPanelRows + i,
                  accumulate);
  } else if (rest == 2) {
    f32_rows<2>(X + n * ldx, ldx, W, ldw, MT, kc, acc + n * kPanelRows, accumulate);
  } else if (rest == 1) {
    f32_rows<1>(X + n * ldx, ldx, W, ldw, MT, kc, acc + n * kPanelRows, accumulate);
  }
}

// ---- fused small-N weight-only GEMM of the 4-bit nibble formats ---------------------------------

// Per 32 values of a row: one 16-byte load widened to 16 int32 lanes, the two nibbles split by a
// shift and a mask (for nf4 / int4 the even elements, then the odd ones: x comes reordered the
// same way), the codes looked up in a 16-float table in one register (VPERMPS), scaled as the
// format's dequantize does, and multiplied with every activation row while still in registers.
template <Nibble F, int MR, int NR>
QF_AVX512 void nib_micro(const NibbleWeights& w, int64_t m0, const float* X, float* Y, int64_t ldy) {
  const int64_t K = w.K;
  __m512 lut;
  if constexpr (F == Nibble::nf4) lut = _mm512_loadu_ps(nf4::kCode);
  else if constexpr (F == Nibble::int4_asym) lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  else if constexpr (F == Nibble::int4_sym)
    lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  else lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i m4 = _mm512_set1_epi32(0x0F);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t gpr = F == Nibble::int4_asym || F == Nibble::int4_sym ? K / w.group : 0;  // groups per row
  int64_t kg = 0, kr = 0;  // int4: group of k within the row, and k's offset in it
  for (int64_t k = 0; k < K; k += 32) {
    __m512 v0[MR], v1[MR];
    for (int i = 0; i < MR; ++i) {
      const int64_t m = m0 + i;
      const uint8_t* p;
      __m512 s;
      if constexpr (F == Nibble::nf4) {
        const int64_t base = m * K + k;
        p = w.codes + (base >> 1);
        // The same bytes MR rows further on, which the next call reads (as the AVX2 kernels do:
        // the interleaved rows of a panel are streams the hardware prefetchers pick up late).
        _mm_prefetch(reinterpret_cast<const char*>(p) + MR * K / 2, _MM_HINT_T0);
        s = _mm512_set1_ps(w.scales[base >> w.group]);
      } else if constexpr (F == Nibble::q4_0) {
        const auto* blk = reinterpret_cast<const block_q4_0*>(w.codes) + m * (K / 32) + k / 32;
        _mm_prefetch(reinterpret_cast<const char*>(blk + QF_PF_BLOCKS), _MM_HINT_T0);
        p = blk->qs;
        s = _mm512_set1_ps(fp16_to_f32(blk->d.bits));
      } else {
        p = w.codes + ((m * K + k) >> 1);
        _mm_prefetch(reinterpret_cast<const char*>(p) + MR * K / 2, _MM_HINT_T0);  // as for nf4
        s = _mm512_set1_ps(w.scales[m * gpr + kg]);
      }
      const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m512i hi = _mm512_srli_epi32(c, 4), lo = _mm512_and_si512(c, m4);
      __m512 a = _mm512_permutexvar_ps(F == Nibble::nf4 ? hi : lo, lut);
      __m512 b = _mm512_permutexvar_ps(F == Nibble::nf4 ? lo : hi, lut);
      if constexpr (F == Nibble::int4_asym) {
        const __m512 z = _mm512_set1_ps(static_cast<float>(w.zeros[m * gpr + kg]));
        a = _mm512_sub_ps(a, z);
        b = _mm512_sub_ps(b, z);
      }
      v0[i] = _mm512_mul_ps(a, s);  // the dequantized values (same roundings as dequantize)
      v1[i] = _mm512_mul_ps(b, s);
    }
    for (int j = 0; j < NR; ++j) {
      const __m512 x0 = _mm512_loadu_ps(X + j * K + k), x1 = _mm512_loadu_ps(X + j * K + k + 16);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(v1[i], x1, _mm512_fmadd_ps(v0[i], x0, acc[i][j]));
    }
    if constexpr (F == Nibble::int4_asym || F == Nibble::int4_sym) {
      if ((kr += 32) == w.group) {
        kr = 0;
        ++kg;
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) Y[j * ldy + i] = _mm512_reduce_add_ps(acc[i][j]);
}

template <Nibble F, int NR>
QF_AVX512 void nib_rows(const NibbleWeights& w, int64_t m0, int64_t MR, const float* X, float* Y, int64_t ldy) {
  constexpr int64_t R = NR == 1 ? 8 : 4;
  for (int64_t i = 0; i < MR; i += R) {
    switch (std::min<int64_t>(R, MR - i)) {
// One case per macro call, as written:
// clang-format off
#define QF_CASE(Q) case Q: if constexpr (Q <= R) nib_micro<F, Q, NR>(w, m0 + i, X, Y + i, ldy); break;
      QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4) QF_CASE(5) QF_CASE(6) QF_CASE(7) QF_CASE(8)
#undef QF_CASE
          // clang-format on
          default : break;
    }
  }
}

template <Nibble F>
QF_AVX512 void nib_format(const NibbleWeights& w, int64_t m0, int64_t MR, const float* X, int64_t N, float* Y,
                          int64_t ldy) {
  switch (N) {
    case 1:
      nib_rows<F, 1>(w, m0, MR, X, Y, ldy);
      break;
    case 2:
      nib_rows<F, 2>(w, m0, MR, X, Y, ldy);
      break;
    case 3:
      nib_rows<F, 3>(w, m0, MR, X, Y, ldy);
      break;
    case 4:
      nib_rows<F, 4>(w, m0, MR, X, Y, ldy);
      break;
    default:
      break;
  }
}

QF_AVX512 void nibble_gemm(const NibbleWeights& w, int64_t m0, int64_t MR, const float* X, int64_t N, float* Y,
                           int64_t ldy) {
  switch (w.fmt) {
    case Nibble::nf4:
      nib_format<Nibble::nf4>(w, m0, MR, X, N, Y, ldy);
      break;
    case Nibble::int4_asym:
      nib_format<Nibble::int4_asym>(w, m0, MR, X, N, Y, ldy);
      break;
    case Nibble::int4_sym:
      nib_format<Nibble::int4_sym>(w, m0, MR, X, N, Y, ldy);
      break;
    case Nibble::q4_0:
      nib_format<Nibble::q4_0>(w, m0, MR, X, N, Y, ldy);
      break;
  }
}

// ---- q4_0 x q8_1 ---------------------------------------------------------------------------------

// Two blocks of MR weight rows x NR activations per step: the 2 x 16 code bytes of a row become
// one 64-byte vector [lo(b), hi(b), lo(b+1), hi(b+1)] (elements 0..31 of each block, in order),
// VPDPBUSD multiplies it with the 64 activation codes (8 int32 lanes per block), starting from
// -8 * (the lane's activation sum) so that the lane holds sum (q_w - 8) q_a exactly. Then the
// lanes are scaled by d_w * d_a of their block and summed into float32 accumulators.
template <int MR, int NR>
QF_AVX512 void q4q8_micro(const block_q4_0* W, int64_t nb, const int8_t* aq, const float* ad, float* out, int64_t ldo_m,
                          int64_t ldo_n) {
  const int64_t K = nb * 32;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i dup = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);     // 128-bit lanes [q0, q0, q1, q1]
  const __m512i shifts = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);  // low nibbles, high nibbles
  const __m512i m4 = _mm512_set1_epi8(0x0F), eights = _mm512_set1_epi8(8), zero = _mm512_setzero_si512();
  const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    __m512i wq[MR];
    __m512 wd[MR];
    for (int i = 0; i < MR; ++i) {
      const block_q4_0* w = W + i * nb + b;
      _mm_prefetch(reinterpret_cast<const char*>(w + QF_PF_BLOCKS), _MM_HINT_T0);
      const __m256i q =
          _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[0].qs))),
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[1].qs)), 1);
      const __m512i t = _mm512_permutexvar_epi64(dup, _mm512_castsi256_si512(q));
      wq[i] = _mm512_and_si512(_mm512_srlv_epi64(t, shifts), m4);
      const __m128i h = _mm_cvtsi32_si128(static_cast<int>(w[0].d.bits | (uint32_t(w[1].d.bits) << 16)));
      wd[i] = _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(_mm_cvtph_ps(h)));
    }
    for (int j = 0; j < NR; ++j) {
      const __m512i a = _mm512_loadu_si512(aq + j * K + b * 32);
      const __m512i bias = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, eights, a));  // -8 * sum a
      const __m512 da = _mm512_permutexvar_ps(
          pair,
          _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ad + j * nb + b)))));
      for (int i = 0; i < MR; ++i) {
        const __m512i dot = _mm512_dpbusd_epi32(bias, wq[i], a);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(wd[i], da), acc[i][j]);
      }
    }
  }
  if (b < nb) {  // an odd last block: the same in 256-bit vectors
    const __m256i m4y = _mm256_set1_epi8(0x0F), eightsy = _mm256_set1_epi8(8), zeroy = _mm256_setzero_si256();
    __m256i wq[MR];
    float wd[MR];
    for (int i = 0; i < MR; ++i) {
      const block_q4_0* w = W + i * nb + b;
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w->qs));
      wq[i] = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1), m4y);
      wd[i] = fp16_to_f32(w->d.bits);
    }
    for (int j = 0; j < NR; ++j) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + j * K + b * 32));
      const __m256i bias = _mm256_sub_epi32(zeroy, _mm256_dpbusd_epi32(zeroy, eightsy, a));
      const float da = ad[j * nb + b];
      for (int i = 0; i < MR; ++i) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(bias, wq[i], a));
        acc[i][j] = _mm512_fmadd_ps(_mm512_zextps256_ps512(f), _mm512_set1_ps(wd[i] * da), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo_m + j * ldo_n] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int NR>
QF_AVX512 void q4q8_rows(const block_q4_0* W, int64_t nb, int64_t mr, const int8_t* aq, const float* ad, float* out,
                         int64_t ldo_m, int64_t ldo_n) {
  switch (mr) {
// One case per macro call, as written:
// clang-format off
#define QF_CASE(R) case R: if constexpr (R * NR <= 16) q4q8_micro<R, NR>(W, nb, aq, ad, out, ldo_m, ldo_n); break;
    QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4) QF_CASE(5) QF_CASE(6) QF_CASE(7) QF_CASE(8)
#undef QF_CASE
        // clang-format on
        default : break;
  }
}

QF_AVX512 void q4q8_panel(const block_q4_0* W, int64_t nb, int64_t MR, const int8_t* aq, const float* ad, int64_t N,
                          float* out, int64_t ldo_m, int64_t ldo_n) {
  const int64_t K = nb * 32;
  int64_t j = 0;
  for (; j + 4 <= N; j += 4)
    for (int64_t i = 0; i < MR; i += 4)
      q4q8_rows<4>(W + i * nb, nb, std::min<int64_t>(4, MR - i), aq + j * K, ad + j * nb, out + i * ldo_m + j * ldo_n,
                   ldo_m, ldo_n);
  const int64_t rest = N - j;
  if (rest == 3) {
    for (int64_t i = 0; i < MR; i += 4)
      q4q8_rows<3>(W + i * nb, nb, std::min<int64_t>(4, MR - i), aq + j * K, ad + j * nb, out + i * ldo_m + j * ldo_n,
                   ldo_m, ldo_n);
  } else if (rest == 2) {
    q4q8_rows<2>(W, nb, MR, aq + j * K, ad + j * nb, out + j * ldo_n, ldo_m, ldo_n);
  } else if (rest == 1) {
    q4q8_rows<1>(W, nb, MR, aq + j * K, ad + j * nb, out + j * ldo_n, ldo_m, ldo_n);
  }
}

// ---- int8 x int8 ---------------------------------------------------------------------------------

// sum b * a = sum (b + 128) * a - 128 * sum a, with b + 128 = b ^ 0x80 as u8. The lanes wrap
// mod 2^32 (VPDPBUSD does not saturate), which is exact for a result inside int32.
template <int MR, int NR>
QF_AVX512 void i8_micro(const int8_t* B, const int8_t* A, int64_t K, int32_t* out, int64_t ldo) {
  __m512i acc[MR][NR], asum[NR];
  for (int j = 0; j < NR; ++j) {
    asum[j] = _mm512_setzero_si512();
    for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_setzero_si512();
  }
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), ones = _mm512_set1_epi8(1);
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 m = tail_mask64(K - k);  // beyond K: a = 0 and b = 0, which add nothing
    __m512i a[NR];
    for (int j = 0; j < NR; ++j) {
      a[j] = _mm512_maskz_loadu_epi8(m, A + j * K + k);
      asum[j] = _mm512_dpbusd_epi32(asum[j], ones, a[j]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512i bu = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, B + i * K + k), flip);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], bu, a[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const uint32_t sa = static_cast<uint32_t>(_mm512_reduce_add_epi32(asum[j]));
    for (int i = 0; i < MR; ++i)
      out[j * ldo + i] = static_cast<int32_t>(static_cast<uint32_t>(_mm512_reduce_add_epi32(acc[i][j])) - 128u * sa);
  }
}

// int4: the packed row's 64 bytes per 128 values give the low nibbles (even elements) and the
// high nibbles (odd elements); (nibble ^ 8) = q + 8 in 0..15 is the unsigned operand, and the
// split activations line up with them (int4_split_rows). Subtract 8 * sum a.
template <int MR, int NR>
QF_AVX512 void i4_micro(const uint8_t* B, const int8_t* A, int64_t K, int32_t* out, int64_t ldo) {
  const int64_t kb = K / 2, Kp = (K + 127) / 128 * 128;
  __m512i acc[MR][NR], asum[NR];
  for (int j = 0; j < NR; ++j) {
    asum[j] = _mm512_setzero_si512();
    for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_setzero_si512();
  }
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x88)), m4 = _mm512_set1_epi8(0x0F);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t c = 0; c < Kp / 128; ++c) {
    const __mmask64 m = tail_mask64(kb - 64 * c);  // missing bytes read as 0 -> q + 8 = 8, times a = 0
    __m512i alo[NR], ahi[NR];
    for (int j = 0; j < NR; ++j) {
      alo[j] = _mm512_loadu_si512(A + j * Kp + 128 * c);
      ahi[j] = _mm512_loadu_si512(A + j * Kp + 128 * c + 64);
      asum[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(asum[j], ones, alo[j]), ones, ahi[j]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512i v = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, B + i * kb + 64 * c), flip);
      const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      for (int j = 0; j < NR; ++j)
        acc[i][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[i][j], lo, alo[j]), hi, ahi[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const uint32_t sa = static_cast<uint32_t>(_mm512_reduce_add_epi32(asum[j]));
    for (int i = 0; i < MR; ++i)
      out[j * ldo + i] = static_cast<int32_t>(static_cast<uint32_t>(_mm512_reduce_add_epi32(acc[i][j])) - 8u * sa);
  }
}

template <bool Int4, int NR>
QF_AVX512 void int_rows(const void* B, int64_t mr, const int8_t* A, int64_t K, int32_t* out, int64_t ldo) {
  const int64_t ldb = Int4 ? K / 2 : K;
  const uint8_t* b = static_cast<const uint8_t*>(B);
  for (int64_t i = 0; i < mr; i += 8 / (NR > 2 ? 2 : 1)) {
    const int64_t r = std::min<int64_t>(NR > 2 ? 4 : 8, mr - i);
    const uint8_t* bi = b + i * ldb;
    switch (r) {
// One case per macro call, as written:
// clang-format off
#define QF_CASE(R)                                                                                              \
  case R:                                                                                                       \
    if constexpr (R * NR <= 16) {                                                                               \
      if constexpr (Int4) i4_micro<R, NR>(bi, A, K, out + i, ldo);                                              \
      else i8_micro<R, NR>(reinterpret_cast<const int8_t*>(bi), A, K, out + i, ldo);                            \
    }                                                                                                           \
    break;
      QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4) QF_CASE(5) QF_CASE(6) QF_CASE(7) QF_CASE(8)
#undef QF_CASE
          // clang-format on
          default : break;
    }
  }
}

template <bool Int4>
QF_AVX512 void int_panel(const void* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out, int64_t ldo) {
  const int64_t lda = Int4 ? (K + 127) / 128 * 128 : K;
  int64_t j = 0;
  for (; j + 4 <= N; j += 4) int_rows<Int4, 4>(B, MR, A + j * lda, K, out + j * ldo, ldo);
  switch (N - j) {
    case 3:
      int_rows<Int4, 3>(B, MR, A + j * lda, K, out + j * ldo, ldo);
      break;
    case 2:
      int_rows<Int4, 2>(B, MR, A + j * lda, K, out + j * ldo, ldo);
      break;
    case 1:
      int_rows<Int4, 1>(B, MR, A + j * lda, K, out + j * ldo, ldo);
      break;
    default:
      break;
  }
}

QF_AVX512 void i8_panel(const int8_t* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out, int64_t ldo) {
  int_panel<false>(B, MR, A, N, K, out, ldo);
}

QF_AVX512 void i4_panel(const uint8_t* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out,
                        int64_t ldo) {
  int_panel<true>(B, MR, A, N, K, out, ldo);
}

}  // namespace

const CpuKernels& kernels() {
  static const CpuKernels k{Isa::avx512, f32_panel, nibble_gemm, q4q8_panel, i8_panel, i4_panel};
  return k;
}

}  // namespace qf::gemm::k_avx512

#endif  // QF_GEMM_X86
