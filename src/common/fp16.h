// Scalar float types shared by every format: IEEE binary16 (fp16) and bfloat16, stored as
// raw bits so that the block structs have a fixed, compiler-independent layout.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define QF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define QF_HOST_DEVICE inline
#endif

namespace qf {

// Raw fp16 / bf16 bits. Distinct types (not uint16_t) so that templates dispatching on the
// input element type can tell them apart.
struct half_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};
static_assert(sizeof(half_t) == 2 && sizeof(bf16_t) == 2, "16-bit storage types");

#if defined(__CUDA_ARCH__)
QF_HOST_DEVICE uint32_t f32_bits(float f) { return __float_as_uint(f); }
QF_HOST_DEVICE float f32_from_bits(uint32_t u) { return __uint_as_float(u); }
#else
QF_HOST_DEVICE uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
QF_HOST_DEVICE float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
#endif

// fp32 -> fp16, round to nearest even, with subnormals, overflow to inf, NaN kept NaN.
// The arithmetic trick of Maratyszcza's FP16 library (also ggml's portable
// GGML_COMPUTE_FP32_TO_FP16): scaling by 2^112 then 2^-110 makes the FPU itself do the
// rounding of the mantissa at the fp16 position, so the result is exactly numpy's
// astype(float16) and the F16C instruction, without needing F16C. Needs IEEE rounding and
// gradual underflow (no -ffast-math, no flush-to-zero).
QF_HOST_DEVICE uint16_t fp32_to_fp16_bits(float f) {
#if defined(__CUDA_ARCH__)
  // One cvt.rn.f16.f32 instruction: the same round-to-nearest-even (NaN payloads aside, and
  // no NaN reaches a quantizer) at a fraction of the cost of the portable code below.
  return __half_as_ushort(__float2half_rn(f));
#endif
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = ((f < 0 ? -f : f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// fp16 -> fp32, exact (every fp16 value is a float32 value).
QF_HOST_DEVICE float fp16_bits_to_fp32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));  // exact, one instruction
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return f32_from_bits(sign | 0x7F800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return f32_from_bits(sign);  // +-0
    // Subnormal: value = man * 2^-24, exact in float32.
    const float v = static_cast<float>(man) * 0x1.0p-24f;
    return sign ? -v : v;
  }
  return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

// Round-trip through fp16: the value a stored fp16 field holds.
QF_HOST_DEVICE float round_to_fp16(float f) { return fp16_bits_to_fp32(fp32_to_fp16_bits(f)); }

QF_HOST_DEVICE float bf16_bits_to_fp32(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

// Element loads used by every quantizer: inputs are float32, float16 or bfloat16 and all
// arithmetic is float32.
QF_HOST_DEVICE float to_f32(float x) { return x; }
QF_HOST_DEVICE float to_f32(half_t x) { return fp16_bits_to_fp32(x.bits); }
QF_HOST_DEVICE float to_f32(bf16_t x) { return bf16_bits_to_fp32(x.bits); }

// Element stores used by every dequantizer: float32 results rounded once to the output
// type (round to nearest even for float16 and bfloat16, as torch's .to() and numpy's astype).
QF_HOST_DEVICE void from_f32(float v, float* out) { *out = v; }
QF_HOST_DEVICE void from_f32(float v, half_t* out) { out->bits = fp32_to_fp16_bits(v); }
QF_HOST_DEVICE void from_f32(float v, bf16_t* out) {
#if defined(__CUDA_ARCH__)
  out->bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return;
#endif
  const uint32_t u = f32_bits(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    out->bits = static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    return;
  }
  out->bits = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // RNE on the dropped half
}

}  // namespace qf

// Explicit instantiation over the three element types (float32, float16, bfloat16).
#define QF_FOR_EACH_INPUT_TYPE(X) X(float) X(::qf::half_t) X(::qf::bf16_t)
