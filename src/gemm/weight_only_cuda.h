// The contract of every format's CUDA weight-only GEMM (declared in formats/<fmt>/<fmt>_gemm_cuda.h,
// built on gemm/weight_only_policy_cuda.cuh); plain C++, so that the bindings can include it.
//
// Dimensions (the GEMM terms of every GEMM entry point, docs/developer.md): Y [N, M] = X [N, K] .
// W^T, with N activation rows, K the reduction, M weight rows (output features); the weight W
// [M, K] is in the format's packed buffers. Arguments in the order X, N, K, M, W's buffers, Y,
// bias, workspace (where the format's GEMM can use one), stream.
//
// X [N, K] of T (float, half_t or bf16_t), Y [N, M] of T (the activations' dtype), device
// pointers, launched on `stream` (a cudaStream_t) of the current device. X and Y 16-byte aligned,
// K a multiple of 32 (16 for mixed2bit). Summation in float32 (FMA) with each unit's scale applied
// to the unit's sum (see gemm/weight_only_cuda.cuh), one rounding to T at the end; bias [M] of T
// (or nullptr) is added to the rounded result in float32 and rounded again, as a separate
// `y += bias` in T would. Formats' extra conditions are in their headers (std::invalid_argument
// otherwise). With 16-bit activations on sm_80+ the products run on tensor cores with each weight
// rounded to the activations' type first (gemm/weight_only_mma_cuda.cuh), except in the offset
// GEMV (one fp16 row of formats with its hooks, gemm/weight_only_gemv_cuda.cuh), which multiplies
// the exact codes and applies each scale to a float32 sum.
//
// Workspace: device scratch that the caller allocates (with its array library, on the stream's
// device) and passes beside the stream; weight_only_workspace_bytes_cuda(N, M, K) says how many
// bytes a product of N activation rows by M weight rows, K deep, may use (0: none). With a smaller or no
// workspace the product is the same to within float32 rounding, and may be slower: the prefill
// kernel's stream-K schedule (gemm/weight_only_prefill_cuda.cuh) sums the K spans of a tile cut
// between two CTAs there.
#pragma once
#include <cstdint>

namespace qf::gemm {

struct GemmWorkspace {
  void* ptr = nullptr;  // device memory, 16-byte aligned, or nullptr
  int64_t bytes = 0;
};

// Bytes of workspace a weight-only product of N x M, K deep, may use on the current device (CUDA
// builds; row counts that never take one return 0 without a CUDA call).
int64_t weight_only_workspace_bytes_cuda(int64_t N, int64_t M, int64_t K);

// log2(v) for a power of two v >= 1, else -1.
inline int log2_exact(int64_t v) {
  if (v < 1 || (v & (v - 1))) return -1;
  int s = 0;
  while ((int64_t(1) << s) < v) ++s;
  return s;
}

}  // namespace qf::gemm
