// A prefill-sized int4 GEMM (Y [N, M] = X [N, K] . W^T, many activation rows), a standalone
// probe for issue 19's N = 512 / 2048 targets: can a kernel that decodes the packed weight inside
// the tensor-core main loop run near cuBLAS fp16, where the library now decodes the whole weight
// to fp16 first? int4 with group_size 128, zero points and float32 scales (qformats.int4's
// layout), fp16 X; M a multiple of 128, N of BN, K of 128; checked against float64 on the host at
// sampled outputs.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -Isrc -Ibenchmarks -diag-suppress 128,177 \
//        benchmarks/prefill_probe.cu -o /tmp/prefill_probe
//   /tmp/prefill_probe
// (4096x14336 and 14336x4096, N = 256 ... 2048, cold; "no-dec": the same pipeline with A = 1.0,
// checked against the sums of X, except ws's, whose A tile is left stale: its error means nothing.)
// Results: benchmarks/README.md, "A GEMM that decodes int4 in its main loop, for prefill".
//
// Three main loops (benchmarks/README.md has the table):
// - prefill: a CTA owns BM = 128 weight rows and BN activation rows; its two warpgroups take 64
//   weight rows each (wgmma m64nBNk16, A = the decoded weights in registers, B = X from shared
//   memory). K moves in steps of 64: each step's X tile (K-major, 128-byte swizzle: wgmma reads it
//   as it lands), packed weights (128 rows x 32 bytes) and the group's scales and zero points come
//   by cp.async, P - 1 steps ahead; one barrier per step; the wgmma batch of step s runs while the
//   warps decode step s + 1.
// - prefill_ws: TMA copies on mbarriers from a warp of their own, a producer warpgroup decoding
//   into an fp16 A tile in shared memory, consumers issuing wgmma with both operands there.
// - prefill_rt: the TMA warp and mbarriers, consumers decoding their own A into registers; 64 or
//   128 weight rows and 128 or 256 activation rows per CTA.
// No permutation of X: the decode builds A in the natural k order. Lane (g, t) needs, per k16
// slice j, byte t of the row's words 2j and 2j + 1 (values 2t, 2t + 1 and 2t + 8, 2t + 9); a PRMT
// copies that byte into both halves of a register, one LOP3 puts its low nibble into the low half's
// mantissa of 1024 and its high nibble, times 16, into the high half's, HSUB2 takes off
// (1024 + z, 1024 + 16 z) and HMUL2 multiplies by (s, s / 16): four instructions per pair of
// weights, each weight (q - z) * s rounded once to fp16 from an fp16 s.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_probe.cuh"
#include "gemm/wgmma_cuda.cuh"

namespace wg = qf::gemm::cuda_wo::wg;

__device__ __forceinline__ void cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ uint32_t pair(uint32_t word, uint32_t sel, uint32_t zoff, uint32_t s2) {
  return hmul2(hsub2(lop3_or(__byte_perm(word, 0u, sel), 0x00F0000Fu), zoff), s2);
}

// (s, s / 16) and (1024 + z, 1024 + 16 z) as fp16 pairs: what pair() takes for a group
__device__ __forceinline__ uint32_t scale_pair(float s) {
  return uint32_t(__half_as_ushort(__float2half(s))) | (uint32_t(__half_as_ushort(__float2half(s * 0.0625f))) << 16);
}
__device__ __forceinline__ uint32_t zero_pair(uint32_t z) { return (0x6400u + z) | ((0x6400u + 16 * z) << 16); }
// The A fragments of one step (4 k16 slices) for rows r0 and r0 + 8 from the step's packed weights
// (32 bytes a row at wrow + row * 32); sel picks byte t of a word (lane (g, t)).
__device__ __forceinline__ void decode_step(const uint8_t* wrow, int r0, uint32_t sel, uint32_t zo0, uint32_t zo1,
                                            uint32_t sa, uint32_t sb, uint32_t (&a)[4][4]) {
  const uint4 u0 = *reinterpret_cast<const uint4*>(wrow + r0 * 32);
  const uint4 u1 = *reinterpret_cast<const uint4*>(wrow + r0 * 32 + 16);
  const uint4 v0 = *reinterpret_cast<const uint4*>(wrow + (r0 + 8) * 32);
  const uint4 v1 = *reinterpret_cast<const uint4*>(wrow + (r0 + 8) * 32 + 16);
  const uint32_t w0[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
  const uint32_t w1[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    a[j][0] = pair(w0[2 * j], sel, zo0, sa);
    a[j][1] = pair(w1[2 * j], sel, zo1, sb);
    a[j][2] = pair(w0[2 * j + 1], sel, zo0, sa);
    a[j][3] = pair(w1[2 * j + 1], sel, zo1, sb);
  }
}

// The wgmma instructions of the three kernels, 64 or 128 float32 accumulators per thread (d[4 nt + e]:
// row g (+ 8 for e >= 2) of the warp's 16, column 8 nt + 2 t + (e & 1)); "RS": A from registers (the
// m16n8k16 A fragment layout per warp), "SS": A from a descriptor. The predicate operand (1)
// keeps the accumulators' values (scale-d).
#define QF_ACC64                                                                                                   \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, " \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define QF_ACC128                                                                                                \
  QF_ACC64                                                                                                       \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, "  \
  "%85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, "    \
  "%105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, " \
  "%123, %124, %125, %126, %127"
#define QF_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define QF_D16(i) QF_D4(i), QF_D4(i + 4), QF_D4(i + 8), QF_D4(i + 12)
#define QF_D64(i) QF_D16(i), QF_D16(i + 16), QF_D16(i + 32), QF_D16(i + 48)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QF_WGMMA(SHAPE, ACC, OPS, PRED, ...)                                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\nwgmma.mma_async.sync.aligned." SHAPE \
               ".f32.f16.f16 {" ACC "}, " OPS ";\n}\n"                                              \
               : __VA_ARGS__)
#else
#define QF_WGMMA(...) ((void)0)
#endif
__device__ __forceinline__ void wgmma_n(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {  // RS m64n128k16
  QF_WGMMA("m64n128k16", QF_ACC64, "{%64, %65, %66, %67}, %68, p, 1, 1, 0", "%69", QF_D64(0) : "r"(a[0]), "r"(a[1]),
           "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_n(float (&d)[128], const uint32_t (&a)[4], uint64_t desc) {  // RS m64n256k16
  QF_WGMMA("m64n256k16", QF_ACC128, "{%128, %129, %130, %131}, %132, p, 1, 1, 0", "%133", QF_D64(0),
           QF_D64(64) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t da, uint64_t db) {  // SS m64n128k16
  QF_WGMMA("m64n128k16", QF_ACC64, "%64, %65, p, 1, 1, 0, 0", "%66", QF_D64(0) : "l"(da), "l"(db), "r"(1));
}
#undef QF_WGMMA

// Dynamic shared memory from its first 1024-byte boundary (the 128-byte swizzle's atom: TMA and
// the wgmma descriptors need it); the kernels ask for 1024 bytes more.
__device__ __forceinline__ uint8_t* smem_1024() {
  extern __shared__ uint8_t smem_raw[];
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
}
// n mbarriers expecting `count` arrivals each.
__device__ __forceinline__ void init_bars(uint64_t* b, int n, int count) {
  for (int i = 0; i < n; ++i) mbar_init(b + i, count);
}
// This thread's warpgroup, through a shuffle so that ptxas sees it warp-uniform (else it
// serializes the wgmma of the branches that depend on it: C7518).
__device__ __forceinline__ int warpgroup() { return __shfl_sync(0xffffffffu, int(threadIdx.x) >> 7, 0); }

// Y [N, M] fp16 from a warp's accumulators d[4 nt + e]: row r0 (+ 8 for e >= 2) of the tile, column
// 8 nt + 2 t + (e & 1) (the wgmma D fragment layout).
template <int NT>
__device__ __forceinline__ void store_tile(const float (&d)[4 * NT], __half* Y, int M, int n0, int m0, int r0, int t) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = n0 + 8 * nt + 2 * t + (e & 1), m = m0 + r0 + (e >> 1) * 8;
      Y[size_t(n) * M + m] = __float2half(d[4 * nt + e]);
    }
}

constexpr int BM = 128, BK = 64;  // weight rows, k per step
constexpr int kWStage = BM * 32;  // 128 rows x 64 codes
constexpr int kSZStage = BM * 8;  // scale (4 bytes) and the aligned zero-point word (4 bytes) per row
template <int BN, int P>
constexpr int smem_bytes() {
  return P * (BN * 128 + kWStage + kSZStage) + 1024;
}

// BN activation rows per CTA (128 or 256), P stages; DECODE false: A = 1.0 (the pipeline without
// the decode: what the decode costs)
template <int BN, int P, bool DECODE>
__global__ void
__launch_bounds__(256, 1)
    prefill(const __half* __restrict__ X, const uint8_t* __restrict__ qw, const float* __restrict__ sc,
            const uint8_t* __restrict__ zr, __half* __restrict__ Y, int N, int M, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  uint8_t* sm = smem_1024();
  constexpr int kXStage = BN * 128, NT = BN / 8;
  uint8_t* xs = sm;                  // [P][BN rows x 128 B], swizzled
  uint8_t* ws = xs + P * kXStage;    // [P][128 rows x 32 B]
  uint8_t* szs = ws + P * kWStage;   // [P][128 x (scale, zero word)]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, steps = K / BK, G = K / 128;
  const int r0 = (warp >> 2) * 64 + (warp & 3) * 16 + g;  // this lane's rows r0 and r0 + 8 of the tile

  auto load = [&](int s) {
    if (s < steps) {
      const int slot = s % P, k0 = s * BK;
      uint8_t* xd = xs + slot * kXStage;
#pragma unroll
      for (int i = 0; i < BN * 8 / 256; ++i) {
        const int q = tid + 256 * i, row = q >> 3, c = q & 7;
        cp16(xd + row * 128 + ((c ^ (row & 7)) << 4), X + size_t(n0 + row) * K + k0 + c * 8);
      }
      cp16(ws + slot * kWStage + tid * 16, qw + size_t(m0 + (tid >> 1)) * (K / 2) + k0 / 2 + (tid & 1) * 16);
      const size_t gi = size_t(m0 + (tid & 127)) * G + (s >> 1);
      if (tid < 128) cp4(szs + slot * kSZStage + tid * 8, sc + gi);
      else cp4(szs + slot * kSZStage + (tid - 128) * 8 + 4, zr + (gi & ~size_t(3)));
    }
    cp_commit();
  };
  const uint32_t sel = 0x4040u | uint32_t(t) | (uint32_t(t) << 8);
  // A of step s: a[j][0..3] for k16 slice j
  auto decode = [&](int s, uint32_t (&a)[4][4]) {
    if constexpr (!DECODE) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[j][e] = 0x3C003C00u;
      return;
    }
    const int slot = s % P;
    const uint8_t* wrow = ws + slot * kWStage;
    const uint8_t* sz = szs + slot * kSZStage;
    const size_t gi0 = size_t(m0 + r0) * G + (s >> 1), gi1 = gi0 + size_t(8) * G;
    const float s0 = *reinterpret_cast<const float*>(sz + r0 * 8), s1 = *reinterpret_cast<const float*>(sz + (r0 + 8) * 8);
    const uint32_t z0 = sz[r0 * 8 + 4 + (gi0 & 3)], z1 = sz[(r0 + 8) * 8 + 4 + (gi1 & 3)];
    decode_step(wrow, r0, sel, zero_pair(z0), zero_pair(z1), scale_pair(s0), scale_pair(s1), a);
  };
  float d[4 * NT];
#pragma unroll
  for (int i = 0; i < 4 * NT; ++i) {
    d[i] = 0.f;
    wg::pin(d[i]);  // (else ptxas serializes the wgmma: C7514)
  }
  const uint32_t xs_addr = smem_u32(xs);
  auto multiply = [&](int s, const uint32_t (&a)[4][4]) {
    const uint64_t desc0 = wg::sw128_desc(xs_addr + (s % P) * kXStage);
    wg::fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_n(d, a[j], desc0 + uint64_t((32 * j) >> 4));
    wg::commit();
  };

  uint32_t a0[4][4], a1[4][4];
#pragma unroll
  for (int s = 0; s < P - 1; ++s) load(s);
  cp_wait<P - 2>();
  wg::proxy_fence();  // cp.async's writes (generic proxy) before the tensor cores' reads
  __syncthreads();
  decode(0, a0);
  // Step s: its batch is issued, then (wait<1>) step s - 1's batch is done, so its X slot and
  // A registers are free; the barrier makes step s + 1's copies visible and every warpgroup's
  // s - 1 batch done before the slot is refilled.
  auto step = [&](int s, uint32_t (&acur)[4][4], uint32_t (&anext)[4][4]) {
    multiply(s, acur);
    // The last step waits for everything: with wait<1> there and wait<0> after the loop, ptxas
    // put the epilogue's reads of the accumulators before the wait (SASS: F2FP of the results
    // with the last batch in flight), whatever the accumulators' pins or operands.
    if (s + 1 == steps) wg::wait<0>();
    else wg::wait<1>();
    cp_wait<P - 3>();
    wg::proxy_fence();
    __syncthreads();
    load(s + P - 1);
    if (s + 1 < steps) decode(s + 1, anext);
  };
  for (int s = 0; s < steps; s += 2) {
    step(s, a0, a1);
    step(s + 1, a1, a0);  // (steps is even: K is a multiple of 128)
  }
  wg::wait<0>();  // (already done by the last step)
#pragma unroll
  for (int i = 0; i < 4 * NT; ++i) wg::pin(d[i]);
  store_tile<NT>(d, Y, M, n0, m0, r0, t);
#endif
}

// ---- The warp-specialized variant: TMA loads on mbarriers, a producer warpgroup that decodes ----
// A CTA of three warpgroups and a warp: warp 12 issues each step's TMA copies (X tile [BN, 64]
// swizzled, packed weights [128, 32 bytes]) as soon as the stage is free; warpgroup 0 decodes
// (thread r: weight row r of the tile, its 64 values of the step into an fp16 A tile in shared
// memory, K-major with the 128-byte swizzle); warpgroups 1 and 2 take 64 weight rows each and only issue wgmma with
// both operands in shared memory. Stage st: full[st] (the copies' bytes), ready[st] (128 decoding
// threads), empty[st] (both consumer warpgroups done with it).
using qf::cuda::tma_load_2d;

// The copies of every step of a CTA (one thread): step k's X tile [rows n0.., 64 values] and packed
// weights [rows m0.., 32 bytes] into stage k % S on full[k % S], once both consumer warpgroups
// have released that stage's previous step on empty.
template <int S>
__device__ __forceinline__ void copy_steps(const CUtensorMap* tmX, const CUtensorMap* tmW, uint8_t* xs, int kX,
                                           uint8_t* wsm, int kW, uint64_t* full, uint64_t* empty, int steps, int n0,
                                           int m0) {
  for (int k = 0; k < steps; ++k) {
    const int st = k % S;
    if (k >= S) mbar_wait(&empty[st], ((k / S) - 1) & 1);
    mbar_expect(&full[st], kX + kW);
    tma_load_2d(xs + st * kX, tmX, k * 64, n0, &full[st]);
    tma_load_2d(wsm + st * kW, tmW, k * 32, m0, &full[st]);
  }
}

template <int BN, int S>
constexpr int ws_smem_bytes() {
  return S * (BN * 128 + 128 * 128 + 128 * 32) + 3 * S * 8 + 1024;
}

// D decoding warpgroups (1 or 2: a row per thread, or half a row); DECODE false: the decoders only
// wait and arrive (A is whatever the buffer holds: timing only)
template <int BN, int S, int D = 1, bool DECODE = true>
__global__ void __launch_bounds__(128 * (D + 2) + 32, 1)
    prefill_ws(const __grid_constant__ CUtensorMap tmX, const __grid_constant__ CUtensorMap tmW,
               const float* __restrict__ sc, const uint8_t* __restrict__ zr, __half* __restrict__ Y, int N, int M, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int NT = BN / 8, kX = BN * 128, kA = 128 * 128, kW = 128 * 32;
  uint8_t* xs = smem_1024();
  uint8_t* as = xs + S * kX;
  uint8_t* wsm = as + S * kA;
  uint64_t* full = reinterpret_cast<uint64_t*>(wsm + S * kW);
  uint64_t* ready = full + S;
  uint64_t* empty = ready + S;
  const int tid = threadIdx.x, wgi = warpgroup();
  const int m0 = blockIdx.x * 128, n0 = blockIdx.y * BN, steps = K / 64, G = K / 128;
  if (tid == 0) {
    init_bars(full, S, 1);
    init_bars(ready, S, 128 * D);
    init_bars(empty, S, 2);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (wgi == D + 2) {  // the copies, S steps ahead: one lane of the last warp
    if ((tid & 31) == 0) copy_steps<S>(&tmX, &tmW, xs, kX, wsm, kW, full, empty, steps, n0, m0);
  } else if (wgi < D) {  // the decode: thread r takes weight row r (D = 2: half h of it)
    const int r = tid % 128, h = D == 2 ? tid / 128 : 0;
    uint8_t* arow = as + (r >> 6) * (kA / 2) + (r & 63) * 128;
    const float* srow = sc + size_t(m0 + r) * G;
    const uint8_t* zrow = zr + size_t(m0 + r) * G;
    float s_next = __ldg(srow);  // (the group of step k + 1 loaded during step k)
    uint32_t z_next = __ldg(zrow);
    for (int k = 0; k < steps; ++k) {
      const int st = k % S;
      const float s0 = s_next;
      const uint32_t z = z_next;
      if (k + 1 < steps) {
        s_next = __ldg(srow + ((k + 1) >> 1));
        z_next = __ldg(zrow + ((k + 1) >> 1));
      }
      const uint32_t zo = zero_pair(z), s2 = scale_pair(s0);
      mbar_wait(&full[st], (k / S) & 1);
      if constexpr (DECODE) {
        constexpr int C = 8 / D;  // chunks (words) per thread
        uint32_t w[8];
#pragma unroll
        for (int q = 0; q < C / 4; ++q) {
          const uint4 u = *reinterpret_cast<const uint4*>(wsm + st * kW + r * 32 + h * 16 + q * 16);
          w[4 * q] = u.x, w[4 * q + 1] = u.y, w[4 * q + 2] = u.z, w[4 * q + 3] = u.w;
        }
        uint8_t* adst = arow + st * kA;
#pragma unroll
        for (int i = 0; i < C; ++i) {  // chunk c: values 8c .. 8c + 7, word c, its bytes in order
          const int c = h * C + i;
          uint4 o;
          o.x = pair(w[i], 0x4040u, zo, s2);
          o.y = pair(w[i], 0x4141u, zo, s2);
          o.z = pair(w[i], 0x4242u, zo, s2);
          o.w = pair(w[i], 0x4343u, zo, s2);
          *reinterpret_cast<uint4*>(adst + ((c ^ (r & 7)) << 4)) = o;
        }
        wg::proxy_fence();
      }
      mbar_arrive(&ready[st]);
    }
  } else {
    const int cw = wgi - D, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    float d[4 * NT];
#pragma unroll
    for (int i = 0; i < 4 * NT; ++i) {
      d[i] = 0.f;
      wg::pin(d[i]);
    }
    const uint32_t xa = smem_u32(xs), aa = smem_u32(as) + cw * (kA / 2);
    auto consume = [&](int k) {
      const int st = k % S;
      mbar_wait(&full[st], (k / S) & 1);
      mbar_wait(&ready[st], (k / S) & 1);
      const uint64_t da = wg::sw128_desc(aa + st * kA), db = wg::sw128_desc(xa + st * kX);
      wg::fence();
#pragma unroll
      for (int j = 0; j < 4; ++j) wgmma_ss(d, da + 2 * j, db + 2 * j);
      wg::commit();
      if (k + 1 == steps) wg::wait<0>();  // (see step() above: the last step waits for everything)
      else wg::wait<1>();
      if (k > 0 && (tid & 127) == 0) mbar_arrive(&empty[(k - 1) % S]);
    };
    for (int k = 0; k < steps; k += 2) {  // (two steps per trip, as in prefill: else ptxas serializes, C7514)
      consume(k);
      consume(k + 1);
    }
#pragma unroll
    for (int i = 0; i < 4 * NT; ++i) wg::pin(d[i]);
    const int r0 = cw * 64 + warp * 16 + g;
    store_tile<NT>(d, Y, M, n0, m0, r0, t);
  }
#endif
}

// The same TMA pipeline, but the consumer warpgroups decode their own weights into A registers
// (wgmma with A from registers, as in prefill above): no fp16 A tile in shared memory, whose
// writes and reads the decoding variant above pays for. A CTA of two warpgroups and a warp (the
// copies); stage st: full[st] (bytes), empty[st] (both warpgroups done with it).
template <int BN, int S, int C>
constexpr int rt_smem_bytes() {
  return S * (BN * 128 + 64 * C * 32) + 2 * S * 8 + 1024;
}
// C consumer warpgroups (64 weight rows each: BM = 64 C); C = 1 runs two CTAs per SM, for grids
// that 128-row tiles leave short of the SMs (4096 rows at 256 activation rows: 64 CTAs). BN = 256
// (128 accumulators per thread) needs more registers than 288 threads may have: the copies then
// get a whole warpgroup, which gives registers to the consumers with setmaxnreg.
template <int BN, int S, bool DECODE = true, int C = 2>
__global__ void __launch_bounds__(128 * C + (BN > 128 ? 128 : 32), C == 1 && BN == 128 ? 2 : 1)
    prefill_rt(const __grid_constant__ CUtensorMap tmX, const __grid_constant__ CUtensorMap tmW,
               const float* __restrict__ sc, const uint8_t* __restrict__ zr, __half* __restrict__ Y, int N, int M, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int NT = BN / 8, kX = BN * 128, kW = 64 * C * 32;
  uint8_t* xs = smem_1024();
  uint8_t* wsm = xs + S * kX;
  uint64_t* full = reinterpret_cast<uint64_t*>(wsm + S * kW);
  uint64_t* empty = full + S;
  const int tid = threadIdx.x, wgi = warpgroup();
  const int m0 = blockIdx.x * 64 * C, n0 = blockIdx.y * BN, steps = K / 64, G = K / 128;
  if (tid == 0) {
    init_bars(full, S, 1);
    init_bars(empty, S, C);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (wgi == C) {
    if constexpr (BN > 128 && C > 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if ((tid & 127) == 0) copy_steps<S>(&tmX, &tmW, xs, kX, wsm, kW, full, empty, steps, n0, m0);
    return;
  }
  if constexpr (BN > 128 && C > 1) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int r0 = wgi * 64 + warp * 16 + g;
  const uint32_t sel = 0x4040u | uint32_t(t) | (uint32_t(t) << 8);
  const float* s0p = sc + size_t(m0 + r0) * G;
  const float* s1p = s0p + size_t(8) * G;
  const uint8_t* z0p = zr + size_t(m0 + r0) * G;
  const uint8_t* z1p = z0p + size_t(8) * G;
  // The scales and zero points of group k / 2 + 1 are loaded while the steps of group k / 2 run
  // (their latency would otherwise sit between a step's wait and its decode).
  float s0n = __ldg(s0p), s1n = __ldg(s1p), s0 = 0.f, s1 = 0.f;
  uint32_t z0n = __ldg(z0p), z1n = __ldg(z1p), z0 = 0, z1 = 0;
  auto decode = [&](int k, uint32_t (&a)[4][4]) {
    const int st = k % S;
    if ((k & 1) == 0) {
      s0 = s0n, s1 = s1n, z0 = z0n, z1 = z1n;
      if ((k >> 1) + 1 < G) {
        const int gn = (k >> 1) + 1;
        s0n = __ldg(s0p + gn), s1n = __ldg(s1p + gn), z0n = __ldg(z0p + gn), z1n = __ldg(z1p + gn);
      }
    }
    mbar_wait(&full[st], (k / S) & 1);
    if constexpr (!DECODE) {  // (A = 1.0: the pipeline without the decode)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[j][e] = 0x3C003C00u;
      return;
    }
    decode_step(wsm + st * kW, r0, sel, zero_pair(z0), zero_pair(z1), scale_pair(s0), scale_pair(s1), a);
  };
  float d[4 * NT];
#pragma unroll
  for (int i = 0; i < 4 * NT; ++i) {
    d[i] = 0.f;
    wg::pin(d[i]);
  }
  const uint32_t xa = smem_u32(xs);
  // (Three sets of A registers with wait_group 2, so that two batches run while the warps decode,
  // measured 3-7% slower: benchmarks/README.md.)
  auto step = [&](int k, const uint32_t (&acur)[4][4], uint32_t (&anext)[4][4]) {
    const uint64_t db = wg::sw128_desc(xa + (k % S) * kX);
    wg::fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_n(d, acur[j], db + 2 * j);
    wg::commit();
    if (k + 1 == steps) wg::wait<0>();  // (see step() in prefill: the last step waits for everything)
    else wg::wait<1>();
    if (k > 0 && (tid & 127) == 0) mbar_arrive(&empty[(k - 1) % S]);
    if (k + 1 < steps) decode(k + 1, anext);
  };
  uint32_t a0[4][4], a1[4][4];
  decode(0, a0);
  for (int k = 0; k < steps; k += 2) {  // (steps is even)
    step(k, a0, a1);
    step(k + 1, a1, a0);
  }
#pragma unroll
  for (int i = 0; i < 4 * NT; ++i) wg::pin(d[i]);
  store_tile<NT>(d, Y, M, n0, m0, r0, t);
#endif
}

// A 2-D tensor map (the library's encoder; exits if the driver refuses it).
static CUtensorMap tensor_map(const void* base, CUtensorMapDataType type, int elem_bytes, uint64_t cols, uint64_t rows,
                              uint32_t box_cols, uint32_t box_rows, CUtensorMapSwizzle swizzle) {
  CUtensorMap tm;
  if (!qf::cuda::tensor_map_2d(&tm, base, type, elem_bytes, cols, rows, box_cols, box_rows, swizzle)) {
    std::printf("cuTensorMapEncodeTiled failed\n");
    std::exit(1);
  }
  return tm;
}

using Set = Int4Set;

// Checks one kernel's output at 3000 sampled points against float64 (decode: the int4 product;
// else A = 1, the sums of X) and times it cold (weights rotated, GPU spin before, median of 15).
template <class Launch>
void check_and_time(const char* name, bool decode, int M, int K, int N, const std::vector<Set>& sets, __half* y,
                    const Int4Host& h, Launch launch) {
  const bool DECODE = decode;
  const std::vector<uint8_t>&hq = h.q, &hz = h.z;
  const std::vector<float>& hs = h.s;
  const std::vector<__half>& hx = h.x;
  CK(cudaMemset(y, 0, size_t(N) * M * 2));
  launch(sets[0]);
  CK(cudaDeviceSynchronize());
  std::vector<__half> got(size_t(N) * M);
  CK(cudaMemcpy(got.data(), y, got.size() * 2, cudaMemcpyDeviceToHost));
  const int G = K / 128;
  double err = 0, mx = 0;
  uint64_t r = 12345;
  for (int i = 0; i < 3000; ++i) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    const int n = int((r >> 33) % N), m = int((r >> 13) % M);
    double acc = 0;
    for (int k = 0; k < K; ++k) {
      const int qv = (hq[size_t(m) * K / 2 + k / 2] >> (4 * (k & 1))) & 15;
      const size_t gi = size_t(m) * G + k / 128;
      acc += double(__half2float(hx[size_t(n) * K + k])) * (DECODE ? hs[gi] * (qv - hz[gi]) : 1.0);  // (A = 1: the sum of x)
    }
    err = std::max(err, std::fabs(double(__half2float(got[size_t(n) * M + m])) - acc));
    mx = std::max(mx, std::fabs(acc));
  }
  const double us = median_cold_us(15, [](int) {}, [&](int i) { launch(sets[i % sets.size()]); });
  std::printf("%-22s %5dx%-5d N=%5d  %8.1f us  %6.1f TFLOP/s  max|err|/max|y| %.2e\n", name, M, K, N, us,
              2.0 * M * K * N / us * 1e-6, err / mx);
}

template <int BN, int P, bool DECODE = true>
void run(int M, int K, int N, const std::vector<Set>& sets, const __half* x, __half* y, const Int4Host& h) {
  if (N % BN) return;
  const int smem = smem_bytes<BN, P>();
  CK(cudaFuncSetAttribute(prefill<BN, P, DECODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  char name[64];
  std::snprintf(name, sizeof name, "BN=%d P=%d %s", BN, P, DECODE ? "decode" : "no-dec");
  check_and_time(name, DECODE, M, K, N, sets, y, h, [&](const Set& st) {
    prefill<BN, P, DECODE><<<dim3(M / BM, N / BN), 256, smem>>>(x, st.q, st.s, st.z, y, N, M, K);
  });
}

template <int BN, int S, int D = 1, bool DECODE = true>
void run_ws(int M, int K, int N, const std::vector<Set>& sets, const __half* x, __half* y, const Int4Host& h) {
  if (N % BN) return;
  const int smem = ws_smem_bytes<BN, S>();
  CK(cudaFuncSetAttribute(prefill_ws<BN, S, D, DECODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const CUtensorMap tx = tensor_map(x, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, K, N, 64, BN, CU_TENSOR_MAP_SWIZZLE_128B);
  std::vector<CUtensorMap> tw;
  for (const Set& st : sets)
    tw.push_back(tensor_map(st.q, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, K / 2, M, 32, 128, CU_TENSOR_MAP_SWIZZLE_NONE));
  char name[64];
  std::snprintf(name, sizeof name, "ws BN=%d S=%d D=%d%s", BN, S, D, DECODE ? "" : " no-dec");
  check_and_time(name, DECODE, M, K, N, sets, y, h, [&](const Set& st) {
    prefill_ws<BN, S, D, DECODE><<<dim3(M / 128, N / BN), 128 * (D + 2) + 32, smem>>>(tx, tw[&st - sets.data()], st.s, st.z, y, N, M, K);
  });
}

template <int BN, int S, bool DECODE = true, int C = 2>
void run_rt(int M, int K, int N, const std::vector<Set>& sets, const __half* x, __half* y, const Int4Host& h) {
  constexpr int BM = 64 * C;
  if (N % BN || M % BM) return;
  const int smem = rt_smem_bytes<BN, S, C>();
  CK(cudaFuncSetAttribute(prefill_rt<BN, S, DECODE, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const CUtensorMap tx = tensor_map(x, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, K, N, 64, BN, CU_TENSOR_MAP_SWIZZLE_128B);
  std::vector<CUtensorMap> tw;
  for (const Set& st : sets)
    tw.push_back(tensor_map(st.q, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, K / 2, M, 32, BM, CU_TENSOR_MAP_SWIZZLE_NONE));
  char name[64];
  std::snprintf(name, sizeof name, "rt BN=%d S=%d BM=%d%s", BN, S, BM, DECODE ? "" : " no-dec");
  check_and_time(name, DECODE, M, K, N, sets, y, h, [&](const Set& st) {
    prefill_rt<BN, S, DECODE, C>
        <<<dim3(M / BM, N / BN), 128 * C + (BN > 128 ? 128 : 32), smem>>>(tx, tw[&st - sets.data()], st.s, st.z, y, N, M, K);
  });
}

int main() {
  const int shapes[2][2] = {{4096, 14336}, {14336, 4096}};
  const int Ns[] = {256, 512, 1024, 2048};
  for (auto& sh : shapes) {
    const int M = sh[0], K = sh[1], NMAX = 2048;
    const Int4Host h = random_int4(M, K, NMAX);
    std::vector<Set> sets = device_sets(h);
    __half *x, *y;
    CK(cudaMalloc(&x, h.x.size() * 2));
    CK(cudaMalloc(&y, size_t(NMAX) * M * 2));
    CK(cudaMemcpy(x, h.x.data(), h.x.size() * 2, cudaMemcpyHostToDevice));
    for (int N : Ns) {
      run_rt<128, 6>(M, K, N, sets, x, y, h);
      run_rt<128, 6, false>(M, K, N, sets, x, y, h);
      run_rt<128, 4, true, 1>(M, K, N, sets, x, y, h);
      run_rt<256, 4>(M, K, N, sets, x, y, h);
      run_rt<256, 4, false>(M, K, N, sets, x, y, h);
      run_rt<256, 3, true, 1>(M, K, N, sets, x, y, h);
      run_ws<128, 4>(M, K, N, sets, x, y, h);
      run_ws<128, 4, 1, false>(M, K, N, sets, x, y, h);
      run<256, 4>(M, K, N, sets, x, y, h);
      run<256, 4, false>(M, K, N, sets, x, y, h);
    }
    free_sets(sets);
    CK(cudaFree(x));
    CK(cudaFree(y));
  }
  return 0;
}
