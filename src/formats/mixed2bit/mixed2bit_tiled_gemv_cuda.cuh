// mixed2bit layout "tiled" (mixed2bit_tiled.h): the GEMV for one or two activation rows (decode
// steps, N <= 2) for groups of 16 values, 16-bit activations, sm_80+, written for the layout
// instead of through the shared tensor-core driver's per-unit policy (mixed2bit_tiled_gemm_cuda.cu,
// which still takes every other case).
//
// Why a kernel of its own: through the driver a lane fetches one 16-value group at a time (its
// codes word, scales byte and second-order pair as three loads with their own 64-bit address
// arithmetic, plus the map-word state) and turns every group's two scales into 16-bit splats for
// an HFMA2 per weight pair, which Nsight Compute counted at about 11 instructions per weight
// (benchmarks/README.md, "mixed2bit's tiled layout ... On the H200").
//
// Two passes over a warp's run of the row:
// - The 2-bit pass takes every group as a 2-bit one. A lane takes four consecutive groups of each
//   of its two rows per step, which the layout stores contiguously: one 16-byte load of their
//   codes, one 4-byte load of their scale bytes, one second-order pair (a block of B >= 4 groups
//   holds the four) and their map word. The 4-bit groups' scale bytes are zeroed, so their codes
//   words (their hi bits) add nothing. The tensor cores multiply the codes as M + 4^f q (the
//   decode below: one LOP3 per weight pair), and each group's scales are applied once to its sum
//   in float32: w . x = s_eff (sum - P) - m_eff sum(x), with P and sum(x) per group precomputed
//   once per CTA. For that every lane must get its own group's sum out of the mma: B is
//   block-diagonal (columns 2t and 2t + 1 hold the activations of lane t's k slots and zeros
//   elsewhere: lanes (g', t) with g' / 2 != t read a zero slot), so lane (g, t)'s accumulators
//   hold exactly its own group's sums for rows g and g + 8: c[0], c[2] with one activation row
//   (which both columns hold), c[0..1], c[2..3] with two (row n in column 2t + n, so a second row
//   costs no mma and no decode, only its table and its epilogue).
// - The 4-bit pass then takes the run's 4-bit groups (a tenth of them at the defaults) on the
//   CUDA cores, one per lane: each lane walks the map words of one row and reads its groups' lo
//   words and mc4 bytes one slot after the other, so no lane computes a slot per group (the
//   popcounts and predicated loads per group that a single pass needs cost more than the 4-bit
//   groups' own arithmetic: benchmarks/README.md, "The GEMV in two passes").
//
// Work split, as the driver's one-row kernel (weight_only_mma_cuda.cuh): a CTA owns 16 weight
// rows and its warps split the row's steps (16 groups, 256 values) into contiguous runs; lane
// (g, t) takes rows g and g + 8 and groups 4t .. 4t + 3 of each step. The CTA first writes X's
// rows into shared memory in mma order, the B registers of a group's four mma in two 16-byte slots.
// The weights of the next step are loaded while the current one is multiplied (two register
// stages), and the 4-bit pass loads its next group while it multiplies one.
//
// Numerics: as the float32 driver (weight_only_cuda.cuh), not the tensor-core one: the weight is
// never rounded to 16 bits; per group s_eff = d16 * sc and m_eff = dm16 * mc (the format's
// float32 products, the 2-bit groups' d16 applied to the sum of their lane's four), sum(q x) from
// the tensor cores or FFMA in float32, sum(x) in float32 in a fixed order; each lane's groups,
// then the quad's lanes, then the warps added in a fixed order (deterministic); one rounding of
// Y. The magic's offset M sum(x') (M = 1024 for fp16) is exact in each product and taken off
// once per group: it adds float32 rounding of about 2^-24 M sum|x| per group, far below the
// fp16 output's rounding (as the offset GEMV's, weight_only_gemv_cuda.cuh).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "formats/mixed2bit/mixed2bit_tiled.h"
#include "gemm/weight_only_cuda.cuh"
#include "gemm/weight_only_cuda.h"
#include "gemm/weight_only_mma_cuda.cuh"
#include "gemm/weight_only_policy_cuda.cuh"

namespace qf::mixed2bit::tiled {
namespace gemv {

constexpr int kStepGroups = 16;  // groups of 16 values per warp step: 4 per lane of a quad
constexpr int kLaneGroups = 4;
constexpr int kWarps = 8;  // most warps per CTA

// The buffers as the kernel reads them; strides in 32-bit units (gemm_cuda_supports bounds rows * G).
struct Args {
  const uint4* codes;      // [rows, G / 4]: the code words of four consecutive groups
  const uint32_t* scales;  // [rows, G / 4]: their four scale bytes
  const uint32_t* so;      // [rows, nb]: [d, dm] fp16 bits of the 2-bit groups of a block
  const uint32_t* map;     // [rows, mw]
  const uint32_t* lo;      // [rows, n4_row]
  const uint8_t* mc4;      // [rows, n4_row]
  const uint32_t* so4;     // [rows, nt]: [d, dm] of a tile's 4-bit groups
  uint32_t G4, nb, mw, nt, n4_row, n4_full;
  int bshift;  // log2(scale_block), >= 2
};

// The decode. A 2-bit codes word holds value k of its group at bits 2k (values 0..7 in the low
// half, 8..15 in the high half). Shifted right by 4p (p = 0..3), one LOP3 each puts two fields
// into the mantissa of the 16-bit magic M (PairOps::kMagic: 1024 in fp16, 128 in bf16; unit last place):
//   (w >> 4p) & 0x00030003 | M  = the pair (M + q[2p],       M + q[8 + 2p])          ("f = 0")
//   (w >> 4p) & 0x000C000C | M  =          (M + 4 q[2p + 1], M + 4 q[9 + 2p])      ("f = 1")
// exact: the A registers of "part p" (k slots 2t, 2t + 1 and 2t + 8, 2t + 9 of a lane). B holds x
// in the same order with the f = 1 values divided by 4 (exact, as the offset GEMV's x / 16 in
// weight_only_gemv_cuda.cuh; fp16 drops low bits only where x / 4 is subnormal), so the mma sums
// M sum(x') + sum(q x) (x' = x / 4^f). The offset is not taken off per pair: the table keeps
// P = M sum(x') per group and the epilogue subtracts it once.
// A 4-bit group (q = 4 hi + lo: hi in its codes word, lo in its lo word, both laid out as above):
// the 4-bit pass decodes its lo word with the same shifts and masks into the magic M / 4 (kMagic4, 256 /
// 32, whose unit last place is 1/4), (M / 4 + 4^f lo / 4), and two HFMA2 give
// 4 (M + 4^f hi) - 5 M + 4 (M / 4 + 4^f lo / 4) = 4^f q, exact in 16 bits (|4^f q| <= 60).
constexpr uint32_t kF0 = 0x00030003u, kF1 = 0x000C000Cu;

// One row's loaded registers for one step of the 2-bit pass (nothing computed from them: see
// weight_only_policy_cuda.cuh).
struct RowStage {
  uint4 c;      // four code words
  uint32_t sb;  // four scale bytes (0 past the row: zero weights)
  uint32_t so;  // the 2-bit groups' [d, dm]
  uint32_t mw;  // the map word holding the four groups (0 past the row)
};

// Step s of row m into st (lane quad position t).
__device__ __forceinline__ void load_row(const Args& a, uint32_t s, int t, uint32_t m, RowStage& st) {
  const uint32_t q = s * (kStepGroups / kLaneGroups) + t;  // the lane's chunk of four groups
  const bool ok = q < a.G4;
  const uint32_t qc = ok ? q : a.G4 - 1, c0 = qc * kLaneGroups;
  st.c = __ldg(a.codes + (m * a.G4 + qc));
  st.sb = ok ? __ldg(a.scales + (m * a.G4 + qc)) : 0u;
  st.so = __ldg(a.so + (m * a.nb + (c0 >> a.bshift)));
  st.mw = ok && a.n4_row > 0 ? __ldg(a.map + (m * a.mw + c0 / kMapBits)) : 0u;
}

// 0xFF in byte i of the result for each bit i of a 4-bit mask (four shifted copies of the bits, 7
// apart: no carries).
__device__ __forceinline__ uint32_t byte_mask4(uint32_t bits) { return ((bits * 0x00204081u) & 0x01010101u) * 0xFFu; }

// The two values of a 16-bit pair as float32 (low half first).
template <class H>
__device__ __forceinline__ float2 pair_to_float2(uint32_t v);
template <>
__device__ __forceinline__ float2 pair_to_float2<half_t>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}
template <>
__device__ __forceinline__ float2 pair_to_float2<bf16_t>(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
}

// XS slot of B-register quad j of group u: the four lanes t of a quad read groups 4t + i, 128
// bytes apart; XOR-ing 2t into the slot puts their 16-byte reads in distinct bank quads. A
// permutation within each run of 8 slots.
__device__ __forceinline__ uint32_t xs_slot(uint32_t u, int j) { return (2 * u + j) ^ (((u >> 2) & 3u) << 1); }

// A row's walk over its 4-bit groups in [g0, g1) (the 4-bit pass): the map word wi, its bits not
// yet taken, and the slot (in lo / mc4) of the next one.
struct Walk {
  uint32_t wi, bits, slot;
};
// One 4-bit group as the 4-bit pass reads it (has: there is one; else only c is set, to 0).
struct Four {
  uint32_t c, hi, lo, sc, mc, so4;
  bool has;
};

template <class H, int NR>
__global__ void
__launch_bounds__(kWarps * 32)
    weight_only_tiled_gemv(const Args a, const H* __restrict__ X, int64_t K, int64_t M, H* __restrict__ Y,
                           const H* __restrict__ bias) {
  static_assert(NR == 1 || NR == 2, "the block-diagonal B has two columns per lane");
  using Ops = gemm::cuda_wo::PairOps<H>;
  using gemm::cuda_wo::and_or;
  // dynamic shared memory (the launcher's xs_bytes): per activation row and group (zero-padded
  // to whole steps) two 16-byte slots of B registers, then one zero slot, then per row and group
  // {sum(x), P}
  extern __shared__ uint4 xs[];
  __shared__ float red[kWarps][NR][gemm::cuda_wo::kMmaRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t m0 = int64_t(blockIdx.x) * gemm::cuda_wo::kMmaRows;
  // rows past M compute on row M - 1 and are not stored
  const uint32_t mA = static_cast<uint32_t>(m0 + g < M ? m0 + g : M - 1);
  const uint32_t mB = static_cast<uint32_t>(m0 + g + 8 < M ? m0 + g + 8 : M - 1);
  const uint32_t groups = a.G4 * kLaneGroups, steps = (groups + kStepGroups - 1) / kStepGroups;
  const uint32_t padded = steps * kStepGroups;
  const uint32_t first = steps * warp / nwarps, end = steps * (warp + 1) / nwarps;
  float2* const xsum = reinterpret_cast<float2*>(xs + NR * 2 * padded + 1);  // [NR][padded]

  RowStage s0[2], s1[2];  // [row A, row B] of two steps
  if (first < end) {
    load_row(a, first, t, mA, s0[0]);
    load_row(a, first, t, mB, s0[1]);
  }
  // the tables: one group of one row per thread and pass. Slot j of a group holds the B registers
  // of its parts 2j and 2j + 1 (.x, .y: part 2j; .z, .w: part 2j + 1), then per row and group
  // {sum(x), M sum(x')} (x' as rounded into the table)
  for (uint32_t e = threadIdx.x; e < NR * padded; e += blockDim.x) {
    const uint32_t n = e / padded, u = e % padded;
    uint32_t w[8];  // x[2k], x[2k + 1] in w[k]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 v = u < groups ? __ldg(reinterpret_cast<const uint4*>(X + n * K + int64_t(u) * 16) + h)
                                 : make_uint4(0, 0, 0, 0);
      w[4 * h] = v.x, w[4 * h + 1] = v.y, w[4 * h + 2] = v.z, w[4 * h + 3] = v.w;
    }
    float sum = 0.0f, sumq = 0.0f;
    uint32_t b[8];  // part p: b[2p] = (x[2p], x[8 + 2p]), b[2p + 1] = (x[2p + 1], x[9 + 2p]) / 4
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      b[2 * p] = gemm::cuda_wo::lo_lo(w[p], w[4 + p]);
      b[2 * p + 1] = Ops::mul(gemm::cuda_wo::hi_hi(w[p], w[4 + p]), Ops::kQuarter);
      const H* x0 = reinterpret_cast<const H*>(&w[p]);
      const H* x1 = reinterpret_cast<const H*>(&w[4 + p]);
      const H* q0 = reinterpret_cast<const H*>(&b[2 * p]);
      const H* q1 = reinterpret_cast<const H*>(&b[2 * p + 1]);
      sum += (to_f32(x0[0]) + to_f32(x0[1])) + (to_f32(x1[0]) + to_f32(x1[1]));
      sumq += (to_f32(q0[0]) + to_f32(q0[1])) + (to_f32(q1[0]) + to_f32(q1[1]));
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
      xs[n * 2 * padded + xs_slot(u, j)] = make_uint4(b[4 * j], b[4 * j + 1], b[4 * j + 2], b[4 * j + 3]);
    xsum[e] = make_float2(sum, Ops::kMagicF * sumq);
  }
  if (threadIdx.x == 0) xs[NR * 2 * padded] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  float yA[NR], yB[NR];  // rows g, g + 8 x activation rows
#pragma unroll
  for (int n = 0; n < NR; ++n) yA[n] = yB[n] = 0.0f;

  // The 2-bit pass: every group as a 2-bit one, the 4-bit groups' scale bytes zeroed (their codes
  // words hold their hi bits: times scale 0 they add nothing; the 4-bit pass below adds them).
  // Lane (g', t) supplies B column g': lane t's own k slots when g' / 2 == t (of activation row
  // g' % 2 for two rows; both columns hold the one row otherwise), else the zero slot, so that B
  // is block-diagonal and lane (g, t)'s accumulators hold its own group's sums for rows g and g +
  // 8: c[0], c[2] with one activation row, c[0..1], c[2..3] with two (row n in column 2t + n).
  const uint32_t xbase = (g >> 1) == t ? (NR == 2 ? (g & 1) * 2 * padded : 0u) : NR * 2 * padded;
  const bool mine = (g >> 1) == t;
  auto multiply = [&](uint32_t s, const RowStage (&st)[2]) {
    // per row: its 2-bit groups' scale bytes, sums sc (sum - P) and mc sum(x) over the lane's four
    // groups (one second-order block: B >= 4), times [d, dm] once
    uint32_t sb[2];
    float ys[2][NR], ym[2][NR];
    const uint32_t b0 = (s & 1u) * kStepGroups + kLaneGroups * t;  // the groups' first bit in the map word
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sb[r] = st[r].sb & ~byte_mask4((st[r].mw >> b0) & 0xFu);
#pragma unroll
      for (int n = 0; n < NR; ++n) ys[r][n] = ym[r][n] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kLaneGroups; ++i) {
      const uint32_t u = s * kStepGroups + kLaneGroups * t + i;  // the lane's group
      const uint32_t wa = gemm::cuda_wo::word_of(st[0].c, i), wb = gemm::cuda_wo::word_of(st[1].c, i);
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint4 xq = xs[mine ? xbase + xs_slot(u, j) : xbase];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int sh = 4 * (2 * j + h);
          const uint32_t pa = wa >> sh, pb = wb >> sh;
          const uint32_t ar[4] = {and_or(pa, kF0, Ops::kMagic), and_or(pb, kF0, Ops::kMagic), and_or(pa, kF1, Ops::kMagic),
                                  and_or(pb, kF1, Ops::kMagic)};
          Ops::mma(c, ar, h ? xq.z : xq.x, h ? xq.w : xq.y);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float sc = static_cast<float>((sb[r] >> (8 * i)) & 15u);
        const float mc = static_cast<float>((sb[r] >> (8 * i + 4)) & 15u);
#pragma unroll
        for (int n = 0; n < NR; ++n) {
          const float2 xg = xsum[n * padded + u];
          ys[r][n] = fmaf(sc, c[2 * r + n] - xg.y, ys[r][n]);
          ym[r][n] = fmaf(mc, xg.x, ym[r][n]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float d = fp16_bits_to_fp32(static_cast<uint16_t>(st[r].so));
      const float dm = fp16_bits_to_fp32(static_cast<uint16_t>(st[r].so >> 16));
      float* y = r ? yB : yA;
#pragma unroll
      for (int n = 0; n < NR; ++n) y[n] = fmaf(-dm, ym[r][n], fmaf(d, ys[r][n], y[n]));
    }
  };
  for (uint32_t s = first; s < end; s += 2) {  // warp-uniform
    if (s + 1 < end) {
      load_row(a, s + 1, t, mA, s1[0]);
      load_row(a, s + 1, t, mB, s1[1]);
    }
    multiply(s, s0);
    if (s + 2 < end) {
      load_row(a, s + 2, t, mA, s0[0]);
      load_row(a, s + 2, t, mB, s0[1]);
    }
    if (s + 1 < end) multiply(s + 1, s1);
  }

  // The 4-bit pass: the 4-bit groups of the warp's range on the CUDA cores, one per lane and
  // round. Lane (g, t) takes row g (t < 2) or g + 8 (t >= 2), and of that row's 4-bit groups in
  // the range every other one (t % 2 the first), so that its sums join yA or yB and the quad's
  // reduction below adds them in a fixed order. It walks the row's map words in order and takes
  // the slots in lo / mc4 one after the other (clamped to the row: a map that breaks the counts,
  // which the callers rule out with check_map_cuda, reads inside it). A group's 16 codes come out
  // of the decode above as exact 16-bit pairs 4^f q (2 HFMA2 from the hi and lo fields), its
  // activations are the table's B registers (x' = x / 4^f): sum(q x) = sum(4^f q x') in float32.
  if (a.n4_row > 0 && first < end) {  // warp-uniform
    const uint32_t G = groups, g0 = first * kStepGroups, g1 = min(end * kStepGroups, G);
    const uint32_t w0 = g0 / kMapBits, wlast = (g1 - 1) / kMapBits;
    const uint32_t m4 = t < 2 ? mA : mB;
    const uint32_t* codes32 = reinterpret_cast<const uint32_t*>(a.codes) + m4 * G;
    const uint8_t* scales8 = reinterpret_cast<const uint8_t*>(a.scales) + m4 * G;
    const uint32_t* rm = a.map + m4 * a.mw;
    const uint32_t* lo = a.lo + m4 * a.n4_row;
    const uint8_t* mc4 = a.mc4 + m4 * a.n4_row;
    const uint32_t* so4 = a.so4 + m4 * a.nt;
    auto word_bits = [&](uint32_t wi) {  // map word wi of the row, restricted to [g0, g1)
      uint32_t v = __ldg(rm + wi);
      if (wi == w0) v &= ~0u << (g0 % kMapBits);
      if (wi == wlast && g1 % kMapBits) v &= (1u << (g1 % kMapBits)) - 1u;
      return v;
    };
    Walk w;
    {
      constexpr uint32_t kTileWords = kTileGroups / kMapBits;
      uint32_t n = (w0 / kTileWords) * a.n4_full;
      for (uint32_t i = w0 & ~(kTileWords - 1); i < w0; ++i) n += __popc(__ldg(rm + i));
      w.wi = w0;
      w.bits = word_bits(w0);
      w.slot = n + __popc(__ldg(rm + w0) & ((1u << (g0 % kMapBits)) - 1u));
    }
    // the walk's next 4-bit group: its column and slot
    auto take = [&](uint32_t& c, uint32_t& slot) {
      while (w.bits == 0 && w.wi < wlast) w.bits = word_bits(++w.wi);
      if (w.bits == 0) return false;
      c = w.wi * kMapBits + __ffs(w.bits) - 1;
      w.bits &= w.bits - 1u;
      slot = min(w.slot++, a.n4_row - 1);
      return true;
    };
    auto fetch = [&](Four& f) {
      uint32_t slot = 0, c2, s2;
      f.has = take(f.c, slot);
      if (f.has) {
        f.hi = __ldg(codes32 + f.c);
        f.sc = __ldg(scales8 + f.c);
        f.lo = __ldg(lo + slot);
        f.mc = __ldg(mc4 + slot);
        f.so4 = __ldg(so4 + f.c / kTileGroups);
        take(c2, s2);  // the other lane's
      }
    };
    const uint32_t k4 = Ops::splat(4.0f), kOff = Ops::splat(-5.0f * Ops::kMagicF);
    auto four = [&](const Four& f, float (&y)[NR]) {
      if (!f.has) return;
      uint32_t qp[8];  // 4^f q of the table's B register pairs, exact
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const uint32_t ph = f.hi >> (4 * p), pl = f.lo >> (4 * p);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t mask = e ? kF1 : kF0;
          // 4 (M + 4^f hi) - 5 M = 4^f 4 hi - M, then + 4 (M / 4 + 4^f lo / 4) = 4^f (4 hi + lo)
          const uint32_t h4 = Ops::fma(and_or(ph, mask, Ops::kMagic), k4, kOff);
          qp[2 * p + e] = Ops::fma(and_or(pl, mask, Ops::kMagic4), k4, h4);
        }
      }
      const float se = fp16_bits_to_fp32(static_cast<uint16_t>(f.so4)) * static_cast<float>(f.sc);
      const float me = fp16_bits_to_fp32(static_cast<uint16_t>(f.so4 >> 16)) * static_cast<float>(f.mc);
#pragma unroll
      for (int n = 0; n < NR; ++n) {
        uint32_t bx[8];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint4 v = xs[n * 2 * padded + xs_slot(f.c, j)];
          bx[4 * j] = v.x, bx[4 * j + 1] = v.y, bx[4 * j + 2] = v.z, bx[4 * j + 3] = v.w;
        }
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float2 q = pair_to_float2<H>(qp[k]), x = pair_to_float2<H>(bx[k]);
          sum = fmaf(q.x, x.x, fmaf(q.y, x.y, sum));
        }
        y[n] = fmaf(-me, xsum[n * padded + f.c].x, fmaf(se, sum, y[n]));
      }
    };
    if (t & 1) {  // the other lane of the row takes the first one
      uint32_t c2, s2;
      take(c2, s2);
    }
    float y4[NR] = {};
    Four fa, fb;  // the next round's loads in flight while one multiplies
    fetch(fa);
    while (__any_sync(0xFFFFFFFFu, fa.has)) {
      fetch(fb);
      four(fa, y4);
      if (!__any_sync(0xFFFFFFFFu, fb.has)) break;
      fetch(fa);
      four(fb, y4);
    }
#pragma unroll
    for (int n = 0; n < NR; ++n) {
      yA[n] += t < 2 ? y4[n] : 0.0f;
      yB[n] += t < 2 ? 0.0f : y4[n];
    }
  }

  // the quad's lanes (t = 0..3) in a fixed order, then the warps
#pragma unroll
  for (int n = 0; n < NR; ++n) {
    yA[n] += __shfl_xor_sync(0xFFFFFFFFu, yA[n], 1);
    yB[n] += __shfl_xor_sync(0xFFFFFFFFu, yB[n], 1);
    yA[n] += __shfl_xor_sync(0xFFFFFFFFu, yA[n], 2);
    yB[n] += __shfl_xor_sync(0xFFFFFFFFu, yB[n], 2);
    if (t == 0) {
      red[warp][n][g] = yA[n];
      red[warp][n][g + 8] = yB[n];
    }
  }
  __syncthreads();
  if (threadIdx.x < NR * gemm::cuda_wo::kMmaRows) {
    const int n = threadIdx.x / gemm::cuda_wo::kMmaRows, r = threadIdx.x % gemm::cuda_wo::kMmaRows;
    float v = 0.0f;
    for (int w = 0; w < nwarps; ++w) v += red[w][n][r];
    if (m0 + r < M) gemm::cuda_wo::store_out(v, bias, m0 + r, &Y[n * M + m0 + r]);
  }
}

// Bytes of the kernel's shared tables for K values and nr activation rows: whole steps of groups,
// two 16-byte slots and two float32 sums per row and group, one zero slot.
inline size_t xs_bytes(int64_t K, int64_t nr) {
  const int64_t groups = (K / 16 + kStepGroups - 1) / kStepGroups * kStepGroups;
  return size_t(nr * groups) * (2 * 16 + 8) + 16;
}

// Whether the kernel takes this call: one or two activation rows, groups of 16 values, scale
// blocks of at least four groups, K a multiple of 64 (whole four-group chunks, 16-byte aligned
// rows of codes) and at most 20480, tables of at most 96 KB (sm_86's shared memory per CTA; two
// rows of K up to 19456), code words 16-byte and scale bytes 4-byte aligned.
constexpr size_t kMaxTableBytes = 96 * 1024;
inline bool supports(const ConstBuffers& q, const Dims& d, int64_t N) {
  return (N == 1 || N == 2) && d.group_size == 16 && d.scale_block >= 4 && d.K % 64 == 0 && d.K <= 20480 &&
         xs_bytes(d.K, N) <= kMaxTableBytes && cuda::aligned16(q.codes) &&
         (reinterpret_cast<uintptr_t>(q.scales) & 3u) == 0;
}

// Launches the kernel on `stream` (the caller checked supports() and the dims).
template <class H>
void launch(const ConstBuffers& q, const Dims& d, const H* X, int64_t N, H* Y, const H* bias, void* stream) {
  const int64_t M = d.rows;
  if (M <= 0 || d.K <= 0) return;
  const Args a{reinterpret_cast<const uint4*>(q.codes),
               reinterpret_cast<const uint32_t*>(q.scales),
               reinterpret_cast<const uint32_t*>(q.so),
               q.map,
               q.lo,
               q.mc4,
               reinterpret_cast<const uint32_t*>(q.so4),
               static_cast<uint32_t>(d.groups_per_row() / kLaneGroups),
               static_cast<uint32_t>(d.blocks_per_row()),
               static_cast<uint32_t>(d.map_words()),
               static_cast<uint32_t>(d.tiles_per_row()),
               static_cast<uint32_t>(d.n4_row()),
               static_cast<uint32_t>(d.n4_full),
               gemm::log2_exact(d.scale_block)};
  const dim3 grid(cuda::grid_for(M, gemm::cuda_wo::kMmaRows));
  // about 2048 warps over the device, as the driver's launcher (weight_only_mma_cuda.cuh), never
  // fewer than two steps per warp
  const int64_t steps = (d.K / 16 + kStepGroups - 1) / kStepGroups;
  int warps = 1;
  while (warps < kWarps && int64_t(grid.x) * warps < 2048 && warps * 2 <= steps) warps *= 2;
  auto go = [&](auto kernel) {
    const size_t smem = xs_bytes(d.K, N);
    if (smem > 46 * 1024) cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel));  // (two rows)
    kernel<<<grid, warps * 32, smem, cuda::stream(stream)>>>(a, X, d.K, M, Y, bias);
  };
  if (N == 2) go(weight_only_tiled_gemv<H, 2>);
  else go(weight_only_tiled_gemv<H, 1>);
  cuda::check_launch("mixed2bit tiled GEMV");
}

}  // namespace gemv
}  // namespace qf::mixed2bit::tiled
