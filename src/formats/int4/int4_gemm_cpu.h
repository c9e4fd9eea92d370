// int4's weight-only GEMM on the CPU (int4_gemm_cpu.cpp): Y [N, M] = X [N, K] . W^T, X float32,
// W decoded a kPanelRows x kTileK tile at a time by the instruction set's decoder into exactly
// the values of int4's dequantize and multiplied in float32 (gemm/weight_only_cpu.h); for N <= 4
// and group sizes that are multiples of 32 the shared fused 4-bit kernel (gemm/nibble_gemm_cpu.h)
// decodes in registers instead. Threaded; results independent of the thread count.
#pragma once
#include <cstdint>

#include "gemm/cpu_isa.h"

namespace qf::gemm {

// qweight uint8 [M, K / 2], scales float32 [M, K / gs], zeros uint8 [M, K / gs] or nullptr
// (symmetric); K % gs == 0, gs a positive multiple of 8. tiles: the same buffers in int4's
// "tiles" layout (formats/int4/int4.h; M % 16 == 0), decoded through the tile path only.
void int4_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const uint8_t* qweight, const float* scales,
                   const uint8_t* zeros, int64_t gs, float* Y, bool tiles = false);

// int4's leaf kernels, one table per instruction set (plain C++ in int4_gemm_cpu.cpp, the others
// in int4_gemm_cpu_avx2.cpp and int4_gemm_cpu_avx512.cpp).
struct Int4CpuKernels {
  // Flat elements [i0, i0 + len) (groups of gs, zeros == nullptr: symmetric), exactly as
  // dequantize (float32), written to out.
  void (*decode)(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t gs, int64_t i0, int64_t len,
                 float* out);
};
const Int4CpuKernels& int4_cpu_kernels();  // the table of active_isa()
namespace k_scalar {
const Int4CpuKernels& int4_kernels();
}
#if QF_GEMM_X86
namespace k_avx2 {
const Int4CpuKernels& int4_kernels();
}
namespace k_avx512 {
const Int4CpuKernels& int4_kernels();
}
#endif

}  // namespace qf::gemm
