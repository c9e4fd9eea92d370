#include "gemm/q4_0_q8_1.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/parallel.h"
#include "common/thread_pool.h"
#include "gemm/cpu_kernels.h"

namespace qf::gemm {

namespace {
constexpr int64_t kChunkN = 64;  // activation rows per work item
}  // namespace

void q4_0_q8_1_cpu(const q4_0::block_q4_0* W, const q8_1::block_q8_1* A, int64_t M, int64_t N, int64_t K, float* out,
                   int64_t ldo_m, int64_t ldo_n) {
  if (M <= 0 || N <= 0) return;
  const int64_t nb = K / q4_0::QK;
  if (nb == 0) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) out[m * ldo_m + n * ldo_n] = 0.0f;
    return;
  }
  // The activations as the leaves read them: codes [N, K] contiguous, scales d [N, nb] as
  // float32 (exact). q8_1's s field is not used: the -8 offset is folded exactly in integers.
  std::vector<int8_t> aq(static_cast<size_t>(N * K));
  std::vector<float> ad(static_cast<size_t>(N * nb));
  parallel_for(N * nb, 1 << 14, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      std::memcpy(aq.data() + b * q4_0::QK, A[b].qs, q4_0::QK);
      ad[b] = fp16_bits_to_fp32(A[b].d.bits);
    }
  });
  const CpuKernels& kern = cpu_kernels();
  const int64_t panels = (M + kPanelRows - 1) / kPanelRows, chunks = (N + kChunkN - 1) / kChunkN;
  const int64_t work = kPanelRows * std::min(N, kChunkN) * K;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / work);
  parallel_chunks(panels * chunks, grain, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t m0 = (w / chunks) * kPanelRows, n0 = (w % chunks) * kChunkN;
      kern.q4q8_panel(W + m0 * nb, nb, std::min(kPanelRows, M - m0), aq.data() + n0 * K, ad.data() + n0 * nb,
                      std::min(kChunkN, N - n0), out + m0 * ldo_m + n0 * ldo_n, ldo_m, ldo_n);
    }
  });
}

void gemm_q4_0_q8_1_cpu(const q4_0::block_q4_0* W, const q8_1::block_q8_1* A, float* out, int64_t M, int64_t N,
                        int64_t K) {
  q4_0_q8_1_cpu(W, A, M, N, K, out, N, 1);
}

template <class T>
void linear_q4_0_cpu(const T* x, int64_t N, int64_t K, const q4_0::block_q4_0* W, int64_t M, float* out) {
  const int64_t n_blocks = N * (K / q8_1::QK);
  std::vector<q8_1::block_q8_1> xq(static_cast<size_t>(n_blocks));
  for_each_block(n_blocks, [&](int64_t b) { q8_1::quantize_block(x + b * q8_1::QK, xq.data() + b); });
  q4_0_q8_1_cpu(W, xq.data(), M, N, K, out, 1, M);
}

#define QF_INSTANTIATE(T) \
  template void linear_q4_0_cpu<T>(const T*, int64_t, int64_t, const q4_0::block_q4_0*, int64_t, float*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::gemm
