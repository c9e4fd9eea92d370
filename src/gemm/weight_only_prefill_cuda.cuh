// Weight-only GEMM for many activation rows (prefill) on sm_90a: Y [N, M] = X [N, K] . W^T with
// fp16 or bf16 X, the packed weight decoded inside a Hopper wgmma main loop (no fp16 copy of W). Where
// the wgmma kernel of weight_only_wgmma_cuda.cuh permutes X into the A fragments' k order at
// every step and decodes the weight again for every 128 activation rows, here
// - X tiles land by TMA as they are in memory (K-major, 128-byte swizzle, which wgmma reads as
//   B directly): the format's decode builds A in the natural k order instead;
// - a CTA owns BM = 64 C weight rows and BN = 16 ... 256 activation rows, so a weight value is
//   decoded once per BN rows;
// - warp specialization: one thread of the copy warp (or warpgroup) issues each step's TMA copies
//   (X tile [BN, 64], packed weights [BM rows, one step], and for formats with a metadata array
//   the rows' entries around the step's) into an S-stage ring as soon as a stage is released; C
//   consumer warpgroups wait on the stage's mbarrier, decode their 64 rows into A registers
//   (wgmma m64nBNk16, A from registers) and release the stage when its batch is done.
//   While step k's batch runs on the tensor cores, the warps decode step k + 1;
// - the consumers store their outputs through a small per-warp buffer (stmatrix.trans), so that a
//   lane writes 16 contiguous bytes of Y instead of 2-byte pieces;
// - persistent CTAs take the tiles in turn; with the caller's workspace, the tiles of a partly idle
//   last wave are shared out by stream-K (K spans, a cut tile's two partial sums added through the
//   workspace; gemm/prefill_plan.h, prefill_stream_k_tiles).
// A format opts in with Fmt::kPrefill and supplies (int4, nf4 and q4_0 do, in their *_gemm_cuda.cu):
//   kPrefillStepBytes           bytes of one weight row per 64 values;
//   kPrefillBoxBytes            optional: the TMA box's width per row (the shared-memory row pitch),
//                               a multiple of 16 that holds a step from the 16-byte boundary at or
//                               below its start: a box starts on such a boundary (a TMA rule), and
//                               the decode gets the tile from the step's offset past it (default
//                               kPrefillStepBytes, for steps that are whole 16-byte chunks);
//   kPrefillWideStages          optional: the stages of the 128 x 256 tile's ring (default 4; a
//                               fifth is measured per format: benchmarks/README.md, "Design
//                               measurements behind kernel choices");
//   kPrefillMinRows             optional: the fewest activation rows the kernel takes (default 33,
//                               below which the wgmma and tensor-core kernels were measured faster
//                               for int4 and nf4);
//   prefill_ok()                host: this weight can take the kernel;
//   prefill_codes()             host: the packed rows, [M, K / 64 * kPrefillStepBytes] bytes;
//   kPrefillTiledCodes          optional: the codes are instead stored in tiles of 16 rows, a
//                               tile's row groups of prefill_tile_group_bytes() (host; a multiple
//                               of 32) one group column after the other (int4's "tiles" layout,
//                               formats/int4/int4.h): [M / 16, K / gs, 16, group bytes]. A 4-D
//                               tensor map then brings the same box (its 16-row pieces land one
//                               after the other, so the tile's rows are in order in shared memory);
//   kPrefillMetaWords           optional: 32-bit words of per-row metadata a step needs beside its
//                               codes (default 0: none, or it comes with the codes), which the
//                               consumers load a group ahead and convert at every step, with
//     PrefillMeta, prefill_meta(m, k)            row m's metadata of step k, loaded from global memory,
//     prefill_meta_words<H>(meta, w)             ... as the kPrefillMetaWords words the decode takes,
//     prefill_group_steps()                      the steps that share one PrefillMeta;
//   kPrefillMetaTma             optional: the metadata is one 32-bit word per row and step,
//                               entry (m, prefill_meta_col(k)) of a row-major array [M, cols] that
//                               the copies bring by TMA with each stage (a box of 4 entries a row,
//                               the step's among them; K / 64 steps may share an entry), with
//     prefill_meta_base(), prefill_meta_cols()   host: the array and its cols,
//     prefill_meta_tma_ok()                      host: cols is a multiple of 4 and the base
//                               16-byte aligned (a tensor map's rule), else the kernel takes the
//                               format's kPrefillMetaWords hooks above, which it must then have,
//     prefill_meta_col(k)                        the entry of step k
//                               (nf4 measured faster by TMA than with the consumers' loads:
//                               benchmarks/README.md, "nf4's block scales by TMA");
//   kPrefillTableBytes, prefill_table<H>(table)   optional: a per-CTA table in shared memory that
//                               the CTA's threads fill together before the main loop;
//   prefill_decode<H>(tile, r, lane, table, wa, wb, a)   lane (g, t)'s A fragments of one step for
//                               tile rows r and r + 8 (a[j]: k16 slice j, m16n8k16's A layout), as
//                               pairs of H (half_t or bf16_t, the activations' type); the step's
//                               bytes of row r start at tile + r * kPrefillBoxBytes, its metadata
//                               words at wa (row r) and wb (row r + 8): in the consumers' registers
//                               (kPrefillMetaWords), or the array's entries in shared memory as
//                               stored (kPrefillMetaTma).
// Measurements and the tile choice: benchmarks/README.md, "A GEMM that decodes int4 in its main
// loop, for prefill" and "The prefill kernel in the library".
#pragma once
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "common/tma_cuda.cuh"
#include "common/unitwise_cuda.cuh"
#include "gemm/prefill_plan.h"
#include "gemm/weight_only_cuda.cuh"
#include "gemm/weight_only_wgmma_cuda.cuh"
#include "gemm/wgmma_cuda.cuh"

namespace qf::gemm::cuda_wo {

// (lo, hi) as the low and high halves of a 32-bit register
__host__ __device__ constexpr uint32_t halves(uint32_t lo, uint32_t hi) { return lo | (hi << 16); }

// The nibble decodes of int4 and q4_0 into A fragments of H (fp16 or bf16): a nibble ORed into the
// mantissa of a magic number, so that HSUB2 of (magic + z) leaves q - z exactly. The low nibble
// goes into bits 0-3 of PairOps<H>'s magic (fp16 1024, bf16 128: mantissa unit 1).
// - fp16 (PairOps::kX16, room for a nibble at bits 4-7): the high nibble stays in bits 4-7 and is
//   ORed into 0x5400 (64, mantissa unit 1/16, so bits 4-7 count whole units): 64 + q. It needs no
//   shift and no scale / 16 (an fp16 subnormal for scales below 2^-10).
// - bf16: 7 mantissa bits, and bit 7 is the exponent's lowest: the high nibble is shifted down into
//   bits 0-3 of the same magic first (a shift more per pair, as in Marlin's bf16 decode in vLLM's
//   gptq_marlin kernels).
// Members: kLo / kHi, the magic numbers' bits; kLoMask, where a 16-bit half's low nibble lies;
// kHiMask, where its high nibble lies after hi_src(x); lo_minus(z) / hi_minus(z), the bits of
// magic + z; byte_both(w, t), byte t of w in both halves with its low nibble where kLoMask takes it
// in the low half and its high nibble where kHiMask takes it in the high half; kFlip, bit 3 of both
// of byte_both's nibbles (a two's-complement nibble's sign: q + 8).
template <class H>
struct PrefillNibbles {
  static constexpr bool kShift = !PairOps<H>::kX16;
  static constexpr uint32_t kLo = PairOps<H>::kMagic & 0xFFFFu, kHi = kShift ? kLo : 0x5400u;
  static constexpr uint32_t kLoMask = 0x000Fu, kHiMask = kShift ? 0x000Fu : 0x00F0u;
  static constexpr uint32_t kFlip = halves(0x8u, kHiMask & 0x88u);
  static __host__ __device__ constexpr uint32_t lo_minus(uint32_t z) { return kLo + z; }
  static __host__ __device__ constexpr uint32_t hi_minus(uint32_t z) { return kHi + (kShift ? 1 : 16) * z; }
  static __device__ __forceinline__ uint32_t hi_src(uint32_t x) { return kShift ? x >> 4 : x; }
  static __device__ __forceinline__ uint32_t byte_both(uint32_t w, uint32_t t) {
    // bf16: byte t of w in the low half, byte t of w >> 4 in the high half
    return kShift ? __byte_perm(w, w >> 4, t | ((4 + t) << 8)) : __byte_perm(w, 0u, 0x4040u | t | (t << 8));
  }
};
static_assert(PrefillNibbles<half_t>::kFlip == 0x00800008u && PrefillNibbles<bf16_t>::kFlip == 0x00080008u);
static_assert(PrefillNibbles<half_t>::kLo == 0x6400u && PrefillNibbles<bf16_t>::kHi == 0x4300u);

// prefill_decode's loop for steps stored as 32 bytes per row, 8 words of two codes per byte
// (int4, nf4): lane (g, t) takes byte t of words 2j and 2j + 1 of rows r and r + 8 for k16 slice j
// (values 2t, 2t + 1 and 2t + 8, 2t + 9); pair(word, h) decodes that byte of a word of row r + 8 h
// into an fp16 pair.
template <class Pair>
__device__ __forceinline__ void byte_pair_fragments(const uint8_t* tile, int r, Pair pair, uint32_t (&a)[4][4]) {
  const uint4* ra = reinterpret_cast<const uint4*>(tile + r * 32);
  const uint4* rb = reinterpret_cast<const uint4*>(tile + (r + 8) * 32);
  const uint4 u0 = ra[0], u1 = ra[1], v0 = rb[0], v1 = rb[1];
  const uint32_t w0[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
  const uint32_t w1[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    a[j][0] = pair(w0[2 * j], 0);
    a[j][1] = pair(w1[2 * j], 1);
    a[j][2] = pair(w0[2 * j + 1], 0);
    a[j][3] = pair(w1[2 * j + 1], 1);
  }
}

// From 33 activation rows (Fmt::kPrefillMinRows where a format measured an earlier crossover) the
// prefill kernel takes the product (up to 128 rows only where its tiles fill the GPU, in tiles of
// 16, 32, 64 or 128 activation rows, X's box cut to the rows there are), where the wgmma kernel of
// weight_only_wgmma_cuda.cuh permutes X into its tables at every step (benchmarks/README.md, "The
// prefill kernel from 33 rows", "Prefill tiles of 16, 32 and 64 activation rows").
template <class Fmt, class = void>
struct prefill_min_rows : std::integral_constant<int, 33> {};
template <class Fmt>
struct prefill_min_rows<Fmt, std::void_t<decltype(Fmt::kPrefillMinRows)>>
    : std::integral_constant<int, Fmt::kPrefillMinRows> {};

// Whether Fmt has the hooks above (Fmt::kPrefill true); the other formats need not mention them.
template <class Fmt, class = void>
struct has_prefill : std::false_type {};
template <class Fmt>
struct has_prefill<Fmt, std::void_t<decltype(Fmt::kPrefill)>> : std::bool_constant<Fmt::kPrefill> {};

// The TMA box's bytes per weight row (Fmt::kPrefillBoxBytes, else a step's bytes).
template <class Fmt, class = void>
struct prefill_box_bytes : std::integral_constant<int, Fmt::kPrefillStepBytes> {};
template <class Fmt>
struct prefill_box_bytes<Fmt, std::void_t<decltype(Fmt::kPrefillBoxBytes)>>
    : std::integral_constant<int, Fmt::kPrefillBoxBytes> {};

// Whether Fmt's codes are in 16-row tiles (Fmt::kPrefillTiledCodes).
template <class Fmt, class = void>
struct prefill_tiled_codes : std::false_type {};
template <class Fmt>
struct prefill_tiled_codes<Fmt, std::void_t<decltype(Fmt::kPrefillTiledCodes)>>
    : std::bool_constant<Fmt::kPrefillTiledCodes> {};
constexpr int kPrefillCodeTileRows = 16;

// Stages of the 128 x 256 tile's ring (Fmt::kPrefillWideStages, else 4).
template <class Fmt, class = void>
struct prefill_wide_stages : std::integral_constant<int, 4> {};
template <class Fmt>
struct prefill_wide_stages<Fmt, std::void_t<decltype(Fmt::kPrefillWideStages)>>
    : std::integral_constant<int, Fmt::kPrefillWideStages> {};

// Per-row metadata words of a step (Fmt::kPrefillMetaWords, else 0).
// Meta: Fmt::PrefillMeta, or an empty stand-in.
template <class Fmt, class = void>
struct prefill_meta_words : std::integral_constant<int, 0> {
  struct Meta {};
};
template <class Fmt>
struct prefill_meta_words<Fmt, std::void_t<decltype(Fmt::kPrefillMetaWords)>>
    : std::integral_constant<int, Fmt::kPrefillMetaWords> {
  using Meta = typename Fmt::PrefillMeta;
};

// Whether Fmt's metadata comes by TMA (Fmt::kPrefillMetaTma), and the bytes of a row's box.
template <class Fmt, class = void>
struct prefill_meta_tma : std::false_type {};
template <class Fmt>
struct prefill_meta_tma<Fmt, std::void_t<decltype(Fmt::kPrefillMetaTma)>> : std::bool_constant<Fmt::kPrefillMetaTma> {};
constexpr int kPrefillMetaBoxBytes = 16;  // 4 entries: a TMA box's least width

// Fmt with its metadata loaded by the consumers (its kPrefillMetaWords hooks), for a weight whose
// metadata array a tensor map cannot take (Fmt::prefill_meta_tma_ok() false), and for tiles where
// the boxes would not leave room for the CTAs per SM that the tile is made for (PrefillFmt below).
template <class Fmt>
struct PrefillLoadedMeta : Fmt {
  static constexpr bool kPrefillMetaTma = false;
  PrefillLoadedMeta(const Fmt& f) : Fmt(f) {}  // (implicit: a launch coerces the Fmt it is given)
};

// Bytes of Fmt's per-CTA table (0: none).
template <class Fmt, class = void>
struct prefill_table_bytes : std::integral_constant<int, 0> {};
template <class Fmt>
struct prefill_table_bytes<Fmt, std::void_t<decltype(Fmt::kPrefillTableBytes)>>
    : std::integral_constant<int, Fmt::kPrefillTableBytes> {};

// Bytes of each consumer warp's epilogue buffer: two of 16 columns x 16 rows of 16-bit outputs.
constexpr int kPrefillEpiBytes = 2 * 16 * 16 * 2;

// Dynamic shared memory: S stages of an X tile (BN rows of 128 bytes), BM rows of packed weights
// and their metadata boxes, 2 S mbarriers, the format's table, the consumer warps' epilogue
// buffers, and the 1 KB that aligning the ring to the swizzle atom may skip.
template <class Fmt, int BN, int S, int C>
constexpr int prefill_smem_bytes() {
  return S * (BN * wg::kRowBytes +
              64 * C * (prefill_box_bytes<Fmt>::value + (prefill_meta_tma<Fmt>::value ? kPrefillMetaBoxBytes : 0))) +
         2 * S * 8 + prefill_table_bytes<Fmt>::value + 4 * C * kPrefillEpiBytes + 1024;
}

// The policy a tile's kernel takes: Fmt, or PrefillLoadedMeta<Fmt> where Fmt's metadata boxes would
// keep a C = 1 tile (two CTAs per SM) from fitting twice into sm_90's 228 KB of shared memory per
// SM, less 1 KB reserved per CTA (nf4's 128 x 128 tile of 4 stages: 64 bytes too many).
template <class Fmt, int BN, int S, int C>
using PrefillFmt = std::conditional_t<(prefill_meta_tma<Fmt>::value && C == 1 &&
                                       2 * (prefill_smem_bytes<Fmt, BN, S, C>() + 1024) > 228 * 1024),
                                      PrefillLoadedMeta<Fmt>, Fmt>;

// Output bits of float32 sum v, as store_out writes them (b: the row's bias as float32, if any).
template <class H>
__device__ __forceinline__ uint32_t prefill_out_bits(float v, bool has_bias, float b) {
  H t;
  from_f32(v, &t);
  if (has_bias) from_f32(qf::cuda::unitwise::load_f32(t) + b, &t);
  return t.bits;
}

// Rows of X's TMA box in the last column of tiles: its rows of X rounded up to 8, not BN. A box
// reaching past X's last row makes the copy zero-fill the rest, and that is slow (benchmarks/
// README.md, "The prefill kernel from 33 rows"). The tile's later rows of shared memory then keep
// older stages' values; they only reach accumulator columns past N, which are never stored.
QF_HOST_DEVICE constexpr int prefill_last_x_rows(int N, int BN) { return (N - (N - 1) / BN * BN + 7) / 8 * 8; }

// Threads of a CTA: C consumer warpgroups and the copies' warp (warpgroup where BN > 128, below).
constexpr int prefill_threads(int BN, int C) { return 128 * C + (BN > 128 ? 128 : 32); }

// A kernel's tile, as the launcher names it: BN activation rows, S stages, C consumer warpgroups.
template <int BN, int S, int C>
struct PrefillTile {
  static constexpr int kBN = BN, kS = S, kC = C;
  static constexpr bool kStreamK = BN >= 128 && C == 2;  // a tile that stream-K may share out (prefill_plan.h)
};

// Stream-K (gemm/prefill_plan.h, prefill_stream_k_tiles): the last `tiles` tiles are shared out
// as spans of K steps; part and flags are the caller's workspace (prefill_stream_k_bytes).
struct PrefillStreamK {
  float4* part = nullptr;     // CTA b's partial sums of a cut tile: [NT][consumer threads] float4 at b
  uint32_t* flags = nullptr;  // flags[b] != 0 once CTA b's partial sums are written (zeroed per launch)
  int tiles = 0;              // 0: no stream-K
};

// This thread's warpgroup, through a shuffle so that ptxas sees it warp-uniform (otherwise it
// serializes the wgmma of the branches that depend on it: C7518).
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, int(threadIdx.x) >> 7, 0); }

// C consumer warpgroups of 64 weight rows; BN activation rows; S stages. BN = 256 or 192 (128 or
// 96 float32 accumulators a thread) needs more registers than a CTA of 288 threads may have
// (ptxas caps it at 168, as for 384: int4 at BN = 192 spilled): the copies then get a whole
// warpgroup, which hands its registers to the consumers (setmaxnreg 40 / 232; without it ptxas
// spills and serializes the wgmma, C7512). C = 1 runs two CTAs per SM. kSK: the stream-K schedule
// (sk; its own instance, so that the others' registers and main loop are those without it).
template <class Fmt, class H, int BN, int S, int C, bool kSK>
__global__ void
__launch_bounds__(prefill_threads(BN, C), C == 1 ? 2 : 1)
    weight_only_prefill_kernel(const __grid_constant__ CUtensorMap tmX, const __grid_constant__ CUtensorMap tmXl,
                               const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmM,
                               const Fmt f, H* __restrict__ Y, const H* __restrict__ bias, const PrefillStreamK sk,
                               int N, int M, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(BN == 16 || BN == 32 || BN == 64 || BN == 128 || BN == 192 || BN == 256, "wgmma n16 ... n256");
  constexpr int NT = BN / 8, kX = BN * wg::kRowBytes, kW = 64 * C * prefill_box_bytes<Fmt>::value;
  static_assert(NT * 128 * C * 16 <= S * (kX + kW), "a split's partial sums fit over the ring");
  extern __shared__ uint8_t prefill_smem[];
  // The ring aligned to 1 KB (the 128-byte swizzle's atom) by an offset from the __shared__ array
  // itself: through an integer cast the compiler loses the address space, and every read of the
  // weight tiles and the format's table becomes a generic load (LD, not LDS; Nsight Compute: the
  // decode's loads then stall on the long scoreboard).
  uint8_t* const xs = prefill_smem + ((1024u - (cuda::smem_u32(prefill_smem) & 1023u)) & 1023u);
  uint8_t* const wsm = xs + S * kX;
  // kTma: each stage's metadata boxes (the tile rows' 4 entries around the step's) after the rings;
  // kMW: metadata words that the consumers load instead.
  constexpr bool kTma = prefill_meta_tma<Fmt>::value;
  constexpr int kMeta = kTma ? 64 * C * kPrefillMetaBoxBytes : 0, kMW = kTma ? 0 : prefill_meta_words<Fmt>::value;
  uint8_t* const meta = wsm + S * kW;
  uint64_t* const full = reinterpret_cast<uint64_t*>(meta + S * kMeta);  // stage's bytes landed
  uint64_t* const empty = full + S;                                  // every consumer done with it
  uint32_t* const table = reinterpret_cast<uint32_t*>(empty + S);
  uint8_t* const epi = reinterpret_cast<uint8_t*>(table) + prefill_table_bytes<Fmt>::value;  // 16-byte aligned
  const int tid = threadIdx.x, wgi = warpgroup_index();
  // Persistent CTAs: tile b, b + gridDim.x, ... (weight-row tiles fastest). The ring runs on across
  // a CTA's pieces of work (prefill_piece), so the copies of the next piece's first S steps land
  // while the consumers store the last one's outputs, and a CTA pays the pipeline's fill once.
  // Split K: a cluster of `splits` CTAs along x shares a tile, CTA z taking its z-th span of steps;
  // the launcher then gives each cluster one tile (the partial sums overwrite the ring).
  // Stream-K (sk.tiles > 0, no split): the last tiles cut into spans of steps (prefill_piece).
  namespace cg = cooperative_groups;
  const int splits = int(cg::this_cluster().num_blocks()), z = int(blockIdx.x) % splits;
  const int mtiles = (M + 64 * C - 1) / (64 * C), tiles = mtiles * ((N + BN - 1) / BN), ksteps = K / 64;
  const int cta = int(blockIdx.x) / splits, ctas = int(gridDim.x) / splits;
  // fn(tile, kb, steps, kk) for this CTA's pieces of work in turn (tile, its steps kb .. kb + steps
  // - 1, the ring's step count kk at the piece's start): the copies and the consumers walk the same
  // list.
  auto for_each_piece = [&](auto&& fn) {
    if constexpr (!kSK) {
      const int steps = ksteps / splits, kb = z * steps;
      for (int tile = cta, kk = 0; tile < tiles; tile += ctas, kk += steps) fn(tile, kb, steps, kk);
    } else {
      for (int i = 0, kk = 0;; ++i) {
        const PrefillPiece pc = prefill_piece(i, cta, ctas, z, splits, tiles, ksteps, sk.tiles);
        if (pc.tile < 0) break;
        fn(pc.tile, pc.kb, pc.steps, kk);
        kk += pc.steps;
      }
    }
  };
  if (tid == 0) {
    for (int i = 0; i < S; ++i) cuda::mbar_init(full + i, 1), cuda::mbar_init(empty + i, C);
    cuda::mbar_init_fence();
  }
  if constexpr (prefill_table_bytes<Fmt>::value > 0) f.template prefill_table<H>(table);
  __syncthreads();
  if (wgi == C) {  // the copies, up to S steps ahead of the consumers
    if constexpr (BN > 128) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if ((tid & 127) == 0) {  // one thread issues the TMA copies
      // The copies of one piece of work (for_each_piece).
      int gbytes = 0;  // (tiled codes: a row's bytes per group)
      if constexpr (prefill_tiled_codes<Fmt>::value) gbytes = f.prefill_tile_group_bytes();
      auto copy_piece = [&](int tile, int kb, int steps, int kk) {
        const int m0 = tile % mtiles * 64 * C, n0 = tile / mtiles * BN;
        const bool lastn = n0 + BN >= N;  // the last column of tiles takes X through tmXl
        const CUtensorMap* const mx = lastn ? &tmXl : &tmX;
        const uint32_t bytes = uint32_t((lastn ? prefill_last_x_rows(N, BN) : BN) * wg::kRowBytes + kW + kMeta);
        for (int k = kb; k < kb + steps; ++k, ++kk) {
          const int st = kk % S;
          if (kk >= S) cuda::mbar_wait(&empty[st], ((kk / S) - 1) & 1);
          cuda::mbar_expect(&full[st], bytes);
          cuda::tma_load_2d(xs + st * kX, mx, k * 64, n0, &full[st]);
          const int cw = (k * Fmt::kPrefillStepBytes) & ~15;  // the box's first byte of a row
          if constexpr (prefill_tiled_codes<Fmt>::value)  // (a box never crosses a group: launcher)
            cuda::tma_load_4d(wsm + st * kW, &tmW, cw % gbytes, 0, cw / gbytes, m0 / kPrefillCodeTileRows, &full[st]);
          else
            cuda::tma_load_2d(wsm + st * kW, &tmW, cw, m0, &full[st]);
          // (rows past M arrive as zeros: their outputs are not stored)
          if constexpr (kTma) cuda::tma_load_2d(meta + st * kMeta, &tmM, f.prefill_meta_col(k) & ~3, m0, &full[st]);
        }
      };
      for_each_piece(copy_piece);
    }
    return;
  }
  if constexpr (BN > 128) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2;
  const int r0 = wgi * 64 + warp * 16 + g;  // this lane's tile rows r0 and r0 + 8
  const uint32_t xa = cuda::smem_u32(xs);
  // The epilogue goes through this warp's two buffers: stmatrix.trans turns each 8 x 8 block of
  // accumulators (a lane: 2 columns of one row) into 16-byte runs of 8 rows of one column, which is
  // what Y [N, M] holds contiguously; a lane then stores 16 bytes (two lanes fill a 32-byte sector)
  // instead of eight 2-byte stores that fill half of four sectors each. Buffer layout: column c's 16
  // rows at 32 c, their halves swapped when c & 4, so that both the stmatrix (8 columns of one
  // half) and the reads (4 columns, both halves) touch each bank once.
  const uint32_t epi_a = cuda::smem_u32(epi) + (tid >> 5) * kPrefillEpiBytes;
  const uint32_t epi_st = [&] {  // lane l: column 8 (j / 2) + l % 8, half j % 2 of matrix j = l / 8
    const int j = lane >> 3, c = 8 * (j >> 1) + (lane & 7);
    return uint32_t(c * 32 + (((j & 1) ^ ((c >> 2) & 1)) << 4));
  }();
  const int epi_c = lane >> 1;  // lane l reads half l % 2 of column l / 2
  const uint32_t epi_ld = uint32_t(epi_c * 32 + (((lane & 1) ^ ((epi_c >> 2) & 1)) << 4));
  const bool epi_vec = M % 8 == 0 && (reinterpret_cast<uintptr_t>(Y) & 15) == 0;
  int epi_buf = 0;  // the buffer of the next 16 columns (alternate, so one __syncwarp per pair)
  float d[NT][4];
  // One piece of work (for_each_piece), kk0 the ring's step count at its start.
  auto run_piece = [&](int tile, int kb, int steps, int kk0) {
    const int m0 = tile % mtiles * 64 * C, n0 = tile / mtiles * BN;
    // The bias of this lane's rows, for the epilogue (rows past M take row M - 1's bias, and its
    // metadata where the consumers load it; the TMA brings zeros for their codes and metadata
    // boxes, and their outputs are not stored).
    const int ma = min(m0 + r0, M - 1), mb = min(m0 + r0 + 8, M - 1);
    using qf::cuda::unitwise::load_f32;
    const float bias_a = bias != nullptr ? load_f32(bias[ma]) : 0.f;
    const float bias_b = bias != nullptr ? load_f32(bias[mb]) : 0.f;
    // Where the consumers load the metadata: the next group's is loaded while the current group's
    // steps run (its latency would otherwise sit between a step's wait and its decode); local step k
    // is the weight's step kb + k, and a span may start inside a group.
    [[maybe_unused]] int group = 0, left = 0, skip = 0, gsteps = 1;
    typename prefill_meta_words<Fmt>::Meta na{}, nb{}, ca{}, cb{};
    if constexpr (kMW > 0) {
      gsteps = f.prefill_group_steps(), group = kb / gsteps, skip = kb % gsteps;
      na = f.prefill_meta(ma, group * gsteps), nb = f.prefill_meta(mb, group * gsteps), ca = na, cb = nb;
    }
    auto decode = [&](int k, uint32_t (&a)[4][4]) {
      const int st = (kk0 + k) % S;
      const uint8_t* const tile_w = wsm + st * kW + (((kb + k) * Fmt::kPrefillStepBytes) & 15);
      if constexpr (kMW > 0) {
        if (left == 0) {
          ca = na, cb = nb, left = gsteps - skip, skip = 0, ++group;
          if (group * gsteps < kb + steps) na = f.prefill_meta(ma, group * gsteps), nb = f.prefill_meta(mb, group * gsteps);
        }
        --left;
        uint32_t wa[kMW], wb[kMW];
        f.template prefill_meta_words<H>(ca, wa);
        f.template prefill_meta_words<H>(cb, wb);
        cuda::mbar_wait(&full[st], ((kk0 + k) / S) & 1);
        f.template prefill_decode<H>(tile_w, r0, lane, table, wa, wb, a);
      } else if constexpr (kTma) {
        cuda::mbar_wait(&full[st], ((kk0 + k) / S) & 1);
        // the boxes of rows r0 and r0 + 8 (16 bytes a row: a warp's 8 rows in 8 distinct banks)
        const uint32_t* const ms = reinterpret_cast<const uint32_t*>(meta + st * kMeta) + (f.prefill_meta_col(kb + k) & 3);
        f.template prefill_decode<H>(tile_w, r0, lane, table, ms + 4 * r0, ms + 4 * (r0 + 8), a);
      } else {
        cuda::mbar_wait(&full[st], ((kk0 + k) / S) & 1);
        f.template prefill_decode<H>(tile_w, r0, lane, table, nullptr, nullptr, a);
      }
    };
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        d[i][e] = 0.f;
        wg::pin(d[i][e]);  // (zeroed in the loop's sight, else ptxas serializes the wgmma: C7514)
      }
    // kLast: the tile's last step (wait for everything; no next step to decode). It is peeled out of
    // the loop below, so that no path from a wait<1> leaves the loop: with the last step's wait<0>
    // as a branch inside the loop, ptxas injected a wait<0> into every second step (C7517).
    auto step = [&](int k, const uint32_t (&acur)[4][4], uint32_t (&anext)[4][4], auto last) {
      constexpr bool kLast = decltype(last)::value;
      const uint64_t db = wg::sw128_desc(xa + ((kk0 + k) % S) * kX);
      wg::fence();
#pragma unroll
      for (int j = 0; j < 4; ++j) wg::WgmmaRS<NT>::template run<std::is_same_v<H, bf16_t>>(d, acur[j], db + 2 * j);  // + 32 B per k16
      wg::commit();
      // The last step waits for everything: with wait<1> here and wait<0> after the loop, ptxas
      // (CUDA 13.0) put the epilogue's reads of the accumulators before the final wait (SASS: F2FP
      // of the results with the last batch in flight).
      if constexpr (kLast) wg::wait<0>();
      else wg::wait<1>();  // step k - 1's batch is done: its stage and A registers are free
      if (k > 0 && (tid & 127) == 0) cuda::mbar_arrive(&empty[(kk0 + k - 1) % S]);
      if constexpr (!kLast) decode(k + 1, anext);
      else if ((tid & 127) == 0) cuda::mbar_arrive(&empty[(kk0 + k) % S]);  // the tile's last stage
    };
    uint32_t a0[4][4], a1[4][4];
    decode(0, a0);
    // Two steps per trip with the A sets swapped by name (an indexed swap would put them in local
    // memory); steps is even (the launcher's K % 128 == 0), the last two after the loop.
    for (int k = 0; k + 2 < steps; k += 2) {
      step(k, a0, a1, std::false_type{});
      step(k + 1, a1, a0, std::false_type{});
    }
    step(steps - 2, a0, a1, std::false_type{});
    step(steps - 1, a1, a0, std::true_type{});
    // Stores activation columns 8 i .. 8 i + 15 of this warp's 16 rows from their sums in the wgmma
    // D layout (u: column tile i, w: i + 1; [e] is row g (+ 8 for e >= 2), column 2 t + (e & 1)).
    auto store2 = [&](int i, const float (&u)[4], const float (&w)[4]) {
      const bool hb = bias != nullptr;
      auto pair = [&](float lo, float hi, float b) {
        return halves(prefill_out_bits<H>(lo, hb, b), prefill_out_bits<H>(hi, hb, b));
      };
      const uint32_t buf = epi_a + epi_buf * (kPrefillEpiBytes / 2);
      epi_buf ^= 1;
      wg::stmatrix_x4_trans(buf + epi_st, pair(u[0], u[1], bias_a), pair(u[2], u[3], bias_b), pair(w[0], w[1], bias_a),
                            pair(w[2], w[3], bias_b));
      __syncwarp();
      uint4 v;  // (read at the 32-bit shared address that stmatrix takes)
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(buf + epi_ld));
      const int n = n0 + 8 * i + epi_c, m = m0 + wgi * 64 + warp * 16 + 8 * (lane & 1);
      if (n >= N || m >= M) return;
      H* const y = Y + int64_t(n) * M + m;
      if (epi_vec) {
        *reinterpret_cast<uint4*>(y) = v;
      } else {
        const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int q = 0; q < 8; ++q)
          if (m + q < M) y[q].bits = uint16_t(wv[q / 2] >> (16 * (q & 1)));
      }
    };
    constexpr int T = 128 * C;  // consumer threads
    if (kSK && steps < ksteps) {
      // A tile cut by stream-K: the CTA with its later steps (kb > 0: the start of that CTA's span,
      // early in its run) writes its partial sums and raises its flag; the one with its first steps
      // (the end of its span, the next higher index) waits for that flag, adds them and stores.
      // The wait ends as long as CTAs start in index order (the grid is one CTA per SM; CUDA does
      // not promise the order, CUTLASS's stream-K counts on it too): a CTA only waits for a lower
      // one, which is running or done.
      float4* const mine = sk.part + int64_t(cta) * NT * T;
      if (kb > 0) {
#pragma unroll
        for (int i = 0; i < NT; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) wg::pin(d[i][e]);
          mine[i * T + tid] = make_float4(d[i][0], d[i][1], d[i][2], d[i][3]);
        }
        asm volatile("bar.sync 1, %0;\n" ::"n"(T) : "memory");  // every consumer's sums written
        if (tid == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(sk.flags + cta) : "memory");
        return;
      }
      if (tid == 0) {
        uint32_t ready = 0;
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(ready) : "l"(sk.flags + cta - 1) : "memory");
        } while (ready == 0);
      }
      asm volatile("bar.sync 1, %0;\n" ::"n"(T) : "memory");  // (thread 0's acquire, then everyone reads)
      const float4* const other = mine - NT * T;
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const float4 u = __ldcg(other + i * T + tid);
        d[i][0] += u.x, d[i][1] += u.y, d[i][2] += u.z, d[i][3] += u.w;
      }
    }
    if (splits == 1) {
#pragma unroll
      for (int i = 0; i < NT; i += 2) {
#pragma unroll
        for (int e = 0; e < 4; ++e) wg::pin(d[i][e]), wg::pin(d[i + 1][e]);
        store2(i, d[i], d[i + 1]);
      }
    } else {
      // The cluster's partial sums, reduced in rank order (deterministic): each CTA writes its own
      // over its ring (float4 (i, thread): d[i][0..3]), and CTA z sums its share of the column
      // tiles i (columns 8 i .. 8 i + 7), pairs [z NT / 2 / splits, (z + 1) NT / 2 / splits), from
      // every CTA in turn.
      asm volatile("bar.sync 1, %0;\n" ::"n"(T) : "memory");  // no consumer's wgmma still reads the ring
      float4* const red = reinterpret_cast<float4*>(xs);
#pragma unroll
      for (int i = 0; i < NT; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) wg::pin(d[i][e]);
        red[i * T + tid] = make_float4(d[i][0], d[i][1], d[i][2], d[i][3]);
      }
      cg::cluster_group cluster = cg::this_cluster();
      cluster.sync();  // every CTA's partial sums written and visible to the cluster
      auto sum = [&](int i, float (&s)[4]) {
        float4 v = cluster.map_shared_rank(red, 0)[i * T + tid];
        for (int q = 1; q < splits; ++q) {
          const float4 u = cluster.map_shared_rank(red, q)[i * T + tid];
          v.x += u.x, v.y += u.y, v.z += u.z, v.w += u.w;
        }
        s[0] = v.x, s[1] = v.y, s[2] = v.z, s[3] = v.w;
      };
      constexpr int kPairs = NT / 2;  // store2 takes column tiles in pairs; a CTA may get none
      for (int p = z * kPairs / splits; p < (z + 1) * kPairs / splits; ++p) {
        float u[4], w[4];
        sum(2 * p, u), sum(2 * p + 1, w);
        store2(2 * p, u, w);
      }
      cluster.sync();  // no CTA leaves while the others read its shared memory
    }
  };
  for_each_piece(run_piece);
#else
  __trap();  // never launched: the host takes this kernel only from a build with sm_90a code
#endif
}

// Launches the prefill kernel on `stream` when it applies: a format with the hooks, fp16 or bf16
// activations, prefill_min_rows or more rows, compute capability 9.0 and sm_90a code in the build, K a
// multiple of 128, N, M, K below 2^31, X 16-byte aligned, the format's prefill_ok(), and a tile
// that gemm/prefill_plan.h's rules take; returns false (nothing launched) otherwise. `ws`: the
// caller's workspace (gemm/weight_only_cuda.h); stream-K is planned only where it holds
// prefill_workspace_bytes(N, M, SMs) (16-byte aligned), else the tiles run whole.
template <class Fmt, class H>
bool launch_weight_only_prefill(const Fmt& f, const H* X, int64_t N, int64_t K, int64_t M, H* Y, const H* bias,
                                GemmWorkspace ws, void* stream) {
  if constexpr (!has_prefill<Fmt>::value || !(std::is_same_v<H, half_t> || std::is_same_v<H, bf16_t>)) {
    return false;
  } else {
    if (!wgmma_built() || N < prefill_min_rows<Fmt>::value || M <= 0 || K <= 0 || K % 128 || N >= (int64_t(1) << 31) ||
        M >= (int64_t(1) << 31) || K >= (int64_t(1) << 31) || !cuda::aligned16(X) || !f.prefill_ok() ||
        cuda::cc_major() != 9)
      return false;
    if constexpr (prefill_meta_tma<Fmt>::value) {
      if (!f.prefill_meta_tma_ok())
        return launch_weight_only_prefill(PrefillLoadedMeta<Fmt>(f), X, N, K, M, Y, bias, ws, stream);
    }
    constexpr int kSB = Fmt::kPrefillStepBytes, kBox = prefill_box_bytes<Fmt>::value;
    // The codes' map: rows [M, K / 64 * kSB], or tiles of 16 rows [M / 16, groups, 16, group
    // bytes] whose boxes of 16 rows x kBox bytes, bm / 16 tiles at a time, land as the rows' box.
    CUtensorMap tw;
    auto codes_map = [&](int bm) {
      if constexpr (prefill_tiled_codes<Fmt>::value) {
        const uint64_t gb = uint64_t(f.prefill_tile_group_bytes()), row_bytes = uint64_t(K / 64 * kSB);
        if (kBox != kSB || gb % kBox || row_bytes % gb || M % kPrefillCodeTileRows) return false;  // a box in one group
        const uint64_t dims[4] = {gb, kPrefillCodeTileRows, row_bytes / gb, uint64_t(M / kPrefillCodeTileRows)};
        const uint64_t strides[3] = {gb, gb * kPrefillCodeTileRows, row_bytes * kPrefillCodeTileRows};
        const uint32_t box[4] = {uint32_t(kBox), kPrefillCodeTileRows, 1, uint32_t(bm / kPrefillCodeTileRows)};
        return cuda::tensor_map(&tw, f.prefill_codes(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, dims, strides, box,
                                CU_TENSOR_MAP_SWIZZLE_NONE);
      } else {
        return cuda::tensor_map_2d(&tw, f.prefill_codes(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(K / 64 * kSB),
                                   uint64_t(M), kBox, bm, CU_TENSOR_MAP_SWIZZLE_NONE);
      }
    };
    const int sms = cuda::sm_count();
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim = {1, 1, 1};
    cudaLaunchConfig_t cfg{};
    cfg.stream = cuda::stream(stream);
    cfg.attrs = attr;
    // Each tile's kernel, with its threads and shared memory set in cfg, handed to fn: one table
    // for the occupancy queries and the launch.
    // sk: the stream-K instance (PrefillTile::kStreamK tiles only).
    auto with_kernel = [&](int bm, int bn, auto&& fn, bool sk = false) {
      auto use = [&](auto tile) {
        using T = decltype(tile);
        using F = PrefillFmt<Fmt, T::kBN, T::kS, T::kC>;
        auto run = [&](auto kernel) {
          cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel));
          cfg.blockDim = dim3(unsigned(prefill_threads(T::kBN, T::kC)));
          cfg.dynamicSmemBytes = size_t(prefill_smem_bytes<F, T::kBN, T::kS, T::kC>());
          return fn(kernel);
        };
        if constexpr (T::kStreamK) {
          if (sk) return run(weight_only_prefill_kernel<F, H, T::kBN, T::kS, T::kC, true>);
        }
        return run(weight_only_prefill_kernel<F, H, T::kBN, T::kS, T::kC, false>);
      };
      if (bn == 256) return use(PrefillTile<256, prefill_wide_stages<Fmt>::value, 2>{});
      if (bn == 192) return use(PrefillTile<192, 6, 2>{});
      // Up to 64 rows, tiles as narrow as the rows allow (wgmma n16 / n32 / n64: the multiplies
      // shrink with them, the decode does not), with more stages in the smaller X tiles' room;
      // n16 and n32 only where the format starts below 33 rows.
      auto small_tile = [&](auto bn_c) {
        constexpr int B = decltype(bn_c)::value;
        if (bm == 128) return use(PrefillTile<B, 8, 2>{});
        return use(PrefillTile<B, 6, 1>{});
      };
      if constexpr (prefill_min_rows<Fmt>::value <= 32) {
        if (bn == 16) return small_tile(std::integral_constant<int, 16>{});
        if (bn == 32) return small_tile(std::integral_constant<int, 32>{});
      }
      if (bn == 64) return small_tile(std::integral_constant<int, 64>{});
      if (bm == 128) return use(PrefillTile<128, 6, 2>{});
      return use(PrefillTile<128, 4, 1>{});
    };
    // Stream-K where the caller's workspace holds what any plan for N x M may need.
    const int64_t ws_need = prefill_workspace_bytes(N, M, sms);
    const bool sk_ok = ws_need > 0 && ws.ptr != nullptr && cuda::aligned16(ws.ptr) && ws.bytes >= ws_need;
    // Whether `tiles` clusters of s CTAs of that kind run at once on this device.
    const PrefillPlan plan = plan_prefill(N, M, K, sms, [&](PrefillKind kind, int s, int64_t tiles) {
      const int bm = kind == PrefillKind::kLow ? 64 : 128,
                bn = kind == PrefillKind::kWide ? 256 : kind == PrefillKind::kN192 ? 192 : 128;
      return with_kernel(bm, bn, [&](auto kernel) {
        cfg.gridDim = dim3(unsigned(tiles * s));
        attr[0].val.clusterDim.x = unsigned(s);
        cfg.numAttrs = 1;
        return tiles <= max_active_clusters(reinterpret_cast<const void*>(kernel), cfg, s);
      });
    }, sk_ok);
    if (!plan.bm) return false;
    const int bm = plan.bm, bn = plan.bn, split = plan.split;
    CUtensorMap tx, txl;
    constexpr auto kXType = std::is_same_v<H, bf16_t> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    const int last_rows = prefill_last_x_rows(int(N), bn);
    // One column of tiles, or a last column as wide as the rest, needs one map (an encode is host time).
    const bool one_map = N <= bn || last_rows == bn;
    if (!cuda::tensor_map_2d(&txl, X, kXType, 2, uint64_t(K), uint64_t(N), 64, last_rows, CU_TENSOR_MAP_SWIZZLE_128B) ||
        !(one_map || cuda::tensor_map_2d(&tx, X, kXType, 2, uint64_t(K), uint64_t(N), 64, bn, CU_TENSOR_MAP_SWIZZLE_128B)) ||
        !codes_map(bm))
      return false;
    CUtensorMap tm{};  // (left zero where the format has no metadata by TMA: the kernel does not read it)
    if constexpr (prefill_meta_tma<Fmt>::value) {
      if (!cuda::tensor_map_2d(&tm, f.prefill_meta_base(), CU_TENSOR_MAP_DATA_TYPE_UINT32, 4, uint64_t(f.prefill_meta_cols()),
                               uint64_t(M), kPrefillMetaBoxBytes / 4, bm, CU_TENSOR_MAP_SWIZZLE_NONE))
        return false;
    }
    // Without a split: one CTA per tile up to the CTAs the GPU holds at once (two per SM for
    // 64-row tiles), each then taking further tiles in turn (the kernel's tile loop).
    const int64_t tiles = int64_t(cuda::grid_for(M, bm)) * cuda::grid_for(N, bn),
                  resident = int64_t(sms) * (bm == 64 ? 2 : 1);
    if (tiles * split >= (int64_t(1) << 31)) return false;
    const int64_t grid = split > 1 ? tiles * split : std::min(tiles, resident);
    // Stream-K: the plan's shared-out tiles over one CTA per SM (grid == sms, as the plan assumed),
    // the flags zeroed on the stream before the kernel.
    PrefillStreamK sk;
    if (plan.stream_k_tiles > 0 && sk_ok && grid == sms) {
      sk.flags = static_cast<uint32_t*>(ws.ptr);
      sk.part = reinterpret_cast<float4*>(static_cast<uint8_t*>(ws.ptr) + prefill_stream_k_flag_bytes(grid));
      sk.tiles = int(plan.stream_k_tiles);
      cuda::check(cudaMemsetAsync(sk.flags, 0, size_t(4 * grid), cfg.stream), "weight-only GEMM (prefill): flags");
    }
    cfg.gridDim = dim3(unsigned(grid));
    attr[0].val.clusterDim.x = unsigned(split);
    cfg.numAttrs = split > 1 ? 1 : 0;  // (a cluster dimension of 1 measured 2-7% slower than none)
    if (one_map) tx = txl;
    with_kernel(bm, bn, [&](auto kernel) {
      cuda::check(cudaLaunchKernelEx(&cfg, kernel, tx, txl, tw, tm, f, Y, bias, sk, int(N), int(M), int(K)),
                  "weight-only GEMM (prefill)");
    }, sk.tiles > 0);
    cuda::check_launch("weight-only GEMM (prefill)");
    return true;
  }
}

}  // namespace qf::gemm::cuda_wo
