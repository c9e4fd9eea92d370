// Weight-only GEMV / small-N GEMM on tensor cores for 16-bit activations (fp16 or bf16): Y [N, M]
// = X [N, K] . W^T with W [M, K] packed in a 4-bit format (nf4, int4, q4_0; or mixed2bit's
// 2- and 4-bit groups, whose policy subtracts its offset with an HFMA2) and decoded in
// registers straight into the A fragments of mma.sync.m16n8k16 (fp32 accumulate), the way
// Marlin and TensorRT-LLM's weight-only kernels decode: a nibble is OR-ed into the mantissa of
// a 16-bit "magic" float (1024 + q in fp16, 128 + q in bf16), the magic and the zero point are
// subtracted exactly (HSUB2), and the scale multiplied in (HMUL2): about 2 instructions per
// weight instead of ~5 for the float32 kernel of weight_only_cuda.cuh, and the activation rows
// ride along in the mma's N dimension, so N <= 16 costs one decode.
//
// Numerics: each weight is rounded to the activations' 16-bit type before the product (as
// dequantize(q, dtype) followed by F.linear would round it; a weight beyond that type's range
// becomes inf there too); products and sums are float32; one rounding of Y at the end.
//
// Work split: a CTA owns 16 weight rows (N > 8: RG groups of 16, each activation register used
// for all of them) and up to 16 activation rows (grid.y covers more);
// its warps split K into steps of 4 U units of Fmt::kUnit values (32, or mixed2bit's 16; step s
// goes to warp s mod warps, or with Fmt::kContiguousSteps each warp takes one contiguous run of
// steps) and add their partial sums in shared memory at the end, in a fixed order
// (deterministic). In a step, lane (g, t) = (lane / 4, lane % 4) loads U units of rows g and
// g + 8 (16-byte loads: whole sectors per quad) and activation row g (+ 8) at the same
// positions. mma's k order need
// not be the memory order, only the same for A and B: an mma of lane (g, t) takes two pairs of
// its unit, each a half2 of two elements that the format decodes together (Fmt::pairs), and
// the activations of the same two elements (Fmt::xpair, one byte permute). Needs sm_80 (the host
// launcher checks; the mma is compiled empty below).
//
// 2..8 activation rows (from Fmt::kStagedXMinRows): each warp copies its next step's activation
// rows into shared memory with cp.async while it multiplies the current step (XT, two stages per
// warp), and lanes read their units from there instead of from global memory.
//
// One activation row (N = 1, the decode GEMV; and two where Fmt::kTableXMaxRows says so): the CTA
// first writes X's rows into shared memory already in mma order (XS: per unit and j, the B
// registers of its two mma, so a lane reads them with one 16-byte LDS instead of loading the
// unit's activations from global memory and permuting them with 2 PRMT per mma; zeros past K, so
// lanes past the end need no test). The weights of the warp's first step are requested before
// that fill, so the two latencies overlap. Why: on the H200 (int4 g128, N = 1) the x loads right
// before their PRMT were the largest stall of the kernel (Nsight Compute source view), and the
// table made int4 faster (benchmarks/README.md, "Design measurements behind kernel choices").
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "common/cp_async_cuda.cuh"
#include "common/cuda_utils.cuh"
#include "common/fp16.h"

namespace qf::gemm::cuda_wo {

constexpr int kMmaRows = 16;     // weight rows per CTA: mma's M
constexpr int kMmaMaxWarps = 8;  // warps per CTA splitting K

// 16-bit pair arithmetic on raw 32-bit registers, one specialization per activation type.
template <class H>
struct PairOps;

using cuda::and_or;  // (a & mask) | c in one LOP3

// The per-unit constants of nibble_pairs: magic + zero (and magic + 16 zero), the scale pair.
struct NibbleConsts {
  uint32_t zf, zf16, s;
};

template <>
struct PairOps<half_t> {
  static constexpr uint32_t kMagic = 0x64006400u;  // 1024.0 in both halves: q in the low mantissa bits
  static constexpr float kMagicF = 1024.0f;
  static constexpr uint32_t kMagic4 = 0x5C005C00u;   // kMagic / 4 (256.0): its unit last place is 1/4
  static constexpr uint32_t kQuarter = 0x34003400u;  // 0.25
  // fp16 has 10 mantissa bits, so a nibble at bits 4..7 decodes too, as 1024 + 16 q: pairs 1 and
  // 3 come out as 16 (q - z) s (exact up to the one rounding) and the kernel divides their sums
  // by 16 in float32. Saves a shift per pair.
  static constexpr bool kX16 = true;
  static __device__ __forceinline__ NibbleConsts nibble_consts(float zero, uint32_t scale2) {
    return {splat(kMagicF + zero), splat(kMagicF + 16.0f * zero), scale2};
  }
  // p[i] = (nibble i of each half of w - zero) * scale (nibble i at bits 4i and 16 + 4i), odd i
  // times 16.
  static __device__ __forceinline__ void nibble_pairs(uint32_t w, const NibbleConsts& k, uint32_t (&p)[4]) {
    const uint32_t w8 = w >> 8;
    p[0] = mul(sub(and_or(w, 0x000F000Fu, kMagic), k.zf), k.s);
    p[1] = mul(sub(and_or(w, 0x00F000F0u, kMagic), k.zf16), k.s);
    p[2] = mul(sub(and_or(w8, 0x000F000Fu, kMagic), k.zf), k.s);
    p[3] = mul(sub(and_or(w8, 0x00F000F0u, kMagic), k.zf16), k.s);
  }
  static __device__ __forceinline__ __half2 h(uint32_t v) { return *reinterpret_cast<__half2*>(&v); }
  static __device__ __forceinline__ uint32_t u(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
  static __device__ __forceinline__ uint32_t sub(uint32_t a, uint32_t b) { return u(__hsub2(h(a), h(b))); }
  static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) { return u(__hmul2(h(a), h(b))); }
  static __device__ __forceinline__ uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
    return u(__hfma2(h(a), h(b), h(c)));
  }
  static __device__ __forceinline__ uint32_t splat(float f) { return u(__float2half2_rn(f)); }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return u(__floats2half2_rn(lo, hi)); }
  // an fp16 scale (its bits in the low half) in both halves: no conversion
  static __device__ __forceinline__ uint32_t scale_fp16(uint32_t bits) { return __byte_perm(bits, 0, 0x1010); }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
};

// p[i] = (nibble i of each half of w - zero) * scale, each nibble shifted down to bits 0..3 first
// (the decode of Ops types whose magic leaves no room for 16 q).
template <class Ops>
__device__ __forceinline__ void shifted_nibble_pairs(uint32_t w, const NibbleConsts& k, uint32_t (&p)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = Ops::mul(Ops::sub(and_or(w >> (4 * i), 0x000F000Fu, Ops::kMagic), k.zf), k.s);
}

template <>
struct PairOps<bf16_t> {
  static constexpr uint32_t kMagic = 0x43004300u;  // 128.0: bf16 has 7 mantissa bits, q < 16 fits
  static constexpr float kMagicF = 128.0f;
  static constexpr uint32_t kMagic4 = 0x42004200u;   // kMagic / 4 (32.0): its unit last place is 1/4
  static constexpr uint32_t kQuarter = 0x3E803E80u;  // 0.25
  static constexpr bool kX16 = false;                // 7 mantissa bits: no room for 16 q
  static __device__ __forceinline__ NibbleConsts nibble_consts(float zero, uint32_t scale2) {
    return {splat(kMagicF + zero), 0u, scale2};
  }
  static __device__ __forceinline__ void nibble_pairs(uint32_t w, const NibbleConsts& k, uint32_t (&p)[4]) {
    shifted_nibble_pairs<PairOps>(w, k, p);
  }
  static __device__ __forceinline__ __nv_bfloat162 h(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }
  static __device__ __forceinline__ uint32_t u(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
  static __device__ __forceinline__ uint32_t sub(uint32_t a, uint32_t b) { return u(__hsub2(h(a), h(b))); }
  static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) { return u(__hmul2(h(a), h(b))); }
  static __device__ __forceinline__ uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
#if __CUDA_ARCH__ >= 800
    return u(__hfma2(h(a), h(b), h(c)));
#else
    return u(__hadd2(__hmul2(h(a), h(b)), h(c)));  // (never run: the kernel needs sm_80)
#endif
  }
  static __device__ __forceinline__ uint32_t splat(float f) { return u(__float2bfloat162_rn(f)); }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return u(__floats2bfloat162_rn(lo, hi)); }
  static __device__ __forceinline__ uint32_t scale_fp16(uint32_t bits) {
    return splat(fp16_bits_to_fp32(static_cast<uint16_t>(bits)));
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
};

// (x_a.lo, x_b.lo) and (x_a.hi, x_b.hi) of two registers holding 16-bit pairs.
__device__ __forceinline__ uint32_t lo_lo(uint32_t a, uint32_t b) { return __byte_perm(a, b, 0x5410); }
__device__ __forceinline__ uint32_t hi_hi(uint32_t a, uint32_t b) { return __byte_perm(a, b, 0x7632); }

// Fmt provides, besides what weight_only_cuda.cuh asks for (kUnit = 16 or 32, row, Unit, load):
//   static constexpr bool kContiguousSteps;  (see the work split above)
//   static constexpr int kMaxRowGroups;  1, 2 or 4: the most 16-row groups a CTA of the two-tile
//       kernel (N > 8) may take (see the launcher; mixed2bit's loads measured slower with more)
//   static constexpr int kStagedXMinRows;  from how many activation rows the one-tile kernel (N <= 8)
//       stages X in shared memory (XT; 9: never), as measured for the format
//   static constexpr int kTableXMaxRows;  1 or 2: up to how many rows X goes into the activation
//       table (XS; it takes precedence over XT), as measured for the format
//   static constexpr bool kLut;  (whether it decodes through a 256-entry pair table; if so:)
//   template <class Ops> __device__ uint32_t lut_entry(int byte) const;
//   template <class Ops> __device__ void pairs(const uint32_t (*lut)[32], int lane, const Unit&, int j,
//                                              uint32_t (&p)[4]) const;
//       pairs 4j .. 4j+3 of the unit (scale applied; j < kUnit / 8), each two elements as a 16-bit pair
//   template <class Ops> __host__ __device__ static constexpr bool odd_x16();  whether pairs 4j+1, 4j+3 come times 16
//   static __device__ uint32_t xpair(const uint32_t (&x)[16], int p);
//       the activations of pair p's two elements from x = the unit's activations as pairs
//   static constexpr bool kPairLoad; if kPairLoad: struct Pair, bool pair_load_ok() const (host),
//       Pair load_pair(RowState&, int64_t u) (units u, u + 1, u even) and
//       pairs_in_pair<Ops>(const Pair&, int i, int j, uint32_t (&p)[4]) (pairs of unit u + i);
//       optionally a second way to load a pair (the one-row kernel takes it where the host says so):
//       struct AlignedPair, bool aligned_pair_ok() const (host), load_aligned_pair and
//       pairs_in_aligned_pair, as above
// Units hold raw loaded registers: work on them waits for the load, so it belongs in pairs().
// PAIR, what a lane loads per row and step: 0 the format's Unit, 1 its Pair of units, 2 its
// AlignedPair.
template <class Fmt, int PAIR>
struct LoadedUnit {
  using type = typename Fmt::Unit;
};
template <class Fmt>
struct LoadedUnit<Fmt, 1> {
  using type = typename Fmt::Pair;
};
template <class Fmt>
struct LoadedUnit<Fmt, 2> {
  using type = typename Fmt::AlignedPair;
};
template <class Fmt, class = void>
struct HasAlignedPair : std::false_type {};
template <class Fmt>
struct HasAlignedPair<Fmt, std::void_t<typename Fmt::AlignedPair>> : std::true_type {};

// A lane's loaded registers for unit uc of one weight row: the format's Unit, or with PAIR its Pair
// (or AlignedPair) of units uc, uc + 1 (uc even).
template <int PAIR, class Fmt>
__device__ __forceinline__ typename LoadedUnit<Fmt, PAIR>::type load_unit(const Fmt& f, typename Fmt::RowState& rs,
                                                                          int64_t row, int64_t uc) {
  if constexpr (PAIR == 2) return f.load_aligned_pair(rs, uc);
  else if constexpr (PAIR == 1) return f.load_pair(rs, uc);
  else return f.load(rs, row, uc, true);
}

// Pairs 4j .. 4j+3 (scale applied) of unit i of a lane's loads `ld` for one row: ld[i] per unit,
// or with PAIR unit i of ld[0].
template <class Ops, int PAIR, class Fmt, class L, int kLoads>
__device__ __forceinline__ void unit_pairs(const Fmt& f, const uint32_t (*lut)[32], int lane, const L (&ld)[kLoads],
                                           int i, int j, uint32_t (&p)[4]) {
  if constexpr (PAIR == 2) f.template pairs_in_aligned_pair<Ops>(ld[0], i, j, p);
  else if constexpr (PAIR == 1) f.template pairs_in_pair<Ops>(ld[0], i, j, p);
  else f.template pairs<Ops>(lut, lane, ld[i], j, p);
}

// XS: the table holds N = 1 or 2 activation rows; lane (g, t) takes row g & (N - 1), so columns 0
// and 1 of the mma are rows 0 and 1 (the other columns repeat them and are not stored).
// A row holds whole steps of 8 units; row 1 starts one unit after row 0's end, so that lanes
// g = 2a and 2a + 1 of one 16-byte-load phase (rows 0 and 1) read distinct bank quads (see
// xs_slot). xs_row_slots: 16-byte slots from one row to the next; xs_bytes: the table's size.
template <int kUnit>
__host__ __device__ constexpr int64_t xs_row_slots(int64_t K) {
  return ((K / kUnit + 7) / 8 * 8 + 1) * (kUnit / 8);
}
template <int kUnit>
constexpr size_t xs_bytes(int64_t N, int64_t K) {
  return size_t(N * xs_row_slots<kUnit>(K) - kUnit / 8) * 16;
}

// XS: slot of word-quad j of unit u in a row of the activation table. The four lanes t of a quad
// read units U t + i (U = 2) in one LDS; XOR-ing j with bits of u puts their four 16-byte reads in
// distinct banks (units are 64 bytes apart for kUnit = 32, 32 bytes for 16). They use half of the
// 8 bank quads; the next row, one unit further (xs_row_slots), uses the other half.
template <int kUnit>
__device__ __forceinline__ int xs_slot(int64_t u, int j) {
  constexpr int kSlots = kUnit / 8;
  return static_cast<int>(u) * kSlots + (j ^ static_cast<int>(kSlots == 4 ? (u >> 1) & 3 : (u >> 2) & 1));
}

// XT: slot of 16-byte chunk c of activation row r in a warp's stage (kRowChunks chunks per row).
// Lane (g, t) reads chunks t * kLaneChunks + (0 .. kLaneChunks - 1) of row 8 nt + g; the eight
// lanes of one 16-byte-load phase (g = 2a, 2a + 1; t = 0..3) differ in t and g & 1, so XOR-ing
// into the chunk's low bits the bits of t that lie above bit 3 of c and the row's low bit puts the
// eight reads in eight distinct bank quads (kLaneChunks = 2^B: t's low bits are already c's bits
// B.. 2 within a 128-byte line). The copies' writes stay conflict-free: a permutation within 8.
template <int kLaneChunks, int kRowChunks>
__device__ __forceinline__ int xt_slot(int r, int c) {
  constexpr int B = kLaneChunks == 2 ? 1 : kLaneChunks == 4 ? 2 : 3;
  static_assert(kLaneChunks == (1 << B) && kRowChunks == 4 * kLaneChunks, "a quad of lanes per row");
  return r * kRowChunks + (c ^ ((c >> 3) | ((r & 1) << (B - 1))));
}

// Fmt::kLut: the CTA fills its pair table, one copy per bank (lane l reads column l, so lookups
// never conflict): each entry is computed once and stored as 8 16-byte chunks of 4 copies,
// thread b starting at chunk b % 8 so that a quarter warp's stores (8 rows, one chunk each) hit 8
// distinct bank quads; ends with a barrier.
template <class Fmt, class Ops>
__device__ __forceinline__ void fill_pair_lut(const Fmt& f, uint32_t (*lut)[32]) {
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    const uint32_t v = f.template lut_entry<Ops>(b);
#pragma unroll
    for (int k = 0; k < 8; ++k) reinterpret_cast<uint4*>(lut[b])[(k + b) & 7] = make_uint4(v, v, v, v);
  }
  __syncthreads();
}

template <class Fmt, class H, int NTILES, int PAIR, bool XS, int RG, bool XT>
__global__ void
__launch_bounds__(kMmaMaxWarps * 32)
weight_only_mma_kernel(const Fmt f, const H* __restrict__ X, int64_t N, int64_t K, int64_t M, H* __restrict__ Y,
                       const H* __restrict__ bias) {
  using Ops = PairOps<H>;
  static_assert(!XS || NTILES == 1, "the activation table: the one-tile kernel (N <= 8)");
  static_assert(NTILES * (NTILES == 1 ? 2 : 1) == 2, "XT's stage size (the launcher's xt_bytes)");
  static_assert(RG == 1 || (!XS && !PAIR), "row groups: the per-unit loads of the multi-tile kernel");
  static_assert(!(XS && XT), "one activation path");
  static_assert(!XT || NTILES == 1, "XT: the one-tile kernel (measured slower at 16 rows and more)");
  // dynamic shared memory (see the launcher): XS, X's row in mma order; XT, each warp's two
  // activation stages
  extern __shared__ uint4 xs[];
  // nf4's pair table, one copy per bank: lane l reads column l, so lookups never conflict.
  __shared__ uint32_t lut[Fmt::kLut ? 256 : 1][32];
  __shared__ float red[kMmaMaxWarps][NTILES * 8][kMmaRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t m0 = int64_t(blockIdx.x) * kMmaRows * RG;
  int64_t rowA[RG], rowB[RG];  // row group r: rows m0 + 16 r + g and + 8 (clamped: rows past M are not stored)
#pragma unroll
  for (int r = 0; r < RG; ++r) {
    const int64_t a = m0 + 16 * r + g, b = a + 8;
    rowA[r] = a < M ? a : M - 1;
    rowB[r] = b < M ? b : M - 1;
  }
  const int64_t n0 = int64_t(blockIdx.y) * NTILES * 8;
  constexpr int kUnit = Fmt::kUnit;
  static_assert(kUnit == 16 || kUnit == 32, "units of 16 or 32 values");
  const int64_t units = K / kUnit;
  typename Fmt::RowState rsA[RG], rsB[RG];  // set below, once the warp's first unit is known

  // c: the products; c16: those of the pairs that Fmt decodes times 16 (odd_x16), scaled at the end
  constexpr bool kX16 = Fmt::template odd_x16<Ops>();
  float c[RG][NTILES][4], c16[RG][NTILES][4];
#pragma unroll
  for (int r = 0; r < RG; ++r)
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[r][nt][i] = c16[r][nt][i] = 0.0f;

  // A warp step takes kStepUnits consecutive 32-value units of rows g and g + 8: U per lane,
  // lane t the units t*U .. t*U+U-1 (a quad reads 64 U contiguous bytes per row). The weights of
  // the next step are loaded before this step is multiplied (two register stages, ping-pong,
  // no copies); activations are loaded when their step is multiplied (they sit in L1: every
  // warp of the SM reads the same X).
  constexpr int U = NTILES == 1 ? 2 : 1;  // two units per lane measured slower at 16 rows (177 registers)
  constexpr int kStepUnits = 4 * U;
  const int64_t steps = (units + kStepUnits - 1) / kStepUnits;
  // XS: this lane's row of the activation table
  const uint4* const xsg = xs + (XS ? (g & (N - 1)) * xs_row_slots<kUnit>(K) : 0);
  // XT (2..8 rows): the activations of a warp's step (8 rows x kStepUnits units) are copied with
  // cp.async into one of the warp's two stages while the previous step is multiplied, and lanes
  // read them from there. Read straight from global memory, a quad's units of one row span two
  // 128-byte lines per 16-byte load and a warp's load touches 16 lines (L1 wavefronts) for 512
  // bytes; from the stage, 4 (benchmarks/README.md, "Activations through shared memory").
  constexpr int kXtChunks = kStepUnits * kUnit / 8, kXtStage = NTILES * 8 * kXtChunks;
  uint4* const xt = xs + (XT ? warp * 2 * kXtStage : 0);
  // this warp's steps: `mine` of them, the k-th being step first + k * stride
  const int64_t first = Fmt::kContiguousSteps ? steps * warp / nwarps : warp;
  const int64_t stride = Fmt::kContiguousSteps ? 1 : nwarps;
  const int64_t mine = Fmt::kContiguousSteps ? steps * (warp + 1) / nwarps - first
                                             : (steps > warp ? (steps - warp + nwarps - 1) / nwarps : 0);
  // PAIR: the format reads a lane's two units in one go (Fmt::Pair, q4_0's 36 bytes as 9 words;
  // Fmt::AlignedPair, as three 16-byte loads)
  static_assert(!PAIR || U == 2, "pair loads take two units per lane");
  using Loaded = typename LoadedUnit<Fmt, PAIR>::type;
  constexpr int kLoads = PAIR ? 1 : U;
  struct Stage {
    Loaded a[RG][kLoads], b[RG][kLoads];
  };
  const H* xrow[NTILES];
  bool xok[NTILES];
#pragma unroll
  for (int nt = 0; nt < NTILES; ++nt) {
    const int64_t n = n0 + nt * 8 + g;
    xok[nt] = n < N;
    xrow[nt] = X + (xok[nt] ? n : 0) * K;
  }
  auto unit_of = [&](int64_t k, int i) { return (first + k * stride) * kStepUnits + t * U + i; };
  // XT: step k's activations into stage k & 1, one commit group per step; rows past N and units
  // past K are not copied (multiply() uses zeros there without reading the stage).
  auto stage_x = [&](int64_t k) {
    if constexpr (XT) {
      uint4* const st = xt + (k & 1) * kXtStage;
      const int64_t c0 = (first + k * stride) * kXtChunks, row_chunks = K / 8;
#pragma unroll
      for (int p = 0; p < kXtStage / 32; ++p) {
        const int idx = lane + 32 * p, r = idx / kXtChunks, c = idx % kXtChunks;
        if (n0 + r < N && c0 + c < row_chunks)
          cuda::cp_async<16>(st + xt_slot<U * kUnit / 8, kXtChunks>(r, c), X + (n0 + r) * K + (c0 + c) * 8, true);
      }
      cuda::cp_async_commit();
    }
  };
  // XT: wait for step k's stage (the next step's copies may stay in flight) and make it visible to
  // the warp; after the step, the barrier orders its reads before the copies that refill it.
  auto x_ready = [&](bool later_in_flight) {
    if constexpr (XT) {
      if (later_in_flight) cuda::cp_async_wait<1>();
      else cuda::cp_async_wait<0>();
      __syncwarp();
    }
  };
  auto x_done = [&]() {
    if constexpr (XT) __syncwarp();
  };
  auto load = [&](int64_t k, Stage& st) {
    // Lanes past the end of K read a unit of the row (the first; the last with contiguous steps,
    // whose loads only move forward) and multiply it by zero activations: no extra work on the
    // loaded registers (see the Fmt note), and a non-finite weight there is in this row's sum anyway.
#pragma unroll
    for (int r = 0; r < RG; ++r)
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int64_t u = unit_of(k, i), uc = u < units ? u : (Fmt::kContiguousSteps ? units - 1 : 0);
        st.a[r][i] = load_unit<PAIR>(f, rsA[r], rowA[r], uc);
        st.b[r][i] = load_unit<PAIR>(f, rsB[r], rowB[r], uc);
      }
  };
  auto multiply = [&](int64_t k, const Stage& st) {
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int64_t u = unit_of(k, i);
      uint32_t x[NTILES][16];  // the unit's activations as pairs (the first kUnit / 2 used)
      uint4 xq[kUnit / 8];     // XS: the unit's B registers, per j (h = 0: .x .y; h = 1: .z .w)
      if constexpr (XS) {
#pragma unroll
        for (int j = 0; j < kUnit / 8; ++j) xq[j] = xsg[xs_slot<kUnit>(u, j)];
      }
#pragma unroll
      for (int nt = 0; nt < NTILES && !XS; ++nt) {
        if (xok[nt] && u < units) {
          const uint4* xp = reinterpret_cast<const uint4*>(xrow[nt] + u * kUnit);
          const uint4* st = xt + (k & 1) * kXtStage;
#pragma unroll
          for (int q = 0; q < kUnit / 8; ++q) {
            const uint4 v = XT ? st[xt_slot<U * kUnit / 8, kXtChunks>(nt * 8 + g, (t * U + i) * (kUnit / 8) + q)]
                               : __ldg(xp + q);
            x[nt][4 * q] = v.x; x[nt][4 * q + 1] = v.y; x[nt][4 * q + 2] = v.z; x[nt][4 * q + 3] = v.w;
          }
        } else {
#pragma unroll
          for (int q = 0; q < kUnit / 2; ++q) x[nt][q] = 0u;  // zero activations: lanes past N or K add 0
        }
      }
#pragma unroll
      for (int j = 0; j < kUnit / 8; ++j)
#pragma unroll
        for (int r = 0; r < RG; ++r) {  // each activation register serves RG row groups
          uint32_t pa[4], pb[4];
          unit_pairs<Ops, PAIR>(f, lut, lane, st.a[r], i, j, pa);
          unit_pairs<Ops, PAIR>(f, lut, lane, st.b[r], i, j, pb);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // A fragment: rows g / g + 8 x k pairs (2t, 2t+1) / (2t+8, 2t+9) = our pairs h / h+2
            // (so that the odd pairs, which may be decoded times 16, share one mma)
            const uint32_t a[4] = {pa[h], pb[h], pa[h + 2], pb[h + 2]};
            if constexpr (XS) {
              Ops::mma(kX16 && h == 1 ? c16[0][0] : c[0][0], a, h ? xq[j].z : xq[j].x, h ? xq[j].w : xq[j].y);
            } else {
#pragma unroll
              for (int nt = 0; nt < NTILES; ++nt)
                Ops::mma(kX16 && h == 1 ? c16[r][nt] : c[r][nt], a, Fmt::xpair(x[nt], 4 * j + h),
                         Fmt::xpair(x[nt], 4 * j + h + 2));
            }
          }
        }
    }
  };

#pragma unroll
  for (int r = 0; r < RG; ++r) {
    rsA[r] = f.row(rowA[r], first * kStepUnits);
    rsB[r] = f.row(rowB[r], first * kStepUnits);
  }
  Stage s0, s1;
  if (mine > 0) {
    load(0, s0);
    stage_x(0);
  }
  // The pair table is filled while the first step's loads are in flight (a warp of a short row,
  // K = 4096, has only a few steps to hide the DRAM latency behind).
  if constexpr (Fmt::kLut) fill_pair_lut<Fmt, Ops>(f, lut);
  if constexpr (XS) {
    // one unit per thread and pass: its kUnit / 2 activation pairs in, kUnit / 8 slots of B
    // registers out (Fmt::xpair's order); units past K (up to whole steps) get zeros
    const int64_t padded = steps * kStepUnits, row_slots = xs_row_slots<kUnit>(K);
    for (int r = 0; r < N; ++r) {
      const H* const xr = X + r * K;
      for (int64_t u = threadIdx.x; u < padded; u += blockDim.x) {
        uint32_t w[16];
#pragma unroll
        for (int q = 0; q < kUnit / 8; ++q) {
          const uint4 v =
              u < units ? __ldg(reinterpret_cast<const uint4*>(xr + u * kUnit) + q) : make_uint4(0, 0, 0, 0);
          w[4 * q] = v.x; w[4 * q + 1] = v.y; w[4 * q + 2] = v.z; w[4 * q + 3] = v.w;
        }
#pragma unroll
        for (int j = 0; j < kUnit / 8; ++j)
          xs[r * row_slots + xs_slot<kUnit>(u, j)] = make_uint4(Fmt::xpair(w, 4 * j), Fmt::xpair(w, 4 * j + 2),
                                                                Fmt::xpair(w, 4 * j + 1), Fmt::xpair(w, 4 * j + 3));
      }
    }
    __syncthreads();
  }
  for (int64_t k = 0; k < mine; k += 2) {  // warp-uniform conditions
    if (k + 1 < mine) {
      load(k + 1, s1);
      stage_x(k + 1);
    }
    x_ready(k + 1 < mine);
    multiply(k, s0);
    x_done();
    if (k + 2 < mine) {
      load(k + 2, s0);
      stage_x(k + 2);
    }
    if (k + 1 < mine) {
      x_ready(k + 2 < mine);
      multiply(k + 1, s1);
      x_done();
    }
  }

  // C fragment: c0, c1 = row g, activation rows 2t, 2t+1; c2, c3 = row g + 8. One row group
  // at a time through the reduction buffer.
#pragma unroll
  for (int rg = 0; rg < RG; ++rg) {
    if (rg > 0) __syncthreads();  // the previous group's sums are read
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt) {
      if (kX16)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[rg][nt][i] = fmaf(c16[rg][nt][i], 0.0625f, c[rg][nt][i]);  // exact scaling
      red[warp][nt * 8 + 2 * t][g] = c[rg][nt][0];
      red[warp][nt * 8 + 2 * t + 1][g] = c[rg][nt][1];
      red[warp][nt * 8 + 2 * t][g + 8] = c[rg][nt][2];
      red[warp][nt * 8 + 2 * t + 1][g + 8] = c[rg][nt][3];
    }
    __syncthreads();
    const int64_t mg = m0 + 16 * rg;
    for (int i = threadIdx.x; i < NTILES * 8 * kMmaRows; i += blockDim.x) {
      const int n = i / kMmaRows, r = i % kMmaRows;
      float v = 0.0f;
      for (int w = 0; w < nwarps; ++w) v += red[w][n][r];
      if (n0 + n < N && mg + r < M) store_out(v, bias, mg + r, &Y[(n0 + n) * M + mg + r]);
    }
  }
}

// Launches the tensor-core kernel on `stream`. X and Y 16-byte aligned, K a multiple of 32;
// bias [M] of H, or nullptr.
template <class Fmt, class H>
void launch_weight_only_mma(const Fmt& f, const H* X, int64_t N, int64_t K, int64_t M, H* Y, const H* bias,
                            void* stream) {
  if (N <= 0 || M <= 0) return;
  const int ntiles = N > 8 ? 2 : 1;
  // Row groups (N > 8): RG 16-row groups per CTA share each activation load. The two-tile kernel
  // with one group was bound by L1 traffic for X (H200, int4 14336x4096, N = 64: L1/TEX 91% busy,
  // DRAM 6%), which RG divides; but fewer CTAs then cover M, so RG halves while the grid would
  // have fewer CTAs than the device has SMs (4096x14336 at N = 16 measured slower with RG = 4
  // than 2). Measurements: benchmarks/README.md, "Row groups".
  int rg = 1;
  if (ntiles == 2) {
    rg = Fmt::kMaxRowGroups;
    const int64_t col_ctas = cuda::grid_for(N, ntiles * 8), sms = cuda::sm_count();
    while (rg > 1 && int64_t(cuda::grid_for(M, kMmaRows * rg)) * col_ctas < sms) rg /= 2;
  }
  const dim3 grid(cuda::grid_for(M, kMmaRows * rg), cuda::grid_for(N, ntiles * 8));
  if (grid.y > 65535) throw std::invalid_argument("weight-only GEMM: too many activation rows for one launch");
  // About 2048 warps over the device (a wave of ~16 per SM at ~110 registers on a 132-SM
  // H200): more K-splitting when there are few 16-row CTAs, never more warps than steps.
  // (Measured on the H200: 1024 is slower, 4096 no faster, for int4 and mixed2bit alike.)
  const int64_t steps = (K / Fmt::kUnit + 7) / 8;  // warp steps (8 units)
  int warps = 1;
  while (warps < kMmaMaxWarps && int64_t(grid.x) * grid.y * warps < 2048 && warps * 2 <= steps) warps *= 2;
  // From Fmt::kStagedXMinRows rows the one-tile kernel's warps stage X in shared memory (XT), two
  // stages of 8 kUnit chunks of 16 bytes each (the kernel's kXtStage, as NTILES * U = 2): 4 KB
  // for kUnit 32. Measured per format (benchmarks/README.md, "Activations through shared memory").
  const bool xt = ntiles == 1 && N >= Fmt::kStagedXMinRows;
  // A pair table (32 KB) beside XT's 8 KB per warp: CTAs of 4 warps (70 KB) fit three to an SM
  // (12 warps), CTAs of 8 (102 KB) two (16 warps, what the registers allow). So with XT a
  // table-decoding format takes 8 warps where the steps allow (benchmarks/README.md, "Design
  // measurements behind kernel choices").
  if (Fmt::kLut && xt)
    while (warps < kMmaMaxWarps && warps * 2 <= steps) warps *= 2;
  cudaStream_t s = cuda::stream(stream);
  // Up to Fmt::kTableXMaxRows (1 or 2) rows: X's rows in shared memory in mma order (XS; whole
  // steps of 8 units, zero-padded) while they fit in 40 KB for one row (K up to ~20000) or 64 KB
  // for two (two CTAs of 8 warps per SM). Every CTA reads all of X into its table, so the fill's
  // L2 traffic grows with N: four rows measured slower than XT or global loads (benchmarks/README.md,
  // "Design measurements behind kernel choices"). nf4's pair table leaves no room.
  static_assert(Fmt::kTableXMaxRows == 1 || Fmt::kTableXMaxRows == 2, "the table's rows: g & (N - 1)");
  const size_t xs_size = xs_bytes<Fmt::kUnit>(N, K);
  const bool xs = N <= Fmt::kTableXMaxRows && !Fmt::kLut && xs_size <= size_t(N == 1 ? 40 : 64) * 1024;
  const size_t xt_bytes = size_t(warps) * 2 * (8 * Fmt::kUnit) * 16;
  const size_t dyn = xs ? xs_size : xt ? xt_bytes : 0;
  auto go = [&](auto kernel) {
    if (dyn > 0) cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel));
    kernel<<<grid, warps * 32, dyn, s>>>(f, X, N, K, M, Y, bias);
  };
  auto two_tile = [&](auto rgc) { go(weight_only_mma_kernel<Fmt, H, 2, false, false, decltype(rgc)::value, false>); };
  auto one_tile = [&](auto pair) {  // the N <= 8 kernels: activations from XS, XT or global memory
    constexpr int kPair = decltype(pair)::value;
    if constexpr (kPair == 2) {  // (with XS only: see below)
      go(weight_only_mma_kernel<Fmt, H, 1, 2, true, 1, false>);
    } else {
      if constexpr (!Fmt::kLut) {
        if (xs) return go(weight_only_mma_kernel<Fmt, H, 1, kPair, true, 1, false>);
      }
      if constexpr (Fmt::kStagedXMinRows <= 8) {
        if (xt) return go(weight_only_mma_kernel<Fmt, H, 1, kPair, false, 1, true>);
      }
      go(weight_only_mma_kernel<Fmt, H, 1, kPair, false, 1, false>);
    }
  };
  if (ntiles == 1) {
    using Units = std::integral_constant<int, 0>;
    using Pair = std::integral_constant<int, 1>;
    using AlignedPair = std::integral_constant<int, 2>;
    bool pair = false;
    if constexpr (Fmt::kPairLoad) {  // (two units per lane: the N <= 8 kernel only)
      pair = f.pair_load_ok();
      bool aligned = false;
      // The aligned pair's three 16-byte loads with XS (one or two rows); with XT (2..8 rows) its 13
      // registers per pair raised the kernel to 172 registers and it measured slower
      // (benchmarks/README.md, "Design measurements behind kernel choices").
      if constexpr (HasAlignedPair<Fmt>::value) {
        aligned = pair && xs && f.aligned_pair_ok();
        if (aligned) one_tile(AlignedPair{});
      }
      if (pair && !aligned) one_tile(Pair{});
    }
    if (!pair) one_tile(Units{});
  } else {
    using R4 = std::integral_constant<int, 4>;
    using R2 = std::integral_constant<int, 2>;
    using R1 = std::integral_constant<int, 1>;
    bool done = false;
    if constexpr (Fmt::kMaxRowGroups >= 4) {
      if (rg == 4) {
        two_tile(R4{});
        done = true;
      }
    }
    if constexpr (Fmt::kMaxRowGroups >= 2) {
      if (rg == 2) {
        two_tile(R2{});
        done = true;
      }
    }
    if (!done) two_tile(R1{});
  }
  cuda::check_launch("weight-only GEMM (tensor cores)");
}

}  // namespace qf::gemm::cuda_wo
