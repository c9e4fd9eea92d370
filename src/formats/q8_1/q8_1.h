// q8_1 pack spec: GGML's 8-bit activation block, byte-compatible with llama.cpp
// (ggml/src/ggml-common.h `block_q8_1`, ggml/src/ggml-quants.c `quantize_row_q8_1_ref`).
//
// Layout: a row of K values (K % 32 == 0) is K/32 consecutive 36-byte blocks:
//
//   byte 0..1   d       fp16 scale
//   byte 2..3   s       fp16 d * sum(qs), the term that lets a q4_0 x q8_1 dot product fold
//                       q4_0's offset of 8 into one multiply (llama.cpp's vec_dot_q4_0_q8_1)
//   byte 4..35  qs[32]  int8 codes
//
// Quantize one block x[0..31] (float32 arithmetic; amax, d and q are the int8 block rule
// that q8_1 shares with q8_0, written once in common/int8_block.h with its corner case):
//   amax = max |x|;  d = amax / 127;  id = d != 0 ? 1 / d : 0
//   q    = roundf(x * id)            (round half away from zero)
//   s    = fp16(d * sum(q))          with the unrounded float32 d
//   stored d = fp16(d), round to nearest even
// Dequantize: x' = q * float(stored d). Without s this is q8_0 (formats/q8_0/q8_0.h).
#pragma once
#include <cstdint>

#include "common/fp16.h"
#include "common/int8_block.h"

namespace qf::q8_1 {

constexpr int QK = 32;  // values per block (QK8_1)

struct block_q8_1 {
  half_t d;       // scale, fp16
  half_t s;       // d * sum(qs), fp16
  int8_t qs[QK];  // codes
};
static_assert(sizeof(block_q8_1) == 4 + QK, "wrong q8_1 block size/padding");

template <class T>
QF_HOST_DEVICE void quantize_block(const T* x, block_q8_1* y) {
  const float d = int8_block::quantize<QK>(x, y->qs);
  int sum = 0;
  for (int j = 0; j < QK; ++j) sum += y->qs[j];
  y->d.bits = fp32_to_fp16_bits(d);
  y->s.bits = fp32_to_fp16_bits(static_cast<float>(sum) * d);
}

QF_HOST_DEVICE void dequantize_block(const block_q8_1* x, float* y) { int8_block::dequantize<QK>(x->d, x->qs, y); }

// Kernels over n_blocks consecutive blocks; T = float, half_t or bf16_t (the input type for
// quantize, the output type for dequantize: decoded in float32, rounded once to T).
// CPU (q8_1_cpu.cpp), threaded for large inputs:
template <class T>
void quantize_cpu(const T* x, int64_t n_blocks, block_q8_1* y);
template <class T>
void dequantize_cpu(const block_q8_1* x, int64_t n_blocks, T* y);
// CUDA (q8_1_cuda.cu): launched on `stream` (a cudaStream_t) on the current device.
template <class T>
void quantize_cuda(const T* x, int64_t n_blocks, block_q8_1* y, void* stream);
template <class T>
void dequantize_cuda(const block_q8_1* x, int64_t n_blocks, T* y, void* stream);

}  // namespace qf::q8_1
