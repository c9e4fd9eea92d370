// int8 x int8 -> int32 GEMM on the CPU: out[n, m] = sum_k A[n, k] * B[m, k], i.e. A . B^T
// with A [N, K] and B [M, K] row-major (bitsandbytes' int8_linear_matmul convention: both
// operands K-contiguous, output [N, M]). Integer arithmetic, so the result is exact and
// independent of the summation order and thread count, as long as it fits in int32:
// |a * b| <= 128 * 128 = 2^14, so K <= kInt8MaxK keeps every partial sum below 2^31.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/parallel.h"

namespace qf::gemm {

// Largest K for which an int8 dot product cannot overflow int32: 2^14 * K <= 2^31 - 1.
constexpr int64_t kInt8MaxK = 131071;

// Rows of B decoded/reused per tile and rows of A per work item: a tile of B (16 * K bytes)
// stays in L1/L2 while 64 rows of A stream past it, and each A row is reused 16 times.
constexpr int64_t kInt8TileM = 16;
constexpr int64_t kInt8TileN = 64;

// Exact int8 dot product in int32. Written as a plain widening loop, which GCC/Clang
// vectorize (sign-extend + multiply-add of 16-bit lanes); no partial sum can overflow
// under K <= kInt8MaxK.
inline int32_t dot_i8(const int8_t* a, const int8_t* b, int64_t K) {
  int32_t acc = 0;
  for (int64_t k = 0; k < K; ++k) acc += static_cast<int32_t>(a[k]) * static_cast<int32_t>(b[k]);
  return acc;
}

// The tiled driver shared by the int8 and int4 integer GEMMs. rows_b(m0, m1, buf) returns
// a pointer to rows [m0, m1) of B as int8 [m1 - m0, K]: either straight into B (int8) or
// into buf (kInt8TileM * K bytes) after unpacking (int4). Work items are (n-chunk, m-tile)
// pairs, so the output is split among threads even when N or M is small.
template <class RowsB>
void int8_gemm_tiles_cpu(const int8_t* A, int64_t N, int64_t K, int64_t M, RowsB&& rows_b, int32_t* out) {
  if (N <= 0 || M <= 0) return;
  const int64_t m_tiles = (M + kInt8TileM - 1) / kInt8TileM;
  const int64_t n_chunks = (N + kInt8TileN - 1) / kInt8TileN;
  parallel_for(m_tiles * n_chunks, 1, [&](int64_t w0, int64_t w1) {
    std::vector<int8_t> buf(static_cast<size_t>(kInt8TileM * K));
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t mt = w / n_chunks, nc = w % n_chunks;  // m-major: consecutive items share a tile
      const int64_t m0 = mt * kInt8TileM, m1 = std::min(M, m0 + kInt8TileM);
      const int64_t n0 = nc * kInt8TileN, n1 = std::min(N, n0 + kInt8TileN);
      const int8_t* b = rows_b(m0, m1, buf.data());
      for (int64_t n = n0; n < n1; ++n) {
        const int8_t* a = A + n * K;
        for (int64_t m = m0; m < m1; ++m) out[n * M + m] = dot_i8(a, b + (m - m0) * K, K);
      }
    }
  });
}

// A: int8 [N, K], B: int8 [M, K], out: int32 [N, M]; requires 0 <= K <= kInt8MaxK.
void int8_matmul_cpu(const int8_t* A, const int8_t* B, int32_t* out, int64_t N, int64_t M, int64_t K);

}  // namespace qf::gemm
