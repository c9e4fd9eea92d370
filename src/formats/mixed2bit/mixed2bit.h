// mixed2bit pack spec: intra-matrix mixed 2/4-bit weights with second-order (quantized)
// scales and optional fp16 sparse outliers, after Jin et al., "Fast and Efficient 2-bit LLM
// Inference on GPU: 2/4/16-bit in a Weight Matrix with Asynchronous Dequantization"
// (arXiv 2311.16442): a few "sensitive" groups of a weight matrix get 4 bits, the rest 2 bits,
// the 2-bit groups' scales are themselves quantized, and rare outliers stay 16-bit.
//
// Parameters: group_size (gs, a multiple of 16 dividing K; default 16), ratio_4bit (0..1;
// default 0.1), sensitivity (optional float32 [K], finite, >= 0, not stored), outlier_ratio
// (0..1; default 0), scale_block (>= 1; groups per second-order block; default 16).
//
// A weight W [rows, K] is cut into groups of gs consecutive values along K:
//   G = K / gs groups per row, group id g = r * G + c (row-major), n_groups = rows * G.
// Group g covers the flat elements [g * gs, (g + 1) * gs) of W (flat index = r * K + k), so
// groups are contiguous and ordered by id in memory.
//
// Quantization (all arithmetic float32, one rounding per operation, no FMA):
// 1. Score per group: by range: max(v) - min(v); with a sensitivity: s = 0, then for k in
//    group order s = s + sens[k] * (w * w). Values are read with -0 as +0 (v + 0.0f; see
//    read_pos_zero), so scores are >= +0 and never -0. A NaN score (0 * inf: only when |w|
//    is so large that w * w overflows, which overflows the fp16 parameters anyway) raises the
//    "too large" error of step 5.
// 2. n4 = floor(ratio_4bit * n_groups + 0.5) (float64). The n4 groups with the largest score
//    are 4-bit; ties go to the smaller group id (a total order: sort by (-score, id)).
//    The other n2 = n_groups - n4 groups are 2-bit.
// 3. Outliers (only if outlier_ratio > 0): among the n2 * gs elements of 2-bit groups,
//    n_out = floor(outlier_ratio * n2 * gs + 0.5) with the largest |w| (ties: the smaller flat
//    index first). Stored sorted by flat index: outlier_idx int32 (so rows * K must be
//    < 2^31 when n_out > 0), outlier_val fp16 (RNE). Outliers are left out of their group's
//    min/max below.
// 4. First order, qmax = 3 (2-bit) or 15 (4-bit), over the group's non-outlier values v
//    (read with -0 as +0); a group with none left has lo = hi = 0:
//      lo = min(min(v), 0);  hi = max(v);  scale = (hi - lo) / qmax;  m = 0 - lo  (>= +0)
// 5. Second order: the 2-bit groups in id order form one list, the 4-bit groups another; each
//    list is cut into blocks of scale_block consecutive groups (the last one may be partial).
//    Per block, S = 15 (2-bit groups: 4-bit scale codes) or 255 (4-bit groups: 8-bit codes):
//      d = max(scale_i) / S,  dm = max(m_i) / S,  stored fp16 (RNE); d16, dm16 their values.
//    If any stored fp16 (d, dm or an outlier value) is inf, quantization raises ValueError
//    (message "values too large for mixed2bit's fp16 second-order scales ...").
//      sc_i = d16 > 0 ? clamp(rint(scale_i / d16), 0, S) : 0
//      mc_i = dm16 > 0 ? clamp(rint(m_i / dm16), 0, S) : 0        (rint: half to even)
// 6. s_eff = d16 * sc, m_eff = dm16 * mc. Codes, per element x of the group (outliers too):
//      q = s_eff > 0 ? clamp(rint((x + m_eff) / s_eff), 0, qmax) : 0
//    Dequantize: x' = q * s_eff - m_eff (two roundings); outliers then overwrite their
//    positions with float(outlier_val).
//
// Buffers (all C-contiguous; n2 = n_groups - n4; B = scale_block):
//
//   group_map   uint8   [ceil(n_groups / 8)]   bit g % 8 of byte g / 8 (LSB first) = 1 if
//                                             group g is 4-bit; padding bits 0
//   codes2      int32   [n2, gs / 16]           2-bit groups in id order; value i of a group in
//                                             word i / 16, bits 2(i%16)..2(i%16)+1
//   codes4      int32   [n4, gs / 8]            4-bit groups; value i in word i / 8, bits
//                                             4(i%8)..4(i%8)+3
//   scales2     uint8   [n2]                    sc | mc << 4  (4-bit codes of scale and m)
//   scales4     uint8   [n4, 2]                 [sc, mc]      (8-bit codes)
//   so2         float16 [ceil(n2 / B), 2]       [d, dm] per block of B 2-bit groups
//   so4         float16 [ceil(n4 / B), 2]       [d, dm] per block of B 4-bit groups
//   outlier_idx int32   [n_out]                 flat indices r * K + k, strictly increasing
//   outlier_val float16 [n_out]
//
//   one 2-bit group, gs = 16:      codes2[j]   = | q15 | q14 | ... | q1 | q0 |   (32 bits)
//                                  scales2[j]  = | mc (4) | sc (4) |
//                                  so2[j / B]  = d, dm  (fp16 pair shared by B groups)
//
// The 2-bit and 4-bit groups live in separate arrays so a GEMV streams each array linearly;
// a row's offsets into them come from a prefix count of group_map. Stored bits per weight at
// the defaults (gs = 16, B = 16): a 2-bit group costs 2 + 8/16 = 2.5, a 4-bit group
// 4 + 16/16 = 5, the map 1/16 and the second order 32 bits per 16 groups = 1/8, so
// 0.9 * 2.5 + 0.1 * 5 + 0.0625 + 0.125 = 2.9375 (+ rounding of n4 and of partial blocks;
// 384 x 384: 2.938).
//
// Clarifications of the project's spec (no behaviour change on ordinary weights):
// * -0 is read as +0 for scores and min/max, and m = 0 - lo, so that no stored value depends
//   on which of two equal zeros a max() happens to return (d, dm are never fp16 -0).
// * NaN scores and inf outlier values raise the same ValueError as inf second-order scales.
// * outlier_idx is int32, so outliers need rows * K < 2^31.
#pragma once
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common/fp16.h"

namespace qf::mixed2bit {

constexpr int kGroupMultiple = 16;  // group_size must be a multiple of this (one codes2 word)
constexpr int kCodes2PerWord = 16;  // 2-bit codes per int32 word
constexpr int kCodes4PerWord = 8;   // 4-bit codes per int32 word
constexpr int kQmax2 = 3;           // largest 2-bit code
constexpr int kQmax4 = 15;          // largest 4-bit code
constexpr int kS2 = 15;             // largest second-order code of a 2-bit group (4-bit sc, mc)
constexpr int kS4 = 255;            // largest second-order code of a 4-bit group (8-bit sc, mc)
constexpr int kDefaultGroupSize = 16;
constexpr int kDefaultScaleBlock = 16;

constexpr const char* kTooLargeMessage = "values too large for mixed2bit's fp16 second-order scales (or fp16 outliers)";

// Sizes of one tensor: everything the buffers' shapes follow from.
struct Dims {
  int64_t rows = 0, K = 0;
  int64_t group_size = kDefaultGroupSize;
  int64_t scale_block = kDefaultScaleBlock;
  int64_t n4 = 0;     // 4-bit groups
  int64_t n_out = 0;  // outliers

  int64_t groups_per_row() const { return group_size ? K / group_size : 0; }
  int64_t n_groups() const { return rows * groups_per_row(); }
  int64_t n2() const { return n_groups() - n4; }
  int64_t words2() const { return group_size / kCodes2PerWord; }  // int32 words per 2-bit group
  int64_t words4() const { return group_size / kCodes4PerWord; }  // int32 words per 4-bit group
  // Ceilings that divide first: n + scale_block - 1 wraps for a scale_block near 2^63.
  int64_t map_bytes() const { return n_groups() / 8 + (n_groups() % 8 != 0); }
  int64_t blocks2() const { return n2() / scale_block + (n2() % scale_block != 0); }
  int64_t blocks4() const { return n4 / scale_block + (n4 % scale_block != 0); }
};

// The packed buffers (codes as uint32 words: the int32 arrays reinterpreted, bit 31 included).
struct Buffers {
  uint8_t* group_map;
  uint32_t* codes2;
  uint32_t* codes4;
  uint8_t* scales2;
  uint8_t* scales4;
  half_t* so2;
  half_t* so4;
  int32_t* outlier_idx;
  half_t* outlier_val;
};
struct ConstBuffers {
  const uint8_t* group_map;
  const uint32_t* codes2;
  const uint32_t* codes4;
  const uint8_t* scales2;
  const uint8_t* scales4;
  const half_t* so2;
  const half_t* so4;
  const int32_t* outlier_idx;
  const half_t* outlier_val;
};

// Throws std::invalid_argument unless the dims are consistent (every kernel checks them).
inline void check_dims(const Dims& d) {
  if (d.rows < 0 || d.K < 0 || d.group_size < kGroupMultiple || d.group_size % kGroupMultiple || d.K % d.group_size ||
      d.scale_block < 1)
    throw std::invalid_argument("mixed2bit: bad rows/K/group_size/scale_block");
  if (d.n4 < 0 || d.n4 > d.n_groups()) throw std::invalid_argument("mixed2bit: n4 out of range [0, n_groups]");
  if (d.n_out < 0 || d.n_out > d.n2() * d.group_size)
    throw std::invalid_argument("mixed2bit: n_out out of range [0, elements of 2-bit groups]");
  if (d.n_out > 0 && d.rows * d.K > int64_t(INT32_MAX))
    throw std::invalid_argument("mixed2bit: outliers need rows * K < 2^31 (int32 indices)");
}

// ---------------------------------------------------------------------------------------------
// Per-group rules, shared by the CPU kernels and the CUDA kernels (same functions, same bytes)
// ---------------------------------------------------------------------------------------------

// Round half to even (numpy's rint) under the default rounding mode.
QF_HOST_DEVICE float rint_even(float v) {
#if defined(__CUDA_ARCH__)
  return rintf(v);
#else
  return std::nearbyint(v);
#endif
}

// x + 0.0f is x for every x except -0, which becomes +0 (round-to-nearest: -0 + +0 = +0).
// Reading values this way makes max/min of a group unique even when it holds both zeros.
QF_HOST_DEVICE float read_pos_zero(float x) { return x + 0.0f; }

// Clamp an already rounded float to [0, hi] before the integer conversion (an out-of-range
// float -> int conversion is undefined in C++); NaN goes to 0.
QF_HOST_DEVICE int clamp_code(float r, int hi) {
  if (!(r > 0.0f)) return 0;
  return r < static_cast<float>(hi) ? static_cast<int>(r) : hi;
}

// Step 1, by range: max - min of the group's values (>= +0; inf if it overflows).
template <class T>
QF_HOST_DEVICE float range_score(const T* x, int gs) {
  float mn = read_pos_zero(to_f32(x[0])), mx = mn;
  for (int j = 1; j < gs; ++j) {
    const float v = read_pos_zero(to_f32(x[j]));
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  }
  return mx - mn;
}

// Step 1, with a sensitivity (e.g. a Hessian diagonal): sum of sens[k] * w^2 in group order,
// starting from +0. Each term is >= +0 or -0 (sens = -0), and +0 + -0 = +0, so s is never -0.
template <class T>
QF_HOST_DEVICE float sensitivity_score(const T* x, const float* sens, int gs) {
  float s = 0.0f;
  for (int j = 0; j < gs; ++j) {
    const float w = to_f32(x[j]);
    const float w2 = w * w;
    const float t = sens[j] * w2;
    s = s + t;
  }
  return s;
}

// Step 2's total order on float scores as an unsigned key: flipping all bits of negatives and
// the sign bit of non-negatives makes unsigned order equal float order for every non-NaN
// value (-0 < +0, but scores are never -0). NaN scores are rejected (the "too large" error).
// The n4 groups first in (key descending, id ascending) order are 4-bit.
QF_HOST_DEVICE uint32_t score_order_key(float f) {
  const uint32_t b = f32_bits(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Step 4, the part that reads the values: min and max of the group's non-outlier values (read
// with -0 as +0; both 0 for a group with none left). `outl` points at the sorted flat indices of
// the outliers that fall in this group (n_outl of them; may be null when 0), `base` is the
// group's first flat index; those elements are skipped. Without outliers this is the same loop
// as range_score, so range_score(x, gs) == range_score_of(mn, mx).
template <class T>
QF_HOST_DEVICE void group_min_max(const T* x, int gs, const int32_t* outl, int64_t n_outl, int64_t base, float* min_out,
                                  float* max_out) {
  bool any = false;
  float mn = 0.0f, mx = 0.0f;
  int64_t o = 0;
  for (int j = 0; j < gs; ++j) {
    if (o < n_outl && outl[o] == base + j) {
      ++o;
      continue;
    }  // an outlier: not in min/max
    const float v = read_pos_zero(to_f32(x[j]));
    if (!any) {
      mn = mx = v;
      any = true;
      continue;
    }
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  }
  *min_out = mn;
  *max_out = mx;
}

// Step 1 by range, from the group's min and max (no outliers): max - min.
QF_HOST_DEVICE float range_score_of(float mn, float mx) { return mx - mn; }

// Step 4 from the min and max: the range hi - lo and m = 0 - lo.
QF_HOST_DEVICE void range_m_of(float mn, float mx, float* range, float* m) {
  const float lo = mn < 0.0f ? mn : 0.0f;  // the grid always holds 0 (m >= 0)
  const float hi = mx;                     // 0 for an empty group
  *range = hi - lo;                        // >= +0: hi >= lo, and hi is never -0
  *m = 0.0f - lo;                          // +0 (not -0) when lo = 0
}

// Step 4, the part that reads the values: the group's range hi - lo and m = 0 - lo over its
// non-outlier values (see group_min_max).
template <class T>
QF_HOST_DEVICE void group_range_m(const T* x, int gs, const int32_t* outl, int64_t n_outl, int64_t base, float* range,
                                  float* m) {
  float mn, mx;
  group_min_max(x, gs, outl, n_outl, base, &mn, &mx);
  range_m_of(mn, mx, range, m);
}

// Step 4, the rest: the first-order scale from the range (qmax = 3 or 15).
QF_HOST_DEVICE float first_order_scale(float range, int qmax) { return range / static_cast<float>(qmax); }

// Step 5: one second-order fp16 field from the block's largest first-order value.
QF_HOST_DEVICE uint16_t second_order_bits(float block_max, int S) {
  return fp32_to_fp16_bits(block_max / static_cast<float>(S));
}

// An fp16 that is inf or NaN (exponent all ones): the "too large" condition.
QF_HOST_DEVICE bool fp16_not_finite(uint16_t bits) { return (bits & 0x7C00u) == 0x7C00u; }

// Step 5: code of a first-order value v (scale or m) on the grid d16 * {0..S}.
QF_HOST_DEVICE int param_code(float v, float d16, int S) {
  if (!(d16 > 0.0f)) return 0;
  const float t = v / d16;
  return clamp_code(rint_even(t), S);
}

// Step 6: the code of one value.
QF_HOST_DEVICE int quantize_value(float x, float s_eff, float m_eff, int qmax) {
  if (!(s_eff > 0.0f)) return 0;
  const float shifted = x + m_eff;
  const float t = shifted / s_eff;
  return clamp_code(rint_even(t), qmax);
}

// Step 6: the decoded value of a code (q * s_eff rounded, then the subtraction rounded), with the
// code given as a float (exact: codes are < 2^24).
QF_HOST_DEVICE float dequantize_value_f(float q, float s_eff, float m_eff) {
  const float p = q * s_eff;
  return p - m_eff;
}
QF_HOST_DEVICE float dequantize_value(int q, float s_eff, float m_eff) {
  return dequantize_value_f(static_cast<float>(q), s_eff, m_eff);
}

// Effective (decoded) scale / offset of a group: code times the block's fp16 field.
QF_HOST_DEVICE float effective(uint16_t d_bits, int code) {
  return fp16_bits_to_fp32(d_bits) * static_cast<float>(code);
}

// Steps 6 + 7: codes of one group, packed. BITS = 2 (16 per word) or 4 (8 per word), value i
// at bits BITS * (i % per_word) of word i / per_word.
template <int BITS, class T>
QF_HOST_DEVICE void encode_group(const T* x, int gs, float s_eff, float m_eff, uint32_t* words) {
  constexpr int per_word = 32 / BITS;
  constexpr int qmax = (1 << BITS) - 1;
  for (int w = 0; w < gs / per_word; ++w) {
    uint32_t word = 0;
    for (int i = 0; i < per_word; ++i) {
      const int q = quantize_value(to_f32(x[w * per_word + i]), s_eff, m_eff, qmax);
      word |= static_cast<uint32_t>(q) << (BITS * i);
    }
    words[w] = word;
  }
}

// Decode one group's packed codes (outliers are overwritten afterwards by the caller).
template <int BITS>
QF_HOST_DEVICE void decode_group(const uint32_t* words, int gs, float s_eff, float m_eff, float* y) {
  constexpr int per_word = 32 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1u;
  for (int w = 0; w < gs / per_word; ++w) {
    const uint32_t word = words[w];
    for (int i = 0; i < per_word; ++i)
      y[w * per_word + i] = dequantize_value(static_cast<int>((word >> (BITS * i)) & mask), s_eff, m_eff);
  }
}

// Step 5 for one second-order block: the n groups ids[0..n) (consecutive in their list, all
// 2-bit or all 4-bit: qmax, S), their ranges and m's by group id -> the fp16 fields d, dm.
// Every value is >= +0 and not NaN, so the max does not depend on the order.
template <class Id>
QF_HOST_DEVICE void second_order_block(const Id* ids, int64_t n, const float* range, const float* m, int qmax, int S,
                                       uint16_t* d_bits, uint16_t* dm_bits) {
  float ms = 0.0f, mm = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float sc = first_order_scale(range[ids[j]], qmax), z = m[ids[j]];
    ms = sc > ms ? sc : ms;
    mm = z > mm ? z : mm;
  }
  *d_bits = second_order_bits(ms, S);
  *dm_bits = second_order_bits(mm, S);
}

// Steps 5 + 6 for one group of BITS = 2 or 4 bits: its second-order codes sc, mc against its
// block's fp16 fields, then its packed codes.
template <int BITS, class T>
QF_HOST_DEVICE void quantize_group(const T* x, int gs, float range, float m, uint16_t d_bits, uint16_t dm_bits, int* sc,
                                   int* mc, uint32_t* words) {
  constexpr int qmax = (1 << BITS) - 1;
  constexpr int S = BITS == 2 ? kS2 : kS4;
  *sc = param_code(first_order_scale(range, qmax), fp16_bits_to_fp32(d_bits), S);
  *mc = param_code(m, fp16_bits_to_fp32(dm_bits), S);
  encode_group<BITS>(x, gs, effective(d_bits, *sc), effective(dm_bits, *mc), words);
}

// Decoded (effective) scale and offset of the group at slot j of its list (4-bit or 2-bit).
QF_HOST_DEVICE void group_params(const ConstBuffers& q, bool is4, int64_t j, int64_t B, float* s_eff, float* m_eff) {
  const int64_t b = j / B;
  if (is4) {
    *s_eff = effective(q.so4[2 * b].bits, q.scales4[2 * j]);
    *m_eff = effective(q.so4[2 * b + 1].bits, q.scales4[2 * j + 1]);
  } else {
    const uint8_t codes = q.scales2[j];
    *s_eff = effective(q.so2[2 * b].bits, codes & 0x0F);
    *m_eff = effective(q.so2[2 * b + 1].bits, codes >> 4);
  }
}

// ---------------------------------------------------------------------------------------------
// CPU kernels (mixed2bit_cpu.cpp)
// ---------------------------------------------------------------------------------------------

// Quantize w [rows, K] (C-contiguous) into every buffer of `out` (all sized from `dims`; every
// byte is written). sens: float32 [K] or nullptr (select by range). Throws
// std::invalid_argument (kTooLargeMessage) when a stored fp16 would be inf or a score is NaN,
// std::invalid_argument for inconsistent dims.
template <class T>
void quantize_cpu(const T* w, const float* sens, const Dims& dims, const Buffers& out);

// Per-row offsets into the packed arrays, from one prefix count of group_map: row r's 4-bit
// groups start at codes4 slot n4_before[r], its 2-bit groups at r * G - n4_before[r], and its
// outliers at outlier_idx[out_before[r]]. Construction checks the buffers against dims (map
// popcount == n4, outlier indices strictly increasing and in range) and throws
// std::invalid_argument otherwise, so decoding never reads or writes out of bounds.
struct RowIndex {
  std::vector<int64_t> n4_before;   // [rows + 1]
  std::vector<int64_t> out_before;  // [rows + 1]
};
RowIndex build_row_index(const ConstBuffers& q, const Dims& dims);

// Decode rows [r0, r1) into y (float32 [(r1 - r0), K]).
void decode_rows_cpu(const ConstBuffers& q, const Dims& dims, const RowIndex& index, int64_t r0, int64_t r1, float* y);

// Decode the whole tensor into y [rows, K] of T = float, half_t or bf16_t (decoded in float32,
// outliers included, then rounded once to T), threaded over rows.
template <class T>
void dequantize_cpu(const ConstBuffers& q, const Dims& dims, T* y);

// Y [N, M=rows] = X [N, K] . W^T, W decoded a tile of rows at a time (gemm/weight_only_cpu.h).
void gemm_cpu(const float* X, int64_t N, const ConstBuffers& q, const Dims& dims, float* Y);

// pack_2bit: n_words * 16 values 0..3 -> n_words words (value i in bits 2i..2i+1 of its word);
// values are masked to 2 bits. unpack_2bit: the first n values of the packed words.
void pack_2bit_cpu(const uint8_t* values, int64_t n_words, uint32_t* out);
void unpack_2bit_cpu(const uint32_t* packed, int64_t n, uint8_t* out);

// ---------------------------------------------------------------------------------------------
// CUDA kernels (mixed2bit_quantize_cuda.cu, mixed2bit_dequantize_cuda.cu, mixed2bit_pack_cuda.cu;
// the GEMM: mixed2bit_gemm_cuda.h): every pointer on the current device, launched on `stream`
// (a cudaStream_t). The quantizer and dequantizer need a device workspace of at least
// *_workspace_bytes_cuda(dims) bytes (the caller allocates it, e.g. as a torch uint8 tensor,
// on the same stream; any alignment); the size queries need the device current.
// ---------------------------------------------------------------------------------------------

// Same result and errors as quantize_cpu. Synchronizes the stream once at the end (one 16-byte
// device-to-host copy of the error flags): the "too large" ValueError must be raised by this
// call, as on the CPU.
int64_t quantize_workspace_bytes_cuda(const Dims& dims);
template <class T>
void quantize_cuda(const T* w, const float* sens, const Dims& dims, const Buffers& out, void* workspace,
                   int64_t workspace_bytes, void* stream);

// Same bytes as dequantize_cpu for consistent buffers; asynchronous (no host synchronization).
// Inconsistent buffers (group_map popcount != n4, outlier_idx not strictly increasing or out of
// range: the CPU's ValueError) are detected on the device and decode to all-NaN instead,
// never reading or writing out of bounds.
int64_t dequantize_workspace_bytes_cuda(const Dims& dims);
template <class T>
void dequantize_cuda(const ConstBuffers& q, const Dims& dims, T* y, void* workspace, int64_t workspace_bytes,
                     void* stream);

void pack_2bit_cuda(const uint8_t* values, int64_t n_words, uint32_t* out, void* stream);
void unpack_2bit_cuda(const uint32_t* packed, int64_t n, uint8_t* out, void* stream);

}  // namespace qf::mixed2bit
