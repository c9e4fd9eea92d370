// mixed2bit layout "tiled" on the CPU (mixed2bit_tiled.h): every tile of a row is quantized on
// its own, so tiles are threaded with qf::for_each_block and the output never depends on the
// thread count.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common/parallel.h"
#include "formats/mixed2bit/mixed2bit_gemm_cpu.h"
#include "formats/mixed2bit/mixed2bit_tiled.h"
#include "gemm/weight_only_cpu.h"

namespace qf::mixed2bit::tiled {
namespace {

// A group's codes into the codes stream (2 bits per value: q, or q >> 2 for a 4-bit group) and,
// for a 4-bit group, the low bits into its lo words.
template <class T>
void encode_split(const T* x, int gs, float s_eff, float m_eff, int qmax, uint32_t* hi_words, uint32_t* lo_words) {
  for (int w = 0; w < gs / kCodes2PerWord; ++w) {
    uint32_t hi = 0, lo = 0;
    for (int i = 0; i < kCodes2PerWord; ++i) {
      const uint32_t q = static_cast<uint32_t>(quantize_value(to_f32(x[w * kCodes2PerWord + i]), s_eff, m_eff, qmax));
      if (lo_words) {
        hi |= (q >> 2) << (2 * i);
        lo |= (q & 3u) << (2 * i);
      } else {
        hi |= q << (2 * i);
      }
    }
    hi_words[w] = hi;
    if (lo_words) lo_words[w] = lo;
  }
}

// Steps 1-5 for tile t of row r. Returns false for the "too large" condition.
template <class T>
bool quantize_tile(const T* w, const float* sens, const Dims& d, const Buffers& out, int64_t r, int64_t t) {
  const int gs = static_cast<int>(d.group_size);
  const int64_t K = d.K, G = d.groups_per_row(), B = d.scale_block, c0 = t * kTileGroups;
  const int tg = static_cast<int>(d.tile_groups(t)), n4 = static_cast<int>(d.tile_n4(t));
  float range[kTileGroups], m[kTileGroups];
  uint32_t key[kTileGroups];
  int order[kTileGroups];
  bool is4[kTileGroups];
  for (int p = 0; p < tg; ++p) {  // 1. scores; 3. the range and m of every group
    const T* x = w + r * K + (c0 + p) * gs;
    float mn, mx;
    group_min_max(x, gs, nullptr, 0, 0, &mn, &mx);
    range_m_of(mn, mx, &range[p], &m[p]);
    const float s = sens ? sensitivity_score(x, sens + (c0 + p) * gs, gs) : range_score_of(mn, mx);
    if (s != s) return false;
    key[p] = score_order_key(s);
    order[p] = p;
    is4[p] = false;
  }
  // 2. the n4 first groups in (score descending, position ascending) order
  std::nth_element(order, order + std::min(n4, tg), order + tg,
                   [&](int a, int b) { return key[a] != key[b] ? key[a] > key[b] : a < b; });
  for (int i = 0; i < n4; ++i) is4[order[i]] = true;

  // 4. second order: 2-bit blocks of B positions (B divides 256: blocks start inside the tile),
  // one 4-bit block per tile
  for (int p0 = 0; p0 < tg; p0 += static_cast<int>(B)) {
    float ms = 0.0f, mm = 0.0f;
    for (int p = p0; p < std::min<int>(tg, p0 + static_cast<int>(B)); ++p) {
      if (is4[p]) continue;
      const float sc = first_order_scale(range[p], kQmax2);
      ms = sc > ms ? sc : ms;
      mm = m[p] > mm ? m[p] : mm;
    }
    half_t* so = out.so + (r * d.blocks_per_row() + (c0 + p0) / B) * 2;
    so[0].bits = second_order_bits(ms, kS2);
    so[1].bits = second_order_bits(mm, kS2);
    if (fp16_not_finite(so[0].bits) || fp16_not_finite(so[1].bits)) return false;
  }
  float ms4 = 0.0f, mm4 = 0.0f;
  for (int p = 0; p < tg; ++p) {
    if (!is4[p]) continue;
    const float sc = first_order_scale(range[p], kQmax4);
    ms4 = sc > ms4 ? sc : ms4;
    mm4 = m[p] > mm4 ? m[p] : mm4;
  }
  half_t* so4 = out.so4 + (r * d.tiles_per_row() + t) * 2;
  so4[0].bits = second_order_bits(ms4, kS4);
  so4[1].bits = second_order_bits(mm4, kS4);
  if (fp16_not_finite(so4[0].bits) || fp16_not_finite(so4[1].bits)) return false;

  // 5. codes, scale codes, map
  const int64_t wpg = d.words_per_group();
  int64_t slot = r * d.n4_row() + d.tile_slot0(t);
  for (int p = 0; p < tg; ++p) {
    const int64_t c = c0 + p;
    const T* x = w + r * K + c * gs;
    uint32_t* hi = out.codes + (r * K + c * gs) / kCodes2PerWord;
    if (is4[p]) {
      const int sc = param_code(first_order_scale(range[p], kQmax4), fp16_bits_to_fp32(so4[0].bits), kS4);
      const int mc = param_code(m[p], fp16_bits_to_fp32(so4[1].bits), kS4);
      encode_split(x, gs, effective(so4[0].bits, sc), effective(so4[1].bits, mc), kQmax4, hi, out.lo + slot * wpg);
      out.scales[r * G + c] = static_cast<uint8_t>(sc);
      out.mc4[slot++] = static_cast<uint8_t>(mc);
    } else {
      const half_t* so = out.so + (r * d.blocks_per_row() + c / B) * 2;
      const int sc = param_code(first_order_scale(range[p], kQmax2), fp16_bits_to_fp32(so[0].bits), kS2);
      const int mc = param_code(m[p], fp16_bits_to_fp32(so[1].bits), kS2);
      encode_split(x, gs, effective(so[0].bits, sc), effective(so[1].bits, mc), kQmax2, hi, nullptr);
      out.scales[r * G + c] = static_cast<uint8_t>(sc | (mc << 4));
    }
  }
  // the tile's map words (a tile is 8 whole words, the last tile's last word padded with 0)
  for (int p0 = 0; p0 < tg; p0 += kMapBits) {
    uint32_t word = 0;
    for (int p = p0; p < std::min(tg, p0 + kMapBits); ++p) word |= static_cast<uint32_t>(is4[p]) << (p - p0);
    out.map[r * d.map_words() + (c0 + p0) / kMapBits] = word;
  }
  return true;
}

}  // namespace

template <class T>
void quantize_cpu(const T* w, const float* sens, const Dims& d, const Buffers& out) {
  check_dims(d);
  const int64_t nt = d.tiles_per_row(), tiles = d.rows * nt;
  std::atomic<bool> too_large{false};
  for_each_block(
      tiles,
      [&](int64_t i) {
        if (!quantize_tile(w, sens, d, out, i / nt, i % nt)) too_large.store(true, std::memory_order_relaxed);
      },
      4);
  if (too_large.load()) throw std::invalid_argument(kTooLargeMessage);
}

namespace {

// Whether every tile's map words mark its tile_n4 groups and no padding bit: what keeps every
// slot inside its tile's run of lo / mc4 (the same test as mixed2bit_tiled_cuda.cu's).
void check_map(const ConstBuffers& q, const Dims& d) {
  const int64_t words = d.map_words(), nt = d.tiles_per_row();
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t t = 0; t < nt; ++t)
      if (tile_map_count(q.map + r * words, d, t) != d.tile_n4(t))
        throw std::invalid_argument("mixed2bit tiled: a tile's map does not mark its n4 groups (n4_full / n4_last)");
}

// Rows [r0, r1) decoded to float32 [r1 - r0, K].
void decode_rows(const ConstBuffers& q, const Dims& d, int64_t r0, int64_t r1, float* y) {
  const int gs = static_cast<int>(d.group_size);
  const int64_t K = d.K, G = d.groups_per_row(), B = d.scale_block, wpg = d.words_per_group();
  for (int64_t r = r0; r < r1; ++r) {
    int64_t slot = r * d.n4_row();
    for (int64_t c = 0; c < G; ++c) {
      const bool is4 = (q.map[r * d.map_words() + c / kMapBits] >> (c % kMapBits)) & 1u;
      const uint8_t s = q.scales[r * G + c];
      float s_eff, m_eff;
      const uint32_t* hi = q.codes + (r * K + c * gs) / kCodes2PerWord;
      const uint32_t* lo = nullptr;
      if (is4) {
        const half_t* so4 = q.so4 + (r * d.tiles_per_row() + c / kTileGroups) * 2;
        s_eff = effective(so4[0].bits, s);
        m_eff = effective(so4[1].bits, q.mc4[slot]);
        lo = q.lo + slot * wpg;
        ++slot;
      } else {
        const half_t* so = q.so + (r * d.blocks_per_row() + c / B) * 2;
        s_eff = effective(so[0].bits, s & 15);
        m_eff = effective(so[1].bits, s >> 4);
      }
      float* out = y + (r - r0) * K + c * gs;
      for (int i = 0; i < gs; ++i) {
        const int sh = 2 * (i % kCodes2PerWord), wi = i / kCodes2PerWord;
        uint32_t code = (hi[wi] >> sh) & 3u;
        if (lo) code = (code << 2) | ((lo[wi] >> sh) & 3u);
        out[i] = dequantize_value(static_cast<int>(code), s_eff, m_eff);
      }
    }
  }
}

}  // namespace

template <class T>
void dequantize_cpu(const ConstBuffers& q, const Dims& d, T* y) {
  check_dims(d);
  check_map(q, d);
  const int64_t K = d.K;
  if (K == 0) return;
  parallel_for(d.rows, std::max<int64_t>(1, (int64_t(1) << 16) / K), [&](int64_t r0, int64_t r1) {
    std::vector<float> row(static_cast<size_t>(K));
    for (int64_t r = r0; r < r1; ++r) {
      decode_rows(q, d, r, r + 1, row.data());
      for (int64_t k = 0; k < K; ++k) from_f32(row[k], y + r * K + k);
    }
  });
}

void gemm_cpu(const float* X, int64_t N, const ConstBuffers& q, const Dims& d, float* Y) {
  check_dims(d);
  check_map(q, d);
  const gemm::Mixed2bitCpuKernels& k = gemm::mixed2bit_cpu_kernels();
  if (k.tiled_gemm_row && d.group_size == 16 && N >= 1 && N <= 4 && d.rows > 0 && d.K > 0) {
    // Few activation rows: each weight row multiplied as it is decoded in registers
    std::vector<float> xt, sx;
    const gemm::M2Act act = gemm::m2_act_gs16(X, N, d.K, xt, sx);
    gemm::fused_panels(
        d.rows, d.K, N,
        [&](int64_t m0, int64_t mr) {
          for (int64_t m = m0; m < m0 + mr; ++m) k.tiled_gemm_row(q, d, m, act, N, Y + m, d.rows);
        },
        /*slow=*/true);
    return;
  }
  gemm::weight_only_gemm_cpu(
      X, N, d.K, d.rows, [&](int64_t m0, int64_t m1, float* tile) { decode_rows(q, d, m0, m1, tile); }, Y);
}

#define QF_INSTANTIATE(T)                                                             \
  template void quantize_cpu<T>(const T*, const float*, const Dims&, const Buffers&); \
  template void dequantize_cpu<T>(const ConstBuffers&, const Dims&, T*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::mixed2bit::tiled
