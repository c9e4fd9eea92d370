// A one- and two-row int4 GEMV on weights stored in the order of the mma fragments (the Marlin
// idea, arXiv 2408.11743, applied to N = 1), a standalone probe for issue 19's N = 1 target: with
// the codes pre-permuted, a lane's 16-byte loads hold exactly its A fragments, so the decode is
// one shift and four LOP3 per 32-bit word and nothing else (no PRMT, no HSUB2 or HMUL2 per pair,
// no shared memory for weights), and the kernel fits in 64 registers (32 warps an SM). Does such
// a kernel, streaming its weights through registers, get near the read floor? Not the library's
// kernel: int4 with group_size 128, a zero point (0..15, one byte) and a float32 scale per group
// (qformats.int4's bytes per group), fp16 activations; checked against a float64 reference on
// the host.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -Isrc -Ibenchmarks benchmarks/gemv_frag_probe.cu -lcublas -o /tmp/gemv_frag_probe
//   /tmp/gemv_frag_probe ["name"]   (4096x14336 and 14336x4096, cold and back-to-back launches;
//                                   a name: that variant only, e.g. for ncu; -DNO_CUBLAS drops
//                                   the fp16 cuBLAS rows)
// Results: benchmarks/README.md, "A GEMV on fragment-ordered int4 weights".
//
// Layout (the probe's; the library has none of it): the weight is cut into blocks of 16 rows x
// one group (128 values), 1 KB each, stored tile after tile, group after group. In a block, lane
// l = 4 g + t of a warp owns 8 words, w[i] at byte (i / 4) * 512 + 16 l + 4 (i % 4), so the warp
// reads a block with two perfectly coalesced 16-byte loads. Words w[2p], w[2p + 1] feed the two
// mma of k-pair p ("lo" and "hi"); nibble n (bits 4n) of w[2p + h] is row g + 8 ((n >> 1) & 1)
// and, of the group, k = 32p + 16 (n & 1) + 8h + 2t + (n >> 2) (kMagic, kCenter) or k = 32t + 8p
// + 4 (n & 1) + 2h + (n >> 2) (kDirect). Then (w & 0x000F000F) | 0x64006400 is the pair
// (1024 + q) of the lo mma's a0 (a2 from w[2p + 1]), (w & 0x00F000F0) | 0x64006400 the pair
// (1024 + 16 q) of the hi mma's, and the same on w >> 8 gives rows g + 8 (a1, a3). Scales and
// zero points: per block, 16 float32 then 16 bytes, loaded by each lane for its rows g, g + 8.
//
// Modes:
//   kMagic   A = 1024 + q (lo) and 1024 + 16 q (hi) as they come out of the LOP3, the hi mma's B
//            = x / 16 (exact); a group's sum is then sum(q x) + 1024 Sx_lo + 64 Sx_hi, and these
//            offsets and the zero point are taken off after the mma, in float32, with the
//            group's Sx (one FFMA per row and group, no work per weight).
//   kCenter  A = q - 8 exact (one HSUB2 or HFMA2 per pair more), B = x: smaller sums.
//   kStream  the loads alone (XOR of the words), no decode, no mma.
//   (kDirect, gemv_direct below, and gemv_row, on the int4 bytes as stored: see there.)
// kMagic and kCenter stage X in shared memory in B-fragment order, with each group's Sx and
// offset: each warp its own groups, while its first weight loads are in flight. NT rows of X
// (1, 2 or 8) go in B's columns. A CTA owns R 16-row tiles; its W warps split K into contiguous
// runs of groups; each warp keeps D groups' loads in flight.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#ifndef NO_CUBLAS
#include <cublas_v2.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_probe.cuh"

enum Mode { kMagic = 0, kCenter = 1, kStream = 2 };

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {  // read once: keep it out of L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ float u8f(uint32_t z) { return __uint_as_float(0x4B000000u | z) - 8388608.f; }

template <int R>
struct Slot {  // one group's loads for R tiles
  uint4 c[R][2];
  float s[R][2];
  uint32_t z[R][2];
};

__device__ __forceinline__ float hsum8(const uint4& v) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __half2 h = *reinterpret_cast<const __half2*>(&reinterpret_cast<const uint32_t*>(&v)[j]);
    s += __low2float(h) + __high2float(h);
  }
  return s;
}

template <int W, int R, int D, int MODE, bool STAGE = true, int NT = 1>
__global__ void __launch_bounds__(W * 32, D == 2 && R == 1 ? 1024 / (W * 32) : 1) gemv(const uint4* __restrict__ q, const float* __restrict__ sc,
                                               const uint8_t* __restrict__ zr, const __half* __restrict__ x,
                                               __half* __restrict__ y, int M, int K) {
  extern __shared__ __align__(16) uint8_t sm[];
  const int KG = K / 128;
  uint4* xs = reinterpret_cast<uint4*>(sm);  // [KG][p 4][NT][t 4]: {lo b0, lo b1, hi b0, hi b1}
  float2* sxc = reinterpret_cast<float2*>(xs + KG * 16 * NT);  // [KG][NT]: {Sx, C}
  __shared__ float red[W][NT][16 * R];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile0 = blockIdx.x * R;
  const int g0 = KG * warp / W, n = KG * (warp + 1) / W - g0;

  auto load = [&](int i, Slot<R>& sl) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const size_t blk = size_t(tile0 + r) * KG + g0 + i;
      const uint4* p = q + blk * 64 + lane;
      sl.c[r][0] = ld_stream(p);
      sl.c[r][1] = ld_stream(p + 32);
      if constexpr (MODE != kStream) {
        sl.s[r][0] = __ldg(sc + blk * 16 + g);
        sl.s[r][1] = __ldg(sc + blk * 16 + g + 8);
        sl.z[r][0] = __ldg(zr + blk * 16 + g);
        sl.z[r][1] = __ldg(zr + blk * 16 + g + 8);
      }
    }
  };
  Slot<R> sl[D];
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (d < n) load(d, sl[d]);

  if constexpr (MODE != kStream && STAGE) {
    // X in B-fragment order, and per group Sx and the offset C that the decode leaves in the
    // sums: each warp stages only its own groups (no CTA barrier), a lane per (group, p, lo or
    // hi): two 16-byte loads of x[32p + 16 hi ..], a 2 x 4 transpose of words into the lanes t.
    // (NT rows of x: B's column c holds x row c; lanes g >= NT read row g % NT, unused columns)
    for (int base = 0; base < n * 8 * NT; base += 32) {
      const int it = base + lane, grp = g0 + (it >> 3) / NT, nr = (it >> 3) % NT, p = (it >> 1) & 3, hi = it & 1;
      const bool ok = it < n * 8 * NT;
      uint4 v0 = {}, v1 = {};
      if (ok) {
        const uint4* px = reinterpret_cast<const uint4*>(x + size_t(nr) * K + grp * 128 + 32 * p + 16 * hi);
        v0 = __ldg(px);
        v1 = __ldg(px + 1);
      }
      float sx = hsum8(v0) + hsum8(v1);
      float c = sx * (MODE == kMagic ? (hi ? 64.f : 1024.f) : -8.f);
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) {
        sx += __shfl_xor_sync(0xffffffffu, sx, o);
        c += __shfl_xor_sync(0xffffffffu, c, o);
      }
      if (ok) {
        if (MODE == kMagic && hi) {  // the hi mma's B: x / 16 (exact)
          v0 = make_uint4(hmul2(v0.x, 0x2C002C00u), hmul2(v0.y, 0x2C002C00u), hmul2(v0.z, 0x2C002C00u),
                          hmul2(v0.w, 0x2C002C00u));
          v1 = make_uint4(hmul2(v1.x, 0x2C002C00u), hmul2(v1.y, 0x2C002C00u), hmul2(v1.z, 0x2C002C00u),
                          hmul2(v1.w, 0x2C002C00u));
        }
        uint2* xs2 = reinterpret_cast<uint2*>(xs);
#pragma unroll
        for (int tt = 0; tt < 4; ++tt)
          xs2[(((grp * 4 + p) * NT + nr) * 4 + tt) * 2 + hi] = make_uint2(word(v0, tt), word(v1, tt));
        if ((it & 7) == 0) sxc[grp * NT + nr] = make_float2(sx, c);
      }
    }
    __syncwarp();
  }

  float acc[R][2][2] = {};
  uint32_t sink = 0;
  for (int i0 = 0; i0 < n; i0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int i = i0 + d;
      if (i >= n) break;
      if constexpr (MODE == kStream) {
#pragma unroll
        for (int r = 0; r < R; ++r)
          sink ^= sl[d].c[r][0].x ^ sl[d].c[r][0].y ^ sl[d].c[r][0].z ^ sl[d].c[r][0].w ^ sl[d].c[r][1].x ^
                  sl[d].c[r][1].y ^ sl[d].c[r][1].z ^ sl[d].c[r][1].w;
      } else {
        const int grp = g0 + i;
        uint4 xq[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) xq[p] = xs[((grp * 4 + p) * NT + g % NT) * 4 + t];
        const float2 sxe[2] = {sxc[grp * NT + min(2 * t, NT - 1)], sxc[grp * NT + min(2 * t + 1, NT - 1)]};
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float dl[4] = {0.f, 0.f, 0.f, 0.f}, dh[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            const uint32_t w0 = word(sl[d].c[r][p >> 1], (p & 1) * 2), w1 = word(sl[d].c[r][p >> 1], (p & 1) * 2 + 1);
            const uint32_t w0s = w0 >> 8, w1s = w1 >> 8;
            uint32_t alo[4] = {lop3_or(w0, 0x000F000Fu), lop3_or(w0s, 0x000F000Fu), lop3_or(w1, 0x000F000Fu),
                               lop3_or(w1s, 0x000F000Fu)};
            uint32_t ahi[4] = {lop3_or(w0, 0x00F000F0u), lop3_or(w0s, 0x00F000F0u), lop3_or(w1, 0x00F000F0u),
                               lop3_or(w1s, 0x00F000F0u)};
            if constexpr (MODE == kCenter) {
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                alo[j] = hsub2(alo[j], 0x64086408u);               // 1024 + q - 1032
                ahi[j] = hfma2(ahi[j], 0x2C002C00u, 0xD480D480u);  // (1024 + 16 q) / 16 - 72
              }
            }
            mma(dl, alo, xq[p].x, xq[p].y);
            mma(dh, ahi, xq[p].z, xq[p].w);
          }
#pragma unroll
          for (int j = 0; j < 2; ++j)  // d[2j + e]: row g + 8j, column 2t + e (NT = 1: every column is x)
#pragma unroll
            for (int e = 0; e < (NT == 1 ? 1 : 2); ++e) {
              float u = dl[2 * j + e] + dh[2 * j + e] - sxe[e].y;
              u = fmaf(-u8f(sl[d].z[r][j]), sxe[e].x, u);
              acc[r][j][e] = fmaf(sl[d].s[r][j], u, acc[r][j][e]);
            }
        }
      }
      if (i + D < n) load(i + D, sl[d]);
    }
  }
  if (MODE == kStream && sink == 0x12345679u) acc[0][0][0] += 1.f;  // (keeps the reads)
#pragma unroll
  for (int e = 0; e < 2; ++e)
    if (2 * t + e < NT)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        red[warp][2 * t + e][r * 16 + g] = acc[r][0][e];
        red[warp][2 * t + e][r * 16 + g + 8] = acc[r][1][e];
      }
  __syncthreads();
  if (threadIdx.x < 16 * R * NT) {
    const int c = threadIdx.x / (16 * R), m = threadIdx.x % (16 * R);
    float v = 0.f;
    for (int w = 0; w < W; ++w) v += red[w][c][m];
    y[size_t(c) * M + size_t(tile0) * 16 + m] = __float2half(v);
  }
}

// kDirect: the k order of a block chosen so that lane t's B fragments are x[32t .. 32t + 31] of
// the group, in order (nibble n of w[2p + h] is row g + 8 ((n >> 1) & 1), k = 32t + 8p + 4 (n & 1)
// + 2h + (n >> 2)): four 16-byte loads of x per group, no staging, no shared memory. The offsets
// 1024 Sx_lo + 64 Sx_hi and Sx come from one more mma per group whose B holds the group's 128
// values as 8 columns of 16 (chunk c = x[16c .. 16c + 15]) and whose A rows 0-7 weigh a slot by
// 1024 (lo) or 64 (hi), rows 8-15 by 1: lane (g, t) gets chunk 2t and 2t + 1's C in d[0], d[1]
// and their Sx in d[2], d[3]; a quad sum finishes both.
// SMEM: each warp first copies its groups' x into shared memory with cp.async (no registers,
// in flight with the first weight loads; this order is already the fragments' order), and the
// loop reads x from there instead of through L1.
template <int W, int R, int D, bool SMEM = false>
__global__ void __launch_bounds__(W * 32, D == 2 && R == 1 ? 1024 / (W * 32) : 1)
    gemv_direct(const uint4* __restrict__ q, const float* __restrict__ sc, const uint8_t* __restrict__ zr,
                const __half* __restrict__ x, __half* __restrict__ y, int M, int K) {
  const int KG = K / 128;
  __shared__ float red[W][16 * R];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile0 = blockIdx.x * R;
  const int g0 = KG * warp / W, n = KG * (warp + 1) / W - g0;
  auto load = [&](int i, Slot<R>& sl) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const size_t blk = size_t(tile0 + r) * KG + g0 + i;
      const uint4* p = q + blk * 64 + lane;
      sl.c[r][0] = ld_stream(p);
      sl.c[r][1] = ld_stream(p + 32);
      sl.s[r][0] = __ldg(sc + blk * 16 + g);
      sl.s[r][1] = __ldg(sc + blk * 16 + g + 8);
      sl.z[r][0] = __ldg(zr + blk * 16 + g);
      sl.z[r][1] = __ldg(zr + blk * 16 + g + 8);
    }
  };
  Slot<R> sl[D];
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (d < n) load(d, sl[d]);
  extern __shared__ __align__(16) uint8_t sm[];
  const __half* xsrc = x;
  if constexpr (SMEM) {
    __half* xn = reinterpret_cast<__half*>(sm);
    for (int c = lane; c < n * 16; c += 32) {
      const int e = g0 * 128 + c * 8;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(xn + e)), "l"(x + e) : "memory");
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncwarp();
    xsrc = xn;
  }
  const uint32_t wc = (t >> 1) ? 0x54005400u : 0x64006400u;  // 64 or 1024 (slot 2t's class)
  const uint32_t asum[4] = {wc, 0x3C003C00u, wc, 0x3C003C00u};
  float acc[R][2] = {};
  for (int i0 = 0; i0 < n; i0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int i = i0 + d;
      if (i >= n) break;
      const int grp = g0 + i;
      const uint4* xp = reinterpret_cast<const uint4*>(xsrc + grp * 128 + 32 * t);
      const uint32_t* xw = reinterpret_cast<const uint32_t*>(xsrc + grp * 128 + 16 * g + 2 * t);
      float ds[4] = {0.f, 0.f, 0.f, 0.f};
      if constexpr (SMEM)
        mma(ds, asum, xw[0], xw[4]);
      else
        mma(ds, asum, __ldg(xw), __ldg(xw + 4));
      float cc = ds[0] + ds[1], sx = ds[2] + ds[3];
      cc += __shfl_xor_sync(0xffffffffu, cc, 1);
      sx += __shfl_xor_sync(0xffffffffu, sx, 1);
      cc += __shfl_xor_sync(0xffffffffu, cc, 2);
      sx += __shfl_xor_sync(0xffffffffu, sx, 2);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float dl[4] = {0.f, 0.f, 0.f, 0.f}, dh[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const uint32_t w0 = word(sl[d].c[r][p >> 1], (p & 1) * 2), w1 = word(sl[d].c[r][p >> 1], (p & 1) * 2 + 1);
          const uint32_t w0s = w0 >> 8, w1s = w1 >> 8;
          const uint32_t alo[4] = {lop3_or(w0, 0x000F000Fu), lop3_or(w0s, 0x000F000Fu), lop3_or(w1, 0x000F000Fu),
                                   lop3_or(w1s, 0x000F000Fu)};
          const uint32_t ahi[4] = {lop3_or(w0, 0x00F000F0u), lop3_or(w0s, 0x00F000F0u), lop3_or(w1, 0x00F000F0u),
                                   lop3_or(w1s, 0x00F000F0u)};
          const uint4 xq = SMEM ? xp[p] : __ldg(xp + p);
          mma(dl, alo, xq.x, xq.y);
          mma(dh, ahi, xq.z, xq.w);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float u = fmaf(dh[2 * j], 0.0625f, dl[2 * j]) - cc;
          u = fmaf(-u8f(sl[d].z[r][j]), sx, u);
          acc[r][j] = fmaf(sl[d].s[r][j], u, acc[r][j]);
        }
      }
      if (i + D < n) load(i + D, sl[d]);
    }
  }
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      red[warp][r * 16 + g] = acc[r][0];
      red[warp][r * 16 + g + 8] = acc[r][1];
    }
  }
  __syncthreads();
  if (threadIdx.x < 16 * R) {
    float v = 0.f;
    for (int w = 0; w < W; ++w) v += red[w][threadIdx.x];
    y[size_t(tile0) * 16 + threadIdx.x] = __float2half(v);
  }
}

// kRow: the library's int4 bytes as stored (row-major, low nibble first): lane (g, t) loads values
// 32t .. 32t + 31 of a chunk of rows g and g + 8 (a quad reads 64 bytes of a row); word j's
// LOP3s give the lo pair (q[8j], q[8j + 4]) and, on w >> 8, (q[8j + 2], q[8j + 6]), so the mma's k
// slots hold values in an order the same for every row, and X is permuted to it (PRMT) when
// staged. ROWMETA: scales and zero points [M][K / 128] as stored, else the blocked copy. PAIRED:
// the next two chunks' loads issued together (a quad's 128 contiguous bytes of a row at once)
// after both slots are used, instead of one chunk after each.
template <int W, bool PAIRED, bool ROWMETA>
__global__ void __launch_bounds__(W * 32, 1024 / (W * 32))
    gemv_row(const uint8_t* __restrict__ q, const float* __restrict__ sc, const uint8_t* __restrict__ zr,
             const __half* __restrict__ x, __half* __restrict__ y, int M, int K) {
  extern __shared__ __align__(16) uint8_t sm[];
  const int KC = K / 128;
  uint4* xs = reinterpret_cast<uint4*>(sm);
  float2* sxc = reinterpret_cast<float2*>(xs + KC * 16);
  __shared__ float red[W][16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x;
  const int c0 = KC * warp / W, n = KC * (warp + 1) / W - c0;
  const uint8_t* qa = q + size_t(tile * 16 + g) * (K / 2) + c0 * 64 + t * 16;
  const uint8_t* qb = qa + size_t(8) * (K / 2);
  auto load = [&](int i, Slot<1>& sl) {
    sl.c[0][0] = ld_stream(reinterpret_cast<const uint4*>(qa + i * 64));
    sl.c[0][1] = ld_stream(reinterpret_cast<const uint4*>(qb + i * 64));
    const int c = c0 + i;
    const size_t ia = ROWMETA ? size_t(tile * 16 + g) * KC + c : (size_t(tile) * KC + c) * 16 + g;
    const size_t ib = ROWMETA ? ia + size_t(8) * KC : ia + 8;
    sl.s[0][0] = __ldg(sc + ia);
    sl.s[0][1] = __ldg(sc + ib);
    sl.z[0][0] = __ldg(zr + ia);
    sl.z[0][1] = __ldg(zr + ib);
  };
  Slot<1> sl[2];
  if (n > 0) load(0, sl[0]);
  if (n > 1) load(1, sl[1]);
  for (int base = 0; base < n * 16; base += 32) {
    const int it = base + lane, c = c0 + (it >> 4), j = (it >> 2) & 3, tt = it & 3;
    const bool ok = it < n * 16;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (ok) v = __ldg(reinterpret_cast<const uint4*>(x + c * 128 + 32 * tt + 8 * j));
    const uint32_t lo0 = __byte_perm(v.x, v.z, 0x5410), lo1 = __byte_perm(v.y, v.w, 0x5410);
    const uint32_t hi0 = __byte_perm(v.x, v.z, 0x7632), hi1 = __byte_perm(v.y, v.w, 0x7632);
    const float slo = hsum8(make_uint4(lo0, lo1, 0u, 0u)), shi = hsum8(make_uint4(hi0, hi1, 0u, 0u));
    float sx = slo + shi, cc = 1024.f * slo + 64.f * shi;
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) {
      sx += __shfl_xor_sync(0xffffffffu, sx, o);
      cc += __shfl_xor_sync(0xffffffffu, cc, o);
    }
    if (ok) {
      xs[(c * 4 + j) * 4 + tt] = make_uint4(lo0, lo1, hmul2(hi0, 0x2C002C00u), hmul2(hi1, 0x2C002C00u));
      if ((it & 15) == 0) sxc[c] = make_float2(sx, cc);
    }
  }
  __syncwarp();
  float acc[2] = {0.f, 0.f};
  for (int i0 = 0; i0 < n; i0 += 2) {
#pragma unroll
    for (int d = 0; d < 2; ++d) {
      const int i = i0 + d, c = c0 + i;
      if (i >= n) break;
      float dl[4] = {0.f, 0.f, 0.f, 0.f}, dh[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 xq = xs[(c * 4 + j) * 4 + t];
        const uint32_t wa = word(sl[d].c[0][0], j), wb = word(sl[d].c[0][1], j);
        const uint32_t alo[4] = {lop3_or(wa, 0x000F000Fu), lop3_or(wb, 0x000F000Fu), lop3_or(wa >> 8, 0x000F000Fu),
                                 lop3_or(wb >> 8, 0x000F000Fu)};
        const uint32_t ahi[4] = {lop3_or(wa, 0x00F000F0u), lop3_or(wb, 0x00F000F0u), lop3_or(wa >> 8, 0x00F000F0u),
                                 lop3_or(wb >> 8, 0x00F000F0u)};
        mma(dl, alo, xq.x, xq.y);
        mma(dh, ahi, xq.z, xq.w);
      }
      const float2 sx = sxc[c];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float u = fmaf(-u8f(sl[d].z[0][r]), sx.x, dl[2 * r] + dh[2 * r] - sx.y);
        acc[r] = fmaf(sl[d].s[0][r], u, acc[r]);
      }
      if (!PAIRED && i + 2 < n) load(i + 2, sl[d]);
    }
    if (PAIRED) {
      if (i0 + 2 < n) load(i0 + 2, sl[0]);
      if (i0 + 3 < n) load(i0 + 3, sl[1]);
    }
  }
  if (t == 0) {
    red[warp][g] = acc[0];
    red[warp][g + 8] = acc[1];
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float v = 0.f;
    for (int w = 0; w < W; ++w) v += red[w][threadIdx.x];
    y[size_t(tile) * 16 + threadIdx.x] = __float2half(v);
  }
}

struct FragSet {
  uint4* q;
  float* s;
  uint8_t* z;
};

// qformats.int4's row-major bytes -> the probe's blocks (see the header)
static void to_frag(const Int4Host& h, int M, int K, bool xcontig, std::vector<uint8_t>& fq, std::vector<float>& fs,
                    std::vector<uint8_t>& fz) {
  const int KG = K / 128;
  fq.assign(size_t(M) * K / 2, 0);
  fs.assign(size_t(M) * KG, 0.f);
  fz.assign(size_t(M) * KG, 0);
  for (int T = 0; T < M / 16; ++T)
    for (int G = 0; G < KG; ++G) {
      const size_t blk = size_t(T) * KG + G;
      for (int r = 0; r < 16; ++r) {
        fs[blk * 16 + r] = h.s[size_t(T * 16 + r) * KG + G];
        fz[blk * 16 + r] = h.z[size_t(T * 16 + r) * KG + G];
      }
      for (int l = 0; l < 32; ++l)
        for (int wi = 0; wi < 8; ++wi)
          for (int nb = 0; nb < 8; ++nb) {
            const int g = l >> 2, t = l & 3, p = wi >> 1, hh = wi & 1;
            const int row = T * 16 + g + 8 * ((nb >> 1) & 1);
            const int k = G * 128 + (xcontig ? 32 * t + 8 * p + 4 * (nb & 1) + 2 * hh + (nb >> 2)
                                             : 32 * p + 16 * (nb & 1) + 8 * hh + 2 * t + (nb >> 2));
            const int qv = (h.q[size_t(row) * K / 2 + k / 2] >> (4 * (k & 1))) & 15;
            const size_t off = blk * 1024 + (wi >> 2) * 512 + l * 16 + (wi & 3) * 4 + (nb >> 1);
            fq[off] |= uint8_t(qv << (4 * (nb & 1)));
          }
    }
}

static const char* only = nullptr;

template <class Launch>
static void time_it(const char* name, int M, int K, int NT, int per_sm, size_t smem, int nsets, Launch launch,
                    const __half* y, const std::vector<double>* ref) {
  launch(0);
  CK(cudaDeviceSynchronize());
  double rel = 0;
  if (ref) {  // y and ref: [NT][M]
    std::vector<__half> h(size_t(NT) * M);
    CK(cudaMemcpy(h.data(), y, h.size() * 2, cudaMemcpyDeviceToHost));
    double err = 0, mx = 0;
    for (size_t m = 0; m < h.size(); ++m) {
      err = std::max(err, std::fabs(double(__half2float(h[m])) - (*ref)[m]));
      mx = std::max(mx, std::fabs((*ref)[m]));
    }
    rel = err / mx;
  }
  const double cold = median_cold_us(15, [](int) {}, [&](int i) { launch(i % nsets); });
  const double resident = median_resident_us([&] { launch(0); });  // one weight, back to back
  std::printf("%-24s %5dx%-5d N %d  CTAs/SM %2d  smem %6zu  cold %6.1f us  resident %6.1f us", name, M, K, NT, per_sm,
              smem, cold, resident);
  if (ref) std::printf("  max|err|/max|y| %.2e", rel);
  std::printf("\n");
}

template <int W, int R, int D, int MODE, bool STAGE = true, int NT = 1>
static void run(const char* name, int M, int K, const std::vector<FragSet>& sets, const __half* x, __half* y,
                const std::vector<double>& ref) {
  const int KG = K / 128;
  if (M % (16 * R) || KG < W || (only && std::strcmp(name, only) != 0)) return;
  const size_t smem = MODE == kStream ? 0 : size_t(KG) * (256 + 8) * NT;
  if (smem > 227 * 1024) return;  // (x's NT rows do not fit)
  auto kern = gemv<W, R, D, MODE, STAGE, NT>;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, W * 32, smem));
  auto launch = [&](int i) {
    const FragSet& st = sets[i];
    kern<<<M / (16 * R), W * 32, smem>>>(st.q, st.s, st.z, x, y, M, K);
  };
  time_it(name, M, K, NT, per_sm, smem, int(sets.size()), launch, y, MODE == kStream || !STAGE ? nullptr : &ref);
}

template <int W, int R, int D, bool SMEM = false>
static void run_direct(const char* name, int M, int K, const std::vector<FragSet>& sets, const __half* x, __half* y,
                       const std::vector<double>& ref) {
  const int KG = K / 128;
  if (M % (16 * R) || KG < W || (only && std::strcmp(name, only) != 0)) return;
  auto kern = gemv_direct<W, R, D, SMEM>;
  const size_t smem = SMEM ? size_t(K) * 2 : 0;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, W * 32, smem));
  auto launch = [&](int i) {
    const FragSet& st = sets[i];
    kern<<<M / (16 * R), W * 32, smem>>>(st.q, st.s, st.z, x, y, M, K);
  };
  time_it(name, M, K, 1, per_sm, smem, int(sets.size()), launch, y, &ref);
}

template <int W, bool PAIRED, bool ROWMETA>
static void run_row(const char* name, int M, int K, const std::vector<FragSet>& sets, const __half* x, __half* y,
                    const std::vector<double>& ref) {
  if (M % 16 || K / 128 < W || (only && std::strcmp(name, only) != 0)) return;
  auto kern = gemv_row<W, PAIRED, ROWMETA>;
  const size_t smem = size_t(K / 128) * (256 + 8);
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, W * 32, smem));
  auto launch = [&](int i) {
    const FragSet& st = sets[i];
    kern<<<M / 16, W * 32, smem>>>(reinterpret_cast<const uint8_t*>(st.q), st.s, st.z, x, y, M, K);
  };
  time_it(name, M, K, 1, per_sm, smem, int(sets.size()), launch, y, &ref);
}

int main(int argc, char** argv) {
  if (argc > 1) only = argv[1];
  const int shapes[2][2] = {{4096, 14336}, {14336, 4096}};
  for (auto& sh : shapes) {
    const int M = sh[0], K = sh[1], KG = K / 128;
    const Int4Host h = random_int4(M, K, 8);
    std::vector<double> ref(size_t(8) * M, 0.0), wrow(K);  // [8][M]
    for (int m = 0; m < M; ++m) {
      for (int k = 0; k < K; ++k) {
        const int qv = (h.q[size_t(m) * K / 2 + k / 2] >> (4 * (k & 1))) & 15, gi = m * KG + k / 128;
        wrow[k] = double(h.s[gi]) * (qv - h.z[gi]);
      }
      for (int c = 0; c < 8; ++c) {
        double acc = 0;
        for (int k = 0; k < K; ++k) acc += double(__half2float(h.x[size_t(c) * K + k])) * wrow[k];
        ref[size_t(c) * M + m] = acc;
      }
    }
    std::vector<uint8_t> fq, fz;
    std::vector<float> fs;
    to_frag(h, M, K, false, fq, fs, fz);
    const size_t bytes = fq.size() + fz.size() * 5;
    std::vector<FragSet> sets(std::max<size_t>(2, (4 * 60ull << 20) / bytes + 1));
    for (auto& st : sets) {
      CK(cudaMalloc(&st.q, fq.size()));
      CK(cudaMalloc(&st.s, fs.size() * 4));
      CK(cudaMalloc(&st.z, fz.size()));
      CK(cudaMemcpy(st.q, fq.data(), fq.size(), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(st.s, fs.data(), fs.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(st.z, fz.data(), fz.size(), cudaMemcpyHostToDevice));
    }
    __half *x, *y;
    CK(cudaMalloc(&x, 8 * K * 2));
    CK(cudaMalloc(&y, 8 * M * 2));
    CK(cudaMemcpy(x, h.x.data(), 8 * K * 2, cudaMemcpyHostToDevice));
    std::printf("%d x %d: %.1f MB of weights, %zu rotated copies\n", M, K, bytes / 1e6, sets.size());
#ifndef NO_CUBLAS
    if (!only) {  // fp16 cuBLAS, the same protocol: its own rotated copies of an fp16 weight
      cublasHandle_t hb;
      cublasCreate(&hb);
      const size_t wb = size_t(M) * K * 2;
      std::vector<__half*> ws(std::max<size_t>(2, (4 * 60ull << 20) / wb + 1));
      for (auto& w : ws) {
        CK(cudaMalloc(&w, wb));
        CK(cudaMemset(w, 0, wb));
      }
      const float one = 1.f, zero = 0.f;
      for (int nt : {1, 2, 8}) {
        auto launch = [&](int i) {
          cublasGemmEx(hb, CUBLAS_OP_T, CUBLAS_OP_N, M, nt, K, &one, ws[i], CUDA_R_16F, K, x, CUDA_R_16F, K, &zero, y,
                       CUDA_R_16F, M, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        };
        time_it("fp16 cuBLAS", M, K, nt, 0, 0, int(ws.size()), launch, y, nullptr);
      }
      for (auto& w : ws) CK(cudaFree(w));
      cublasDestroy(hb);
    }
#endif
    run<8, 1, 2, kStream>("stream W8 R1 D2", M, K, sets, x, y, ref);
    run<16, 1, 2, kStream>("stream W16 R1 D2", M, K, sets, x, y, ref);
    run<4, 1, 2, kMagic>("magic W4 R1 D2", M, K, sets, x, y, ref);
    run<8, 1, 2, kMagic>("magic W8 R1 D2", M, K, sets, x, y, ref);
    run<16, 1, 2, kMagic>("magic W16 R1 D2", M, K, sets, x, y, ref);
    run<8, 1, 2, kMagic, false>("magic W8 R1 D2 no X", M, K, sets, x, y, ref);
    run<16, 1, 2, kMagic, false>("magic W16 R1 D2 no X", M, K, sets, x, y, ref);
    run<8, 1, 2, kCenter>("center W8 R1 D2", M, K, sets, x, y, ref);
    run<4, 1, 2, kMagic, true, 2>("magic W4 R1 D2", M, K, sets, x, y, ref);
    run<8, 1, 2, kMagic, true, 2>("magic W8 R1 D2", M, K, sets, x, y, ref);
    run<16, 1, 2, kMagic, true, 2>("magic W16 R1 D2", M, K, sets, x, y, ref);
    run<16, 1, 2, kMagic, true, 8>("magic W16 R1 D2", M, K, sets, x, y, ref);
    // the direct layout, in the same buffers
    to_frag(h, M, K, true, fq, fs, fz);
    for (auto& st : sets) CK(cudaMemcpy(st.q, fq.data(), fq.size(), cudaMemcpyHostToDevice));
    run_direct<16, 1, 2>("direct W16 R1 D2", M, K, sets, x, y, ref);
    run_direct<4, 1, 2, true>("direct smem W4 R1 D2", M, K, sets, x, y, ref);
    run_direct<8, 1, 2, true>("direct smem W8 R1 D2", M, K, sets, x, y, ref);
    run_direct<16, 1, 2, true>("direct smem W16 R1 D2", M, K, sets, x, y, ref);
    run_direct<8, 1, 3, true>("direct smem W8 R1 D3", M, K, sets, x, y, ref);
    // the int4 bytes as stored (row-major), first with the blocked scales, then with them as stored
    for (auto& st : sets) CK(cudaMemcpy(st.q, h.q.data(), h.q.size(), cudaMemcpyHostToDevice));
    run_row<8, false, false>("row W8", M, K, sets, x, y, ref);
    run_row<16, false, false>("row W16", M, K, sets, x, y, ref);
    run_row<8, true, false>("row paired W8", M, K, sets, x, y, ref);
    run_row<16, true, false>("row paired W16", M, K, sets, x, y, ref);
    for (auto& st : sets) {
      CK(cudaMemcpy(st.s, h.s.data(), h.s.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(st.z, h.z.data(), h.z.size(), cudaMemcpyHostToDevice));
    }
    run_row<8, false, true>("row rowmeta W8", M, K, sets, x, y, ref);
    run_row<16, false, true>("row rowmeta W16", M, K, sets, x, y, ref);
    run_row<8, true, true>("row rowmeta paired W8", M, K, sets, x, y, ref);
    run_row<16, true, true>("row rowmeta paired W16", M, K, sets, x, y, ref);
    for (auto& st : sets) {
      CK(cudaFree(st.q));
      CK(cudaFree(st.s));
      CK(cudaFree(st.z));
    }
    CK(cudaFree(x));
    CK(cudaFree(y));
  }
  return 0;
}
