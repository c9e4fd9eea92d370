// AVX2 + FMA + F16C leaf kernels (gemm/cpu_kernels.h), for x86-64 CPUs without AVX-512. Every
// function carries the target attribute QF_AVX2 (no global -m flags); cpu_isa.cpp hands this
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

#define QF_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QF_AVX2_INLINE QF_AVX2 __attribute__((always_inline)) inline

namespace qf::gemm::k_avx2 {
namespace {

using q4_0::block_q4_0;

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
QF_AVX2 void f32_rows(const float* X, int64_t ldx, const float* W, int64_t ldw, int64_t mr, int64_t kc,
                      float* acc, bool accumulate) {
  switch (mr) {
#define QF_CASE(R) case R: if constexpr (R * NR <= 12) f32_micro<R, NR>(X, ldx, W, ldw, kc, acc, accumulate); break;
    QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4) QF_CASE(5) QF_CASE(6) QF_CASE(7) QF_CASE(8)
#undef QF_CASE
    default: break;
  }
}

QF_AVX2 void f32_panel(const float* X, int64_t ldx, int64_t N, const float* W, int64_t ldw, int64_t MT,
                       int64_t kc, float* acc, bool accumulate) {
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

// ---- decoders --------------------------------------------------------------------------------

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

QF_AVX2 void decode_nf4(const uint8_t* packed, const float* absmax, int log2_bs, int64_t i0, int64_t len,
                        float* out) {
  if ((i0 | len) & 31) return k_scalar::kernels().decode_nf4(packed, absmax, log2_bs, i0, len, out);
  const __m256 lut_lo = _mm256_loadu_ps(nf4::kCode), lut_hi = _mm256_loadu_ps(nf4::kCode + 8);
  for (int64_t t = 0; t < len; t += 32) {
    const int64_t i = i0 + t;
    const __m256 am = _mm256_set1_ps(absmax[i >> log2_bs]);
    __m256i c[4];
    widen32(nibbles32<true>(packed + (i >> 1)), c);
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(out + t + 8 * q, _mm256_mul_ps(lookup16(c[q], lut_lo, lut_hi), am));
  }
}

QF_AVX2 void decode_int4(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t gs, int64_t i0,
                         int64_t len, float* out) {
  if (((i0 | len | gs) & 31)) return k_scalar::kernels().decode_int4(qweight, scales, zeros, gs, i0, len, out);
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
    if ((r += 32) == gs) { r = 0; ++g; }
  }
}

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

// One mixed2bit group of gs values, branch-free on its width (2- and 4-bit groups mix
// unpredictably): 16 values are one word shifted by 2 i (2-bit) or two words shifted by 4 i.
// Hands each 16 decoded values to sink(offset in the group, values 0-7, values 8-15).
// Per width (2-bit, 4-bit): the lane shifts of values 0-7 and 8-15, and the code mask (loaded,
// not blended: loads are cheaper than the three blends per group).
alignas(32) constexpr int32_t kM2Lanes[2][3][8] = {
    {{0, 2, 4, 6, 8, 10, 12, 14}, {16, 18, 20, 22, 24, 26, 28, 30}, {3, 3, 3, 3, 3, 3, 3, 3}},
    {{0, 4, 8, 12, 16, 20, 24, 28}, {0, 4, 8, 12, 16, 20, 24, 28}, {15, 15, 15, 15, 15, 15, 15, 15}}};

template <class Sink>
QF_AVX2_INLINE void m2_group(const uint32_t* words, int is4, float s_eff, float m_eff, int64_t gs, const Sink& sink) {
  const __m256i* lanes = reinterpret_cast<const __m256i*>(kM2Lanes[is4]);
  const __m256i sha = _mm256_load_si256(lanes), shb = _mm256_load_si256(lanes + 1);
  const __m256i msk = _mm256_load_si256(lanes + 2);
  const __m256 s = _mm256_set1_ps(s_eff), m = _mm256_set1_ps(m_eff);
  for (int64_t v = 0; v < gs; v += 16) {
    const uint32_t* w = words + ((v / 16) << is4);
    const __m256i q0 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w[0])), sha), msk);
    const __m256i q1 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w[is4])), shb), msk);
    // fl(q * s) - m: two roundings, as mixed2bit's dequantize_value (no FMA)
    sink(v, _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q0), s), m),
         _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q1), s), m));
  }
}

// The sink that writes the values to out (a decoded tile row).
struct M2Store {
  float* out;
  QF_AVX2_INLINE void operator()(int64_t pos, __m256 a, __m256 b) const {
    _mm256_storeu_ps(out + pos, a);
    _mm256_storeu_ps(out + pos + 8, b);
  }
};

QF_AVX2 void decode_m2(const M2Group* groups, int64_t n, int64_t gs, float* out) {
  for (int64_t g = 0; g < n; ++g)
    m2_group(groups[g].words, groups[g].is4 ? 1 : 0, groups[g].s, groups[g].m, gs, M2Store{out + g * gs});
}

// For each byte value v: the number of set bits of v below bit i, i = 0..7.
struct PrefixCounts {
  uint8_t v[256][8];
  constexpr PrefixCounts() : v() {
    for (int x = 0; x < 256; ++x)
      for (int i = 1; i < 8; ++i) v[x][i] = static_cast<uint8_t>(v[x][i - 1] + ((x >> (i - 1)) & 1));
  }
};
constexpr PrefixCounts kPrefixCounts;

// Second-order block of each lane's slot j0 + rank (rank < 8 per lane): j0 / B plus the block
// boundaries passed, counted with compares (no division).
QF_AVX2_INLINE __m256i block_of(__m256i rank, int64_t j0, int64_t B) {
  const int64_t r0 = j0 % B;
  const __m256i r = _mm256_add_epi32(rank, _mm256_set1_epi32(static_cast<int>(r0)));
  __m256i b = _mm256_set1_epi32(static_cast<int>(j0 / B));
  for (int64_t t = B; t < r0 + 8; t += B)  // compare gives -1 where r >= t
    b = _mm256_sub_epi32(b, _mm256_cmpgt_epi32(r, _mm256_set1_epi32(static_cast<int>(t - 1))));
  return b;
}

// n bytes (n <= 16) from p, zero-filled: a plain load where `avail` bytes stay readable.
QF_AVX2_INLINE __m128i load_upto16(const uint8_t* p, int64_t n, int64_t avail) {
  if (avail >= 16) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (n <= 0 || avail <= 0) return _mm_setzero_si128();  // p may be an empty list's pointer
  alignas(16) uint8_t tmp[16] = {};
  std::memcpy(tmp, p, static_cast<size_t>(std::min(n, avail)));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
}

// A sink seen from a group at offset base of the window.
template <class Sink>
struct M2At {
  Sink& sink;
  int64_t base;
  QF_AVX2_INLINE void operator()(int64_t v, __m256 a, __m256 b) const { sink(base + v, a, b); }
};

// The [d, dm] fp16 pairs (as 32-bit lanes) of the second-order blocks of slots j0 + rank of one
// list, in the lanes of `mask`: with B >= 8 the 8 lanes span at most two blocks, picked from
// two scalar loads; else a masked gather.
QF_AVX2_INLINE __m256i block_pairs(__m256i pairs, const half_t* so, int64_t n_list, __m256i rank, int64_t j0,
                                   int64_t B, __m256i mask) {
  const int* so32 = reinterpret_cast<const int*>(so);
  if (B >= 8) {
    const int64_t b0 = j0 / B, r0 = j0 % B;
    const int p0 = so32[b0];
    const int p1 = (b0 + 1) * B < n_list ? so32[b0 + 1] : 0;  // the next block, where it exists
    const __m256i next = _mm256_cmpgt_epi32(rank, _mm256_set1_epi32(static_cast<int>(B - 1 - r0)));
    const __m256i v = _mm256_blendv_epi8(_mm256_set1_epi32(p0), _mm256_set1_epi32(p1), next);
    return _mm256_blendv_epi8(pairs, v, mask);
  }
  return _mm256_mask_i32gather_epi32(pairs, so32, block_of(rank, j0, B), mask, 4);
}

// The parameters of 8 consecutive groups of a window (fewer at its end): width bits, effective
// scale and offset per lane, the lanes' slots and their code words' offsets.
struct M2Eight {
  uint32_t bits;   // bit t: group t is 4-bit
  int cnt, c4;     // groups, 4-bit ones among them
  __m256 s, m;     // effective scale and offset per lane
  __m256i is4, is2, r2;  // lane masks, and each lane's rank among the 2-bit lanes
  alignas(32) int32_t off[8];  // code word offset of each lane's group in its list
};

// 8 groups per step (AVX-512's decode_m2_window with 8 lanes): their width bits from the map,
// their slots from prefix counts, their second-order codes by one load per list permuted into
// the groups' lanes, their blocks' fp16 pairs, the effective scale and offset (the float32
// products of mixed2bit's effective()) for all 8 in two multiplies.
QF_AVX2_INLINE void m2_eight(const M2Window& w, int64_t t0, int64_t j4, int64_t j2, M2Eight& e) {
  const mixed2bit::ConstBuffers& q = *w.q;
  const int64_t B = w.B;
  const int w2 = static_cast<int>(w.gs / 16), w4 = static_cast<int>(w.gs / 8);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
  const int cnt = static_cast<int>(std::min<int64_t>(8, w.n - t0));
  const int64_t g = w.g0 + t0, byte0 = g >> 3;
  uint32_t bits = q.group_map[byte0];
  if ((g & 7) + cnt > 8) bits |= uint32_t(q.group_map[byte0 + 1]) << 8;
  bits = (bits >> (g & 7)) & ((1u << cnt) - 1u);
  const int c4 = kPrefixCounts.v[bits][7] + static_cast<int>(bits >> 7), c2 = cnt - c4;
  const __m256i p4 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kPrefixCounts.v[bits])));
  const __m256i r2 = _mm256_sub_epi32(lane, p4);  // rank among the 2-bit lanes
  const __m256i is4 = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane_bit),
                                         lane_bit);
  const __m256i is2 = _mm256_andnot_si256(is4, _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), lane));
  // Second-order codes: 2-bit slots j2.. are consecutive bytes sc | mc << 4, 4-bit slots j4..
  // consecutive byte pairs [sc, mc]; each lane takes its rank's entry.
  const __m256i v2 =
      _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(load_upto16(q.scales2 + j2, c2, w.n2 - j2)), r2);
  __m256i v4 = _mm256_setzero_si256(), pairs = _mm256_setzero_si256();
  if (c2) pairs = block_pairs(pairs, q.so2, w.n2, r2, j2, B, is2);
  if (c4) {
    v4 = _mm256_permutevar8x32_epi32(
        _mm256_cvtepu16_epi32(load_upto16(q.scales4 + 2 * j4, 2 * c4, 2 * (w.n4 - j4))), p4);
    pairs = block_pairs(pairs, q.so4, w.n4, p4, j4, B, is4);
  }
  const __m256i sc = _mm256_blendv_epi8(_mm256_and_si256(v2, _mm256_set1_epi32(0x0F)),
                                        _mm256_and_si256(v4, _mm256_set1_epi32(0xFF)), is4);
  const __m256i mc = _mm256_blendv_epi8(_mm256_srli_epi32(v2, 4), _mm256_srli_epi32(v4, 8), is4);
  // 16-bit halves in order: packus per 128-bit lane, then the 64-bit quarters reordered.
  const __m256i h = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_and_si256(pairs, lo16), _mm256_srli_epi32(pairs, 16)), 0xD8);
  e.s = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtepi32_ps(sc));
  e.m = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), _mm256_cvtepi32_ps(mc));
  const __m256i j4v = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j4)), p4);
  const __m256i j2v = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j2)), r2);
  _mm256_store_si256(reinterpret_cast<__m256i*>(e.off),
                     _mm256_blendv_epi8(_mm256_mullo_epi32(j2v, _mm256_set1_epi32(w2)),
                                        _mm256_mullo_epi32(j4v, _mm256_set1_epi32(w4)), is4));
  e.bits = bits;
  e.cnt = cnt;
  e.c4 = c4;
  e.is4 = is4;
  e.is2 = is2;
  e.r2 = r2;
}

// Each group of the window decoded from its words and handed to the sink at its offset in the
// window (`only4`: the 4-bit groups only).
template <class Sink>
QF_AVX2_INLINE void m2_window(const M2Window& w, Sink& sink) {
  const mixed2bit::ConstBuffers& q = *w.q;
  int64_t j4 = w.j4, j2 = w.j2;
  M2Eight e;
  alignas(32) float s_arr[8], m_arr[8];
  for (int64_t t0 = 0; t0 < w.n; t0 += 8) {
    m2_eight(w, t0, j4, j2, e);
    _mm256_store_ps(s_arr, e.s);
    _mm256_store_ps(m_arr, e.m);
    for (int t = 0; t < e.cnt; ++t) {
      const int g4 = (e.bits >> t) & 1;
      m2_group((g4 ? q.codes4 : q.codes2) + e.off[t], g4, s_arr[t], m_arr[t], w.gs, M2At<Sink>{sink, (t0 + t) * w.gs});
    }
    j4 += e.c4;
    j2 += e.cnt - e.c4;
  }
}

QF_AVX2 void decode_m2_window(const M2Window& w, float* out) {
  M2Store store{out};
  m2_window(w, store);
}

// Fused mixed2bit product of one weight row (the window: all its groups) with NR activation rows:
// the decoded values (exactly dequantize's) multiplied into two float32 partial sums per row.
template <int NR>
struct M2Dot {
  const float* X;
  int64_t ldx;
  __m256 acc[NR][2];
  QF_AVX2_INLINE void operator()(int64_t pos, __m256 a, __m256 b) {
    for (int j = 0; j < NR; ++j) {
      acc[j][0] = _mm256_fmadd_ps(a, _mm256_loadu_ps(X + j * ldx + pos), acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(b, _mm256_loadu_ps(X + j * ldx + pos + 8), acc[j][1]);
    }
  }
};

// n uint32 words (n <= 8) from p, zero-filled: a plain load where `avail` words stay readable.
QF_AVX2_INLINE __m256i load_words8(const uint32_t* p, int64_t n, int64_t avail) {
  if (avail >= 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (n <= 0 || avail <= 0) return _mm256_setzero_si256();
  alignas(32) uint32_t tmp[8] = {};
  std::memcpy(tmp, p, static_cast<size_t>(std::min(n, avail)) * 4);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
}

template <int NR>
QF_AVX2 void m2_row_dot(const M2Window& w, const M2Act& a, float* y, int64_t ldy) {
  M2Dot<NR> dot{a.X, a.ldx, {}};
  for (int j = 0; j < NR; ++j) dot.acc[j][0] = dot.acc[j][1] = _mm256_setzero_ps();
  if (!a.xt) {
    m2_window(w, dot);
  } else {
    // gs = 16, groups across the lanes: lane t of a step holds group t0 + t, value i of every
    // lane's group multiplies xt (x's values i of the 8 groups, side by side). For the 2-bit
    // groups (the 2-bit words of consecutive slots are consecutive) each lane sums d = sum_i q_i
    // x_i, then adds s * d - m * (sum_i x_i); the 4-bit groups go through m2_group one by one.
    const mixed2bit::ConstBuffers& q = *w.q;
    int64_t j4 = w.j4, j2 = w.j2;
    M2Eight e;
    alignas(32) float s_arr[8], m_arr[8];
    __m256 acc2[NR];
    for (int j = 0; j < NR; ++j) acc2[j] = _mm256_setzero_ps();
    const __m256i three = _mm256_set1_epi32(3);
    for (int64_t t0 = 0; t0 < w.n; t0 += 8) {
      m2_eight(w, t0, j4, j2, e);
      const int c2 = e.cnt - e.c4;
      if (c2) {
        __m256i words = _mm256_permutevar8x32_epi32(load_words8(q.codes2 + j2, c2, w.n2 - j2), e.r2);
        __m256 d[NR][2];
        for (int j = 0; j < NR; ++j) d[j][0] = d[j][1] = _mm256_setzero_ps();
        const float* xt = a.xt + t0 * 16;
        for (int i = 0; i < 16; ++i) {
          const __m256 qv = _mm256_cvtepi32_ps(_mm256_and_si256(words, three));
          words = _mm256_srli_epi32(words, 2);
          for (int j = 0; j < NR; ++j)
            d[j][i & 1] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(xt + j * a.ldt + 8 * i), d[j][i & 1]);
        }
        for (int j = 0; j < NR; ++j) {
          const __m256 sx = _mm256_loadu_ps(a.sx + j * a.lds + t0);
          const __m256 v = _mm256_fmsub_ps(e.s, _mm256_add_ps(d[j][0], d[j][1]), _mm256_mul_ps(e.m, sx));
          acc2[j] = _mm256_add_ps(acc2[j], _mm256_and_ps(v, _mm256_castsi256_ps(e.is2)));
        }
      }
      if (e.c4) {
        _mm256_store_ps(s_arr, e.s);
        _mm256_store_ps(m_arr, e.m);
        for (uint32_t b = e.bits; b; b &= b - 1) {
          const int t = __builtin_ctz(b);
          m2_group(q.codes4 + e.off[t], 1, s_arr[t], m_arr[t], 16, M2At<M2Dot<NR>>{dot, (t0 + t) * 16});
        }
      }
      j4 += e.c4;
      j2 += c2;
    }
    for (int j = 0; j < NR; ++j) dot.acc[j][0] = _mm256_add_ps(dot.acc[j][0], acc2[j]);
  }
  for (int j = 0; j < NR; ++j) y[j * ldy] = hsum(_mm256_add_ps(dot.acc[j][0], dot.acc[j][1]));
}

QF_AVX2 void m2_gemm_row(const M2Window& w, const M2Act& a, int64_t N, float* y, int64_t ldy) {
  switch (N) {
    case 1: m2_row_dot<1>(w, a, y, ldy); break;
    case 2: m2_row_dot<2>(w, a, y, ldy); break;
    case 3: m2_row_dot<3>(w, a, y, ldy); break;
    case 4: m2_row_dot<4>(w, a, y, ldy); break;
    default: break;
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
        for (int q = 0; q < 4; ++q) acc[i][j] = _mm256_fmadd_ps(v[q], _mm256_loadu_ps(X + j * K + k + 8 * q), acc[i][j]);
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
        const uint8_t* p = F == Nibble::q4_0
                               ? reinterpret_cast<const block_q4_0*>(w.codes)[(m0 + i) * gpr + g].qs
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
                             _mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4))};
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
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(z, sx[j], _mm256_add_ps(d[i][j][0], d[i][j][1])), acc[i][j]);
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
#define QF_CASE(Q)                                                       \
  case Q:                                                                \
    if constexpr (Q <= R) {                                              \
      if constexpr (kInt) nib_int_micro<F, Q, NR>(w, m0 + i, X, Y + i, ldy); \
      else nf4_micro<Q, NR>(w, m0 + i, X, Y + i, ldy);                   \
    }                                                                    \
    break;
      QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4) QF_CASE(5) QF_CASE(6) QF_CASE(7) QF_CASE(8)
#undef QF_CASE
      default: break;
    }
  }
}

template <Nibble F>
QF_AVX2 void nib_format(const NibbleWeights& w, int64_t m0, int64_t MR, const float* X, int64_t N, float* Y,
                        int64_t ldy) {
  switch (N) {
    case 1: nib_rows<F, 1>(w, m0, MR, X, Y, ldy); break;
    case 2: nib_rows<F, 2>(w, m0, MR, X, Y, ldy); break;
    case 3: nib_rows<F, 3>(w, m0, MR, X, Y, ldy); break;
    case 4: nib_rows<F, 4>(w, m0, MR, X, Y, ldy); break;
    default: break;
  }
}

QF_AVX2 void nibble_gemm(const NibbleWeights& w, int64_t m0, int64_t MR, const float* X, int64_t N, float* Y,
                         int64_t ldy) {
  switch (w.fmt) {
    case Nibble::nf4: nib_format<Nibble::nf4>(w, m0, MR, X, N, Y, ldy); break;
    case Nibble::int4_asym: nib_format<Nibble::int4_asym>(w, m0, MR, X, N, Y, ldy); break;
    case Nibble::int4_sym: nib_format<Nibble::int4_sym>(w, m0, MR, X, N, Y, ldy); break;
    case Nibble::q4_0: nib_format<Nibble::q4_0>(w, m0, MR, X, N, Y, ldy); break;
  }
}

// ---- fused small-N int8 weight-only GEMM ---------------------------------------------------------

// Per 16 values of a row: two 8-byte loads sign-extended to int32 lanes (VPMOVSXBD), converted
// to float (exact) and multiplied into two partial sums per output (two FMA chains); at the end
// of each scale unit the unit's sum is scaled into the output's accumulator. Per-output
// accumulators: the sum order depends on K and L only.
template <int MR, int NR>
QF_AVX2 void i8w_micro(const Int8Weights& w, int64_t m0, const float* X, float* Y, int64_t ldy) {
  const int64_t K = w.K, L = w.L;
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t u0 = 0; u0 < K; u0 += L) {
    __m256 d[MR][NR][2];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) d[i][j][0] = d[i][j][1] = _mm256_setzero_ps();
    for (int64_t k = u0; k < u0 + L; k += 16) {
      for (int i = 0; i < MR; ++i) {
        const int8_t* p = w.q + (m0 + i) * K + k;
        _mm_prefetch(reinterpret_cast<const char*>(p) + MR * K, _MM_HINT_T0);  // as nib_int_micro
        const __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
        const __m256 v1 =
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
        for (int j = 0; j < NR; ++j) {
          d[i][j][0] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(X + j * K + k), d[i][j][0]);
          d[i][j][1] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(X + j * K + k + 8), d[i][j][1]);
        }
      }
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 s = _mm256_broadcast_ss(w.scales + (m0 + i) * w.scale_stride + u0 / L);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(s, _mm256_add_ps(d[i][j][0], d[i][j][1]), acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) Y[j * ldy + i] = hsum(acc[i][j]);
}

template <int NR>
QF_AVX2 void i8w_rows(const Int8Weights& w, int64_t m0, int64_t MR, const float* X, float* Y, int64_t ldy) {
  constexpr int64_t R = NR == 1 ? 4 : 2;
  for (int64_t i = 0; i < MR; i += R) {
    switch (std::min<int64_t>(R, MR - i)) {
#define QF_CASE(Q) case Q: if constexpr (Q <= R) i8w_micro<Q, NR>(w, m0 + i, X, Y + i, ldy); break;
      QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4)
#undef QF_CASE
      default: break;
    }
  }
}

QF_AVX2 void int8_gemm(const Int8Weights& w, int64_t m0, int64_t MR, const float* X, int64_t N, float* Y,
                       int64_t ldy) {
  switch (N) {
    case 1: i8w_rows<1>(w, m0, MR, X, Y, ldy); break;
    case 2: i8w_rows<2>(w, m0, MR, X, Y, ldy); break;
    case 3: i8w_rows<3>(w, m0, MR, X, Y, ldy); break;
    case 4: i8w_rows<4>(w, m0, MR, X, Y, ldy); break;
    default: break;
  }
}

// ---- q4_0 x q8_1 ---------------------------------------------------------------------------------

// Per block: the 32 weight codes as u8 (low nibbles = elements 0..15, high = 16..31),
// VPMADDUBSW with the activation codes minus VPMADDUBSW of 8 with them (pairs of
// (q_w - 8) q_a, |.| <= 2 * 8 * 128 + ...: inside int16), widened to int32 and scaled by d_w d_a.
template <int MR, int NR>
QF_AVX2 void q4q8_micro(const block_q4_0* W, int64_t nb, const int8_t* aq, const float* ad, float* out,
                        int64_t ldo_m, int64_t ldo_n) {
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
#define QF_CASE(R) case R: if constexpr (R * NR <= 8) q4q8_micro<R, NR>(W, nb, aq, ad, out, ldo_m, ldo_n); break;
    QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4) QF_CASE(5) QF_CASE(6) QF_CASE(7) QF_CASE(8)
#undef QF_CASE
    default: break;
  }
}

QF_AVX2 void q4q8_panel(const block_q4_0* W, int64_t nb, int64_t MR, const int8_t* aq, const float* ad, int64_t N,
                        float* out, int64_t ldo_m, int64_t ldo_n) {
  const int64_t K = nb * 32;
  int64_t j = 0;
  for (; j + 2 <= N; j += 2)
    for (int64_t i = 0; i < MR; i += 4)
      q4q8_rows<2>(W + i * nb, nb, std::min<int64_t>(4, MR - i), aq + j * K, ad + j * nb,
                   out + i * ldo_m + j * ldo_n, ldo_m, ldo_n);
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
    for (int i = 0; i < MR; ++i)
      out[j * ldo + i] = static_cast<int32_t>(hsum_u32(acc[i][j]) - 8u * sa);
  }
}

template <bool Int4, int NR>
QF_AVX2 void int_rows(const uint8_t* B, int64_t mr, const int8_t* A, int64_t K, int32_t* out, int64_t ldo) {
  const int64_t ldb = Int4 ? K / 2 : K;
  for (int64_t i = 0; i < mr; i += 4) {
    const uint8_t* bi = B + i * ldb;
    switch (std::min<int64_t>(4, mr - i)) {
#define QF_CASE(R)                                                                        \
  case R:                                                                                 \
    if constexpr (Int4) i4_micro<R, NR>(bi, A, K, out + i, ldo);                          \
    else i8_micro<R, NR>(reinterpret_cast<const int8_t*>(bi), A, K, out + i, ldo);        \
    break;
      QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4)
#undef QF_CASE
      default: break;
    }
  }
}

template <bool Int4>
QF_AVX2 void int_panel(const uint8_t* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out,
                       int64_t ldo) {
  const int64_t lda = Int4 ? (K + 127) / 128 * 128 : K;
  int64_t j = 0;
  for (; j + 2 <= N; j += 2) int_rows<Int4, 2>(B, MR, A + j * lda, K, out + j * ldo, ldo);
  if (j < N) int_rows<Int4, 1>(B, MR, A + j * lda, K, out + j * ldo, ldo);
}

QF_AVX2 void i8_panel(const int8_t* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out,
                      int64_t ldo) {
  int_panel<false>(reinterpret_cast<const uint8_t*>(B), MR, A, N, K, out, ldo);
}

QF_AVX2 void i4_panel(const uint8_t* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out,
                      int64_t ldo) {
  int_panel<true>(B, MR, A, N, K, out, ldo);
}

}  // namespace

const CpuKernels& kernels() {
  static const CpuKernels k{Isa::avx2, f32_panel, decode_nf4, decode_int4, decode_q4_0, decode_m2, decode_m2_window,
                            nibble_gemm, int8_gemm, m2_gemm_row, q4q8_panel, i8_panel,  i4_panel};
  return k;
}

}  // namespace qf::gemm::k_avx2

#endif  // QF_GEMM_X86
