// The int8 block rule of GGML's 8-bit formats, written once for q8_0 and q8_1: llama.cpp's
// ggml/src/ggml-quants.c `quantize_row_q8_0_ref` and `quantize_row_q8_1_ref` compute the scale
// and the codes of a block with the same lines (q8_1 then adds its `s` field). Each format's
// header (formats/q8_0/q8_0.h, formats/q8_1/q8_1.h) states its byte layout and uses these.
//
// Quantize one block x[0..QK-1] (float32 arithmetic, every operation rounded separately):
//   amax = max |x|;  d = amax / 127;  id = d != 0 ? 1 / d : 0
//   q    = roundf(x * id)          (round half away from zero; |q| <= 127)
// The block stores fp16(d), round to nearest even. Dequantize: x' = q * float(stored d).
// Where 1/d overflows to inf (amax < ~3.7e-37), x * id is +-inf or NaN; llama.cpp's int8
// conversion of that is undefined in C and yields 0 on x86-64 (so does numpy's astype, which
// the gguf package uses); we define q = 0 there.
#pragma once
#include <cmath>
#include <cstdint>

#include "common/fp16.h"

namespace qf::int8_block {

// One code from a float32 value and the block's reciprocal scale.
QF_HOST_DEVICE int8_t quantize_value(float x, float id) {
  const float v = x * id;
  if (!(v == v) || v == INFINITY || v == -INFINITY) return 0;  // see the header comment
  const float r = roundf(v);                                   // |v| <= 127 (+ rounding) since |x| <= amax
  return static_cast<int8_t>(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
}

// The codes of x[0..QK-1] into qs[0..QK-1]; returns the unrounded float32 scale d, which the
// caller stores as fp16 (q8_1 also forms its `s` from it). T = float, half_t or bf16_t.
template <int QK, class T>
QF_HOST_DEVICE float quantize(const T* x, int8_t* qs) {
  float amax = 0.0f;
  for (int j = 0; j < QK; ++j) {
    const float a = fabsf(to_f32(x[j]));  // fabsf, not a sign test: |-0.0| must be +0.0
    amax = amax > a ? amax : a;
  }
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < QK; ++j) qs[j] = quantize_value(to_f32(x[j]), id);
  return d;
}

// y[j] = qs[j] * float(d) for j in [0, QK): the decoded values, float32.
template <int QK>
QF_HOST_DEVICE void dequantize(half_t d, const int8_t* qs, float* y) {
  const float df = fp16_bits_to_fp32(d.bits);
  for (int j = 0; j < QK; ++j) y[j] = static_cast<float>(qs[j]) * df;
}

}  // namespace qf::int8_block
