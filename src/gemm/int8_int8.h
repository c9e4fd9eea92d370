// int8 x int8 -> int32 GEMM on the CPU: out[n, m] = sum_k A[n, k] * B[m, k], i.e. A . B^T
// with A [N, K] and B [M, K] row-major (bitsandbytes' int8_linear_matmul convention: both
// operands K-contiguous, output [N, M]). Integer arithmetic, so the result is exact and
// independent of the summation order, instruction set and thread count, as long as it fits in
// int32: |a * b| <= 128 * 128 = 2^14, so K <= kInt8MaxK keeps every sum below 2^31.
//
// The fused form (int8_linear_cpu) is bitsandbytes' int8_linear_matmul followed by
// int8_mm_dequant (and the bias / ReLU of a linear layer) in one pass: each int32 tile is scaled
// while it is still in cache and written once in the output type.
#pragma once
#include <cstdint>

namespace qf::gemm {

// Largest K for which an int8 dot product cannot overflow int32: 2^14 * K <= 2^31 - 1.
constexpr int64_t kInt8MaxK = 131071;

// A: int8 [N, K], B: int8 [M, K], out: int32 [N, M]; requires 0 <= K <= kInt8MaxK.
// Threads take panels of 8 rows of B x up to 64 rows of A (leaf kernels: gemm/cpu_kernels.h).
void int8_matmul_cpu(const int8_t* A, const int8_t* B, int32_t* out, int64_t N, int64_t M, int64_t K);

// out[n, m] = relu?( fl(float(acc[n, m]) * fl(fl(x_scale[n] * w_scale[m]) * scale_c)) + bias[m] )
// with acc = int8_matmul(A, B), all float32, rounded once to T (float, half_t or bf16_t).
// x_scale: float32 [N] (x_scale_per_row) or [1]; w_scale: float32 [M] or [1]; bias: float32 [M]
// or nullptr. The ReLU maps NaN to NaN and -0 to -0 (max(v, 0) written as v < 0 ? 0 : v).
template <class T>
void int8_linear_cpu(const int8_t* A, const float* x_scale, bool x_scale_per_row, const int8_t* B, const float* w_scale,
                     bool w_scale_per_row, const float* bias, bool relu, float scale_c, T* out, int64_t N, int64_t M,
                     int64_t K);

// CUDA: activation-row count up to which the integer GEMMs (int8, int4, q4_0 x q8_1) use the
// warp-per-rows GEMV kernel instead of 64 x 64 tiles.
constexpr int64_t kIntGemvMaxN = 16;

// CUDA (int_gemm_cuda.cu): the same two products on device pointers, launched on `stream`
// (dp4a over 64 x 64 output tiles). Same results bit for bit: the sums are exact integers and
// the fused epilogue is the formula above, operation for operation. N <= kIntGemvMaxN: GEMV.
void int8_matmul_cuda(const int8_t* A, const int8_t* B, int32_t* out, int64_t N, int64_t M, int64_t K, void* stream);
template <class T>
void int8_linear_cuda(const int8_t* A, const float* x_scale, bool x_scale_per_row, const int8_t* B,
                      const float* w_scale, bool w_scale_per_row, const float* bias, bool relu, float scale_c, T* out,
                      int64_t N, int64_t M, int64_t K, void* stream);

}  // namespace qf::gemm
