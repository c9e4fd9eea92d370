// q4_0's weight-only GEMM on the CPU (q4_0_gemm_cpu.cpp): Y [N, M] = X [N, K] . W^T, X float32,
// W decoded a kPanelRows x kTileK tile at a time by the instruction set's decoder into exactly
// the values of q4_0's dequantize and multiplied in float32 (gemm/weight_only_cpu.h); for N <= 4
// the shared fused 4-bit kernel (gemm/nibble_gemm_cpu.h) decodes in registers instead. Threaded;
// results independent of the thread count. (The integer q4_0 x q8_1 product is gemm/q4_0_q8_1.h.)
#pragma once
#include <cstdint>

#include "formats/q4_0/q4_0.h"
#include "gemm/cpu_isa.h"

namespace qf::gemm {

// W as [M, K / 32] blocks, K % 32 == 0.
void q4_0_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const q4_0::block_q4_0* W, float* Y);

// q4_0's leaf kernels, one table per instruction set (plain C++ in q4_0_gemm_cpu.cpp, the others
// in q4_0_gemm_cpu_avx2.cpp and q4_0_gemm_cpu_avx512.cpp).
struct Q4_0CpuKernels {
  // n_blocks consecutive blocks (32 values each), exactly as dequantize (float32), to out.
  void (*decode)(const q4_0::block_q4_0* blocks, int64_t n_blocks, float* out);
};
const Q4_0CpuKernels& q4_0_cpu_kernels();  // the table of active_isa()
namespace k_scalar {
const Q4_0CpuKernels& q4_0_kernels();
}
#if QF_GEMM_X86
namespace k_avx2 {
const Q4_0CpuKernels& q4_0_kernels();
}
namespace k_avx512 {
const Q4_0CpuKernels& q4_0_kernels();
}
#endif

}  // namespace qf::gemm
