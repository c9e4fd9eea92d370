// mixed2bit CUDA codec: the steps of mixed2bit.h as a short pipeline of kernels on one stream.
// Every per-group rule is the QF_HOST_DEVICE function the CPU calls (one thread per group, so
// sums and min/max run in the CPU's order); the global steps (selection, list slots, block
// maxima) are exact integer computations (or order-free maxima of non-negative floats) whose
// result does not depend on the launch shape.
//
// Groups are handled in tiles of 256 (one CTA of 256 threads, a thread per group). A group's
// selection key is ~score_order_key(score): the n4 smallest keys, ties to the smaller id, are the
// 4-bit groups. The threshold key K* and the number need3 of ties (key == K*) taken are found by
// a radix select of 11 + 11 + 10 bits; then g is 4-bit iff key < K*, or key == K* and fewer than
// need3 ties come before it. Per-tile counts of (key < K*, key == K*) and their prefix over the
// tiles give every group its slot in its list without materializing any per-group array.
//
// Quantize (n = n_groups; scratch in the caller's workspace, one memset of a 21 KB header):
//   stats     grid-stride, thread/group   w -> min/max per group (rm, in T's precision: exact),
//             [key]; NaN score -> flag; histogram of the key's top 11 bits; the last CTA picks
//             the first digit (or settles n4 = 0 / n4 = n); zeroes the block maxima
//   select x2 grid-stride                 histograms of the next 11 and 10 bits among the keys
//             that match the digits so far; the last CTA picks the digit -> K*, need3
//   counts    CTA/16 tiles                per-tile (less, tie) counts and their prefix within the
//             CTA; the last CTA scans the CTA sums
//   -- only with outliers (element-wise, 64-bit radix select) --
//   mark      CTA/tile                    is4[g]
//   okeys, select x8, omark, scan (CUB), oscatter, ogroups (rm again for the groups with outliers)
//   --
//   place     CTA/2048 groups             slot[g] (g's index in its list), group_map (warp
//             ballots), step 5's maxima per second-order block from the groups' range and m
//             staged in list order: so2/so4 for the blocks inside the CTA, atomicMax into bmax
//             for the (at most 4) blocks it shares with a neighbour
//   finish    thread/shared block         so2/so4 of the shared blocks from bmax
//   encode    thread/group                w, slot, map bit, rm, so -> scales and codes (steps 5 +
//             6; the codes by a multiply with an exact-division fallback near k + 1/2)
//   then one 16-byte device-to-host copy of the flags and a stream synchronization.
//
// Dequantize (asynchronous):
//   counts    CTA/16 tiles                map popcount per tile, prefix within the CTA; the last
//             CTA scans the CTA sums and checks popcount == n4; outlier_idx increasing, in range
//   decode    CTA/1024 groups             warp ballots of the map bits -> each group's slot;
//                                         decode_group in float32 (2-bit codes widened to nibbles:
//                                         one code path), rounded once to T, staged per warp in
//                                         shared memory and written with 16-byte stores (all-NaN if
//                                         the check failed)
//   outliers  thread/outlier              y[idx] = float(val) rounded to T
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "formats/mixed2bit/mixed2bit.h"

namespace qf::mixed2bit {
namespace {

namespace cu = ::qf::cuda;
using ull = unsigned long long;

constexpr int kThreads = 256;              // threads per CTA
constexpr int kWarps = kThreads / 32;
constexpr int kTile = kThreads;            // groups per tile: one per thread
constexpr int kTilesPerCta = 16;           // tiles per CTA of the counting kernels
constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr int kRadix = 256;                // outlier radix select: 8 bits per pass ...
constexpr int kSelectPasses = 8;           // ... over 64-bit composite keys
constexpr int kMaxHistCtas = 1024;         // grid of an outlier histogram pass
constexpr int64_t kAlign = 256;            // alignment of every workspace region

// Group selection digits: bits 31..21, 20..10, 9..0 of the 32-bit key.
constexpr int kBits1 = 11, kShift1 = 21, kBits2 = 11, kShift2 = 10, kBits3 = 10, kShift3 = 0;

// The control words at the start of the workspace (uint32, cleared by one memset per call).
enum : int {
  kFlagTooLarge = 0, kFlagInternal = 1, kFlagBad = 2,  // error flags, copied back by quantize
  kDone1 = 4, kDone2 = 5, kDone3 = 6, kDone4 = 7,       // "last CTA" counters, one per kernel
  kPrefix1 = 8, kNeed1 = 9, kPrefix2 = 10, kNeed2 = 11, kKstar = 12, kNeed3 = 13,
  kHist1 = 16, kHist2 = kHist1 + (1 << kBits1), kHist3 = kHist2 + (1 << kBits2),
  kCtlWords = kHist3 + (1 << kBits3),
  kCtlWordsDequantize = 16,
};

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31u); }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x >> 5); }
__device__ __forceinline__ unsigned lanes_below() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// a / b for 0 <= a, 1 <= b, in 32 bits when both fit (a 64-bit division is a long subroutine).
__device__ __forceinline__ int64_t div_index(int64_t a, int64_t b) {
  if (((a | b) >> 32) == 0) return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
  return a / b;
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ uint32_t min32(uint32_t a, uint32_t b) { return a < b ? a : b; }

// Division by the scale block B (>= 1): a shift when B is a power of two.
struct DivB {
  int64_t B;
  int shift;  // log2(B), or -1
  __device__ __forceinline__ int64_t div(int64_t a) const { return shift >= 0 ? a >> shift : div_index(a, B); }
};

// Exclusive prefix sum over the CTA (every thread calls it); *total = the CTA's sum.
template <class V>
__device__ V cta_exclusive_sum(V v, V* total) {
  __shared__ V warp_sums[kWarps];
  const V incl = cu::warp_inclusive_sum(v);
  if (lane_id() == 31) warp_sums[warp_id()] = incl;
  __syncthreads();
  V before = 0, all = 0;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) {
    const V s = warp_sums[i];
    if (i < warp_id()) before += s;
    all += s;
  }
  __syncthreads();
  *total = all;
  return before + incl - v;
}

// Exclusive prefix sum of a[0..n) in place by one CTA (16 items per thread per round, all
// loads in flight at once); returns the total.
template <class V>
__device__ V cta_scan_in_place(V* a, int64_t n) {
  constexpr int kPer = 16;
  V carry = 0;
  for (int64_t base = 0; base < n; base += int64_t(kThreads) * kPer) {
    const int64_t i0 = base + int64_t(threadIdx.x) * kPer;
    V v[kPer], s = 0;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const bool in = i0 + k < n;
      v[k] = __ldcg(a + (in ? i0 + k : n - 1));  // unconditional: all loads in flight (n >= 1)
      if (!in) v[k] = 0;
      s += v[k];
    }
    V tot;
    V run = carry + cta_exclusive_sum(s, &tot);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (i0 + k < n) a[i0 + k] = run;
      run += v[k];
    }
    carry += tot;
  }
  return carry;
}

// The "last CTA" pattern (as cooperative groups' grid sync): every CTA publishes its results
// (stores, atomics); after a CTA barrier one thread fences and counts the CTA done; the CTA that
// counts last fences again and then sees everything the others published (read with __ldcg).
__device__ bool cta_is_last(uint32_t* counter) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) __threadfence();
  }
  __syncthreads();
  return last;
}

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
  __device__ __forceinline__ uint32_t key_of(int64_t g, const R&) const { return key[g]; }
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

// ---------------------------------------------------------------------------------------------
// Group selection
// ---------------------------------------------------------------------------------------------

// Steps 1 and 4 (no outliers yet): rm[g], key[g] (when stored), the first digit's histogram.
template <int GS, class T, bool SENS>
__global__ void __launch_bounds__(kThreads)
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

// ---------------------------------------------------------------------------------------------
// Outliers (step 3): element-wise 64-bit radix select of the n_out-th smallest composite key
// c(i) = okey[i] << 32 | i, 8 passes of 8 bits, each a histogram then one CTA picking the digit.
// ---------------------------------------------------------------------------------------------

struct SelectState {
  ull prefix;  // the threshold's bits found so far (the whole threshold after the last pass)
  ull mask;    // which bits of prefix are known
  ull need;    // rank (1-based) of the wanted key among the keys that match prefix
};

__device__ __forceinline__ uint64_t composite(const uint32_t* keys, int64_t i) {
  return (static_cast<uint64_t>(keys[i]) << 32) | static_cast<uint64_t>(i);
}

__global__ void __launch_bounds__(kThreads)
select_histogram_kernel(const uint32_t* __restrict__ keys, int64_t n, const SelectState* __restrict__ st,
                        int pass, ull* __restrict__ hist) {
  __shared__ unsigned h[kRadix];
  for (int t = threadIdx.x; t < kRadix; t += blockDim.x) h[t] = 0;
  __syncthreads();
  const uint64_t prefix = pass ? st->prefix : 0, mask = pass ? st->mask : 0;
  const int shift = 56 - 8 * pass;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x; base < n; base += stride) {
    const int64_t i = base + threadIdx.x;
    bool hit = false;
    unsigned bin = 0;
    if (i < n) {
      const uint64_t c = composite(keys, i);
      hit = (c & mask) == prefix;
      bin = static_cast<unsigned>(c >> shift) & (kRadix - 1);
    }
    hist_add_matched(h, hit, bin);
  }
  __syncthreads();
  for (int t = threadIdx.x; t < kRadix; t += blockDim.x)
    if (h[t]) atomicAdd(&hist[t], static_cast<ull>(h[t]));
}

__global__ void __launch_bounds__(kRadix)
select_digit_kernel(SelectState* st, const ull* __restrict__ hist, int pass, ull k) {
  const ull need = pass ? st->need : k;
  const ull prefix = pass ? st->prefix : 0ull, mask = pass ? st->mask : 0ull;
  const ull count = hist[threadIdx.x];
  ull total;
  const ull excl = cta_exclusive_sum(count, &total);  // every thread has read *st before the winner writes
  if (excl < need && need <= excl + count) {          // exactly one digit when 1 <= need <= matching keys
    const int shift = 56 - 8 * pass;
    st->need = need - excl;
    st->prefix = prefix | (static_cast<ull>(threadIdx.x) << shift);
    st->mask = mask | (0xFFull << shift);
  }
}

void radix_select(const uint32_t* keys, int64_t n, int64_t k, SelectState* st, ull* hist, cudaStream_t s) {
  cu::check(cudaMemsetAsync(hist, 0, sizeof(ull) * kRadix * kSelectPasses, s), "mixed2bit: clear histograms");
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(cu::grid_for(n, kThreads), kMaxHistCtas));
  for (int pass = 0; pass < kSelectPasses; ++pass) {
    select_histogram_kernel<<<grid, kThreads, 0, s>>>(keys, n, st, pass, hist + pass * kRadix);
    cu::check_launch("mixed2bit select histogram");
    select_digit_kernel<<<1, kRadix, 0, s>>>(st, hist + pass * kRadix, pass, static_cast<ull>(k));
    cu::check_launch("mixed2bit select digit");
  }
}

// Step 3's order as an ascending 32-bit key: larger |w| first (for non-NaN floats the unsigned
// order of the sign-cleared bits is the order of |w|, as on the CPU); elements of 4-bit groups
// get 0xFFFFFFFF, after every candidate (candidates are <= 0x7FFFFFFF), and n_out never exceeds
// the number of candidates.
template <class T>
__global__ void __launch_bounds__(kThreads)
outlier_keys_kernel(const T* __restrict__ w, int64_t n, int gs, const uint32_t* __restrict__ is4,
                    uint32_t* __restrict__ okey) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  okey[i] = is4[i / gs] ? 0xFFFFFFFFu : 0x7FFFFFFFu - (f32_bits(to_f32(w[i])) & 0x7FFFFFFFu);
}

__global__ void __launch_bounds__(kThreads)
outlier_mark_kernel(const uint32_t* __restrict__ okey, int64_t n, const SelectState* __restrict__ st,
                    uint32_t* __restrict__ opos) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  opos[i] = composite(okey, i) <= st->prefix ? 1u : 0u;
}

// After the in-place exclusive scan, opos[i] is the output slot of the selected element i:
// the outliers come out sorted by flat index.
template <class T>
__global__ void __launch_bounds__(kThreads)
outlier_scatter_kernel(const T* __restrict__ w, const uint32_t* __restrict__ okey,
                       const uint32_t* __restrict__ opos, int64_t n, int64_t n_out,
                       const SelectState* __restrict__ st, int32_t* __restrict__ idx, half_t* __restrict__ val,
                       uint32_t* flags) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n || composite(okey, i) > st->prefix) return;
  const int64_t j = opos[i];
  if (j >= n_out) { flags[kFlagInternal] = 1u; return; }
  idx[j] = static_cast<int32_t>(i);
  const uint16_t h = fp32_to_fp16_bits(to_f32(w[i]));
  val[j].bits = h;
  if (fp16_not_finite(h)) flags[kFlagTooLarge] = 1u;
}

__device__ __forceinline__ int64_t lower_bound_i32(const int32_t* a, int64_t n, int64_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] < v) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Step 4 again for the groups that hold outliers (the others keep the stats kernel's min/max,
// which are what group_min_max gives without outliers).
template <class T>
__global__ void __launch_bounds__(kThreads)
outlier_groups_kernel(const T* __restrict__ w, int64_t ng, int gs, const int32_t* __restrict__ idx,
                      int64_t n_out, RM<T>* __restrict__ rm) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= ng) return;
  const int64_t base = g * gs;
  const int64_t o0 = lower_bound_i32(idx, n_out, base);
  const int64_t o1 = o0 + lower_bound_i32(idx + o0, n_out - o0, base + gs);
  if (o1 == o0) return;
  float mn, mx;
  group_min_max(w + base, gs, idx + o0, o1 - o0, base, &mn, &mx);
  rm[g] = MinMax<T>::pack(mn, mx);
}

// ---------------------------------------------------------------------------------------------
// Dequantize kernels
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ unsigned map_bit(const uint8_t* map, int64_t g) {
  return (map[g >> 3] >> (g & 7)) & 1u;
}

// Map popcount per tile (a warp's 32 bytes), local[t] = the sum over the CTA's earlier tiles,
// cta_sum scanned by the last CTA, which checks the total against n4. Also the CPU's outlier
// checks: outlier_idx strictly increasing and in range. Any failure sets kFlagBad.
__global__ void __launch_bounds__(kThreads)
map_count_kernel(const uint8_t* __restrict__ map, int64_t ng, int64_t n_tiles, int64_t n4,
                 const int32_t* __restrict__ idx, int64_t n_out, int64_t numel, uint32_t* ctl,
                 uint32_t* __restrict__ local, uint32_t* __restrict__ cta_sum) {
  constexpr int kBytesPerTile = kTile / 8;  // 32: one warp
  __shared__ uint32_t tc[kTilesPerCta];
  const int64_t map_bytes = (ng + 7) / 8;
  const int64_t b0 = int64_t(blockIdx.x) * kTilesPerCta * kBytesPerTile;
#pragma unroll
  for (int it = 0; it < kTilesPerCta * kBytesPerTile / kThreads; ++it) {
    const int64_t byte = b0 + it * kThreads + threadIdx.x;
    uint32_t c = 0;
    if (byte < map_bytes) {
      uint32_t v = map[byte];
      if (byte == map_bytes - 1 && (ng & 7)) v &= (1u << (ng & 7)) - 1u;  // padding bits are not counted
      c = __popc(v);
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) c += __shfl_xor_sync(kFull, c, o);
    if (lane_id() == 0) tc[it * kWarps + warp_id()] = c;
  }
  __syncthreads();
  const int64_t t0 = int64_t(blockIdx.x) * kTilesPerCta;
  if (threadIdx.x < 32) {
    const uint32_t v = threadIdx.x < kTilesPerCta ? tc[threadIdx.x] : 0u;
    const uint32_t incl = cu::warp_inclusive_sum(v);
    if (threadIdx.x < kTilesPerCta && t0 + threadIdx.x < n_tiles) local[t0 + threadIdx.x] = incl - v;
    if (threadIdx.x == 31) cta_sum[blockIdx.x] = incl;
  }
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n_out; i += stride) {
    const int64_t v = idx[i];
    if (v < 0 || v >= numel || (i > 0 && v <= int64_t(idx[i - 1]))) ctl[kFlagBad] = 1u;
  }
  if (!cta_is_last(ctl + kDone1)) return;
  const uint32_t total = cta_scan_in_place(cta_sum, int64_t(gridDim.x));
  if (threadIdx.x == 0 && int64_t(total) != n4) ctl[kFlagBad] = 1u;
}

// group_params with the block index from DivB.
__device__ __forceinline__ void slot_params(const ConstBuffers& q, bool four, int64_t j, DivB B, float* s_eff,
                                            float* m_eff) {
  const int64_t b = B.div(j);
  if (four) {
    *s_eff = effective(q.so4[2 * b].bits, q.scales4[2 * j]);
    *m_eff = effective(q.so4[2 * b + 1].bits, q.scales4[2 * j + 1]);
  } else {
    const uint8_t codes = q.scales2[j];
    *s_eff = effective(q.so2[2 * b].bits, codes & 0x0F);
    *m_eff = effective(q.so2[2 * b + 1].bits, codes >> 4);
  }
}

// The 8 2-bit fields of x's low 16 bits as 8 nibbles (field i in bits 4i..4i+1).
__device__ __forceinline__ uint32_t nibbles_of_2bit(uint32_t x) {
  x &= 0xFFFFu;
  x = (x | (x << 8)) & 0x00FF00FFu;
  x = (x | (x << 4)) & 0x0F0F0F0Fu;
  return (x | (x << 2)) & 0x33333333u;
}

// decode_group of 16 values given as nibbles (value i in bits 4(i % 8) of lo (i < 8) or hi),
// rounded to T. float(q) = (1.5 * 2^23's neighbour 2^23 + q) - 2^23, exact.
template <class T>
__device__ __forceinline__ void decode16(uint32_t lo, uint32_t hi, float s_eff, float m_eff, T (&o)[16]) {
  float f[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const uint32_t q = ((i < 8 ? lo : hi) >> (4 * (i & 7))) & 15u;
    const float qf = __fsub_rn(f32_from_bits(0x4B000000u | q), 8388608.0f);
    f[i] = dequantize_value_f(qf, s_eff, m_eff);
  }
  if constexpr (std::is_same<T, half_t>::value) {
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);  // = two __float2half_rn
      memcpy(&w[i], &h, 4);
    }
    memcpy(o, w, sizeof(w));
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) from_f32(f[i], &o[i]);
  }
}

// A CTA per 1024 groups (4 per thread; each warp 128 consecutive ones, 32 at a time). GS = 16:
// each warp stages its 32 groups' 512 outputs in shared memory and writes them with 16-byte
// stores (a thread's 16 values are contiguous, so direct stores would be strided across the
// warp); GS = 0 (other group sizes) stores directly. All of a thread's loads are issued before
// any decoding, and 2-bit and 4-bit groups share one code path (2-bit codes widened to nibbles).
constexpr int kDecPer = 4;
constexpr int kDecGroups = kThreads * kDecPer;
template <int GS, class T>
__global__ void __launch_bounds__(kThreads)
decode_kernel(ConstBuffers q, int64_t ng, int gs, DivB B, const uint32_t* __restrict__ local,
              const uint32_t* __restrict__ cta_off, const uint32_t* __restrict__ ctl, T* __restrict__ y, bool vec) {
  __shared__ uint32_t warp_counts[kWarps];
  const int64_t first = int64_t(blockIdx.x) * kDecGroups;
  const int64_t tile = first / kTile;
  const uint32_t base = local[tile] + cta_off[tile / kTilesPerCta];  // 4-bit groups before the CTA's
  const bool bad = ctl[kFlagBad] != 0;  // inconsistent buffers: all NaN, no index is trusted
  const int64_t wfirst = first + int64_t(warp_id()) * 32 * kDecPer;
  uint32_t bit[kDecPer], rank[kDecPer], run = 0;
#pragma unroll
  for (int i = 0; i < kDecPer; ++i) {
    const int64_t g = wfirst + 32 * i + lane_id();
    bit[i] = map_bit(q.group_map, g < ng ? g : ng - 1) & (g < ng ? 1u : 0u);  // unconditional load
  }
#pragma unroll
  for (int i = 0; i < kDecPer; ++i) {
    const unsigned bal = __ballot_sync(kFull, bit[i] != 0);
    rank[i] = run + __popc(bal & lanes_below());
    run += __popc(bal);
  }
  if (lane_id() == 0) warp_counts[warp_id()] = run;
  __syncthreads();
  uint32_t wbefore = base;
#pragma unroll
  for (int i = 0; i < kWarps; ++i)
    if (i < warp_id()) wbefore += warp_counts[i];
  const int words2 = gs / kCodes2PerWord, words4 = gs / kCodes4PerWord;
  T nan_t;
  from_f32(f32_from_bits(0x7FC00000u), &nan_t);
  if constexpr (GS > 0) {
    static_assert(GS == 16, "the staged path is for 16-value groups");
    __shared__ __align__(16) T stage[kWarps][32 * 16];
    float s_eff[kDecPer], m_eff[kDecPer];
    uint32_t lo[kDecPer], hi[kDecPer];
    // slot_params and the codes, with every load unconditional (a load behind a branch waits for
    // the earlier ones): groups past the end or of inconsistent buffers read the control words.
    const uint32_t* dummy = ctl;
#pragma unroll
    for (int i = 0; i < kDecPer; ++i) {
      const int64_t g = wfirst + 32 * i + lane_id();
      const bool ok = g < ng && !bad, four = bit[i] != 0;
      const int64_t i4 = int64_t(wbefore) + rank[i];  // 4-bit groups before g
      const int64_t j = four ? i4 : g - i4;            // slot in g's list
      const int64_t b = B.div(j);
      const uint32_t* cp = !ok ? dummy : four ? q.codes4 + 2 * j : q.codes2 + j;
      const uint32_t* hp = ok && four ? cp + 1 : dummy;
      const uint8_t* sp = !ok ? reinterpret_cast<const uint8_t*>(dummy) : four ? q.scales4 + 2 * j : q.scales2 + j;
      const uint8_t* mp = ok && four ? sp + 1 : sp;
      const half_t* op = !ok ? reinterpret_cast<const half_t*>(dummy) : (four ? q.so4 : q.so2) + 2 * b;
      lo[i] = cp[0];
      hi[i] = four ? hp[0] : 0u;
      const uint8_t c0 = sp[0], c1 = mp[0];
      const uint16_t d = op[0].bits, dm = op[1].bits;
      // group_params
      s_eff[i] = effective(d, four ? c0 : c0 & 0x0F);
      m_eff[i] = effective(dm, four ? c1 : c0 >> 4);
    }
    T* ws = stage[warp_id()];
#pragma unroll
    for (int i = 0; i < kDecPer; ++i) {
      const int64_t g0 = wfirst + 32 * i;  // the warp's 32 groups this round
      if (g0 >= ng) break;
      if (g0 + lane_id() < ng) {
        T o[16];
        if (bad) {
#pragma unroll
          for (int e = 0; e < 16; ++e) o[e] = nan_t;
        } else {
          const uint32_t a = bit[i] ? lo[i] : nibbles_of_2bit(lo[i]);
          const uint32_t b = bit[i] ? hi[i] : nibbles_of_2bit(lo[i] >> 16);
          decode16(a, b, s_eff[i], m_eff[i], o);
        }
        cu::store_run(ws + 16 * lane_id(), o, true);
      }
      __syncwarp();
      const int groups = ng - g0 < 32 ? static_cast<int>(ng - g0) : 32;
      T* dst = y + g0 * 16;
      if (vec) {
        const int n16 = groups * 16 * static_cast<int>(sizeof(T)) / 16;
        for (int e = lane_id(); e < n16; e += 32)
          reinterpret_cast<uint4*>(dst)[e] = reinterpret_cast<const uint4*>(ws)[e];
      } else {
        for (int e = lane_id(); e < groups * 16; e += 32) dst[e] = ws[e];
      }
      __syncwarp();
    }
  } else {
#pragma unroll
    for (int i = 0; i < kDecPer; ++i) {
      const int64_t g = wfirst + 32 * i + lane_id();
      if (g >= ng) continue;
      T* out = y + g * gs;
      const int64_t i4 = int64_t(wbefore) + rank[i];
      const int64_t j = bit[i] ? i4 : g - i4;
      float s_eff = 0.0f, m_eff = 0.0f;
      if (!bad) slot_params(q, bit[i] != 0, j, B, &s_eff, &m_eff);
      for (int c = 0; c < gs / 16; ++c) {
        T o[16];
        if (bad) {
#pragma unroll
          for (int e = 0; e < 16; ++e) o[e] = nan_t;
        } else if (bit[i]) {
          decode16(q.codes4[j * words4 + 2 * c], q.codes4[j * words4 + 2 * c + 1], s_eff, m_eff, o);
        } else {
          const uint32_t c2 = q.codes2[j * words2 + c];
          decode16(nibbles_of_2bit(c2), nibbles_of_2bit(c2 >> 16), s_eff, m_eff, o);
        }
        cu::store_run(out + 16 * c, o, vec);
      }
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
outlier_write_kernel(const int32_t* __restrict__ idx, const half_t* __restrict__ val, int64_t n_out,
                     const uint32_t* __restrict__ ctl, T* __restrict__ y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_out || ctl[kFlagBad]) return;
  from_f32(fp16_bits_to_fp32(val[i].bits), y + idx[i]);
}

__global__ void __launch_bounds__(kThreads)
pack_2bit_kernel(const uint8_t* __restrict__ values, int64_t n_words, uint32_t* __restrict__ out) {
  const int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= n_words) return;
  uint32_t word = 0;
  for (int i = 0; i < kCodes2PerWord; ++i)
    word |= static_cast<uint32_t>(values[w * kCodes2PerWord + i] & 3u) << (2 * i);
  out[w] = word;
}

__global__ void __launch_bounds__(kThreads)
unpack_2bit_kernel(const uint32_t* __restrict__ packed, int64_t n, uint8_t* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = static_cast<uint8_t>((packed[i / kCodes2PerWord] >> (2 * (i % kCodes2PerWord))) & 3u);
}

// ---------------------------------------------------------------------------------------------
// Workspace layouts: offsets from the 256-byte aligned start of the caller's buffer.
// ---------------------------------------------------------------------------------------------

struct Carver {
  int64_t off = 0;
  int64_t take(int64_t bytes) {
    const int64_t o = off;
    off += (bytes + kAlign - 1) / kAlign * kAlign;
    return o;
  }
};

// Temporary bytes of CUB's exclusive sum over n uint32 (the size depends on n and the types
// only, not on the pointers or on whether the scan is in place).
size_t scan_temp_bytes(int64_t n) {
  size_t bytes = 0;
  uint32_t* p = nullptr;
  cu::check(cub::DeviceScan::ExclusiveSum(nullptr, bytes, p, p, n), "mixed2bit: scan size");
  return bytes;
}

// out = exclusive prefix sum of in (n items; in == out allowed), with `capacity` bytes of
// temporary storage at tmp (checked against CUB's own size query).
void exclusive_sum(void* tmp, size_t capacity, uint32_t* in, uint32_t* out, int64_t n, cudaStream_t s,
                   const char* what) {
  size_t bytes = 0;
  cu::check(cub::DeviceScan::ExclusiveSum(nullptr, bytes, in, out, n, s), what);
  if (bytes > capacity) throw std::runtime_error(std::string(what) + ": scan workspace too small");
  cu::check(cub::DeviceScan::ExclusiveSum(tmp, bytes, in, out, n, s), what);
}

int64_t n_tiles_of(const Dims& d) { return (d.n_groups() + kTile - 1) / kTile; }
int64_t n_count_ctas(int64_t n_tiles) { return (n_tiles + kTilesPerCta - 1) / kTilesPerCta; }

struct QuantizeLayout {
  int64_t ctl = 0, key = 0, rm = 0, slot = 0, local = 0, cta = 0, bmax = 0, bnd = 0;
  int64_t state = 0, hist = 0, is4 = 0, okey = 0, opos = 0, scan = 0;  // outliers only
  size_t scan_bytes = 0;
  int64_t total = 0;  // bytes the caller provides (alignment slack included)
};

QuantizeLayout quantize_layout(const Dims& d) {
  QuantizeLayout L;
  const int64_t ng = d.n_groups(), numel = d.rows * d.K;
  if (ng == 0) return L;  // nothing to do, no workspace
  const int64_t n_tiles = n_tiles_of(d);
  Carver c;
  L.ctl = c.take(sizeof(uint32_t) * kCtlWords);
  L.key = c.take(4 * ng);  // used with a sensitivity or outliers only
  L.rm = c.take(8 * ng);   // float2 for float32 inputs, 4 bytes for 16-bit ones
  L.local = c.take(8 * n_tiles);
  L.cta = c.take(8 * n_count_ctas(n_tiles));
  L.slot = c.take(4 * ng);
  L.bmax = c.take(8 * (d.blocks2() + d.blocks4()));
  L.bnd = c.take(16 * ((ng + kPlaceGroups - 1) / kPlaceGroups));
  if (d.n_out > 0) {
    L.state = c.take(sizeof(SelectState));
    L.hist = c.take(sizeof(ull) * kRadix * kSelectPasses);
    L.is4 = c.take(4 * ng);
    L.okey = c.take(4 * numel);
    L.opos = c.take(4 * numel);
    L.scan_bytes = scan_temp_bytes(numel);
    L.scan = c.take(static_cast<int64_t>(L.scan_bytes));
  }
  L.total = c.off + kAlign;
  return L;
}

struct DequantizeLayout {
  int64_t ctl = 0, local = 0, cta = 0;
  int64_t total = 0;
};

DequantizeLayout dequantize_layout(const Dims& d) {
  DequantizeLayout L;
  const int64_t ng = d.n_groups();
  if (ng == 0) return L;
  const int64_t n_tiles = n_tiles_of(d);
  Carver c;
  L.ctl = c.take(sizeof(uint32_t) * kCtlWordsDequantize);
  L.local = c.take(4 * n_tiles);
  L.cta = c.take(4 * n_count_ctas(n_tiles));
  L.total = c.off + kAlign;
  return L;
}

uint8_t* workspace_base(void* ws, int64_t ws_bytes, int64_t need) {
  if (ws == nullptr || ws_bytes < need)
    throw std::invalid_argument("workspace: expected at least " + std::to_string(need) + " bytes, got " +
                                std::to_string(ws == nullptr ? 0 : ws_bytes));
  const uintptr_t p = reinterpret_cast<uintptr_t>(ws);
  return reinterpret_cast<uint8_t*>((p + kAlign - 1) / kAlign * kAlign);
}

void check_cuda_dims(const Dims& d) {
  check_dims(d);
  if (d.n_groups() > int64_t(UINT32_MAX))
    throw std::invalid_argument("mixed2bit (CUDA): at most 2^32 - 1 groups");
}

// CTAs of the grid-stride kernels: a few per SM of the current device.
unsigned stride_grid(int64_t n, int per_sm) {
  int dev = 0, sms = 0;
  cu::check(cudaGetDevice(&dev), "mixed2bit: device");
  cu::check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "mixed2bit: SM count");
  const int64_t want = std::min<int64_t>(cu::grid_for(n, kThreads), int64_t(sms) * per_sm);
  return static_cast<unsigned>(std::max<int64_t>(1, want));
}

DivB make_div(int64_t B) {
  int shift = -1;
  if ((B & (B - 1)) == 0 && B < (int64_t(1) << 31))
    for (shift = 0; (int64_t(1) << shift) < B; ++shift) {}
  return DivB{B, shift};
}

}  // namespace

int64_t quantize_workspace_bytes_cuda(const Dims& dims) {
  check_cuda_dims(dims);
  return quantize_layout(dims).total;
}

int64_t dequantize_workspace_bytes_cuda(const Dims& dims) {
  check_cuda_dims(dims);
  return dequantize_layout(dims).total;
}

namespace {

template <class T, class Keys>
void quantize_after_stats(const T* w, const Dims& d, const Buffers& out, uint8_t* base, const QuantizeLayout& L,
                          Keys keys, cudaStream_t s) {
  const int64_t ng = d.n_groups(), n4 = d.n4, n2 = d.n2(), n_out = d.n_out;
  const DivB B = make_div(d.scale_block);
  const int64_t n_tiles = n_tiles_of(d), n_ctas = n_count_ctas(n_tiles);
  const int gs = static_cast<int>(d.group_size);
  auto* ctl = reinterpret_cast<uint32_t*>(base + L.ctl);
  auto* key = reinterpret_cast<uint32_t*>(base + L.key);
  auto* rm = reinterpret_cast<RM<T>*>(base + L.rm);
  auto* local = reinterpret_cast<ull*>(base + L.local);
  auto* cta = reinterpret_cast<ull*>(base + L.cta);
  auto* slot = reinterpret_cast<uint32_t*>(base + L.slot);
  auto* bmax = reinterpret_cast<uint32_t*>(base + L.bmax);
  const int64_t blocks2 = d.blocks2();
  auto* bnd = reinterpret_cast<uint32_t*>(base + L.bnd);

  // Step 2: the remaining digits of K*, then the tile counts.
  if (n4 > 0 && n4 < ng) {
    const unsigned grid = stride_grid(ng, 4);
    select_pass_kernel<kBits2, kShift2><<<grid, kThreads, 0, s>>>(keys, ng, ctl);
    cu::check_launch("mixed2bit select pass");
    select_pass_kernel<kBits3, kShift3><<<grid, kThreads, 0, s>>>(keys, ng, ctl);
    cu::check_launch("mixed2bit select pass");
  }
  tile_count_kernel<<<cu::grid_for(n_tiles, kTilesPerCta), kThreads, 0, s>>>(keys, ng, n_tiles, n4, ctl, local, cta);
  cu::check_launch("mixed2bit tile count kernel");

  // Step 3: outliers, then step 4 again for the groups that hold some.
  if (n_out > 0) {
    const int64_t numel = d.rows * d.K;
    auto* st = reinterpret_cast<SelectState*>(base + L.state);
    auto* hist = reinterpret_cast<ull*>(base + L.hist);
    auto* is4 = reinterpret_cast<uint32_t*>(base + L.is4);
    auto* okey = reinterpret_cast<uint32_t*>(base + L.okey);
    auto* opos = reinterpret_cast<uint32_t*>(base + L.opos);
    mark_kernel<<<cu::grid_for(ng, kTile), kThreads, 0, s>>>(keys, ng, local, cta, ctl, is4);
    cu::check_launch("mixed2bit mark kernel");
    const unsigned grid_elems = cu::grid_for(numel, kThreads);
    outlier_keys_kernel<T><<<grid_elems, kThreads, 0, s>>>(w, numel, gs, is4, okey);
    cu::check_launch("mixed2bit outlier keys kernel");
    radix_select(okey, numel, n_out, st, hist, s);
    outlier_mark_kernel<<<grid_elems, kThreads, 0, s>>>(okey, numel, st, opos);
    cu::check_launch("mixed2bit outlier mark kernel");
    exclusive_sum(base + L.scan, L.scan_bytes, opos, opos, numel, s, "mixed2bit: outlier scan");
    outlier_scatter_kernel<T><<<grid_elems, kThreads, 0, s>>>(w, okey, opos, numel, n_out, st, out.outlier_idx,
                                                              out.outlier_val, ctl);
    cu::check_launch("mixed2bit outlier scatter kernel");
    outlier_groups_kernel<T><<<cu::grid_for(ng, kThreads), kThreads, 0, s>>>(w, ng, gs, out.outlier_idx, n_out, rm);
    cu::check_launch("mixed2bit outlier groups kernel");
  }

  // Step 2's slots and map, step 5's second order, then steps 5 + 6.
  const unsigned place_ctas = cu::grid_for(ng, kPlaceGroups);
  place_kernel<T><<<place_ctas, kThreads, 0, s>>>(keys, rm, ng, B, n2, n4, blocks2, local, cta, ctl, bmax, bnd, slot,
                                                  out);
  cu::check_launch("mixed2bit place kernel");
  finish_kernel<<<cu::grid_for(4 * int64_t(place_ctas), kThreads), kThreads, 0, s>>>(bnd, 4 * int64_t(place_ctas),
                                                                                     blocks2, bmax, out.so2, out.so4, ctl);
  cu::check_launch("mixed2bit finish kernel");
  const bool vec = cu::aligned16(w);
  if (gs == 16)
    encode_kernel<16, T><<<cu::grid_for(ng, kThreads), kThreads, 0, s>>>(w, rm, slot, ng, gs, B, n2, n4, ctl, out, vec);
  else
    encode_kernel<0, T><<<cu::grid_for(ng, kThreads), kThreads, 0, s>>>(w, rm, slot, ng, gs, B, n2, n4, ctl, out, vec);
  cu::check_launch("mixed2bit encode kernel");
  (void)n_ctas;
  (void)key;
}

}  // namespace

template <class T>
void quantize_cuda(const T* w, const float* sens, const Dims& d, const Buffers& out, void* workspace,
                   int64_t workspace_bytes, void* stream) {
  check_cuda_dims(d);
  const int64_t ng = d.n_groups();
  if (ng == 0) return;  // every buffer is empty
  const QuantizeLayout L = quantize_layout(d);
  uint8_t* base = workspace_base(workspace, workspace_bytes, L.total);
  auto* ctl = reinterpret_cast<uint32_t*>(base + L.ctl);
  auto* rm = reinterpret_cast<RM<T>*>(base + L.rm);
  auto* bmax = reinterpret_cast<uint32_t*>(base + L.bmax);
  const cudaStream_t s = cu::stream(stream);
  const int gs = static_cast<int>(d.group_size);
  const bool vec = cu::aligned16(w);  // 16 values of T are 32 or 64 bytes: every group aligned too
  const bool svec = cu::aligned16(sens);
  const bool store_key = sens != nullptr || d.n_out > 0;
  uint32_t* key = store_key ? reinterpret_cast<uint32_t*>(base + L.key) : nullptr;
  const int64_t n_bmax = 2 * (d.blocks2() + d.blocks4());  // block maxima, cleared by the stats kernel

  cu::check(cudaMemsetAsync(ctl, 0, sizeof(uint32_t) * kCtlWords, s), "mixed2bit: clear control words");

  // Steps 1 and 4 (no outliers yet) and the first digit of the selection.
  const unsigned grid = stride_grid(ng, 8);
  auto stats = [&](auto gs_c, auto sens_c) {
    constexpr int GS = decltype(gs_c)::value;
    constexpr bool SENS = decltype(sens_c)::value;
    stats_kernel<GS, T, SENS><<<grid, kThreads, 0, s>>>(w, sens, ng, gs, d.groups_per_row(), vec, svec, key, rm, bmax,
                                                        n_bmax, ctl, d.n4);
  };
  using Gs16 = std::integral_constant<int, 16>;
  using Gs0 = std::integral_constant<int, 0>;
  using Yes = std::true_type;
  using No = std::false_type;
  if (gs == 16) {
    if (sens) stats(Gs16{}, Yes{}); else stats(Gs16{}, No{});
  } else {
    if (sens) stats(Gs0{}, Yes{}); else stats(Gs0{}, No{});
  }
  cu::check_launch("mixed2bit stats kernel");

  if (store_key)
    quantize_after_stats(w, d, out, base, L, ArrayKeys{key}, s);
  else
    quantize_after_stats(w, d, out, base, L, RangeKeys<T>{rm}, s);

  // The one synchronization: the error flags.
  uint32_t host_flags[4] = {};
  cu::check(cudaMemcpyAsync(host_flags, ctl, sizeof(host_flags), cudaMemcpyDeviceToHost, s),
            "mixed2bit: copy flags");
  cu::check(cudaStreamSynchronize(s), "mixed2bit quantize");
  if (host_flags[kFlagInternal])
    throw std::runtime_error("mixed2bit (CUDA): internal error: inconsistent selection (please report)");
  if (host_flags[kFlagTooLarge]) throw std::invalid_argument(kTooLargeMessage);
}

template <class T>
void dequantize_cuda(const ConstBuffers& q, const Dims& d, T* y, void* workspace, int64_t workspace_bytes,
                     void* stream) {
  check_cuda_dims(d);
  const int64_t ng = d.n_groups();
  if (ng == 0) return;
  const DequantizeLayout L = dequantize_layout(d);
  uint8_t* base = workspace_base(workspace, workspace_bytes, L.total);
  auto* ctl = reinterpret_cast<uint32_t*>(base + L.ctl);
  auto* local = reinterpret_cast<uint32_t*>(base + L.local);
  auto* cta = reinterpret_cast<uint32_t*>(base + L.cta);
  const cudaStream_t s = cu::stream(stream);
  const int64_t n_tiles = n_tiles_of(d);

  cu::check(cudaMemsetAsync(ctl, 0, sizeof(uint32_t) * kCtlWordsDequantize, s), "mixed2bit: clear flags");
  map_count_kernel<<<cu::grid_for(n_tiles, kTilesPerCta), kThreads, 0, s>>>(
      q.group_map, ng, n_tiles, d.n4, q.outlier_idx, d.n_out, d.rows * d.K, ctl, local, cta);
  cu::check_launch("mixed2bit map count kernel");
  const int gs = static_cast<int>(d.group_size);
  const bool vec = cu::aligned16(y);
  const DivB B = make_div(d.scale_block);
  if (gs == 16)
    decode_kernel<16, T><<<cu::grid_for(ng, kDecGroups), kThreads, 0, s>>>(q, ng, gs, B, local, cta, ctl, y, vec);
  else
    decode_kernel<0, T><<<cu::grid_for(ng, kDecGroups), kThreads, 0, s>>>(q, ng, gs, B, local, cta, ctl, y, vec);
  cu::check_launch("mixed2bit decode kernel");
  if (d.n_out > 0) {
    outlier_write_kernel<T><<<cu::grid_for(d.n_out, kThreads), kThreads, 0, s>>>(q.outlier_idx, q.outlier_val,
                                                                               d.n_out, ctl, y);
    cu::check_launch("mixed2bit outlier write kernel");
  }
}

void pack_2bit_cuda(const uint8_t* values, int64_t n_words, uint32_t* out, void* stream) {
  if (n_words <= 0) return;
  pack_2bit_kernel<<<cu::grid_for(n_words, kThreads), kThreads, 0, cu::stream(stream)>>>(values, n_words, out);
  cu::check_launch("mixed2bit pack_2bit kernel");
}

void unpack_2bit_cuda(const uint32_t* packed, int64_t n, uint8_t* out, void* stream) {
  if (n <= 0) return;
  unpack_2bit_kernel<<<cu::grid_for(n, kThreads), kThreads, 0, cu::stream(stream)>>>(packed, n, out);
  cu::check_launch("mixed2bit unpack_2bit kernel");
}

#define QF_INSTANTIATE(T)                                                                                  \
  template void quantize_cuda<T>(const T*, const float*, const Dims&, const Buffers&, void*, int64_t, void*); \
  template void dequantize_cuda<T>(const ConstBuffers&, const Dims&, T*, void*, int64_t, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::mixed2bit
