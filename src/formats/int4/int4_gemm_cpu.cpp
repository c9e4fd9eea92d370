#include "formats/int4/int4_gemm_cpu.h"

#include <algorithm>

#include "formats/int4/int4.h"
#include "gemm/nibble_gemm_cpu.h"
#include "gemm/weight_only_cpu.h"

namespace qf::gemm {

void int4_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const uint8_t* qweight, const float* scales,
                   const uint8_t* zeros, int64_t gs, float* Y, bool tiles) {
  // (the tiles layout takes the tile decoder: the fused kernel read it no faster, on the AVX2
  // development machine, than the decoder does; benchmarks/README.md)
  if (!tiles && gs % 32 == 0 &&
      nibble_gemm_cpu({zeros ? Nibble::int4_asym : Nibble::int4_sym, qweight, scales, zeros, K, gs}, X, N, M, Y))
    return;
  const Int4CpuKernels& kern = int4_cpu_kernels();
  const int64_t C = K / gs;
  weight_only_gemm_tiles(
      X, N, K, M, kTileK,
      [&](int64_t m0, int64_t m1, int64_t k0, int64_t k1, float* tile) {
        const int64_t len = k1 - k0;
        for (int64_t m = m0; m < m1; ++m) {
          float* out = tile + (m - m0) * len;
          if (!tiles) {
            kern.decode(qweight, scales, zeros, gs, m * K + k0, len, out);
            continue;
          }
          // The "tiles" layout (int4.h): a row's groups are apart, each group's values in order.
          for (int64_t k = k0; k < k1;) {
            const int64_t c = k / gs, n = std::min(k1, (c + 1) * gs) - k;
            kern.decode(qweight, scales, zeros, gs, int4::tiles_group(m, c, C) * gs + k % gs, n, out + (k - k0));
            k += n;
          }
        }
      },
      Y);
}

const Int4CpuKernels& int4_cpu_kernels() {
#if QF_GEMM_X86
  switch (active_isa()) {
    case Isa::avx512:
      return k_avx512::int4_kernels();
    case Isa::avx2:
      return k_avx2::int4_kernels();
    default:
      break;
  }
#endif
  return k_scalar::int4_kernels();
}

// Plain C++: the portable fallback, the reference the vector versions are tested against, and
// the general path (any alignment) that they call for the cases they do not cover.
namespace k_scalar {
namespace {

void decode_int4(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t gs, int64_t i0, int64_t len,
                 float* out) {
  for (int64_t t = 0; t < len; ++t) {
    const int64_t i = i0 + t, g = i / gs;
    const uint8_t byte = qweight[i >> 1];
    const int nib = (i & 1) ? (byte >> 4) : (byte & 0x0F);  // even element: low nibble
    out[t] = zeros ? int4::decode_asym(nib, zeros[g], scales[g]) : int4::decode_sym(nib, scales[g]);
  }
}

}  // namespace

const Int4CpuKernels& int4_kernels() {
  static const Int4CpuKernels k{decode_int4};
  return k;
}

}  // namespace k_scalar

}  // namespace qf::gemm
