// mixed2bit CUDA quantize, outlier kernels (step 3 of mixed2bit.h; only with n_out > 0, included
// by mixed2bit_quantize_cuda.cu only): element-wise 64-bit radix select of the n_out-th smallest
// composite key c(i) = okey[i] << 32 | i, 8 passes of 8 bits, each a histogram then one CTA
// picking the digit; then the outliers' positions (a CUB scan in the caller), values, and the
// min/max of the groups that hold some.
#pragma once
#include <cstdint>

#include "formats/mixed2bit/mixed2bit_select_cuda.cuh"

namespace qf::mixed2bit {
namespace {

struct SelectState {
  ull prefix;  // the threshold's bits found so far (the whole threshold after the last pass)
  ull mask;    // which bits of prefix are known
  ull need;    // rank (1-based) of the wanted key among the keys that match prefix
};

__device__ __forceinline__ uint64_t composite(const uint32_t* keys, int64_t i) {
  return (static_cast<uint64_t>(keys[i]) << 32) | static_cast<uint64_t>(i);
}

__global__ void
__launch_bounds__(kThreads)
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

}  // namespace
}  // namespace qf::mixed2bit
