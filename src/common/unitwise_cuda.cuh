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
    const int n = 1 << (log_s - 5);      // warps per team
    const int first = warp & ~(n - 1);   // the team's first warp
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
__device__ inline float load_f32(T v) { return to_f32(v); }
__device__ inline float load_f32(half_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
template <class T>
__device__ inline void store_f32(float f, T* out) { from_f32(f, out); }
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
