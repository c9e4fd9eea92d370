// Weight-only GEMM on the CPU, shared by every weight format: Y = X . W^T with float32
// activations X [N, K] and quantized weights W [M, K] that the caller's decoder turns into
// float32 one tile at a time (the weights are never fully materialized).
//
// Work items are panels of kPanelRows weight rows (and, when there are fewer panels than
// threads, chunks of activation rows), handed out to threads in chunks (common/thread_pool.h). A panel is decoded kc
// columns at a time into a kPanelRows x kc float tile (32 KiB for kc = kTileK: it stays in L1) and multiplied with
// every activation row by the instruction set's leaf kernel (gemm/cpu_kernels.h: 4 x 4 or 8 x 1 register blocks of FMAs
// on AVX-512 / AVX2, 8 partial sums in plain C++). Each output element is produced by one thread in one fixed order, so
// the result does not depend on the thread count.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/fp16.h"
#include "common/parallel.h"
#include "common/thread_pool.h"
#include "gemm/cpu_kernels.h"

namespace qf::gemm {

// Kept for callers that size their decode buffers by it: rows per decoded tile.
constexpr int64_t kWeightTileRows = kPanelRows;

// decode(m0, m1, k0, k1, float* tile) must write W[m0:m1, k0:k1] as float32 [m1 - m0, k1 - k0]
// (m1 - m0 <= kPanelRows; k0 a multiple of kc, k1 = min(K, k0 + kc)). X float32 [N, K], Y
// float32 [N, M]. `decode` is called from several threads at once.
template <class DecodeTile>
void weight_only_gemm_tiles(const float* X, int64_t N, int64_t K, int64_t M, int64_t kc, DecodeTile&& decode,
                            float* Y) {
  if (N <= 0 || M <= 0) return;
  if (K <= 0) {
    std::fill(Y, Y + N * M, 0.0f);
    return;
  }
  kc = std::max<int64_t>(1, std::min(kc, K));
  const CpuKernels& kern = cpu_kernels();
  const int64_t panels = (M + kPanelRows - 1) / kPanelRows;
  // Fewer panels than threads (small M, many activation rows): also split N.
  int64_t n_chunks = 1;
  if (panels < num_threads() && N >= 32) n_chunks = std::min<int64_t>(num_threads(), N / 16);
  const int64_t n_per = (N + n_chunks - 1) / n_chunks;
  // About 2^20 multiply-adds per thread at least; below that a thread costs more than it saves.
  const int64_t work = kPanelRows * K * std::min<int64_t>(N, n_per);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(work, 1));
  parallel_chunks(panels * n_chunks, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> tile(static_cast<size_t>(kPanelRows * kc));
    std::vector<float> acc(static_cast<size_t>(kPanelRows * std::min(N, n_per)));
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t p = w / n_chunks, c = w % n_chunks;
      const int64_t m0 = p * kPanelRows, m1 = std::min(M, m0 + kPanelRows), mt = m1 - m0;
      const int64_t n0 = c * n_per, n1 = std::min(N, n0 + n_per);
      if (n0 >= n1) continue;
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t k1 = std::min(K, k0 + kc);
        decode(m0, m1, k0, k1, tile.data());
        kern.f32_panel(X + n0 * K + k0, K, n1 - n0, tile.data(), k1 - k0, mt, k1 - k0, acc.data(), k0 > 0);
      }
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t i = 0; i < mt; ++i) Y[n * M + m0 + i] = acc[(n - n0) * kPanelRows + i];
    }
  });
}

// kernel(m0, mr) on every panel of kPanelRows weight rows (mr of them), threaded: the fused
// small-N kernels' driver. A thread takes about 2^20 multiply-adds at least (a tenth of that
// with `slow`: a decoder that costs many times a multiply-add per value, where even a small
// weight is worth a second thread).
template <class Panel>
void fused_panels(int64_t M, int64_t K, int64_t N, Panel&& kernel, bool slow = false) {
  const int64_t panels = (M + kPanelRows - 1) / kPanelRows;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / (slow ? 10 : 1) / (kPanelRows * K * N));
  parallel_chunks(panels, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) kernel(p * kPanelRows, std::min(kPanelRows, M - p * kPanelRows));
  });
}

// The original interface: decode_rows(m0, m1, float* tile) writes whole rows [m0, m1) of W as
// float32 [m1 - m0, K] (at most kWeightTileRows rows). Used by formats whose decoder works on
// whole rows; the multiply is the same tiled driver with kc = K.
template <class DecodeRows>
void weight_only_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, DecodeRows&& decode_rows, float* Y) {
  weight_only_gemm_tiles(
      X, N, K, M, K, [&](int64_t m0, int64_t m1, int64_t, int64_t, float* tile) { decode_rows(m0, m1, tile); }, Y);
}

// x [n] of float, half_t or bf16_t -> float32 (exact), threaded for large n.
template <class T>
void to_float32(const T* x, int64_t n, float* out) {
  parallel_for(n, int64_t(1) << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = to_f32(x[i]);
  });
}

}  // namespace qf::gemm
