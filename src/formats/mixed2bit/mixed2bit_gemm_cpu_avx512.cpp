// mixed2bit's AVX-512 (F, BW, VL, DQ, VNNI) leaf kernels (mixed2bit_gemm_cpu.h:
// Mixed2bitCpuKernels). Every function carries the target attribute QF_AVX512
// (gemm/cpu_simd_avx512.h; no global -m flags); mixed2bit_cpu_kernels() hands this table out only
// when gemm/cpu_isa.h reports the instruction set.
#include "formats/mixed2bit/mixed2bit_gemm_cpu.h"

#if QF_GEMM_X86
#include <algorithm>

#include "gemm/cpu_simd_avx512.h"

namespace qf::gemm::k_avx512 {
namespace {

// One mixed2bit group of gs values, branch-free on its width (2- and 4-bit groups mix
// unpredictably): 16 values are one word shifted by 2 i (2-bit) or two words shifted by 4 i.
QF_AVX512_INLINE void m2_group(const uint32_t* words, int is4, float s_eff, float m_eff, int64_t gs, float* y) {
  const __m512i sh2 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i sh4 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const __mmask16 k4 = static_cast<__mmask16>(-is4);
  const __m512i sh = _mm512_mask_mov_epi32(sh2, k4, sh4);
  const __m512i msk = _mm512_mask_mov_epi32(_mm512_set1_epi32(3), k4, _mm512_set1_epi32(15));
  const __mmask16 upper = static_cast<__mmask16>(k4 & 0xFF00);
  const __m512 s = _mm512_set1_ps(s_eff), m = _mm512_set1_ps(m_eff);
  for (int64_t v = 0; v < gs; v += 16) {
    const uint32_t* w = words + ((v / 16) << is4);
    const __m512i both = _mm512_mask_blend_epi32(upper, _mm512_set1_epi32(static_cast<int>(w[0])),
                                                 _mm512_set1_epi32(static_cast<int>(w[is4])));
    const __m512i q = _mm512_and_si512(_mm512_srlv_epi32(both, sh), msk);
    // fl(q * s) - m: two roundings, as mixed2bit's dequantize_value (no FMA)
    _mm512_storeu_ps(y + v, _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), s), m));
  }
}

QF_AVX512 void decode_m2(const M2Group* groups, int64_t n, int64_t gs, float* out) {
  for (int64_t g = 0; g < n; ++g)
    m2_group(groups[g].words, groups[g].is4 ? 1 : 0, groups[g].s, groups[g].m, gs, out + g * gs);
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

// Second-order block of each lane's slot j (lanes j = j0 + offset, offset < 16): b0 = j0 / B
// plus the number of block boundaries passed, counted with compares (no division).
QF_AVX512_INLINE __m512i block_of(__m512i j, int64_t j0, int64_t B) {
  const int64_t b0 = j0 / B, r0 = j0 % B;
  const __m512i r = _mm512_add_epi32(_mm512_sub_epi32(j, _mm512_set1_epi32(static_cast<int>(j0))),
                                     _mm512_set1_epi32(static_cast<int>(r0)));
  __m512i b = _mm512_set1_epi32(static_cast<int>(b0));
  for (int64_t t = B; t < r0 + 16; t += B)
    b = _mm512_mask_add_epi32(b, _mm512_cmpge_epi32_mask(r, _mm512_set1_epi32(static_cast<int>(t))), b,
                              _mm512_set1_epi32(1));
  return b;
}

// 16 groups per step: their width bits from the map, their slots from prefix counts, their
// second-order codes by masked loads + expands, their blocks' fp16 pairs by a masked gather,
// the effective scale and offset (the same float32 products as mixed2bit's effective()) for
// all 16 in two multiplies; then each group is decoded from its words.
QF_AVX512 void decode_m2_window(const M2Window& w, float* out) {
  const mixed2bit::ConstBuffers& q = *w.q;
  const int64_t gs = w.gs, B = w.B;
  const int w2 = static_cast<int>(gs / 16), w4 = static_cast<int>(gs / 8);
  int64_t j4 = w.j4, j2 = w.j2;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float s_arr[16], m_arr[16];
  alignas(64) int32_t off[16];
  for (int64_t t0 = 0; t0 < w.n; t0 += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, w.n - t0));
    const int64_t g = w.g0 + t0, byte0 = g >> 3, byte1 = (g + cnt - 1) >> 3;
    uint32_t bits = 0;
    for (int64_t b = byte0; b <= byte1; ++b) bits |= uint32_t(q.group_map[b]) << (8 * (b - byte0));
    bits = (bits >> (g & 7)) & ((1u << cnt) - 1u);
    const __mmask16 k4 = static_cast<__mmask16>(bits);
    const __mmask16 k2 = static_cast<__mmask16>(~bits & ((1u << cnt) - 1u));
    const int lo4 = kPrefixCounts.v[bits & 0xFF][7] + ((bits >> 7) & 1);  // 4-bit groups in lanes 0..7
    const int c4 = lo4 + kPrefixCounts.v[bits >> 8][7] + ((bits >> 15) & 1), c2 = cnt - c4;
    const __m128i pre = _mm_unpacklo_epi64(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(kPrefixCounts.v[bits & 0xFF])),
        _mm_add_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kPrefixCounts.v[(bits >> 8) & 0xFF])),
                     _mm_set1_epi8(static_cast<char>(lo4))));
    const __m512i p4 = _mm512_cvtepu8_epi32(pre);  // 4-bit groups before each lane
    const __m512i j4v = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j4)), p4);
    const __m512i j2v = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j2)), _mm512_sub_epi32(lane, p4));
    // Second-order codes: 2-bit slots j2.. are consecutive bytes sc | mc << 4, 4-bit slots j4..
    // consecutive byte pairs [sc, mc]; expanded into their groups' lanes (others 0).
    const __m512i v2 = _mm512_maskz_expand_epi32(
        k2, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << c2) - 1u), q.scales2 + j2)));
    const __m512i v4 = _mm512_maskz_expand_epi32(k4, _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                                                         static_cast<__mmask16>((1u << c4) - 1u), q.scales4 + 2 * j4)));
    const __m512i sc =
        _mm512_or_si512(_mm512_and_si512(v2, _mm512_set1_epi32(0x0F)), _mm512_and_si512(v4, _mm512_set1_epi32(0xFF)));
    const __m512i mc = _mm512_or_si512(_mm512_srli_epi32(v2, 4), _mm512_srli_epi32(v4, 8));
    // [d, dm] fp16 pair of each lane's block (one 32-bit gather per list, masked to its lanes).
    __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k2, block_of(j2v, j2, B), q.so2, 4);
    pairs = _mm512_mask_i32gather_epi32(pairs, k4, block_of(j4v, j4, B), q.so4, 4);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs));
    const __m512 dm = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16)));
    _mm512_store_ps(s_arr, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
    _mm512_store_ps(m_arr, _mm512_mul_ps(dm, _mm512_cvtepi32_ps(mc)));
    _mm512_store_si512(off, _mm512_mask_blend_epi32(k4, _mm512_mullo_epi32(j2v, _mm512_set1_epi32(w2)),
                                                    _mm512_mullo_epi32(j4v, _mm512_set1_epi32(w4))));
    for (int t = 0; t < cnt; ++t) {
      const int is4 = (bits >> t) & 1;
      m2_group((is4 ? q.codes4 : q.codes2) + off[t], is4, s_arr[t], m_arr[t], gs, out + (t0 + t) * gs);
    }
    j4 += c4;
    j2 += c2;
  }
}

}  // namespace

const Mixed2bitCpuKernels& mixed2bit_kernels() {
  static const Mixed2bitCpuKernels k{decode_m2, decode_m2_window, k_avx2::mixed2bit_kernels().gemm_row,
                                     k_avx2::mixed2bit_kernels().tiled_gemm_row};
  return k;
}

}  // namespace qf::gemm::k_avx512

#endif  // QF_GEMM_X86
