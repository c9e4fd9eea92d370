// int4's weight-only GEMM on the GPU (declared in formats/int4/int4_gemm_cuda.h): the policy of
// the shared drivers (gemm/weight_only_policy_cuda.cuh) that loads and decodes a unit of one
// weight row to the values of int4's dequantize (int4.h), split as w = v * scale, and its
// launcher.
#include <stdexcept>
#include <type_traits>

#include "formats/int4/int4.h"
#include "formats/int4/int4_gemm_cuda.h"
#include "gemm/weight_only_policy_cuda.cuh"

namespace qf::gemm {
namespace {

using cuda_wo::hi_hi;
using cuda_wo::kMagic;
using cuda_wo::lo_lo;
using cuda_wo::magic_u4;
using cuda_wo::nibbles_lo_first;
using cuda_wo::NoShared;
using cuda_wo::PairOps;
using cuda_wo::word_of;
using cuda_wo::xpair_lo_first;

// int4 (formats/int4): element 2b in the LOW nibble; asymmetric w = (q - zero) * scale, symmetric
// codes are two's-complement nibbles, turned into q + 8 by flipping bit 3 (zero = 8).
// group_size = 32 * 2^gshift, so a unit of 32 lies in one group. kTiles: the buffers are in int4's
// "tiles" layout (int4.h: row m's group c is stored group ((m / 16) * C + c) * 16 + m % 16), so a
// row's consecutive groups are 16 groups apart; the codes of a group are the same bytes.
template <bool kTiles>
struct Int4 {
  static constexpr int kUnit = 32;
  static constexpr bool kOffset = false;
  static constexpr int64_t kGroupStep = kTiles ? int4::kTileRows : 1;  // stored groups between a row's groups
  const uint8_t* qweight;
  const float* scales;
  const uint8_t* zeros;  // nullptr: symmetric
  int64_t K;
  int gshift;
  using Shared = NoShared;
  struct RowState {
    const uint4* q;  // rows: the row's codes, 16 bytes per unit; tiles: qweight
    int64_t g0;      // stored index of the row's first group
  };
  __host__ __device__ int64_t groups_per_row() const { return K >> (gshift + 5); }
  // Row m's group c as stored.
  __host__ __device__ int64_t group(int64_t m, int64_t c) const {
    return kTiles ? int4::tiles_group(m, c, groups_per_row()) : m * groups_per_row() + c;
  }
  // Unit u (32 values) of a row: its stored group and its 16 bytes.
  __device__ int64_t unit_group(const RowState& r, int64_t u) const { return r.g0 + (u >> gshift) * kGroupStep; }
  __device__ const uint4* unit_codes(const RowState& r, int64_t u, int64_t g) const {
    if constexpr (kTiles) return r.q + (g << gshift) + (u & ((int64_t(1) << gshift) - 1));
    return r.q + u;
  }
  struct Unit {
    uint4 q;
    float scale;
    uint32_t zero;  // the stored zero point (asymmetric)
  };
  __device__ void init(Shared&) const {}
  __device__ RowState row(int64_t m, int64_t) const {
    return {reinterpret_cast<const uint4*>(kTiles ? qweight : qweight + m * K / 2), group(m, 0)};
  }
  __device__ Unit load(RowState& r, int64_t, int64_t u, bool) const {
    const int64_t g = unit_group(r, u);
    return {__ldg(unit_codes(r, u, g)), __ldg(scales + g), zeros ? __ldg(zeros + g) : 0u};
  }
  __device__ float scale(const Unit& un) const { return un.scale; }
  __device__ float offset(const Unit&) const { return 0.0f; }
  // Word j with the codes as unsigned nibbles, and the zero point.
  __device__ uint32_t word(const Unit& un, int j) const { return word_of(un.q, j) ^ (zeros ? 0u : 0x88888888u); }
  __device__ float zero(const Unit& un) const { return zeros ? static_cast<float>(un.zero) : 8.0f; }
  __device__ void decode8(const Shared&, const Unit& un, int j, float (&v)[8]) const {
    nibbles_lo_first(word(un, j), kMagic + zero(un), v);
  }
  // Tensor-core path: nibbles i and i + 4 of word j (elements 8j+i, 8j+i+4) in one magic pair.
  static constexpr bool kLut = false;
  static constexpr int kMmaMinRows = 1;
  template <class Ops>
  __host__ __device__ static constexpr bool odd_x16() {
    return Ops::kX16;
  }
  template <class Ops>
  __device__ void pairs(const uint32_t (*)[32], int, const Unit& un, int j, uint32_t (&p)[4]) const {
    Ops::nibble_pairs(word(un, j), Ops::nibble_consts(zero(un), Ops::splat(un.scale)), p);
  }
  static __device__ uint32_t xpair(const uint32_t (&x)[16], int p) { return xpair_lo_first(x, p); }
  // A lane's two units (u even) share their group when group_size >= 64 (then units per row are
  // even too): one scale and one zero load for both; measured faster on the H200 at N = 1 than a
  // load per unit (benchmarks/README.md, "Design measurements behind kernel choices").
  static constexpr bool kPairLoad = true;
  static constexpr bool kContiguousSteps = false;
  static constexpr int kMaxRowGroups = 4;    // benchmarks/README.md, "Row groups"
  static constexpr int kStagedXMinRows = 4;  // benchmarks/README.md, "Activations through shared memory"
  static constexpr int kTableXMaxRows = 1;   // benchmarks/README.md, "Design measurements behind kernel choices"
  bool pair_load_ok() const { return gshift >= 1; }
  struct Pair {
    uint4 q[2];
    float scale;
    uint32_t zero;
  };
  __device__ Pair load_pair(RowState& r, int64_t u) const {
    const int64_t g = unit_group(r, u);
    const uint4* q = unit_codes(r, u, g);  // u even: units u and u + 1 are one group's
    return {{__ldg(q), __ldg(q + 1)}, __ldg(scales + g), zeros ? __ldg(zeros + g) : 0u};
  }
  template <class Ops>
  __device__ void pairs_in_pair(const Pair& pr, int i, int j, uint32_t (&p)[4]) const {
    pairs<Ops>(nullptr, 0, Unit{pr.q[i], pr.scale, pr.zero}, j, p);
  }
  // The offset GEMV (gemm/weight_only_gemv_cuda.cuh, one fp16 row): a chunk of 128
  // values is 64 bytes of a row as stored, and groups of >= 128 give it one scale and zero point.
#pragma nv_diag_suppress 177  // (read through the HasGemv trait, which nvcc does not count)
  static constexpr bool kGemvNibbles = true;
#pragma nv_diag_default 177
  // Two rows too on the tiles layout: there it measured faster than the tensor-core driver on four
  // of five Llama shapes (0.15-2.3 us; 0.55 us slower on 4096x4096); on the rows layout the kernel
  // spills at two rows and measured mixed (benchmarks/README.md, "int4's tiles layout").
  static constexpr int kGemvMaxRows = kTiles ? 2 : 1;
  // (tiles: groups of 128 only, so that a row's next chunk is always 16 chunks on; the general
  // step costs the kernel a spill at its 64 registers)
  bool gemv_ok() const { return kTiles ? gshift == 2 : gshift >= 2; }
  __host__ __device__ const uint8_t* gemv_codes() const { return qweight; }
  __device__ const uint8_t* gemv_row(int64_t m) const { return qweight + group(m, 0) * (int64_t(16) << gshift); }
  __device__ int64_t gemv_offset(int64_t chunk) const { return chunk * kGroupStep * cuda_wo::kGemvChunkBytes; }
  __device__ int64_t gemv_meta_row(int64_t m) const { return group(m, 0); }
  __device__ cuda_wo::GemvMeta gemv_meta(int64_t row_group, int64_t chunk) const {
    const int64_t g = row_group + (kTiles ? chunk * kGroupStep : chunk >> (gshift - 2));
    return {__ldg(scales + g), zeros ? uint32_t(__ldg(zeros + g)) : 8u};
  }
  __device__ uint32_t gemv_flip() const { return zeros ? 0u : 0x88888888u; }
  // The prefill kernel (gemm/weight_only_prefill_cuda.cuh, fp16 or bf16 activations): a step of 64
  // codes is 32 bytes of a row, so the packed rows are its TMA tiles as stored; groups of >= 64
  // values hold whole steps.
  static constexpr bool kPrefill = true;
  static constexpr bool kPrefillTiledCodes = kTiles;
// (a build without sm_90a code compiles the kernel empty: the hooks below are then unused)
#pragma nv_diag_suppress 177
  static constexpr int kPrefillStepBytes = 32;
  static constexpr int kPrefillWideStages = 5;  // 0.2-3.3% faster than 4 (benchmarks/README.md)
  bool prefill_ok() const { return gshift >= 1; }
  const void* prefill_codes() const { return qweight; }
  __host__ __device__ int prefill_tile_group_bytes() const { return 16 << gshift; }  // gs / 2
  // A step's metadata: the group's scale as an H pair, and magic + zero for the decode's HSUB2,
  // loaded by the consumers a group ahead (through the copy warp it measured slower:
  // benchmarks/README.md, "Per-row metadata through the copy warp").
  static constexpr int kPrefillMetaWords = 2;
  __device__ int prefill_group_steps() const { return 1 << (gshift - 1); }
  struct PrefillMeta {
    float scale;
    uint32_t zero;  // the stored zero point; 8 for symmetric codes
  };
  __device__ PrefillMeta prefill_meta(int m, int k) const {
    const int64_t g = group(m, k >> (gshift - 1));
    return {__ldg(scales + g), zeros ? uint32_t(__ldg(zeros + g)) : 8u};
  }
  template <class H>
  __device__ void prefill_meta_words(const PrefillMeta& p, uint32_t (&w)[2]) const {
    using PN = cuda_wo::PrefillNibbles<H>;
    w[0] = cuda_wo::PairOps<H>::splat(p.scale);
    w[1] = cuda_wo::halves(PN::lo_minus(p.zero), PN::hi_minus(p.zero));
  }
  // In k16 slice j, lane (g, t = lane & 3) needs values 2t, 2t + 1 and 2t + 8, 2t + 9 of rows r and
  // r + 8: byte t of words 2j and 2j + 1 (low nibble first). PrefillNibbles<H>::byte_both puts that
  // byte's low nibble in the low half and its high nibble in the high half (fp16: a PRMT; bf16: a
  // shift and a PRMT); one LOP3 keeps them, ORs in the magic numbers (fp16 1024 + q, 64 + q; bf16
  // 128 + q) and for symmetric codes flips bit 3 of both nibbles (q + 8); HSUB2 takes off the
  // magic + z and HMUL2 multiplies by (s, s): four instructions per pair (five for bf16), each
  // weight (q - z) s rounded once to H from an H s.
  template <class H>
  __device__ void prefill_decode(const uint8_t* tile, int r, int lane, const uint32_t*, const uint32_t* wa,
                                 const uint32_t* wb, uint32_t (&a)[4][4]) const {
    using namespace cuda_wo;
    using Ops = PairOps<H>;
    using PN = PrefillNibbles<H>;
    constexpr uint32_t kMagic2 = halves(PN::kLo, PN::kHi), kMask2 = halves(PN::kLoMask, PN::kHiMask);
    const uint32_t t = lane & 3, flip = zeros ? kMagic2 : kMagic2 ^ PN::kFlip;
    const uint32_t sa = wa[0], za = wa[1], sb = wb[0], zb = wb[1];
    byte_pair_fragments(
        tile, r,
        [&](uint32_t w, int h) {
          return Ops::mul(Ops::sub(cuda::and_xor(PN::byte_both(w, t), kMask2, flip), h ? zb : za), h ? sb : sa);
        },
        a);
  }
#pragma nv_diag_default 177
};

}  // namespace

template <class T>
void int4_gemm_cuda(const T* X, int64_t N, int64_t K, int64_t M, const uint8_t* qweight, const float* scales,
                    const uint8_t* zeros, int64_t gs, T* Y, const T* bias, GemmWorkspace ws, void* stream, bool tiles) {
  if (!int4_gemm_cuda_supports(gs) || K % gs)
    throw std::invalid_argument("int4 CUDA GEMM: group_size must be 32 * 2^j dividing K");
  if (tiles && M % int4::kTileRows) throw std::invalid_argument("int4 CUDA GEMM: the tiles layout needs M % 16 == 0");
  const int gshift = log2_exact(gs / 32);
  if (tiles)
    cuda_wo::launch_weight_only_any(Int4<true>{qweight, scales, zeros, K, gshift}, X, N, K, M, Y, bias, ws, stream);
  else cuda_wo::launch_weight_only_any(Int4<false>{qweight, scales, zeros, K, gshift}, X, N, K, M, Y, bias, ws, stream);
}

#define QF_INSTANTIATE(T)                                                                                            \
  template void int4_gemm_cuda<T>(const T*, int64_t, int64_t, int64_t, const uint8_t*, const float*, const uint8_t*, \
                                  int64_t, T*, const T*, GemmWorkspace, void*, bool);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::gemm
