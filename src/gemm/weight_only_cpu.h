// Weight-only GEMM on the CPU, shared by every weight format: Y = X . W^T with float32
// activations X [N, K] and quantized weights W [M, K] that the caller's decoder turns into
// float32 a tile of rows at a time (the weights are never fully materialized).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/parallel.h"

namespace qf::gemm {

constexpr int64_t kWeightTileRows = 16;

// decode_rows(m0, m1, float* tile) must write rows [m0, m1) of W as float32 [m1 - m0, K].
// Y is float32 [N, M]. Dot products use 8 independent partial sums (a fixed order, so the
// result is the same for any thread count) which the compiler can keep in one vector register.
template <class DecodeRows>
void weight_only_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, DecodeRows&& decode_rows,
                          float* Y) {
  const int64_t n_tiles = (M + kWeightTileRows - 1) / kWeightTileRows;
  parallel_for(n_tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> tile(static_cast<size_t>(kWeightTileRows * K));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t * kWeightTileRows, m1 = std::min(M, m0 + kWeightTileRows);
      decode_rows(m0, m1, tile.data());
      for (int64_t n = 0; n < N; ++n) {
        const float* x = X + n * K;
        for (int64_t m = m0; m < m1; ++m) {
          const float* w = tile.data() + (m - m0) * K;
          float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          int64_t k = 0;
          for (; k + 8 <= K; k += 8)
            for (int l = 0; l < 8; ++l) acc[l] += x[k + l] * w[k + l];
          for (; k < K; ++k) acc[k & 7] += x[k] * w[k];
          Y[n * M + m] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        }
      }
    }
  });
}

}  // namespace qf::gemm
