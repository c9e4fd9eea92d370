#include "formats/nf4/nf4.h"

#include <algorithm>
#include <array>
#include <limits>

#include "common/parallel.h"

namespace qf::nf4 {

template <class T>
void quantize_cpu(const T* x, int64_t n, int64_t blocksize, uint8_t* packed, float* absmax) {
  const int64_t n_blocks = (n + blocksize - 1) / blocksize;
  // Grain in blocks: about 32 K values per thread at least, whatever the blocksize.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / blocksize);
  for_each_block(
      n_blocks,
      [&](int64_t b) {
        uint8_t q[kMaxBlocksize];
        const int64_t s = b * blocksize, len = std::min(blocksize, n - s);
        absmax[b] = quantize_block(x + s, len, len == blocksize, q);
        // blocksize is even, so every block starts on a byte boundary: blocks own disjoint bytes.
        uint8_t* out = packed + s / 2;
        int64_t i = 0;
        for (; i + 1 < len; i += 2) out[i / 2] = static_cast<uint8_t>(q[i] << 4 | q[i + 1]);
        if (i < len) out[i / 2] = static_cast<uint8_t>(q[i] << 4 | kPadCode);  // odd n: pad with 7
      },
      grain);
}

void dequantize_range(const uint8_t* packed, const float* absmax, int64_t i0, int64_t i1, int64_t blocksize,
                      float* y) {
  // Walk block by block so that the scale is loaded once per block, not per element.
  int64_t i = i0;
  while (i < i1) {
    const int64_t b = i / blocksize;
    const int64_t e = std::min(i1, (b + 1) * blocksize);
    const float a = absmax[b];
    for (; i < e; ++i) {
      const uint8_t byte = packed[i >> 1];
      const uint8_t code = (i & 1) ? (byte & 0x0F) : (byte >> 4);  // even element: high nibble
      y[i - i0] = dequantize_value(code, a);
    }
  }
}

void dequantize_cpu(const uint8_t* packed, const float* absmax, int64_t n, int64_t blocksize, float* y) {
  const int64_t n_blocks = (n + blocksize - 1) / blocksize;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / blocksize);
  for_each_block(
      n_blocks,
      [&](int64_t b) {
        const int64_t s = b * blocksize, e = std::min(n, s + blocksize);
        dequantize_range(packed, absmax, s, e, blocksize, y + s);
      },
      grain);
}

// torch's float32 Tensor.sum on the CPU (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum ->
// vectorized_inner_sum -> row_sum -> multi_row_sum), for a contiguous 1-D tensor reduced on one
// thread, as built for x86-64 (the sum kernel is an AVX2 kernel even on AVX-512 machines:
// Vectorized<float> has W = 8 lanes). Reproduced operation by operation:
//   * n >= W: the first n/W*W values are W-lane vectors v[0..nv). Vectors are read four at a time
//     ("ilp" rows k = 0..3: vector 4i+k goes to accumulator k) for i < nv/4, with a cascade of
//     4 levels: level 0 adds `step` = 2^max(4, ceil_log2(nv/4)/4) consecutive groups, then is
//     added into level 1 and cleared; level 1 is carried into level 2 every step^2 groups, level 2
//     into level 3 every step^3. Leftover groups go to level 0; then acc0 += acc1, += acc2, += acc3
//     (per lane, per ilp row). Leftover vectors (nv % 4) are added to ilp row 0, then rows 1, 2, 3
//     are added to row 0. The scalar result starts at 0, adds the n % W tail values in order, then
//     the W lanes of row 0 in lane order.
//   * n < W: the same with scalars instead of vectors (row_sum on scalars, 4 ilp accumulators).
//   * The output starts at 0 and the result is added to it (0 + s).
// Each "+" is one float32 addition; the order above is the whole specification.
namespace {

constexpr int kLanes = 8;
using Vec = std::array<float, kLanes>;

inline void add_to(Vec& a, const Vec& b) {
  for (int l = 0; l < kLanes; ++l) a[l] = a[l] + b[l];
}

inline int64_t ceil_log2(int64_t x) {  // c10 / ATen utils::CeilLog2
  if (x <= 2) return 1;
  int64_t r = 0;
  uint64_t v = static_cast<uint64_t>(x - 1);
  while (v) { ++r; v >>= 1; }
  return r;
}

// multi_row_sum with nrows = 4 over `groups` groups of 4 elements (element (i, k) = load(4i + k)).
template <class Acc, class Load>
std::array<Acc, 4> multi_row_sum(int64_t groups, Load&& load, const Acc& zero) {
  constexpr int kLevels = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(groups) / kLevels);
  const int64_t level_step = int64_t(1) << level_power;
  const int64_t level_mask = level_step - 1;
  Acc acc[kLevels][4];
  for (auto& lv : acc)
    for (auto& a : lv) a = zero;
  int64_t i = 0;
  while (i + level_step <= groups) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k) add_to(acc[0][k], load(4 * i + k));
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k) {
        add_to(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = zero;
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < groups; ++i)
    for (int k = 0; k < 4; ++k) add_to(acc[0][k], load(4 * i + k));
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k) add_to(acc[0][k], acc[j][k]);
  return {acc[0][0], acc[0][1], acc[0][2], acc[0][3]};
}

// row_sum: ilp partial sums, then the leftovers into row 0, then rows 1..3 into row 0.
template <class Acc, class Load>
Acc row_sum(int64_t size, Load&& load, const Acc& zero) {
  const int64_t groups = size / 4;
  auto ps = multi_row_sum<Acc>(groups, load, zero);
  for (int64_t i = groups * 4; i < size; ++i) add_to(ps[0], load(i));
  for (int k = 1; k < 4; ++k) add_to(ps[0], ps[k]);
  return ps[0];
}

struct Scalar {  // a one-lane "vector" so that the same templates serve the n < W path
  float v;
};
inline void add_to(Scalar& a, const Scalar& b) { a.v = a.v + b.v; }

}  // namespace

float mean_torch_order(const float* x, int64_t n) {
  if (n == 0) return f32_from_bits(0xFFC00000u);  // torch: 0 / 0 on x86 = the default NaN, sign set
  float sum;
  if (n < kLanes) {
    sum = row_sum<Scalar>(n, [&](int64_t i) { return Scalar{x[i]}; }, Scalar{0.0f}).v;
  } else {
    const int64_t nv = n / kLanes;
    const Vec row = row_sum<Vec>(
        nv,
        [&](int64_t i) {
          Vec v;
          for (int l = 0; l < kLanes; ++l) v[l] = x[i * kLanes + l];
          return v;
        },
        Vec{});
    sum = 0.0f;
    for (int64_t k = nv * kLanes; k < n; ++k) sum = sum + x[k];
    for (int l = 0; l < kLanes; ++l) sum = sum + row[l];
  }
  sum = 0.0f + sum;                         // the output tensor starts at 0 and accumulates
  return sum / static_cast<float>(n);       // Tensor.mean on the CPU: sum, then div_(numel)
}

void double_quant_cpu(const float* absmax, int64_t n_blocks, uint8_t* q, float* absmax2, float* offset) {
  const float off = mean_torch_order(absmax, n_blocks);
  *offset = off;
  const int64_t n2 = (n_blocks + kDoubleQuantBlock - 1) / kDoubleQuantBlock;
  for_each_block(
      n2,
      [&](int64_t b) {
        float d[kDoubleQuantBlock];
        const int64_t s = b * kDoubleQuantBlock, len = std::min<int64_t>(kDoubleQuantBlock, n_blocks - s);
        for (int64_t i = 0; i < len; ++i) d[i] = absmax[s + i] - off;  // float32 subtraction
        absmax2[b] = double_quant_block(d, len, q + s);
      },
      128);
}

void dequantize_absmax_cpu(const uint8_t* q, const float* absmax2, float offset, int64_t n_blocks, float* absmax) {
  const int64_t n2 = (n_blocks + kDoubleQuantBlock - 1) / kDoubleQuantBlock;
  for_each_block(
      n2,
      [&](int64_t b) {
        const int64_t s = b * kDoubleQuantBlock, e = std::min<int64_t>(n_blocks, s + kDoubleQuantBlock);
        for (int64_t i = s; i < e; ++i) absmax[i] = dequantize_absmax_value(q[i], absmax2[b], offset);
      },
      128);
}

#define QF_INSTANTIATE(T) template void quantize_cpu<T>(const T*, int64_t, int64_t, uint8_t*, float*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::nf4
