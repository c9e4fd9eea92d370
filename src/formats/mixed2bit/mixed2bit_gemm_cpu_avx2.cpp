// mixed2bit's AVX2 + FMA + F16C leaf kernels (mixed2bit_gemm_cpu.h: Mixed2bitCpuKernels). Every
// function carries the target attribute QF_AVX2 (gemm/cpu_simd_avx2.h; no global -m flags);
// mixed2bit_cpu_kernels() hands this table out only when gemm/cpu_isa.h reports the instruction
// set.
#include "formats/mixed2bit/mixed2bit_gemm_cpu.h"

#if QF_GEMM_X86
#include <algorithm>
#include <cstring>

#include "gemm/cpu_simd_avx2.h"

namespace qf::gemm::k_avx2 {
namespace {

// One mixed2bit group of gs values, branch-free on its width (2- and 4-bit groups mix
// unpredictably): 16 values are one word shifted by 2 i (2-bit) or two words shifted by 4 i.
// Hands each 16 decoded values to sink(offset in the group, values 0-7, values 8-15).
// Per width (2-bit, 4-bit): the lane shifts of values 0-7 and 8-15, and the code mask (loaded,
// not blended: loads are cheaper than the three blends per group).
alignas(32) constexpr int32_t kM2Lanes[2][3][8] = {
    {{0, 2, 4, 6, 8, 10, 12, 14}, {16, 18, 20, 22, 24, 26, 28, 30}, {3, 3, 3, 3, 3, 3, 3, 3}},
    {{0, 4, 8, 12, 16, 20, 24, 28}, {0, 4, 8, 12, 16, 20, 24, 28}, {15, 15, 15, 15, 15, 15, 15, 15}}};

// Each lane's 2-bit code (the low 2 bits of its word) as a float in one VPERMILPS, which reads
// only those bits of its index: the mask and the int -> float conversion in one instruction.
QF_AVX2_INLINE __m256 code2_ps(__m256i w) {
  return _mm256_permutevar_ps(_mm256_setr_ps(0.0f, 1.0f, 2.0f, 3.0f, 0.0f, 1.0f, 2.0f, 3.0f), w);
}

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
QF_AVX2_INLINE __m256i block_pairs(__m256i pairs, const half_t* so, int64_t n_list, __m256i rank, int64_t j0, int64_t B,
                                   __m256i mask) {
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
  uint32_t bits;               // bit t: group t is 4-bit
  int cnt, c4;                 // groups, 4-bit ones among them
  __m256 s, m;                 // effective scale and offset per lane
  __m256i is4, is2, r2;        // lane masks, and each lane's rank among the 2-bit lanes
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
  const __m256i is4 =
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane_bit), lane_bit);
  const __m256i is2 = _mm256_andnot_si256(is4, _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), lane));
  // Second-order codes: 2-bit slots j2.. are consecutive bytes sc | mc << 4, 4-bit slots j4..
  // consecutive byte pairs [sc, mc]; each lane takes its rank's entry.
  const __m256i v2 = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(load_upto16(q.scales2 + j2, c2, w.n2 - j2)), r2);
  __m256i v4 = _mm256_setzero_si256(), pairs = _mm256_setzero_si256();
  if (c2) pairs = block_pairs(pairs, q.so2, w.n2, r2, j2, B, is2);
  if (c4) {
    v4 = _mm256_permutevar8x32_epi32(_mm256_cvtepu16_epi32(load_upto16(q.scales4 + 2 * j4, 2 * c4, 2 * (w.n4 - j4))),
                                     p4);
    pairs = block_pairs(pairs, q.so4, w.n4, p4, j4, B, is4);
  }
  const __m256i sc = _mm256_blendv_epi8(_mm256_and_si256(v2, _mm256_set1_epi32(0x0F)),
                                        _mm256_and_si256(v4, _mm256_set1_epi32(0xFF)), is4);
  const __m256i mc = _mm256_blendv_epi8(_mm256_srli_epi32(v2, 4), _mm256_srli_epi32(v4, 8), is4);
  // 16-bit halves in order: packus per 128-bit lane, then the 64-bit quarters reordered.
  const __m256i h =
      _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_and_si256(pairs, lo16), _mm256_srli_epi32(pairs, 16)), 0xD8);
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
    for (int64_t t0 = 0; t0 < w.n; t0 += 8) {
      m2_eight(w, t0, j4, j2, e);
      const int c2 = e.cnt - e.c4;
      if (c2) {
        __m256i words = _mm256_permutevar8x32_epi32(load_words8(q.codes2 + j2, c2, w.n2 - j2), e.r2);
        __m256 d[NR][2];
        for (int j = 0; j < NR; ++j) d[j][0] = d[j][1] = _mm256_setzero_ps();
        const float* xt = a.xt + t0 * 16;
        for (int i = 0; i < 16; ++i) {
          const __m256 qv = code2_ps(words);
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
  with_rows4(N, [&](auto nr) { m2_row_dot<decltype(nr)::value>(w, a, y, ldy); });
}

// The tiled layout (mixed2bit_tiled.h), group_size 16, groups across the lanes as in m2_row_dot:
// lane t of a step holds group t0 + t of the row. Its codes words are 8 consecutive words of
// `codes` and its scales 8 consecutive bytes (one load each: the layout puts them at their
// column), its second-order pair its block's (B >= 8: the step's 8 groups share one block; else
// a gather); only the step's 4-bit groups (a byte of the map) fetch lo and mc4, at slots counted
// from their tile's first (t * n4_full). Each lane sums h = sum_i hi_i x_i from the codes words
// (a 4-bit group's high bits) and adds s' h - m sum_i x_i, s' = s (2-bit) or 4 s (4-bit); each
// 4-bit group then adds s sum_i lo_i x_i on its own (its lo word decoded against x in its natural
// order), so the steps pay for lo words only where there are some, not for all 8 lanes.
template <int NR>
QF_AVX2 void m2t_row_dot(const mixed2bit::tiled::ConstBuffers& q, const mixed2bit::tiled::Dims& d, int64_t row,
                         const M2Act& a, float* y, int64_t ldy) {
  namespace mt = mixed2bit::tiled;
  const int64_t G = d.groups_per_row(), B = d.scale_block;
  int bshift = 0;
  while ((int64_t(1) << bshift) < B) ++bshift;  // a power of two (check_dims)
  const uint32_t* codes = q.codes + row * G;    // gs = 16: one codes word per group
  const uint8_t* scales = q.scales + row * G;
  const int* so = reinterpret_cast<const int*>(q.so) + row * d.blocks_per_row();
  const int* so4 = reinterpret_cast<const int*>(q.so4) + row * d.tiles_per_row();
  const uint32_t* map = q.map + row * d.map_words();
  const int64_t slot_row = row * d.n4_row();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
  const __m256i* lo_lanes = reinterpret_cast<const __m256i*>(kM2Lanes[0]);  // values 0-7, 8-15 of a word
  const __m256i sha = _mm256_load_si256(lo_lanes), shb = _mm256_load_si256(lo_lanes + 1);
  __m256 acc[NR], accl[NR][2];
  for (int j = 0; j < NR; ++j) acc[j] = accl[j][0] = accl[j][1] = _mm256_setzero_ps();
  int64_t run = 0;  // 4-bit groups of the current tile before the step
  for (int64_t t0 = 0; t0 < G; t0 += 8) {
    if (t0 % mt::kTileGroups == 0) run = 0;
    const int cnt = static_cast<int>(std::min<int64_t>(8, G - t0));
    const __m256i live = tail_mask8(cnt);
    const __m256i hi = load_words8(codes + t0, cnt, G - t0);
    const __m256i sb = _mm256_cvtepu8_epi32(load_upto16(scales + t0, cnt, G - t0));
    const uint32_t bits = (map[t0 / mt::kMapBits] >> (t0 % mt::kMapBits)) & ((1u << cnt) - 1u);
    __m256i pair =
        B >= 8
            ? _mm256_set1_epi32(so[t0 >> bshift])
            : _mm256_mask_i32gather_epi32(
                  _mm256_setzero_si256(), so,
                  _mm256_srli_epi32(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(t0)), lane), bshift), live, 4);
    __m256i sc = _mm256_and_si256(sb, _mm256_set1_epi32(15)), mc = _mm256_srli_epi32(sb, 4);
    __m256i is4 = _mm256_setzero_si256();
    alignas(32) uint32_t lo_a[8] = {};
    alignas(32) int32_t mc_a[8] = {};
    if (bits) {
      int64_t slot = slot_row + (t0 / mt::kTileGroups) * d.n4_full + run;
      for (uint32_t b = bits; b; b &= b - 1, ++slot) {
        const int t = __builtin_ctz(b);
        lo_a[t] = q.lo[slot];  // one lo word per group at gs = 16
        mc_a[t] = q.mc4[slot];
      }
      run += __builtin_popcount(bits);
      is4 = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane_bit), lane_bit);
      sc = _mm256_blendv_epi8(sc, sb, is4);  // a 4-bit group's scales byte is its 8-bit sc
      mc = _mm256_blendv_epi8(mc, _mm256_load_si256(reinterpret_cast<const __m256i*>(mc_a)), is4);
      pair = _mm256_blendv_epi8(pair, _mm256_set1_epi32(so4[t0 / mt::kTileGroups]), is4);
    }
    // effective scale and offset: the float32 products of mixed2bit's effective()
    const __m256i h =
        _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_and_si256(pair, lo16), _mm256_srli_epi32(pair, 16)), 0xD8);
    const __m256 s = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtepi32_ps(sc));
    const __m256 m = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), _mm256_cvtepi32_ps(mc));
    __m256 dh[NR][2];
    for (int j = 0; j < NR; ++j) dh[j][0] = dh[j][1] = _mm256_setzero_ps();
    const float* xt = a.xt + t0 * 16;
    __m256i wh = hi;
    for (int i = 0; i < 16; ++i) {
      const __m256 qh = code2_ps(wh);
      wh = _mm256_srli_epi32(wh, 2);
      for (int j = 0; j < NR; ++j)
        dh[j][i & 1] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(xt + j * a.ldt + 8 * i), dh[j][i & 1]);
    }
    // a 4-bit lane's hi codes count 4 times
    const __m256 sh = _mm256_blendv_ps(s, _mm256_mul_ps(s, _mm256_set1_ps(4.0f)), _mm256_castsi256_ps(is4));
    for (int j = 0; j < NR; ++j) {
      const __m256 v = _mm256_fmsub_ps(sh, _mm256_add_ps(dh[j][0], dh[j][1]),
                                       _mm256_mul_ps(m, _mm256_loadu_ps(a.sx + j * a.lds + t0)));
      acc[j] = _mm256_add_ps(acc[j], _mm256_and_ps(v, _mm256_castsi256_ps(live)));  // lanes past the row: nothing
    }
    if (bits) {
      alignas(32) float s_a[8];
      _mm256_store_ps(s_a, s);
      for (uint32_t b = bits; b; b &= b - 1) {
        const int t = __builtin_ctz(b);
        const __m256i wl = _mm256_set1_epi32(static_cast<int>(lo_a[t]));
        const __m256 st = _mm256_set1_ps(s_a[t]);
        const __m256 l0 = _mm256_mul_ps(code2_ps(_mm256_srlv_epi32(wl, sha)), st);
        const __m256 l1 = _mm256_mul_ps(code2_ps(_mm256_srlv_epi32(wl, shb)), st);
        const float* xg = a.X + (t0 + t) * 16;
        for (int j = 0; j < NR; ++j) {
          accl[j][0] = _mm256_fmadd_ps(l0, _mm256_loadu_ps(xg + j * a.ldx), accl[j][0]);
          accl[j][1] = _mm256_fmadd_ps(l1, _mm256_loadu_ps(xg + j * a.ldx + 8), accl[j][1]);
        }
      }
    }
  }
  for (int j = 0; j < NR; ++j) y[j * ldy] = hsum(_mm256_add_ps(acc[j], _mm256_add_ps(accl[j][0], accl[j][1])));
}

QF_AVX2 void m2t_gemm_row(const mixed2bit::tiled::ConstBuffers& q, const mixed2bit::tiled::Dims& d, int64_t row,
                          const M2Act& a, int64_t N, float* y, int64_t ldy) {
  with_rows4(N, [&](auto nr) { m2t_row_dot<decltype(nr)::value>(q, d, row, a, y, ldy); });
}

}  // namespace

const Mixed2bitCpuKernels& mixed2bit_kernels() {
  static const Mixed2bitCpuKernels k{decode_m2, decode_m2_window, m2_gemm_row, m2t_gemm_row};
  return k;
}

}  // namespace qf::gemm::k_avx2

#endif  // QF_GEMM_X86
