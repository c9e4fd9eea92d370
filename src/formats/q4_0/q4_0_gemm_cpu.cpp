#include "formats/q4_0/q4_0_gemm_cpu.h"

#include "gemm/nibble_gemm_cpu.h"
#include "gemm/weight_only_cpu.h"

namespace qf::gemm {

void q4_0_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const q4_0::block_q4_0* W, float* Y) {
  if (nibble_gemm_cpu({Nibble::q4_0, reinterpret_cast<const uint8_t*>(W), nullptr, nullptr, K, 0}, X, N, M, Y)) return;
  const Q4_0CpuKernels& kern = q4_0_cpu_kernels();
  const int64_t nb = K / q4_0::QK;
  weight_only_gemm_tiles(
      X, N, K, M, kTileK,
      [&](int64_t m0, int64_t m1, int64_t k0, int64_t k1, float* tile) {
        const int64_t len = k1 - k0;
        for (int64_t m = m0; m < m1; ++m)
          kern.decode(W + m * nb + k0 / q4_0::QK, len / q4_0::QK, tile + (m - m0) * len);
      },
      Y);
}

const Q4_0CpuKernels& q4_0_cpu_kernels() {
#if QF_GEMM_X86
  switch (active_isa()) {
    case Isa::avx512:
      return k_avx512::q4_0_kernels();
    case Isa::avx2:
      return k_avx2::q4_0_kernels();
    default:
      break;
  }
#endif
  return k_scalar::q4_0_kernels();
}

// Plain C++: the portable fallback and the reference the vector versions are tested against.
namespace k_scalar {
namespace {

void decode_q4_0(const q4_0::block_q4_0* blocks, int64_t n_blocks, float* out) {
  for (int64_t b = 0; b < n_blocks; ++b) q4_0::dequantize_block(blocks + b, out + b * q4_0::QK);
}

}  // namespace

const Q4_0CpuKernels& q4_0_kernels() {
  static const Q4_0CpuKernels k{decode_q4_0};
  return k;
}

}  // namespace k_scalar

}  // namespace qf::gemm
