// mixed2bit layout "tiled" on the GPU (mixed2bit_tiled.h): the map check and the dequantizer.
//
// Dequantize: a thread per 16-value codes word (16 values out: the stores are the traffic), a
// CTA per 128 words of one row (grid.y walks the rows), or per 64 or 256 when 128 does not
// divide the row's words in whole warps (rows of 896 words, K = 14336: CTAs of 256 left half of
// every fourth CTA idle; rows of 256 words ran 7% faster in CTAs of 128 than of 256). A warp's
// 32 words lie in one tile of one row (a tile is 256 * gs / 16 words, a multiple of 32), so the
// warp reads that tile's (at most 8) map words itself, lanes 0..7 one each, and shares them and
// their prefix counts by shuffles: no barrier, and the codes / scales / so loads, which do not
// depend on the map, are in flight while it does. Only a 4-bit group's lo / mc4 loads wait for
// the map (its slot). The count check of the CPU (tile_map_count) runs on the same words, and a
// tile that fails it decodes to NaN.
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "formats/mixed2bit/mixed2bit_cuda_common.cuh"
#include "formats/mixed2bit/mixed2bit_tiled.h"
#include "gemm/weight_only_cuda.h"

namespace qf::mixed2bit::tiled {
namespace {

constexpr int kThreads = 256;
constexpr int kTileWords = kTileGroups / kMapBits;  // 8
constexpr unsigned kAll = 0xFFFFFFFFu;

__global__ void check_map_kernel(const uint32_t* __restrict__ map, const Dims d, int32_t* bad) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, nt = d.tiles_per_row();
  if (i >= d.rows * nt) return;
  const int64_t r = i / nt, t = i % nt;
  if (tile_map_count(map + r * d.map_words(), d, t) != d.tile_n4(t)) atomicAdd(bad, 1);
}

// Per-tensor constants of the dequantizer, in 32 bits (the host checks that they fit).
struct DeqDims {
  uint32_t K16, G, wpg, nb, mw, nt, n4_row, n4_full, n4_last, rest;  // rest = G % 32
  int b_shift;                                                       // log2(scale_block)
  int wpg_shift;  // log2(wpg) when a power of two (a shift instead of a 32-bit division), else -1
  int64_t rows;
};

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
__launch_bounds__(kThreads) dequantize_kernel(const ConstBuffers q, const DeqDims d, T* __restrict__ y, bool vec) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const uint32_t w = blockIdx.x * blockDim.x + threadIdx.x;  // codes word of the row
  const uint32_t w0 = w & ~31u;                            // the warp's first word
  if (w0 >= d.K16) return;                                 // the whole warp
  const bool valid = w < d.K16;
  const uint32_t wv = valid ? w : w0;
  const uint32_t c = d.wpg_shift >= 0 ? wv >> d.wpg_shift : wv / d.wpg, sub = wv - c * d.wpg;  // group, word in it
  const uint32_t t = (d.wpg_shift >= 0 ? w0 >> d.wpg_shift : w0 / d.wpg) / kTileGroups;      // the warp's tile
  const uint32_t tile_n4 = (t + 1) * kTileGroups <= d.G ? d.n4_full : d.n4_last;
  T nan_t;
  from_f32(__uint_as_float(0x7FC00000u), &nan_t);
  for (int64_t r = blockIdx.y; r < d.rows; r += gridDim.y) {
    // Loads that do not depend on the map first.
    const uint32_t mwi = t * kTileWords + lane;  // lanes 0..7: the tile's map words
    const uint32_t mv = lane < kTileWords && mwi < d.mw ? __ldg(q.map + r * d.mw + mwi) : 0u;
    uint32_t hi = 0, s = 0, so = 0;
    if (valid) {
      hi = __ldg(q.codes + r * d.K16 + w);
      s = __ldg(q.scales + r * d.G + c);
      so = __ldg(reinterpret_cast<const uint32_t*>(q.so) + r * d.nb + (c >> d.b_shift));  // [d, dm]
    }
    const uint32_t so4 = __ldg(reinterpret_cast<const uint32_t*>(q.so4) + r * d.nt + t);
    // The tile's count (tile_map_count): prefix of the words' popcounts over lanes 0..7, and no bit
    // past the row's last group in its last word.
    int n = __popc(mv);
#pragma unroll
    for (int o = 1; o < kTileWords; o <<= 1) {
      const int up = __shfl_up_sync(kAll, n, o);
      if (lane >= o) n += up;
    }
    const bool pad = mwi == d.mw - 1 && d.rest && (mv >> d.rest);
    const bool ok = !__any_sync(kAll, pad) && static_cast<uint32_t>(__shfl_sync(kAll, n, kTileWords - 1)) == tile_n4;
    const int wl = static_cast<int>((c / kMapBits) & (kTileWords - 1));  // c's word within the tile
    const uint32_t word = __shfl_sync(kAll, mv, wl);
    const int before = __shfl_sync(kAll, n, wl) - __popc(word);
    if (!valid) continue;
    alignas(16) T out[16];
    T* dst = y + (r * d.K16 + w) * kCodes2PerWord;
    if (!ok) {
#pragma unroll
      for (int e = 0; e < 16; ++e) out[e] = nan_t;
      store16(out, dst, vec);
      continue;
    }
    const uint32_t bit = c % kMapBits;
    const bool is4 = (word >> bit) & 1u;
    uint32_t lo = 0;
    float s_eff, m_eff;
    if (is4) {  // ok: the slot lies in this tile's part of the row's lo / mc4
      const int64_t slot = r * d.n4_row + int64_t(t) * d.n4_full + before + __popc(word & ((1u << bit) - 1u));
      lo = __ldg(q.lo + slot * d.wpg + sub);
      s_eff = effective(static_cast<uint16_t>(so4), static_cast<int>(s));
      m_eff = effective(static_cast<uint16_t>(so4 >> 16), __ldg(q.mc4 + slot));
    } else {
      s_eff = effective(static_cast<uint16_t>(so), static_cast<int>(s & 15u));
      m_eff = effective(static_cast<uint16_t>(so >> 16), static_cast<int>(s >> 4));
    }
    // One code path for both kinds (a warp nearly always holds both)
    decode16_planes(hi, lo, is4, s_eff, m_eff, out);
    store16(out, dst, vec);
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
  if (d.rows == 0 || d.K == 0) return;
  const int64_t K16 = d.K / kCodes2PerWord;
  // 32-bit indices within a row (every per-row count is at most K16)
  if (K16 > 0x7FFFFFFF - kThreads) throw std::invalid_argument("mixed2bit tiled dequantize (CUDA): rows too long");
  if ((reinterpret_cast<uintptr_t>(q.so) & 3u) || (reinterpret_cast<uintptr_t>(q.so4) & 3u))
    throw std::invalid_argument("mixed2bit tiled dequantize (CUDA): so and so4 must be 4-byte aligned");
  int b_shift = 0;
  while ((int64_t(1) << b_shift) < d.scale_block) ++b_shift;  // a power of two (check_dims)
  const DeqDims dd{static_cast<uint32_t>(K16),
                   static_cast<uint32_t>(d.groups_per_row()),
                   static_cast<uint32_t>(d.words_per_group()),
                   static_cast<uint32_t>(d.blocks_per_row()),
                   static_cast<uint32_t>(d.map_words()),
                   static_cast<uint32_t>(d.tiles_per_row()),
                   static_cast<uint32_t>(d.n4_row()),
                   static_cast<uint32_t>(d.n4_full),
                   static_cast<uint32_t>(d.n4_last),
                   static_cast<uint32_t>(d.groups_per_row() % kMapBits),
                   b_shift,
                   gemm::log2_exact(d.words_per_group()),
                   d.rows};
  const bool vec = (reinterpret_cast<uintptr_t>(y) & 15u) == 0;
  const int64_t warps = (K16 + 31) / 32;  // per row
  const int threads = warps % 4 == 0 ? 128 : warps % 2 == 0 ? 64 : 256;
  const dim3 grid(cuda::grid_for(K16, threads), static_cast<unsigned>(d.rows < 65535 ? d.rows : 65535));
  dequantize_kernel<T><<<grid, threads, 0, cuda::stream(stream)>>>(q, dd, y, vec);
  cuda::check_launch("mixed2bit tiled dequantize");
}

#define QF_INSTANTIATE(T) template void dequantize_cuda<T>(const ConstBuffers&, const Dims&, T*, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::mixed2bit::tiled
