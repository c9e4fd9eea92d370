// q4_0 weights x q8_1 activations, llama.cpp's pair (ggml-cpu ggml_vec_dot_q4_0_q8_0, whose
// q8_0 codes are q8_1's; ggml-cuda vecdotq.cuh vec_dot_q4_0_q8_1): per 32-block an exact integer
// dot product of the codes, scaled by d_w * d_a, summed over blocks in float32.
#pragma once
#include <cstdint>

#include "formats/q4_0/q4_0.h"
#include "formats/q8_1/q8_1.h"
#include "gemm/int8_int8.h"

namespace qf::gemm {

// W: [M, K/32] q4_0 blocks; A: [N, K/32] q8_1 blocks; out: float32 [M, N] row-major (W . A^T).
// Per block: d_w * d_a * sum_j (q_w[j] - 8) * q_a[j] (integer sums exact; llama.cpp's CPU
// kernel folds the -8 the same way, while its CUDA kernel uses q8_1's rounded s field instead),
// summed over blocks in float32 in an order fixed by the instruction set (not by threads). The
// AVX-512 kernel scales the 8 lane sums of a block (4 codes each) separately, so its float32
// error is relative to sum |w a|, not to the block's (possibly cancelling) total.
void gemm_q4_0_q8_1_cpu(const q4_0::block_q4_0* W, const q8_1::block_q8_1* A, float* out, int64_t M, int64_t N,
                        int64_t K);

// The same product with out[i * ldo_m + j * ldo_n] (gemm_q4_0_q8_1_cpu: ldo_m = N, ldo_n = 1;
// a linear layer's [N, M] output: ldo_m = 1, ldo_n = M).
void q4_0_q8_1_cpu(const q4_0::block_q4_0* W, const q8_1::block_q8_1* A, int64_t M, int64_t N, int64_t K, float* out,
                   int64_t ldo_m, int64_t ldo_n);

// llama.cpp's linear layer: x [N, K] (T = float, half_t or bf16_t) quantized to q8_1 on the fly
// (exactly q8_1::quantize_cpu's bytes), then Y [N, M] = q4_0_q8_1(W, x_q)^T. Bitwise equal to
// gemm_q4_0_q8_1_cpu(W, quantize_q8_1(x)) transposed.
template <class T>
void linear_q4_0_cpu(const T* x, int64_t N, int64_t K, const q4_0::block_q4_0* W, int64_t M, float* out);

// CUDA (int_gemm_cuda.cu): the same product on device pointers, launched on `stream`, with
// out[m * ldo_m + n * ldo_n] of T (float, half_t or bf16_t; rounded once from float32). The
// exact int32 block sums are the CPU's; the float32 sum over blocks runs in another order (and
// on the tensor cores each block's sum is scaled by d_w, then by d_a: two roundings).
// N <= kIntGemvMaxN (int8_int8.h): one warp per 4 weight rows (weights streamed once per 8
// activation rows). Larger N on sm_80+ with a 16-byte aligned `workspace` of
// q4_0_q8_1_cuda_workspace_bytes(M, N, K): both operands unpacked there to int8 codes and float
// scales, then the pipelined int8 tensor-core kernel (int8_mma_cuda.cuh); without one (or on
// older GPUs), tiles that fetch the blocks through registers.
int64_t q4_0_q8_1_cuda_workspace_bytes(int64_t M, int64_t N, int64_t K);
template <class T>
void q4_0_q8_1_cuda(const q4_0::block_q4_0* W, const q8_1::block_q8_1* A, int64_t M, int64_t N, int64_t K, T* out,
                    int64_t ldo_m, int64_t ldo_n, void* workspace, void* stream);

}  // namespace qf::gemm
