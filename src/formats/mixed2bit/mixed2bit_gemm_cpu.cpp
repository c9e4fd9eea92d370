#include "formats/mixed2bit/mixed2bit_gemm_cpu.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "common/fp16.h"
#include "common/thread_pool.h"
#include "gemm/weight_only_cpu.h"

namespace qf::gemm {

namespace {

bool map_bit(const uint8_t* map, int64_t g) { return (map[g >> 3] >> (g & 7)) & 1; }

// Set bits per byte (no POPCNT instruction needed: the generic x86-64 target lacks it).
struct PopTable {
  uint8_t v[256];
  constexpr PopTable() : v() {
    for (int i = 0; i < 256; ++i)
      v[i] = static_cast<uint8_t>((i & 1) + ((i >> 1) & 1) + ((i >> 2) & 1) + ((i >> 3) & 1) + ((i >> 4) & 1) +
                                  ((i >> 5) & 1) + ((i >> 6) & 1) + ((i >> 7) & 1));
  }
};
constexpr PopTable kPop;

// Set bits of the group map in [g0, g1).
int64_t count_bits(const uint8_t* map, int64_t g0, int64_t g1) {
  int64_t n = 0, g = g0;
  for (; g < g1 && (g & 7); ++g) n += map_bit(map, g);
  for (; g + 8 <= g1; g += 8) n += kPop.v[map[g >> 3]];
  for (; g < g1; ++g) n += map_bit(map, g);
  return n;
}

}  // namespace

void mixed2bit_row_index(const mixed2bit::ConstBuffers& q, const mixed2bit::Dims& dims, int64_t* n4_before,
                         int64_t* out_before) {
  mixed2bit::check_dims(dims);
  const int64_t rows = dims.rows, G = dims.groups_per_row(), K = dims.K, n_out = dims.n_out;
  int64_t c4 = 0;
  for (int64_t r = 0; r < rows; ++r) {
    n4_before[r] = c4;
    c4 += count_bits(q.group_map, r * G, (r + 1) * G);
  }
  n4_before[rows] = c4;
  if (c4 != dims.n4) throw std::invalid_argument("mixed2bit: group_map does not mark n4 groups");
  int64_t prev = -1;
  for (int64_t i = 0; i < n_out; ++i) {
    const int64_t idx = q.outlier_idx[i];
    if (idx <= prev || idx >= rows * K)
      throw std::invalid_argument("mixed2bit: outlier_idx must be strictly increasing and < rows * K");
    prev = idx;
  }
  int64_t o = 0;
  for (int64_t r = 0; r <= rows; ++r) {
    while (o < n_out && q.outlier_idx[o] < r * K) ++o;
    out_before[r] = o;
  }
}

namespace {

// The two fp16 fields [d, dm] of second-order block b as floats (out of the hot loop: a block
// changes every B groups of its list).
__attribute__((noinline)) void block_fields(const half_t* so, int64_t b, float* d, float* dm) {
  *d = fp16_bits_to_fp32(so[2 * b].bits);
  *dm = fp16_bits_to_fp32(so[2 * b + 1].bits);
}

// Descriptors of the n groups g0 .. g0 + n - 1 of one row (g0 = m G + c0), whose slots in the
// 4-bit and 2-bit lists start at j4 and j2. Each list's second-order block is followed with a
// counter (no division); its fields are read when the block is first used (the block after a
// list's last slot does not exist). Prefetches each group's code words, which the decoder reads
// right after (the descriptors of a whole tile are built first).
void m2_descriptors(const mixed2bit::ConstBuffers& q, int64_t B, int64_t w2, int64_t w4, int64_t g0, int64_t n,
                    int64_t j4, int64_t j2, M2Group* out) {
  const uint8_t* const map = q.group_map;
  const uint8_t* const scales2 = q.scales2;
  const uint8_t* const scales4 = q.scales4;
  const uint32_t* const codes2 = q.codes2;
  const uint32_t* const codes4 = q.codes4;
  int64_t b4 = j4 / B, r4 = j4 % B, b2 = j2 / B, r2 = j2 % B, loaded4 = -1, loaded2 = -1;
  float d4 = 0, dm4 = 0, d2 = 0, dm2 = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t g = g0 + t;
    M2Group& o = out[t];
    if ((map[g >> 3] >> (g & 7)) & 1) {
      if (b4 != loaded4) {
        block_fields(q.so4, b4, &d4, &dm4);
        loaded4 = b4;
      }
      o.words = codes4 + j4 * w4;
      o.s = d4 * static_cast<float>(scales4[2 * j4]);  // mixed2bit's effective(): fp16 field * code
      o.m = dm4 * static_cast<float>(scales4[2 * j4 + 1]);
      o.is4 = 1;
      ++j4;
      if (++r4 == B) {
        r4 = 0;
        ++b4;
      }
    } else {
      if (b2 != loaded2) {
        block_fields(q.so2, b2, &d2, &dm2);
        loaded2 = b2;
      }
      const uint8_t c = scales2[j2];
      o.words = codes2 + j2 * w2;
      o.s = d2 * static_cast<float>(c & 0x0F);
      o.m = dm2 * static_cast<float>(c >> 4);
      o.is4 = 0;
      ++j2;
      if (++r2 == B) {
        r2 = 0;
        ++b2;
      }
    }
    __builtin_prefetch(o.words);
  }
}

}  // namespace

namespace {
// Values per tile of the tiled product: whole groups.
int64_t m2_tile(const mixed2bit::Dims& d) { return d.group_size * std::max<int64_t>(1, kTileK / d.group_size); }
}  // namespace

Mixed2bitCpuIndex mixed2bit_cpu_index(const mixed2bit::ConstBuffers& q, const mixed2bit::Dims& dims) {
  std::vector<int64_t> n4_before(static_cast<size_t>(dims.rows + 1));
  Mixed2bitCpuIndex index;
  index.out_before.resize(static_cast<size_t>(dims.rows + 1));
  mixed2bit_row_index(q, dims, n4_before.data(), index.out_before.data());
  const int64_t K = dims.K, gs = dims.group_size, G = dims.groups_per_row(), kc = m2_tile(dims);
  // 4-bit groups before each tile of each row (the slot of the tile's first 4-bit group).
  // (K / kc rounded up without K + kc - 1: the index is built for any weight, an empty one with
  // a K that no array bounds included)
  const int64_t n_win = K / kc + (K % kc != 0), gw = kc / gs;
  index.win4.resize(static_cast<size_t>(dims.rows * n_win));
  parallel_chunks(dims.rows, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int64_t c4 = n4_before[r];
      for (int64_t t = 0; t < n_win; ++t) {
        index.win4[r * n_win + t] = c4;
        c4 += count_bits(q.group_map, r * G + t * gw, r * G + std::min(G, (t + 1) * gw));
      }
    }
  });
  return index;
}

M2Act m2_act_gs16(const float* X, int64_t N, int64_t K, std::vector<float>& xt, std::vector<float>& sx) {
  const int64_t G = K / 16, steps = (G + 7) / 8;
  xt.assign(static_cast<size_t>(N * steps * 128), 0.0f);
  sx.assign(static_cast<size_t>(N * steps * 8), 0.0f);
  for (int64_t j = 0; j < N; ++j)
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.0f;
      for (int64_t i = 0; i < 16; ++i) {
        const float v = X[j * K + g * 16 + i];
        xt[j * steps * 128 + (g / 8) * 128 + i * 8 + g % 8] = v;
        sum += v;
      }
      sx[j * steps * 8 + g] = sum;
    }
  return {X, K, xt.data(), sx.data(), steps * 128, steps * 8};
}

void mixed2bit_gemm_cpu(const float* X, int64_t N, const mixed2bit::ConstBuffers& q, const mixed2bit::Dims& dims,
                        float* Y) {
  mixed2bit_gemm_cpu(X, N, q, dims, mixed2bit_cpu_index(q, dims), Y);
}

void mixed2bit_gemm_cpu(const float* X, int64_t N, const mixed2bit::ConstBuffers& q, const mixed2bit::Dims& dims,
                        const Mixed2bitCpuIndex& index, float* Y) {
  const CpuKernels& kern = cpu_kernels();
  const Mixed2bitCpuKernels& m2k = mixed2bit_cpu_kernels();
  const int64_t K = dims.K, gs = dims.group_size, G = dims.groups_per_row(), B = dims.scale_block;
  const int64_t w2 = dims.words2(), w4 = dims.words4();
  const int64_t kc = m2_tile(dims), n_win = K / kc + (K % kc != 0);  // as mixed2bit_cpu_index
  const int64_t* const win4 = index.win4.data();
  const int64_t* const out_before = index.out_before.data();
  const bool vector_window = m2k.decode_window && dims.n2() * w2 < (int64_t(1) << 31) &&
                             dims.n4 * w4 < (int64_t(1) << 31) && dims.n_groups() < (int64_t(1) << 31);
  if (vector_window && m2k.gemm_row && N >= 1 && N <= 4 && dims.rows > 0 && K > 0) {
    // Few activation rows: each weight row decoded in registers and multiplied right away; a
    // row with outliers is decoded whole, patched, then multiplied.
    std::vector<float> xt, sx;
    // gs = 16: x arranged for the lanes-across-groups kernel
    const M2Act act = gs == 16 ? m2_act_gs16(X, N, K, xt, sx) : M2Act{X, K, nullptr, nullptr, 0, 0};
    fused_panels(
        dims.rows, K, N,
        [&](int64_t m0, int64_t mr) {
          thread_local std::vector<float> row;
          float acc[4 * kPanelRows];
          for (int64_t m = m0; m < m0 + mr; ++m) {
            const int64_t j4 = win4[m * n_win];
            const M2Window w{&q, gs, B, m * G, G, j4, m * G - j4, dims.n4, dims.n2()};
            if (out_before[m + 1] == out_before[m]) {
              m2k.gemm_row(w, act, N, Y + m, dims.rows);
              continue;
            }
            row.resize(static_cast<size_t>(K));
            m2k.decode_window(w, row.data());
            for (int64_t o = out_before[m]; o < out_before[m + 1]; ++o)
              row[q.outlier_idx[o] - m * K] = fp16_bits_to_fp32(q.outlier_val[o].bits);
            kern.f32_panel(X, K, N, row.data(), K, 1, K, acc, false);
            for (int64_t j = 0; j < N; ++j) Y[j * dims.rows + m] = acc[j * kPanelRows];
          }
        },
        /*slow=*/true);
    return;
  }
  weight_only_gemm_tiles(
      X, N, K, dims.rows, kc,
      [&](int64_t m0, int64_t m1, int64_t k0, int64_t k1, float* tile) {
        const int64_t len = k1 - k0, c0 = k0 / gs, ng = k1 / gs - c0;
        if (vector_window) {  // 16 groups' parameters at a time, in vector registers
          for (int64_t m = m0; m < m1; ++m) {
            const int64_t j4 = win4[m * n_win + k0 / kc];
            m2k.decode_window({&q, gs, B, m * G + c0, ng, j4, m * G + c0 - j4, dims.n4, dims.n2()},
                              tile + (m - m0) * len);
          }
        } else {  // per-group descriptors, then the decoder
          thread_local std::vector<M2Group> groups;
          groups.resize(static_cast<size_t>(kPanelRows * ng));
          for (int64_t m = m0; m < m1; ++m) {  // this row's slots in the two lists at group c0
            const int64_t j4 = win4[m * n_win + k0 / kc];
            m2_descriptors(q, B, w2, w4, m * G + c0, ng, j4, m * G + c0 - j4, groups.data() + (m - m0) * ng);
          }
          for (int64_t m = m0; m < m1; ++m) m2k.decode(groups.data() + (m - m0) * ng, ng, gs, tile + (m - m0) * len);
        }
        for (int64_t m = m0; m < m1; ++m) {
          float* row = tile + (m - m0) * len;
          // Outliers of this row inside [k0, k1) replace their decoded values.
          const int32_t* ob = q.outlier_idx + out_before[m];
          const int32_t* oe = q.outlier_idx + out_before[m + 1];
          for (const int32_t* o = std::lower_bound(ob, oe, m * K + k0); o < oe && *o < m * K + k1; ++o)
            if (*o >= m * K + k0)  // always, for the buffers the index was made from
              row[*o - m * K - k0] = fp16_bits_to_fp32(q.outlier_val[o - q.outlier_idx].bits);
        }
      },
      Y);
}

const Mixed2bitCpuKernels& mixed2bit_cpu_kernels() {
#if QF_GEMM_X86
  switch (active_isa()) {
    case Isa::avx512:
      return k_avx512::mixed2bit_kernels();
    case Isa::avx2:
      return k_avx2::mixed2bit_kernels();
    default:
      break;
  }
#endif
  return k_scalar::mixed2bit_kernels();
}

// Plain C++: the portable fallback and the reference the vector versions are tested against.
namespace k_scalar {
namespace {

void decode_m2(const M2Group* groups, int64_t n, int64_t gs, float* out) {
  for (int64_t g = 0; g < n; ++g) {
    const M2Group& G = groups[g];
    float* y = out + g * gs;
    const int bits = G.is4 ? 4 : 2, per_word = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    for (int64_t i = 0; i < gs; ++i) {
      const uint32_t q = (G.words[i / per_word] >> (bits * (i % per_word))) & mask;
      const float p = static_cast<float>(q) * G.s;  // two roundings, as mixed2bit's decode
      y[i] = p - G.m;
    }
  }
}

}  // namespace

const Mixed2bitCpuKernels& mixed2bit_kernels() {
  static const Mixed2bitCpuKernels k{decode_m2, nullptr, nullptr, nullptr};
  return k;
}

}  // namespace k_scalar

}  // namespace qf::gemm
