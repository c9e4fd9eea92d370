// mixed2bit CUDA quantize, group selection and encoding kernels (steps 1, 2, 4, 5, 6 of
// mixed2bit.h; the pipeline is described in mixed2bit_quantize_cuda.cu, the only includer): the
// radix select of the 4-bit groups, their slots and map, the second-order scales, the codes.
#pragma once
#include <cstdint>
#include <cstring>

#include "formats/mixed2bit/mixed2bit_cuda_common.cuh"

namespace qf::mixed2bit {
namespace {

// Shared-memory histograms. hist_add: one shared atomic per hit (bins spread out);
// hist_add_matched: one per distinct bin of the warp (all 32 lanes call it; for very hot bins).
__device__ __forceinline__ void hist_add(uint32_t* h, bool hit, unsigned bin) {
  if (hit) atomicAdd(&h[bin], 1u);
}
__device__ __forceinline__ void hist_add_matched(uint32_t* h, bool hit, unsigned bin) {
  const unsigned hits = __ballot_sync(kFull, hit);
  if (hit) {
    const unsigned peers = __match_any_sync(hits, bin);
    if (lane_id() == __ffs(peers) - 1) atomicAdd(&h[bin], static_cast<unsigned>(__popc(peers)));
  }
}

// One CTA: the digit whose bin holds the need-th (1-based) key of the histogram hist[0..NB);
// writes ctl[prefix_slot] = prefix | digit << shift and ctl[need_slot] = the rank within the bin.
template <int NB>
__device__ void pick_digit(const uint32_t* hist, uint32_t need, uint32_t* ctl, int prefix_slot, uint32_t prefix,
                           int shift, int need_slot) {
  constexpr int per = NB / kThreads;
  __shared__ int found;
  uint32_t c[per], s = 0;
#pragma unroll
  for (int i = 0; i < per; ++i) {
    c[i] = __ldcg(hist + threadIdx.x * per + i);
    s += c[i];
  }
  if (threadIdx.x == 0) found = 0;
  uint32_t total;
  const uint32_t before = cta_exclusive_sum(s, &total);  // synchronizes: `found` is cleared
  if (before < need && need <= before + s) {             // one thread when 1 <= need <= total
    uint32_t acc = before;
#pragma unroll
    for (int i = 0; i < per; ++i) {
      if (need <= acc + c[i]) {
        ctl[prefix_slot] = prefix | (static_cast<uint32_t>(threadIdx.x * per + i) << shift);
        ctl[need_slot] = need - acc;
        found = 1;
        break;
      }
      acc += c[i];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && !found) ctl[kFlagInternal] = 1u;
}

// A score's selection key (ascending key = descending score). A NaN score raises "too large";
// its key only has to be the same in every kernel.
__device__ __forceinline__ uint32_t select_key(float s) { return s != s ? 0u : ~score_order_key(s); }

// A group's min and max (step 4's inputs) in T's own precision, which holds them exactly.
template <class T>
struct MinMax {  // half_t
  using Storage = uint32_t;
  static __device__ __forceinline__ Storage pack(float mn, float mx) {
    return fp32_to_fp16_bits(mn) | static_cast<uint32_t>(fp32_to_fp16_bits(mx)) << 16;
  }
  static __device__ __forceinline__ void unpack(Storage s, float* mn, float* mx) {
    *mn = fp16_bits_to_fp32(static_cast<uint16_t>(s & 0xFFFFu));
    *mx = fp16_bits_to_fp32(static_cast<uint16_t>(s >> 16));
  }
};
template <>
struct MinMax<bf16_t> {  // bfloat16 values are floats with 16 zero low bits
  using Storage = uint32_t;
  static __device__ __forceinline__ Storage pack(float mn, float mx) {
    return (f32_bits(mn) >> 16) | (f32_bits(mx) & 0xFFFF0000u);
  }
  static __device__ __forceinline__ void unpack(Storage s, float* mn, float* mx) {
    *mn = f32_from_bits(s << 16);
    *mx = f32_from_bits(s & 0xFFFF0000u);
  }
};
template <>
struct MinMax<float> {
  using Storage = float2;
  static __device__ __forceinline__ Storage pack(float mn, float mx) { return make_float2(mn, mx); }
  static __device__ __forceinline__ void unpack(Storage s, float* mn, float* mx) {
    *mn = s.x;
    *mx = s.y;
  }
};
template <class T>
using RM = typename MinMax<T>::Storage;

// Where the selection kernels get a group's key: the stored keys (sensitivity scores, or range
// scores when outliers change rm later), or recomputed from rm (range scores).
struct ArrayKeys {
  const uint32_t* key;
  __device__ __forceinline__ uint32_t operator()(int64_t g) const { return key[g]; }
  template <class R>
  __device__ __forceinline__ uint32_t key_of(int64_t g, const R&) const {
    return key[g];
  }
};
template <class T>
struct RangeKeys {
  const RM<T>* rm;
  __device__ __forceinline__ uint32_t operator()(int64_t g) const { return key_of(g, rm[g]); }
  __device__ __forceinline__ uint32_t key_of(int64_t, const RM<T>& r) const {
    float mn, mx;
    MinMax<T>::unpack(r, &mn, &mx);
    return select_key(range_score_of(mn, mx));
  }
};

// group_min_max without outliers for 16 values in registers: the CPU's loop keeps the first
// value when it is NaN (then every comparison fails) and otherwise ignores NaNs, and -0 is read
// as +0, so the result is min/max of the non-NaN values (IEEE minNum/maxNum, in any order), or
// NaN, NaN when the first value is NaN. fp16 does it two values per instruction.
template <class T>
__device__ __forceinline__ void minmax16(const T (&v)[16], float* mn, float* mx) {
  const float x0 = read_pos_zero(to_f32(v[0]));
  float lo = x0, hi = x0;
#pragma unroll
  for (int i = 1; i < 16; ++i) {
    const float x = read_pos_zero(to_f32(v[i]));
    lo = fminf(lo, x);
    hi = fmaxf(hi, x);
  }
  *mn = x0 != x0 ? x0 : lo;
  *mx = x0 != x0 ? x0 : hi;
}
template <>
__device__ __forceinline__ void minmax16<half_t>(const half_t (&v)[16], float* mn, float* mx) {
  uint32_t w[8];
  memcpy(w, v, sizeof(w));
  const __half2 zero = __float2half2_rn(0.0f);
  __half2 p;
  memcpy(&p, &w[0], 4);
  __half2 lo = __hadd2(p, zero), hi = lo;  // -0 + +0 = +0
#pragma unroll
  for (int i = 1; i < 8; ++i) {
    memcpy(&p, &w[i], 4);
    p = __hadd2(p, zero);
    lo = __hmin2(lo, p);  // a NaN operand yields the other one
    hi = __hmax2(hi, p);
  }
  const float x0 = to_f32(v[0]);
  *mn = x0 != x0 ? x0 : __half2float(__hmin(__low2half(lo), __high2half(lo)));
  *mx = x0 != x0 ? x0 : __half2float(__hmax(__low2half(hi), __high2half(hi)));
}

// sensitivity_score of 16 values in registers, with the group's 16 sensitivities loaded as
// four 16-byte vectors when `svec` (sens 16-byte aligned).
template <class T>
__device__ __forceinline__ float sens_score16(const T (&v)[16], const float* __restrict__ sens, bool svec) {
  float sv[16];
  if (svec) {
    float4 f[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = __ldg(reinterpret_cast<const float4*>(sens) + i);
    memcpy(sv, f, sizeof(sv));
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) sv[i] = __ldg(sens + i);
  }
  return sensitivity_score(v, sv, 16);
}

// Steps 1 and 4 (no outliers yet): rm[g], key[g] (when stored), the first digit's histogram.
template <int GS, class T, bool SENS>
__global__ void
__launch_bounds__(kThreads)
stats_kernel(const T* __restrict__ w, const float* __restrict__ sens, int64_t ng, int gs, int64_t G, bool vec,
             bool svec, uint32_t* __restrict__ key, RM<T>* __restrict__ rm, uint32_t* __restrict__ bmax,
             int64_t n_bmax, uint32_t* ctl, int64_t n4) {
  constexpr int NB = 1 << kBits1;
  __shared__ uint32_t h[NB];
  for (int i = threadIdx.x; i < NB; i += kThreads) h[i] = 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n_bmax; i += stride) bmax[i] = 0;
  __syncthreads();
  // `base` is the same for every thread of the CTA: whole warps reach hist_add.
  for (int64_t base = int64_t(blockIdx.x) * kThreads; base < ng; base += stride) {
    const int64_t g = base + threadIdx.x;
    uint32_t k = 0;
    if (g < ng) {
      float s = 0.0f, mn, mx;
      const float* srow = SENS ? sens + (g - div_index(g, G) * G) * gs : nullptr;  // g % G
      if constexpr (GS > 0) {
        static_assert(GS == 16, "the registers path is for 16-value groups");
        T v[GS];
        cu::load_run<true>(w + g * GS, v, vec);
        minmax16(v, &mn, &mx);
        if constexpr (SENS) s = sens_score16(v, srow, svec);
      } else {
        group_min_max(w + g * gs, gs, static_cast<const int32_t*>(nullptr), 0, 0, &mn, &mx);
        if constexpr (SENS) s = sensitivity_score(w + g * gs, srow, gs);
      }
      const RM<T> st = MinMax<T>::pack(mn, mx);
      rm[g] = st;
      if constexpr (!SENS) {
        MinMax<T>::unpack(st, &mn, &mx);  // exact; the later kernels see the same values
        s = range_score_of(mn, mx);
      }
      if (s != s) ctl[kFlagTooLarge] = 1u;  // 0 * inf: the CPU's "too large" error
      k = select_key(s);
      if (key) key[g] = k;
    }
    hist_add(h, g < ng, k >> kShift1);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NB; i += kThreads)
    if (h[i]) atomicAdd(&ctl[kHist1 + i], h[i]);
  if (!cta_is_last(ctl + kDone1)) return;
  if (n4 <= 0 || n4 >= ng) {  // nothing to select: no key is below 0, every key below 2^32 - 1
    if (threadIdx.x == 0) {
      ctl[kKstar] = n4 <= 0 ? 0u : 0xFFFFFFFFu;
      ctl[kNeed3] = n4 <= 0 ? 0u : 0xFFFFFFFFu;
    }
    return;
  }
  pick_digit<NB>(ctl + kHist1, static_cast<uint32_t>(n4), ctl, kPrefix1, 0u, kShift1, kNeed1);
}

// The next digit: a histogram of bits [SHIFT, SHIFT + BITS) of the keys that match the digits so far.
template <int BITS, int SHIFT, class Keys>
__global__ void __launch_bounds__(kThreads)
select_pass_kernel(Keys keys, int64_t ng, uint32_t* ctl) {
  constexpr int NB = 1 << BITS;
  constexpr bool kSecond = SHIFT == kShift2;  // else the third (last) digit
  constexpr int kHist = kSecond ? kHist2 : kHist3;
  __shared__ uint32_t h[NB];
  for (int i = threadIdx.x; i < NB; i += kThreads) h[i] = 0;
  __syncthreads();
  const uint32_t prefix = ctl[kSecond ? kPrefix1 : kPrefix2];
  const uint32_t need = ctl[kSecond ? kNeed1 : kNeed2];
  const uint32_t high = ~0u << (SHIFT + BITS);
  constexpr int kPer = 16;  // keys per thread in flight
  const int64_t stride = int64_t(gridDim.x) * kThreads * kPer;
  for (int64_t base = int64_t(blockIdx.x) * kThreads * kPer; base < ng; base += stride) {
    uint32_t k[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int64_t g = base + u * kThreads + threadIdx.x;
      k[u] = keys(g < ng ? g : ng - 1);  // unconditional loads (a branch would serialize them)
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int64_t g = base + u * kThreads + threadIdx.x;
      hist_add(h, g < ng && (k[u] & high) == prefix, (k[u] >> SHIFT) & (NB - 1));
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NB; i += kThreads)
    if (h[i]) atomicAdd(&ctl[kHist + i], h[i]);
  if (!cta_is_last(ctl + (kSecond ? kDone2 : kDone3))) return;
  pick_digit<NB>(ctl + kHist, need, ctl, kSecond ? kPrefix2 : kKstar, prefix, SHIFT, kSecond ? kNeed2 : kNeed3);
}

// Per tile: (groups with key < K*) << 32 | (groups with key == K*); local[t] = the sum over the
// CTA's earlier tiles, cta_sum[c] = the CTA's total, scanned (exclusive) by the last CTA.
template <class Keys>
__global__ void __launch_bounds__(kThreads, 4)
tile_count_kernel(Keys keys, int64_t ng, int64_t n_tiles, int64_t n4, uint32_t* ctl, ull* __restrict__ local,
                  ull* __restrict__ cta_sum) {
  __shared__ ull part[kTilesPerCta][kWarps];
  const uint32_t kstar = ctl[kKstar];
  const int64_t t0 = int64_t(blockIdx.x) * kTilesPerCta;
  uint32_t k[kTilesPerCta];  // every load in flight at once
#pragma unroll
  for (int it = 0; it < kTilesPerCta; ++it) {
    const int64_t g = (t0 + it) * kTile + threadIdx.x;
    k[it] = keys(g < ng ? g : ng - 1);  // unconditional loads (a branch would serialize them)
  }
#pragma unroll
  for (int it = 0; it < kTilesPerCta; ++it) {
    const bool valid = (t0 + it) * kTile + threadIdx.x < ng;
    const bool less = valid && k[it] < kstar, eq = valid && k[it] == kstar;
    const unsigned bl = __ballot_sync(kFull, less), be = __ballot_sync(kFull, eq);
    if (lane_id() == 0) part[it][warp_id()] = (ull(__popc(bl)) << 32) | ull(__popc(be));
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    ull v = 0;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) v += threadIdx.x < kTilesPerCta ? part[threadIdx.x][i] : 0ull;
    const ull incl = cu::warp_inclusive_sum(v);
    if (threadIdx.x < kTilesPerCta && t0 + threadIdx.x < n_tiles) local[t0 + threadIdx.x] = incl - v;
    if (threadIdx.x == 31) cta_sum[blockIdx.x] = incl;
  }
  if (!cta_is_last(ctl + kDone4)) return;
  const ull total = cta_scan_in_place(cta_sum, int64_t(gridDim.x));
  const int64_t less = int64_t(total >> 32), ties = int64_t(total & 0xFFFFFFFFull);
  if (threadIdx.x == 0 && less + min64(ties, ctl[kNeed3]) != n4) ctl[kFlagInternal] = 1u;
}

// A group's place: 4-bit or not, and its slot j in its list (all counts < 2^32). Every thread of
// the CTA calls it (tile = the CTA's 256-group tile, `base` = local[tile] + cta_off[...] loaded
// early by the caller); `valid` = g < n_groups, k = g's key.
struct Slot {
  bool four;
  uint32_t j;
};
__device__ __forceinline__ Slot group_slot(uint32_t k, bool valid, int64_t g, ull base, uint32_t kstar,
                                           uint32_t need3) {
  __shared__ uint32_t warp_counts[kWarps];
  const bool less = valid && k < kstar, eq = valid && k == kstar;
  const unsigned bl = __ballot_sync(kFull, less), be = __ballot_sync(kFull, eq);
  if (lane_id() == 0) warp_counts[warp_id()] = (__popc(bl) << 16) | __popc(be);  // <= 256 each
  uint32_t in_tile = (__popc(bl & lanes_below()) << 16) | __popc(be & lanes_below());
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kWarps; ++i)
    if (i < warp_id()) in_tile += warp_counts[i];
  __syncthreads();
  const uint32_t less_b = static_cast<uint32_t>(base >> 32), eq_b = static_cast<uint32_t>(base);
  const uint32_t ties_before = eq_b + (in_tile & 0xFFFFu);  // ties (key == K*) before g
  Slot s;
  s.four = less || (eq && ties_before < need3);
  const uint32_t n4_before = less_b + (in_tile >> 16) + min32(ties_before, need3);
  s.j = s.four ? n4_before : static_cast<uint32_t>(g) - n4_before;
  return s;
}

__device__ __forceinline__ ull tile_base(const ull* local, const ull* cta_off, int64_t tile) {
  return local[tile] + cta_off[tile / kTilesPerCta];
}

// is4[g] for the outlier kernels.
template <class Keys>
__global__ void __launch_bounds__(kThreads)
mark_kernel(Keys keys, int64_t ng, const ull* __restrict__ local, const ull* __restrict__ cta_off,
            const uint32_t* ctl, uint32_t* __restrict__ is4) {
  const int64_t tile = blockIdx.x, g = tile * kTile + threadIdx.x;
  const bool valid = g < ng;
  const Slot s = group_slot(valid ? keys(g) : 0u, valid, g, tile_base(local, cta_off, tile), ctl[kKstar], ctl[kNeed3]);
  if (valid) is4[g] = s.four ? 1u : 0u;
}

// The second order of one block from its maxima (max range, max m; >= +0, NaNs left out):
// second_order_block's d, dm (max of first_order_scale = first_order_scale of the max range:
// the rounded division is monotonic), stored in so; an inf raises "too large".
__device__ __forceinline__ void finish_block(bool four, int64_t b, float max_range, float max_m, half_t* so2,
                                             half_t* so4, uint32_t* ctl) {
  const uint16_t d = second_order_bits(first_order_scale(max_range, four ? kQmax4 : kQmax2), four ? kS4 : kS2);
  const uint16_t dm = second_order_bits(max_m, four ? kS4 : kS2);
  half_t* so = (four ? so4 : so2) + 2 * b;
  so[0].bits = d;
  so[1].bits = dm;
  if (fp16_not_finite(d) || fp16_not_finite(dm)) ctl[kFlagTooLarge] = 1u;
}

// Step 2's result and step 5, 2048 groups per CTA (8 per thread, each warp 256 consecutive
// ones): every group's slot j in its list (slot[g]) and the group map (warp ballots); the
// groups' range and m in shared memory in list-slot order, then a thread (or, for blocks of more
// than 64 groups, a warp) per second-order block that overlaps the CTA's slots takes the maxima.
// A block that lies inside the CTA's slots gets its so pair right away; one shared with a
// neighbour CTA (at most the first and the last block of each list) goes to bmax (atomicMax on
// the bits of values >= +0, cleared by the stats kernel) and is listed in bnd[4 c + k] for
// finish_kernel.
constexpr int kPlacePer = 8;
constexpr int kPlaceGroups = kThreads * kPlacePer;
constexpr uint32_t kNoBlock = 0xFFFFFFFFu;
template <class T, class Keys>
__global__ void __launch_bounds__(kThreads, 4)
place_kernel(Keys keys, const RM<T>* __restrict__ rm, int64_t ng, DivB B, int64_t n2, int64_t n4, int64_t blocks2,
             const ull* __restrict__ local, const ull* __restrict__ cta_off, uint32_t* ctl, uint32_t* __restrict__ bmax,
             uint32_t* __restrict__ bnd, uint32_t* __restrict__ slot, Buffers out) {
  __shared__ float st_r[kPlaceGroups], st_m[kPlaceGroups];
  __shared__ uint32_t warp_counts[kWarps];
  if (threadIdx.x < 4) bnd[4 * int64_t(blockIdx.x) + threadIdx.x] = kNoBlock;  // before the barrier below
  const int64_t first = int64_t(blockIdx.x) * kPlaceGroups;
  const ull base = tile_base(local, cta_off, first / kTile);
  const uint32_t kstar = ctl[kKstar], need3 = ctl[kNeed3];
  const int64_t wfirst = first + int64_t(warp_id()) * 32 * kPlacePer;
  RM<T> r[kPlacePer];
  uint32_t k[kPlacePer];
#pragma unroll
  for (int i = 0; i < kPlacePer; ++i) {
    const int64_t g = wfirst + 32 * i + lane_id();
    const int64_t gc = g < ng ? g : ng - 1;  // unconditional loads (a branch would serialize them)
    r[i] = rm[gc];
    k[i] = keys.key_of(gc, r[i]);
  }
  // (less << 16 | ties) before each group within the warp, then the warp's total.
  uint32_t before[kPlacePer], run = 0;
#pragma unroll
  for (int i = 0; i < kPlacePer; ++i) {
    const bool valid = wfirst + 32 * i + lane_id() < ng;
    const unsigned bl = __ballot_sync(kFull, valid && k[i] < kstar), be = __ballot_sync(kFull, valid && k[i] == kstar);
    before[i] = run + ((__popc(bl & lanes_below()) << 16) | __popc(be & lanes_below()));
    run += (__popc(bl) << 16) | __popc(be);
  }
  if (lane_id() == 0) warp_counts[warp_id()] = run;
  __syncthreads();
  uint32_t wbefore = 0, total = 0;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) {
    if (i < warp_id()) wbefore += warp_counts[i];
    total += warp_counts[i];
  }
  const uint32_t less_b = static_cast<uint32_t>(base >> 32), eq_b = static_cast<uint32_t>(base);
  const int64_t n4_first = int64_t(less_b) + min32(eq_b, need3);  // 4-bit groups before the CTA's
  const int64_t n4_last = int64_t(less_b) + (total >> 16) + min32(eq_b + (total & 0xFFFFu), need3);
  const int64_t groups = ng - first < kPlaceGroups ? ng - first : kPlaceGroups;
  const int64_t cnt4 = n4_last - n4_first, cnt2 = groups - cnt4;
  const int64_t j02 = first - n4_first, j04 = n4_first;  // the CTA's first slot in each list
  const int64_t map_bytes = (ng + 7) / 8;
#pragma unroll
  for (int i = 0; i < kPlacePer; ++i) {
    const int64_t g = wfirst + 32 * i + lane_id();
    const bool valid = g < ng;
    const uint32_t in = wbefore + before[i];
    const uint32_t ties_before = eq_b + (in & 0xFFFFu);
    const bool four = valid && (k[i] < kstar || (k[i] == kstar && ties_before < need3));
    // The map: these 32 groups are 4 bytes (g - lane is a multiple of 32); padding bits 0.
    const unsigned bits = __ballot_sync(kFull, four);
    const int64_t byte = (g - lane_id()) / 8 + lane_id();
    if (lane_id() < 4 && byte < map_bytes) out.group_map[byte] = static_cast<uint8_t>(bits >> (8 * lane_id()));
    if (!valid) continue;
    const int64_t n4b = int64_t(less_b) + (in >> 16) + min32(ties_before, need3);
    const int64_t j = four ? n4b : g - n4b;
    slot[g] = static_cast<uint32_t>(j);
    float mn, mx, range, m;
    MinMax<T>::unpack(r[i], &mn, &mx);
    range_m_of(mn, mx, &range, &m);
    const int64_t li = four ? cnt2 + (j - j04) : j - j02;
    st_r[li] = range;
    st_m[li] = m;
  }
  __syncthreads();
  const int64_t nb2 = cnt2 > 0 ? B.div(j02 + cnt2 - 1) - B.div(j02) + 1 : 0;
  const int64_t nb4 = cnt4 > 0 ? B.div(j04 + cnt4 - 1) - B.div(j04) + 1 : 0;
  // Task t: block B.div(j0) + t of the 2-bit list, then of the 4-bit list; its values here are
  // st_*[off + lo .. off + hi).
  struct Task {
    bool four;
    int64_t b, lo, hi, off;
  };
  auto task = [&](int64_t t) {
    Task q;
    q.four = t >= nb2;
    const int64_t j0 = q.four ? j04 : j02, c = q.four ? cnt4 : cnt2;
    q.b = B.div(j0) + (q.four ? t - nb2 : t);
    const int64_t s0 = q.b * B.B, s1 = s0 + B.B;
    q.lo = (s0 > j0 ? s0 : j0) - j0;
    q.hi = (s1 < j0 + c ? s1 : j0 + c) - j0;
    q.off = q.four ? cnt2 : 0;
    return q;
  };
  auto publish = [&](int64_t t, const Task& q, float mr, float mm) {
    const int64_t nl = q.four ? n4 : n2;
    const int64_t s0 = q.b * B.B, size = (s0 + B.B < nl ? s0 + B.B : nl) - s0;  // the block's groups
    if (q.hi - q.lo == size) {  // all of them are here
      finish_block(q.four, q.b, mr, mm, out.so2, out.so4, ctl);
      return;
    }
    const int64_t gb = (q.four ? blocks2 : 0) + q.b;
    if (mr > 0.0f) atomicMax(&bmax[2 * gb], f32_bits(mr));
    if (mm > 0.0f) atomicMax(&bmax[2 * gb + 1], f32_bits(mm));
    const bool last = t == (q.four ? nb2 + nb4 : nb2) - 1;  // else the list's first task
    bnd[4 * int64_t(blockIdx.x) + (q.four ? 2 : 0) + (last ? 1 : 0)] = static_cast<uint32_t>(gb);
  };
  const int64_t tasks = nb2 + nb4;
  if (B.B <= 64) {  // a thread per block
    for (int64_t t = threadIdx.x; t < tasks; t += kThreads) {
      const Task q = task(t);
      float mr[4] = {0.0f, 0.0f, 0.0f, 0.0f}, mm[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      int i = static_cast<int>(q.off + q.lo);
      const int e = static_cast<int>(q.off + q.hi);
      for (; i + 4 <= e; i += 4) {  // four independent chains: the shared loads overlap
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float a = st_r[i + u], z = st_m[i + u];
          mr[u] = a > mr[u] ? a : mr[u];  // NaN never wins
          mm[u] = z > mm[u] ? z : mm[u];
        }
      }
      for (; i < e; ++i) {
        const float a = st_r[i], z = st_m[i];
        mr[0] = a > mr[0] ? a : mr[0];
        mm[0] = z > mm[0] ? z : mm[0];
      }
      // no NaN left: fmaxf is the max
      publish(t, q, fmaxf(fmaxf(mr[0], mr[1]), fmaxf(mr[2], mr[3])), fmaxf(fmaxf(mm[0], mm[1]), fmaxf(mm[2], mm[3])));
    }
  } else {  // a warp per block
    for (int64_t t = warp_id(); t < tasks; t += kWarps) {
      const Task q = task(t);
      float mr = 0.0f, mm = 0.0f;
      for (int64_t i = q.off + q.lo + lane_id(); i < q.off + q.hi; i += 32) {
        const float a = st_r[i], z = st_m[i];
        mr = a > mr ? a : mr;
        mm = z > mm ? z : mm;
      }
#pragma unroll
      for (int o = 16; o; o >>= 1) {  // no NaN left: fmaxf is the max
        mr = fmaxf(mr, __shfl_xor_sync(kFull, mr, o));
        mm = fmaxf(mm, __shfl_xor_sync(kFull, mm, o));
      }
      if (lane_id() == 0) publish(t, q, mr, mm);
    }
  }
}

// The so pairs of the blocks that place_kernel's CTAs shared (listed in bnd, maybe twice: the
// same result), from their maxima in bmax.
__global__ void __launch_bounds__(kThreads)
finish_kernel(const uint32_t* __restrict__ bnd, int64_t n, int64_t blocks2, const uint32_t* __restrict__ bmax,
              half_t* so2, half_t* so4, uint32_t* ctl) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n || bnd[i] == kNoBlock) return;
  const int64_t gb = bnd[i];
  const bool four = gb >= blocks2;
  finish_block(four, four ? gb - blocks2 : gb, f32_from_bits(bmax[2 * gb]), f32_from_bits(bmax[2 * gb + 1]), so2, so4,
               ctl);
}

// Step 6 for 16 values: the codes quantize_value(x, s_eff, m_eff, qmax) gives, packed (2-bit:
// w[0]; 4-bit: w[0], w[1]), for s_eff > 0. With r = 1 / s_eff (correctly rounded) and a = x + m_eff
// clamped to [0, (qmax + 1/4) s_eff] (NaN -> 0, code 0 as clamp_code(NaN); beyond either end
// both give 0 or qmax), p = a * r (exact, inside the fma) is within 2^-23 |a / s_eff| <= 2^-19 of
// the float32 quotient, so rint(p) (the fma with 1.5 * 2^23) is the code unless p lies within
// 2^-19 of some k + 1/2; then (|p - rint(p)| > 0.49998 for some value, rare) the group takes the
// exact division. The float 1.5 * 2^23 + q has bits 0x4B400000 + q, summed shifted into the
// words and the constant offsets taken off at the end.
constexpr uint32_t kMagicBits = 0x4B400000u;
constexpr uint32_t magic_offset(int bits, int n) {
  uint32_t c = 0;
  for (int i = 0; i < n; ++i) c += kMagicBits << (bits * i);
  return c;
}
constexpr uint32_t kMagic2 = magic_offset(2, 16), kMagic4 = magic_offset(4, 8);
template <class T>
__device__ __forceinline__ void code_words16(const T* x, float s_eff, float m_eff, bool four, uint32_t* w) {
  w[0] = w[1] = 0u;
  if (!(s_eff > 0.0f)) return;
  const int qmax = four ? kQmax4 : kQmax2;
  const float r = __frcp_rn(s_eff);
  const float amax = __fmul_rn(static_cast<float>(qmax) + 0.25f, s_eff);
  uint32_t a2 = 0, a4lo = 0, a4hi = 0;
  float worst = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float a = fminf(fmaxf(__fadd_rn(to_f32(x[i]), m_eff), 0.0f), amax);
    const float big = __fmaf_rn(a, r, 12582912.0f);
    worst = fmaxf(worst, fabsf(__fmaf_rn(a, r, -__fsub_rn(big, 12582912.0f))));
    const uint32_t bits = f32_bits(big);
    a2 += bits << (2 * i);
    if (i < 8) a4lo += bits << (4 * i); else a4hi += bits << (4 * (i - 8));
  }
  if (!(worst <= 0.49998f)) {  // the exact rule (2e-5 > 2^-19 + 2^-26 from the exact quotient)
    for (int i = 0; i < 16; ++i) {
      const uint32_t q = static_cast<uint32_t>(quantize_value(to_f32(x[i]), s_eff, m_eff, qmax));
      if (four) w[i / 8] |= q << (4 * (i % 8)); else w[0] |= q << (2 * i);
    }
    return;
  }
  w[0] = four ? a4lo - kMagic4 : a2 - kMagic2;
  w[1] = four ? a4hi - kMagic4 : 0u;
}

// Steps 5 + 6, a thread per group: its slot and map bit (place_kernel), its range and m (rm),
// its block's so pair -> quantize_group's codes, written to scales and codes.
template <int GS, class T>
__global__ void __launch_bounds__(kThreads)
encode_kernel(const T* __restrict__ w, const RM<T>* __restrict__ rm, const uint32_t* __restrict__ slot, int64_t ng,
              int gs, DivB B, int64_t n2, int64_t n4, uint32_t* ctl, Buffers out, bool vec) {
  const int64_t g = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= ng) return;
  const int n = GS > 0 ? GS : gs;
  T v[GS > 0 ? GS : 16];
  if constexpr (GS > 0) cu::load_run<true>(w + g * GS, v, vec);
  const int64_t j = slot[g];
  const bool four = (out.group_map[g >> 3] >> (g & 7)) & 1u;
  float mn, mx, range, m;
  MinMax<T>::unpack(rm[g], &mn, &mx);
  range_m_of(mn, mx, &range, &m);
  if (j >= (four ? n4 : n2)) {  // impossible: the counts say otherwise
    ctl[kFlagInternal] = 1u;
    return;
  }
  const int qmax = four ? kQmax4 : kQmax2, S = four ? kS4 : kS2;
  const half_t* so = (four ? out.so4 : out.so2) + 2 * B.div(j);
  const uint16_t d = so[0].bits, dm = so[1].bits;
  // quantize_group: the second-order codes, then the codes with the effective parameters.
  const int sc = param_code(first_order_scale(range, qmax), fp16_bits_to_fp32(d), S);
  const int mc = param_code(m, fp16_bits_to_fp32(dm), S);
  const float s_eff = effective(d, sc), m_eff = effective(dm, mc);
  for (int c = 0; c < n / 16; ++c) {
    uint32_t words[2];
    if constexpr (GS > 0) {
      code_words16(v + 16 * c, s_eff, m_eff, four, words);
    } else {
      T chunk[16];
      cu::load_run(w + g * gs + 16 * c, chunk, vec);
      code_words16(chunk, s_eff, m_eff, four, words);
    }
    if (four) {
      uint32_t* dst = out.codes4 + j * (n / kCodes4PerWord) + 2 * c;
      dst[0] = words[0];
      dst[1] = words[1];
    } else {
      out.codes2[j * (n / kCodes2PerWord) + c] = words[0];
    }
  }
  if (four) {
    out.scales4[2 * j] = static_cast<uint8_t>(sc);
    out.scales4[2 * j + 1] = static_cast<uint8_t>(mc);
  } else {
    out.scales2[j] = static_cast<uint8_t>(sc | mc << 4);
  }
}

}  // namespace
}  // namespace qf::mixed2bit
