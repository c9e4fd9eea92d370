#include "formats/int8/int8_gemm_cpu.h"

#include "formats/int8/int8.h"
#include "gemm/weight_only_cpu.h"

namespace qf::gemm {

void int8_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const int8_t* q, const float* scales, int64_t unit,
                   int64_t scale_stride, float* Y) {
  const Int8CpuKernels& kern = int8_cpu_kernels();
  if (kern.gemm && N >= 1 && N <= 4 && M > 0 && K > 0 && unit % 16 == 0) {
    const Int8Weights w{q, scales, K, unit, scale_stride};
    fused_panels(M, K, N, [&](int64_t m0, int64_t mr) { kern.gemm(w, m0, mr, X, N, Y + m0, M); });
    return;
  }
  weight_only_gemm_tiles(
      X, N, K, M, kTileK,
      [&](int64_t m0, int64_t m1, int64_t k0, int64_t k1, float* tile) {
        const int64_t len = k1 - k0;
        for (int64_t m = m0; m < m1; ++m) {
          const int8_t* row = q + m * K;
          const float* s = scales + m * scale_stride;
          float* t = tile + (m - m0) * len;
          for (int64_t k = k0; k < k1; ++k) t[k - k0] = int8::dequantize_value(row[k], s[k / unit]);
        }
      },
      Y);
}

const Int8CpuKernels& int8_cpu_kernels() {
#if QF_GEMM_X86
  switch (active_isa()) {
    case Isa::avx512:
      return k_avx512::int8_kernels();
    case Isa::avx2:
      return k_avx2::int8_kernels();
    default:
      break;
  }
#endif
  return k_scalar::int8_kernels();
}

namespace k_scalar {
// No fused kernel in plain C++: the tile path runs.
const Int8CpuKernels& int8_kernels() {
  static const Int8CpuKernels k{nullptr};
  return k;
}
}  // namespace k_scalar

#if QF_GEMM_X86
namespace k_avx512 {
// Written for AVX2 only; every AVX-512 CPU here also has AVX2, FMA and F16C.
const Int8CpuKernels& int8_kernels() { return k_avx2::int8_kernels(); }
}  // namespace k_avx512
#endif

}  // namespace qf::gemm
