// int8's AVX2 + FMA + F16C leaf kernels (int8_gemm_cpu.h: Int8CpuKernels). Every function carries
// the target attribute QF_AVX2 (gemm/cpu_simd_avx2.h; no global -m flags); int8_cpu_kernels() hands
// this table out only when gemm/cpu_isa.h reports the instruction set.
#include "formats/int8/int8_gemm_cpu.h"

#if QF_GEMM_X86
#include <algorithm>

#include "gemm/cpu_simd_avx2.h"

namespace qf::gemm::k_avx2 {
namespace {

// Per 16 values of a row: two 8-byte loads sign-extended to int32 lanes (VPMOVSXBD), converted
// to float (exact) and multiplied into two partial sums per output (two FMA chains); at the end
// of each scale unit the unit's sum is scaled into the output's accumulator. Per-output
// accumulators: the sum order depends on K and L only.
template <int MR, int NR>
QF_AVX2 void i8w_micro(const Int8Weights& w, int64_t m0, const float* X, float* Y, int64_t ldy) {
  const int64_t K = w.K, L = w.L;
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t u0 = 0; u0 < K; u0 += L) {
    __m256 d[MR][NR][2];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) d[i][j][0] = d[i][j][1] = _mm256_setzero_ps();
    for (int64_t k = u0; k < u0 + L; k += 16) {
      for (int i = 0; i < MR; ++i) {
        const int8_t* p = w.q + (m0 + i) * K + k;
        _mm_prefetch(reinterpret_cast<const char*>(p) + MR * K, _MM_HINT_T0);  // as nib_int_micro
        const __m256 v0 =
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
        const __m256 v1 =
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
        for (int j = 0; j < NR; ++j) {
          d[i][j][0] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(X + j * K + k), d[i][j][0]);
          d[i][j][1] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(X + j * K + k + 8), d[i][j][1]);
        }
      }
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 s = _mm256_broadcast_ss(w.scales + (m0 + i) * w.scale_stride + u0 / L);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(s, _mm256_add_ps(d[i][j][0], d[i][j][1]), acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) Y[j * ldy + i] = hsum(acc[i][j]);
}

template <int NR>
QF_AVX2 void i8w_rows(const Int8Weights& w, int64_t m0, int64_t MR, const float* X, float* Y, int64_t ldy) {
  constexpr int64_t R = NR == 1 ? 4 : 2;
  for (int64_t i = 0; i < MR; i += R) {
    switch (std::min<int64_t>(R, MR - i)) {
// One case per macro call, as written:
// clang-format off
#define QF_CASE(Q) case Q: if constexpr (Q <= R) i8w_micro<Q, NR>(w, m0 + i, X, Y + i, ldy); break;
      QF_CASE(1) QF_CASE(2) QF_CASE(3) QF_CASE(4)
#undef QF_CASE
          // clang-format on
          default : break;
    }
  }
}

QF_AVX2 void int8_gemm(const Int8Weights& w, int64_t m0, int64_t MR, const float* X, int64_t N, float* Y, int64_t ldy) {
  with_rows4(N, [&](auto nr) { i8w_rows<decltype(nr)::value>(w, m0, MR, X, Y, ldy); });
}

}  // namespace

const Int8CpuKernels& int8_kernels() {
  static const Int8CpuKernels k{int8_gemm};
  return k;
}

}  // namespace qf::gemm::k_avx2

#endif  // QF_GEMM_X86
