// q4_0 pack spec: GGML's 4-bit block format, byte-compatible with llama.cpp
// (ggml/src/ggml-common.h `block_q4_0`, ggml/src/ggml-quants.c `quantize_row_q4_0_ref`)
// and the gguf package's numpy `Q4_0`.
//
// Layout: a row of K values (K % 32 == 0) is K/32 consecutive 18-byte blocks:
//
//   byte 0..1   d      fp16 little-endian scale (delta)
//   byte 2..17  qs[16] qs[j] = q[j] | q[j + 16] << 4   (element j low nibble, j+16 high)
//
// Quantize one block x[0..31] (float32 arithmetic, every operation rounded separately):
//   max = the element with the largest |x| (the first one on ties), with its sign
//   d   = max / -8                 (float32)
//   id  = d != 0 ? 1 / d : 0       (from the unrounded float32 d)
//   q   = min(15, trunc(fl32(fl32(x * id) + 8.5)))   -- never a fused multiply-add
//   stored d = fp16(d), round to nearest even
// Dequantize: x' = (q - 8) * float(stored d).
//
// Corner cases, all also the gguf package's behaviour:
// * An all-zero block starting with -0.0 has max = -0.0 and so d = +0 (bits 0x0000).
//   llama.cpp's loop starts from max = +0 and stores -0 (0x8000) there; the decoded
//   values are the same zeros.
// * When |d| is so small that 1/d overflows to inf (|max| < ~2.4e-38), x*id is +-inf or
//   NaN. llama.cpp's (int8_t) conversion of that is undefined in C; on x86-64 it yields 0,
//   and so does numpy's astype. We define q = 0 for a non-finite fl32(x*id) + 8.5. The
//   stored fp16 d of such a block is 0 anyway, so the decoded values are zeros.
#pragma once
#include <cmath>
#include <cstdint>

#include "common/fp16.h"

namespace qf::q4_0 {

constexpr int QK = 32;  // values per block (QK4_0)

struct block_q4_0 {
  half_t d;            // scale, fp16
  uint8_t qs[QK / 2];  // nibbles: element j low, element j + QK/2 high
};
static_assert(sizeof(block_q4_0) == 2 + QK / 2, "wrong q4_0 block size/padding");

// One 4-bit code from a float32 value and the block's reciprocal scale.
QF_HOST_DEVICE uint8_t quantize_value(float x, float id) {
  const float scaled = x * id;                                 // rounded to float32 ...
  const float v = scaled + 8.5f;                               // ... then the add, rounded again (no FMA)
  if (!(v == v) || v == INFINITY || v == -INFINITY) return 0;  // see the header comment
  const int q = static_cast<int>(v);                           // truncation toward zero; v >= 0 here
  return static_cast<uint8_t>(q < 15 ? q : 15);
}

template <class T>
QF_HOST_DEVICE void quantize_block(const T* x, block_q4_0* y) {
  float amax = -1.0f, max = 0.0f;  // amax < 0 so that element 0 is taken first (even for +-0)
  for (int j = 0; j < QK; ++j) {
    const float v = to_f32(x[j]);
    const float a = fabsf(v);  // fabsf, not a sign test: |-0.0| must be +0.0
    if (amax < a) {
      amax = a;
      max = v;
    }
  }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  y->d.bits = fp32_to_fp16_bits(d);
  for (int j = 0; j < QK / 2; ++j) {
    const uint8_t lo = quantize_value(to_f32(x[j]), id);
    const uint8_t hi = quantize_value(to_f32(x[j + QK / 2]), id);
    y->qs[j] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

QF_HOST_DEVICE void dequantize_block(const block_q4_0* x, float* y) {
  const float d = fp16_bits_to_fp32(x->d.bits);
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = static_cast<float>((x->qs[j] & 0x0F) - 8) * d;
    y[j + QK / 2] = static_cast<float>((x->qs[j] >> 4) - 8) * d;
  }
}

// Kernels over n_blocks consecutive blocks; T = float, half_t or bf16_t (the input type for
// quantize, the output type for dequantize: decoded in float32, rounded once to T).
// CPU (q4_0_cpu.cpp), threaded for large inputs:
template <class T>
void quantize_cpu(const T* x, int64_t n_blocks, block_q4_0* y);
template <class T>
void dequantize_cpu(const block_q4_0* x, int64_t n_blocks, T* y);
// CUDA (q4_0_cuda.cu): launched on `stream` (a cudaStream_t) on the current device.
template <class T>
void quantize_cuda(const T* x, int64_t n_blocks, block_q4_0* y, void* stream);
template <class T>
void dequantize_cuda(const block_q4_0* x, int64_t n_blocks, T* y, void* stream);

}  // namespace qf::q4_0
