// mixed2bit CPU kernels: the steps of mixed2bit.h on raw pointers. Per-group work is threaded
// with qf::for_each_block (groups are independent); the selections (steps 2 and 3) and the
// prefix counts are sequential, with one fixed total order, so the output never depends on the
// thread count.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "common/parallel.h"
#include "formats/mixed2bit/mixed2bit.h"
#include "gemm/weight_only_cpu.h"

namespace qf::mixed2bit {
namespace {

constexpr int64_t kGrainGroups = 1024;  // groups of >= 16 values: >= 64 KiB of fp32 per thread

struct GroupKey {
  uint32_t key;  // score_order_key(score)
  int64_t id;    // group id
};
// "a before b" in step 2: larger score first, then the smaller id.
bool group_before(const GroupKey& a, const GroupKey& b) { return a.key != b.key ? a.key > b.key : a.id < b.id; }

// Step 5 over one list (2-bit or 4-bit groups in id order): [d, dm] fp16 per block of B.
void second_order_list(const std::vector<int64_t>& list, const float* range, const float* m, int64_t B, int qmax, int S,
                       half_t* so) {
  const int64_t n = static_cast<int64_t>(list.size());
  const int64_t n_blocks = (n + B - 1) / B;
  for_each_block(n_blocks, [&](int64_t b) {
    uint16_t d, dm;
    second_order_block(list.data() + b * B, std::min(n, (b + 1) * B) - b * B, range, m, qmax, S, &d, &dm);
    so[2 * b].bits = d;
    so[2 * b + 1].bits = dm;
  });
}

bool any_not_finite(const half_t* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (fp16_not_finite(h[i].bits)) return true;
  return false;
}

}  // namespace

template <class T>
void quantize_cpu(const T* w, const float* sens, const Dims& dims, const Buffers& out) {
  check_dims(dims);
  const int gs = static_cast<int>(dims.group_size);
  const int64_t G = dims.groups_per_row(), ng = dims.n_groups(), n4 = dims.n4, n_out = dims.n_out;
  const int64_t B = dims.scale_block;

  // 1. Scores.
  std::vector<float> score(static_cast<size_t>(ng));
  for_each_block(
      ng,
      [&](int64_t g) {
        const T* x = w + g * gs;
        score[g] = sens ? sensitivity_score(x, sens + (g % G) * gs, gs) : range_score(x, gs);
      },
      kGrainGroups);
  for (float s : score)
    if (s != s) throw std::invalid_argument(kTooLargeMessage);  // 0 * inf: |w| ~ 1e19 or more

  // 2. The n4 largest scores (ties: smaller id) are 4-bit. nth_element puts exactly the first
  // n4 groups of the total order in front; which of them is where does not matter.
  std::vector<uint8_t> is4(static_cast<size_t>(ng), 0);
  if (n4 == ng) {
    std::fill(is4.begin(), is4.end(), uint8_t(1));
  } else if (n4 > 0) {
    std::vector<GroupKey> keys(static_cast<size_t>(ng));
    for (int64_t g = 0; g < ng; ++g) keys[g] = {score_order_key(score[g]), g};
    std::nth_element(keys.begin(), keys.begin() + n4, keys.end(), group_before);
    for (int64_t i = 0; i < n4; ++i) is4[keys[i].id] = 1;
  }

  // 3. Outliers: the n_out elements of 2-bit groups with the largest |w|, ties to the smaller
  // flat index. One 64-bit key per candidate: |w|'s bits (sign cleared; for non-NaN floats
  // the unsigned order of these bits is the order of |w|) above the complement of the index
  // (so that a smaller index is a larger key); the n_out largest keys are the outliers.
  std::vector<int32_t> oidx(static_cast<size_t>(n_out));
  if (n_out > 0) {
    std::vector<uint64_t> cand;
    cand.reserve(static_cast<size_t>(dims.n2() * gs));
    for (int64_t g = 0; g < ng; ++g) {
      if (is4[g]) continue;
      for (int64_t i = g * gs; i < (g + 1) * gs; ++i) {
        const uint32_t abs_bits = f32_bits(to_f32(w[i])) & 0x7FFFFFFFu;
        cand.push_back(uint64_t(abs_bits) << 32 | uint64_t(0xFFFFFFFFu - static_cast<uint32_t>(i)));
      }
    }
    if (n_out < static_cast<int64_t>(cand.size()))
      std::nth_element(cand.begin(), cand.begin() + n_out, cand.end(), std::greater<uint64_t>());
    for (int64_t i = 0; i < n_out; ++i)
      oidx[i] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(cand[i] & 0xFFFFFFFFu));
    std::sort(oidx.begin(), oidx.end());
  }
  for (int64_t i = 0; i < n_out; ++i) {
    out.outlier_idx[i] = oidx[i];
    out.outlier_val[i].bits = fp32_to_fp16_bits(to_f32(w[oidx[i]]));
  }

  // 4. First-order range and m per group, outliers left out (they are a contiguous run of the
  // sorted index list: groups are contiguous in flat order); scale = range / qmax.
  std::vector<float> range(static_cast<size_t>(ng)), m(static_cast<size_t>(ng));
  for_each_block(
      ng,
      [&](int64_t g) {
        const int64_t base = g * gs;
        const int32_t* const o_begin = oidx.data();
        const int32_t* const o_end = o_begin + n_out;
        const int32_t* o0 = o_begin;
        int64_t n_in = 0;
        if (n_out > 0) {
          o0 = std::lower_bound(o_begin, o_end, base);
          n_in = std::lower_bound(o0, o_end, base + gs) - o0;
        }
        group_range_m(w + base, gs, o0, n_in, base, &range[g], &m[g]);
      },
      kGrainGroups);

  // 5. The two lists in id order, each group's slot in its list, and the second order.
  std::vector<int64_t> list2, list4, slot(static_cast<size_t>(ng));
  list2.reserve(static_cast<size_t>(dims.n2()));
  list4.reserve(static_cast<size_t>(n4));
  for (int64_t g = 0; g < ng; ++g) {
    std::vector<int64_t>& list = is4[g] ? list4 : list2;
    slot[g] = static_cast<int64_t>(list.size());
    list.push_back(g);
  }
  second_order_list(list2, range.data(), m.data(), B, kQmax2, kS2, out.so2);
  second_order_list(list4, range.data(), m.data(), B, kQmax4, kS4, out.so4);
  if (any_not_finite(out.so2, 2 * dims.blocks2()) || any_not_finite(out.so4, 2 * dims.blocks4()) ||
      any_not_finite(out.outlier_val, n_out))
    throw std::invalid_argument(kTooLargeMessage);

  // 5 + 6. Second-order codes, then the element codes with the effective parameters.
  const int64_t w2 = dims.words2(), w4 = dims.words4();
  for_each_block(
      ng,
      [&](int64_t g) {
        const int64_t j = slot[g], b = j / B;
        const T* x = w + g * gs;
        int sc, mc;
        if (is4[g]) {
          quantize_group<4>(x, gs, range[g], m[g], out.so4[2 * b].bits, out.so4[2 * b + 1].bits, &sc, &mc,
                            out.codes4 + j * w4);
          out.scales4[2 * j] = static_cast<uint8_t>(sc);
          out.scales4[2 * j + 1] = static_cast<uint8_t>(mc);
        } else {
          quantize_group<2>(x, gs, range[g], m[g], out.so2[2 * b].bits, out.so2[2 * b + 1].bits, &sc, &mc,
                            out.codes2 + j * w2);
          out.scales2[j] = static_cast<uint8_t>(sc | mc << 4);
        }
      },
      kGrainGroups);

  // 7. The group map, LSB first, padding bits 0.
  for (int64_t i = 0; i < dims.map_bytes(); ++i) {
    uint8_t byte = 0;
    for (int bit = 0; bit < 8; ++bit) {
      const int64_t g = 8 * i + bit;
      if (g < ng && is4[g]) byte = static_cast<uint8_t>(byte | (1u << bit));
    }
    out.group_map[i] = byte;
  }
}

RowIndex build_row_index(const ConstBuffers& q, const Dims& dims) {
  check_dims(dims);
  const int64_t rows = dims.rows, G = dims.groups_per_row(), K = dims.K, n_out = dims.n_out;
  RowIndex ix;
  ix.n4_before.resize(static_cast<size_t>(rows + 1));
  ix.out_before.resize(static_cast<size_t>(rows + 1));
  int64_t c4 = 0;
  for (int64_t r = 0; r < rows; ++r) {
    ix.n4_before[r] = c4;
    for (int64_t g = r * G; g < (r + 1) * G; ++g) c4 += (q.group_map[g >> 3] >> (g & 7)) & 1;
  }
  ix.n4_before[rows] = c4;
  if (c4 != dims.n4) throw std::invalid_argument("mixed2bit: group_map does not mark n4 groups");
  const int64_t numel = rows * K;
  int64_t prev = -1;
  for (int64_t i = 0; i < n_out; ++i) {
    const int64_t idx = q.outlier_idx[i];
    if (idx <= prev || idx >= numel)
      throw std::invalid_argument("mixed2bit: outlier_idx must be strictly increasing and < rows * K");
    prev = idx;
  }
  int64_t o = 0;
  for (int64_t r = 0; r <= rows; ++r) {
    while (o < n_out && q.outlier_idx[o] < r * K) ++o;
    ix.out_before[r] = o;
  }
  return ix;
}

void decode_rows_cpu(const ConstBuffers& q, const Dims& dims, const RowIndex& ix, int64_t r0, int64_t r1, float* y) {
  const int gs = static_cast<int>(dims.group_size);
  const int64_t G = dims.groups_per_row(), K = dims.K, B = dims.scale_block;
  const int64_t w2 = dims.words2(), w4 = dims.words4();
  for (int64_t r = r0; r < r1; ++r) {
    float* yr = y + (r - r0) * K;
    int64_t i4 = ix.n4_before[r], i2 = r * G - i4;  // this row's first slots in each list
    for (int64_t c = 0; c < G; ++c) {
      const int64_t g = r * G + c;
      float s_eff, m_eff;
      if ((q.group_map[g >> 3] >> (g & 7)) & 1) {
        group_params(q, true, i4, B, &s_eff, &m_eff);
        decode_group<4>(q.codes4 + i4 * w4, gs, s_eff, m_eff, yr + c * gs);
        ++i4;
      } else {
        group_params(q, false, i2, B, &s_eff, &m_eff);
        decode_group<2>(q.codes2 + i2 * w2, gs, s_eff, m_eff, yr + c * gs);
        ++i2;
      }
    }
    for (int64_t o = ix.out_before[r]; o < ix.out_before[r + 1]; ++o)
      yr[q.outlier_idx[o] - r * K] = fp16_bits_to_fp32(q.outlier_val[o].bits);
  }
}

template <class T>
void dequantize_cpu(const ConstBuffers& q, const Dims& dims, T* y) {
  const RowIndex ix = build_row_index(q, dims);
  const int64_t K = dims.K;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
  parallel_for(dims.rows, grain, [&](int64_t r0, int64_t r1) {
    if constexpr (std::is_same_v<T, float>) {
      decode_rows_cpu(q, dims, ix, r0, r1, y + r0 * K);
    } else {  // a row at a time in float32, then rounded once to T
      std::vector<float> row(static_cast<size_t>(K));
      for (int64_t r = r0; r < r1; ++r) {
        decode_rows_cpu(q, dims, ix, r, r + 1, row.data());
        for (int64_t k = 0; k < K; ++k) from_f32(row[k], y + r * K + k);
      }
    }
  });
}

void gemm_cpu(const float* X, int64_t N, const ConstBuffers& q, const Dims& dims, float* Y) {
  const RowIndex ix = build_row_index(q, dims);  // once per call, shared by every tile
  gemm::weight_only_gemm_cpu(
      X, N, dims.K, dims.rows, [&](int64_t m0, int64_t m1, float* tile) { decode_rows_cpu(q, dims, ix, m0, m1, tile); },
      Y);
}

void pack_2bit_cpu(const uint8_t* values, int64_t n_words, uint32_t* out) {
  for_each_block(
      n_words,
      [&](int64_t w) {
        uint32_t word = 0;
        for (int i = 0; i < kCodes2PerWord; ++i)
          word |= static_cast<uint32_t>(values[w * kCodes2PerWord + i] & 3u) << (2 * i);
        out[w] = word;
      },
      kGrainGroups);
}

void unpack_2bit_cpu(const uint32_t* packed, int64_t n, uint8_t* out) {
  for_each_block(
      n,
      [&](int64_t i) {
        out[i] = static_cast<uint8_t>((packed[i / kCodes2PerWord] >> (2 * (i % kCodes2PerWord))) & 3u);
      },
      1 << 16);
}

#define QF_INSTANTIATE(T)                                                             \
  template void quantize_cpu<T>(const T*, const float*, const Dims&, const Buffers&); \
  template void dequantize_cpu<T>(const ConstBuffers&, const Dims&, T*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::mixed2bit
