#include "gemm/q4_0_q8_1.h"

#include "common/parallel.h"

namespace qf::gemm {

void gemm_q4_0_q8_1_cpu(const q4_0::block_q4_0* W, const q8_1::block_q8_1* A, float* out,
                        int64_t M, int64_t N, int64_t K) {
  const int64_t nb = K / q4_0::QK;
  // Rows of W per thread chunk: one weight row is reused against every activation row.
  parallel_for(M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const q4_0::block_q4_0* w = W + m * nb;
      for (int64_t n = 0; n < N; ++n) {
        const q8_1::block_q8_1* a = A + n * nb;
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          int sumi = 0;
          for (int j = 0; j < q4_0::QK / 2; ++j) {
            sumi += ((w[b].qs[j] & 0x0F) - 8) * a[b].qs[j];
            sumi += ((w[b].qs[j] >> 4) - 8) * a[b].qs[j + q4_0::QK / 2];
          }
          const float dw = fp16_bits_to_fp32(w[b].d.bits);
          const float da = fp16_bits_to_fp32(a[b].d.bits);
          acc += dw * da * static_cast<float>(sumi);
        }
        out[m * N + n] = acc;
      }
    }
  });
}

}  // namespace qf::gemm
