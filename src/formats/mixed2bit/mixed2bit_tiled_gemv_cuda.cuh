// mixed2bit layout "tiled" (mixed2bit_tiled.h): the GEMV for one or two activation rows (decode
// steps, N <= 2) for groups of 16 values, 16-bit activations, sm_80+, written for the layout instead of through the
// shared tensor-core driver's per-unit policy (mixed2bit_tiled_gemm_cuda.cu, which still takes
// every other case).
//
// Why a kernel of its own: through the driver a lane fetches one 16-value group at a time (its
// codes word, scales byte and second-order pair as three loads with their own 64-bit address
// arithmetic, plus the map-word state) and turns every group's two scales into 16-bit splats for
// an HFMA2 per weight pair, which Nsight Compute counted at about 11 instructions per weight
// (benchmarks/README.md, "mixed2bit's tiled layout ... On the H200"). Here:
// - a lane takes four consecutive groups of each of its two rows per step, which the layout
//   stores contiguously: one 16-byte load of their codes, one 4-byte load of their scale bytes,
//   one second-order pair (a block of B >= 4 groups holds the four), one so4 pair (a tile of 256
//   groups holds them) and their four map bits in one word (a step's 16 groups lie in one
//   32-group word); only a 4-bit group loads more (its lo word and mc4 byte, at the slot its map
//   bits give, with predicated loads instead of branches);
// - the tensor cores multiply the exact codes q (0..15 in fp16 / bf16), and each group's scales
//   are applied once to its sum in float32: w . x = s_eff sum(q x) - m_eff sum(x), with sum(x) per
//   group precomputed once per CTA. For that every lane must get its own group's sum out of the
//   mma: B is block-diagonal (columns 2t and 2t + 1 hold the activations of lane t's k slots and
//   zeros elsewhere: lanes (g', t) with g' / 2 != t read a zero slot), so lane (g, t)'s
//   accumulators hold exactly its own group's sums for rows g and g + 8: c[0], c[2] with one
//   activation row (which both columns hold), c[0..1], c[2..3] with two (row n in column 2t + n,
//   so a second row costs no mma and no decode, only its table and its epilogue). The decode
//   is then two instructions per weight pair (field into the magic, subtract it) instead of
//   five or six, and no 16-bit scale splats.
//
// Work split, as the driver's one-row kernel (weight_only_mma_cuda.cuh): a CTA owns 16 weight
// rows and its warps split the row's steps (16 groups, 256 values) into contiguous runs; lane
// (g, t) takes rows g and g + 8 and groups 4t .. 4t + 3 of each step. The CTA first writes X's
// rows into shared memory in mma order, the B registers of a group's four mma in two 16-byte slots.
// The weights of the next step are loaded while the current one is multiplied (two register
// stages).
//
// Numerics: as the float32 driver (weight_only_cuda.cuh), not the tensor-core one: the weight is
// never rounded to 16 bits; per group s_eff = d16 * sc and m_eff = dm16 * mc (the format's
// float32 products), sum(q x) from the tensor cores in float32, sum(x) in float32 in a fixed
// order; each lane's groups, then the quad's lanes, then the warps added in a fixed order
// (deterministic); one rounding of Y.
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

// A row's place in its map: word wi (32 groups), that word and the next (loaded a word ahead),
// and the slot of the row's first 4-bit group in word wi (its tile's first slot plus the 4-bit
// groups of the tile's earlier words); the row's offsets into each buffer, in elements.
struct Row {
  uint32_t wi, word, next, slot0;
  uint32_t oq, oso, oso4, omap, olo;
};

// One row's loaded registers for one step (nothing computed from them: see weight_only_policy_cuda.cuh).
struct RowStage {
  uint4 c;                                    // four code words
  uint32_t sb;                                // four scale bytes (0 past the row: zero weights)
  uint32_t so;                                // the 2-bit groups' [d, dm]
  uint32_t so4;                               // the 4-bit groups' [d, dm]
  uint32_t bits;                              // the four groups' map bits (0 past the row)
  uint32_t lo[kLaneGroups], mc[kLaneGroups];  // a 4-bit group's lo word and mc4 byte, else 0
};

// *p when `pred`, else 0, as one predicated load (no branch: a lane's 4-bit groups differ from its
// neighbours').
__device__ __forceinline__ uint32_t ldg_u32_if(bool pred, const uint32_t* p) {
  uint32_t v;
  asm("{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\nmov.b32 %0, 0;\n@q ld.global.nc.u32 %0, [%1];\n}\n"
      : "=r"(v)
      : "l"(p), "r"(static_cast<int>(pred)));
  return v;
}
__device__ __forceinline__ uint32_t ldg_u8_if(bool pred, const uint8_t* p) {
  uint32_t v;
  asm("{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\nmov.b32 %0, 0;\n@q ld.global.nc.u8 %0, [%1];\n}\n"
      : "=r"(v)
      : "l"(p), "r"(static_cast<int>(pred)));
  return v;
}

__device__ __forceinline__ Row row_at(const Args& a, uint32_t m, uint32_t wi) {
  constexpr uint32_t kTileWords = kTileGroups / kMapBits;
  Row r;
  r.oq = m * a.G4;
  r.oso = m * a.nb;
  r.oso4 = m * a.nt;
  r.omap = m * a.mw;
  r.olo = m * a.n4_row;
  const uint32_t* rm = a.map + r.omap;
  uint32_t n = (wi / kTileWords) * a.n4_full;
  for (uint32_t i = wi & ~(kTileWords - 1); i < wi; ++i) n += __popc(__ldg(rm + i));
  r.wi = wi;
  r.word = __ldg(rm + wi);
  r.next = wi + 1 < a.mw ? __ldg(rm + wi + 1) : 0u;
  r.slot0 = n;
  return r;
}

// Step s of a row into st (lane quad position t). A warp's steps are consecutive and step s lies
// in map word s / 2, so the word moves forward by at most one per step.
__device__ __forceinline__ void load_row(const Args& a, uint32_t s, int t, Row& r, RowStage& st) {
  const uint32_t q = s * (kStepGroups / kLaneGroups) + t;  // the lane's chunk of four groups
  const bool ok = q < a.G4;
  const uint32_t qc = ok ? q : a.G4 - 1, c0 = qc * kLaneGroups;
  st.c = __ldg(a.codes + (r.oq + qc));
  st.sb = ok ? __ldg(a.scales + (r.oq + qc)) : 0u;
  st.so = __ldg(a.so + (r.oso + (c0 >> a.bshift)));
  st.so4 = __ldg(a.so4 + (r.oso4 + c0 / kTileGroups));
  const uint32_t wi = s * kStepGroups / kMapBits;
  if (wi != r.wi) {  // the next word (warp-uniform); a tile's first word restarts the slot count
    constexpr uint32_t kTileWords = kTileGroups / kMapBits;
    r.slot0 = wi % kTileWords ? r.slot0 + __popc(r.word) : (wi / kTileWords) * a.n4_full;
    r.word = r.next;
    r.next = wi + 1 < a.mw ? __ldg(a.map + (r.omap + wi + 1)) : 0u;
    r.wi = wi;
  }
  const uint32_t b0 = c0 % kMapBits;
  st.bits = ok && a.n4_row > 0 ? (r.word >> b0) & 0xFu : 0u;
  // slots: the row's 4-bit groups before each, clamped to the row (a map that breaks the counts,
  // which the callers rule out with check_map_cuda, then reads inside the row)
  const uint32_t first = r.slot0 + __popc(r.word & ((1u << b0) - 1u)), last = a.n4_row - 1;
#pragma unroll
  for (int i = 0; i < kLaneGroups; ++i) {
    const bool is4 = (st.bits >> i) & 1u;
    uint32_t slot = first + (i ? __popc(st.bits & ((1u << i) - 1u)) : 0u);
    slot = r.olo + (slot < last ? slot : last);
    st.lo[i] = ldg_u32_if(is4, a.lo + slot);
    st.mc[i] = ldg_u8_if(is4, a.mc4 + slot);
  }
}

// The 16 codes of group i of a row stage, half j (values 8j .. 8j + 7), as exact 16-bit pairs
// (q of values 8j + k, 8j + k + 4 for k = 0..3; xpair_lo_first's order). A byte permute puts the
// 2-bit fields of values 8j .. 8j + 3 in the low half and 8j + 4 .. 8j + 7 in the high half
// (field k at bits 2k); a 4-bit group's value is hi << 2 | lo. The fields of even k go into one
// word and those of odd k into another, a 4-bit group's hi fields shifted up by 2 next to its lo
// fields, so that field k is always the 4 bits at 2k of its word: one shift, one LOP3 into the
// magic's mantissa and one subtraction per pair for both kinds of group.
template <class Ops>
__device__ __forceinline__ void group_codes(const RowStage& st, int i, int j, uint32_t (&p)[4]) {
  const bool is4 = (st.bits >> i) & 1u;
  const uint32_t sel = j ? 0x3322u : 0x1100u;
  const uint32_t hw = __byte_perm(gemm::cuda_wo::word_of(st.c, i), 0u, sel) << (is4 ? 2 : 0);
  const uint32_t lw = __byte_perm(st.lo[i], 0u, sel);
  // even k: hi at bits 2k + 2 (4-bit) or 2k (2-bit), lo at 2k; odd k likewise (0x0330: k = 1, 3
  // shifted by 2; 0x00CC: unshifted)
  const uint32_t even = gemm::cuda_wo::and_or(hw, is4 ? 0x00CC00CCu : 0x00330033u, lw & 0x00330033u);
  const uint32_t odd = gemm::cuda_wo::and_or(hw, is4 ? 0x03300330u : 0x00CC00CCu, lw & 0x00CC00CCu);
#pragma unroll
  for (int k = 0; k < 4; ++k)
    p[k] = Ops::sub(gemm::cuda_wo::and_or((k & 1 ? odd : even) >> (2 * k), 0x000F000Fu, Ops::kMagic), Ops::kMagic);
}

// XS slot of B-register quad j of group u: the four lanes t of a quad read groups 4t + i, 128
// bytes apart; XOR-ing 2t into the slot puts their 16-byte reads in distinct bank quads. A
// permutation within each run of 8 slots.
__device__ __forceinline__ uint32_t xs_slot(uint32_t u, int j) { return (2 * u + j) ^ (((u >> 2) & 3u) << 1); }

template <class H, int NR>
__global__ void
__launch_bounds__(kWarps * 32)
    weight_only_tiled_gemv(const Args a, const H* __restrict__ X, int64_t K, int64_t M, H* __restrict__ Y,
                           const H* __restrict__ bias) {
  static_assert(NR == 1 || NR == 2, "the block-diagonal B has two columns per lane");
  using Ops = gemm::cuda_wo::PairOps<H>;
  // dynamic shared memory (the launcher's xs_bytes): per activation row and group (zero-padded
  // to whole steps) two 16-byte slots of B registers, then one zero slot, then per row and group
  // its float32 sum
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
  float* const xsum = reinterpret_cast<float*>(xs + NR * 2 * padded + 1);  // [NR][padded]

  const uint32_t wi0 = first < end ? first * kStepGroups / kMapBits : 0u;
  Row rA = row_at(a, mA, wi0), rB = row_at(a, mB, wi0);
  RowStage s0[2], s1[2];  // [row A, row B] of two steps
  if (first < end) {
    load_row(a, first, t, rA, s0[0]);
    load_row(a, first, t, rB, s0[1]);
  }
  // the tables: one group of one row per thread and pass; its 8 activation pairs in
  // xpair_lo_first's order (.x .y: the B registers of the mma of pairs 4j, 4j + 2; .z .w: 4j + 1,
  // 4j + 3), and its sum
  for (uint32_t e = threadIdx.x; e < NR * padded; e += blockDim.x) {
    const uint32_t n = e / padded, u = e % padded;
    uint32_t w[16];
    float sum = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 v = u < groups ? __ldg(reinterpret_cast<const uint4*>(X + n * K + int64_t(u) * 16) + h)
                                 : make_uint4(0, 0, 0, 0);
      w[4 * h] = v.x, w[4 * h + 1] = v.y, w[4 * h + 2] = v.z, w[4 * h + 3] = v.w;
    }
#pragma unroll
    for (int e = 0; e < 16; ++e) sum += to_f32(reinterpret_cast<const H*>(w)[e]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      using gemm::cuda_wo::xpair_lo_first;
      xs[n * 2 * padded + xs_slot(u, j)] = make_uint4(xpair_lo_first(w, 4 * j), xpair_lo_first(w, 4 * j + 2),
                                     xpair_lo_first(w, 4 * j + 1), xpair_lo_first(w, 4 * j + 3));
    }
    xsum[e] = sum;
  }
  if (threadIdx.x == 0) xs[NR * 2 * padded] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  // lane (g', t) supplies B column g': lane t's own k slots when g' / 2 == t (of activation row
  // g' % 2 for two rows; both columns hold the one row otherwise), else the zero slot
  const uint32_t xbase = (g >> 1) == t ? (NR == 2 ? (g & 1) * 2 * padded : 0u) : NR * 2 * padded;
  const bool mine = (g >> 1) == t;
  float yA[NR], yB[NR];  // rows g, g + 8 x activation rows
#pragma unroll
  for (int n = 0; n < NR; ++n) yA[n] = yB[n] = 0.0f;
  auto multiply = [&](uint32_t s, const RowStage (&st)[2]) {
    const float dA2 = fp16_bits_to_fp32(static_cast<uint16_t>(st[0].so));
    const float mA2 = fp16_bits_to_fp32(static_cast<uint16_t>(st[0].so >> 16));
    const float dA4 = fp16_bits_to_fp32(static_cast<uint16_t>(st[0].so4));
    const float mA4 = fp16_bits_to_fp32(static_cast<uint16_t>(st[0].so4 >> 16));
    const float dB2 = fp16_bits_to_fp32(static_cast<uint16_t>(st[1].so));
    const float mB2 = fp16_bits_to_fp32(static_cast<uint16_t>(st[1].so >> 16));
    const float dB4 = fp16_bits_to_fp32(static_cast<uint16_t>(st[1].so4));
    const float mB4 = fp16_bits_to_fp32(static_cast<uint16_t>(st[1].so4 >> 16));
#pragma unroll
    for (int i = 0; i < kLaneGroups; ++i) {
      const uint32_t u = s * kStepGroups + kLaneGroups * t + i;  // the lane's group
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint4 xq = xs[mine ? xbase + xs_slot(u, j) : xbase];
        uint32_t pa[4], pb[4];
        group_codes<Ops>(st[0], i, j, pa);
        group_codes<Ops>(st[1], i, j, pb);
        const uint32_t a0[4] = {pa[0], pb[0], pa[2], pb[2]}, a1[4] = {pa[1], pb[1], pa[3], pb[3]};
        Ops::mma(c, a0, xq.x, xq.y);
        Ops::mma(c, a1, xq.z, xq.w);
      }
      // c[n] = sum(q x) of row A's group with activation row n, c[2 + n] row B's (c[1], c[3]
      // repeat c[0], c[2] for one row); the group's scales in float32
      float xg[NR];
#pragma unroll
      for (int n = 0; n < NR; ++n) xg[n] = xsum[n * padded + u];
      auto apply = [&](const RowStage& r, float d2, float m2, float d4, float m4, const float* sum, float (&y)[NR]) {
        const bool is4 = (r.bits >> i) & 1u;
        const uint32_t sbyte = (r.sb >> (8 * i)) & 0xFFu;
        const float sc = static_cast<float>(is4 ? sbyte : sbyte & 15u);
        const float mc = static_cast<float>(is4 ? r.mc[i] : sbyte >> 4);
        const float se = (is4 ? d4 : d2) * sc, nme = -((is4 ? m4 : m2) * mc);
#pragma unroll
        for (int n = 0; n < NR; ++n) y[n] = fmaf(nme, xg[n], fmaf(se, sum[n], y[n]));
      };
      apply(st[0], dA2, mA2, dA4, mA4, c, yA);
      apply(st[1], dB2, mB2, dB4, mB4, c + 2, yB);
    }
  };
  for (uint32_t s = first; s < end; s += 2) {  // warp-uniform
    if (s + 1 < end) {
      load_row(a, s + 1, t, rA, s1[0]);
      load_row(a, s + 1, t, rB, s1[1]);
    }
    multiply(s, s0);
    if (s + 2 < end) {
      load_row(a, s + 2, t, rA, s0[0]);
      load_row(a, s + 2, t, rB, s0[1]);
    }
    if (s + 1 < end) multiply(s + 1, s1);
  }

  // the quad's lanes (t = 0..3: their groups of each step) in a fixed order, then the warps
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
// two 16-byte slots and a float32 sum per row and group, one zero slot.
inline size_t xs_bytes(int64_t K, int64_t nr) {
  const int64_t groups = (K / 16 + kStepGroups - 1) / kStepGroups * kStepGroups;
  return size_t(nr * groups) * (2 * 16 + 4) + 16;
}

// Whether the kernel takes this call: one or two activation rows, groups of 16 values, scale
// blocks of at least four groups, K a multiple of 64 (whole four-group chunks, 16-byte aligned
// rows of codes) and at most 20480 (the tables: 46 KB per row), code words 16-byte and scale
// bytes 4-byte aligned.
inline bool supports(const ConstBuffers& q, const Dims& d, int64_t N) {
  return (N == 1 || N == 2) && d.group_size == 16 && d.scale_block >= 4 && d.K % 64 == 0 && d.K <= 20480 &&
         cuda::aligned16(q.codes) && (reinterpret_cast<uintptr_t>(q.scales) & 3u) == 0;
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
