#include "gemm/nibble_gemm_cpu.h"

#include <vector>

#include "gemm/weight_only_cpu.h"

namespace qf::gemm {

bool nibble_gemm_cpu(const NibbleWeights& w, const float* X, int64_t N, int64_t M, float* Y) {
  const CpuKernels& kern = cpu_kernels();
  if (!kern.nibble_gemm || N < 1 || N > 4 || M <= 0 || w.K <= 0 || w.K % 32) return false;
  const int64_t K = w.K;
  std::vector<float> xs;
  if (nibble_split_order(w.fmt)) {  // each run of 32: the even elements, then the odd ones
    xs.resize(static_cast<size_t>(N * K));
    for (int64_t i = 0; i < N * K; i += 32)
      for (int t = 0; t < 16; ++t) {
        xs[i + t] = X[i + 2 * t];
        xs[i + 16 + t] = X[i + 2 * t + 1];
      }
    X = xs.data();
  }
  fused_panels(M, K, N, [&](int64_t m0, int64_t mr) { kern.nibble_gemm(w, m0, mr, X, N, Y + m0, M); });
  return true;
}

}  // namespace qf::gemm
