// int4 pack spec: 4-bit integer codes, two per byte, with one float32 scale (and, in the
// asymmetric mode, one integer zero point) per group of group_size consecutive values along
// the last axis. The asymmetric mode is the min-max + integer zero point convention of
// GPTQ/AWQ/HQQ weights (GPTQ's `Quantizer.find_params` / `quantize`: scale = (xmax - xmin) /
// maxq, zero = round(-xmin / scale), q = clamp(round(x / scale) + zero, 0, maxq), with the
// range widened to contain 0); the symmetric mode gives signed codes that multiply as
// integers (int4 x int4 GEMM).
//
// Layout of a tensor [..., K] (K % group_size == 0; group_size a positive multiple of 8):
//   qweight  uint8   [..., K / 2]           byte j = code[2j] | code[2j + 1] << 4
//                                           (element 2j in the LOW nibble, 2j+1 in the HIGH)
//   scales   float32 [..., K / group_size]
//   zeros    uint8   [..., K / group_size]  asymmetric mode only, in [0, 15]
// Group g (flat index over all rows) covers values [g*gs, g*gs + gs), bytes
// [g*gs/2, g*gs/2 + gs/2) of qweight (gs is even, so no byte straddles two groups), scales[g]
// and zeros[g], whatever the leading shape.
//
// Layout "tiles" (params layout="tiles"; a 2-D weight [M, K] with M % 16 == 0): the same groups
// with the same bytes, stored in another order. The rows are cut into tiles of 16; a tile's groups
// are stored one group column after the other, the tile's 16 rows one after the other in each:
//   row m's group c (rows layout: group m * C + c, C = K / gs) is group
//   ((m / 16) * C + c) * 16 + m % 16 of qweight, scales and zeros.
// As arrays: qweight uint8 [M / 16, C, 16, gs / 2], scales float32 and zeros uint8 [M / 16, C, 16]:
// the rows layout's arrays seen as [M / 16, 16, C, ...] with axes 1 and 2 swapped. Why: a GPU warp
// that multiplies 16 rows reads one group column of a tile, 16 * gs / 2 contiguous bytes (1 KB at
// group_size 128) and 16 contiguous scales, where the rows layout puts each row K / 2 bytes apart
// (gemm/weight_only_gemv_cuda.cuh; the order of Marlin's tiles, arXiv 2408.11743, without its
// permutation inside them).
//
// Asymmetric (codes 0..15), per group x[0..gs), float32, every operation rounded separately:
//   lo    = min(min(x), 0),  hi = max(max(x), 0)   (the range contains 0, so 0 is exact;
//                                                  both are +0 unless some x < 0 / x > 0)
//   scale = (hi - lo) / 15
//           -- if hi - lo overflows to +inf (|hi|, |lo| both ~1.7e38 or more): scale =
//              hi / 15 - lo / 15 instead, which cannot overflow (our extension: the plain
//              formula would give scale = inf and decode every value to NaN)
//   scale == 0:  zero = 0 and every code 0
//   otherwise:   zero = clamp(rint(-lo / scale), 0, 15)
//                q    = clamp(rint(x / scale) + zero, 0, 15)
//   rint = round half to even; true float32 divisions; clamp in float before the integer
//   conversion. Dequantize: x' = float(q - zero) * scale (q - zero an exact small integer).
//
// Symmetric (codes -8..7, stored as the two's-complement nibble), per group:
//   scale = max|x| / 7
//   scale == 0:  every code 0
//   otherwise:   q = clamp(rint(x / scale), -8, 7)      (-8 only where a subnormal scale
//                                                        rounded down: absmax = 45 * 2^-149
//                                                        gives scale = 6 * 2^-149 and
//                                                        -absmax / scale = -7.5 -> -8)
//   Dequantize: x' = float(q) * scale.
//
// Why the error stays at half a step although the zero point is rounded: zero is an
// integer, so q - zero = rint(x / scale) unless clamped, and the decoded grid is the
// multiples of scale; the clamp window [-zero * scale, (15 - zero) * scale] is [lo, hi]
// moved by less than scale / 2 at each end, so clamped values move by less than scale / 2.
// Corner cases: x / scale is finite for every finite x (|x| <= 15 * scale up to rounding),
// but the clamps are written so that +-inf and NaN (only reachable by calling the kernels
// directly with non-finite input) still give a defined code. The decode (q - zero) * scale
// can round past FLT_MAX to +-inf when a group's values come within scale / 2 of FLT_MAX
// (the grid point nearest such an x lies beyond FLT_MAX); the codes are still the right ones.
#pragma once
#include <cmath>
#include <cstdint>

#include "common/fp16.h"
#include "common/rounding.h"

// CUDA note: `int4` is also CUDA's built-in vector type (struct int4 in the global
// namespace), so code outside namespace qf that says `using namespace qf;` must spell this
// namespace qf::int4 (checked with nvcc 13: the rules below compile for the device and give
// the host's bytes).
namespace qf::int4 {

constexpr int kAsymMax = 15;  // asymmetric codes 0..15
constexpr int kSymMin = -8;   // symmetric codes -8..7
constexpr int kSymMax = 7;
constexpr int kGroupMultiple = 8;  // group_size must be a positive multiple of this

// clamp(v, lo, hi) written so that NaN maps to lo (NaN fails every comparison).
QF_HOST_DEVICE float clamp_nan_lo(float v, float lo, float hi) {
  v = v > lo ? v : lo;
  return v < hi ? v : hi;
}

// Two codes into one byte: element 2j low nibble, element 2j+1 high nibble. Only the low 4
// bits of each code are kept, which is also the two's-complement nibble of a signed code.
QF_HOST_DEVICE uint8_t pack_pair(int lo, int hi) { return static_cast<uint8_t>((lo & 0x0F) | ((hi & 0x0F) << 4)); }
// The "tiles" layout (see the header): rows per tile, and the stored index of row m's group c
// (C groups per row); rows_group is its inverse (the rows layout's index m * C + c of group gt).
constexpr int kTileRows = 16;
QF_HOST_DEVICE int64_t tiles_group(int64_t m, int64_t c, int64_t C) {
  return ((m / kTileRows) * C + c) * kTileRows + m % kTileRows;
}
QF_HOST_DEVICE int64_t rows_group(int64_t gt, int64_t C) {
  const int64_t tc = gt / kTileRows, r = gt % kTileRows;  // (tile * C + c), row in tile
  return ((tc / C) * kTileRows + r) * C + tc % C;
}

// A 4-bit two's-complement nibble n in [0, 15] as a signed value in [-8, 7]: flipping the
// sign bit maps -8..7 onto 0..15 in order, so (n ^ 8) - 8 undoes it (no signed shifts).
QF_HOST_DEVICE int nibble_to_signed(int n) { return (n ^ 8) - 8; }
// One unpacked code byte: signed -> the int8 bit pattern of -8..7, else 0..15.
QF_HOST_DEVICE uint8_t unpack_nibble(int n, bool is_signed) {
  return static_cast<uint8_t>(is_signed ? nibble_to_signed(n) : n);
}

// ---- asymmetric ----------------------------------------------------------------------------

// scale = (hi - lo) / 15, or hi / 15 - lo / 15 where hi - lo overflows (see the header).
QF_HOST_DEVICE float asym_scale(float lo, float hi) {
  const float range = hi - lo;
  if (range == INFINITY) return hi / 15.0f - lo / 15.0f;
  return range / 15.0f;
}

// zero = clamp(rint(-lo / scale), 0, 15) for scale > 0. The bounds are integers, so clamping
// before rounding gives the same result and keeps rint_small in range.
QF_HOST_DEVICE float asym_zero(float lo, float scale) { return rint_small(clamp_nan_lo(-lo / scale, 0.0f, 15.0f)); }

// q = clamp(rint(x / scale) + zero, 0, 15) for scale > 0, zero in [0, 15]. Clamping x / scale
// to [-16, 16] first changes nothing (anything below -16 rounds to <= -16 and ends at 0 after
// + zero <= 15 and the clamp; anything above 16 ends at 15) and keeps rint_small in range.
QF_HOST_DEVICE int quantize_value_asym(float x, float scale, float zero) {
  const float r = rint_small(clamp_nan_lo(x / scale, -16.0f, 16.0f)) + zero;  // exact integer
  return static_cast<int>(clamp_nan_lo(r, 0.0f, 15.0f));
}

// Running extrema of a group, started at lo = hi = +0 (the range always contains 0). A -0
// input never enters (-0 < +0 and -0 > +0 are false), so lo is +0 or negative and hi is +0
// or positive: min and max are then exact and order-free, and partial extrema of any split
// of a group (threads, lanes, segments) combine with the same two steps to the serial result.
QF_HOST_DEVICE float min_step(float lo, float v) { return v < lo ? v : lo; }
QF_HOST_DEVICE float max_step(float hi, float v) { return v > hi ? v : hi; }

// A group's scale and zero point from its extrema: zero = 0 where scale == 0 (all values
// +-0, or a range so small that range / 15 underflows).
struct AsymParams {
  float scale;
  float zero;  // an integer in [0, 15]
};
QF_HOST_DEVICE AsymParams asym_params(float lo, float hi) {
  const float scale = asym_scale(lo, hi);
  return {scale, scale == 0.0f ? 0.0f : asym_zero(lo, scale)};
}
// One asymmetric code; every code of a scale-0 group is 0.
QF_HOST_DEVICE int asym_code(float x, AsymParams p) {
  return p.scale == 0.0f ? 0 : quantize_value_asym(x, p.scale, p.zero);
}
// One decoded value: (q - zero) * scale, q - zero an exact small integer.
QF_HOST_DEVICE float decode_asym(int q, int zero, float scale) { return static_cast<float>(q - zero) * scale; }

// One group of gs values (gs even) -> gs / 2 bytes of qw, its scale and zero point.
template <class T>
QF_HOST_DEVICE void quantize_group_asym(const T* x, int64_t gs, uint8_t* qw, float* scale_out, uint8_t* zero_out) {
  float lo = 0.0f, hi = 0.0f;  // +0 start: see min_step
  for (int64_t j = 0; j < gs; ++j) {
    const float v = to_f32(x[j]);
    lo = min_step(lo, v);
    hi = max_step(hi, v);
  }
  const AsymParams p = asym_params(lo, hi);
  *scale_out = p.scale;
  *zero_out = static_cast<uint8_t>(p.zero);
  for (int64_t j = 0; j < gs / 2; ++j)
    qw[j] = pack_pair(asym_code(to_f32(x[2 * j]), p), asym_code(to_f32(x[2 * j + 1]), p));
}

// T = float, half_t or bf16_t: decoded in float32, rounded once to T.
template <class T>
QF_HOST_DEVICE void dequantize_group_asym(const uint8_t* qw, int64_t gs, float scale, uint8_t zero, T* y) {
  const int z = zero;
  for (int64_t j = 0; j < gs / 2; ++j) {
    from_f32(decode_asym(qw[j] & 0x0F, z, scale), y + 2 * j);
    from_f32(decode_asym(qw[j] >> 4, z, scale), y + 2 * j + 1);
  }
}

// ---- symmetric -----------------------------------------------------------------------------

// q = clamp(rint(x / scale), -8, 7) for scale > 0 (integer bounds: clamp first, then round).
QF_HOST_DEVICE int quantize_value_sym(float x, float scale) {
  return static_cast<int>(rint_small(clamp_nan_lo(x / scale, -8.0f, 7.0f)));
}

// One step of the running max |x| (start: +0). fabsf, not a sign test: |-0.0| must be +0.0
// (scale bits); partial maxima (all >= +0) combine with max_step, exactly and in any order.
QF_HOST_DEVICE float absmax_step(float amax, float v) {
  const float a = fabsf(v);
  return amax > a ? amax : a;
}
QF_HOST_DEVICE float sym_scale(float amax) { return amax / 7.0f; }
// One symmetric code; every code of a scale-0 group is 0.
QF_HOST_DEVICE int sym_code(float x, float scale) { return scale == 0.0f ? 0 : quantize_value_sym(x, scale); }
// One decoded value from a stored nibble: signed code * scale.
QF_HOST_DEVICE float decode_sym(int nibble, float scale) {
  return static_cast<float>(nibble_to_signed(nibble)) * scale;
}

template <class T>
QF_HOST_DEVICE void quantize_group_sym(const T* x, int64_t gs, uint8_t* qw, float* scale_out) {
  float amax = 0.0f;
  for (int64_t j = 0; j < gs; ++j) amax = absmax_step(amax, to_f32(x[j]));
  const float scale = sym_scale(amax);
  *scale_out = scale;
  for (int64_t j = 0; j < gs / 2; ++j)
    qw[j] = pack_pair(sym_code(to_f32(x[2 * j]), scale), sym_code(to_f32(x[2 * j + 1]), scale));
}

template <class T>
QF_HOST_DEVICE void dequantize_group_sym(const uint8_t* qw, int64_t gs, float scale, T* y) {
  for (int64_t j = 0; j < gs / 2; ++j) {
    from_f32(decode_sym(qw[j] & 0x0F, scale), y + 2 * j);
    from_f32(decode_sym(qw[j] >> 4, scale), y + 2 * j + 1);
  }
}

// Groups [g0, g1) of either mode (zeros == nullptr: symmetric) into y (which points at the
// first value of group g0). Serial: the weight-only GEMM calls it from inside its threads.
template <class T>
QF_HOST_DEVICE void dequantize_groups(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t gs,
                                      int64_t g0, int64_t g1, T* y) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* qw = qweight + g * (gs / 2);
    T* yg = y + (g - g0) * gs;
    if (zeros) dequantize_group_asym(qw, gs, scales[g], zeros[g], yg);
    else dequantize_group_sym(qw, gs, scales[g], yg);
  }
}

// ---- CPU kernels (int4_cpu.cpp), threaded over groups / bytes ------------------------------

// x: n_groups * gs values; qweight: n_groups * gs / 2 bytes; one scale (and zero) per group.
template <class T>
void quantize_asym_cpu(const T* x, int64_t n_groups, int64_t gs, uint8_t* qweight, float* scales, uint8_t* zeros);
template <class T>
void quantize_sym_cpu(const T* x, int64_t n_groups, int64_t gs, uint8_t* qweight, float* scales);
// zeros == nullptr selects the symmetric decode. T = float, half_t or bf16_t (decoded in
// float32, rounded once to T). tiles_C > 0: the buffers are in the "tiles" layout of a weight
// with tiles_C groups per row, and y [M, K] is written in row order (group gt to
// y + rows_group(gt, tiles_C) * gs); 0: the rows layout.
template <class T>
void dequantize_cpu(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t n_groups, int64_t gs,
                    T* y, int64_t tiles_C = 0);

// n_bytes bytes from 2 * n_bytes codes (low 4 bits of each byte of `codes`, so uint8 0..15
// and int8 -8..7 alike); and back: signed -> int8 -8..7, else uint8 0..15.
void pack_cpu(const uint8_t* codes, int64_t n_bytes, uint8_t* packed);
void unpack_cpu(const uint8_t* packed, int64_t n_bytes, bool is_signed, uint8_t* codes);

// ---- CUDA kernels (int4_cuda.cu): the same signatures plus `stream` (a cudaStream_t), launched
// on the current device, every pointer device memory. Groups that do not fit one CTA (gs >
// 16384, or > 4096 on the unaligned path) take two extra small kernels and a stream-ordered
// workspace of a few bytes per 16K values.
template <class T>
void quantize_asym_cuda(const T* x, int64_t n_groups, int64_t gs, uint8_t* qweight, float* scales, uint8_t* zeros,
                        void* stream);
template <class T>
void quantize_sym_cuda(const T* x, int64_t n_groups, int64_t gs, uint8_t* qweight, float* scales, void* stream);
template <class T>
void dequantize_cuda(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t n_groups, int64_t gs,
                     T* y, void* stream, int64_t tiles_C = 0);
void pack_cuda(const uint8_t* codes, int64_t n_bytes, uint8_t* packed, void* stream);
void unpack_cuda(const uint8_t* packed, int64_t n_bytes, bool is_signed, uint8_t* codes, void* stream);

// Y [N, M] = X [N, K] . W^T for an int4 weight W [M, K] (zeros == nullptr: symmetric),
// through gemm::weight_only_gemm_cpu (decodes 16 weight rows at a time, float32 dots).
void weight_only_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const uint8_t* qweight, const float* scales,
                          const uint8_t* zeros, int64_t gs, float* Y);

}  // namespace qf::int4
