// q4_0's weight-only GEMM on the GPU (q4_0_gemm_cuda.cu), under the contract of gemm/weight_only_cuda.h:
// Y [N, M] = X [N, K] . W^T, W [M, K] as [M, K / 32] q4_0 blocks. Needs K % 32 == 0.
#pragma once
#include <cstdint>

#include "formats/q4_0/q4_0.h"
#include "gemm/weight_only_cuda.h"

namespace qf::gemm {

template <class T>
void q4_0_gemm_cuda(const T* X, int64_t N, int64_t K, int64_t M, const q4_0::block_q4_0* W, T* Y, const T* bias,
                    GemmWorkspace ws, void* stream);

}  // namespace qf::gemm
