// Weight-only GEMM from 9 activation rows on sm_90a: the wide kernel's split of the work
// (weight_only_wide_cuda.cuh: a CTA of 8 warps owns 128 WR weight rows, up to 64 activation rows,
// or 128 with one row group per warp (grid.y covers more), and one K slice; the slices of a column of CTAs form a
// cluster and sum through distributed shared memory) with Hopper's asynchronous warpgroup MMA (wgmma_cuda.cuh) instead
// of mma.sync: each warp decodes its rows into A fragments exactly as the wide kernel does (Fmt::pairs), and the two
// warpgroups' wgmma read the activations (B) from a shared-memory table written in the A fragments' k order (see the
// table below), so a warpgroup issues one instruction per 64 x NR x 16 block and decodes the next unit quarter while
// the tensor cores work.
//
// The table holds one step (8 units, 256 values of K) of the CTA's activation rows and is double
// buffered: while the warps multiply step k from one buffer, the CTA's copy of step k + 1's rows
// (cp.async into a staging buffer, issued one step ahead) is permuted into the other. So the
// shared memory does not grow with K (the wide kernel keeps its whole slice, which for K = 14336
// at 64 rows needs 8 slices of 229 KB: clusters of 8 CTAs of which the H200 runs only 15 at a
// time, so 16 of them took two waves; benchmarks/README.md), and the launcher can choose the
// slices and rows per CTA for the grid to fill the GPU in whole waves.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "gemm/weight_only_wide_cuda.cuh"
#include "gemm/wgmma_cuda.cuh"

namespace qf::gemm::cuda_wo {

// The table of one step: a K-major tile with the 128-byte swizzle (wgmma_cuda.cuh) of NR rows and
// four 64-element row blocks, in the k order of the A fragments. In k16 slice q = 8i + 2j + h (unit
// quarter (i, j), pair parity h), k positions 2t, 2t + 1 hold pair 4j + h (Fmt::xpair's numbering)
// of lane t's unit 2t + i and positions 2t + 8, + 9 its pair 4j + h + 2, which is mma.sync's k order
// in the wide kernel (a0 = pairs 4j, 4j + 2; a1 = 4j + 1, 4j + 3). Slice q is k16 slice q % 4 of row
// block q / 4: pair p of unit 2t + i of row n lies at byte (q / 4) NR 128 + sw128_offset(n, 16 (q % 4)
// + 8 ((p / 2) % 2) + 2t).
// Bytes of one step's table (and of its staging copy) for NR activation rows: 256 16-bit values per row.
__host__ __device__ constexpr int wg_step_bytes(int nr) { return nr * kWideStepUnits * 32 * 2; }

// CTAs per SM the kernel's registers are capped for: two (16 warps) with one row group and up to 64
// activation rows, whose registers fit in 128 per thread; else one.
constexpr int wgmma_min_ctas(int nt, int wr) { return wr == 1 && nt <= 8 ? 2 : 1; }

template <class Fmt, class H, int NT, int WR, bool PAIR>
__global__ void
__launch_bounds__(kWideWarps * 32, wgmma_min_ctas(NT, WR))
    weight_only_wgmma_kernel(const Fmt f, const H* __restrict__ X, int64_t N, int64_t K, int64_t M,
                             H* __restrict__ Y, const H* __restrict__ bias, int slice_steps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Ops = PlainPairOps<H>;  // one set of accumulators
  constexpr int NR = NT * 8, R = kMmaRows * WR * kWideWarps;  // activation rows, weight rows per CTA
  constexpr int kStep = wg_step_bytes(NR);
  static_assert(Fmt::kUnit == 32, "units of 32 values");
  static_assert(NR * R * 4 <= 3 * kStep, "the partial sums fit over the tables");
  // Dynamic shared memory (the launcher's wgmma_smem_bytes): two step tables, 1024-byte aligned
  // for the swizzle, then the staging copy; at the end the partial sums over them.
  extern __shared__ uint4 dyn[];
  unsigned char* const tab0 = reinterpret_cast<unsigned char*>(dyn) +
                              ((1024u - (static_cast<uint32_t>(__cvta_generic_to_shared(dyn)) & 1023u)) & 1023u);
  unsigned char* const stg = tab0 + 2 * kStep;
  __shared__ uint32_t lut[Fmt::kLut ? 256 : 1][32];  // filled once the first loads are in flight

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t mb = int64_t(blockIdx.x) * R, m0 = mb + 16 * WR * warp;
  const int64_t n0 = int64_t(blockIdx.y) * NR;
  using Rows = WideRows<Fmt, WR, PAIR>;
  using Stage = typename Rows::Stage;
  Rows rows(f, m0, M, K, slice_steps);
  const int steps = rows.steps;

  // Step k's activation rows into the staging buffer: 16-byte chunk c (unit c / 4) of row n at
  // chunk c ^ (n mod 8) of its 512-byte line, so that the permute's reads (8 rows' same chunk per
  // phase) hit 8 distinct bank quads. Thread e copies chunk c = e mod 32 of rows e / 32 + 8 s
  // (s < NR / 8): its source pointer and destination are set once. Rows past N and units past K:
  // zeros.
  constexpr int kCopies = NR / 8;  // per thread and step (256 threads, NR x 32 chunks)
  const int cc = threadIdx.x & 31, cn = threadIdx.x >> 5;
  const H* const xsrc = X + (n0 + cn) * K + rows.u0 * 32 + cc * 8;  // (+ 8 s rows, + 256 k values)
  unsigned char* const cdst = stg + cn * 512 + ((cc ^ (cn & 7)) << 4);  // (+ 8 s rows: 4 KB)
  auto stage_x = [&](int k) {
    const bool u_ok = rows.u0 + int64_t(k) * kWideStepUnits + (cc >> 2) < rows.units;
#pragma unroll
    for (int s = 0; s < kCopies; ++s) {
      const bool ok = u_ok && n0 + cn + 8 * s < N;
      cuda::cp_async<16>(cdst + s * 4096, ok ? xsrc + int64_t(8 * s) * K + k * 256 : X, ok);
    }
    cuda::cp_async_commit();
  };
  // The staged step into table `tab` in the A fragments' k order. Thread (n, t) (NR x 4 of them)
  // takes units 2t and 2t + 1 of row n; a warp holds rows n mod 8 = 0..7 of lanes t = 0..3, whose
  // pairs share a 16-byte column of the table, so each 4-byte store hits 32 distinct banks. The
  // reads and stores use 8 offsets (chunk c ^ (n mod 8)) computed once, the rest are constants.
  const int pn = (threadIdx.x & 7) | ((threadIdx.x >> 5) << 3), pt = (threadIdx.x >> 3) & 3;
  int xo[8];
#pragma unroll
  for (int c8 = 0; c8 < 8; ++c8) xo[c8] = (c8 ^ (pn & 7)) << 4;
  auto permute = [&](unsigned char* tab) {
#pragma unroll
    for (int n = pn; n < (NR > 64 ? NR : 64); n += 64) {  // (64 rows per pass)
      if (n >= NR) break;                                  // (CTA-uniform per warp)
      const uint4* src = reinterpret_cast<const uint4*>(stg + n * 512 + 128 * pt);
      unsigned char* dst = tab + n * wg::kRowBytes + 4 * pt;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        uint32_t w[16];
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // chunk 8t + 4i + q of the line: 8t + ((4i + q) ^ (n mod 8))
          const uint4 v = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(src) + xo[4 * i + q]);
          w[4 * q] = v.x, w[4 * q + 1] = v.y, w[4 * q + 2] = v.z, w[4 * q + 3] = v.w;
        }
#pragma unroll
        for (int p = 0; p < 16; ++p) {
          // the table's byte of pair p of unit 2t + i of row n: a constant and a per-chunk offset
          const int q = 8 * i + 2 * (p >> 2) + (p & 1), c16 = 2 * (q & 3) + ((p >> 1) & 1);
          *reinterpret_cast<uint32_t*>(dst + (q >> 2) * NR * wg::kRowBytes + xo[c16]) = Fmt::xpair(w, p);
        }
      }
    }
    wg::proxy_fence();  // the table is read by the tensor cores (async proxy)
  };

  float c[WR][NT][4];
#pragma unroll
  for (int r = 0; r < WR; ++r)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[r][nt][i] = 0.0f;
  // Per unit quarter (i, j) one batch of 2 WR wgmma; its A registers alternate between two sets,
  // so the warp decodes quarter q + 1 while the batch of q runs (wait<1>: batch q - 1, the last
  // reader of the set about to be overwritten, is done). 8 quarters per step: the parity of a
  // step's quarters is the same in every step.
  uint32_t wa[2][WR][2][4];
  const uint32_t tab0_addr = static_cast<uint32_t>(__cvta_generic_to_shared(tab0));
  auto multiply = [&](const Stage& st, int buf) {
    const uint64_t desc0 = wg::sw128_desc(tab0_addr + buf * kStep);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t(&a)[WR][2][4] = wa[(4 * i + j) & 1];
        quarter_fragments<Ops, PAIR>(f, lut, lane, st, i, j, a);
        wg::fence();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int q = 8 * i + 2 * j + h;
          const uint64_t desc = desc0 + static_cast<uint64_t>(((q >> 2) * NR * wg::kRowBytes + 32 * (q & 3)) >> 4);
#pragma unroll
          for (int r = 0; r < WR; ++r) wg::WgmmaRS<NT>::template run<std::is_same_v<H, bf16_t>>(c[r], a[r][h], desc);
        }
        wg::commit();
        wg::wait<1>();
      }
  };

  Stage s0, s1;
  if (steps > 0) rows.load(f, 0, s0);  // in flight while the first table (and nf4's pair table) is made
  if (steps > 1) rows.load(f, 1, s1);
  if (steps > 0) stage_x(0);
  if constexpr (Fmt::kLut) fill_pair_lut<Fmt, Ops>(f, lut);  // (ends with __syncthreads)
  if (steps > 0) {
    cuda::cp_async_wait<0>();
    __syncthreads();
    permute(tab0);
    __syncthreads();
    if (steps > 1) stage_x(1);
  }
  // Step k + 1's table is made after step k's multiply: its buffer was last read by step k - 1's
  // wgmma, which every warpgroup has waited for by then (wait<1> in step k), and the barrier
  // before the permute orders that for both warpgroups. CTA-uniform conditions.
  auto next_table = [&](int k) {
    if (k + 1 >= steps) return;
    cuda::cp_async_wait<0>();
    __syncthreads();  // step k + 1 staged by every thread; step k - 1's table no longer read
    permute(tab0 + ((k + 1) & 1) * kStep);
    __syncthreads();  // the table is complete, the staging buffer free
    if (k + 2 < steps) stage_x(k + 2);
  };
  for (int k = 0; k < steps; k += 2) {
    multiply(s0, 0);
    if (k + 2 < steps) rows.load(f, k + 2, s0);
    next_table(k);
    if (k + 1 < steps) {
      multiply(s1, 1);
      if (k + 3 < steps) rows.load(f, k + 3, s1);
      next_table(k + 1);
    }
  }
  wg::wait<0>();
#pragma unroll
  for (int r = 0; r < WR; ++r)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) wg::pin(c[r][nt][e]);
  wide_epilogue<NT, WR>(c, reinterpret_cast<float*>(tab0), mb, m0, n0, N, M, Y, bias);
#else
#if __CUDA_ARCH__ >= 900
  __trap();  // never launched: the host takes this kernel only from a build with sm_90a code
#endif
#endif
}

// Whether this build has sm_90a code (CMake defines QFORMATS_SM90A when its architectures include
// 90a): only then does the wgmma kernel run, on compute capability 9.0.
constexpr bool wgmma_built() {
#if defined(QFORMATS_SM90A)
  return true;
#else
  return false;
#endif
}

// Dynamic shared memory of the wgmma kernel for NT activation tiles: two step tables and the
// staging copy, plus the 1 KB that aligning the tables may skip.
constexpr int wgmma_smem_bytes(int nt) { return 3 * wg_step_bytes(8 * nt) + 1024; }

// How many clusters of `cfg`'s shape can run at once on the current device (cached per kernel,
// cluster size and shared memory).
inline int max_active_clusters(const void* kernel, const cudaLaunchConfig_t& cfg, int cluster) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, size_t, int>, int> cache;
  int dev = 0;
  cuda::check(cudaGetDevice(&dev), "CUDA device");
  const auto key = std::make_tuple(kernel, cluster, cfg.dynamicSmemBytes, dev);
  std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int n = 0;
  cuda::check(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg), "cluster occupancy");
  cache[key] = n;
  return n;
}

// Launches the wgmma kernel on `stream` for 9 or more activation rows on compute capability 9.0
// with sm_90a code in the build; returns false (nothing launched) otherwise. The grid: 128 WR
// weight rows x NR activation rows per CTA (NR = 16, 32, 64, or 128 with WR = 1 above 64 rows),
// K split into S slices (a cluster of S CTAs, S <= 8); of the (WR, S) pairs, the one whose per-CTA
// work (WR x steps / S) times its waves (grid / clusters that fit at once, from the occupancy
// calculator) or CTAs per SM is least. X and Y 16-byte aligned, K a multiple of 32.
template <class Fmt, class H>
bool launch_weight_only_wgmma(const Fmt& f, const H* X, int64_t N, int64_t K, int64_t M, H* Y, const H* bias,
                              void* stream) {
  if (!wgmma_built() || N <= 8 || M <= 0 || cuda::cc_major() != 9) return false;
  static_assert(Fmt::kUnit == 32, "units of 32 values");
  const int nt = N > 64 ? 16 : N > 32 ? 8 : N > 16 ? 4 : 2;  // (above 64 rows: 128 per CTA, grid.y)
  const int64_t steps = (K / 32 + kWideStepUnits - 1) / kWideStepUnits;
  bool pair = false;
  if constexpr (Fmt::kPairLoad) pair = f.pair_load_ok();
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = wide_launch_config(attr, wgmma_smem_bytes(nt), stream);
  // Calls fn with the kernel for (wr, NT, PAIR).
  auto with_kernel = [&](int wr, auto&& fn) {
    auto by_nt = [&](auto wr_c, auto p_c) {
      constexpr int WR = decltype(wr_c)::value;
      constexpr bool P = decltype(p_c)::value;
      if (nt == 2) fn(weight_only_wgmma_kernel<Fmt, H, 2, WR, P>);
      else if (nt == 4) fn(weight_only_wgmma_kernel<Fmt, H, 4, WR, P>);
      else if (nt == 8) fn(weight_only_wgmma_kernel<Fmt, H, 8, WR, P>);
      else if constexpr (WR == 1) fn(weight_only_wgmma_kernel<Fmt, H, 16, 1, P>);  // (the launcher's WR for 16)
    };
    auto by_pair = [&](auto wr_c) {
      if constexpr (Fmt::kPairLoad) {
        if (pair) return by_nt(wr_c, std::true_type{});
      }
      by_nt(wr_c, std::false_type{});
    };
    if (wr == 1) by_pair(std::integral_constant<int, 1>{});
    else by_pair(std::integral_constant<int, 2>{});
  };
  auto shape = [&](int wr, int s) {
    set_wide_grid(cfg, dim3(cuda::grid_for(M, kMmaRows * wr * kWideWarps), cuda::grid_for(N, nt * 8), s));
  };
  // The choice depends only on the call's shape, the kernel family and the device, so it is made
  // once per (NT, PAIR, M, column CTAs, steps, device) and remembered: an eager layer call then
  // pays one lookup instead of 16 occupancy queries (benchmarks/README.md, "wgmma launcher").
  int dev = 0;
  cuda::check(cudaGetDevice(&dev), "CUDA device");
  const auto key = std::make_tuple(nt, pair, M, int64_t(cuda::grid_for(N, nt * 8)), steps, dev);
  static std::mutex choice_mu;
  static std::map<std::tuple<int, bool, int64_t, int64_t, int64_t, int>, std::pair<int, int>> choices;
  int best_wr = 0, best_s = 0;
  {
    std::lock_guard<std::mutex> lock(choice_mu);
    const auto it = choices.find(key);
    if (it != choices.end()) best_wr = it->second.first, best_s = it->second.second;
  }
  if (best_wr == 0) {
    const int sms = cuda::sm_count();
    double best = 0.0;
    for (int wr = nt == 16 ? 1 : 2; wr >= 1; --wr)  // (ties: more rows per CTA, then fewer slices; 128
                                                    // activation rows: one row group, for the registers)
      for (int s = 1; s <= kWideMaxSlices && s <= steps; ++s) {
        shape(wr, s);
        int fit = 0;
        with_kernel(wr, [&](auto kernel) {
          cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel));
          fit = max_active_clusters(reinterpret_cast<const void*>(kernel), cfg, s);
        });
        if (fit <= 0) continue;
        // a CTA's work (wr x its steps) times the waves of clusters, or times the CTAs per SM when
        // more than one CTA shares an SM
        const int64_t clusters = int64_t(cfg.gridDim.x) * cfg.gridDim.y;
        const double waves = std::max(double((clusters + fit - 1) / fit), double(clusters * s) / sms);
        const double cost = waves * wr * double((steps + s - 1) / s);
        if (best_wr == 0 || cost < best) best = cost, best_wr = wr, best_s = s;
      }
    if (best_wr == 0) return false;  // (not remembered: nothing fits, a rare shape)
    std::lock_guard<std::mutex> lock(choice_mu);
    choices[key] = {best_wr, best_s};
  }
  const int slice_steps = static_cast<int>((steps + best_s - 1) / best_s);
  shape(best_wr, best_s);
  with_kernel(best_wr, [&](auto kernel) {
    cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel));
    cuda::check(cudaLaunchKernelEx(&cfg, kernel, f, X, N, K, M, Y, bias, slice_steps), "weight-only GEMM (wgmma)");
  });
  cuda::check_launch("weight-only GEMM (wgmma)");
  return true;
}

}  // namespace qf::gemm::cuda_wo
