// Device-side reads of the GGML blocks that more than one GEMM kernel streams (the weight-only
// GEMV of gemm/weight_only_cuda.cuh and the integer GEMMs of gemm/int_gemm_cuda.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/fp16.h"

namespace qf::gemm {

// The q4_0 block at `b` (formats/q4_0: fp16 d, then qs[16]; 18 bytes, so only 2-byte aligned)
// read as 9 halfwords: returns d as float, qs as 4 little-endian words (qs[4i .. 4i+3] in
// word i: element j in the low nibble of qs[j], element j + 16 in the high nibble).
__device__ __forceinline__ float load_q4_0_block(const uint16_t* __restrict__ b, uint32_t (&qs)[4]) {
  uint16_t h[9];
#pragma unroll
  for (int i = 0; i < 9; ++i) h[i] = __ldg(b + i);
#pragma unroll
  for (int i = 0; i < 4; ++i) qs[i] = uint32_t(h[1 + 2 * i]) | uint32_t(h[2 + 2 * i]) << 16;
  return fp16_bits_to_fp32(h[0]);
}

}  // namespace qf::gemm
