// nf4 CUDA codec: the per-value rules of nf4.h (block_recip / block_den / stored_absmax, the NF4
// code count, dequantize_value, the 8-bit double-quantization code, torch's summation order of the
// offset) on the GPU, so GPU bytes equal CPU bytes. What differs from the CPU is only who computes
// what (and, for the 4-bit code, how: code_of_cells, equal to code_of for every float):
//
// quantize: a thread owns 4 consecutive 16-byte vectors (32 values of a 16-bit type, 16 of
//   float32), all in one block (blocks are powers of two >= 32); a block is a run of consecutive
//   threads. Its absmax is the thread's maximum (packed pairs), then a butterfly over the block's
//   lanes, then (when it spans several warps) over the warps through shared memory: a max of
//   non-negative, non-NaN partial maxima, so the result does not depend on the launch shape (see
//   abs_max_step in nf4.h). Codes: s = x * fl(1 / absmax) (x / den in a partial last block), then
//   one table lookup in shared memory and one comparison per value (add_code); one 16-byte store
//   of a thread's codes. The thread whose values start a block stores its absmax.
// dequantize: a CTA of 256 threads owns a tile of 4096 consecutive values (= the largest
//   blocksize). Values move as 16-byte vectors of V = 16 / sizeof(T) values (4 for float32, 8 for
//   16-bit types); a thread holds 16 values, i.e. kSteps = 16 / V vectors: in step k, thread t has
//   the vector at tile offset (k * 256 + t) * V, so each warp access of each step is one
//   contiguous run.
// Vector accesses are used when the base pointers are aligned (checked on the host), element
//   accesses otherwise and at the ragged end of the tensor.
// double quantization: the offset (torch's CPU-order float32 mean of absmax) by one CTA that sums
//   torch's level-0 chunks in parallel and carries them through the cascade in order (mean_kernel
//   below), written to the device; then one CTA per 256-block of absmax reads it.
// fp16 / bf16 conversions are the shared to_f32 / from_f32 (hardware cvt on the device, the same
// round-to-nearest-even as the CPU code).
#include <cstring>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "common/fp16.h"
#include "common/unitwise_cuda.cuh"
#include "formats/nf4/nf4.h"

namespace qf::nf4 {
namespace {

constexpr int kThreads = 256;  // threads per CTA of the codec kernels
constexpr int kWarps = kThreads / 32;
constexpr int kQuantVecs = 4;     // 16-byte vectors per thread in quantize
constexpr int kQuantMinCtas = 6;  // quantize: 40 registers, 1536 threads/SM

// Dequantize layout: a CTA decodes a tile of 4096 values, 16 per thread in kSteps steps.
constexpr int kValuesPerThread = 16;
constexpr int kTile = kThreads * kValuesPerThread;  // 4096 values per CTA
static_assert(kTile == kMaxBlocksize, "a tile holds whole blocks");

template <class T>
struct Layout {
  static constexpr int V = 16 / int(sizeof(T));        // values per 16-byte vector: 4 or 8
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

// A thread's vectors stay the loaded 16-byte words (V values each) until their codes are
// computed: half the registers of float32 copies for 16-bit inputs. Value j of a word as float32
// (exact, as to_f32).
template <class T>
__device__ __forceinline__ float word_value(const uint4& w, int j) {
  constexpr int kPerWord = 4 / int(sizeof(T));
  const int k = j / kPerWord;
  const uint32_t u = k == 0 ? w.x : k == 1 ? w.y : k == 2 ? w.z : w.w;
  if constexpr (sizeof(T) == 4) return __uint_as_float(u);
  else return to_f32(T{static_cast<uint16_t>(j % 2 ? u >> 16 : u & 0xFFFFu)});
}

// max(+0, |v|) over a thread's values (fmaxf(a, |v|) from +0, i.e. abs_max_step's result in any
// order: -0 never wins), with `nan` set when some value is NaN (the result is then meaningless).
// On packed pairs where the hardware has them (sm_80+, 16-bit types): the maximum and the minimum
// with NaN propagation (three-input HMNMX2: one instruction per two words each), then max(max,
// -min), which is max |v| exactly; a zero result is made +0.
template <class T>
__device__ __forceinline__ float thread_absmax_nan(const uint4 (&raw)[kQuantVecs], bool& nan) {
#if __CUDA_ARCH__ >= 800
  if constexpr (sizeof(T) == 2) {
    uint32_t hi = raw[0].x, lo = raw[0].x;
#pragma unroll
    for (int k = 0; k < kQuantVecs; ++k) {
      const uint32_t u[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (std::is_same_v<T, bf16_t>) {
          asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(hi) : "r"(hi), "r"(u[i]));
          asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(lo) : "r"(lo), "r"(u[i]));
        } else {
          asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(hi) : "r"(hi), "r"(u[i]));
          asm("min.NaN.f16x2 %0, %1, %2;" : "=r"(lo) : "r"(lo), "r"(u[i]));
        }
      }
    }
    const float h0 = to_f32(T{static_cast<uint16_t>(hi & 0xFFFFu)}), h1 = to_f32(T{static_cast<uint16_t>(hi >> 16)});
    const float l0 = to_f32(T{static_cast<uint16_t>(lo & 0xFFFFu)}), l1 = to_f32(T{static_cast<uint16_t>(lo >> 16)});
    nan = h0 != h0 || h1 != h1;  // a NaN reaches both the maximum and the minimum
    const float a = fmaxf(fmaxf(h0, h1), -fminf(l0, l1));
    return a > 0.0f ? a : 0.0f;
  }
#endif
  float a = 0.0f;
  bool n = false;
#pragma unroll
  for (int k = 0; k < kQuantVecs; ++k)
#pragma unroll
    for (int j = 0; j < 16 / int(sizeof(T)); ++j) {
      const float v = word_value<T>(raw[k], j);
      n |= v != v;
      a = fmaxf(a, fabsf(v));
    }
  nan = n;
  return a;
}

// The same with NaNs skipped (abs_max_step's result for any input).
template <class T>
__device__ __forceinline__ float word_absmax(const uint4& w) {
  float a = 0.0f;
#pragma unroll
  for (int j = 0; j < 16 / int(sizeof(T)); ++j) a = fmaxf(a, fabsf(word_value<T>(w, j)));
  return a;
}

// word + (code_of_cells(s) << kShift), code_of_cells (nf4.h) with the table in shared memory,
// written out so that a value costs one fused multiply-add (cell_of; kClamp: after fminf / fmaxf,
// as nf4.h), one address multiply-add, one 8-byte shared load, one compare, one shift-add and one
// predicated add: `biased` is the table's shared address minus 8 * kCellMagicBase (mod 2^32), so
// bits(w) * 8 + biased addresses cell bits(w) - kCellMagicBase = cell_of(s); then base << kShift
// is added, and 1 << kShift where s > mid (never for a NaN s). Without the clamp (the caller
// guarantees |s| <= 1 + 2^-20) the cell is the same: nf4.h's cell_of_unclamped.
template <int kShift, bool kClamp>
__device__ __forceinline__ uint32_t add_code(uint32_t word, float s, uint32_t biased) {
  const float c = kClamp ? fminf(fmaxf(s, -1.0f), 1.0f) : s;  // fmaxf(NaN, -1) = -1
  const float w = fmaf(c, 16.0f, kCellMagic);
  float mid;
  uint32_t base;
  asm("ld.shared.v2.b32 {%0, %1}, [%2];" : "=f"(mid), "=r"(base) : "r"(__float_as_uint(w) * 8u + biased));
  word += base << kShift;
  asm("{\n\t.reg .pred p;\n\tsetp.gt.f32 p, %1, %2;\n\t@p add.u32 %0, %0, %3;\n\t}"
      : "+r"(word)
      : "f"(s), "f"(mid), "n"(1u << kShift));
  return word;
}

// add_code for element j of a vector: byte j / 2 = code[2j] << 4 | code[2j + 1], so element j's
// nibble starts at bit 8 (j / 2) + 4 (1 - j % 2).
template <int J, bool kClamp>
__device__ __forceinline__ uint32_t add_element_code(uint32_t word, float s, uint32_t biased) {
  return add_code<8 * (J / 2) + 4 * (1 - J % 2), kClamp>(word, s, biased);
}

template <class T, int V, bool kClamp, class F, int J = 0>
__device__ __forceinline__ uint32_t vector_codes(uint32_t word, uint32_t biased, F scaled) {
  if constexpr (J == V) {
    return word;
  } else {
    return vector_codes<T, V, kClamp, F, J + 1>(add_element_code<J, kClamp>(word, scaled(J), biased), biased, scaled);
  }
}

// Quantize layout: thread t of CTA b owns kQuantVecs consecutive 16-byte vectors, i.e. the
// kQuantVecs * V values from (b * kThreads + t) * kQuantVecs * V (32 for 16-bit types, 16 for
// float32). Blocks (>= 32 values, powers of two) are whole runs of S = blocksize / (kQuantVecs V)
// consecutive threads, so a thread needs one block absmax (its own maximum, then a butterfly over
// the S threads, through shared memory when S > 32), one reciprocal and one 16-byte (8-byte for
// float32) store of its codes. Per-thread work that does not scale with the values (index
// arithmetic, the reciprocal, the stores) is paid once per 32 values, not once per vector.

template <class T>
struct QuantLayout {
  static constexpr int V = 16 / int(sizeof(T));        // values per 16-byte vector
  static constexpr int kPerThread = kQuantVecs * V;    // 32 or 16 consecutive values
  static constexpr int kTile = kThreads * kPerThread;  // values per CTA
  static constexpr int kOutBytes = kPerThread / 2;     // 16 or 8 bytes of packed codes
  static_assert(kMinBlocksize % kPerThread == 0, "a thread's values lie in one block");
};

template <class T, int kMinCtas>
__global__ void
__launch_bounds__(kThreads, cuda::unitwise::min_ctas_for_arch(kMinCtas, kThreads))
quantize_kernel(const T* __restrict__ x, int64_t n, int lg, uint8_t* __restrict__ packed,
                float* __restrict__ absmax, bool vec_in, bool vec_out) {
  using L = QuantLayout<T>;
  constexpr int V = L::V;
  __shared__ CodeCell cells[kCodeCells];  // code_of_cells' table (nf4.h)
  __shared__ float warp_max[kWarps];
  if (threadIdx.x < kCodeCells) cells[threadIdx.x] = code_cell(static_cast<int>(threadIdx.x));
  static_assert(sizeof(CodeCell) == 8, "one 8-byte shared load per lookup");
  const int64_t e0 = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * L::kPerThread;  // first value

  // Load; values at or past n read as +0 (neutral for the absmax; the code of +0 is 7, the
  // padding code of an odd n, and nothing past n is stored).
  uint4 raw[kQuantVecs];
  if (vec_in && e0 + L::kPerThread <= n) {
#pragma unroll
    for (int k = 0; k < kQuantVecs; ++k) raw[k] = __ldg(reinterpret_cast<const uint4*>(x + e0) + k);
  } else {
#pragma unroll
    for (int k = 0; k < kQuantVecs; ++k) {
      T v[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int64_t e = e0 + k * V + j;
        v[j] = e < n ? x[e] : T{};
      }
      memcpy(&raw[k], v, sizeof(v));
    }
  }

  // Block absmax: fmaxf(a, |v|) from a = +0 is abs_max_step (nf4.h): NaN skipped, -0 never wins;
  // a max of such partial maxima is the block's, in any grouping.
  // `nan`: this thread holds a NaN (outside the checked API; then its absmax is taken again with
  // NaNs skipped, and its codes take the clamped cell index).
  bool nan = false;
  float a = thread_absmax_nan<T>(raw, nan);
  if (nan) {
    a = 0.0f;
#pragma unroll
    for (int k = 0; k < kQuantVecs; ++k) a = fmaxf(a, word_absmax<T>(raw[k]));
  }

  const int group = (1 << lg) / L::kPerThread;  // threads per block: 1 .. kThreads (a power of two)
  const int width = group < 32 ? group : 32;
  for (int off = width / 2; off > 0; off >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, off));
  // Through a shuffle, so that the compiler keeps it in a register (one multiply-add per lookup)
  // rather than splitting it into a uniform base and a 32-bit constant.
  const uint32_t biased =
      __shfl_sync(0xffffffffu, static_cast<uint32_t>(__cvta_generic_to_shared(cells)) - 8u * kCellMagicBase, 0);
  if (group > 32) {  // the block spans several warps (a kernel-uniform branch)
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) warp_max[warp] = a;
    __syncthreads();
    const int warps_per_block = group / 32;  // 2 .. 8
    const int w0 = warp & ~(warps_per_block - 1);
    a = warp_max[w0];
    for (int w = 1; w < warps_per_block; ++w) a = fmaxf(a, warp_max[w0 + w]);
  } else {
    __syncthreads();  // cells[] is complete (the other branch's barrier does it there)
  }
  if (e0 >= n) return;

  const int64_t b = e0 >> lg, start = b << lg;
  const bool full = start + (int64_t(1) << lg) <= n;
  // Codes: byte j = code[2j] << 4 | code[2j+1] within each vector's V / 2 bytes.
  // Every scaled value has |s| <= 1 + 2^-23 when the block's values are finite (|x| <= a, and
  // fl(1 / max(a, TINY)) <= (1 / max(a, TINY))(1 + 2^-24); the partial block's |x / den| <= 1),
  // so the cell index needs no clamp (nf4.h cell_of_unclamped) unless this thread holds a NaN or
  // the block an infinity (a = inf).
  uint32_t word[kQuantVecs];
  const bool clamp = nan || !(a < INFINITY);
  if (full && !clamp) {
    const float r = block_recip(a);
#pragma unroll
    for (int k = 0; k < kQuantVecs; ++k) {
      const uint4 w = raw[k];
      word[k] = vector_codes<T, V, false>(0u, biased, [&](int j) { return __fmul_rn(word_value<T>(w, j), r); });
    }
  } else if (full) {
    const float r = block_recip(a);
#pragma unroll
    for (int k = 0; k < kQuantVecs; ++k) {
      const uint4 w = raw[k];
      word[k] = vector_codes<T, V, true>(0u, biased, [&](int j) { return __fmul_rn(word_value<T>(w, j), r); });
    }
  } else {  // the partial last block: true division (clamped index: one block in the tensor)
    const float den = block_den(a);
#pragma unroll
    for (int k = 0; k < kQuantVecs; ++k) {
      const uint4 w = raw[k];
      word[k] = vector_codes<T, V, true>(0u, biased, [&](int j) { return word_value<T>(w, j) / den; });
    }
  }
  if (e0 == start) absmax[b] = stored_absmax(a, full);
  uint8_t* out = packed + e0 / 2;
  if (vec_out && e0 + L::kPerThread <= n) {
    if constexpr (L::kOutBytes == 16) *reinterpret_cast<uint4*>(out) = make_uint4(word[0], word[1], word[2], word[3]);
    else *reinterpret_cast<uint2*>(out) = make_uint2(word[0] | word[1] << 16, word[2] | word[3] << 16);
  } else {
#pragma unroll
    for (int k = 0; k < kQuantVecs; ++k)
#pragma unroll
      for (int j = 0; j < V / 2; ++j)
        if (e0 + k * V + 2 * j < n) out[k * (V / 2) + j] = static_cast<uint8_t>(word[k] >> (8 * j));
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
  using L = QuantLayout<T>;
  quantize_kernel<T, sizeof(T) == 2 ? kQuantMinCtas : 4><<<cuda::grid_for(n, L::kTile), kThreads, 0,
                                                           cuda::stream(stream)>>>(
      x, n, log2_of(blocksize), packed, absmax, cuda::aligned16(x), aligned_to(packed, L::kOutBytes));
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
