// int4's weight-only GEMM on the GPU (int4_gemm_cuda.cu), under the contract of gemm/weight_only_cuda.h:
// Y [N, M] = X [N, K] . W^T, W [M, K] as qweight uint8 [M, K / 2], scales float32 [M, K / gs] and
// zeros uint8 [M, K / gs] or nullptr (symmetric), or (tiles) the same buffers in int4's "tiles"
// layout (formats/int4/int4.h; M % 16 == 0). Needs gs = group_size = 32 * 2^j dividing K.
#pragma once
#include <cstdint>

#include "gemm/weight_only_cuda.h"

namespace qf::gemm {

template <class T>
void int4_gemm_cuda(const T* X, int64_t N, int64_t K, int64_t M, const uint8_t* qweight, const float* scales,
                    const uint8_t* zeros, int64_t gs, T* Y, const T* bias, GemmWorkspace ws, void* stream,
                    bool tiles = false);

// The group sizes the CUDA kernel takes (the Python layers ask before choosing one).
inline bool int4_gemm_cuda_supports(int64_t group_size) {
  return group_size % 32 == 0 && log2_exact(group_size / 32) >= 0;
}

}  // namespace qf::gemm
