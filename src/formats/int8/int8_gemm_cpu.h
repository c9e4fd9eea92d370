// int8's weight-only GEMM on the CPU (int8_gemm_cpu.cpp): Y [N, M] = X [N, K] . W^T, X float32.
// For N <= 4 and scale units that are multiples of 16 the instruction set's fused kernel scales
// each unit's float32 sum of q x once; otherwise the values q * s are decoded exactly as int8's
// dequantize, a tile at a time, and multiplied in float32 (gemm/weight_only_cpu.h). Threaded;
// results independent of the thread count. (The int8 x int8 product is gemm/int8_int8.h.)
#pragma once
#include <cstdint>

#include "gemm/cpu_isa.h"

namespace qf::gemm {

// codes q [M, K] with one float32 scale per unit of `unit` values along a row: the scale of row
// m, unit u is scales[m * scale_stride + u] (int8's row granularity: unit = K, stride 1; group:
// unit = group_size, stride K / unit; tensor: unit = K, stride 0). unit >= 1 divides K.
void int8_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const int8_t* q, const float* scales, int64_t unit,
                   int64_t scale_stride, float* Y);

// An int8 weight [M, K] with one float32 scale per unit of L values along a row (int8's
// granularities: row L = K, group L = group_size, tensor L = K with scale_stride 0): the scale
// of row m, unit u is scales[m * scale_stride + u].
struct Int8Weights {
  const int8_t* q;
  const float* scales;
  int64_t K, L, scale_stride;
};

// int8's leaf kernels, one table per instruction set (int8_gemm_cpu_avx2.cpp; the plain C++
// table is empty and AVX-512 uses the AVX2 kernel).
struct Int8CpuKernels {
  // Fused weight-only GEMM for few activation rows (N <= 4): Y[j * ldy + i] = sum_u
  // s(m0 + i, u) * sum_{k in u} q[m0 + i, k] X[j, k] for i < MR <= kPanelRows (L % 16 == 0):
  // the scale applied to each unit's float32 sum, not to each value (within float32 rounding of
  // the dequantized product). nullptr in tables without it (the tile path runs).
  void (*gemm)(const Int8Weights& w, int64_t m0, int64_t MR, const float* X, int64_t N, float* Y, int64_t ldy);
};
const Int8CpuKernels& int8_cpu_kernels();  // the table of active_isa()
namespace k_scalar {
const Int8CpuKernels& int8_kernels();
}
#if QF_GEMM_X86
namespace k_avx2 {
const Int8CpuKernels& int8_kernels();
}
namespace k_avx512 {
const Int8CpuKernels& int8_kernels();
}
#endif

}  // namespace qf::gemm
