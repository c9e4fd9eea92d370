// int4 x int4 -> int32 GEMM on the CPU: out[n, m] = sum_k A[n, k] * B[m, k] (A . B^T) for
// symmetric int4 operands, both packed two signed codes per byte as in formats/int4
// (element 2j in the low nibble, 2j+1 in the high nibble, two's complement, -8..7).
// Exact: |a * b| <= 64, so K <= kInt4MaxK keeps every sum inside int32.
#pragma once
#include <cstdint>

#include "gemm/int8_int8.h"

namespace qf::gemm {

// Largest K for which an int4 dot product cannot overflow int32: 64 * K <= 2^31 - 1.
constexpr int64_t kInt4MaxK = 33554431;

// A: uint8 [N, K/2], B: uint8 [M, K/2] (packed), out: int32 [N, M]; K even, K <= kInt4MaxK.
// A (the activations, usually few rows) is unpacked once to int8 in the order the leaf kernels
// read it (int4_split_rows); B stays packed and is unpacked in registers (gemm/cpu_kernels.h).
void int4_matmul_cpu(const uint8_t* A, const uint8_t* B, int32_t* out, int64_t N, int64_t M, int64_t K);

// Rows of packed codes [N, K/2] -> int8 [N, Kp], Kp = K rounded up to 128: per 128 values the 64
// even elements, then the 64 odd ones (the low and the high nibbles of 64 packed bytes), zeros
// after K.
void int4_split_rows(const uint8_t* A, int64_t N, int64_t K, int8_t* out);

// CUDA (int_gemm_cuda.cu): the same product on device pointers, launched on `stream` (nibbles
// sign-extended to bytes in registers, dp4a over 64 x 64 output tiles); exact, so equal to the
// CPU's.
void int4_matmul_cuda(const uint8_t* A, const uint8_t* B, int32_t* out, int64_t N, int64_t M, int64_t K, void* stream);

}  // namespace qf::gemm
