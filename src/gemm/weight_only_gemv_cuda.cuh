// The offset GEMV: one fp16 activation row on sm_80+, for formats whose rows are 4-bit codes two
// per byte, low nibble first, with one scale and zero point per chunk of 128 values (int4 with
// group_size >= 128: formats/int4/int4.h). y [M] = W x, x [K], W [M, K]. The format says where a
// row's chunks are: in int4's tiles layout a CTA's 16 rows of a chunk are 1 KB contiguous and a
// warp's two loads of it 512 bytes each (about 1-2 us faster at one row: benchmarks/README.md,
// "int4's tiles layout").
//
// Why a kernel of its own: the tensor-core driver (weight_only_mma_cuda.cuh) rebuilds each lane's
// mma fragments from the bytes with a PRMT, an HSUB2 and an HMUL2 per pair (about 29 instructions
// per mma, ~120 registers); this one takes about 10 and fits in 64 registers, so 32 warps an SM
// keep two chunks' loads each in flight. benchmarks/README.md, "A GEMV on fragment-ordered int4
// weights" (the standalone probe, benchmarks/gemv_frag_probe.cu) and "The offset GEMV".
//
// The decode. Lane (g, t) of a warp loads, per chunk, 16 bytes of weight rows g and g + 8: values
// 32t .. 32t + 31. In word j (values 8j .. 8j + 7 of those, low nibble first) one LOP3 each gives
//   (w & 0x000F000F) | 0x64006400      = the fp16 pair (1024 + q[8j],      1024 + q[8j + 4])
//   (w & 0x00F000F0) | 0x64006400      =               (1024 + 16 q[8j + 1], 1024 + 16 q[8j + 5])
// and the same on w >> 8 values 8j + 2, 8j + 6 and 8j + 3, 8j + 7: with rows g and g + 8 these
// are the four A registers of a "lo" mma and of a "hi" mma, all exact. The mma's k slots then hold
// values in an order that is the same for every row (lo: slot 2t + e <-> 32t + 8j + 4e, slot 2t
// + 8 + e <-> 32t + 8j + 2 + 4e; hi: the next value of each), so x is permuted to match once, into
// shared memory, with the hi mma's values divided by 16 (exact).
// The offsets are not taken off per weight. A chunk's float32 sum for a row is
//   sum(q x) + C,  C = 1024 Sx_lo + 64 Sx_hi  (Sx_lo, Sx_hi: the chunk's sums of x over lo, hi slots)
// and the row's output gains s (sum - C - z Sx) per chunk, with C and Sx computed with the staging:
// one FADD and two FFMA per row and chunk, nothing per weight. Symmetric codes (two's complement
// nibbles) get bit 3 flipped inside the same LOP3 (q + 8, z = 8). The result differs from a sum
// of dequantized products by float32 rounding only; the offsets add |error| <~ 2^-24 * 1024 *
// sum|x| per chunk and row, well under the fp16 output's rounding.
//
// B's columns hold x (one row of X, or two alternating: weight_only_gemv_kernel), so lane (g, t)'s
// accumulators c[0], c[2] are rows g and g + 8. Two rows of X take this kernel where the format says
// so (kGemvMaxRows): on int4's rows layout they spill at 64 registers and measured mixed against the
// tensor-core driver, on its tiles layout mostly faster (benchmarks/README.md, "The offset GEMV",
// "int4's tiles layout").
// Work split: a CTA owns 16 weight rows and all of K; its W warps split K into runs of whole
// chunks (W from the chunk count: about 4 to 8 chunks a warp, measured in the probe), each warp
// stages only its own chunks of x (no CTA barrier before the loop) while its first two chunks'
// weights load. The warps' sums are added in shared memory in a fixed order: deterministic.
#pragma once
#include <cstdint>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "common/fp16.h"
#include "gemm/weight_only_cuda.cuh"
#include "gemm/weight_only_mma_cuda.cuh"

namespace qf::gemm::cuda_wo {

// A format opts in with `static constexpr bool kGemvNibbles = true` and
//   bool gemv_ok() const                      the shape's chunks each have one scale and zero point
//   __host__ __device__ const uint8_t* gemv_codes() const   the codes (for the alignment check)
//   __device__ const uint8_t* gemv_row(int64_t m) const     row m's first chunk: 64 bytes, low
//                                             nibble first (16-byte aligned)
//   __device__ int64_t gemv_offset(int64_t chunk) const     bytes from a row's first chunk to
//                                             chunk `chunk`, the same for every row
//   __device__ int64_t gemv_meta_row(int64_t m) const       row m's first chunk's metadata index
//   __device__ GemvMeta gemv_meta(int64_t row_index, int64_t chunk) const   chunk `chunk` of the
//                                             row whose gemv_meta_row is row_index
//   __device__ uint32_t gemv_flip() const     nibble bits to flip before the decode (0x88888888:
//                                             two's-complement codes to q + 8)
//   static constexpr int kGemvMaxRows         activation rows it takes (1 or 2)
struct GemvMeta {
  float scale;
  uint32_t zero;  // the code of 0.0 (below 2^16)
};
template <class Fmt, class = void>
struct HasGemv : std::false_type {};
template <class Fmt>
struct HasGemv<Fmt, std::enable_if_t<Fmt::kGemvNibbles>> : std::true_type {};

constexpr int kGemvChunk = 128;      // values per chunk: one scale and zero point
constexpr int kGemvChunkBytes = 64;  // of one row

// 16 bytes read once: not kept in L1.
__device__ __forceinline__ uint4 ld_stream16(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Per chunk and lane: rows g and g + 8's 16 bytes, scales and zero points (row g + 8's in bits
// 16..31: one register for both, so that two slots stay within 64 registers without spilling).
struct GemvSlot {
  uint4 c[2];
  float s[2];
  uint32_t z;
};

// NT activation rows (1 or 2; 4 is written too, and measured slower than the tensor-core driver on
// every shape: benchmarks/README.md, "int4's tiles layout"): B's column n holds x row n % NT, so
// lane (g, t)'s accumulators c[e], c[2 + e] are weight rows g, g + 8 times x row (2t + e) % NT
// (e = 0, 1; NT = 1: e = 0 only). The decode and the mma are the same for every NT.
template <class Fmt, int W, int NT>
__global__ void
__launch_bounds__(W * 32, 1024 / (W * 32))
    weight_only_gemv_kernel(const Fmt f, const half_t* __restrict__ X, int64_t K, int64_t M, half_t* __restrict__ Y,
                            const half_t* __restrict__ bias) {
  static_assert(NT == 1 || NT == 2 || NT == 4, "x rows in B's columns");
  constexpr int E = NT == 1 ? 1 : 2;           // x rows per lane
  constexpr int kWriters = NT == 4 ? 2 : 1;    // lanes t < kWriters hold distinct x rows
  using Ops = PairOps<half_t>;
  extern __shared__ __align__(16) uint8_t gemv_smem[];
  const int KC = int(K / kGemvChunk);
  // xs [KC][j 4][x row NT][t 4]: {lo b0, lo b1, hi b0, hi b1} of lane t's mma pair j;
  // sxc [KC][x row NT]: {Sx, C}
  uint4* xs = reinterpret_cast<uint4*>(gemv_smem);
  float2* sxc = reinterpret_cast<float2*>(xs + size_t(KC) * 16 * NT);
  __shared__ float red[W][NT][16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t m0 = int64_t(blockIdx.x) * 16;
  const int c0 = KC * warp / W, n = KC * (warp + 1) / W - c0;  // this warp's chunks
  // rows past M load row M - 1 (in bounds) and store nothing
  const int64_t ra = m0 + g < M ? m0 + g : M - 1, rb = m0 + g + 8 < M ? m0 + g + 8 : M - 1;
  const uint8_t* qa = f.gemv_row(ra) + t * 16;
  const uint8_t* qb = f.gemv_row(rb) + t * 16;
  const int64_t ia = f.gemv_meta_row(ra), ib = f.gemv_meta_row(rb);
  auto load = [&](int i, GemvSlot& sl) {
    const int64_t off = f.gemv_offset(c0 + i);
    sl.c[0] = ld_stream16(qa + off);
    sl.c[1] = ld_stream16(qb + off);
    const GemvMeta a = f.gemv_meta(ia, c0 + i), b = f.gemv_meta(ib, c0 + i);
    sl.s[0] = a.scale;
    sl.s[1] = b.scale;
    sl.z = a.zero | b.zero << 16;
  };
  GemvSlot sl[2];
  if (n > 0) load(0, sl[0]);
  if (n > 1) load(1, sl[1]);

  // x's chunks of this warp into xs: a lane per (chunk, x row, j, t), one 16-byte load of values
  // 32t + 8j .. + 7, four PRMT into the slots' order; C and Sx summed over the 16 lanes of a chunk.
  for (int base = 0; base < n * 16 * NT; base += 32) {
    const int it = base + lane, c = c0 + (it >> 4) / NT, xr = (it >> 4) % NT, j = (it >> 2) & 3, tt = it & 3;
    const bool ok = it < n * 16 * NT;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (ok) v = __ldg(reinterpret_cast<const uint4*>(X + xr * K + int64_t(c) * kGemvChunk + 32 * tt + 8 * j));
    const uint32_t lo0 = lo_lo(v.x, v.z), lo1 = lo_lo(v.y, v.w), hi0 = hi_hi(v.x, v.z), hi1 = hi_hi(v.y, v.w);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo0)),
                 b = __half22float2(*reinterpret_cast<const __half2*>(&lo1)),
                 d = __half22float2(*reinterpret_cast<const __half2*>(&hi0)),
                 e = __half22float2(*reinterpret_cast<const __half2*>(&hi1));
    const float slo = (a.x + a.y) + (b.x + b.y), shi = (d.x + d.y) + (e.x + e.y);
    float sx = slo + shi, cc = 1024.0f * slo + 64.0f * shi;
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) {
      sx += __shfl_xor_sync(0xffffffffu, sx, o);
      cc += __shfl_xor_sync(0xffffffffu, cc, o);
    }
    if (ok) {
      constexpr uint32_t kSixteenth = 0x2C002C00u;  // 1/16 in both halves
      xs[((c * 4 + j) * NT + xr) * 4 + tt] = make_uint4(lo0, lo1, Ops::mul(hi0, kSixteenth), Ops::mul(hi1, kSixteenth));
      if ((it & 15) == 0) sxc[c * NT + xr] = make_float2(sx, cc);
    }
  }
  __syncwarp();

  const uint32_t flip = f.gemv_flip();
  const uint32_t klo = 0x64006400u ^ (flip & 0x000F000Fu), khi = 0x64006400u ^ (flip & 0x00F000F0u);
  float acc[2][E] = {};  // rows g, g + 8; x rows (2t + e) % NT
  for (int i0 = 0; i0 < n; i0 += 2) {
#pragma unroll
    for (int d = 0; d < 2; ++d) {
      const int i = i0 + d, c = c0 + i;
      if (i >= n) break;
      float dl[4] = {0.f, 0.f, 0.f, 0.f}, dh[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 xq = xs[((c * 4 + j) * NT + g % NT) * 4 + t];
        const uint32_t wa = word_of(sl[d].c[0], j), wb = word_of(sl[d].c[1], j);
        const uint32_t alo[4] = {cuda::and_xor(wa, 0x000F000Fu, klo), cuda::and_xor(wb, 0x000F000Fu, klo),
                                 cuda::and_xor(wa >> 8, 0x000F000Fu, klo), cuda::and_xor(wb >> 8, 0x000F000Fu, klo)};
        const uint32_t ahi[4] = {cuda::and_xor(wa, 0x00F000F0u, khi), cuda::and_xor(wb, 0x00F000F0u, khi),
                                 cuda::and_xor(wa >> 8, 0x00F000F0u, khi), cuda::and_xor(wb >> 8, 0x00F000F0u, khi)};
        Ops::mma(dl, alo, xq.x, xq.y);
        Ops::mma(dh, ahi, xq.z, xq.w);
      }
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float2 sc = sxc[c * NT + (2 * t + e) % NT];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float u = fmaf(-float((sl[d].z >> (16 * r)) & 0xFFFFu), sc.x, dl[2 * r + e] + dh[2 * r + e] - sc.y);
          acc[r][e] = fmaf(sl[d].s[r], u, acc[r][e]);
        }
      }
      if (i + 2 < n) load(i + 2, sl[d]);
    }
  }
  if (t < kWriters) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      red[warp][(2 * t + e) % NT][g] = acc[0][e];
      red[warp][(2 * t + e) % NT][g + 8] = acc[1][e];
    }
  }
  __syncthreads();
  if (threadIdx.x < 16 * NT) {
    const int r = threadIdx.x % 16, xr = threadIdx.x / 16;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) v += red[w][xr][r];
    if (m0 + r < M) store_out(v, bias, m0 + r, &Y[xr * M + m0 + r]);
  }
}

// Launches the offset GEMV on `stream` and returns true where it takes the product: fp16 X and Y
// (16-byte aligned, the launcher contract), N = 1 (or 2 where Fmt::kGemvMaxRows says so), a format with the hooks above whose
// gemv_ok() holds, K a multiple of 128 with x's staged chunks within the device's shared memory,
// codes 16-byte aligned, sm_80+ (the caller checks). Otherwise false, and nothing is launched.
template <class Fmt, class T>
bool launch_weight_only_gemv(const Fmt& f, const T* X, int64_t N, int64_t K, int64_t M, T* Y, const T* bias,
                             void* stream) {
  if constexpr (!std::is_same_v<T, half_t> || !HasGemv<Fmt>::value) {
    return false;
  } else {
    if (N < 1 || N > Fmt::kGemvMaxRows || M <= 0 || K % kGemvChunk || !f.gemv_ok() ||
        reinterpret_cast<uintptr_t>(f.gemv_codes()) % 16)
      return false;
    const int64_t chunks = K / kGemvChunk;
    const size_t smem = size_t(chunks) * N * (16 * 16 + sizeof(float2));
    constexpr size_t kDefaultSmem = 46 * 1024;  // (48 KB less the static red[])
    if (smem > kDefaultSmem && smem > size_t(cuda::max_dynamic_smem()) - 4096) return false;
    // Warps per CTA from the chunks of a row: 4096x14336 (112 chunks) measured fastest with 16
    // (7 chunks a warp), 14336x4096 (32) with 8 (benchmarks/README.md, "A GEMV on
    // fragment-ordered int4 weights").
    const int warps = chunks >= 64 ? 16 : chunks >= 16 ? 8 : 4;
    const dim3 grid(cuda::grid_for(M, 16));
    cudaStream_t s = cuda::stream(stream);
    auto go = [&](auto kernel) {
      if (smem > kDefaultSmem) cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel));
      kernel<<<grid, warps * 32, smem, s>>>(f, X, K, M, Y, bias);
    };
    auto with_rows = [&](auto nt) {
      constexpr int NT = decltype(nt)::value;
      if (warps == 16)
        go(weight_only_gemv_kernel<Fmt, 16, NT>);
      else if (warps == 8)
        go(weight_only_gemv_kernel<Fmt, 8, NT>);
      else
        go(weight_only_gemv_kernel<Fmt, 4, NT>);
    };
    if (N == 1)
      with_rows(std::integral_constant<int, 1>{});
    else if constexpr (Fmt::kGemvMaxRows >= 2)
      with_rows(std::integral_constant<int, 2>{});
    cuda::check_launch("weight-only GEMV (offsets after the mma)");
    return true;
  }
}

}  // namespace qf::gemm::cuda_wo
