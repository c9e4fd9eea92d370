// nf4's weight-only GEMM on the CPU (nf4_gemm_cpu.cpp): Y [N, M] = X [N, K] . W^T, X float32,
// W decoded a kPanelRows x kTileK tile at a time by the instruction set's decoder into exactly
// the values of nf4's dequantize and multiplied in float32 (gemm/weight_only_cpu.h); for N <= 4
// the shared fused 4-bit kernel (gemm/nibble_gemm_cpu.h) decodes in registers instead.
// Threaded; results independent of the thread count.
#pragma once
#include <cstdint>

#include "gemm/cpu_isa.h"

namespace qf::gemm {

// packed uint8 [ceil(M K / 2)], absmax float32 [ceil(M K / blocksize)] (decoded), blocks over
// the flattened W (so they may straddle rows), blocksize a power of two in [32, 4096].
void nf4_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const uint8_t* packed, const float* absmax,
                  int64_t blocksize, float* Y);

// nf4's leaf kernels, one table per instruction set (plain C++ in nf4_gemm_cpu.cpp, the others in
// nf4_gemm_cpu_avx2.cpp and nf4_gemm_cpu_avx512.cpp).
struct Nf4CpuKernels {
  // Flat elements [i0, i0 + len) of a tensor with blocks of 2^log2_bs values, exactly as
  // dequantize (float32), written to out.
  void (*decode)(const uint8_t* packed, const float* absmax, int log2_bs, int64_t i0, int64_t len, float* out);
};
const Nf4CpuKernels& nf4_cpu_kernels();  // the table of active_isa()
namespace k_scalar {
const Nf4CpuKernels& nf4_kernels();
}
#if QF_GEMM_X86
namespace k_avx2 {
const Nf4CpuKernels& nf4_kernels();
}
namespace k_avx512 {
const Nf4CpuKernels& nf4_kernels();
}
#endif

}  // namespace qf::gemm
