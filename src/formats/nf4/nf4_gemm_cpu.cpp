#include "formats/nf4/nf4_gemm_cpu.h"

#include "formats/nf4/nf4.h"
#include "gemm/nibble_gemm_cpu.h"
#include "gemm/weight_only_cpu.h"

namespace qf::gemm {

void nf4_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const uint8_t* packed, const float* absmax,
                  int64_t blocksize, float* Y) {
  int log2_bs = 0;
  while ((int64_t(1) << log2_bs) < blocksize) ++log2_bs;
  if (nibble_gemm_cpu({Nibble::nf4, packed, absmax, nullptr, K, log2_bs}, X, N, M, Y)) return;
  const Nf4CpuKernels& kern = nf4_cpu_kernels();
  // Rows of W are flat ranges [m K + k0, m K + k1); a 32-aligned run never straddles a block, so
  // the vector decoders take every row when K % 32 == 0 (else the portable decoder does).
  weight_only_gemm_tiles(
      X, N, K, M, kTileK,
      [&](int64_t m0, int64_t m1, int64_t k0, int64_t k1, float* tile) {
        const int64_t len = k1 - k0;
        for (int64_t m = m0; m < m1; ++m) kern.decode(packed, absmax, log2_bs, m * K + k0, len, tile + (m - m0) * len);
      },
      Y);
}

const Nf4CpuKernels& nf4_cpu_kernels() {
#if QF_GEMM_X86
  switch (active_isa()) {
    case Isa::avx512:
      return k_avx512::nf4_kernels();
    case Isa::avx2:
      return k_avx2::nf4_kernels();
    default:
      break;
  }
#endif
  return k_scalar::nf4_kernels();
}

// Plain C++: the portable fallback, the reference the vector versions are tested against, and
// the general path (any alignment) that they call for the cases they do not cover.
namespace k_scalar {
namespace {

void decode_nf4(const uint8_t* packed, const float* absmax, int log2_bs, int64_t i0, int64_t len, float* out) {
  for (int64_t t = 0; t < len; ++t) {
    const int64_t i = i0 + t;
    const uint8_t byte = packed[i >> 1];
    const int code = (i & 1) ? (byte & 0x0F) : (byte >> 4);  // even element: high nibble
    out[t] = nf4::kCode[code] * absmax[i >> log2_bs];
  }
}

}  // namespace

const Nf4CpuKernels& nf4_kernels() {
  static const Nf4CpuKernels k{decode_nf4};
  return k;
}

}  // namespace k_scalar

}  // namespace qf::gemm
