// mixed2bit CUDA codec: the steps of mixed2bit.h as a short pipeline of kernels on one stream.
// Every per-group rule is the QF_HOST_DEVICE function the CPU calls (one thread per group, so
// sums and min/max run in the CPU's order); the global steps (selection, list slots, block
// maxima) are exact integer computations (or order-free maxima of non-negative floats) whose
// result does not depend on the launch shape.
//
// This header: what the codec's kernels share (included by mixed2bit_quantize_cuda.cu,
// mixed2bit_dequantize_cuda.cu and mixed2bit_pack_cuda.cu): launch constants, the control words
// at the start of the workspace, warp and CTA scans, the "last CTA" pattern, and the workspace
// helpers of the host code.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "formats/mixed2bit/mixed2bit.h"

namespace qf::mixed2bit {
namespace {

namespace cu = ::qf::cuda;
using ull = unsigned long long;

constexpr int kThreads = 256;  // threads per CTA
constexpr int kWarps = kThreads / 32;
constexpr int kTile = kThreads;   // groups per tile: one per thread
constexpr int kTilesPerCta = 16;  // tiles per CTA of the counting kernels
constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr int kRadix = 256;         // outlier radix select: 8 bits per pass ...
constexpr int kSelectPasses = 8;    // ... over 64-bit composite keys
constexpr int kMaxHistCtas = 1024;  // grid of an outlier histogram pass
constexpr int64_t kAlign = 256;     // alignment of every workspace region

// Group selection digits: bits 31..21, 20..10, 9..0 of the 32-bit key.
constexpr int kBits1 = 11, kShift1 = 21, kBits2 = 11, kShift2 = 10, kBits3 = 10, kShift3 = 0;

// The control words at the start of the workspace (uint32, cleared by one memset per call).
// clang-format off
enum : int {
  kFlagTooLarge = 0, kFlagInternal = 1, kFlagBad = 2,  // error flags, copied back by quantize
  kDone1 = 4, kDone2 = 5, kDone3 = 6, kDone4 = 7,       // "last CTA" counters, one per kernel
  kPrefix1 = 8, kNeed1 = 9, kPrefix2 = 10, kNeed2 = 11, kKstar = 12, kNeed3 = 13,
  kHist1 = 16, kHist2 = kHist1 + (1 << kBits1), kHist3 = kHist2 + (1 << kBits2),
  kCtlWords = kHist3 + (1 << kBits3),
  kCtlWordsDequantize = 16,
};
// clang-format on

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31u); }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x >> 5); }
__device__ __forceinline__ unsigned lanes_below() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// The 8 2-bit fields of x's low 16 bits as 8 nibbles (field i in bits 4i..4i+1).
__device__ __forceinline__ uint32_t nibbles_of_2bit(uint32_t x) {
  x &= 0xFFFFu;
  x = (x | (x << 8)) & 0x00FF00FFu;
  x = (x | (x << 4)) & 0x0F0F0F0Fu;
  return (x | (x << 2)) & 0x33333333u;
}

// Two float32 values rounded to a 16-bit T as one 32-bit pair (a in the low half): one
// conversion instruction, the bits of two __float2half_rn / __float2bfloat16_rn.
__device__ __forceinline__ uint32_t pack_pair(float a, float b, half_t*) {
  const __half2 h = __floats2half2_rn(a, b);
  uint32_t w;
  memcpy(&w, &h, 4);
  return w;
}
__device__ __forceinline__ uint32_t pack_pair(float a, float b, bf16_t*) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  uint32_t w;
  memcpy(&w, &h, 4);
  return w;
}

// decode_group of 16 values given as nibbles (value i in bits 4(i % 8) of lo (i < 8) or hi),
// rounded to T; both layouts' dequantizers. float(q) = (2^23 + q) - 2^23, exact.
template <class T>
__device__ __forceinline__ void decode16(uint32_t lo, uint32_t hi, float s_eff, float m_eff, T (&o)[16]) {
  float f[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const uint32_t q = ((i < 8 ? lo : hi) >> (4 * (i & 7))) & 15u;
    const float qf = __fsub_rn(f32_from_bits(0x4B000000u | q), 8388608.0f);
    f[i] = dequantize_value_f(qf, s_eff, m_eff);
  }
  if constexpr (sizeof(T) == 2) {
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = pack_pair(f[2 * i], f[2 * i + 1], static_cast<T*>(nullptr));
    memcpy(o, w, sizeof(w));
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) from_f32(f[i], &o[i]);
  }
}

// decode_group of one codes word of 16 values, straight from the tiled layout's 2-bit planes: hi
// (the codes word) and, for a 4-bit group, lo (value i's q = hi_i << 2 | lo_i; a 2-bit group's
// q = hi_i), value i's fields at bits 2i of their word. Bit-exact with dequantize_value_f, in
// about 3 instructions per value instead of decode16's 5 plus the nibble spreading:
// - the fields of values 8h .. 8h + 7 (h = 0, 1: a 16-bit half) go into two words, even and odd
//   positions f apart, a 4-bit group's hi fields shifted up by 2 next to its lo fields, so that
//   value f's whole code is the bits 2f .. 2f + 3 of its word (those of the other parity are
//   zero there);
// - OR-ed into the mantissa of 2^23 in place, a code becomes the exact float 2^23 + q 4^f (bits
//   up to 17 < 23), and subtracting 2^23 gives q 4^f exactly;
// - fmaf(q 4^f, s_eff 4^-f, -m_eff) is then round(q s_eff - m_eff), as dequantize_value_f's
//   round(round(q s_eff) - m_eff): q s_eff is exact in float32 (a 4-bit code times an fp16 field
//   times an 8-bit code: 23 significant bits), and scaling s_eff by 4^-f is exact (s_eff >= 2^-24
//   or 0: far from float32's subnormals).
template <class T>
__device__ __forceinline__ void decode16_planes(uint32_t hi, uint32_t lo, bool is4, float s_eff, float m_eff,
                                                T (&o)[16]) {
  float s[8];  // s_eff 4^-f
  s[0] = s_eff;
#pragma unroll
  for (int f = 1; f < 8; ++f) s[f] = s[f - 1] * 0.25f;
  float v[16];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t hw = (hi >> (16 * h)) & 0xFFFFu, lw = is4 ? (lo >> (16 * h)) & 0xFFFFu : 0u;
    const uint32_t hs = is4 ? hw << 2 : hw;  // the hi fields at 2f + 2 (4-bit) or 2f (2-bit)
    const uint32_t even = (hs & (is4 ? 0x0CCCCu : 0x03333u)) | (lw & 0x3333u);
    const uint32_t odd = (hs & (is4 ? 0x33330u : 0x0CCCCu)) | (lw & 0xCCCCu);
#pragma unroll
    for (int f = 0; f < 8; ++f) {
      const float q =
          __fsub_rn(f32_from_bits(cu::and_or(f & 1 ? odd : even, 0xFu << (2 * f), 0x4B000000u)), 8388608.0f);
      v[8 * h + f] = __fmaf_rn(q, s[f], -m_eff);
    }
  }
  if constexpr (sizeof(T) == 2) {
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = pack_pair(v[2 * i], v[2 * i + 1], static_cast<T*>(nullptr));
    memcpy(o, w, sizeof(w));
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) from_f32(v[i], &o[i]);
  }
}

// a / b for 0 <= a, 1 <= b, in 32 bits when both fit (a 64-bit division is a long subroutine).
__device__ __forceinline__ int64_t div_index(int64_t a, int64_t b) {
  if (((a | b) >> 32) == 0) return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
  return a / b;
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ uint32_t min32(uint32_t a, uint32_t b) { return a < b ? a : b; }

// Division by the scale block B (>= 1): a shift when B is a power of two.
struct DivB {
  int64_t B;
  int shift;  // log2(B), or -1
  __device__ __forceinline__ int64_t div(int64_t a) const { return shift >= 0 ? a >> shift : div_index(a, B); }
};

// Exclusive prefix sum over the CTA (every thread calls it); *total = the CTA's sum.
template <class V>
__device__ V cta_exclusive_sum(V v, V* total) {
  __shared__ V warp_sums[kWarps];
  const V incl = cu::warp_inclusive_sum(v);
  if (lane_id() == 31) warp_sums[warp_id()] = incl;
  __syncthreads();
  V before = 0, all = 0;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) {
    const V s = warp_sums[i];
    if (i < warp_id()) before += s;
    all += s;
  }
  __syncthreads();
  *total = all;
  return before + incl - v;
}

// Exclusive prefix sum of a[0..n) in place by one CTA (16 items per thread per round, all
// loads in flight at once); returns the total.
template <class V>
__device__ V cta_scan_in_place(V* a, int64_t n) {
  constexpr int kPer = 16;
  V carry = 0;
  for (int64_t base = 0; base < n; base += int64_t(kThreads) * kPer) {
    const int64_t i0 = base + int64_t(threadIdx.x) * kPer;
    V v[kPer], s = 0;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const bool in = i0 + k < n;
      v[k] = __ldcg(a + (in ? i0 + k : n - 1));  // unconditional: all loads in flight (n >= 1)
      if (!in) v[k] = 0;
      s += v[k];
    }
    V tot;
    V run = carry + cta_exclusive_sum(s, &tot);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (i0 + k < n) a[i0 + k] = run;
      run += v[k];
    }
    carry += tot;
  }
  return carry;
}

// The "last CTA" pattern (as cooperative groups' grid sync): every CTA publishes its results
// (stores, atomics); after a CTA barrier one thread fences and counts the CTA done; the CTA that
// counts last fences again and then sees everything the others published (read with __ldcg).
__device__ inline bool cta_is_last(uint32_t* counter) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) __threadfence();
  }
  __syncthreads();
  return last;
}

// ---------------------------------------------------------------------------------------------
// Workspace layouts: offsets from the 256-byte aligned start of the caller's buffer.
// ---------------------------------------------------------------------------------------------

struct Carver {
  int64_t off = 0;
  int64_t take(int64_t bytes) {
    const int64_t o = off;
    off += (bytes + kAlign - 1) / kAlign * kAlign;
    return o;
  }
};

inline int64_t n_tiles_of(const Dims& d) { return (d.n_groups() + kTile - 1) / kTile; }
inline int64_t n_count_ctas(int64_t n_tiles) { return (n_tiles + kTilesPerCta - 1) / kTilesPerCta; }

inline uint8_t* workspace_base(void* ws, int64_t ws_bytes, int64_t need) {
  if (ws == nullptr || ws_bytes < need)
    throw std::invalid_argument("workspace: expected at least " + std::to_string(need) + " bytes, got " +
                                std::to_string(ws == nullptr ? 0 : ws_bytes));
  const uintptr_t p = reinterpret_cast<uintptr_t>(ws);
  return reinterpret_cast<uint8_t*>((p + kAlign - 1) / kAlign * kAlign);
}

inline void check_cuda_dims(const Dims& d) {
  check_dims(d);
  if (d.n_groups() > int64_t(UINT32_MAX)) throw std::invalid_argument("mixed2bit (CUDA): at most 2^32 - 1 groups");
}

inline DivB make_div(int64_t B) {
  int shift = -1;
  if ((B & (B - 1)) == 0 && B < (int64_t(1) << 31))
    for (shift = 0; (int64_t(1) << shift) < B; ++shift) {
    }
  return DivB{B, shift};
}

}  // namespace
}  // namespace qf::mixed2bit
