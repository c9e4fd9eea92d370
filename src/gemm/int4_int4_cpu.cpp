#include "gemm/int4_int4.h"

#include <algorithm>
#include <vector>

#include "common/parallel.h"
#include "common/thread_pool.h"
#include "formats/int4/int4.h"
#include "gemm/cpu_kernels.h"

namespace qf::gemm {

void int4_split_rows(const uint8_t* A, int64_t N, int64_t K, int8_t* out) {
  const int64_t kb = K / 2, Kp = (K + 127) / 128 * 128;
  parallel_for(N, std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(Kp, 1)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* a = A + n * kb;
      int8_t* o = out + n * Kp;
      std::fill(o, o + Kp, int8_t(0));
      for (int64_t t = 0; t < kb; ++t) {
        const int64_t c = t / 64, u = t % 64;
        o[128 * c + u] = static_cast<int8_t>(int4::nibble_to_signed(a[t] & 0x0F));
        o[128 * c + 64 + u] = static_cast<int8_t>(int4::nibble_to_signed(a[t] >> 4));
      }
    }
  });
}

void int4_matmul_cpu(const uint8_t* A, const uint8_t* B, int32_t* out, int64_t N, int64_t M, int64_t K) {
  if (N <= 0 || M <= 0) return;
  const int64_t Kp = (K + 127) / 128 * 128;
  std::vector<int8_t> a(static_cast<size_t>(N * Kp));
  int4_split_rows(A, N, K, a.data());
  const CpuKernels& kern = cpu_kernels();
  constexpr int64_t kChunkN = 64;
  const int64_t panels = (M + kPanelRows - 1) / kPanelRows, chunks = (N + kChunkN - 1) / kChunkN;
  const int64_t work = kPanelRows * std::min(N, kChunkN) * std::max<int64_t>(K, 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / work);
  parallel_chunks(panels * chunks, grain, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t m0 = (w / chunks) * kPanelRows, n0 = (w % chunks) * kChunkN;
      kern.i4_panel(B + m0 * (K / 2), std::min(kPanelRows, M - m0), a.data() + n0 * Kp, std::min(kChunkN, N - n0), K,
                    out + n0 * M + m0, M);
    }
  });
}

}  // namespace qf::gemm
