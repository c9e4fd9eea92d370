// Plain C++ format-independent leaf kernels (gemm/cpu_kernels.h): the portable fallback, and
// the reference the vector versions are tested against.
#include <algorithm>

#include "formats/int4/int4.h"
#include "gemm/cpu_kernels.h"

namespace qf::gemm::k_scalar {
namespace {

void f32_panel(const float* X, int64_t ldx, int64_t N, const float* W, int64_t ldw, int64_t MT, int64_t kc, float* acc,
               bool accumulate) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = X + n * ldx;
    for (int64_t i = 0; i < MT; ++i) {
      const float* w = W + i * ldw;
      // 8 independent partial sums: a fixed order the compiler can keep in vector registers.
      float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= kc; k += 8)
        for (int l = 0; l < 8; ++l) s[l] += x[k + l] * w[k + l];
      for (int l = 0; k < kc; ++k, ++l) s[l] += x[k] * w[k];
      const float r = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
      float& a = acc[n * kPanelRows + i];
      a = accumulate ? a + r : r;
    }
  }
}

void q4q8_panel(const q4_0::block_q4_0* W, int64_t nb, int64_t MR, const int8_t* aq, const float* ad, int64_t N,
                float* out, int64_t ldo_m, int64_t ldo_n) {
  const int64_t K = nb * q4_0::QK;
  for (int64_t i = 0; i < MR; ++i) {
    const q4_0::block_q4_0* w = W + i * nb;
    for (int64_t j = 0; j < N; ++j) {
      const int8_t* a = aq + j * K;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* ab = a + b * q4_0::QK;
        int sumi = 0;
        for (int t = 0; t < q4_0::QK / 2; ++t) {
          sumi += ((w[b].qs[t] & 0x0F) - 8) * ab[t];
          sumi += ((w[b].qs[t] >> 4) - 8) * ab[t + q4_0::QK / 2];
        }
        const float dw = fp16_bits_to_fp32(w[b].d.bits);
        acc += dw * ad[j * nb + b] * static_cast<float>(sumi);
      }
      out[i * ldo_m + j * ldo_n] = acc;
    }
  }
}

void i8_panel(const int8_t* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out, int64_t ldo) {
  for (int64_t j = 0; j < N; ++j)
    for (int64_t i = 0; i < MR; ++i) {
      const int8_t* a = A + j * K;
      const int8_t* b = B + i * K;
      int32_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<int32_t>(a[k]) * static_cast<int32_t>(b[k]);
      out[j * ldo + i] = s;
    }
}

void i4_panel(const uint8_t* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out, int64_t ldo) {
  const int64_t kb = K / 2, Kp = (K + 127) / 128 * 128;
  for (int64_t j = 0; j < N; ++j)
    for (int64_t i = 0; i < MR; ++i) {
      const int8_t* a = A + j * Kp;
      const uint8_t* b = B + i * kb;
      int32_t s = 0;
      for (int64_t t = 0; t < kb; ++t) {
        // byte t holds elements 2t (low) and 2t + 1 (high); the split A has them at
        // 128 c + u and 128 c + 64 + u for t = 64 c + u.
        const int64_t c = t / 64, u = t % 64;
        s += int4::nibble_to_signed(b[t] & 0x0F) * a[128 * c + u];
        s += int4::nibble_to_signed(b[t] >> 4) * a[128 * c + 64 + u];
      }
      out[j * ldo + i] = s;
    }
}

}  // namespace

const CpuKernels& kernels() {
  static const CpuKernels k{Isa::scalar, f32_panel, nullptr, q4q8_panel, i8_panel, i4_panel};
  return k;
}

}  // namespace qf::gemm::k_scalar
