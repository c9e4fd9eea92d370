// nf4 CUDA codec: the per-value rules of nf4.h (block_recip / block_den / stored_absmax, the NF4
// code count, dequantize_value, the 8-bit double-quantization code, torch's summation order of the
// offset) on the GPU, so GPU bytes equal CPU bytes by construction. What differs from the CPU is
// only who computes what:
//
// quantize / dequantize: a CTA of 256 threads owns a tile of 4096 consecutive values (= the
//   largest blocksize, so a tile holds whole blocks, except the last tile of the tensor). Values
//   move as 16-byte vectors of V = 16 / sizeof(T) values (4 for float32, 8 for 16-bit types); a
//   thread holds 16 values, i.e. kSteps = 16 / V vectors: in step k, thread t has the vector at
//   tile offset (k * 256 + t) * V, so each warp access of each step (16-byte loads/stores of T,
//   V/2-byte words of packed codes) is one contiguous run. A block of B values is B / V
//   consecutive threads of a step when B <= 256 V; larger blocks are whole consecutive steps of
//   all 256 threads. The block absmax is fmaxf over the block's steps, then a butterfly over its
//   lanes, then (when it spans several warps) over the warps through shared memory: a max of
//   non-negative, non-NaN partial maxima, so the result does not depend on the launch shape (see
//   abs_max_step in nf4.h). The thread whose vector starts a block stores its absmax. Vector
//   accesses are used when the base pointers are aligned (checked on the host), element accesses
//   otherwise and at the ragged end of the tensor.
// double quantization: the offset (torch's CPU-order float32 mean of absmax) by one CTA that sums
//   torch's level-0 chunks in parallel and carries them through the cascade in order (mean_kernel
//   below), written to the device; then one CTA per 256-block of absmax reads it.
// fp16 / bf16 conversions are the shared to_f32 / from_f32 (hardware cvt on the device, the same
// round-to-nearest-even as the CPU code).
#include "common/cuda_utils.cuh"
#include "common/fp16.h"
#include "formats/nf4/nf4.h"

namespace qf::nf4 {
namespace {

constexpr int kThreads = 256;                           // threads per CTA of the codec kernels
constexpr int kValuesPerThread = 16;
constexpr int kTile = kThreads * kValuesPerThread;      // 4096 values per CTA
constexpr int kWarps = kThreads / 32;
static_assert(kTile == kMaxBlocksize, "a tile holds whole blocks");

template <class T>
struct Layout {
  static constexpr int V = 16 / int(sizeof(T));       // values per 16-byte vector: 4 or 8
  static constexpr int kSteps = kValuesPerThread / V;  // vectors per thread: 4 or 2
  static constexpr int kSpan = kThreads * V;           // values per step: 1024 or 2048
  static_assert(kMinBlocksize % V == 0, "a vector never straddles two blocks");
  static_assert(V % 2 == 0, "a vector packs into whole bytes");
};

inline bool aligned_to(const void* p, unsigned bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

inline int log2_of(int64_t blocksize) {  // blocksize: a power of two (checked by the binding)
  int lg = 0;
  while ((int64_t(1) << lg) < blocksize) ++lg;
  return lg;
}

// V/2 packed bytes <-> the low bytes of a word (byte j at address j: little-endian).
template <int NB>
__device__ __forceinline__ uint32_t load_packed(const uint8_t* __restrict__ p) {
  static_assert(NB == 2 || NB == 4, "2 or 4 bytes");
  if constexpr (NB == 4) return __ldg(reinterpret_cast<const unsigned int*>(p));
  else return __ldg(reinterpret_cast<const unsigned short*>(p));
}
template <int NB>
__device__ __forceinline__ void store_packed(uint8_t* __restrict__ p, uint32_t w) {
  static_assert(NB == 2 || NB == 4, "2 or 4 bytes");
  if constexpr (NB == 4) *reinterpret_cast<uint32_t*>(p) = w;
  else *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(w);
}

// --- quantize ------------------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads)
quantize_kernel(const T* __restrict__ x, int64_t n, int lg, uint8_t* __restrict__ packed,
                float* __restrict__ absmax, bool vec_in, bool vec_out) {
  using L = Layout<T>;
  constexpr int V = L::V, kSteps = L::kSteps;
  __shared__ float mid[16];
  __shared__ float warp_max[kSteps][kWarps];
  if (threadIdx.x < 15) mid[threadIdx.x] = midpoint(static_cast<int>(threadIdx.x));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t first = int64_t(blockIdx.x) * kTile + int64_t(threadIdx.x) * V;  // step 0's vector

  // Load: f[k][j] = element first + k * kSpan + j; values at or past n read as +0 (neutral for
  // the absmax, never stored).
  float f[kSteps][V];
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int64_t e0 = first + int64_t(k) * L::kSpan;
    if (vec_in && e0 + V <= n) {
      T v[V];
      cuda::load_run(x + e0, v, true);
#pragma unroll
      for (int j = 0; j < V; ++j) f[k][j] = to_f32(v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) f[k][j] = e0 + j < n ? to_f32(x[e0 + j]) : 0.0f;
    }
  }

  // Block absmax. fmaxf(a, |v|) from a = +0 is abs_max_step (nf4.h): NaN skipped, -0 never wins.
  float a[kSteps];
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    a[k] = 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) a[k] = fmaxf(a[k], fabsf(f[k][j]));
  }
  const int steps_per_block = (1 << lg) / L::kSpan;  // 0 when a block lies inside one step
#pragma unroll
  for (int d = 1; d < kSteps; d <<= 1) {  // blocks of 2 (or 4) whole steps: combine those steps
    if (steps_per_block > d) {
      float t[kSteps];
#pragma unroll
      for (int k = 0; k < kSteps; ++k) t[k] = fmaxf(a[k], a[k ^ d]);
#pragma unroll
      for (int k = 0; k < kSteps; ++k) a[k] = t[k];
    }
  }
  const int group = steps_per_block > 0 ? kThreads : (1 << lg) / V;  // threads of a block in a step
  const int width = group < 32 ? group : 32;                            // ... inside one warp
  for (int off = width / 2; off > 0; off >>= 1) {
#pragma unroll
    for (int k = 0; k < kSteps; ++k) a[k] = fmaxf(a[k], __shfl_xor_sync(0xffffffffu, a[k], off));
  }
  __syncthreads();  // mid[] is complete
  if (group > 32) {  // the block spans several warps (a kernel-uniform branch)
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < kSteps; ++k) warp_max[k][warp] = a[k];
    }
    __syncthreads();
    const int warps_per_block = group / 32;  // 2 .. 8
    const int w0 = warp / warps_per_block * warps_per_block;
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      float m = 0.0f;
      for (int w = 0; w < warps_per_block; ++w) m = fmaxf(m, warp_max[k][w0 + w]);
      a[k] = m;
    }
  }

  // Codes and stores.
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int64_t e0 = first + int64_t(k) * L::kSpan;
    if (e0 >= n) continue;
    const int64_t b = e0 >> lg, start = b << lg;
    const bool full = start + (int64_t(1) << lg) <= n;
    uint8_t c[V];
    if (full) {
      const float r = block_recip(a[k]);
#pragma unroll
      for (int j = 0; j < V; ++j) c[j] = code_of_search(f[k][j] * r, mid);
    } else {  // the partial last block: true division
      const float den = block_den(a[k]);
#pragma unroll
      for (int j = 0; j < V; ++j) c[j] = code_of_search(f[k][j] / den, mid);
    }
    if (e0 == start) absmax[b] = stored_absmax(a[k], full);
    // Byte j = code[2j] << 4 | code[2j+1]; a missing odd element is the padding code 7.
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < V / 2; ++j) {
      const uint32_t lo = e0 + 2 * j + 1 < n ? c[2 * j + 1] : static_cast<uint32_t>(kPadCode);
      word |= (static_cast<uint32_t>(c[2 * j]) << 4 | lo) << (8 * j);
    }
    uint8_t* out = packed + e0 / 2;
    if (vec_out && e0 + V <= n) {
      store_packed<V / 2>(out, word);
    } else {
#pragma unroll
      for (int j = 0; j < V / 2; ++j)
        if (e0 + 2 * j < n) out[j] = static_cast<uint8_t>(word >> (8 * j));
    }
  }
}

// --- dequantize ----------------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads)
dequantize_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ absmax, int64_t n, int lg,
                  T* __restrict__ y, bool vec_in, bool vec_out) {
  using L = Layout<T>;
  constexpr int V = L::V, kSteps = L::kSteps;
  __shared__ float code[16];  // 16 distinct banks: a warp's lookups never conflict
  if (threadIdx.x < 16) code[threadIdx.x] = code_value(static_cast<int>(threadIdx.x));
  const int64_t first = int64_t(blockIdx.x) * kTile + int64_t(threadIdx.x) * V;

  // All loads first (more bytes in flight), then decode and store.
  uint32_t word[kSteps];
  float a[kSteps];
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int64_t e0 = first + int64_t(k) * L::kSpan;
    word[k] = 0;
    a[k] = 0.0f;
    if (e0 >= n) continue;
    a[k] = __ldg(absmax + (e0 >> lg));
    const uint8_t* in = packed + e0 / 2;
    if (vec_in && e0 + V <= n) {
      word[k] = load_packed<V / 2>(in);
    } else {
#pragma unroll
      for (int j = 0; j < V / 2; ++j)
        if (e0 + 2 * j < n) word[k] |= static_cast<uint32_t>(in[j]) << (8 * j);
    }
  }
  __syncthreads();  // code[] is complete

#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int64_t e0 = first + int64_t(k) * L::kSpan;
    if (e0 >= n) continue;
    T o[V];
#pragma unroll
    for (int j = 0; j < V / 2; ++j) {
      const uint32_t byte = (word[k] >> (8 * j)) & 0xFFu;
      // dequantize_value(c, a) = kCode[c] * a: one float32 multiply, then one rounding to T.
      from_f32(code[byte >> 4] * a[k], &o[2 * j]);  // even element: high nibble
      from_f32(code[byte & 0x0Fu] * a[k], &o[2 * j + 1]);
    }
    if (vec_out && e0 + V <= n) {
      cuda::store_run(y + e0, o, true);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j)
        if (e0 + j < n) y[e0 + j] = o[j];
    }
  }
}

// --- the offset: torch's CPU-order float32 mean of absmax (nf4.h), on one CTA -------------------------
//
// For n >= 8, lane s of every warp works on stream s (kSumStreams == 32), whose values are
// x[32 g + s]: a warp reads 128 contiguous bytes per group. Rounds of kMeanChunksPerRound chunks:
// each warp sums kMeanChunksPerWarp chunks (each sequentially from 0 over `step` groups: torch's
// level 0), then warp 0 pushes the round's chunk sums through cascade_push in chunk order. Warp 0
// then adds the leftover groups and takes cascade_result; thread 0 finishes with mean_finish.
// Every addition is the CPU's, in the CPU's order, whatever the number of warps.
constexpr int kMeanWarps = 32;
constexpr int kMeanChunksPerWarp = 4;
constexpr int kMeanChunksPerRound = kMeanWarps * kMeanChunksPerWarp;
constexpr int kMeanUnroll = 8;  // groups per batch of loads; the step (>= 16) is a multiple of it
static_assert(kSumStreams == 32, "one lane per stream");

__global__ void __launch_bounds__(kMeanWarps * 32)
mean_kernel(const float* __restrict__ x, int64_t n, float* __restrict__ out) {
  __shared__ float chunk_sums[kMeanChunksPerRound][kSumStreams];
  __shared__ float totals[kSumStreams];
  if (n < kSumLanes) {  // torch's scalar path (and n == 0): a handful of additions
    // Stored as bits, so that the NaN of n == 0 keeps the CPU's payload (0xFFC00000).
    if (threadIdx.x == 0) *reinterpret_cast<uint32_t*>(out) = f32_bits(mean_small(x, n));
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t groups = n / kSumLanes / 4;
  const int p = sum_level_power(groups);
  const int64_t step = int64_t(1) << p, n_chunks = groups / step;
  const float* xs = x + lane;  // this lane's stream: group g's value is xs[32 g]
  SumCascade cascade;          // warp 0's: levels 1..3 of stream `lane`
  for (int64_t c0 = 0; c0 < n_chunks; c0 += kMeanChunksPerRound) {
    const int64_t cw = c0 + int64_t(warp) * kMeanChunksPerWarp;  // this warp's first chunk
    float acc[kMeanChunksPerWarp];
#pragma unroll
    for (int r = 0; r < kMeanChunksPerWarp; ++r) acc[r] = 0.0f;
    for (int64_t g = 0; g < step; g += kMeanUnroll) {
#pragma unroll
      for (int u = 0; u < kMeanUnroll; ++u)
#pragma unroll
        for (int r = 0; r < kMeanChunksPerWarp; ++r)
          if (cw + r < n_chunks) acc[r] = acc[r] + xs[kSumStreams * ((cw + r) * step + g + u)];
    }
#pragma unroll
    for (int r = 0; r < kMeanChunksPerWarp; ++r) chunk_sums[warp * kMeanChunksPerWarp + r][lane] = acc[r];
    __syncthreads();
    if (warp == 0) {
      const int64_t left = n_chunks - c0;
      const int m = left < kMeanChunksPerRound ? static_cast<int>(left) : kMeanChunksPerRound;
      for (int k = 0; k < m; ++k) cascade_push(cascade, chunk_sums[k][lane], (c0 + k + 1) * step, p);
    }
    __syncthreads();  // chunk_sums is reused by the next round
  }
  if (warp == 0) {
    float leftover = 0.0f;
    for (int64_t g = n_chunks * step; g < groups; ++g) leftover = leftover + xs[kSumStreams * g];
    totals[lane] = cascade_result(cascade, leftover);
  }
  __syncthreads();
  if (threadIdx.x == 0) *out = mean_finish(totals, x, n);
}

// --- double quantization of absmax and its inverse --------------------------------------------------

__global__ void __launch_bounds__(kDoubleQuantBlock)
double_quant_kernel(const float* __restrict__ absmax, int64_t nb, const float* __restrict__ offset,
                    uint8_t* __restrict__ q, float* __restrict__ absmax2) {
  __shared__ float warp_max[kDoubleQuantBlock / 32];
  const int64_t i = int64_t(blockIdx.x) * kDoubleQuantBlock + threadIdx.x;
  const bool valid = i < nb;
  const float d = valid ? absmax[i] - *offset : 0.0f;  // float32 subtraction, as the CPU
  float a2 = abs_max_step(0.0f, d);                      // +0 for a lane past the end: neutral
  for (int off = 16; off > 0; off >>= 1) a2 = fmaxf(a2, __shfl_xor_sync(0xffffffffu, a2, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = a2;
  __syncthreads();
  a2 = 0.0f;
#pragma unroll
  for (int w = 0; w < kDoubleQuantBlock / 32; ++w) a2 = fmaxf(a2, warp_max[w]);
  const float r = a2 == 0.0f ? 0.0f : 1.0f / a2;  // as double_quant_block
  if (valid) q[i] = double_quant_code(d, a2, r);
  if (threadIdx.x == 0) absmax2[blockIdx.x] = a2;
}

constexpr int kAbsmaxThreads = 256;

__global__ void __launch_bounds__(kAbsmaxThreads)
dequantize_absmax_kernel(const uint8_t* __restrict__ q, const float* __restrict__ absmax2,
                         const float* __restrict__ offset, int64_t nb, float* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * kAbsmaxThreads + threadIdx.x;
  if (i >= nb) return;
  out[i] = dequantize_absmax_value(q[i], absmax2[i / kDoubleQuantBlock], *offset);
}

}  // namespace

template <class T>
void quantize_cuda(const T* x, int64_t n, int64_t blocksize, uint8_t* packed, float* absmax, void* stream) {
  if (n <= 0) return;
  quantize_kernel<T><<<cuda::grid_for(n, kTile), kThreads, 0, cuda::stream(stream)>>>(
      x, n, log2_of(blocksize), packed, absmax, cuda::aligned16(x), aligned_to(packed, Layout<T>::V / 2));
  cuda::check_launch("nf4 quantize kernel");
}

template <class T>
void dequantize_cuda(const uint8_t* packed, const float* absmax, int64_t n, int64_t blocksize, T* y, void* stream) {
  if (n <= 0) return;
  dequantize_kernel<T><<<cuda::grid_for(n, kTile), kThreads, 0, cuda::stream(stream)>>>(
      packed, absmax, n, log2_of(blocksize), y, aligned_to(packed, Layout<T>::V / 2), cuda::aligned16(y));
  cuda::check_launch("nf4 dequantize kernel");
}

void double_quant_cuda(const float* absmax, int64_t n_blocks, uint8_t* q, float* absmax2, float* offset,
                       void* stream) {
  const cudaStream_t s = cuda::stream(stream);
  mean_kernel<<<1, kMeanWarps * 32, 0, s>>>(absmax, n_blocks, offset);  // also for n_blocks == 0 (NaN)
  cuda::check_launch("nf4 offset kernel");
  if (n_blocks <= 0) return;
  double_quant_kernel<<<cuda::grid_for(n_blocks, kDoubleQuantBlock), kDoubleQuantBlock, 0, s>>>(
      absmax, n_blocks, offset, q, absmax2);
  cuda::check_launch("nf4 double-quant kernel");
}

void dequantize_absmax_cuda(const uint8_t* q, const float* absmax2, const float* offset, int64_t n_blocks,
                            float* absmax, void* stream) {
  if (n_blocks <= 0) return;
  dequantize_absmax_kernel<<<cuda::grid_for(n_blocks, kAbsmaxThreads), kAbsmaxThreads, 0, cuda::stream(stream)>>>(
      q, absmax2, offset, n_blocks, absmax);
  cuda::check_launch("nf4 dequantize-absmax kernel");
}

#define QF_INSTANTIATE(T)                                                                      \
  template void quantize_cuda<T>(const T*, int64_t, int64_t, uint8_t*, float*, void*); \
  template void dequantize_cuda<T>(const uint8_t*, const float*, int64_t, int64_t, T*, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::nf4
