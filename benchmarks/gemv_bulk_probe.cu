// A one-row int4 GEMV whose weights reach shared memory by bulk copies (TMA's 1-D form), a
// standalone probe for issue 19's N = 1 target: does a kernel that keeps its weight bytes in
// flight without registers, and decodes with fewer instructions per weight, get near the read
// floor that benchmarks/read_patterns.cu measured? Not the library's kernel: int4 with
// group_size 128, zero points and float32 scales (qformats.int4's layout), fp16 activations,
// K / 128 a multiple of G; checked against a float64 reference on the host.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -diag-suppress 128 benchmarks/gemv_bulk_probe.cu -o /tmp/gemv_bulk_probe
//   /tmp/gemv_bulk_probe ["W4 G4 P2"]   (4096x14336 and 14336x4096, cold and back-to-back launches;
//                                       a name: that variant only, e.g. for ncu)
// Results: benchmarks/README.md, "A one-row GEMV fed by bulk copies".
//
// The kernel: a CTA owns 16 weight rows; its W warps split K into contiguous runs of whole
// groups; each warp streams its run through a private ring of P stages (G groups of its 16 rows
// per stage), lanes 0-15 issuing one cp.async.bulk per row and stage onto the stage's mbarrier,
// P stages ahead. The CTA's scales and zero points come the same way, once. Lane (g, t) takes rows
// g and g + 8 and unit t (32 values) of each group, so a quad covers one group and the mma's
// 16 k slots hold values of one group: the A fragments are the exact integers q - z (one LOP3
// and one HSUB2 or HFMA2 per pair: the nibble in the mantissa of 1024, then 1024 + z or
// (64 + z) after a 1/16 scaling subtracted), each group's products are summed by the mma into
// fresh float32 accumulators and scaled once per group (FFMA). X goes into shared memory once
// per CTA, in the order of the B fragments.
//
// Variants (template arguments): W warps per CTA, G groups per stage, P stages per ring, rows
// padded by 64 bytes in shared memory (rows g and g + 1, read by one quarter warp, in other banks)
// or not; KS CTAs per 16-row tile, each taking 1/KS of K and adding its sums into a float32 Y
// with atomics (more warps per tile; each CTA still copies its rows' scales and zero points whole);
// and the mode below.
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

enum Mode {
  kGroups = 0,       // each group's 8 mma in one chain, group after group; a slot refilled after its stage
  kStreamOnly = 1,   // no decode: one word per lane and stage (what the copies alone cost)
  kInterleaved = 3,  // the stage's G groups as G chains, interleaved
  kEarly = 4,        // kInterleaved, and the slot refilled as soon as its words are in registers
};

// bytes (a multiple of 16, 16-byte aligned at both ends) from global to shared memory, counted
// on mbarrier b
__device__ __forceinline__ void bulk(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(b))
      : "memory");
}
__device__ __forceinline__ uint32_t pack(__half lo, __half hi) {
  return uint32_t(__half_as_ushort(lo)) | (uint32_t(__half_as_ushort(hi)) << 16);
}

// A word's 8 codes (element 2b in the low nibble of byte b) as the pairs P0 = (e0, e4),
// P1 = (e1, e5), P2 = (e2, e6), P3 = (e3, e7), each q - z exact in fp16.
__device__ __forceinline__ void decode(uint32_t w, uint32_t zlo, uint32_t zhi, uint32_t (&p)[4]) {
  const uint32_t w8 = w >> 8;
  p[0] = hsub2(lop3_or(w, 0x000F000Fu), zlo);               // 1024 + q - (1024 + z)
  p[1] = hfma2(lop3_or(w, 0x00F000F0u), 0x2C002C00u, zhi);  // (1024 + 16 q) / 16 - (64 + z)
  p[2] = hsub2(lop3_or(w8, 0x000F000Fu), zlo);
  p[3] = hfma2(lop3_or(w8, 0x00F000F0u), 0x2C002C00u, zhi);
}

template <int W, int G, int P, bool PAD = true, int KS = 1>
struct Cfg {
  static constexpr int kRowBytes = G * 64 + (PAD ? 64 : 0);  // + 64: rows g and g + 1 of a quarter warp in other banks
  static constexpr int kStage = 16 * kRowBytes;
  static size_t smem(int K) {
    const int KG = K / 128;
    const int xs_groups = (KG / G + KS - 1) / KS * G;  // a CTA's groups (K split KS ways)
    return size_t(W) * P * kStage + size_t(xs_groups) * 256 + 16 * KG * 4 + 16 * KG + 16 + 8 * (1 + W * P) + 128;
  }
};

template <int W, int G, int P, int MODE, bool PAD, int KS>
__global__ void
__launch_bounds__(W * 32) gemv(const uint8_t* __restrict__ q, const float* __restrict__ sc,
                                               const uint8_t* __restrict__ zr, const __half* __restrict__ x,
                                               __half* __restrict__ y, float* __restrict__ y32, int M, int K) {
  using C = Cfg<W, G, P, PAD, KS>;
  extern __shared__ __align__(128) uint8_t sm[];
  // KS > 1: CTA (tile, blockIdx.y) takes stages cs0.. of the row; the CTAs' sums are added
  // into y32 with atomics (a probe of more warps per row tile: not deterministic)
  const int KG = K / 128, S = KG / G, cs0 = S * int(blockIdx.y) / KS, Sc = S * int(blockIdx.y + 1) / KS - cs0;
  const int sw0 = cs0 + Sc * int(threadIdx.x >> 5) / W, stages = cs0 + Sc * int((threadIdx.x >> 5) + 1) / W - sw0;
  const int xg0 = cs0 * G;  // the CTA's first group: xs holds groups xg0 .. xg0 + Sc * G
  uint8_t* ring = sm;
  uint4* xs = reinterpret_cast<uint4*>(ring + size_t(W) * P * C::kStage);
  float* ssc = reinterpret_cast<float*>(xs + (S + KS - 1) / KS * G * 16);  // (Cfg::smem's xs_groups)
  uint8_t* szr = reinterpret_cast<uint8_t*>(ssc + 16 * KG);
  uint64_t* bars = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(szr + 16 * KG) + 15) & ~uintptr_t(15));
  __shared__ float red[W][16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t m0 = int64_t(blockIdx.x) * 16;
  uint64_t* meta = bars;
  uint64_t* full = bars + 1 + warp * P;
  uint8_t* myring = ring + size_t(warp) * P * C::kStage;
  const int gw0 = sw0 * G;
  if (threadIdx.x == 0) {
    mbar_init(meta, 1);
    for (int i = 0; i < W * P; ++i) mbar_init(bars + 1 + i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // stage s of this warp's run into slot s % P: lane r < 16 copies row r (one instruction for the
  // 16 copies), after lane 0 has announced the stage's bytes
  const uint8_t* const qrow = q + (m0 + (lane & 15)) * (K / 2) + int64_t(gw0) * 64;
  auto issue = [&](int s) {
    uint64_t* b = full + s % P;
    if (lane == 0) mbar_expect(b, 16 * G * 64);
    __syncwarp();
    if (lane < 16) bulk(myring + (s % P) * C::kStage + lane * C::kRowBytes, qrow + int64_t(s) * G * 64, G * 64, b);
  };
  if (warp == 0) {
    if (lane == 0) mbar_expect(meta, 16 * KG * 5);
    __syncwarp();
    if (lane < 16) {
      bulk(ssc + lane * KG, sc + (m0 + lane) * KG, KG * 4, meta);
      bulk(szr + lane * KG, zr + (m0 + lane) * KG, KG, meta);
    }
  }
  for (int s = 0; s < P && s < stages; ++s) issue(s);
  // X in B-fragment order: slot ((u / 4) * 4 + j) * 4 + u % 4 holds unit u's word j pairs
  // {x(P0), x(P2), x(P1), x(P3)} (mma h = 0: .x .y; h = 1: .z .w)
  for (int u = xg0 * 4 + threadIdx.x; u < (xg0 + Sc * G) * 4; u += W * 32) {
    const uint4* xp = reinterpret_cast<const uint4*>(x + u * 32);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 v = __ldg(xp + j);
      const __half* e = reinterpret_cast<const __half*>(&v);
      xs[(((u >> 2) - xg0) * 4 + j) * 4 + (u & 3)] =
          make_uint4(pack(e[0], e[4]), pack(e[2], e[6]), pack(e[1], e[5]), pack(e[3], e[7]));
    }
  }
  __syncthreads();
  mbar_wait(meta, 0);
  float acc_a = 0.f, acc_b = 0.f;
  uint32_t sink = 0;
  for (int s = 0; s < stages; ++s) {
    mbar_wait(full + s % P, (s / P) & 1);
    const uint8_t* st = myring + (s % P) * C::kStage;
    if constexpr (MODE == kStreamOnly) {
      sink ^= *reinterpret_cast<const uint32_t*>(st + g * C::kRowBytes + t * 16);
      __syncwarp();
      if (s + P < stages) issue(s + P);
      continue;
    }
    uint4 ua[G], ub[G];
#pragma unroll
    for (int i = 0; i < G; ++i) {
      ua[i] = *reinterpret_cast<const uint4*>(st + g * C::kRowBytes + i * 64 + t * 16);
      ub[i] = *reinterpret_cast<const uint4*>(st + (g + 8) * C::kRowBytes + i * 64 + t * 16);
    }
    if constexpr (MODE == kEarly) {
      // Early release: the slot is refilled as soon as its words are in registers (the branch
      // reads every loaded word, so the copy cannot overtake a load), and the stage is
      // multiplied while P stages are in flight instead of P - 1.
      uint32_t all = 0;
#pragma unroll
      for (int i = 0; i < G; ++i) all |= ua[i].x ^ ua[i].y ^ ua[i].z ^ ua[i].w ^ ub[i].x ^ ub[i].y ^ ub[i].z ^ ub[i].w;
      if (all == 0x9E3779B9u) red[warp][0] = 0.f;  // (a branch on every word: the warp waits for them)
      __syncwarp();
      if (s + P < stages) issue(s + P);
    }
    if constexpr (MODE == kInterleaved || MODE == kEarly) {
      float d[G][4], sa[G], sb[G];
      uint32_t zloa[G], zlob[G], zhia[G], zhib[G];
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const int ga = gw0 + s * G + i;
        const uint32_t za = szr[g * KG + ga], zb = szr[(g + 8) * KG + ga];
        sa[i] = ssc[g * KG + ga];
        sb[i] = ssc[(g + 8) * KG + ga];
        zloa[i] = (0x6400u + za) * 0x10001u;
        zlob[i] = (0x6400u + zb) * 0x10001u;
        zhia[i] = (0xD400u + 16 * za) * 0x10001u;
        zhib[i] = (0xD400u + 16 * zb) * 0x10001u;
        d[i][0] = d[i][1] = d[i][2] = d[i][3] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < G; ++i) {
          const int ga = gw0 + s * G + i;
          const uint4 xq = xs[((ga - xg0) * 4 + j) * 4 + t];
          uint32_t pa[4], pb[4];
          decode(word(ua[i], j), zloa[i], zhia[i], pa);
          decode(word(ub[i], j), zlob[i], zhib[i], pb);
          const uint32_t a0[4] = {pa[0], pb[0], pa[2], pb[2]};
          const uint32_t a1[4] = {pa[1], pb[1], pa[3], pb[3]};
          mma(d[i], a0, xq.x, xq.y);
          mma(d[i], a1, xq.z, xq.w);
        }
#pragma unroll
      for (int i = 0; i < G; ++i) {
        acc_a = fmaf(sa[i], d[i][0], acc_a);
        acc_b = fmaf(sb[i], d[i][2], acc_b);
      }
    }
#pragma unroll
    for (int i = 0; i < G && MODE == kGroups; ++i) {
      const int ga = gw0 + s * G + i;
      const uint32_t za = szr[g * KG + ga], zb = szr[(g + 8) * KG + ga];
      const float sa = ssc[g * KG + ga], sb = ssc[(g + 8) * KG + ga];
      const uint32_t zloa = (0x6400u + za) * 0x10001u, zlob = (0x6400u + zb) * 0x10001u;
      const uint32_t zhia = (0xD400u + 16 * za) * 0x10001u, zhib = (0xD400u + 16 * zb) * 0x10001u;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 xq = xs[((ga - xg0) * 4 + j) * 4 + t];
        uint32_t pa[4], pb[4];
        decode(word(ua[i], j), zloa, zhia, pa);
        decode(word(ub[i], j), zlob, zhib, pb);
        const uint32_t a0[4] = {pa[0], pb[0], pa[2], pb[2]};
        const uint32_t a1[4] = {pa[1], pb[1], pa[3], pb[3]};
        mma(d, a0, xq.x, xq.y);
        mma(d, a1, xq.z, xq.w);
      }
      acc_a = fmaf(sa, d[0], acc_a);  // every column of B is x: d[0] = row g, d[2] = row g + 8
      acc_b = fmaf(sb, d[2], acc_b);
    }
    if constexpr (MODE != kEarly) {
      __syncwarp();  // (the stage's values are in registers and used: the slot can be refilled)
      if (s + P < stages) issue(s + P);
    }
  }
  if (MODE == kStreamOnly && sink == 0x12345679u) acc_a += 1.f;  // (keeps the reads)
  if (t == 0) {
    red[warp][g] = acc_a;
    red[warp][g + 8] = acc_b;
  }
  __syncthreads();
  if (threadIdx.x < 16 && m0 + threadIdx.x < M) {
    float v = 0.f;
    for (int w = 0; w < W; ++w) v += red[w][threadIdx.x];
    if (KS > 1) atomicAdd(y32 + m0 + threadIdx.x, v);
    else y[m0 + threadIdx.x] = __float2half(v);
  }
}

using Set = Int4Set;

static const char* only = nullptr;
template <int W, int G, int P, int MODE = kGroups, bool PAD = true, int KS = 1>
void run(const char* name, int M, int K, const std::vector<Set>& sets, const __half* x, __half* y, float* y32,
         const std::vector<double>& ref) {
  using C = Cfg<W, G, P, PAD, KS>;
  const int KG = K / 128;
  if (KG % G || KG / G < W * KS || (only && std::strcmp(name, only) != 0)) return;
  const size_t smem = C::smem(K);
  CK(cudaFuncSetAttribute(gemv<W, G, P, MODE, PAD, KS>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv<W, G, P, MODE, PAD, KS>, W * 32, smem));
  auto launch = [&](const Set& st) {
    gemv<W, G, P, MODE, PAD, KS><<<dim3(M / 16, KS), W * 32, smem>>>(st.q, st.s, st.z, x, y, y32, M, K);
  };
  CK(cudaMemset(y32, 0, M * 4));
  launch(sets[0]);
  CK(cudaDeviceSynchronize());
  std::vector<__half> h(M);
  std::vector<float> h32(M);
  CK(cudaMemcpy(h.data(), y, M * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h32.data(), y32, M * 4, cudaMemcpyDeviceToHost));
  double err = 0, mx = 0;
  for (int m = 0; m < M; ++m) {
    err = std::max(err, std::fabs((KS > 1 ? double(h32[m]) : double(__half2float(h[m]))) - ref[m]));
    mx = std::max(mx, std::fabs(ref[m]));
  }
  const double cold = median_cold_us(
      15, [&](int) {
        if (KS > 1) CK(cudaMemsetAsync(y32, 0, M * 4));
      },
      [&](int i) { launch(sets[i % sets.size()]); });
  const double resident = median_resident_us([&] { launch(sets[0]); });  // one weight, back to back
  std::printf("%-22s %5dx%-5d  CTAs/SM %d  smem %6zu  cold %6.1f us  resident %6.1f us  max|err|/max|y| %.2e\n", name,
              M, K, per_sm, smem, cold, resident, err / mx);
}

int main(int argc, char** argv) {
  if (argc > 1) only = argv[1];
  const int shapes[2][2] = {{4096, 14336}, {14336, 4096}};
  for (auto& sh : shapes) {
    const int M = sh[0], K = sh[1], KG = K / 128;
    const Int4Host h = random_int4(M, K, 1);
    const std::vector<uint8_t>&hq = h.q, &hz = h.z;
    const std::vector<float>& hs = h.s;
    const std::vector<__half>& hx = h.x;
    std::vector<double> ref(M, 0.0);
    for (int m = 0; m < M; ++m) {
      double acc = 0;
      for (int k = 0; k < K; ++k) {
        const int qv = (hq[size_t(m) * K / 2 + k / 2] >> (4 * (k & 1))) & 15, gi = m * KG + k / 128;
        acc += double(__half2float(hx[k])) * hs[gi] * (qv - hz[gi]);
      }
      ref[m] = acc;
    }
    std::vector<Set> sets = device_sets(h);
    const size_t bytes = hq.size() + hz.size() * 5;
    const int nsets = int(sets.size());
    __half *x, *y;
    float* y32;
    CK(cudaMalloc(&y32, M * 4));
    CK(cudaMalloc(&x, K * 2));
    CK(cudaMalloc(&y, M * 2));
    CK(cudaMemcpy(x, hx.data(), K * 2, cudaMemcpyHostToDevice));
    std::printf("%d x %d: %.1f MB of weights, %d rotated copies\n", M, K, bytes / 1e6, nsets);
    run<4, 4, 2, kStreamOnly>("W4 G4 P2 stream-only", M, K, sets, x, y, y32, ref);
    run<4, 4, 3, kStreamOnly>("W4 G4 P3 stream-only", M, K, sets, x, y, y32, ref);
    run<2, 8, 2, kStreamOnly>("W2 G8 P2 stream-only", M, K, sets, x, y, y32, ref);
    run<8, 4, 2, kStreamOnly, false>("W8 G4 P2 stream-only nopad", M, K, sets, x, y, y32, ref);
    run<4, 4, 2>("W4 G4 P2", M, K, sets, x, y, y32, ref);
    run<4, 4, 3>("W4 G4 P3", M, K, sets, x, y, y32, ref);
    run<4, 2, 4>("W4 G2 P4", M, K, sets, x, y, y32, ref);
    run<8, 2, 2>("W8 G2 P2", M, K, sets, x, y, y32, ref);
    run<2, 8, 2>("W2 G8 P2", M, K, sets, x, y, y32, ref);
    run<4, 4, 2, kInterleaved>("W4 G4 P2 ilv", M, K, sets, x, y, y32, ref);
    run<4, 4, 2, kInterleaved, false>("W4 G4 P2 ilv nopad", M, K, sets, x, y, y32, ref);
    run<8, 4, 2, kInterleaved, false>("W8 G4 P2 ilv nopad", M, K, sets, x, y, y32, ref);
    run<4, 8, 2, kInterleaved, false>("W4 G8 P2 ilv nopad", M, K, sets, x, y, y32, ref);
    run<4, 4, 2, kEarly>("W4 G4 P2 early", M, K, sets, x, y, y32, ref);
    run<4, 4, 2, kInterleaved, true, 2>("W4 G4 P2 ilv, K over 2 CTAs", M, K, sets, x, y, y32, ref);
    run<4, 4, 2, kInterleaved, true, 4>("W4 G4 P2 ilv, K over 4 CTAs", M, K, sets, x, y, y32, ref);
    run<2, 4, 2, kInterleaved, true, 4>("W2 G4 P2 ilv, K over 4 CTAs", M, K, sets, x, y, y32, ref);
    run<4, 2, 2, kInterleaved, true, 4>("W4 G2 P2 ilv, K over 4 CTAs", M, K, sets, x, y, y32, ref);
    run<4, 4, 2, kStreamOnly, true, 4>("W4 G4 P2 stream-only, K over 4 CTAs", M, K, sets, x, y, y32, ref);
    run<2, 8, 2, kEarly>("W2 G8 P2 early", M, K, sets, x, y, y32, ref);
    free_sets(sets);
    cudaFree(x);
    cudaFree(y);
    cudaFree(y32);
  }
  return 0;
}
