// int8 pack spec: symmetric absmax int8 with one float32 scale per unit, the rounding of
// bitsandbytes' `int8_vectorwise_quant` (bitsandbytes/backends/default/ops.py:
// `torch.round(A * (127.0 / row_stats))`, LLM.int8() vector-wise quantization).
//
// Layout (no structs: two plain arrays). A "unit" is a contiguous run of L values that
// shares one scale; the granularity picks L:
//   tensor   L = numel          scale shape [1] * ndim
//   row      L = K (last axis)  scale shape [..., 1]
//   group    L = group_size     scale shape [..., K / group_size]   (K % group_size == 0)
//   q      int8    [..., K]   codes in [-127, 127] (-128 is never produced)
//   scale  float32 one per unit, absmax / 127
// so unit u covers q[u*L .. u*L + L) and scale[u], whatever the leading shape.
//
// Quantize one unit x[0..L) (float32 arithmetic, every operation rounded separately):
//   absmax = max |x|                       (exact; order-free, so threads may split it)
//   m      = 127 / absmax                  (float32 division, once per unit)
//   q      = clamp(rint(x * m), -127, 127) (float32 multiply, round half to even, clamp in
//                                           float before the int conversion)
//   scale  = absmax / 127                  (float32 division)
// Dequantize: x' = float(q) * scale (one float32 multiply).
// bitsandbytes stores absmax (row_stats) instead of scale and divides by 127 at matmul
// time; the codes are the same. Its default backend does not clamp: it never needs to,
// because |x * m| <= 127 * (1 + 2^-24)^2 < 127.5 whenever m is finite.
//
// Corner cases (unreachable from bitsandbytes' tests, defined here so that every finite
// input has one answer):
// * absmax = 0: m = 127 / 0 = +inf, x * m = 0 * inf = NaN; we define q = 0 for a NaN
//   product, so an all-zero unit stores q = 0 and scale = 0 and decodes to zeros.
// * 0 < absmax < 127 / FLT_MAX (~3.7e-37): m overflows to +inf, so x * m is +-inf for every
//   x != 0 and the clamp saturates it to +-127; x == +-0 gives NaN -> q = 0. This is the
//   exact (infinitely precise) code only for x = +-absmax and x = 0; other elements of such
//   a unit decode to +-127 * scale ~ +-absmax, an absolute error below absmax < 3.7e-37.
//   (bitsandbytes converts the inf to int8 without a clamp, which is undefined in C++.)
// * absmax close to FLT_MAX: 127 * fl(absmax / 127) can round up past FLT_MAX (it does for
//   absmax = FLT_MAX), so the element equal to absmax decodes to +-inf. The codes are
//   still the exact ones; only the float32 product of the decode overflows.
#pragma once
#include <cmath>
#include <cstdint>

#include "common/fp16.h"
#include "common/rounding.h"

namespace qf::int8 {

constexpr int kQMax = 127;  // codes are symmetric: [-127, 127]

// The per-unit multiplier 127 / absmax (+inf for absmax == 0 or absmax < ~3.7e-37).
QF_HOST_DEVICE float multiplier(float absmax) { return static_cast<float>(kQMax) / absmax; }
QF_HOST_DEVICE float scale_of(float absmax) { return absmax / static_cast<float>(kQMax); }

// One code from a float32 value and the unit's multiplier m = 127 / absmax.
QF_HOST_DEVICE int8_t quantize_value(float x, float m) {
  float v = x * m;
  if (!(v == v)) return 0;  // 0 * inf: an all-zero unit, or x = 0 when m overflowed
  // Clamp before rounding: the bounds are integers, so clamp(rint(v)) == rint(clamp(v)),
  // and the clamped value is in rint_small's range (+-inf included).
  v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
  return static_cast<int8_t>(rint_small(v));
}

// One step of the running max |x| (start: amax = +0). fabsf, not a sign test: |-0.0| must
// be +0.0 (scale bits), so every partial maximum is +0 or positive and never -0.
QF_HOST_DEVICE float absmax_step(float amax, float v) {
  const float a = fabsf(v);
  return amax > a ? amax : a;
}
// Combines two partial maxima (both >= +0): max is exact, so partial maxima of any split
// of a unit (threads, lanes, segments) combine in any order to the serial result.
QF_HOST_DEVICE float max_combine(float a, float b) { return a > b ? a : b; }

// max |x| over a run; exact, so partial maxima may be combined in any order.
template <class T>
QF_HOST_DEVICE float absmax_run(const T* x, int64_t n) {
  float amax = 0.0f;  // +0: an empty run or a run of +-0 gives absmax +0 (and scale +0)
  for (int64_t j = 0; j < n; ++j) amax = absmax_step(amax, to_f32(x[j]));
  return amax;
}

template <class T>
QF_HOST_DEVICE void quantize_run(const T* x, int64_t n, float m, int8_t* q) {
  for (int64_t j = 0; j < n; ++j) q[j] = quantize_value(to_f32(x[j]), m);
}

// One decoded value: q * scale in float32 (then rounded once to the output type).
QF_HOST_DEVICE float dequantize_value(int8_t q, float scale) { return static_cast<float>(q) * scale; }

// T = float, half_t or bf16_t: decoded in float32, rounded once to T.
template <class T>
QF_HOST_DEVICE void dequantize_run(const int8_t* q, int64_t n, float scale, T* y) {
  for (int64_t j = 0; j < n; ++j) from_f32(dequantize_value(q[j], scale), y + j);
}

// Kernels over n_units units of unit_len consecutive values each (n_units * unit_len values
// in all; unit_len may be 0, then every scale is 0). T = float, half_t or bf16_t: the input
// type for quantize, the output type for dequantize.
// CPU (int8_cpu.cpp), threaded:
template <class T>
void quantize_cpu(const T* x, int64_t n_units, int64_t unit_len, int8_t* q, float* scale);
template <class T>
void dequantize_cpu(const int8_t* q, const float* scale, int64_t n_units, int64_t unit_len, T* y);
// CUDA (int8_cuda.cu): launched on `stream` (a cudaStream_t) on the current device; every
// pointer is device memory. Units that do not fit one CTA (per-tensor, very long rows) take
// two extra small kernels and a stream-ordered workspace of a few bytes per 16K values.
template <class T>
void quantize_cuda(const T* x, int64_t n_units, int64_t unit_len, int8_t* q, float* scale, void* stream);
template <class T>
void dequantize_cuda(const int8_t* q, const float* scale, int64_t n_units, int64_t unit_len, T* y, void* stream);

}  // namespace qf::int8
