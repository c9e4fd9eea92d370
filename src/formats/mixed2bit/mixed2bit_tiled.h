// mixed2bit, layout "tiled": the per-group rules of mixed2bit.h (scores, first order, codes)
// with a layout made for row-wise kernels. The global layout (mixed2bit.h) picks its 4-bit groups
// over the whole matrix, so a row holds any number of them anywhere and a kernel needs a prefix
// count to find a group's codes; here every row has the same number of 4-bit groups, every
// group's position in the codes is fixed by its column, and all per-row offsets are
// multiplications.
//
// Parameters: group_size (gs, a multiple of 16 dividing K), ratio_4bit (0..1), sensitivity
// (optional float32 [K], not stored), scale_block (B, a power of two <= 256). No outliers.
//
// A row of W [rows, K] has G = K / gs groups (position c = 0..G-1 along the row), cut into tiles
// of kTileGroups = 256 consecutive groups (the last tile of a row may be shorter). B divides 256,
// so no second-order block crosses a tile.
//
// Quantization (float32, one rounding per operation, as mixed2bit.h):
// 1. Score per group: as mixed2bit.h step 1 (range, or sum of sens[k] * w^2).
// 2. Per tile of tg groups: n4t = floor(ratio_4bit * tg + 0.5) (float64) groups with the largest
//    score are 4-bit, ties to the smaller position. Every full tile has the same n4t, so every
//    row has n4_row = (G / 256) * n4t(256) + n4t(G % 256) 4-bit groups. A NaN score raises the
//    "too large" error.
// 3. First order: as mixed2bit.h step 4 without outliers (lo = min(min v, 0), hi = max v,
//    scale = (hi - lo) / qmax, m = 0 - lo).
// 4. Second order:
//    2-bit groups: per block of B consecutive positions of a row, over its 2-bit groups (4-bit
//      groups left out; an empty block has 0): d = max(scale) / 15, dm = max(m) / 15, fp16.
//    4-bit groups: per tile, over its 4-bit groups: d = max(scale) / 255, dm = max(m) / 255.
//    sc, mc = param_code(scale, d16, S), param_code(m, dm16, S) (S = 15 or 255); an inf fp16
//    raises the "too large" error.
// 5. Codes: q = quantize_value(x, d16 * sc, dm16 * mc, qmax) (mixed2bit.h step 6).
// Dequantize: x' = q * s_eff - m_eff, q the 2-bit code, or hi << 2 | lo for a 4-bit group.
//
// Buffers (C-contiguous; n4_row as above; nb = ceil(G / B); nt = ceil(G / 256)):
//
//   codes   int32   [rows, K / 16]      2 bits per value of every group: value k of the row in
//                                       word k / 16, bits 2(k%16)..+1; a 2-bit group's codes,
//                                       a 4-bit group's high bits (q >> 2)
//   scales  uint8   [rows, G]           2-bit group: sc | mc << 4 (4-bit codes); 4-bit group: sc
//                                       (8-bit code)
//   so      float16 [rows, nb, 2]       [d, dm] of the 2-bit groups of each block of B positions
//   map     uint32  [rows, ceil(G/32)]  bit c % 32 of word c / 32: group c is 4-bit (padding 0)
//   lo      int32   [rows, n4_row, gs / 16]  a 4-bit group's low bits (q & 3), the row's 4-bit
//                                       groups in position order, values as in codes
//   mc4     uint8   [rows, n4_row]      a 4-bit group's mc (8-bit code), same order
//   so4     float16 [rows, nt, 2]       [d, dm] of the 4-bit groups of each tile
//
//   a row, gs = 16:  codes  | w0 | w1 | w2 | ... |   one 32-bit word per group, at its column
//                    scales | s0 | s1 | s2 | ... |   one byte per group
//                    map    bit c: group c 4-bit; the j-th 4-bit group of the row has lo[j], mc4[j]
//
// A row-wise kernel reads codes, scales, so and map at addresses given by the column, and only
// for a 4-bit group its slot j (a popcount of the row's map words before it: the running count of
// a warp moving along the row) in lo and mc4.
//
// Stored bits per weight at the defaults (gs = 16, B = 16, ratio 0.1: n4t = 26 of 256 groups):
// codes 2, scales 8/16 = 0.5, so 32/256 = 0.125, map 1/16, and per 4-bit group lo 32 + mc4 8
// bits over 16 values, 26/256 of the groups: 0.254; so4 32 bits per 4096 values: 0.008. Total
// 2.949 (the global layout: 2.9375; the 0.5-bit scales byte of each 4-bit group holds only sc).
#pragma once
#include <cstdint>
#include <stdexcept>

#include "formats/mixed2bit/mixed2bit.h"

namespace qf::mixed2bit::tiled {

constexpr int kTileGroups = 256;  // groups per tile: the unit of the 4-bit selection and of so4
constexpr int kMapBits = 32;      // groups per map word

// Sizes of one tensor.
struct Dims {
  int64_t rows = 0, K = 0;
  int64_t group_size = kDefaultGroupSize;
  int64_t scale_block = kDefaultScaleBlock;
  int64_t n4_full = 0;  // 4-bit groups of a full tile
  int64_t n4_last = 0;  // 4-bit groups of the last, shorter tile (0 when G % 256 == 0)

  QF_HOST_DEVICE int64_t groups_per_row() const { return group_size ? K / group_size : 0; }
  QF_HOST_DEVICE int64_t tiles_per_row() const {
    return groups_per_row() / kTileGroups + (groups_per_row() % kTileGroups != 0);
  }
  QF_HOST_DEVICE int64_t n4_row() const { return (groups_per_row() / kTileGroups) * n4_full + n4_last; }
  QF_HOST_DEVICE int64_t blocks_per_row() const {
    return groups_per_row() / scale_block + (groups_per_row() % scale_block != 0);
  }
  QF_HOST_DEVICE int64_t map_words() const { return groups_per_row() / kMapBits + (groups_per_row() % kMapBits != 0); }
  QF_HOST_DEVICE int64_t words_per_group() const { return group_size / kCodes2PerWord; }
  // 4-bit groups of tile t (of tg groups) and the slot of its first one in the row
  QF_HOST_DEVICE int64_t tile_groups(int64_t t) const {
    const int64_t G = groups_per_row();
    return (t + 1) * kTileGroups <= G ? kTileGroups : G - t * kTileGroups;
  }
  QF_HOST_DEVICE int64_t tile_n4(int64_t t) const { return tile_groups(t) == kTileGroups ? n4_full : n4_last; }
  QF_HOST_DEVICE int64_t tile_slot0(int64_t t) const { return t * n4_full; }
};

QF_HOST_DEVICE int popcount32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}

// What check_map (CPU) and check_map_cuda compare with tile_n4(t): the set bits of tile t's map
// words in one row's map, or -1 when a bit past the row's last group is set (that would move a
// 4-bit group into the padding and keep the count).
QF_HOST_DEVICE int64_t tile_map_count(const uint32_t* row_map, const Dims& d, int64_t t) {
  constexpr int64_t kTileWords = kTileGroups / kMapBits;
  const int64_t words = d.map_words(), rest = d.groups_per_row() % kMapBits;
  int64_t n = 0;
  for (int64_t i = t * kTileWords; i < words && i < (t + 1) * kTileWords; ++i) {
    const uint32_t v = row_map[i];
    if (i == words - 1 && rest && (v >> rest)) return -1;
    n += popcount32(v);
  }
  return n;
}

struct Buffers {
  uint32_t* codes;
  uint8_t* scales;
  half_t* so;
  uint32_t* map;
  uint32_t* lo;
  uint8_t* mc4;
  half_t* so4;
};
struct ConstBuffers {
  const uint32_t* codes;
  const uint8_t* scales;
  const half_t* so;
  const uint32_t* map;
  const uint32_t* lo;
  const uint8_t* mc4;
  const half_t* so4;
};

// Throws std::invalid_argument unless the dims are consistent.
inline void check_dims(const Dims& d) {
  if (d.rows < 0 || d.K < 0 || d.group_size < kGroupMultiple || d.group_size % kGroupMultiple || d.K % d.group_size)
    throw std::invalid_argument("mixed2bit tiled: bad rows/K/group_size");
  if (d.scale_block < 1 || d.scale_block > kTileGroups || (d.scale_block & (d.scale_block - 1)))
    throw std::invalid_argument("mixed2bit tiled: scale_block must be a power of two <= 256");
  const int64_t rest = d.groups_per_row() % kTileGroups;
  if (d.n4_full < 0 || d.n4_full > kTileGroups)
    throw std::invalid_argument("mixed2bit tiled: n4_full out of range [0, 256]");
  if (d.n4_last < 0 || d.n4_last > rest)
    throw std::invalid_argument("mixed2bit tiled: n4_last out of range [0, groups of the last tile]");
}

// Quantize w [rows, K] into every buffer (all written). sens: float32 [K] or nullptr. Throws
// std::invalid_argument (kTooLargeMessage) for a NaN score or an inf second-order fp16.
template <class T>
void quantize_cpu(const T* w, const float* sens, const Dims& dims, const Buffers& out);

// Decode into y [rows, K] of T = float, half_t or bf16_t (float32 values rounded once to T).
// Throws std::invalid_argument when a tile's map words do not mark exactly tile_n4 groups (or
// mark padding past the row): the slots of a tile's 4-bit groups start at tile_slot0, so a map
// that breaks the count would send them into another tile's lo / mc4.
template <class T>
void dequantize_cpu(const ConstBuffers& q, const Dims& dims, T* y);

// Y [N, rows] = X [N, K] . W^T (float32), W decoded a panel of rows at a time
// (gemm/weight_only_cpu.h). Throws as dequantize_cpu.
void gemm_cpu(const float* X, int64_t N, const ConstBuffers& q, const Dims& dims, float* Y);

// CUDA, on `stream`, every pointer on the current device.
//
// mixed2bit_tiled_quantize_cuda.cu: the quantizer reads each tile of w from device memory once
// (one warp per tile; its second pass re-reads the tile from cache) and synchronizes the stream
// once at the end to raise the "too large" error; `flags` is a device workspace of kFlagsBytes.
constexpr int64_t kFlagsBytes = 16;
template <class T>
void quantize_cuda(const T* w, const float* sens, const Dims& dims, const Buffers& out, void* flags, void* stream);

// mixed2bit_tiled_cuda.cu: the dequantizer is asynchronous; a tile whose map breaks the count
// (as dequantize_cpu checks it) decodes to NaN. check_map_cuda adds to *bad_tiles (int32 on the
// device) the number of such tiles: what a caller checks once before it trusts the map, as
// the GEMM does (it clamps slots to the row, so a bad map reads no byte outside the buffers, but
// multiplies wrong values).
template <class T>
void dequantize_cuda(const ConstBuffers& q, const Dims& dims, T* y, void* stream);
void check_map_cuda(const uint32_t* map, const Dims& dims, int32_t* bad_tiles, void* stream);

// mixed2bit_tiled_gemm_cuda.cu: Y [N, rows] = X [N, K] . W^T under the contract of
// gemm/weight_only_cuda.h (X and Y of T, bias [rows] of T or nullptr), W decoded in registers.
// Needs gemm_cuda_supports(dims).
inline bool gemm_cuda_supports(const Dims& d) {
  const int64_t units = d.group_size / kCodes2PerWord;  // 16-value units per group
  // a warp step (32 units) inside one map word; 16-value units indexed in 32 bits
  return units > 0 && units <= 32 && (units & (units - 1)) == 0 && d.rows * (d.K / kCodes2PerWord) < (int64_t(1) << 32);
}
template <class T>
void gemm_cuda(const T* X, int64_t N, const ConstBuffers& q, const Dims& dims, T* Y, const T* bias, void* stream);

}  // namespace qf::mixed2bit::tiled
