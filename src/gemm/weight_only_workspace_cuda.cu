// weight_only_workspace_bytes_cuda (gemm/weight_only_cuda.h): the prefill kernel's stream-K
// workspace, bounded before its plan is made (gemm/prefill_plan.h).
#include "common/cuda_utils.cuh"
#include "gemm/prefill_plan.h"
#include "gemm/weight_only_cuda.h"
#include "gemm/weight_only_wgmma_cuda.cuh"

namespace qf::gemm {

int64_t weight_only_workspace_bytes_cuda(int64_t N, int64_t M, int64_t K) {
  if (N <= 64 || M <= 0 || K <= 0 || K % 128 || !cuda_wo::wgmma_built()) return 0;  // (no CUDA call)
  if (cuda::cc_major() != 9) return 0;
  return prefill_workspace_bytes(N, M, cuda::sm_count());
}

}  // namespace qf::gemm
