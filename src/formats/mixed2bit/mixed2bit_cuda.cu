// mixed2bit CUDA codec: the steps of mixed2bit.h as a pipeline of simple kernels on one stream.
// Every per-group rule is the QF_HOST_DEVICE function the CPU calls (one thread per group, so
// sums and min/max run in the CPU's order); the global steps (selections, list slots) are
// exact integer computations whose result does not depend on the launch shape.
//
// Quantize (n = n_groups, N = rows * K; scratch in the caller's workspace):
//   stats        thread/group   w -> key[g] = ~score_order_key(score), range[g], m[g]
//                               (step 1 + step 4 without outliers); NaN score -> flag
//   select x8    see radix_select: the n4-th smallest composite key (key << 32 | g)
//   mark         thread/group   is4[g] = composite(g) <= threshold     (exactly n4 ones)
//   scan (CUB)                  slot4 = exclusive prefix sum of is4
//   -- only with outliers --
//   okeys        thread/elem    okey[i] = 2-bit group ? 0x7FFFFFFF - |w| bits : 0xFFFFFFFF
//   select x8                   the n_out-th smallest (okey << 32 | i)
//   omark        thread/elem    opos[i] = selected(i); scan (CUB, in place) -> output slot
//   oscatter     thread/elem    outlier_idx / outlier_val in index order; inf fp16 -> flag
//   ogroups      thread/group   range, m again for the groups holding outliers
//   --
//   lists        thread/group   list[slot] = g (2-bit list, then the 4-bit list)
//   second order thread/block   so2 / so4 (step 5, max over the block's groups); inf -> flag
//   encode       thread/group   w -> scales2/4 and codes2/4 (steps 5 + 6)
//   map          thread/byte    group_map from is4
//   then one 16-byte device-to-host copy of the flags and a stream synchronization.
//
// Dequantize (asynchronous):
//   tile counts  thread/tile    popcount of group_map per tile of 256 groups
//   scan (CUB)                  tile prefix
//   check        thread/outlier map popcount == n4, outlier_idx increasing and in range
//   decode       CTA/tile       block scan of the tile's map bits -> each group's slot;
//                               decode_group in float32, rounded once to T (all-NaN if the
//                               check failed)
//   outliers     thread/outlier y[idx] = float(val) rounded to T
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/cuda_utils.cuh"
#include "formats/mixed2bit/mixed2bit.h"

namespace qf::mixed2bit {
namespace {

namespace cu = ::qf::cuda;
using ull = unsigned long long;

constexpr int kThreads = 256;       // threads per CTA of the per-item kernels
constexpr int kTileGroups = 256;    // groups per CTA of the decoder (one thread each)
constexpr int kRadix = 256;         // radix select: 8 bits per pass ...
constexpr int kSelectPasses = 8;    // ... over 64-bit composite keys
constexpr int kMaxHistCtas = 1024;  // grid of a histogram pass (grid-stride loop)
constexpr int64_t kAlign = 256;     // alignment of every workspace region

// Error flags (uint32 each) in the workspace, copied back once at the end of quantize.
enum : int { kFlagTooLarge = 0, kFlagInternal = 1, kFlagBad = 2, kFlagCount = 4 };

struct SelectState {
  ull prefix;  // the threshold's bits found so far (the whole threshold after the last pass)
  ull mask;    // which bits of prefix are known
  ull need;    // rank (1-based) of the wanted key among the keys that match prefix
};

// ---------------------------------------------------------------------------------------------
// Radix select of the k-th smallest (1 <= k <= n) of the n distinct composite keys
// c(i) = keys[i] << 32 | i (i < 2^32): 8 passes, each a histogram of the next 8 bits of the keys
// that match the bits found so far, then one CTA picks the digit holding the wanted rank.
// Integer counts only, so the result does not depend on the launch shape. Afterwards exactly
// k keys satisfy c(i) <= state.prefix: the k first in (key, index) order.
// ---------------------------------------------------------------------------------------------

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
  // `base` is the same for every thread of the CTA, so whole warps run each iteration (the
  // warp-wide ballot and match below need that).
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x; base < n; base += stride) {
    const int64_t i = base + threadIdx.x;
    bool hit = false;
    unsigned bin = 0;
    if (i < n) {
      const uint64_t c = composite(keys, i);
      hit = (c & mask) == prefix;
      bin = static_cast<unsigned>(c >> shift) & (kRadix - 1);
    }
    const unsigned hits = __ballot_sync(0xFFFFFFFFu, hit);
    if (hit) {  // one shared atomic per distinct bin of the warp
      const unsigned peers = __match_any_sync(hits, bin);
      if ((threadIdx.x & 31u) == static_cast<unsigned>(__ffs(peers) - 1)) atomicAdd(&h[bin], __popc(peers));
    }
  }
  __syncthreads();
  for (int t = threadIdx.x; t < kRadix; t += blockDim.x)
    if (h[t]) atomicAdd(&hist[t], static_cast<ull>(h[t]));
}

__global__ void __launch_bounds__(kRadix)
select_digit_kernel(SelectState* st, const ull* __restrict__ hist, int pass, ull k) {
  using Scan = cub::BlockScan<ull, kRadix>;
  __shared__ typename Scan::TempStorage tmp;
  const ull need = pass ? st->need : k;
  const ull prefix = pass ? st->prefix : 0ull, mask = pass ? st->mask : 0ull;
  const ull count = hist[threadIdx.x];
  ull incl;
  Scan(tmp).InclusiveSum(count, incl);
  __syncthreads();  // every thread has read *st before the one winner writes it
  const ull excl = incl - count;
  if (excl < need && need <= incl) {  // exactly one digit when 1 <= need <= matching keys
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

// ---------------------------------------------------------------------------------------------
// Quantize kernels
// ---------------------------------------------------------------------------------------------

// The group's values: GS > 0 (the default group size 16) reads them into registers with 16-byte
// loads when `vec`, GS == 0 passes the global pointer (any group size). Either way the per-group
// rule reads the same values in the same order.
template <int GS, class T, class Body>
__device__ __forceinline__ void with_group(const T* __restrict__ w, int64_t g, int gs, bool vec, Body&& body) {
  if constexpr (GS > 0) {
    T v[GS];
    cu::load_run(w + g * GS, v, vec);
    body(static_cast<const T*>(v), GS);
  } else {
    body(w + g * gs, gs);
  }
}

template <int GS, class T>
__global__ void __launch_bounds__(kThreads)
stats_kernel(const T* __restrict__ w, const float* __restrict__ sens, int64_t ng, int gs, int64_t G, bool vec,
             uint32_t* __restrict__ key, float* __restrict__ range, float* __restrict__ m, uint32_t* flags) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= ng) return;
  with_group<GS>(w, g, gs, vec, [&](const T* x, int n) {
    const float s = sens ? sensitivity_score(x, sens + (g % G) * n, n) : range_score(x, n);
    if (s != s) flags[kFlagTooLarge] = 1u;  // 0 * inf: the CPU's "too large" error
    key[g] = ~score_order_key(s);           // ascending key = descending score
    float r, z;
    group_range_m(x, n, static_cast<const int32_t*>(nullptr), 0, 0, &r, &z);
    range[g] = r;
    m[g] = z;
  });
}

enum : int { kMarkNone = 0, kMarkAll = 1, kMarkSelected = 2 };

__global__ void __launch_bounds__(kThreads)
mark_groups_kernel(const uint32_t* __restrict__ key, int64_t ng, int mode, const SelectState* __restrict__ st,
                   uint32_t* __restrict__ is4) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= ng) return;
  is4[g] = mode == kMarkAll ? 1u : mode == kMarkNone ? 0u : (composite(key, g) <= st->prefix ? 1u : 0u);
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

// Step 4 again for the groups that hold outliers (the others keep the stats kernel's values,
// which are what group_range_m gives without outliers).
template <class T>
__global__ void __launch_bounds__(kThreads)
outlier_groups_kernel(const T* __restrict__ w, int64_t ng, int gs, const int32_t* __restrict__ idx,
                      int64_t n_out, float* __restrict__ range, float* __restrict__ m) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= ng) return;
  const int64_t base = g * gs;
  const int64_t o0 = lower_bound_i32(idx, n_out, base);
  const int64_t o1 = o0 + lower_bound_i32(idx + o0, n_out - o0, base + gs);
  if (o1 == o0) return;
  float r, z;
  group_range_m(w + base, gs, idx + o0, o1 - o0, base, &r, &z);
  range[g] = r;
  m[g] = z;
}

// list[0 .. n2) = the 2-bit groups in id order, list[n2 .. ng) = the 4-bit groups.
__global__ void __launch_bounds__(kThreads)
lists_kernel(const uint32_t* __restrict__ is4, const uint32_t* __restrict__ slot4, int64_t ng, int64_t n2,
             int64_t n4, uint32_t* __restrict__ list, uint32_t* flags) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= ng) return;
  const int64_t s4 = slot4[g];
  const int64_t j = is4[g] ? s4 : g - s4;
  if (j >= (is4[g] ? n4 : n2)) { flags[kFlagInternal] = 1u; return; }
  list[(is4[g] ? n2 : 0) + j] = static_cast<uint32_t>(g);
}

// One thread per second-order block: blocks [0, blocks2) of the 2-bit list, then the 4-bit list.
__global__ void __launch_bounds__(kThreads)
second_order_kernel(const uint32_t* __restrict__ list, const float* __restrict__ range,
                    const float* __restrict__ m, int64_t n2, int64_t n4, int64_t B, int64_t blocks2,
                    int64_t blocks4, half_t* __restrict__ so2, half_t* __restrict__ so4, uint32_t* flags) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= blocks2 + blocks4) return;
  const bool four = b >= blocks2;
  const int64_t bb = four ? b - blocks2 : b;
  const int64_t n = four ? n4 : n2;
  const int64_t j0 = bb * B;
  const int64_t count = n - j0 < B ? n - j0 : B;
  uint16_t d, dm;
  second_order_block(list + (four ? n2 : 0) + j0, count, range, m, four ? kQmax4 : kQmax2, four ? kS4 : kS2, &d,
                     &dm);
  half_t* so = (four ? so4 : so2) + 2 * bb;
  so[0].bits = d;
  so[1].bits = dm;
  if (fp16_not_finite(d) || fp16_not_finite(dm)) flags[kFlagTooLarge] = 1u;
}

template <int GS, class T>
__global__ void __launch_bounds__(kThreads)
encode_kernel(const T* __restrict__ w, int64_t ng, int gs, int64_t B, int64_t n2, int64_t n4,
              const uint32_t* __restrict__ is4, const uint32_t* __restrict__ slot4,
              const float* __restrict__ range, const float* __restrict__ m, Buffers out, bool vec) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= ng) return;
  const bool four = is4[g] != 0;
  const int64_t s4 = slot4[g];
  const int64_t j = four ? s4 : g - s4;   // slot in the group's list
  if (j >= (four ? n4 : n2)) return;      // impossible; lists_kernel has raised kFlagInternal
  const int64_t b = j / B;
  const float r = range[g], z = m[g];
  with_group<GS>(w, g, gs, vec, [&](const T* x, int n) {
    int sc, mc;
    if (four) {
      quantize_group<4>(x, n, r, z, out.so4[2 * b].bits, out.so4[2 * b + 1].bits, &sc, &mc,
                        out.codes4 + j * (n / kCodes4PerWord));
      out.scales4[2 * j] = static_cast<uint8_t>(sc);
      out.scales4[2 * j + 1] = static_cast<uint8_t>(mc);
    } else {
      quantize_group<2>(x, n, r, z, out.so2[2 * b].bits, out.so2[2 * b + 1].bits, &sc, &mc,
                        out.codes2 + j * (n / kCodes2PerWord));
      out.scales2[j] = static_cast<uint8_t>(sc | mc << 4);
    }
  });
}

__global__ void __launch_bounds__(kThreads)
group_map_kernel(const uint32_t* __restrict__ is4, int64_t ng, int64_t n_bytes, uint8_t* __restrict__ map) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_bytes) return;
  unsigned byte = 0;
  for (int bit = 0; bit < 8; ++bit) {
    const int64_t g = 8 * i + bit;
    if (g < ng && is4[g]) byte |= 1u << bit;  // padding bits 0
  }
  map[i] = static_cast<uint8_t>(byte);
}

// ---------------------------------------------------------------------------------------------
// Dequantize kernels
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ unsigned map_bit(const uint8_t* map, int64_t g) {
  return (map[g >> 3] >> (g & 7)) & 1u;
}

__global__ void __launch_bounds__(kThreads)
tile_count_kernel(const uint8_t* __restrict__ map, int64_t ng, int64_t n_tiles, uint32_t* __restrict__ count) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n_tiles) return;
  const int64_t g0 = t * kTileGroups, g1 = g0 + kTileGroups < ng ? g0 + kTileGroups : ng;
  uint32_t c = 0;
  for (int64_t g = g0; g < g1; ++g) c += map_bit(map, g);  // padding bits are not counted
  count[t] = c;
}

// The CPU's build_row_index checks: map popcount == n4; outlier_idx strictly increasing, in range.
__global__ void __launch_bounds__(kThreads)
check_kernel(const uint32_t* __restrict__ count, const uint32_t* __restrict__ prefix, int64_t n_tiles,
             int64_t n4, const int32_t* __restrict__ idx, int64_t n_out, int64_t numel, uint32_t* flags) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i == 0 && int64_t(prefix[n_tiles - 1]) + int64_t(count[n_tiles - 1]) != n4) flags[kFlagBad] = 1u;
  if (i < n_out) {
    const int64_t v = idx[i];
    if (v < 0 || v >= numel || (i > 0 && v <= int64_t(idx[i - 1]))) flags[kFlagBad] = 1u;
  }
}

template <class T>
__global__ void __launch_bounds__(kTileGroups)
decode_kernel(ConstBuffers q, int64_t ng, int gs, int64_t B, const uint32_t* __restrict__ tile_prefix,
              const uint32_t* __restrict__ flags, T* __restrict__ y, bool vec) {
  using Scan = cub::BlockScan<uint32_t, kTileGroups>;
  __shared__ typename Scan::TempStorage tmp;
  const int64_t g = int64_t(blockIdx.x) * kTileGroups + threadIdx.x;
  const uint32_t bit = g < ng ? map_bit(q.group_map, g) : 0u;
  uint32_t rank;
  Scan(tmp).ExclusiveSum(bit, rank);  // every thread of the CTA takes part
  if (g >= ng) return;
  T* out = y + g * gs;
  const int chunks = gs / 16;
  if (flags[kFlagBad]) {  // inconsistent buffers: all NaN, no index is trusted
    T o[16];
    for (int j = 0; j < 16; ++j) from_f32(f32_from_bits(0x7FC00000u), &o[j]);
    for (int c = 0; c < chunks; ++c) cu::store_run(out + 16 * c, o, vec);
    return;
  }
  const int64_t i4 = int64_t(tile_prefix[blockIdx.x]) + rank;  // 4-bit groups before g
  const int64_t j = bit ? i4 : g - i4;                          // slot in g's list
  float s_eff, m_eff;
  group_params(q, bit != 0, j, B, &s_eff, &m_eff);
  for (int c = 0; c < chunks; ++c) {  // 16 values at a time: one 2-bit word or two 4-bit words
    float f[16];
    if (bit)
      decode_group<4>(q.codes4 + j * (gs / kCodes4PerWord) + 2 * c, 16, s_eff, m_eff, f);
    else
      decode_group<2>(q.codes2 + j * (gs / kCodes2PerWord) + c, 16, s_eff, m_eff, f);
    T o[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) from_f32(f[k], &o[k]);
    cu::store_run(out + 16 * c, o, vec);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
outlier_write_kernel(const int32_t* __restrict__ idx, const half_t* __restrict__ val, int64_t n_out,
                     const uint32_t* __restrict__ flags, T* __restrict__ y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_out || flags[kFlagBad]) return;
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

struct QuantizeLayout {
  int64_t flags = 0, state = 0, hist = 0, key = 0, range = 0, m = 0, is4 = 0, slot4 = 0, list = 0;
  int64_t okey = 0, opos = 0, scan = 0;
  size_t scan_bytes = 0;
  int64_t total = 0;  // bytes the caller provides (alignment slack included)
};

QuantizeLayout quantize_layout(const Dims& d) {
  QuantizeLayout L;
  const int64_t ng = d.n_groups(), numel = d.rows * d.K;
  if (ng == 0) return L;  // nothing to do, no workspace
  Carver c;
  L.flags = c.take(sizeof(uint32_t) * kFlagCount);
  L.state = c.take(sizeof(SelectState));
  L.hist = c.take(sizeof(ull) * kRadix * kSelectPasses);
  L.key = c.take(4 * ng);
  L.range = c.take(4 * ng);
  L.m = c.take(4 * ng);
  L.is4 = c.take(4 * ng);
  L.slot4 = c.take(4 * ng);
  L.list = c.take(4 * ng);
  L.scan_bytes = scan_temp_bytes(ng);
  if (d.n_out > 0) {
    L.okey = c.take(4 * numel);
    L.opos = c.take(4 * numel);
    L.scan_bytes = std::max(L.scan_bytes, scan_temp_bytes(numel));
  }
  L.scan = c.take(static_cast<int64_t>(L.scan_bytes));
  L.total = c.off + kAlign;
  return L;
}

struct DequantizeLayout {
  int64_t flags = 0, count = 0, prefix = 0, scan = 0;
  size_t scan_bytes = 0;
  int64_t total = 0;
};

DequantizeLayout dequantize_layout(const Dims& d) {
  DequantizeLayout L;
  const int64_t ng = d.n_groups();
  if (ng == 0) return L;
  const int64_t n_tiles = (ng + kTileGroups - 1) / kTileGroups;
  Carver c;
  L.flags = c.take(sizeof(uint32_t) * kFlagCount);
  L.count = c.take(4 * n_tiles);
  L.prefix = c.take(4 * n_tiles);
  L.scan_bytes = scan_temp_bytes(n_tiles);
  L.scan = c.take(static_cast<int64_t>(L.scan_bytes));
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

}  // namespace

int64_t quantize_workspace_bytes_cuda(const Dims& dims) {
  check_cuda_dims(dims);
  return quantize_layout(dims).total;
}

int64_t dequantize_workspace_bytes_cuda(const Dims& dims) {
  check_cuda_dims(dims);
  return dequantize_layout(dims).total;
}

template <class T>
void quantize_cuda(const T* w, const float* sens, const Dims& d, const Buffers& out, void* workspace,
                   int64_t workspace_bytes, void* stream) {
  check_cuda_dims(d);
  const int64_t ng = d.n_groups();
  if (ng == 0) return;  // every buffer is empty
  const QuantizeLayout L = quantize_layout(d);
  uint8_t* base = workspace_base(workspace, workspace_bytes, L.total);
  auto* flags = reinterpret_cast<uint32_t*>(base + L.flags);
  auto* st = reinterpret_cast<SelectState*>(base + L.state);
  auto* hist = reinterpret_cast<ull*>(base + L.hist);
  auto* key = reinterpret_cast<uint32_t*>(base + L.key);
  auto* range = reinterpret_cast<float*>(base + L.range);
  auto* m = reinterpret_cast<float*>(base + L.m);
  auto* is4 = reinterpret_cast<uint32_t*>(base + L.is4);
  auto* slot4 = reinterpret_cast<uint32_t*>(base + L.slot4);
  auto* list = reinterpret_cast<uint32_t*>(base + L.list);
  void* scan_tmp = base + L.scan;
  const cudaStream_t s = cu::stream(stream);

  const int gs = static_cast<int>(d.group_size);
  const int64_t G = d.groups_per_row(), n4 = d.n4, n2 = d.n2(), n_out = d.n_out, B = d.scale_block;
  const int64_t numel = d.rows * d.K;
  const unsigned grid_groups = cu::grid_for(ng, kThreads);
  const bool gs16 = gs == 16;
  const bool vec = cu::aligned16(w);  // 16 values of T are 32 or 64 bytes: every group aligned too

  cu::check(cudaMemsetAsync(flags, 0, sizeof(uint32_t) * kFlagCount, s), "mixed2bit: clear flags");

  // Steps 1 and 4 (no outliers yet).
  if (gs16)
    stats_kernel<16, T><<<grid_groups, kThreads, 0, s>>>(w, sens, ng, gs, G, vec, key, range, m, flags);
  else
    stats_kernel<0, T><<<grid_groups, kThreads, 0, s>>>(w, sens, ng, gs, G, vec, key, range, m, flags);
  cu::check_launch("mixed2bit stats kernel");

  // Step 2: the n4 first groups in (-score, id) order.
  int mode = kMarkSelected;
  if (n4 == 0) mode = kMarkNone;
  else if (n4 == ng) mode = kMarkAll;
  else radix_select(key, ng, n4, st, hist, s);
  mark_groups_kernel<<<grid_groups, kThreads, 0, s>>>(key, ng, mode, st, is4);
  cu::check_launch("mixed2bit mark kernel");
  exclusive_sum(scan_tmp, L.scan_bytes, is4, slot4, ng, s, "mixed2bit: group scan");

  // Step 3: outliers, then step 4 again for the groups that hold some.
  if (n_out > 0) {
    auto* okey = reinterpret_cast<uint32_t*>(base + L.okey);
    auto* opos = reinterpret_cast<uint32_t*>(base + L.opos);
    const unsigned grid_elems = cu::grid_for(numel, kThreads);
    outlier_keys_kernel<T><<<grid_elems, kThreads, 0, s>>>(w, numel, gs, is4, okey);
    cu::check_launch("mixed2bit outlier keys kernel");
    radix_select(okey, numel, n_out, st, hist, s);
    outlier_mark_kernel<<<grid_elems, kThreads, 0, s>>>(okey, numel, st, opos);
    cu::check_launch("mixed2bit outlier mark kernel");
    exclusive_sum(scan_tmp, L.scan_bytes, opos, opos, numel, s, "mixed2bit: outlier scan");
    outlier_scatter_kernel<T><<<grid_elems, kThreads, 0, s>>>(w, okey, opos, numel, n_out, st, out.outlier_idx,
                                                              out.outlier_val, flags);
    cu::check_launch("mixed2bit outlier scatter kernel");
    outlier_groups_kernel<T><<<grid_groups, kThreads, 0, s>>>(w, ng, gs, out.outlier_idx, n_out, range, m);
    cu::check_launch("mixed2bit outlier groups kernel");
  }

  // Step 5: the lists and the second order.
  lists_kernel<<<grid_groups, kThreads, 0, s>>>(is4, slot4, ng, n2, n4, list, flags);
  cu::check_launch("mixed2bit lists kernel");
  const int64_t blocks2 = d.blocks2(), blocks4 = d.blocks4();
  second_order_kernel<<<cu::grid_for(blocks2 + blocks4, kThreads), kThreads, 0, s>>>(
      list, range, m, n2, n4, B, blocks2, blocks4, out.so2, out.so4, flags);
  cu::check_launch("mixed2bit second order kernel");

  // Steps 5 + 6: codes, then the map.
  if (gs16)
    encode_kernel<16, T><<<grid_groups, kThreads, 0, s>>>(w, ng, gs, B, n2, n4, is4, slot4, range, m, out, vec);
  else
    encode_kernel<0, T><<<grid_groups, kThreads, 0, s>>>(w, ng, gs, B, n2, n4, is4, slot4, range, m, out, vec);
  cu::check_launch("mixed2bit encode kernel");
  const int64_t map_bytes = d.map_bytes();
  group_map_kernel<<<cu::grid_for(map_bytes, kThreads), kThreads, 0, s>>>(is4, ng, map_bytes, out.group_map);
  cu::check_launch("mixed2bit group map kernel");

  // The one synchronization: the error flags.
  uint32_t host_flags[kFlagCount] = {};
  cu::check(cudaMemcpyAsync(host_flags, flags, sizeof(host_flags), cudaMemcpyDeviceToHost, s),
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
  auto* flags = reinterpret_cast<uint32_t*>(base + L.flags);
  auto* count = reinterpret_cast<uint32_t*>(base + L.count);
  auto* prefix = reinterpret_cast<uint32_t*>(base + L.prefix);
  const cudaStream_t s = cu::stream(stream);
  const int64_t n_tiles = (ng + kTileGroups - 1) / kTileGroups;

  cu::check(cudaMemsetAsync(flags, 0, sizeof(uint32_t) * kFlagCount, s), "mixed2bit: clear flags");
  tile_count_kernel<<<cu::grid_for(n_tiles, kThreads), kThreads, 0, s>>>(q.group_map, ng, n_tiles, count);
  cu::check_launch("mixed2bit tile count kernel");
  exclusive_sum(base + L.scan, L.scan_bytes, count, prefix, n_tiles, s, "mixed2bit: tile scan");
  const int64_t n_check = d.n_out > 0 ? d.n_out : 1;
  check_kernel<<<cu::grid_for(n_check, kThreads), kThreads, 0, s>>>(count, prefix, n_tiles, d.n4, q.outlier_idx,
                                                                   d.n_out, d.rows * d.K, flags);
  cu::check_launch("mixed2bit check kernel");
  decode_kernel<T><<<cu::grid_for(ng, kTileGroups), kTileGroups, 0, s>>>(
      q, ng, static_cast<int>(d.group_size), d.scale_block, prefix, flags, y, cu::aligned16(y));
  cu::check_launch("mixed2bit decode kernel");
  if (d.n_out > 0) {
    outlier_write_kernel<T><<<cu::grid_for(d.n_out, kThreads), kThreads, 0, s>>>(q.outlier_idx, q.outlier_val,
                                                                               d.n_out, flags, y);
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
