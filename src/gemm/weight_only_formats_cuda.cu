// Weight-only GEMMs of the quantized weight formats on the GPU: the format policies of
// gemm/weight_only_cuda.cuh (how a unit of one weight row is loaded and decoded) and their
// launchers (declared in gemm/weight_only_formats.h). Each policy decodes to the values of its
// format's dequantize (nf4.h, int4.h, q4_0.h, mixed2bit.h), split as w = v * scale - offset.
#include <stdexcept>
#include <type_traits>

#include "formats/nf4/nf4.h"
#include "gemm/weight_only_cuda.cuh"
#include "gemm/weight_only_formats.h"
#include "gemm/weight_only_mma_cuda.cuh"

namespace qf::gemm {
namespace {

using cuda_wo::hi_hi;
using cuda_wo::kMagic;
using cuda_wo::lo_lo;
using cuda_wo::magic_u4;

struct NoShared {};
struct NoRowState {};

// Element 2b of a word's byte b in the LOW nibble, 2b+1 in the high one (int4, mixed2bit): v[]
// gets the codes in element order as exact floats (2^23 + c) - zf.
__device__ __forceinline__ void nibbles_lo_first(uint32_t w, float zf, float (&v)[8]) {
  const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    v[2 * b] = magic_u4(lo, b) - zf;
    v[2 * b + 1] = magic_u4(hi, b) - zf;
  }
}

__device__ __forceinline__ uint32_t word_of(const uint4& q, int j) {
  return j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w;  // j is a constant after unrolling
}

// Units hold the loaded registers only: whatever depends on them (zero points, XORs, fp16
// scales) is computed when the unit is decoded, because an instruction that reads a register
// with a load in flight stalls the warp, and the loads of the next steps must stay in flight.

// nf4 (bitsandbytes): element 2b in the HIGH nibble of byte b; value CODE[c] * absmax, blocks of
// blocksize >= 32 over the flattened W, so a unit of 32 never straddles two.
struct Nf4 {
  static constexpr int kUnit = 32;
  static constexpr bool kOffset = false;
  const uint8_t* packed;
  const float* absmax;
  int64_t K;
  int log2_bs;
  struct Shared {
    float code[16];  // 16 floats in 16 banks: any lookup pattern is conflict-free
  };
  struct RowState {
    const uint4* q;  // the row's codes, 16 bytes per unit
    int64_t e0;      // index of the row's first element in the flattened W
  };
  struct Unit {
    uint4 q;
    float absmax;
  };
  __device__ void init(Shared& s) const {
    if (threadIdx.x < 16) s.code[threadIdx.x] = nf4::code_value(static_cast<int>(threadIdx.x));
  }
  __device__ RowState row(int64_t m, int64_t) const {
    return {reinterpret_cast<const uint4*>(packed + m * K / 2), m * K};
  }
  __device__ Unit load(RowState& r, int64_t, int64_t u, bool) const {
    return {__ldg(r.q + u), __ldg(absmax + ((r.e0 + u * kUnit) >> log2_bs))};
  }
  __device__ float scale(const Unit& un) const { return un.absmax; }
  __device__ float offset(const Unit&) const { return 0.0f; }
  __device__ void decode8(const Shared& s, const Unit& un, int j, float (&v)[8]) const {
    const uint32_t w = word_of(un.q, j);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      v[2 * b] = s.code[(w >> (8 * b + 4)) & 15u];
      v[2 * b + 1] = s.code[(w >> (8 * b)) & 15u];
    }
  }
  // Tensor-core path: a byte (elements 2b, 2b+1 of its word) looks up both codes at once.
  static constexpr bool kLut = true;
  static constexpr int kMmaMinRows = 2;
  template <class Ops>
  __device__ uint32_t lut_entry(int byte) const {
    return Ops::pack(nf4::code_value(byte >> 4), nf4::code_value(byte & 15));
  }
  template <class Ops>
  __host__ __device__ static constexpr bool odd_x16() { return false; }
  template <class Ops>
  __device__ void pairs(const uint32_t (*lut)[32], int lane, const Unit& un, int j, uint32_t (&p)[4]) const {
    const uint32_t w = word_of(un.q, j), s = Ops::splat(un.absmax);
#pragma unroll
    for (int b = 0; b < 4; ++b) p[b] = Ops::mul(lut[__byte_perm(w, 0, 0x4440 | b)][lane], s);
  }
  static __device__ uint32_t xpair(const uint32_t (&x)[16], int p) { return x[p]; }  // elements 2p, 2p+1
  static constexpr bool kPairLoad = false;
  static constexpr bool kContiguousSteps = false;
};

// int4 (formats/int4): element 2b in the LOW nibble; asymmetric w = (q - zero) * scale, symmetric
// codes are two's-complement nibbles, turned into q + 8 by flipping bit 3 (zero = 8).
// group_size = 32 * 2^gshift, so a unit of 32 lies in one group.
struct Int4 {
  static constexpr int kUnit = 32;
  static constexpr bool kOffset = false;
  const uint8_t* qweight;
  const float* scales;
  const uint8_t* zeros;  // nullptr: symmetric
  int64_t K;
  int gshift;
  using Shared = NoShared;
  struct RowState {
    const uint4* q;  // the row's codes, 16 bytes per unit
    int64_t g0;      // index of the row's first group
  };
  struct Unit {
    uint4 q;
    float scale;
    uint32_t zero;  // the stored zero point (asymmetric)
  };
  __device__ void init(Shared&) const {}
  __device__ RowState row(int64_t m, int64_t) const {
    return {reinterpret_cast<const uint4*>(qweight + m * K / 2), m * (K >> (gshift + 5))};
  }
  __device__ Unit load(RowState& r, int64_t, int64_t u, bool) const {
    const int64_t g = r.g0 + (u >> gshift);
    return {__ldg(r.q + u), __ldg(scales + g), zeros ? __ldg(zeros + g) : 0u};
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
  __host__ __device__ static constexpr bool odd_x16() { return Ops::kX16; }
  template <class Ops>
  __device__ void pairs(const uint32_t (*)[32], int, const Unit& un, int j, uint32_t (&p)[4]) const {
    Ops::nibble_pairs(word(un, j), Ops::nibble_consts(zero(un), Ops::splat(un.scale)), p);
  }
  static __device__ uint32_t xpair(const uint32_t (&x)[16], int p) {
    const int j = p / 4, i = p % 4;
    const uint32_t a = x[4 * j + i / 2], b = x[4 * j + 2 + i / 2];
    return i & 1 ? hi_hi(a, b) : lo_lo(a, b);
  }
  // A lane's two units (u even) share their group when group_size >= 64 (then units per row are
  // even too): one scale and one zero load for both. Measured on the H200 (g128, N = 1, with the
  // activation table; benchmarks/gemm.py): 14336x4096 18.2 -> 17.5 us, 4096x14336 17.8 -> 17.1.
  static constexpr bool kPairLoad = true;
  static constexpr bool kContiguousSteps = false;
  bool pair_load_ok() const { return gshift >= 1; }
  struct Pair {
    uint4 q[2];
    float scale;
    uint32_t zero;
  };
  __device__ Pair load_pair(RowState& r, int64_t u) const {
    const int64_t g = r.g0 + (u >> gshift);
    return {{__ldg(r.q + u), __ldg(r.q + u + 1)}, __ldg(scales + g), zeros ? __ldg(zeros + g) : 0u};
  }
  template <class Ops>
  __device__ void pairs_in_pair(const Pair& pr, int i, int j, uint32_t (&p)[4]) const {
    pairs<Ops>(nullptr, 0, Unit{pr.q[i], pr.scale, pr.zero}, j, p);
  }
};

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
  __host__ __device__ static constexpr bool odd_x16() { return Ops::kX16; }
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
    const uint32_t w = i == 0 ? __byte_perm(pr.w[j], pr.w[j + 1], 0x5432) : pr.w[5 + j];
    const uint32_t d = i == 0 ? pr.w[0] : pr.w[4] >> 16;
    Ops::nibble_pairs(w, Ops::nibble_consts(8.0f, Ops::scale_fp16(d & 0xFFFFu)), p);
  }
};

// 4-bit groups before group b (0..31) of a chunk, from the chunk's index entry (the count before
// the chunk in the low half, the chunk's map bits in the high half; weight_only_formats.h).
__device__ __forceinline__ uint32_t fours_before(uint64_t entry, uint32_t b) {
  return static_cast<uint32_t>(entry) + __popc(static_cast<uint32_t>(entry >> 32) & ((1u << b) - 1u));
}

// mixed2bit (formats/mixed2bit) on the float32 kernel: a unit is 16 values of one group (one
// codes2 word or two codes4 words); group_size = 16 * 2^ushift <= 512 so a warp's 32 units hold
// whole groups, and scale_block = 2^bshift. A lane finds its group's slot in the 2-bit or 4-bit
// list from the row's running counts plus a vote over the group starts of this warp step (the
// paper's per-row offsets); the counts start from the chunk index (weight_only_formats.h).
// w = q * s_eff - m_eff.
struct Mixed2 {
  static constexpr int kUnit = 16;
  static constexpr bool kOffset = true;
  mixed2bit::ConstBuffers q;
  const uint64_t* index;  // mixed2bit_row_index_cuda's chunk index
  int64_t G, C;           // groups and chunks per row
  int ushift, bshift;
  using Shared = NoShared;
  struct RowState {
    int64_t n4, n2;  // 4-bit / 2-bit groups before the current warp step
    uint32_t map;    // the group_map byte of this lane's group at the next load (read a step early)
  };
  // The loaded registers only (see the note at Nf4): codes, scale codes and second-order scales.
  struct Unit {
    uint32_t c0, c1;  // 4-bit: the unit's two codes4 words; 2-bit: c0 = its codes2 word
    uint32_t s0, s1;  // 4-bit: the scale and min codes (scales4); 2-bit: s0 = the packed scales2 byte
    uint32_t d, dm;   // fp16 bits of the second-order block's scale and min scale
    bool is4;
  };
  __device__ void init(Shared&) const {}
  __device__ uint32_t map_byte(int64_t m, int64_t u) const {
    const int64_t g = m * G + (u >> ushift);
    return u < (G << ushift) ? __ldg(q.group_map + (g >> 3)) : 0u;
  }
  __device__ RowState row(int64_t m, int64_t u0) const {
    const int64_t gb = u0 >> ushift;  // groups before u0 (u0 is a multiple of 32 >= a group's units)
    const int64_t n4 = fours_before(__ldg(index + m * C + (gb >> 5)), static_cast<uint32_t>(gb & 31));
    return {n4, m * G + gb - n4, map_byte(m, u0 + (threadIdx.x & 31))};
  }
  // 8 2-bit fields in the low 16 bits -> 8 nibbles (field i to bits 4i..4i+3).
  static __device__ __forceinline__ uint32_t spread2(uint32_t x) {
    x &= 0xFFFFu;
    x = (x | (x << 8)) & 0x00FF00FFu;
    x = (x | (x << 4)) & 0x0F0F0F0Fu;
    return (x | (x << 2)) & 0x33333333u;
  }
  __device__ Unit load(RowState& rs, int64_t m, int64_t u, bool valid) const {
    const int sub = static_cast<int>(u & ((1 << ushift) - 1));
    const int64_t g = m * G + (u >> ushift);
    const bool start = valid && sub == 0;
    const bool is4 = valid && ((rs.map >> (g & 7)) & 1u);
    // The map byte for this lane's unit of the next step (lanes past the end got u0 = u & ~31).
    rs.map = map_byte(m, (u & ~int64_t(31)) + (threadIdx.x & 31) + 32);
    const uint32_t m4 = __ballot_sync(0xFFFFFFFFu, start && is4);
    const uint32_t m2 = __ballot_sync(0xFFFFFFFFu, start && !is4);
    const uint32_t before = (1u << ((threadIdx.x & 31) - sub)) - 1u;  // group starts before ours
    const int64_t i4 = rs.n4 + __popc(m4 & before), i2 = rs.n2 + __popc(m2 & before);
    rs.n4 += __popc(m4);
    rs.n2 += __popc(m2);
    Unit r{0u, 0u, 0u, 0u, 0u, 0u, false};  // decodes to 0 with scale and offset 0
    if (!valid) return r;
    r.is4 = is4;
    const half_t* so;  // [d, dm] of the group's second-order block
    if (is4) {
      const uint32_t* c = q.codes4 + ((i4 << ushift) + sub) * 2;
      r.c0 = __ldg(c);
      r.c1 = __ldg(c + 1);
      r.s0 = __ldg(q.scales4 + 2 * i4);
      r.s1 = __ldg(q.scales4 + 2 * i4 + 1);
      so = q.so4 + 2 * (i4 >> bshift);
    } else {
      r.c0 = __ldg(q.codes2 + (i2 << ushift) + sub);
      r.s0 = __ldg(q.scales2 + i2);
      so = q.so2 + 2 * (i2 >> bshift);
    }
    r.d = __ldg(&so[0].bits);
    r.dm = __ldg(&so[1].bits);
    return r;
  }
  // s_eff = d16 * sc, m_eff = dm16 * mc: the format's float32 products
  __device__ float scale(const Unit& un) const {
    return fp16_bits_to_fp32(static_cast<uint16_t>(un.d)) * static_cast<float>(un.is4 ? un.s0 : un.s0 & 15u);
  }
  __device__ float offset(const Unit& un) const {
    return fp16_bits_to_fp32(static_cast<uint16_t>(un.dm)) * static_cast<float>(un.is4 ? un.s1 : un.s0 >> 4);
  }
  __device__ void decode8(const Shared&, const Unit& un, int j, float (&v)[8]) const {
    const uint32_t w = un.is4 ? (j == 0 ? un.c0 : un.c1) : spread2(j == 0 ? un.c0 : un.c0 >> 16);
    nibbles_lo_first(w, kMagic, v);
  }
};

// mixed2bit on the tensor-core kernel (16-bit activations, sm_80+). A lane's unit is 16 values
// of one group; warps take contiguous runs of K, so a lane's units only move forward and its
// chunk-index entry (the 4-bit count before the chunk and the chunk's 32 map bits) changes once
// per 32 groups, with the next entry loaded a chunk ahead: each unit then finds its slot in the
// 2-bit or 4-bit list with a popcount, no vote and no dependent load. Both kinds decode the same
// way: a byte permute puts the unit's fields for values (8j + i, 8j + i + 4) at bits (s i, 16 +
// s i) of one word (s = 4 for codes4, 2 for codes2; i = 0..3), a LOP3 ORs each pair into the
// magic, HSUB2 takes the magic away exactly, and HFMA2 gives q * s_eff - m_eff rounded once to
// the 16-bit type (as dequantize followed by F.linear would round it, up to the fp16 rounding of
// s_eff and m_eff).
struct Mixed2Mma {
  static constexpr int kUnit = 16;
  static constexpr bool kLut = false;
  static constexpr bool kPairLoad = false;
  static constexpr bool kContiguousSteps = true;
  mixed2bit::ConstBuffers q;
  const uint64_t* index;
  int64_t G, C;
  int ushift, bshift;
  // Index arithmetic in 32 bits: mixed2bit_gemm_cuda_supports keeps rows * K / 16 below 2^32.
  struct RowState {
    const uint64_t* entries;  // the row's chunk entries
    uint32_t g0, chunk;       // the row's first group id; the chunk of cur
    uint64_t cur, next;       // entries of chunks `chunk` and chunk + 1
  };
  struct Unit {
    uint32_t c0, c1;  // 4-bit: the two codes4 words; 2-bit: c0 = the codes2 word, c1 = 0
    uint32_t sc;      // 4-bit: scales4's [sc, mc] as a halfword; 2-bit: the scales2 byte
    uint32_t so;      // the second-order [d, dm] (fp16 bits)
    bool is4;
  };
  __device__ RowState row(int64_t m, int64_t u0) const {
    uint32_t ch = static_cast<uint32_t>((u0 >> ushift) >> 5);
    ch = ch < C ? ch : static_cast<uint32_t>(C - 1);  // a warp without steps: any entry (ch + 1 <= C stays in the index)
    const uint64_t* e = index + m * C;
    return {e, static_cast<uint32_t>(m * G), ch, __ldg(e + ch), __ldg(e + ch + 1)};
  }
  __device__ Unit load(RowState& rs, int64_t, int64_t u64, bool) const {
    const uint32_t u = static_cast<uint32_t>(u64), c = u >> ushift, ch = c >> 5;
    if (ch != rs.chunk) {  // forward by one chunk (the steps of a warp are contiguous and chunk-aligned)
      rs.cur = rs.next;
      rs.next = __ldg(rs.entries + ch + 1);
      rs.chunk = ch;
    }
    const uint32_t b = c & 31u, i4 = fours_before(rs.cur, b), i2 = rs.g0 + c - i4;  // 4-/2-bit groups before
    Unit r;
    r.is4 = (rs.cur >> (32 + b)) & 1u;
    const uint32_t i = r.is4 ? i4 : i2, w = (i << ushift) + (u & ((1u << ushift) - 1u));  // group; its unit's word
    // Branch-free: one address per array, the second codes word and scale byte only for 4-bit.
    const uint32_t* cp = r.is4 ? q.codes4 + 2 * size_t(w) : q.codes2 + w;
    r.c0 = __ldg(cp);
    r.c1 = r.is4 ? __ldg(cp + 1) : 0u;
    const uint8_t* sp = r.is4 ? q.scales4 + 2 * size_t(i) : q.scales2 + i;
    r.sc = r.is4 ? uint32_t(__ldg(reinterpret_cast<const uint16_t*>(sp))) : uint32_t(__ldg(sp));
    r.so = __ldg(reinterpret_cast<const uint32_t*>(r.is4 ? q.so4 : q.so2) + (i >> bshift));
    return r;
  }
  template <class Ops>
  __host__ __device__ static constexpr bool odd_x16() { return false; }
  template <class Ops>
  __device__ void pairs(const uint32_t (*)[32], int, const Unit& un, int j, uint32_t (&p)[4]) const {
    // s_eff = d16 * sc and m_eff = dm16 * mc in float32, as the format computes them
    const uint32_t sc = un.is4 ? un.sc & 0xFFu : un.sc & 15u, mc = un.is4 ? un.sc >> 8 : (un.sc >> 4) & 15u;
    const float s = fp16_bits_to_fp32(static_cast<uint16_t>(un.so)) * static_cast<float>(sc);
    const float mo = fp16_bits_to_fp32(static_cast<uint16_t>(un.so >> 16)) * static_cast<float>(mc);
    const uint32_t s2 = Ops::splat(s), nm2 = Ops::splat(-mo);
    // codes4: word j as it is; codes2: bytes 2j, 2j + 1 (values 8j..8j+3, 8j+4..8j+7) to bytes 0, 2
    const uint32_t w = __byte_perm(un.c0, un.c1, un.is4 ? (j ? 0x7654u : 0x3210u) : (j ? 0x3322u : 0x1100u));
    const int sh = un.is4 ? 4 : 2;
    const uint32_t mask = un.is4 ? 0x000F000Fu : 0x00030003u;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      p[i] = Ops::fma(Ops::sub(cuda_wo::and_or(w >> (sh * i), mask, Ops::kMagic), Ops::kMagic), s2, nm2);
  }
  static __device__ uint32_t xpair(const uint32_t (&x)[16], int p) { return Int4::xpair(x, p); }
};

// One warp per row: each chunk's 32 map bits by a vote, and their count in the low half (the
// scan below turns the counts into the exclusive prefix). The last warp writes the final entry.
__global__ void chunk_bits_kernel(const uint8_t* __restrict__ map, int64_t rows, int64_t G, int64_t C,
                                  uint64_t* __restrict__ out) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t i = 32 * c + lane, g = r * G + i;
    const bool bit = i < G && ((__ldg(map + (g >> 3)) >> (g & 7)) & 1u);
    const uint32_t bits = __ballot_sync(0xFFFFFFFFu, bit);
    if (lane == 0) out[r * C + c] = uint64_t(__popc(bits)) | uint64_t(bits) << 32;
  }
  if (r == rows - 1 && lane == 0) out[rows * C] = 0;
}

// In-place exclusive scan of the low 32 bits of out[0 .. n) (the high halves kept) by one CTA of
// 1024 threads: each thread scans a contiguous run, after a Hillis-Steele scan of the run totals.
__global__ void __launch_bounds__(1024) scan_low_kernel(uint64_t* __restrict__ out, int64_t n) {
  __shared__ uint64_t part[1024];
  const int64_t per = (n + 1023) / 1024, i0 = threadIdx.x * per, i1 = i0 + per < n ? i0 + per : n;
  uint64_t s = 0;
  for (int64_t i = i0; i < i1; ++i) s += out[i] & 0xFFFFFFFFu;
  part[threadIdx.x] = s;
  __syncthreads();
  for (int o = 1; o < 1024; o <<= 1) {
    const uint64_t v = threadIdx.x >= o ? part[threadIdx.x - o] : 0;
    __syncthreads();
    part[threadIdx.x] += v;
    __syncthreads();
  }
  s = threadIdx.x ? part[threadIdx.x - 1] : 0;  // total before this thread's run
  for (int64_t i = i0; i < i1; ++i) {
    const uint64_t v = out[i];
    out[i] = (v & 0xFFFFFFFF00000000ull) | s;  // s < 2^32: the GEMM takes fewer than 2^32 groups
    s += v & 0xFFFFFFFFu;
  }
}

// 16-bit activations on sm_80+: the tensor-core kernel (one decode serves up to 16 rows), from
// N = Fmt::kMmaMinRows. Otherwise (float32 activations, an older GPU, nf4 at N = 1) the float32
// kernel; for nf4 at one row it measured faster on the H200 (the tensor-core kernel builds its
// pair table in every CTA).
template <class Fmt, class T>
void launch(const Fmt& f, const T* X, int64_t N, int64_t K, int64_t M, T* Y, const T* bias, void* stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (N >= Fmt::kMmaMinRows && cuda::has_sm80_mma())
      return cuda_wo::launch_weight_only_mma(f, X, N, K, M, Y, bias, stream);
  }
  cuda_wo::launch_weight_only(f, X, N, K, M, Y, bias, stream);
}

}  // namespace

template <class T>
void nf4_gemm_cuda(const T* X, int64_t N, int64_t K, int64_t M, const uint8_t* packed, const float* absmax,
                   int64_t blocksize, T* Y, const T* bias, void* stream) {
  const int lb = log2_exact(blocksize);
  if (K % 32 || lb < 5) throw std::invalid_argument("nf4 CUDA GEMM: K must be a multiple of 32");
  launch(Nf4{packed, absmax, K, lb}, X, N, K, M, Y, bias, stream);
}

template <class T>
void int4_gemm_cuda(const T* X, int64_t N, int64_t K, int64_t M, const uint8_t* qweight, const float* scales,
                    const uint8_t* zeros, int64_t gs, T* Y, const T* bias, void* stream) {
  if (!int4_gemm_cuda_supports(gs) || K % gs)
    throw std::invalid_argument("int4 CUDA GEMM: group_size must be 32 * 2^j dividing K");
  launch(Int4{qweight, scales, zeros, K, log2_exact(gs / 32)}, X, N, K, M, Y, bias, stream);
}

template <class T>
void q4_0_gemm_cuda(const T* X, int64_t N, int64_t K, int64_t M, const q4_0::block_q4_0* W, T* Y, const T* bias,
                    void* stream) {
  if (K % q4_0::QK) throw std::invalid_argument("q4_0 CUDA GEMM: K must be a multiple of 32");
  launch(Q4_0{reinterpret_cast<const uint16_t*>(W), K / q4_0::QK}, X, N, K, M, Y, bias, stream);
}

void mixed2bit_row_index_cuda(const uint8_t* group_map, int64_t rows, int64_t G, uint64_t* index, void* stream) {
  cudaStream_t s = cuda::stream(stream);
  const int64_t C = (G + 31) / 32, n = mixed2bit_chunk_index_size(rows, G);
  if (rows > 0 && C > 0) chunk_bits_kernel<<<cuda::grid_for(rows, 8), 256, 0, s>>>(group_map, rows, G, C, index);
  else cuda::check(cudaMemsetAsync(index, 0, sizeof(uint64_t) * n, s), "mixed2bit chunk index");
  scan_low_kernel<<<1, 1024, 0, s>>>(index, n);
  cuda::check_launch("mixed2bit chunk index");
}

template <class T>
void mixed2bit_gemm_cuda(const T* X, int64_t N, const mixed2bit::ConstBuffers& q, const mixed2bit::Dims& d,
                         const uint64_t* index, T* Y, const T* bias, void* stream) {
  if (!mixed2bit_gemm_cuda_supports(d))
    throw std::invalid_argument("mixed2bit CUDA GEMM: needs group_size = 16 * 2^j <= 512, a power-of-two "
                                "scale_block, no outliers and fewer than 2^32 units of 16 values");
  const int64_t G = d.groups_per_row(), C = (G + 31) / 32;
  const int us = log2_exact(d.group_size / 16), bs = log2_exact(d.scale_block);
  if constexpr (!std::is_same_v<T, float>) {
    // the tensor-core policy reads scales4 as halfwords and so2 / so4 as words
    const bool aligned = (reinterpret_cast<uintptr_t>(q.scales4) & 1u) == 0 &&
                         (reinterpret_cast<uintptr_t>(q.so2) & 3u) == 0 && (reinterpret_cast<uintptr_t>(q.so4) & 3u) == 0;
    if (aligned && cuda::has_sm80_mma())
      return cuda_wo::launch_weight_only_mma(Mixed2Mma{q, index, G, C, us, bs}, X, N, d.K, d.rows, Y, bias, stream);
  }
  cuda_wo::launch_weight_only(Mixed2{q, index, G, C, us, bs}, X, N, d.K, d.rows, Y, bias, stream);
}

#define QF_INSTANTIATE(T)                                                                                     \
  template void nf4_gemm_cuda<T>(const T*, int64_t, int64_t, int64_t, const uint8_t*, const float*, int64_t,  \
                                 T*, const T*, void*);                                                        \
  template void int4_gemm_cuda<T>(const T*, int64_t, int64_t, int64_t, const uint8_t*, const float*,          \
                                  const uint8_t*, int64_t, T*, const T*, void*);                              \
  template void q4_0_gemm_cuda<T>(const T*, int64_t, int64_t, int64_t, const q4_0::block_q4_0*, T*, const T*, \
                                  void*);                                                                     \
  template void mixed2bit_gemm_cuda<T>(const T*, int64_t, const mixed2bit::ConstBuffers&,                     \
                                       const mixed2bit::Dims&, const uint64_t*, T*, const T*, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::gemm
