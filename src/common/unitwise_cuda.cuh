// Work split of the CUDA codecs whose scale covers a run of L consecutive values (a "unit":
// int8 tensors / rows / groups, int4 groups), L known only at run time.
//
// A unit is cut into chunks of V consecutive values (V = 8 on the vector path: 16-byte loads
// for 16-bit inputs, two for float32; smaller where pointers or L do not allow it). A "team"
// of S threads (S a power of two, 1..kThreads) takes one unit; thread `lane` of the team holds
// chunks lane, lane + S, lane + 2S, ... (at most kChunksPerThread of them) in registers, so
// consecutive lanes read consecutive 16-byte words (coalesced), every thread has several
// independent loads in flight, and the unit is read from DRAM once: its reduction (absmax,
// min/max) and its codes both come from the registers. make_plan picks the smallest S that
// holds the unit; a unit longer than a whole CTA holds (kThreads * kChunksPerThread chunks)
// is cut into segments of that size, one CTA-wide team per segment ("spu" segments per
// unit), and the codecs then reduce in two more small kernels.
//
// Reductions are max / min of floats that are never NaN and never -0 (the formats start
// their running extrema at +0 and take fabsf), so they are exact, commutative and
// associative: every launch shape, lane order and segment split gives the serial CPU result.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "common/fp16.h"

namespace qf::cuda::unitwise {

constexpr int kThreads = 512;  // threads per CTA (16 warps), every kernel here
constexpr int kLogThreads = 9;
constexpr int kWarps = kThreads / 32;
constexpr int kChunksPerThread = 4;
static_assert(kThreads == 1 << kLogThreads, "kThreads must be 2^kLogThreads");

inline bool aligned_to(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

// How a launch covers n_units units of n_chunks (>= 1) chunks each.
struct Plan {
  int log_s = 0;        // threads per team = 1 << log_s
  int64_t spu = 1;      // teams (segments) per unit; > 1 only when a team is the whole CTA
  int64_t n_teams = 0;  // n_units * spu
  unsigned grid = 0;    // CTAs of kThreads threads, each kThreads >> log_s teams
};

inline Plan make_plan(int64_t n_units, int64_t n_chunks) {
  Plan p;
  // The smallest team whose threads hold the whole unit, at most a CTA.
  while ((int64_t(kChunksPerThread) << p.log_s) < n_chunks && p.log_s < kLogThreads) ++p.log_s;
  const int64_t per_team = int64_t(kChunksPerThread) << p.log_s;
  p.spu = n_chunks <= per_team ? 1 : (n_chunks + per_team - 1) / per_team;
  p.n_teams = n_units * p.spu;
  p.grid = grid_for(p.n_teams, kThreads >> p.log_s);
  return p;
}

// This thread's place in a launch planned by make_plan (log_s, spu, n_teams as planned).
struct Team {
  int64_t index;  // team number, in [0, n_teams) when active
  int64_t unit;   // the unit it works on
  int64_t first;  // its first chunk within the unit (its segment's start)
  int lane;       // thread within the team, 0..size-1
  int size;       // threads per team
  bool active;    // false for the idle teams of the last CTA
  // This thread's chunk i (0 <= i < kChunksPerThread) within the unit; may be >= n_chunks.
  __device__ int64_t chunk(int i) const { return first + lane + int64_t(i) * size; }
};

__device__ inline Team team_of(int log_s, int64_t spu, int64_t n_teams) {
  Team t;
  t.size = 1 << log_s;
  t.lane = static_cast<int>(threadIdx.x) & (t.size - 1);
  t.index = int64_t(blockIdx.x) * (kThreads >> log_s) + (threadIdx.x >> log_s);
  t.active = t.index < n_teams;
  t.unit = spu == 1 ? t.index : t.index / spu;
  t.first = (t.index - t.unit * spu) * (int64_t(kChunksPerThread) << log_s);
  return t;
}

// v reduced over the team with op (exact, see the header comment); every thread of the team
// gets the result. Every thread of the CTA must call it, with the same log_s (a kernel
// argument): it shuffles with full warp masks and, for teams wider than a warp, meets at a
// __syncthreads. `red` is a __shared__ float[kWarps] that no other call of the kernel uses.
template <class Op>
__device__ inline float team_reduce(float v, int log_s, float* red, Op op) {
  const int width = log_s < 5 ? 1 << log_s : 32;
  for (int o = width >> 1; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (log_s > 5) {  // whole warps: combine the team's warps through shared memory
    const int warp = static_cast<int>(threadIdx.x) >> 5;
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    const int n = 1 << (log_s - 5);     // warps per team
    const int first = warp & ~(n - 1);  // the team's first warp
    v = red[first];
    for (int k = 1; k < n; ++k) v = op(v, red[first + k]);
  }
  return v;
}

// Element conversions on the device. fp16 uses the hardware conversions: cvt.f32.f16 is
// exact (every fp16 value is a float32 value) and cvt.rn.f16.f32 rounds to nearest even with
// subnormal results and overflow to inf (no .ftz: this build never flushes), so both give
// fp16.h's to_f32 / from_f32 bits for every non-NaN value, in one instruction instead of a
// dozen integer operations and two branches (the codecs' kernels would otherwise be bound by
// instruction issue, not by memory). NaN never reaches them: inputs are checked finite
// (where a caller skips that check, the output for NaN is unspecified) and decoded values
// are q * finite scale. float32 and bfloat16 use fp16.h's (a move, a shift, a rounding add).
template <class T>
__device__ inline float load_f32(T v) {
  return to_f32(v);
}
__device__ inline float load_f32(half_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
template <class T>
__device__ inline void store_f32(float f, T* out) {
  from_f32(f, out);
}
__device__ inline void store_f32(float f, half_t* out) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  out->bits = h;
}

// V values at p as float32: 16-byte loads when V * sizeof(T) is a multiple of 16 (the caller
// then guarantees that p is 16-byte aligned), element loads otherwise.
template <class T, int V>
__device__ inline void load_chunk(const T* __restrict__ p, float (&f)[V]) {
  T t[V];
  if constexpr ((V * sizeof(T)) % 16 == 0) {
    uint4 w[V * sizeof(T) / 16];
#pragma unroll
    for (int i = 0; i < int(V * sizeof(T) / 16); ++i) w[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
    memcpy(t, w, sizeof(t));  // register-to-register
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) t[j] = p[j];
  }
#pragma unroll
  for (int j = 0; j < V; ++j) f[j] = load_f32(t[j]);
}

// V float32 values rounded once to T (store_f32) and stored at p, as load_chunk.
template <class T, int V>
__device__ inline void store_chunk(T* __restrict__ p, const float (&f)[V]) {
  T t[V];
#pragma unroll
  for (int j = 0; j < V; ++j) store_f32(f[j], &t[j]);
  if constexpr ((V * sizeof(T)) % 16 == 0) {
    uint4 w[V * sizeof(T) / 16];
    memcpy(w, t, sizeof(t));
#pragma unroll
    for (int i = 0; i < int(V * sizeof(T) / 16); ++i) reinterpret_cast<uint4*>(p)[i] = w[i];
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = t[j];
  }
}

// N bytes at p: one access for N = 4 or 8 (p then N-byte aligned, checked by the caller),
// bytewise otherwise.
template <int N>
__device__ inline void load_bytes(const uint8_t* __restrict__ p, uint8_t (&b)[N]) {
  if constexpr (N == 8) {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
    memcpy(b, &w, 8);
  } else if constexpr (N == 4) {
    const unsigned w = __ldg(reinterpret_cast<const unsigned*>(p));
    memcpy(b, &w, 4);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) b[j] = p[j];
  }
}

template <int N>
__device__ inline void store_bytes(uint8_t* __restrict__ p, const uint8_t (&b)[N]) {
  if constexpr (N == 8) {
    uint2 w;
    memcpy(&w, b, 8);
    *reinterpret_cast<uint2*>(p) = w;
  } else if constexpr (N == 4) {
    unsigned w;
    memcpy(&w, b, 4);
    *reinterpret_cast<unsigned*>(p) = w;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = b[j];
  }
}

// ---- Raw chunks: the fused vector-path kernels ---------------------------------------------
//
// The fused quantizers keep a thread's chunks as the loaded 16-byte words (8 values: one word
// for 16-bit types, two for float32) and convert each value to float32 only where its code is
// computed: half the registers of a float32 copy for 16-bit inputs (so more threads, and more
// loads in flight, per SM), and the reductions run on packed pairs where the hardware has
// them (sm_80+: one HMNMX2 per two fp16 / bf16 values instead of two float32 steps).
template <class T>
struct Raw8 {
  static constexpr int kWords = 8 * int(sizeof(T)) / 16;  // 1 (16-bit types) or 2 (float32)
  uint4 w[kWords];
};

// CTAs of kThreads per SM that the fused kernels ask the register allocator for: 3 (40
// registers: 1536 threads and 48 KB of loads in flight per SM) for 16-bit inputs, measured on
// an H200 a little faster than 4 (32 registers, where the rare paths spill), and 2 for float32
// (whose raw chunks alone take 32 registers). min_ctas_for_arch caps a count at what the
// architecture being compiled holds (threads per SM: 1024 on sm_75, 1536 on sm_86 / sm_89,
// 2048 elsewhere), for __launch_bounds__ only: the cap differs between compilation passes, so
// it must never reach a template argument.
template <class T>
constexpr int fused_min_ctas() {
  return sizeof(T) == 2 ? 3 : 2;
}

constexpr int min_ctas_for_arch(int ctas, int threads_per_cta) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
  constexpr int kMaxThreadsPerSm = 1024;
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 890)
  constexpr int kMaxThreadsPerSm = 1536;
#else
  constexpr int kMaxThreadsPerSm = 2048;
#endif
  return ctas * threads_per_cta <= kMaxThreadsPerSm ? ctas : kMaxThreadsPerSm / threads_per_cta;
}

template <class T>
__device__ inline void load_raw8(const T* __restrict__ p, Raw8<T>& r) {
#pragma unroll
  for (int i = 0; i < Raw8<T>::kWords; ++i) r.w[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
}
template <class T>
__device__ inline void zero_raw8(Raw8<T>& r) {
#pragma unroll
  for (int i = 0; i < Raw8<T>::kWords; ++i) r.w[i] = make_uint4(0u, 0u, 0u, 0u);
}

// The 32-bit word holding value j (0..7) of a chunk, and value j as float32 (exact: the same
// value as load_f32 / to_f32). j is a compile-time constant after unrolling, so both are
// register selections, not memory accesses.
template <class T>
__device__ inline uint32_t raw_word(const Raw8<T>& r, int j) {
  constexpr int kPerWord = 4 / int(sizeof(T));  // values per 32-bit word: 2 or 1
  const int k = j / kPerWord;
  const uint4& w = r.w[k / 4];
  const int c = k % 4;
  return c == 0 ? w.x : c == 1 ? w.y : c == 2 ? w.z : w.w;
}
template <class T>
__device__ inline float raw_value(const Raw8<T>& r, int j) {
  const uint32_t u = raw_word(r, j);
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(u);
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    return __uint_as_float(j % 2 ? u & 0xFFFF0000u : u << 16);  // bf16 -> float32: the high half
  } else {
    return load_f32(half_t{static_cast<uint16_t>(j % 2 ? u >> 16 : u & 0xFFFFu)});  // cvt.f32.f16
  }
}

// Value e (0 .. 8N - 1, known only at run time) of N chunks, by selects among the registers
// (an array indexed at run time would live in local memory, and so would the chunks).
template <class T, int N>
__device__ inline float raw_value_at(const Raw8<T> (&r)[N], int e) {
  constexpr int kPerWord = 4 / int(sizeof(T));
  constexpr int kWordsPerChunk = 8 / kPerWord;
  const int wanted = e / kPerWord;  // word index over all chunks
  uint32_t u = 0;
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int k = 0; k < kWordsPerChunk; ++k)
      if (wanted == i * kWordsPerChunk + k) u = raw_word(r[i], k * kPerWord);
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(u);
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    return __uint_as_float(e % 2 ? u & 0xFFFF0000u : u << 16);
  } else {
    return load_f32(half_t{static_cast<uint16_t>(e % 2 ? u >> 16 : u & 0xFFFFu)});
  }
}

template <class T>
__device__ inline float raw_value_at(const Raw8<T>& r, int e) {
  const Raw8<T> rs[1] = {r};
  return raw_value_at(rs, e);
}

// Packed min / max of two fp16 or bf16 pairs (IEEE minNum / maxNum: a NaN operand is skipped)
// and max with NaN propagation; sm_80+ only (the callers take the float32 loop below sm_80).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <class T>
__device__ inline uint32_t pair_min(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (std::is_same_v<T, bf16_t>) asm("min.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else asm("min.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
template <class T>
__device__ inline uint32_t pair_max(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (std::is_same_v<T, bf16_t>) asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
template <class T>
__device__ inline uint32_t pair_max_nan(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (std::is_same_v<T, bf16_t>) asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
template <class T>
__device__ inline uint32_t pair_min_nan(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (std::is_same_v<T, bf16_t>) asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else asm("min.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// The two 16-bit values of a packed word as float32 (exact).
template <class T>
__device__ inline float pair_lo(uint32_t u) {
  if constexpr (std::is_same_v<T, bf16_t>) return __uint_as_float(u << 16);
  else return load_f32(half_t{static_cast<uint16_t>(u & 0xFFFFu)});
}
template <class T>
__device__ inline float pair_hi(uint32_t u) {
  if constexpr (std::is_same_v<T, bf16_t>) return __uint_as_float(u & 0xFFFF0000u);
  else return load_f32(half_t{static_cast<uint16_t>(u >> 16)});
}
template <class T>
constexpr bool kPackedPairs = sizeof(T) == 2;
#else
template <class T>
constexpr bool kPackedPairs = false;
#endif

// lo = min(+0, every value), hi = max(+0, every value) over N chunks, NaN skipped: the set
// minimum / maximum, hence the result of any order of int4's min_step / max_step from +0.
// A packed or fminf step may keep -0 where the serial steps keep +0; the last two lines turn
// every zero result into +0, so lo and hi are bit-exact.
template <class T, int N>
__device__ inline void range_raw(const Raw8<T> (&r)[N], float& lo, float& hi) {
  if constexpr (kPackedPairs<T>) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t l = 0u, h = 0u;  // two +0 values each
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        l = pair_min<T>(l, raw_word(r[i], j));
        h = pair_max<T>(h, raw_word(r[i], j));
      }
    lo = fminf(pair_lo<T>(l), pair_hi<T>(l));
    hi = fmaxf(pair_lo<T>(h), pair_hi<T>(h));
#endif
  } else {
    lo = 0.0f;
    hi = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        lo = fminf(lo, raw_value(r[i], j));
        hi = fmaxf(hi, raw_value(r[i], j));
      }
  }
  lo = lo < 0.0f ? lo : 0.0f;
  hi = hi > 0.0f ? hi : 0.0f;
}

// max(+0, |every value|) over N chunks, exact, with `nan` set when some value is NaN (then
// the result is meaningless and the caller recomputes it its own way). Packed: the maximum and
// the minimum with NaN propagation (the three-input HMNMX2 takes two words per instruction),
// then max(max, -min) = max |v|, a zero result made +0.
template <class T, int N>
__device__ inline float absmax_raw(const Raw8<T> (&r)[N], bool& nan) {
  if constexpr (kPackedPairs<T>) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t hi = raw_word(r[0], 0), lo = hi;
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        hi = pair_max_nan<T>(hi, raw_word(r[i], j));
        lo = pair_min_nan<T>(lo, raw_word(r[i], j));
      }
    const float h0 = pair_lo<T>(hi), h1 = pair_hi<T>(hi);
    nan = h0 != h0 || h1 != h1;  // a NaN reaches both the maximum and the minimum
    const float a = fmaxf(fmaxf(h0, h1), -fminf(pair_lo<T>(lo), pair_hi<T>(lo)));
    return a > 0.0f ? a : 0.0f;
#endif
  } else {
    float a = 0.0f;
    bool n = false;
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float v = raw_value(r[i], j);
        a = fmaxf(a, fabsf(v));
        n |= v != v;
      }
    nan = n;
    return a;
  }
}

// absmax_raw where no value is NaN; otherwise the format's own rule folded over every value from
// +0 (step(amax, v), the header's absmax_step: what it makes of a NaN is the format's business,
// a NaN input being outside the checked API).
template <class T, int N, class Step>
__device__ __forceinline__ float absmax_or_fold(const Raw8<T> (&r)[N], Step step) {
  bool nan;
  float a = absmax_raw(r, nan);
  if (nan) {
    a = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) a = step(a, raw_value(r[i], j));
  }
  return a;
}

// A stream-ordered device workspace for the segment path (partial reductions): allocated
// with cudaMallocAsync on the launch stream and freed with cudaFreeAsync after the kernels
// queued before the destructor runs, also when a launch check throws in between.
class Workspace {
 public:
  Workspace(size_t bytes, cudaStream_t s) : stream_(s) {
    check(cudaMallocAsync(&ptr_, bytes, s), "workspace allocation (cudaMallocAsync)");
  }
  ~Workspace() {
    if (ptr_) (void)cudaFreeAsync(ptr_, stream_);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  float* floats() const { return static_cast<float*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace qf::cuda::unitwise
