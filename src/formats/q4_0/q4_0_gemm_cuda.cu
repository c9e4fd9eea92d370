// q4_0's weight-only GEMM on the GPU (declared in formats/q4_0/q4_0_gemm_cuda.h): the policy of
// the shared drivers (gemm/weight_only_policy_cuda.cuh) that loads and decodes a block of one
// weight row to the values of q4_0's dequantize (q4_0.h), split as w = v * scale, and its
// launcher.
#include <stdexcept>
#include <type_traits>

#include "formats/q4_0/q4_0.h"
#include "formats/q4_0/q4_0_gemm_cuda.h"
#include "gemm/weight_only_policy_cuda.cuh"

namespace qf::gemm {
namespace {

using cuda_wo::hi_hi;
using cuda_wo::kMagic;
using cuda_wo::lo_lo;
using cuda_wo::magic_u4;
using cuda_wo::nibbles_lo_first;
using cuda_wo::NoShared;
using cuda_wo::word_of;
using cuda_wo::xpair_lo_first;

// q4_0 (llama.cpp block_q4_0, 18 bytes: fp16 d, 16 bytes qs): element i in the low nibble of
// qs[i], element i + 16 in the high nibble; w = (q - 8) * d. Blocks are only 2-byte aligned,
// so a lane reads its block as 9 halfwords (consecutive lanes, consecutive blocks).
struct Q4_0 {
  static constexpr int kUnit = 32;
  static constexpr bool kOffset = false;
  const uint16_t* blocks;
  int64_t nb;  // blocks per row (K / 32)
  using Shared = NoShared;
  struct RowState {
    const uint16_t* b;  // the row's first block
  };
  struct Unit {
    uint32_t h[9];  // the block's halfwords, zero-extended: d, then qs as 8 halfwords
  };
  __device__ void init(Shared&) const {}
  __device__ RowState row(int64_t m, int64_t) const { return {blocks + m * nb * 9}; }
  __device__ Unit load(RowState& rs, int64_t, int64_t u, bool) const {
    const uint16_t* b = rs.b + u * 9;
    Unit r;
#pragma unroll
    for (int i = 0; i < 9; ++i) r.h[i] = __ldg(b + i);
    return r;
  }
  __device__ float scale(const Unit& un) const { return fp16_bits_to_fp32(static_cast<uint16_t>(un.h[0])); }
  __device__ float offset(const Unit&) const { return 0.0f; }
  // qs[4j .. 4j+3] as a little-endian word
  static __device__ uint32_t qs_word(const Unit& un, int j) { return un.h[1 + 2 * j] | un.h[2 + 2 * j] << 16; }
  __device__ void decode8(const Shared&, const Unit& un, int j, float (&v)[8]) const {
    // j = 0, 1: low nibbles of qs[8j .. 8j+7]; j = 2, 3: high nibbles of qs[8(j-2) ..]
    const uint32_t w0 = qs_word(un, 2 * (j & 1)), w1 = qs_word(un, 2 * (j & 1) + 1);
    const int sh = j >= 2 ? 4 : 0;
    const uint32_t a = (w0 >> sh) & 0x0F0F0F0Fu, b = (w1 >> sh) & 0x0F0F0F0Fu;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = magic_u4(a, i) - (kMagic + 8.0f);
      v[4 + i] = magic_u4(b, i) - (kMagic + 8.0f);
    }
  }
  // Tensor-core path: word j holds qs[4j .. 4j+3]; (w >> 4i) & 0x000F000F pairs the nibbles of
  // bytes 0 and 2 (or 1 and 3): elements (4j, 4j+2), (4j+16, 4j+18), (4j+1, 4j+3), (4j+17, 4j+19).
  static constexpr bool kLut = false;
  static constexpr int kMmaMinRows = 1;
  template <class Ops>
  __host__ __device__ static constexpr bool odd_x16() {
    return Ops::kX16;
  }
  template <class Ops>
  __device__ void pairs(const uint32_t (*)[32], int, const Unit& un, int j, uint32_t (&p)[4]) const {
    Ops::nibble_pairs(qs_word(un, j), Ops::nibble_consts(8.0f, Ops::scale_fp16(un.h[0])), p);
  }
  static __device__ uint32_t xpair(const uint32_t (&x)[16], int p) {
    const int j = p / 4, i = p % 4, r = (i & 1) ? 8 + 2 * j : 2 * j;  // i = 1, 3: the high-nibble half
    return i >= 2 ? hi_hi(x[r], x[r + 1]) : lo_lo(x[r], x[r + 1]);
  }
  // Two consecutive blocks (36 bytes) start 4-byte aligned when the row's first block does and
  // u is even: with an even number of blocks per row and a 4-byte aligned W, every row's does.
  // Then a lane reads its two units as 9 words instead of 18 halfwords.
  static constexpr bool kPairLoad = true;
  static constexpr bool kContiguousSteps = false;
  static constexpr int kMaxRowGroups = 4;    // benchmarks/README.md, "Row groups"
  static constexpr int kStagedXMinRows = 2;  // benchmarks/README.md, "Activations through shared memory"
  static constexpr int kTableXMaxRows = 2;   // benchmarks/README.md, "Design measurements behind kernel choices"
  bool pair_load_ok() const { return nb % 2 == 0 && (reinterpret_cast<uintptr_t>(blocks) & 3u) == 0; }
  struct Pair {
    uint32_t w[9];  // block u: d = low half of w[0], qs = bytes 2..17; block u+1: d = high half of w[4], qs = w[5..8]
  };
  __device__ Pair load_pair(RowState& rs, int64_t u) const {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(rs.b + u * 9);
    Pair r;
#pragma unroll
    for (int i = 0; i < 9; ++i) r.w[i] = __ldg(p + i);
    return r;
  }
  template <class Ops>
  __device__ void pairs_in_pair(const Pair& pr, int i, int j, uint32_t (&p)[4]) const {
    pair_pairs<Ops>([&](int k) { return pr.w[k]; }, i, j, p);
  }
  // With nb % 8 == 0 and a 16-byte aligned W, every run of 4 pairs (8 blocks, 144 = 9 * 16 bytes)
  // starts 16-byte aligned, and its pair p (bytes 36p .. 36p + 35) lies in the 48 bytes from 32p,
  // inside the run: a lane reads those as three 16-byte loads, so that a quad's loads cover its 144
  // bytes in whole 16-byte pieces instead of 36 scattered words. The decode takes words p .. p + 8
  // of them, selected when decoded (an instruction that reads a register whose load is in flight
  // stalls the warp). Used at one activation row (see the launcher).
  bool aligned_pair_ok() const { return nb % 8 == 0 && (reinterpret_cast<uintptr_t>(blocks) & 15u) == 0; }
  struct AlignedPair {
    uint32_t l[12];  // the 48 bytes; the pair's words are l[p .. p + 8] (Pair::w)
    uint32_t p;
  };
  __device__ AlignedPair load_aligned_pair(RowState& rs, int64_t u) const {
    AlignedPair r;
    r.p = static_cast<uint32_t>(u >> 1) & 3u;
    const uint4* q = reinterpret_cast<const uint4*>(rs.b + u * 9 - 2 * r.p);  // byte 18u - 4p: 32p into the run
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const uint4 v = __ldg(q + i);
      r.l[4 * i] = v.x, r.l[4 * i + 1] = v.y, r.l[4 * i + 2] = v.z, r.l[4 * i + 3] = v.w;
    }
    return r;
  }
  template <class Ops>
  __device__ void pairs_in_aligned_pair(const AlignedPair& pr, int i, int j, uint32_t (&p)[4]) const {
    pair_pairs<Ops>(
        [&](int k) {  // l[k + p]: shifted by p & 1 words, then by p & 2
          const uint32_t a = pr.p & 1u ? pr.l[k + 1] : pr.l[k], b = pr.p & 1u ? pr.l[k + 3] : pr.l[k + 2];
          return pr.p & 2u ? b : a;
        },
        i, j, p);
  }
  // Pairs 4j .. 4j+3 of unit u + i of a pair whose word k (Pair::w's layout) is word(k).
  template <class Ops, class Word>
  static __device__ void pair_pairs(Word word, int i, int j, uint32_t (&p)[4]) {
    const uint32_t w = i == 0 ? __byte_perm(word(j), word(j + 1), 0x5432) : word(5 + j);
    const uint32_t d = i == 0 ? word(0) : word(4) >> 16;
    Ops::nibble_pairs(w, Ops::nibble_consts(8.0f, Ops::scale_fp16(d & 0xFFFFu)), p);
  }
  // The prefill kernel (gemm/weight_only_prefill_cuda.cuh, fp16 or bf16 activations): a step of 64 values
  // is two blocks, 36 bytes of a row, 4 (k % 4) bytes past a 16-byte boundary, so a 48-byte TMA box
  // from that boundary holds it (boxes start on 16-byte boundaries; the row's bytes must be a
  // multiple of 16 too, hence K % 256). d comes with the codes: no separate metadata.
  static constexpr bool kPrefill = true;
  static constexpr int kPrefillStepBytes = 36;
  static constexpr int kPrefillBoxBytes = 48;
  // From 16 rows: its tiles of 16 and 32 activation rows measured faster than the wgmma kernel on
  // the 7B shapes (benchmarks/README.md, "Prefill tiles of 16, 32 and 64 activation rows").
  static constexpr int kPrefillMinRows = 16;
  bool prefill_ok() const { return nb % 8 == 0 && cuda::aligned16(blocks); }
  const void* prefill_codes() const { return blocks; }
// (a build without sm_90a code compiles the kernel empty: the hooks below are then unused)
#pragma nv_diag_suppress 177
  // In k16 slice 2b + h (block b of the step, nibble h), lane (g, t = lane & 3) needs values 2t,
  // 2t + 1 and 2t + 8, 2t + 9 of rows r and r + 8: nibble h of qs[2t], qs[2t + 1] and of qs[2t + 8],
  // qs[2t + 9], two halfword loads per block and row. A PRMT spreads a halfword's bytes over the
  // two halves; one LOP3 keeps the low nibbles and ORs in the magic number, or keeps the high
  // nibbles and ORs in theirs (PrefillNibbles<H>: fp16 1024 + q and 64 + q, bf16 128 + q after a
  // shift); HSUB2 takes off magic + 8, HMUL2 multiplies by (d, d): 3.5 instructions per pair (4 for
  // bf16), each weight (q - 8) d rounded once (bf16: from d rounded to bf16).
  template <class H>
  __device__ void prefill_decode(const uint8_t* tile, int r, int lane, const uint32_t*, const uint32_t*,
                                 const uint32_t*, uint32_t (&a)[4][4]) const {
    using namespace cuda_wo;
    using Ops = PairOps<H>;
    using PN = PrefillNibbles<H>;
    constexpr uint32_t kLo = halves(PN::kLo, PN::kLo), kHi = halves(PN::kHi, PN::kHi);
    constexpr uint32_t kLoMask = halves(PN::kLoMask, PN::kLoMask), kHiMask = halves(PN::kHiMask, PN::kHiMask);
    constexpr uint32_t kLo8 = halves(PN::lo_minus(8), PN::lo_minus(8));
    constexpr uint32_t kHi8 = halves(PN::hi_minus(8), PN::hi_minus(8));
    const int t = lane & 3;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const uint16_t* ba = reinterpret_cast<const uint16_t*>(tile + r * kPrefillBoxBytes + 18 * b);
      const uint16_t* bb = reinterpret_cast<const uint16_t*>(tile + (r + 8) * kPrefillBoxBytes + 18 * b);
      const uint32_t da = Ops::scale_fp16(ba[0]), db = Ops::scale_fp16(bb[0]);
      const uint32_t q[4] = {__byte_perm(ba[1 + t], 0u, 0x4140u), __byte_perm(bb[1 + t], 0u, 0x4140u),
                             __byte_perm(ba[5 + t], 0u, 0x4140u), __byte_perm(bb[5 + t], 0u, 0x4140u)};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t d = e & 1 ? db : da;
        a[2 * b][e] = Ops::mul(Ops::sub(cuda::and_xor(q[e], kLoMask, kLo), kLo8), d);
        a[2 * b + 1][e] = Ops::mul(Ops::sub(cuda::and_xor(PN::hi_src(q[e]), kHiMask, kHi), kHi8), d);
      }
    }
  }
#pragma nv_diag_default 177
};

}  // namespace

template <class T>
void q4_0_gemm_cuda(const T* X, int64_t N, int64_t K, int64_t M, const q4_0::block_q4_0* W, T* Y, const T* bias,
                    GemmWorkspace ws, void* stream) {
  if (K % q4_0::QK) throw std::invalid_argument("q4_0 CUDA GEMM: K must be a multiple of 32");
  cuda_wo::launch_weight_only_any(Q4_0{reinterpret_cast<const uint16_t*>(W), K / q4_0::QK}, X, N, K, M, Y, bias, ws,
                                  stream);
}

#define QF_INSTANTIATE(T)                                                                                     \
  template void q4_0_gemm_cuda<T>(const T*, int64_t, int64_t, int64_t, const q4_0::block_q4_0*, T*, const T*, \
                                  GemmWorkspace, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::gemm
