// Weight-only GEMM for 9..64 activation rows on sm_90: Y [N, M] = X [N, K] . W^T, with the
// decode and mma of weight_only_mma_cuda.cuh (PairOps, Fmt::pairs, Fmt::xpair) but a different
// split of the work, so that each weight is decoded once for all the activation rows and each
// activation is read from L2 once per 128 or 256 weight rows:
// - a CTA of kWideWarps warps owns 16 x WR weight rows per warp (WR = wide_row_groups(NT)) and up
//   to 64 activation rows (NT tiles of 8; grid.y covers more), over one slice of K (grid.z);
// - the CTA first writes its activation rows over its K slice into shared memory, already in mma
//   order (as the one-row kernel's XS table: per unit and word-quad j, the four B registers of
//   its two mma), so a lane reads an n8 tile's B registers with one 16-byte LDS and no PRMT;
// - every warp then streams its own rows over the whole slice (two register stages of weight
//   loads, as in the mma kernel; both in flight while the table is filled) and issues NT x WR x 2
//   mma per decoded unit quarter;
// - the K slices of a column of CTAs form one thread-block cluster; each CTA leaves its partial
//   sums in its shared memory and each adds up 1/S of the tile from all S CTAs' memories, in
//   rank order (deterministic), and stores Y.
// Why: the two-tile kernel (N > 8) decodes every weight once per 16 activation rows and its
// warps read X through L1 per 16-row group, which made it 2-3x slower than fp16 at 64 rows
// (benchmarks/README.md, "Row groups"). Marlin (IST-DASLab/marlin) splits the work the same way
// (wide CTA tiles of weight columns, activations in shared memory, K sliced over CTAs); its
// offline weight permutation is not needed here because the activations are permuted instead,
// once per CTA. Cluster launch and distributed shared memory need sm_90: the launcher checks,
// and the kernel compiles empty below.
#pragma once
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdlib>

#include "gemm/weight_only_mma_cuda.cuh"

namespace qf::gemm::cuda_wo {

constexpr int kWideWarps = 8;
constexpr int kWideStepUnits = 8;  // a warp step: lane t takes units 2t, 2t + 1
constexpr int kWideMaxSlices = 8;  // K slices per cluster (the portable cluster size)

// 16-row groups per warp for NT activation tiles: 2 from 32 activation rows, which halves the
// table's reads per mma and the activations each CTA loads per weight byte (measured faster at 32
// and 64 rows; at 16 rows one group, for more CTAs).
__host__ __device__ constexpr int wide_row_groups(int nt) { return nt >= 4 ? 2 : 1; }

// Slot of word-quad j of local unit u for activation row n (NR rows) in the CTA's table. The
// eight lanes of a 16-byte read phase (g = 0, 1; t = 0..3) read units 2t + i of rows g: XOR-ing
// 2t into n puts them at eight distinct 16-byte offsets of a 128-byte line (NR >= 16 makes each
// (u, j) run a multiple of 256 bytes), so the phase touches every bank once.
template <int NR>
__device__ __forceinline__ int wide_slot(int u, int j, int n) {
  return (u * 4 + j) * NR + (n ^ (((u >> 1) & 3) << 1));
}

// PairOps without the fp16 "times 16" decode (odd pairs shifted down like bf16's instead): one set
// of accumulators instead of two, for the kernel's large tiles.
template <class H>
struct PlainPairOps : PairOps<H> {
  using B = PairOps<H>;
  static constexpr bool kX16 = false;
  static __device__ __forceinline__ NibbleConsts nibble_consts(float zero, uint32_t scale2) {
    return {B::splat(B::kMagicF + zero), 0u, scale2};
  }
  static __device__ __forceinline__ void nibble_pairs(uint32_t w, const NibbleConsts& k, uint32_t (&p)[4]) {
    shifted_nibble_pairs<B>(w, k, p);
  }
};

// A warp's weight rows in a wide CTA (this kernel and the wgmma kernel): row group r (r < WR) is
// rows m0 + 16 r + g and + 8 (clamped to M - 1: rows past M are computed and not stored), over
// the CTA's K slice (grid.z) of slice_steps steps of kWideStepUnits units; lane t loads units 2t,
// 2t + 1 of each step (a Stage: the raw loaded registers; units past K load the row's first unit,
// multiplied by zero activations).
template <class Fmt, int WR, bool PAIR>
struct WideRows {
  using Loaded = typename LoadedUnit<Fmt, PAIR>::type;
  static constexpr int kLoads = PAIR ? 1 : 2;
  struct Stage {
    Loaded a[WR][kLoads], b[WR][kLoads];
  };
  int64_t rowA[WR], rowB[WR];
  typename Fmt::RowState rsA[WR], rsB[WR];
  int64_t units, u0;
  int steps;  // steps of this slice that hold units (the last slices may hold fewer, or none)
  int t;
  __device__ __forceinline__ WideRows(const Fmt& f, int64_t m0, int64_t M, int64_t K, int slice_steps) {
    const int lane = threadIdx.x & 31, g = lane >> 2;
    t = lane & 3;
#pragma unroll
    for (int r = 0; r < WR; ++r) {
      const int64_t a = m0 + 16 * r + g, b = a + 8;
      rowA[r] = a < M ? a : M - 1;
      rowB[r] = b < M ? b : M - 1;
    }
    units = K / 32;
    u0 = int64_t(blockIdx.z) * slice_steps * kWideStepUnits;
    const int64_t left = units - u0, need = (left + kWideStepUnits - 1) / kWideStepUnits;
    steps = left <= 0 ? 0 : static_cast<int>(need < slice_steps ? need : slice_steps);
#pragma unroll
    for (int r = 0; r < WR; ++r) {
      rsA[r] = f.row(rowA[r], u0);
      rsB[r] = f.row(rowB[r], u0);
    }
  }
  __device__ __forceinline__ void load(const Fmt& f, int k, Stage& st) {
#pragma unroll
    for (int r = 0; r < WR; ++r)
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int64_t u = u0 + k * kWideStepUnits + 2 * t + i, uc = u < units ? u : 0;
        st.a[r][i] = load_unit<PAIR>(f, rsA[r], rowA[r], uc);
        st.b[r][i] = load_unit<PAIR>(f, rsB[r], rowB[r], uc);
      }
  }
};

// A warp's A fragments of unit quarter (i, j) of a step (both kernels): for row group r, a[r][0]
// holds pairs 4j, 4j + 2 and a[r][1] pairs 4j + 1, 4j + 3 of rows g (st.a) and g + 8 (st.b), in
// mma.m16n8k16's A layout (registers: row g, row g + 8, row g at k + 8, row g + 8 at k + 8).
template <class Ops, bool PAIR, class Fmt, class Stage, int WR>
__device__ __forceinline__ void quarter_fragments(const Fmt& f, const uint32_t (*lut)[32], int lane, const Stage& st,
                                                  int i, int j, uint32_t (&a)[WR][2][4]) {
#pragma unroll
  for (int r = 0; r < WR; ++r) {
    uint32_t pa[4], pb[4];
    unit_pairs<Ops, PAIR>(f, lut, lane, st.a[r], i, j, pa);
    unit_pairs<Ops, PAIR>(f, lut, lane, st.b[r], i, j, pb);
#pragma unroll
    for (int h = 0; h < 2; ++h) a[r][h][0] = pa[h], a[r][h][1] = pb[h], a[r][h][2] = pa[h + 2], a[r][h][3] = pb[h + 2];
  }
}

// The end of a wide CTA (this kernel and the wgmma kernel of weight_only_wgmma_cuda.cuh): its
// warps' accumulators c (the C fragment: c[r][nt][0..1] = weight row m0 + 16 r + g, activation
// rows n0 + 8 nt + 2t, + 1; [2..3] = weight row + 8) go to Y, or with K split over a cluster
// (gridDim.z > 1) into partial sums [NR][R] in `red` (the CTA's shared memory, free once every
// warp is done with it: the barrier below), and each CTA of the cluster sums its 1/S of the tile
// over the S slices in rank order (deterministic) and stores it. R: the CTA's weight rows from mb.
template <int NT, int WR, class H>
__device__ __forceinline__ void wide_epilogue(const float (&c)[WR][NT][4], float* red, int64_t mb, int64_t m0,
                                              int64_t n0, int64_t N, int64_t M, H* __restrict__ Y,
                                              const H* __restrict__ bias) {
  namespace cg = cooperative_groups;
  constexpr int NR = NT * 8, R = kMmaRows * WR * kWideWarps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  if (gridDim.z == 1) {
#pragma unroll
    for (int r = 0; r < WR; ++r)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t n = n0 + nt * 8 + 2 * t + (e & 1), m = m0 + 16 * r + g + (e >> 1) * 8;
          if (n < N && m < M) store_out(c[r][nt][e], bias, m, &Y[n * M + m]);
        }
    return;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < WR; ++r)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        red[(nt * 8 + 2 * t + (e & 1)) * R + 16 * (WR * warp + r) + g + (e >> 1) * 8] = c[r][nt][e];
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every CTA's partial sums are written and visible to the cluster
  const int S = static_cast<int>(cluster.num_blocks()), z = static_cast<int>(cluster.block_rank());
  constexpr int E = NR * R;
  for (int e = z * E / S + threadIdx.x; e < (z + 1) * E / S; e += blockDim.x) {  // (any S)
    float v = 0.0f;
    for (int s = 0; s < S; ++s) v += cluster.map_shared_rank(red, s)[e];
    const int64_t n = n0 + e / R, m = mb + e % R;
    if (n < N && m < M) store_out(v, bias, m, &Y[n * M + m]);
  }
  cluster.sync();  // no CTA leaves while the others read its shared memory
}

template <class Fmt, class H, int NT, bool PAIR>
__global__ void
__launch_bounds__(kWideWarps * 32, 1)
    weight_only_wide_kernel(const Fmt f, const H* __restrict__ X, int64_t N, int64_t K, int64_t M, H* __restrict__ Y,
                            const H* __restrict__ bias, int slice_steps) {
#if __CUDA_ARCH__ >= 900
  constexpr int WR = wide_row_groups(NT);
  using Ops = std::conditional_t<(NT * WR >= 8), PlainPairOps<H>, PairOps<H>>;  // (accumulator registers)
  constexpr int NR = NT * 8, R = kMmaRows * WR * kWideWarps;  // activation rows, weight rows per CTA
  static_assert(Fmt::kUnit == 32, "units of 32 values");
  constexpr bool kX16 = Fmt::template odd_x16<Ops>();
  extern __shared__ uint4 xs[];  // the activation table, then the partial sums (see the end)
  __shared__ uint32_t lut[Fmt::kLut ? 256 : 1][32];  // filled once the first loads are in flight

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t mb = int64_t(blockIdx.x) * R, m0 = mb + 16 * WR * warp;
  const int64_t n0 = int64_t(blockIdx.y) * NR;
  using Rows = WideRows<Fmt, WR, PAIR>;
  using Stage = typename Rows::Stage;
  Rows rows(f, m0, M, K, slice_steps);
  const int64_t units = rows.units, u0 = rows.u0;
  const int steps = rows.steps;
  auto load = [&](int k, Stage& st) { rows.load(f, k, st); };
  float c[WR][NT][4], c16[kX16 ? WR : 1][NT][4];
#pragma unroll
  for (int r = 0; r < WR; ++r)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[r][nt][i] = c16[kX16 ? r : 0][nt][i] = 0.0f;
  auto multiply = [&](int k, const Stage& st) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int ul = k * kWideStepUnits + 2 * t + i;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t a[WR][2][4];
        quarter_fragments<Ops, PAIR>(f, lut, lane, st, i, j, a);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint4 xq = xs[wide_slot<NR>(ul, j, nt * 8 + g)];
#pragma unroll
          for (int r = 0; r < WR; ++r) {
            Ops::mma(c[r][nt], a[r][0], xq.x, xq.y);
            Ops::mma(kX16 ? c16[kX16 ? r : 0][nt] : c[r][nt], a[r][1], xq.z, xq.w);
          }
        }
      }
    }
  };

  Stage s0, s1;
  if (steps > 0) load(0, s0);  // in flight while the tables are filled
  if (steps > 1) load(1, s1);
  if constexpr (Fmt::kLut) fill_pair_lut<Fmt, Ops>(f, lut);  // (ends with __syncthreads)
  // The table: one (unit, row) per thread and pass, the unit's 16 activation pairs in, its four
  // slots out; rows past N and units past K (up to whole steps) get zeros.
  for (int idx = threadIdx.x; idx < steps * kWideStepUnits * NR; idx += blockDim.x) {
    const int n = idx % NR, ul = idx / NR;
    const int64_t u = u0 + ul;
    const bool ok = n0 + n < N && u < units;
    const uint4* src = reinterpret_cast<const uint4*>(X + (ok ? (n0 + n) * K + u * 32 : 0));
    uint32_t w[16];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint4 v = ok ? __ldg(src + q) : make_uint4(0, 0, 0, 0);
      w[4 * q] = v.x; w[4 * q + 1] = v.y; w[4 * q + 2] = v.z; w[4 * q + 3] = v.w;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
      xs[wide_slot<NR>(ul, j, n)] = make_uint4(Fmt::xpair(w, 4 * j), Fmt::xpair(w, 4 * j + 2),
                                               Fmt::xpair(w, 4 * j + 1), Fmt::xpair(w, 4 * j + 3));
  }
  __syncthreads();
  for (int k = 0; k < steps; k += 2) {  // CTA-uniform conditions
    multiply(k, s0);
    if (k + 2 < steps) load(k + 2, s0);
    if (k + 1 < steps) {
      multiply(k + 1, s1);
      if (k + 3 < steps) load(k + 3, s1);
    }
  }
  if constexpr (kX16)
#pragma unroll
    for (int r = 0; r < WR; ++r)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[r][nt][i] = fmaf(c16[r][nt][i], 0.0625f, c[r][nt][i]);  // exact scaling

  wide_epilogue<NT, WR>(c, reinterpret_cast<float*>(xs), mb, m0, n0, N, M, Y, bias);
#endif
}

// The launch of a wide CTA (this kernel's and the wgmma kernel's): kWideWarps warps, `smem` bytes
// of dynamic shared memory, the K slices of a column of CTAs (grid.z) as one cluster (attr: the
// config's one attribute, which set_wide_grid sizes with the grid).
inline cudaLaunchConfig_t wide_launch_config(cudaLaunchAttribute (&attr)[1], int64_t smem, void* stream) {
  cudaLaunchConfig_t cfg{};
  cfg.blockDim = dim3(kWideWarps * 32);
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = cuda::stream(stream);
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}
inline void set_wide_grid(cudaLaunchConfig_t& cfg, dim3 grid) {
  cfg.gridDim = grid;
  cfg.attrs[0].val.clusterDim.z = grid.z;
}

// Launches the wide kernel on `stream` when it applies: 9..64 rows on sm_90, the activation table
// of a K slice fits the CTA's shared memory with at most kWideMaxSlices slices, and the grid
// needs at most 4 slices to cover the SMs or the CTA takes 64 activation rows. Below that (few
// weight rows for many slices, e.g. 4096x14336 at 16 rows) the two-tile kernel measured faster
// (benchmarks/README.md, "Wide CTAs"). Returns false (nothing launched) otherwise. X and Y
// 16-byte aligned, K a multiple of 32.
template <class Fmt, class H>
bool launch_weight_only_wide(const Fmt& f, const H* X, int64_t N, int64_t K, int64_t M, H* Y, const H* bias,
                             void* stream) {
  if (N <= 8 || N > 64 || M <= 0 || cuda::cc_major() < 9) return false;
  const int nt = N > 32 ? 8 : N > 16 ? 4 : 2;
  const int rows = kMmaRows * kWideWarps * wide_row_groups(nt);
  const int64_t steps = (K / 32 + kWideStepUnits - 1) / kWideStepUnits;
  // the table (per step: 8 NT activation rows x 8 units x 4 slots of 16 bytes), and at the end
  // the partial sums over it (8 NT x rows floats)
  auto bytes = [&](int s) {
    return std::max((steps + s - 1) / s * (int64_t(nt) * 8 * kWideStepUnits * 4 * 16), int64_t(nt) * 8 * rows * 4);
  };
  const int64_t budget = cuda::max_dynamic_smem() - (Fmt::kLut ? 256 * 32 * 4 : 0) - 1024;
  const int64_t ctas = int64_t(cuda::grid_for(M, rows)) * cuda::grid_for(N, nt * 8), sms = cuda::sm_count();
  int S = 1;
  while (S < kWideMaxSlices && (bytes(S) > budget || ctas * S < sms)) S *= 2;
  if (bytes(S) > budget || (S > 4 && nt < 8)) return false;
  const int slice_steps = static_cast<int>((steps + S - 1) / S);
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = wide_launch_config(attr, bytes(S), stream);
  set_wide_grid(cfg, dim3(cuda::grid_for(M, rows), cuda::grid_for(N, nt * 8), S));
  auto go = [&](auto kernel) {
    cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel));
    cuda::check(cudaLaunchKernelEx(&cfg, kernel, f, X, N, K, M, Y, bias, slice_steps), "weight-only GEMM (wide)");
  };
  auto by_nt = [&](auto pair) {
    constexpr bool P = decltype(pair)::value;
    if (nt == 2) go(weight_only_wide_kernel<Fmt, H, 2, P>);
    else if (nt == 4) go(weight_only_wide_kernel<Fmt, H, 4, P>);
    else go(weight_only_wide_kernel<Fmt, H, 8, P>);
  };
  bool pair = false;
  if constexpr (Fmt::kPairLoad) {
    pair = f.pair_load_ok();
    if (pair) by_nt(std::true_type{});
  }
  if (!pair) by_nt(std::false_type{});
  cuda::check_launch("weight-only GEMM (wide)");
  return true;
}

}  // namespace qf::gemm::cuda_wo
