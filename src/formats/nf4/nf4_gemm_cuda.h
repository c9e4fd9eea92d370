// nf4's weight-only GEMM on the GPU (nf4_gemm_cuda.cu), under the contract of gemm/weight_only_cuda.h:
// Y [N, M] = X [N, K] . W^T, W [M, K] as nf4's packed uint8 [M K / 2] and absmax float32
// [M K / blocksize] (decoded), blocks over the flattened W. Needs K % 32 == 0.
#pragma once
#include <cstdint>

#include "gemm/weight_only_cuda.h"

namespace qf::gemm {

template <class T>
void nf4_gemm_cuda(const T* X, int64_t N, int64_t K, int64_t M, const uint8_t* packed, const float* absmax,
                   int64_t blocksize, T* Y, const T* bias, GemmWorkspace ws, void* stream);

}  // namespace qf::gemm
