// mixed2bit layout "tiled" on the GPU (mixed2bit_tiled.h): the map check and the dequantizer.
//
// One CTA of 256 threads per tile of a row. The tile's (at most 8) map words and the 4-bit
// groups before each of them go to shared memory first, so a 4-bit group's slot is a shared
// load and a popcount; the count check of the CPU (tile_map_count) runs on the same words, and a
// tile that fails it decodes to NaN. Threads then take the tile's 16-value words in order (one
// codes word in, 16 values out: the stores are the traffic, so each thread writes its values
// with 16-byte stores where y allows).
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "formats/mixed2bit/mixed2bit_tiled.h"

namespace qf::mixed2bit::tiled {
namespace {

constexpr int kThreads = 256;
constexpr int kTileWords = kTileGroups / kMapBits;  // 8

// Tile `tile` (row * tiles_per_row + t): its map words, the 4-bit groups before each word in the
// tile, and whether the tile's count is right. Called by the whole CTA; ends with a barrier.
struct TileMap {
  uint32_t word[kTileWords];
  int before[kTileWords];
  bool ok;
};
__device__ void load_tile_map(const uint32_t* __restrict__ map, const Dims& d, int64_t r, int64_t t, TileMap& sh) {
  if (threadIdx.x == 0) {
    const uint32_t* row_map = map + r * d.map_words();
    int n = 0;
    for (int i = 0; i < kTileWords; ++i) {
      const int64_t w = t * kTileWords + i;
      sh.word[i] = w < d.map_words() ? __ldg(row_map + w) : 0u;
      sh.before[i] = n;
      n += __popc(sh.word[i]);
    }
    sh.ok = tile_map_count(row_map, d, t) == d.tile_n4(t);
  }
  __syncthreads();
}

__global__ void check_map_kernel(const uint32_t* __restrict__ map, const Dims d, int32_t* bad) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, nt = d.tiles_per_row();
  if (i >= d.rows * nt) return;
  const int64_t r = i / nt, t = i % nt;
  if (tile_map_count(map + r * d.map_words(), d, t) != d.tile_n4(t)) atomicAdd(bad, 1);
}

// 16 values to y (16-byte stores when `vec`: y 16-byte aligned, so every 16-value run is).
template <class T>
__device__ __forceinline__ void store16(const T (&v)[16], T* y, bool vec) {
  if (vec) {
    constexpr int kVecs = 16 * sizeof(T) / 16;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) reinterpret_cast<uint4*>(y)[i] = reinterpret_cast<const uint4*>(v)[i];
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) y[i] = v[i];
  }
}

template <class T>
__global__ void
__launch_bounds__(kThreads) dequantize_kernel(const ConstBuffers q, const Dims d, T* __restrict__ y, bool vec) {
  __shared__ TileMap sh;
  const int64_t nt = d.tiles_per_row(), r = blockIdx.x / nt, t = blockIdx.x % nt;
  load_tile_map(q.map, d, r, t, sh);
  const int64_t K = d.K, G = d.groups_per_row(), wpg = d.words_per_group(), n4_row = d.n4_row();
  const int64_t items = d.tile_groups(t) * wpg;  // 16-value words of the tile
  T nan_t;
  from_f32(__uint_as_float(0x7FC00000u), &nan_t);
  for (int64_t i = threadIdx.x; i < items; i += kThreads) {
    const int p = static_cast<int>(i / wpg), sub = static_cast<int>(i % wpg);  // group p of the tile
    const int64_t c = t * kTileGroups + p;                                         // its column
    const int64_t word = r * (K / kCodes2PerWord) + c * wpg + sub;                // and codes word
    alignas(16) T out[16];
    if (!sh.ok) {
#pragma unroll
      for (int e = 0; e < 16; ++e) out[e] = nan_t;
    } else {
      const uint32_t mw = sh.word[p / kMapBits], below = mw & ((1u << (p % kMapBits)) - 1u);
      const bool is4 = (mw >> (p % kMapBits)) & 1u;
      const uint32_t s = __ldg(q.scales + r * G + c), hi = __ldg(q.codes + word);
      uint32_t lo = 0;
      float s_eff, m_eff;
      if (is4) {
        const int64_t slot = r * n4_row + d.tile_slot0(t) + sh.before[p / kMapBits] + __popc(below);
        const half_t* so4 = q.so4 + (r * nt + t) * 2;
        lo = __ldg(q.lo + slot * wpg + sub);
        s_eff = effective(so4[0].bits, static_cast<int>(s));
        m_eff = effective(so4[1].bits, __ldg(q.mc4 + slot));
      } else {
        const half_t* so = q.so + (r * d.blocks_per_row() + c / d.scale_block) * 2;
        s_eff = effective(so[0].bits, static_cast<int>(s & 15u));
        m_eff = effective(so[1].bits, static_cast<int>(s >> 4));
      }
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        uint32_t code = (hi >> (2 * e)) & 3u;
        if (is4) code = (code << 2) | ((lo >> (2 * e)) & 3u);
        from_f32(dequantize_value(static_cast<int>(code), s_eff, m_eff), &out[e]);
      }
    }
    store16(out, y + word * kCodes2PerWord, vec);
  }
}

}  // namespace

void check_map_cuda(const uint32_t* map, const Dims& d, int32_t* bad_tiles, void* stream) {
  check_dims(d);
  const int64_t tiles = d.rows * d.tiles_per_row();
  if (tiles == 0) return;
  check_map_kernel<<<cuda::grid_for(tiles, kThreads), kThreads, 0, cuda::stream(stream)>>>(map, d, bad_tiles);
  cuda::check_launch("mixed2bit tiled map check");
}

template <class T>
void dequantize_cuda(const ConstBuffers& q, const Dims& d, T* y, void* stream) {
  check_dims(d);
  const int64_t tiles = d.rows * d.tiles_per_row();
  if (tiles == 0) return;
  if (tiles > 0x7FFFFFFF) throw std::invalid_argument("mixed2bit tiled dequantize: more than 2^31 - 1 tiles");
  const bool vec = (reinterpret_cast<uintptr_t>(y) & 15u) == 0;
  dequantize_kernel<T><<<static_cast<unsigned>(tiles), kThreads, 0, cuda::stream(stream)>>>(q, d, y, vec);
  cuda::check_launch("mixed2bit tiled dequantize");
}

#define QF_INSTANTIATE(T) template void dequantize_cuda<T>(const ConstBuffers&, const Dims&, T*, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::mixed2bit::tiled
