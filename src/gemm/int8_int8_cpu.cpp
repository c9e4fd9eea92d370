#include "gemm/int8_int8.h"

#include <algorithm>

#include "common/fp16.h"
#include "common/parallel.h"
#include "common/thread_pool.h"
#include "gemm/cpu_kernels.h"

namespace qf::gemm {

namespace {

constexpr int64_t kChunkN = 64;  // activation rows per work item: 64 K bytes stay in L2

// Calls tile(m0, mr, n0, nn) for every (panel of kPanelRows rows of B) x (chunk of kChunkN rows of
// A), panel-major (consecutive items of a thread reuse a panel), threaded over the items.
template <class Tile>
void for_each_tile(int64_t N, int64_t M, int64_t K, Tile&& tile) {
  if (N <= 0 || M <= 0) return;
  const int64_t panels = (M + kPanelRows - 1) / kPanelRows;
  const int64_t chunks = (N + kChunkN - 1) / kChunkN;
  const int64_t work = kPanelRows * std::min(N, kChunkN) * std::max<int64_t>(K, 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / work);
  parallel_chunks(panels * chunks, grain, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t p = w / chunks, c = w % chunks;
      const int64_t m0 = p * kPanelRows, n0 = c * kChunkN;
      tile(m0, std::min(kPanelRows, M - m0), n0, std::min(kChunkN, N - n0));
    }
  });
}

}  // namespace

void int8_matmul_cpu(const int8_t* A, const int8_t* B, int32_t* out, int64_t N, int64_t M, int64_t K) {
  const CpuKernels& kern = cpu_kernels();
  for_each_tile(N, M, K, [&](int64_t m0, int64_t mr, int64_t n0, int64_t nn) {
    kern.i8_panel(B + m0 * K, mr, A + n0 * K, nn, K, out + n0 * M + m0, M);
  });
}

template <class T>
void int8_linear_cpu(const int8_t* A, const float* x_scale, bool x_scale_per_row, const int8_t* B, const float* w_scale,
                     bool w_scale_per_row, const float* bias, bool relu, float scale_c, T* out, int64_t N, int64_t M,
                     int64_t K) {
  const CpuKernels& kern = cpu_kernels();
  for_each_tile(N, M, K, [&](int64_t m0, int64_t mr, int64_t n0, int64_t nn) {
    int32_t acc[kChunkN * kPanelRows];
    kern.i8_panel(B + m0 * K, mr, A + n0 * K, nn, K, acc, kPanelRows);
    for (int64_t j = 0; j < nn; ++j) {
      const float xs = x_scale[x_scale_per_row ? n0 + j : 0];
      for (int64_t i = 0; i < mr; ++i) {
        const int64_t m = m0 + i;
        const float s = (xs * w_scale[w_scale_per_row ? m : 0]) * scale_c;
        float v = static_cast<float>(acc[j * kPanelRows + i]) * s;
        if (bias) v = v + bias[m];
        if (relu) v = v < 0.0f ? 0.0f : v;
        from_f32(v, out + (n0 + j) * M + m);
      }
    }
  });
}

#define QF_INSTANTIATE(T)                                                                                              \
  template void int8_linear_cpu<T>(const int8_t*, const float*, bool, const int8_t*, const float*, bool, const float*, \
                                   bool, float, T*, int64_t, int64_t, int64_t);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::gemm
