// Weight-only GEMV / small-N GEMM on the GPU, shared by every weight format: Y [N, M] = X [N, K]
// . W^T with float activations (float32, float16 or bfloat16) and a packed weight W [M, K] that
// the format's policy decodes in registers (never in global or shared memory: the paper's
// "asynchronous dequantization" of arXiv 2311.16442 and the mmvq kernels of llama.cpp work the
// same way). Y is written in the activations' dtype.
//
// Work split (one CTA = kRows weight rows x all of K x NT activation rows; its warps split K):
// * warp w of W takes a contiguous run of warp steps (32 units each; a unit is Fmt::kUnit
//   consecutive values of one row that share one scale: a q4_0 block, 32 nf4/int4 values, 16
//   mixed2bit values); in a step lane l takes unit l, so a warp reads 32 consecutive units of
//   each row per step: coalesced. Splitting K puts more, shorter warps on the device when M is
//   small: a warp's steps wait on memory one after another (a double buffer hides one), so a few
//   long warps are latency-bound (see the launcher for what it measured).
// * each activation value is loaded once per warp step and used for kRows rows, so the L1
//   traffic for X stays near the weight traffic instead of kRows times it.
// * per unit the policy yields raw values v (q - zero, a code's table value...) and the unit's
//   (scale, offset) with w = v * scale - offset; the kernel sums v * x and x over the unit and
//   applies scale and offset once per unit: one FMA per weight and activation row. That moves
//   the scale multiply out of the sum, so the result differs from a sum of dequantized products
//   by float32 rounding only (|error| <~ K * 2^-24 * sum |w x|; the tests bound it).
// * each warp sums its lanes with shuffles; the CTA adds its warps' sums in shared memory in a
//   fixed order (deterministic) and writes the kRows x NT outputs.
// Loops are warp-uniform (lanes past the end of a row compute on zeros and add nothing), so a
// policy may use warp votes (mixed2bit counts its 4-bit groups with __ballot_sync).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/fp16.h"

namespace qf::gemm::cuda_wo {

constexpr int kRows = 4;            // weight rows per CTA: the reuse factor of each activation load
constexpr int kMaxWarpsPerCta = 8;  // warps splitting K
constexpr int kMaxNT = 8;           // activation rows per pass; grid.y covers larger N

// A 4-bit code c as the exact float (2^23 + c): c in the low mantissa bits of 2^23. Subtracting
// (2^23 + zero) then gives c - zero exactly, two instructions per value and no int->float
// conversion (I2F runs at a quarter of the FP32 rate).
__device__ __forceinline__ float magic_u4(uint32_t bytes, int b) {
  // byte b of `bytes` into the low byte of 0x4B000000 (selector 0x744b: byte b, 0, 0, 0x4B)
  return __uint_as_float(__byte_perm(bytes, 0x4B000000u, 0x7440u | b));
}
constexpr float kMagic = 8388608.0f;  // 2^23

// Word j (0..3) of a 16-byte unit.
__device__ __forceinline__ uint32_t word_of(const uint4& q, int j) {
  return j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w;  // j is a constant after unrolling
}

// Writes output y of weight row m from its float32 sum v. With a bias (x's dtype), v is rounded
// to T, the bias added in float32 and the sum rounded again: the same two roundings as
// `y = gemm(x, W); y += bias` in T (torch adds 16-bit tensors in float32 and rounds once), so
// fusing the bias into the epilogue changes no output bit and saves a launch.
template <class T>
__device__ __forceinline__ void store_out(float v, const T* __restrict__ bias, int64_t m, T* y) {
  if (bias != nullptr) {
    T t;
    from_f32(v, &t);
    v = to_f32(t) + to_f32(bias[m]);
  }
  from_f32(v, y);
}

// 8 consecutive activations (16-byte aligned) as float32.
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x;
  v[1] = a.y;
  v[2] = a.z;
  v[3] = a.w;
  v[4] = b.x;
  v[5] = b.y;
  v[6] = b.z;
  v[7] = b.w;
}
__device__ __forceinline__ void load8(const half_t* p, float (&v)[8]) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const bf16_t* p, float (&v)[8]) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // a bf16 is the top half of its float32
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

// Fmt (a policy, passed by value as a kernel argument) provides:
//   static constexpr int kUnit;                       values per unit, a multiple of 8
//   struct Shared; __device__ void init(Shared&) const;  per-CTA tables (before a barrier)
//   struct RowState; __device__ RowState row(int64_t m, int64_t u0) const;  state for units from u0
//       (u0 a multiple of 32; a warp-uniform call)
//   struct Unit;  __device__ float scale(const Unit&) const, offset(const Unit&) const;
//   __device__ Unit load(RowState&, int64_t m, int64_t u, bool valid) const;  warp-uniform call
//   __device__ void decode8(const Shared&, const Unit&, int j, float (&v)[8]) const;
//       raw values of elements 8j..8j+7 of the unit: w = v * scale - offset
//   static constexpr bool kOffset;                     false: offset is always 0
template <class Fmt, class T, int NT>
__global__ void
__launch_bounds__(kMaxWarpsPerCta * 32)
weight_only_kernel(const Fmt f, const T* __restrict__ X, int64_t N, int64_t K, int64_t M, T* __restrict__ Y,
                   const T* __restrict__ bias) {
  __shared__ typename Fmt::Shared sh;
  __shared__ float red[kMaxWarpsPerCta][kRows][NT];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int64_t m0 = int64_t(blockIdx.x) * kRows;
  const int64_t n0 = int64_t(blockIdx.y) * NT;
  const int nt = static_cast<int>(N - n0 < NT ? N - n0 : NT);
  const int64_t units = K / Fmt::kUnit, steps = (units + 31) / 32;
  const int64_t u_begin = steps * warp / nwarps * 32, u_end = steps * (warp + 1) / nwarps * 32;  // this warp's units

  typename Fmt::RowState rs[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) rs[r] = f.row(m0 + r < M ? m0 + r : M - 1, u_begin);
  float acc[kRows][NT];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[r][n] = 0.0f;

  // Register double buffer: the next warp step's units are loaded before this step's
  // products, so every warp keeps two steps of weight bytes in flight.
  typename Fmt::Unit un[kRows];
  auto load_step = [&](int64_t u0, typename Fmt::Unit(&dst)[kRows]) {
    const int64_t u = u0 + lane;
    const bool valid = u < units;
#pragma unroll
    for (int r = 0; r < kRows; ++r) dst[r] = f.load(rs[r], m0 + r < M ? m0 + r : M - 1, valid ? u : u0, valid);
  };
  if (u_begin < u_end) load_step(u_begin, un);
  f.init(sh);  // per-CTA tables, while the first loads are in flight
  __syncthreads();
  for (int64_t u0 = u_begin; u0 < u_end; u0 += 32) {
    const int64_t u = u0 + lane;
    const bool valid = u < units;
    typename Fmt::Unit next[kRows];
    if (u0 + 32 < u_end) load_step(u0 + 32, next);  // warp-uniform condition
    if (valid) {
      float dot[kRows][NT], xsum[NT];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        xsum[n] = 0.0f;
#pragma unroll
        for (int r = 0; r < kRows; ++r) dot[r][n] = 0.0f;
      }
      const T* xu = X + n0 * K + u * Fmt::kUnit;
#pragma unroll
      for (int j = 0; j < Fmt::kUnit / 8; ++j) {
        float w[kRows][8];
#pragma unroll
        for (int r = 0; r < kRows; ++r) f.decode8(sh, un[r], j, w[r]);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          if (n < nt) {
            float xv[8];
            load8(xu + n * K + 8 * j, xv);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              if (Fmt::kOffset) xsum[n] += xv[i];
#pragma unroll
              for (int r = 0; r < kRows; ++r) dot[r][n] = fmaf(w[r][i], xv[i], dot[r][n]);
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          acc[r][n] = fmaf(dot[r][n], f.scale(un[r]), acc[r][n]);
          if (Fmt::kOffset) acc[r][n] = fmaf(-xsum[n], f.offset(un[r]), acc[r][n]);
        }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) un[r] = next[r];
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const float v = cuda::warp_sum(acc[r][n]);
      if (lane == 0) red[warp][r][n] = v;
    }
  __syncthreads();
  if (threadIdx.x < kRows * NT) {
    const int r = threadIdx.x / NT, n = threadIdx.x % NT;
    float v = 0.0f;
    for (int w = 0; w < nwarps; ++w) v += red[w][r][n];
    if (m0 + r < M && n < nt) store_out(v, bias, m0 + r, &Y[(n0 + n) * M + m0 + r]);
  }
}

// Launches the kernel for every activation row of X on `stream`. X and Y must be 16-byte
// aligned (the adapters check) and K a multiple of Fmt::kUnit; bias [M] of T, or nullptr.
template <class Fmt, class T>
void launch_weight_only(const Fmt& f, const T* X, int64_t N, int64_t K, int64_t M, T* Y, const T* bias,
                        void* stream) {
  if (N <= 0 || M <= 0) return;
  const int nt = N >= 8 ? 8 : N >= 4 ? 4 : N >= 2 ? 2 : 1;
  const dim3 grid(cuda::grid_for(M, kRows), cuda::grid_for(N, nt));
  if (grid.y > 65535) throw std::invalid_argument("weight-only GEMM: too many activation rows for one launch");
  // Split K over up to kMaxWarpsPerCta warps until the device has about 2048 of them (a wave of
  // ~16 per SM at ~120 registers on a 132-SM H200), leaving each warp at least two steps (so that
  // its double buffer has something to overlap). Measured on the H200 at N = 1: faster than no
  // split for nf4's long rows, the other shapes unchanged; 8192 and 16384 warps were slower
  // (benchmarks/README.md, "Design measurements behind kernel choices").
  const int64_t steps = (K / Fmt::kUnit + 31) / 32;
  int warps = 1;
  while (warps < kMaxWarpsPerCta && int64_t(grid.x) * grid.y * warps < 2048 && warps * 4 <= steps) warps *= 2;
  const dim3 block(warps * 32);
  cudaStream_t s = cuda::stream(stream);
  switch (nt) {
    case 8: weight_only_kernel<Fmt, T, 8><<<grid, block, 0, s>>>(f, X, N, K, M, Y, bias); break;
    case 4: weight_only_kernel<Fmt, T, 4><<<grid, block, 0, s>>>(f, X, N, K, M, Y, bias); break;
    case 2: weight_only_kernel<Fmt, T, 2><<<grid, block, 0, s>>>(f, X, N, K, M, Y, bias); break;
    default: weight_only_kernel<Fmt, T, 1><<<grid, block, 0, s>>>(f, X, N, K, M, Y, bias); break;
  }
  cuda::check_launch("weight-only GEMM");
}

}  // namespace qf::gemm::cuda_wo
