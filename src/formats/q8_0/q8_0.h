// q8_0 pack spec: GGML's 8-bit block format, byte-compatible with llama.cpp
// (ggml/src/ggml-common.h `block_q8_0`, ggml/src/ggml-quants.c `quantize_row_q8_0_ref`)
// and the gguf package's numpy `Q8_0`.
//
// Layout: a row of K values (K % 32 == 0) is K/32 consecutive 34-byte blocks:
//
//   byte 0..1   d       fp16 little-endian scale
//   byte 2..33  qs[32]  int8 codes, element j in qs[j]
//
// Quantize one block x[0..31] (float32 arithmetic; amax, d and q are the int8 block rule
// that q8_0 shares with q8_1, written once in common/int8_block.h with its corner case):
//   amax = max |x|;  d = amax / 127;  id = d != 0 ? 1 / d : 0
//   q    = roundf(x * id)            (round half away from zero)
//   stored d = fp16(d), round to nearest even
// Dequantize: x' = q * float(stored d). q8_1 (formats/q8_1/q8_1.h) is this plus a field s.
#pragma once
#include <cstdint>

#include "common/fp16.h"
#include "common/int8_block.h"

namespace qf::q8_0 {

constexpr int QK = 32;  // values per block (QK8_0)

struct block_q8_0 {
  half_t d;       // scale, fp16
  int8_t qs[QK];  // codes
};
static_assert(sizeof(block_q8_0) == 2 + QK, "wrong q8_0 block size/padding");

template <class T>
QF_HOST_DEVICE void quantize_block(const T* x, block_q8_0* y) {
  y->d.bits = fp32_to_fp16_bits(int8_block::quantize<QK>(x, y->qs));
}

QF_HOST_DEVICE void dequantize_block(const block_q8_0* x, float* y) { int8_block::dequantize<QK>(x->d, x->qs, y); }

// Kernels over n_blocks consecutive blocks; T = float, half_t or bf16_t (the input type for
// quantize, the output type for dequantize: decoded in float32, rounded once to T).
// CPU (q8_0_cpu.cpp), threaded for large inputs:
template <class T>
void quantize_cpu(const T* x, int64_t n_blocks, block_q8_0* y);
template <class T>
void dequantize_cpu(const block_q8_0* x, int64_t n_blocks, T* y);
// CUDA (q8_0_cuda.cu): launched on `stream` (a cudaStream_t) on the current device.
template <class T>
void quantize_cuda(const T* x, int64_t n_blocks, block_q8_0* y, void* stream);
template <class T>
void dequantize_cuda(const block_q8_0* x, int64_t n_blocks, T* y, void* stream);

}  // namespace qf::q8_0
