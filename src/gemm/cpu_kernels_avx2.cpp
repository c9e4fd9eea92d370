// AVX2 + FMA + F16C format-independent leaf kernels (gemm/cpu_kernels.h), for x86-64 CPUs without AVX-512. Every
// function carries the target attribute QF_AVX2 (gemm/cpu_simd_avx2.h; no global -m flags); cpu_isa.cpp hands this
// table out only when __builtin_cpu_supports reports AVX2, FMA and F16C.
//
// Integer products: VPMADDUBSW (u8 x s8 -> pairs summed in int16) where the operands keep
// every pair sum far inside int16 (q4_0 and int4: |u * a| <= 15 * 128), VPMADDWD on
// sign-extended int16 for int8 x int8 (no saturation possible), VPMADDWD by ones to widen to
// int32. Exact.
#include "gemm/cpu_kernels.h"

#if QF_GEMM_X86
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "formats/nf4/nf4.h"
#include "gemm/cpu_simd_avx2.h"

namespace qf::gemm::k_avx2 {
namespace {

using q4_0::block_q4_0;

// ---- float32 panel -------------------------------------------------------------------------

template <int MR, int NR>
QF_AVX2 void f32_micro(const float* X, int64_t ldx, const float* W, int64_t ldw, int64_t kc, float* acc,
                       bool accumulate) {
  __m256 c[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) c[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    __m256 x[NR];
    for (int j = 0; j < NR; ++j) x[j] = _mm256_loadu_ps(X + j * ldx + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 w = _mm256_loadu_ps(W + i * ldw + k);
      for (int j = 0; j < NR; ++j) c[i][j] = _mm256_fmadd_ps(w, x[j], c[i][j]);
    }
  }
  if (k < kc) {
    const __m256i m = tail_mask8(kc - k);
    __m256 x[NR];
    for (int j = 0; j < NR; ++j) x[j] = _mm256_maskload_ps(X + j * ldx + k, m);
    for (int i = 0; i < MR; ++i) {
      const __m256 w = _mm256_maskload_ps(W + i * ldw + k, m);
      for (int j = 0; j < NR; ++j) c[i][j] = _mm256_fmadd_ps(w, x[j], c[i][j]);
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int i = 0; i < MR; ++i) {
      const float s = hsum(c[i][j]);
      float& a = acc[j * kPanelRows + i];
      a = accumulate ? a + s : s;
    }
}

template <int NR>
QF_AVX2 void f32_rows(const float* X, int64_t ldx, const float* W, int64_t ldw, int64_t mr, int64_t kc, float* acc,
                      bool accumulate) {
  switch (mr) {
// One case per macro call, as written:
// clang-format off
#define QF_CASE(R) case R: if constexpr (R * NR <= 12) f32_micro<R, NR>(X, ldx, W, ldw, kc, acc, accumulate); break;
    QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4) QF_CASE(5) QF_CASE(6) QF_CASE(7) QF_CASE(8)
#undef QF_CASE
        // clang-format on
        default : break;
  }
}

QF_AVX2 void f32_panel(const float* X, int64_t ldx, int64_t N, const float* W, int64_t ldw, int64_t MT, int64_t kc,
                       float* acc, bool accumulate) {
  int64_t n = 0;
  for (; n + 3 <= N; n += 3)  // 4 x 3 blocks: 12 accumulators of the 16 ymm registers
    for (int64_t i = 0; i < MT; i += 4)
      f32_rows<3>(X + n * ldx, ldx, W + i * ldw, ldw, std::min<int64_t>(4, MT - i), kc, acc + n * kPanelRows + i,
                  accumulate);
  if (N - n == 2) {
    for (int64_t i = 0; i < MT; i += 4)
      f32_rows<2>(X + n * ldx, ldx, W + i * ldw, ldw, std::min<int64_t>(4, MT - i), kc, acc + n * kPanelRows + i,
                  accumulate);
  } else if (N - n == 1) {
    f32_rows<1>(X + n * ldx, ldx, W, ldw, MT, kc, acc + n * kPanelRows, accumulate);
  }
}

// ---- fused small-N weight-only GEMM of the 4-bit nibble formats ---------------------------------

// nf4, per 32 values of a row: two 8-byte loads widened to 8 int32 lanes each (VPMOVZXBD from
// memory); each byte's high nibble (element 2t) and low nibble (2t + 1) give the values of x
// positions 0-7, 16-23 (first 8 bytes) and 8-15, 24-31 (the next 8), in the order
// nibble_split_order gives x. The 16-entry table times the block's absmax (the products
// dequantize makes, so the same values) is made once per run and looked up with two VPERMPS,
// which read only the low 3 index bits (no mask for the low nibble), blended on bit 3. The
// values are multiplied with every activation row while in registers; each output has its own
// accumulator, so its sum order depends on K only (not on MR, N or threads).
QF_AVX2_INLINE __m256 nf4_lookup(__m256i idx, __m256i sel, __m256 lo, __m256 hi) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                          _mm256_castsi256_ps(sel));
}

template <int MR, int NR>
QF_AVX2 void nf4_micro(const NibbleWeights& w, int64_t m0, const float* X, float* Y, int64_t ldy) {
  const int64_t K = w.K;
  const __m256 lut_lo = _mm256_loadu_ps(nf4::kCode), lut_hi = _mm256_loadu_ps(nf4::kCode + 8);
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    for (int i = 0; i < MR; ++i) {
      const int64_t base = (m0 + i) * K + k;  // a 32-aligned run lies inside one block
      const uint8_t* p = w.codes + (base >> 1);
      _mm_prefetch(reinterpret_cast<const char*>(p) + MR * K / 2, _MM_HINT_T0);  // as nib_int_micro
      const __m256 am = _mm256_broadcast_ss(w.scales + (base >> w.group));
      const __m256 lo = _mm256_mul_ps(lut_lo, am), hi = _mm256_mul_ps(lut_hi, am);
      const __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      const __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
      // high nibble: index bits 4-6, select bit 7; low nibble: index bits 0-2, select bit 3
      const __m256 v[4] = {nf4_lookup(_mm256_srli_epi32(c0, 4), _mm256_slli_epi32(c0, 24), lo, hi),
                           nf4_lookup(_mm256_srli_epi32(c1, 4), _mm256_slli_epi32(c1, 24), lo, hi),
                           nf4_lookup(c0, _mm256_slli_epi32(c0, 28), lo, hi),
                           nf4_lookup(c1, _mm256_slli_epi32(c1, 28), lo, hi)};
      for (int j = 0; j < NR; ++j)
        for (int q = 0; q < 4; ++q)
          acc[i][j] = _mm256_fmadd_ps(v[q], _mm256_loadu_ps(X + j * K + k + 8 * q), acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) Y[j * ldy + i] = hsum(acc[i][j]);
}

// The integer-code formats (int4, q4_0), whose value is s * (q - z) with one s and z per group
// (q4_0: per 32-block, z = 8): per group and output, d = sum q x over the group (the codes
// converted to float, one FMA each), then acc += s * (d - z * sum x) with sum x taken once per
// group for all rows. Two vector operations per 8 weights instead of four; the float32 rounding
// differs from dequantize + a float product only by the order of the sums (within fp32
// rounding of the exact product, relative to sum |q| |x| + z sum |x| per group).
template <Nibble F, int MR, int NR>
QF_AVX2 void nib_int_micro(const NibbleWeights& w, int64_t m0, const float* X, float* Y, int64_t ldy) {
  const int64_t K = w.K, G = F == Nibble::q4_0 ? 32 : w.group, gpr = K / G;
  const int64_t row_bytes = F == Nibble::q4_0 ? gpr * int64_t(sizeof(block_q4_0)) : K / 2;
  const __m256i m4 = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < gpr; ++g) {
    __m256 d[MR][NR][2], sx[NR];  // two partial sums per output: two FMA chains
    for (int j = 0; j < NR; ++j) {
      sx[j] = _mm256_setzero_ps();
      for (int i = 0; i < MR; ++i) d[i][j][0] = d[i][j][1] = _mm256_setzero_ps();
    }
    for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
      for (int j = 0; j < NR; ++j) {
        const float* x = X + j * K + k;
        sx[j] = _mm256_add_ps(sx[j], _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                                                   _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24))));
      }
      for (int i = 0; i < MR; ++i) {
        const uint8_t* p = F == Nibble::q4_0 ? reinterpret_cast<const block_q4_0*>(w.codes)[(m0 + i) * gpr + g].qs
                                             : w.codes + (((m0 + i) * K + k) >> 1);
        // The same bytes of the row MR further on, which the next call reads (its rows come
        // next in the panel order): the interleaved rows of a panel are streams the hardware
        // prefetchers pick up too late; this hides most of the DRAM latency.
        _mm_prefetch(reinterpret_cast<const char*>(p) + row_bytes * MR, _MM_HINT_T0);
        __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
        if constexpr (F == Nibble::int4_sym) {  // u ^ 8 = q + 8 for the signed nibble q: z = 8
          c0 = _mm256_xor_si256(c0, _mm256_set1_epi32(0x88));
          c1 = _mm256_xor_si256(c1, _mm256_set1_epi32(0x88));
        }
        const __m256 v[4] = {_mm256_cvtepi32_ps(_mm256_and_si256(c0, m4)), _mm256_cvtepi32_ps(_mm256_and_si256(c1, m4)),
                             _mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4)),
                             _mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4))};
        for (int j = 0; j < NR; ++j)
          for (int q = 0; q < 4; ++q)
            d[i][j][q & 1] = _mm256_fmadd_ps(v[q], _mm256_loadu_ps(X + j * K + k + 8 * q), d[i][j][q & 1]);
      }
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t m = m0 + i;
      __m256 s, z;
      if constexpr (F == Nibble::q4_0) {
        s = _mm256_set1_ps(fp16_to_f32(reinterpret_cast<const block_q4_0*>(w.codes)[m * gpr + g].d.bits));
        z = _mm256_cvtepi32_ps(eight);
      } else {
        s = _mm256_broadcast_ss(w.scales + m * gpr + g);
        z = F == Nibble::int4_asym ? _mm256_set1_ps(static_cast<float>(w.zeros[m * gpr + g]))
                                   : _mm256_cvtepi32_ps(eight);
      }
      for (int j = 0; j < NR; ++j)
        acc[i][j] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(z, sx[j], _mm256_add_ps(d[i][j][0], d[i][j][1])), acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) Y[j * ldy + i] = hsum(acc[i][j]);
}

template <Nibble F, int NR>
QF_AVX2 void nib_rows(const NibbleWeights& w, int64_t m0, int64_t MR, const float* X, float* Y, int64_t ldy) {
  constexpr bool kInt = F != Nibble::nf4;
  constexpr int64_t R = kInt ? (NR == 1 ? 4 : 2) : (NR == 1 ? 8 : 4);
  for (int64_t i = 0; i < MR; i += R) {
    switch (std::min<int64_t>(R, MR - i)) {
// One case per macro call, as written:
// clang-format off
#define QF_CASE(Q)                                                       \
  case Q:                                                                \
    if constexpr (Q <= R) {                                              \
      if constexpr (kInt) nib_int_micro<F, Q, NR>(w, m0 + i, X, Y + i, ldy); \
      else nf4_micro<Q, NR>(w, m0 + i, X, Y + i, ldy);                   \
    }                                                                    \
    break;
      QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4) QF_CASE(5) QF_CASE(6) QF_CASE(7) QF_CASE(8)
#undef QF_CASE
          // clang-format on
          default : break;
    }
  }
}

template <Nibble F>
QF_AVX2 void nib_format(const NibbleWeights& w, int64_t m0, int64_t MR, const float* X, int64_t N, float* Y,
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

QF_AVX2 void nibble_gemm(const NibbleWeights& w, int64_t m0, int64_t MR, const float* X, int64_t N, float* Y,
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

// Per block: the 32 weight codes as u8 (low nibbles = elements 0..15, high = 16..31),
// VPMADDUBSW with the activation codes minus VPMADDUBSW of 8 with them (pairs of
// (q_w - 8) q_a, |.| <= 2 * 8 * 128 + ...: inside int16), widened to int32 and scaled by d_w d_a.
template <int MR, int NR>
QF_AVX2 void q4q8_micro(const block_q4_0* W, int64_t nb, const int8_t* aq, const float* ad, float* out, int64_t ldo_m,
                        int64_t ldo_n) {
  const int64_t K = nb * 32;
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), eights = _mm256_set1_epi8(8), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wq[MR];
    float wd[MR];
    for (int i = 0; i < MR; ++i) {
      const block_q4_0* w = W + i * nb + b;
      _mm_prefetch(reinterpret_cast<const char*>(w + MR * nb), _MM_HINT_T0);  // as nib_int_micro
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w->qs));
      wq[i] = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1), m4);
      wd[i] = fp16_to_f32(w->d.bits);
    }
    for (int j = 0; j < NR; ++j) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + j * K + b * 32));
      const __m256i bias = _mm256_maddubs_epi16(eights, a);
      const float da = ad[j * nb + b];
      for (int i = 0; i < MR; ++i) {
        const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(wq[i], a), bias);
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
        acc[i][j] = _mm256_fmadd_ps(f, _mm256_set1_ps(wd[i] * da), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo_m + j * ldo_n] = hsum(acc[i][j]);
}

template <int NR>
QF_AVX2 void q4q8_rows(const block_q4_0* W, int64_t nb, int64_t mr, const int8_t* aq, const float* ad, float* out,
                       int64_t ldo_m, int64_t ldo_n) {
  switch (mr) {
// One case per macro call, as written:
// clang-format off
#define QF_CASE(R) case R: if constexpr (R * NR <= 8) q4q8_micro<R, NR>(W, nb, aq, ad, out, ldo_m, ldo_n); break;
    QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4) QF_CASE(5) QF_CASE(6) QF_CASE(7) QF_CASE(8)
#undef QF_CASE
        // clang-format on
        default : break;
  }
}

QF_AVX2 void q4q8_panel(const block_q4_0* W, int64_t nb, int64_t MR, const int8_t* aq, const float* ad, int64_t N,
                        float* out, int64_t ldo_m, int64_t ldo_n) {
  const int64_t K = nb * 32;
  int64_t j = 0;
  for (; j + 2 <= N; j += 2)
    for (int64_t i = 0; i < MR; i += 4)
      q4q8_rows<2>(W + i * nb, nb, std::min<int64_t>(4, MR - i), aq + j * K, ad + j * nb, out + i * ldo_m + j * ldo_n,
                   ldo_m, ldo_n);
  if (j < N) q4q8_rows<1>(W, nb, MR, aq + j * K, ad + j * nb, out + j * ldo_n, ldo_m, ldo_n);
}

// ---- int8 x int8 -------------------------------------------------------------------------------

// 16 values per step, sign-extended to int16; VPMADDWD gives exact int32 pair sums. Lanes
// cannot overflow (K <= 131071 and |a * b| <= 2^14). The K % 16 tail is scalar.
template <int MR, int NR>
QF_AVX2 void i8_micro(const int8_t* B, const int8_t* A, int64_t K, int32_t* out, int64_t ldo) {
  __m256i acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m256i a[NR];
    for (int j = 0; j < NR; ++j)
      a[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(A + j * K + k)));
    for (int i = 0; i < MR; ++i) {
      const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B + i * K + k)));
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(b, a[j]));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      int32_t s = static_cast<int32_t>(hsum_u32(acc[i][j]));
      for (int64_t t = k; t < K; ++t) s += int32_t(B[i * K + t]) * int32_t(A[j * K + t]);
      out[j * ldo + i] = s;
    }
}

// int4: per 32 packed bytes, the low nibbles (64 even elements' half) and high nibbles as
// u = q + 8 = nibble ^ 8 in 0..15; VPMADDUBSW with the split activations (pairs <= 2 * 15 * 128,
// and the low + high pair sums <= 7680: int16), widened by VPMADDWD; minus 8 * sum a.
template <int MR, int NR>
QF_AVX2 void i4_micro(const uint8_t* B, const int8_t* A, int64_t K, int32_t* out, int64_t ldo) {
  const int64_t kb = K / 2, Kp = (K + 127) / 128 * 128;
  __m256i acc[MR][NR], asum[NR];
  for (int j = 0; j < NR; ++j) {
    asum[j] = _mm256_setzero_si256();
    for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_setzero_si256();
  }
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x88)), m4 = _mm256_set1_epi8(0x0F);
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t h = 0; 32 * h < kb; ++h) {  // 32 bytes = 64 values per step
    const int64_t c = h / 2, off = 128 * c + 32 * (h % 2);
    __m256i alo[NR], ahi[NR];
    for (int j = 0; j < NR; ++j) {
      alo[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(A + j * Kp + off));
      ahi[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(A + j * Kp + off + 64));
      const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(ones8, alo[j]), _mm256_maddubs_epi16(ones8, ahi[j]));
      asum[j] = _mm256_add_epi32(asum[j], _mm256_madd_epi16(s, ones16));
    }
    const int64_t nbytes = std::min<int64_t>(32, kb - 32 * h);
    for (int i = 0; i < MR; ++i) {
      __m256i raw;
      if (nbytes == 32) {
        raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + i * kb + 32 * h));
      } else {  // the row's last bytes; the rest reads as 0 (q + 8 = 8, times a = 0)
        alignas(32) uint8_t tmp[32] = {};
        std::memcpy(tmp, B + i * kb + 32 * h, static_cast<size_t>(nbytes));
        raw = _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
      }
      const __m256i v = _mm256_xor_si256(raw, flip);
      const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      for (int j = 0; j < NR; ++j) {
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo[j]), _mm256_maddubs_epi16(hi, ahi[j]));
        acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(p, ones16));
      }
    }
  }
  for (int j = 0; j < NR; ++j) {
    const uint32_t sa = hsum_u32(asum[j]);
    for (int i = 0; i < MR; ++i) out[j * ldo + i] = static_cast<int32_t>(hsum_u32(acc[i][j]) - 8u * sa);
  }
}

template <bool Int4, int NR>
QF_AVX2 void int_rows(const uint8_t* B, int64_t mr, const int8_t* A, int64_t K, int32_t* out, int64_t ldo) {
  const int64_t ldb = Int4 ? K / 2 : K;
  for (int64_t i = 0; i < mr; i += 4) {
    const uint8_t* bi = B + i * ldb;
    switch (std::min<int64_t>(4, mr - i)) {
// One case per macro call, as written:
// clang-format off
#define QF_CASE(R)                                                                        \
  case R:                                                                                 \
    if constexpr (Int4) i4_micro<R, NR>(bi, A, K, out + i, ldo);                          \
    else i8_micro<R, NR>(reinterpret_cast<const int8_t*>(bi), A, K, out + i, ldo);        \
    break;
      QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4)
#undef QF_CASE
          // clang-format on
          default : break;
    }
  }
}

template <bool Int4>
QF_AVX2 void int_panel(const uint8_t* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out, int64_t ldo) {
  const int64_t lda = Int4 ? (K + 127) / 128 * 128 : K;
  int64_t j = 0;
  for (; j + 2 <= N; j += 2) int_rows<Int4, 2>(B, MR, A + j * lda, K, out + j * ldo, ldo);
  if (j < N) int_rows<Int4, 1>(B, MR, A + j * lda, K, out + j * ldo, ldo);
}

QF_AVX2 void i8_panel(const int8_t* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out, int64_t ldo) {
  int_panel<false>(reinterpret_cast<const uint8_t*>(B), MR, A, N, K, out, ldo);
}

QF_AVX2 void i4_panel(const uint8_t* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out, int64_t ldo) {
  int_panel<true>(B, MR, A, N, K, out, ldo);
}

}  // namespace

const CpuKernels& kernels() {
  static const CpuKernels k{Isa::avx2, f32_panel, nibble_gemm, q4q8_panel, i8_panel, i4_panel};
  return k;
}

}  // namespace qf::gemm::k_avx2

#endif  // QF_GEMM_X86
