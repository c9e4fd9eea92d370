// mixed2bit layout "tiled" (mixed2bit_tiled.h), the CUDA quantizer: one kernel, one warp per tile
// of 256 groups of a row (a CTA holds kTileWarps tiles; tiles are independent, as in quantize_cpu),
// then one 16-byte copy of the error flags and a stream synchronization.
//
// Lane l of a tile's warp owns the groups at positions p = l + 32 i (i = 0..7) of the tile, so
// "row" i of the warp is the tile's map word i (a ballot), its codes words are consecutive (one
// coalesced store per row at gs = 16), and positions in order are (i, then lane).
//   pass 1   per group, serially in its lane as on the CPU: min/max, range, m, score -> key
//   select   the n4-th largest key K* by a bitwise search (a warp count per bit below the top
//            bits all the tile's keys share), then the ties (key == K*) in position order by
//            ballots: is4, the map words, each 4-bit group's slot
//   order 2  each group's first-order scale (one division), maxima of the 2-bit blocks
//            (segments of B lanes, then rows for B > 32) and of the tile's 4-bit groups -> so, so4
//   pass 2   per group, the tile's values read again: sc, mc and the codes
// STAGE (16-bit inputs, gs = 16): the warp first copies its tile (8 KB) into its part of shared
// memory, every 16-byte chunk requested at once (cp.async on sm_80+), and both passes read it
// there. Read straight from global memory, the compiled loops keep one group's loads in flight
// at a time, so a lane waits for each of its 8 groups in pass 1 and again in pass 2; staged, the
// whole tile's loads are in flight together.
// Every per-group value comes from the same mixed2bit.h function, with the same arguments, that
// quantize_cpu calls, and every cross-group result is an exact count or a maximum of values
// >= +0, so the bytes equal the CPU's whatever the launch shape.
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "common/cp_async_cuda.cuh"
#include "formats/mixed2bit/mixed2bit_cuda_common.cuh"
#include "formats/mixed2bit/mixed2bit_select_cuda.cuh"
#include "formats/mixed2bit/mixed2bit_tiled.h"

namespace qf::mixed2bit::tiled {
namespace {

constexpr int kTileWarps = 8;  // tiles (warps) per CTA
constexpr int kTileThreads = 32 * kTileWarps;
constexpr int kRowsPerTile = kTileGroups / 32;  // groups per lane
static_assert(kMapBits == 32 && kTileGroups == 32 * kRowsPerTile, "a warp row of 32 groups is one map word");
constexpr int kStageBytes = kTileGroups * 16 * 2;  // a staged tile: 256 groups of 16 16-bit values

// The 16 values at x in shared memory (16-byte aligned).
template <class T>
__device__ __forceinline__ void load_shared16(const T* x, T (&v)[16]) {
  static_assert(sizeof(T) == 2, "staged tiles hold 16-bit values");
  uint4 w[2];
  w[0] = reinterpret_cast<const uint4*>(x)[0];
  w[1] = reinterpret_cast<const uint4*>(x)[1];
  memcpy(v, w, sizeof(w));
}

// Per-launch constants, computed once on the host.
struct Params {
  int64_t K, G, nt, tiles, n4_row, nb, map_words;
  int gs, b_shift, n4_full, n4_last;  // b_shift = log2(scale_block)
};

// Fields at bits 4k, 4k + 1 (k = 0..7) to bits 2k, 2k + 1: a nibble word's low or (shifted down
// by 2) high 2 bits of every code, in the layout of codes / lo.
__device__ __forceinline__ uint32_t gather2(uint32_t x) {
  x &= 0x33333333u;
  x = (x | (x >> 2)) & 0x0F0F0F0Fu;
  x = (x | (x >> 4)) & 0x00FF00FFu;
  return (x | (x >> 8)) & 0x0000FFFFu;
}

// The CPU's encode_split for 16 values: 2-bit codes (q, or q >> 2 for a 4-bit group) into *hi,
// a 4-bit group's q & 3 into *lo. The codes come from code_words16 (mixed2bit_select_cuda.cuh:
// a multiply by 1 / s_eff, the exact division where a quotient lies near k + 1/2), the global
// layout's encoder, so both layouts round alike.
template <class T>
__device__ __forceinline__ void encode16(const T (&v)[16], float s_eff, float m_eff, bool four, uint32_t* hi,
                                         uint32_t* lo) {
  uint32_t w[2];
  code_words16(v, s_eff, m_eff, four, w);
  if (four) {
    *hi = gather2(w[0] >> 2) | gather2(w[1] >> 2) << 16;
    *lo = gather2(w[0]) | gather2(w[1]) << 16;
  } else {
    *hi = w[0];
    *lo = 0u;
  }
}

// Maximum over the aligned segments of `width` lanes (a power of two <= 32): every lane ends
// with its segment's maximum. Inputs are >= +0 and never NaN (the callers fold NaN away with
// fmaxf). Such floats order as their bits do, so for segments of 16 or 32 lanes the maximum is
// one unsigned REDUX per segment (the other lanes give 0); below 16, xor shuffles, whose offsets
// below width never leave the segment.
__device__ __forceinline__ float segment_max(float v, int width) {
  if (width >= 16) {
    const unsigned b = static_cast<unsigned>(max(static_cast<int>(__float_as_uint(v)), 0));  // (-0 as +0)
    if (width == 32) return __uint_as_float(cu::warp_max_u32(b));
    const bool upper = lane_id() >= 16;
    const unsigned lo = cu::warp_max_u32(upper ? 0u : b), hi = cu::warp_max_u32(upper ? b : 0u);
    return __uint_as_float(upper ? hi : lo);
  }
  for (int o = width >> 1; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// GS: 16 (a group is one 16-value register run) or 0 (any gs, read through the helpers'
// pointer loops in pass 1 and 16 values at a time in pass 2). SENS: sensitivity scores. STAGE:
// the tile read from shared memory (GS = 16, 16-bit T, w 16-byte aligned; kStageBytes of dynamic
// shared memory per warp).
// Three CTAs (24 warps) per SM: 80 registers instead of 109, a few bytes of spills, and faster on
// an H100, level on an H200 (benchmarks/README.md, "The tiled quantizer's instructions").
template <int GS, class T, bool SENS, bool STAGE>
__global__ void
__launch_bounds__(kTileThreads, 3)
tiled_quantize_kernel(const T* __restrict__ w, const float* __restrict__ sens, Params P, Buffers out,
                      uint32_t* __restrict__ flags, bool vec, bool svec) {
  static_assert(!STAGE || (GS == 16 && sizeof(T) == 2), "staging: 16-bit values, groups of 16");
  extern __shared__ uint4 stage_mem[];
  const int64_t tile = int64_t(blockIdx.x) * kTileWarps + warp_id();
  if (tile >= P.tiles) return;  // the whole warp: every shuffle below has all 32 lanes
  const int lane = lane_id();
  const int64_t r = tile / P.nt, t = tile - r * P.nt;
  const int64_t c0 = t * kTileGroups;
  const int tg = P.G - c0 < kTileGroups ? static_cast<int>(P.G - c0) : kTileGroups;
  const int n4 = tg == kTileGroups ? P.n4_full : P.n4_last;  // dims.tile_n4(t)
  const int gs = GS > 0 ? GS : P.gs;
  const T* wrow = w + r * P.K;
  // STAGE: the tile's values (group p at p * 16), copied in 16-byte chunks
  const T* const staged = reinterpret_cast<const T*>(stage_mem + warp_id() * (kStageBytes / 16));
  if constexpr (STAGE) {
    uint4* const dst = stage_mem + warp_id() * (kStageBytes / 16);
    const uint4* const src = reinterpret_cast<const uint4*>(wrow + c0 * GS);
    const int chunks = tg * GS * static_cast<int>(sizeof(T)) / 16;
#if __CUDA_ARCH__ >= 800
    for (int k = lane; k < chunks; k += 32) cu::cp_async<16>(dst + k, src + k, true);
    cu::cp_async_commit();
    cu::cp_async_wait<0>();
#else
    for (int k = lane; k < chunks; k += 32) dst[k] = __ldcs(src + k);
#endif
    __syncwarp();
  }

  // Pass 1 (steps 1 and 3): the CPU's loop body for group p = lane + 32 i. Positions past the
  // tile get key 0, which no candidate of the search below reaches (every candidate has a bit
  // set), and range = m = 0, which no maximum notices.
  float rng[kRowsPerTile], mv[kRowsPerTile];
  uint32_t key[kRowsPerTile];
  bool bad = false;
#pragma unroll
  for (int i = 0; i < kRowsPerTile; ++i) {
    const int p = lane + 32 * i;
    rng[i] = mv[i] = 0.0f;
    key[i] = 0u;
    if (p >= tg) continue;
    const int64_t c = c0 + p;
    const T* x = wrow + c * gs;
    float mn, mx, s = 0.0f;
    if constexpr (GS > 0) {
      static_assert(GS == 16, "the registers path is for 16-value groups");
      T v[GS];
      if constexpr (STAGE) load_shared16(staged + p * GS, v);
      else cu::load_run(x, v, vec);  // cached: pass 2 reads these bytes again
      minmax16(v, &mn, &mx);         // group_min_max's result (fp16: two values per instruction)
      if constexpr (SENS) {
        float sv[GS];
        const float* sx = sens + c * GS;
        if (svec) {  // a group's 16 sensitivities are 64 bytes at a multiple of 64 from sens
          float4 f[GS / 4];
#pragma unroll
          for (int k = 0; k < GS / 4; ++k) f[k] = __ldg(reinterpret_cast<const float4*>(sx) + k);
          memcpy(sv, f, sizeof(sv));  // register to register
        } else {
#pragma unroll
          for (int k = 0; k < GS; ++k) sv[k] = __ldg(sx + k);
        }
        s = sensitivity_score(v, sv, GS);  // serial, in group order: the CPU's sum
      }
    } else {
      group_min_max(x, gs, static_cast<const int32_t*>(nullptr), 0, 0, &mn, &mx);
      if constexpr (SENS) s = sensitivity_score(x, sens + c * gs, gs);
    }
    range_m_of(mn, mx, &rng[i], &mv[i]);
    if constexpr (!SENS) s = range_score_of(mn, mx);
    if (s != s) bad = true;
    key[i] = score_order_key(s);
  }
  if (bad) flags[0] = 1u;  // a NaN score: the CPU's "too large" error (the bytes do not matter then)

  // Step 2. kstar = the largest v with count(key >= v) >= n4, built bit by bit from the top
  // (count is non-increasing in v): the n4-th largest key. Then count(key > kstar) < n4 <=
  // count(key >= kstar), and the need = n4 - count(key > kstar) first ties (key == kstar) in
  // position order complete the CPU's n4 first groups in (key descending, position ascending).
  // n4 = 0 skips the search: no key is above kstar = ~0u, and need = 0 takes no tie. Everything
  // here is warp-uniform.
  uint32_t kstar = ~0u;
  int need = 0;
  if (n4 > 0) {
    // kstar is one of the tile's keys, so it has the top bits that all of them share (those of
    // the largest and the smallest): the search starts below them.
    uint32_t kmax = 0u, kmin = ~0u;
#pragma unroll
    for (int i = 0; i < kRowsPerTile; ++i) {
      kmax = max(kmax, key[i]);
      if (lane + 32 * i < tg) kmin = min(kmin, key[i]);
    }
    kmax = cu::warp_max_u32(kmax);
    kmin = cu::warp_min_u32(kmin);
    const int common = __clz(static_cast<int>(kmax ^ kmin));  // 32 when all are equal
    kstar = common == 32 ? kmax : kmax & ~(0xFFFFFFFFu >> common);
    for (int b = 31 - common; b >= 0; --b) {
      const uint32_t cand = kstar | (1u << b);
      int n = 0;
#pragma unroll
      for (int i = 0; i < kRowsPerTile; ++i) n += key[i] >= cand;
      if (cu::warp_sum(n) >= n4) kstar = cand;
    }
    int gt = 0;
#pragma unroll
    for (int i = 0; i < kRowsPerTile; ++i) gt += key[i] > kstar;
    need = n4 - cu::warp_sum(gt);
  }
  // is4 bit i of `four`; map words by ballot; 4-bit slots by a running count in position order.
  const unsigned below = lanes_below();
  unsigned four = 0;
  uint32_t map_word = 0;         // word `lane` of the tile's map (lanes 0..7)
  int slot_in_tile[kRowsPerTile];  // 4-bit groups of the tile before p
  int ties = 0, n4_run = 0;
#pragma unroll
  for (int i = 0; i < kRowsPerTile; ++i) {
    const bool valid = lane + 32 * i < tg;
    const bool eq = valid && key[i] == kstar;
    const unsigned be = __ballot_sync(kFull, eq);
    const bool f = (valid && key[i] > kstar) || (eq && ties + __popc(be & below) < need);
    ties += __popc(be);
    const unsigned b4 = __ballot_sync(kFull, f);
    slot_in_tile[i] = n4_run + __popc(b4 & below);
    n4_run += __popc(b4);
    four |= static_cast<unsigned>(f) << i;
    if (lane == i) map_word = b4;
  }
  if (lane < kRowsPerTile && 32 * lane < tg) out.map[r * P.map_words + t * kRowsPerTile + lane] = map_word;

  // Step 4: each group's first-order scale, once (a division: steps 4 and 5 both use it).
  float fs[kRowsPerTile];
#pragma unroll
  for (int i = 0; i < kRowsPerTile; ++i) fs[i] = first_order_scale(rng[i], (four >> i) & 1u ? kQmax4 : kQmax2);

  // Step 4, 4-bit groups: one block per tile. fmaxf(0, x) is the CPU's `x > acc ? x : acc` from
  // acc = 0: NaN (only where an error is raised anyway) never enters a maximum.
  float a4 = 0.0f, z4 = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerTile; ++i) {
    if (!((four >> i) & 1u)) continue;
    a4 = fmaxf(a4, fs[i]);
    z4 = fmaxf(z4, mv[i]);
  }
  a4 = segment_max(a4, 32);
  z4 = segment_max(z4, 32);
  const uint16_t d4 = second_order_bits(a4, kS4), dm4 = second_order_bits(z4, kS4);
  bool too_large = fp16_not_finite(d4) || fp16_not_finite(dm4);
  if (lane == 0) {
    half_t* so4 = out.so4 + (r * P.nt + t) * 2;
    so4[0].bits = d4;
    so4[1].bits = dm4;
  }

  // Step 4, 2-bit groups: blocks of B = 2^b_shift positions (B divides 256). Position p's block
  // is p >> b_shift: for B <= 32 an aligned segment of B lanes of one row, for B > 32 whole
  // rows i with the same i >> (b_shift - 5). Each lane keeps its own groups' pairs (d2, dm2) for
  // pass 2; the lane at a block's first position (p % B == 0) stores it.
  const int B = 1 << P.b_shift;
  float a2[kRowsPerTile], z2[kRowsPerTile];
#pragma unroll
  for (int i = 0; i < kRowsPerTile; ++i) {
    const bool two = !((four >> i) & 1u);  // positions past the tile have range = m = 0
    a2[i] = segment_max(two ? fmaxf(0.0f, fs[i]) : 0.0f, B < 32 ? B : 32);
    z2[i] = segment_max(two ? fmaxf(0.0f, mv[i]) : 0.0f, B < 32 ? B : 32);
  }
  if (B > 32) {  // combine the rows of each block (unrolled: the arrays stay in registers)
    const int rs = P.b_shift - 5;
    float ra[kRowsPerTile], rz[kRowsPerTile];
#pragma unroll
    for (int i = 0; i < kRowsPerTile; ++i) {
      ra[i] = a2[i];
      rz[i] = z2[i];
    }
#pragma unroll
    for (int i = 0; i < kRowsPerTile; ++i) {
#pragma unroll
      for (int j = 0; j < kRowsPerTile; ++j) {
        if ((i >> rs) != (j >> rs)) continue;
        a2[i] = fmaxf(a2[i], ra[j]);
        z2[i] = fmaxf(z2[i], rz[j]);
      }
    }
  }
  uint16_t d2[kRowsPerTile], dm2[kRowsPerTile];
#pragma unroll
  for (int i = 0; i < kRowsPerTile; ++i) {
    d2[i] = second_order_bits(a2[i], kS2);
    dm2[i] = second_order_bits(z2[i], kS2);
    const int p = lane + 32 * i;
    if (p < tg && (p & (B - 1)) == 0) {
      half_t* so = out.so + (r * P.nb + ((c0 + p) >> P.b_shift)) * 2;
      so[0].bits = d2[i];
      so[1].bits = dm2[i];
      too_large = too_large || fp16_not_finite(d2[i]) || fp16_not_finite(dm2[i]);
    }
  }
  if (too_large) flags[0] = 1u;

  // Pass 2 (steps 4 and 5): sc, mc against the group's pair, then the codes, 16 values at a time.
  const int wpg = (GS > 0 ? GS : gs) / kCodes2PerWord;  // a constant 1 for GS = 16: the loads of the unrolled loop can batch
  const int64_t slot0 = r * P.n4_row + t * P.n4_full;  // dims.tile_slot0(t) within row r
#pragma unroll
  for (int i = 0; i < kRowsPerTile; ++i) {
    const int p = lane + 32 * i;
    if (p >= tg) continue;
    const int64_t c = c0 + p;
    const bool f = (four >> i) & 1u;
    const uint16_t d = f ? d4 : d2[i], dm = f ? dm4 : dm2[i];
    const int S = f ? kS4 : kS2;
    const int sc = param_code(fs[i], fp16_bits_to_fp32(d), S);
    const int mc = param_code(mv[i], fp16_bits_to_fp32(dm), S);
    const float s_eff = effective(d, sc), m_eff = effective(dm, mc);
    const int64_t slot = slot0 + slot_in_tile[i];
    const T* x = wrow + c * gs;
    uint32_t* hi = out.codes + (r * P.K + c * gs) / kCodes2PerWord;
    uint32_t* lo = out.lo + slot * wpg;
    for (int k = 0; k < wpg; ++k) {
      T v[kCodes2PerWord];
      if constexpr (STAGE) load_shared16(staged + p * GS + k * kCodes2PerWord, v);
      else cu::load_run<true>(x + k * kCodes2PerWord, v, vec);  // evict-first: the last read
      uint32_t h, l;
      encode16(v, s_eff, m_eff, f, &h, &l);
      hi[k] = h;
      if (f) lo[k] = l;
    }
    if (f) {
      out.scales[r * P.G + c] = static_cast<uint8_t>(sc);
      out.mc4[slot] = static_cast<uint8_t>(mc);
    } else {
      out.scales[r * P.G + c] = static_cast<uint8_t>(sc | (mc << 4));
    }
  }
}

// The one synchronization: the error flags.
void finish(uint32_t* fl, cudaStream_t s) {
  uint32_t host_flags[kFlagsBytes / sizeof(uint32_t)] = {};
  cu::check(cudaMemcpyAsync(host_flags, fl, sizeof(host_flags), cudaMemcpyDeviceToHost, s),
            "mixed2bit tiled: copy flags");
  cu::check(cudaStreamSynchronize(s), "mixed2bit tiled quantize");
  if (host_flags[0]) throw std::invalid_argument(kTooLargeMessage);
}

}  // namespace

template <class T>
void quantize_cuda(const T* w, const float* sens, const Dims& d, const Buffers& out, void* flags, void* stream) {
  check_dims(d);
  if (d.rows == 0 || d.K == 0) return;  // every buffer is empty
  if (flags == nullptr) throw std::invalid_argument("mixed2bit tiled (CUDA): no flags workspace");
  const cudaStream_t s = cu::stream(stream);
  Params P;
  P.K = d.K;
  P.G = d.groups_per_row();
  P.nt = d.tiles_per_row();
  P.tiles = d.rows * P.nt;
  P.n4_row = d.n4_row();
  P.nb = d.blocks_per_row();
  P.map_words = d.map_words();
  P.gs = static_cast<int>(d.group_size);
  P.b_shift = 0;
  while ((int64_t(1) << P.b_shift) < d.scale_block) ++P.b_shift;  // a power of two (check_dims)
  P.n4_full = static_cast<int>(d.n4_full);
  P.n4_last = static_cast<int>(d.n4_last);
  auto* fl = static_cast<uint32_t*>(flags);
  cu::check(cudaMemsetAsync(fl, 0, kFlagsBytes, s), "mixed2bit tiled: clear flags");

  // Every group (and its 16-value chunks) starts at a multiple of 16 * sizeof(T) >= 32 bytes from
  // w, and its sensitivities at a multiple of 64 bytes from sens: the base pointers decide.
  const bool vec = cu::aligned16(w), svec = cu::aligned16(sens);
  const unsigned grid = cu::grid_for(P.tiles, kTileWarps);
  auto launch = [&](auto kernel, int smem) {
    if (smem > 0)
      cu::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                "mixed2bit tiled quantize: shared memory");
    kernel<<<grid, kTileThreads, smem, s>>>(w, sens, P, out, fl, vec, svec);
    cu::check_launch("mixed2bit tiled quantize kernel");
  };
  if (P.gs == 16) {
    constexpr int kStaged = kTileWarps * kStageBytes;
    if constexpr (sizeof(T) == 2) {
      if (vec) {
        if (sens) launch(tiled_quantize_kernel<16, T, true, true>, kStaged);
        else launch(tiled_quantize_kernel<16, T, false, true>, kStaged);
        return finish(fl, s);
      }
    }
    if (sens) launch(tiled_quantize_kernel<16, T, true, false>, 0);
    else launch(tiled_quantize_kernel<16, T, false, false>, 0);
  } else {
    if (sens) launch(tiled_quantize_kernel<0, T, true, false>, 0);
    else launch(tiled_quantize_kernel<0, T, false, false>, 0);
  }
  finish(fl, s);
}

#define QF_INSTANTIATE(T) \
  template void quantize_cuda<T>(const T*, const float*, const Dims&, const Buffers&, void*, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::mixed2bit::tiled
