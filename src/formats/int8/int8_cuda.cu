// int8 CUDA codec: the per-value rules of int8.h (absmax_step, multiplier, scale_of,
// quantize_value, dequantize_value) under the team work split of unitwise_cuda.cuh, so GPU
// bytes equal CPU bytes.
//
// Quantize, units of up to 16384 values (8 per chunk on the vector path; 2048 on the
// unaligned path): one kernel. A team of 1..512 threads holds its unit in registers (at most
// 4 chunks of 8 values per thread), takes absmax (per thread, then team_reduce: warp shuffles
// and, for teams wider than a warp, shared memory), writes the scale and the codes (8 codes =
// one 8-byte store per chunk). The vector path (quantize_fused_kernel) keeps the chunks as the
// loaded 16-byte words, reduces packed pairs, and makes a code with one multiply and one add
// (exact: see the kernel); the unaligned path (quantize_kernel) runs quantize_value per value.
// DRAM traffic: the input once, the codes and scales once. Per-tensor units and longer rows:
// (1) absmax per segment of 16384 values into a workspace, (2) one CTA per unit combines its
// segments and writes the scale and the absmax, (3) the codes per segment: the input is read
// twice (unavoidable when a unit does not fit on chip), the reductions stay exact.
// Dequantize: the same split, no reduction: 8 codes (one 8-byte load) -> 8 values (one or two
// 16-byte stores) per chunk, the unit's scale read once per thread.
#include "common/cuda_utils.cuh"
#include "common/unitwise_cuda.cuh"
#include "formats/int8/int8.h"

namespace qf::int8 {
namespace {

namespace uw = ::qf::cuda::unitwise;
constexpr int kCpt = uw::kChunksPerThread;
constexpr int kVec = 8;  // values per chunk on the vector path (1 on the unaligned path)

struct MaxOp {
  __device__ float operator()(float a, float b) const { return max_combine(a, b); }
};

enum class Pass {
  kFused,     // the team holds its whole unit: absmax, scale, codes
  kPartial,   // absmax of the team's segment -> partial[team]
  kFromAmax,  // codes of the team's segment from amax[unit] (the scale is already written)
};

template <class T, int V, Pass P>
__global__ void
__launch_bounds__(uw::kThreads, 2
)  // <= 64 registers: 2 CTAs (1024 threads) per SM
quantize_kernel(const T* __restrict__ x, int64_t n_chunks, int log_s, int64_t spu, int64_t n_teams,
                int8_t* __restrict__ q, float* __restrict__ scale, float* __restrict__ partial,
                const float* __restrict__ amax_in) {
  const uw::Team t = uw::team_of(log_s, spu, n_teams);
  const int64_t base = t.unit * n_chunks * V;  // the unit's first value
  float f[kCpt][V] = {};
  float amax = 0.0f;  // +0 start, as absmax_run
#pragma unroll
  for (int i = 0; i < kCpt; ++i) {
    const int64_t c = t.chunk(i);
    if (t.active && c < n_chunks) {
      uw::load_chunk<T, V>(x + base + c * V, f[i]);
      if constexpr (P != Pass::kFromAmax) {
#pragma unroll
        for (int j = 0; j < V; ++j) amax = absmax_step(amax, f[i][j]);
      }
    }
  }
  if constexpr (P != Pass::kFromAmax) {
    __shared__ float red[uw::kWarps];
    amax = uw::team_reduce(amax, log_s, red, MaxOp{});  // every thread of the CTA gets here
  }
  if constexpr (P == Pass::kPartial) {
    if (t.active && t.lane == 0) partial[t.index] = amax;
  } else {
    if (!t.active) return;
    if constexpr (P == Pass::kFromAmax) {
      amax = amax_in[t.unit];
    } else {
      if (t.lane == 0) scale[t.unit] = scale_of(amax);
    }
    const float m = multiplier(amax);
    uint8_t* qu = reinterpret_cast<uint8_t*>(q) + base;
#pragma unroll
    for (int i = 0; i < kCpt; ++i) {
      const int64_t c = t.chunk(i);
      if (c < n_chunks) {
        uint8_t b[V];
#pragma unroll
        for (int j = 0; j < V; ++j) b[j] = static_cast<uint8_t>(quantize_value(f[i][j], m));
        uw::store_bytes<V>(qu + c * V, b);
      }
    }
  }
}

// ---- The fused vector-path quantizer ----------------------------------------------------------
//
// The same rule with fewer instructions per value (about 4 for fp16 input, against about 20
// for quantize_kernel). A thread keeps its chunks as the loaded 16-byte words (unitwise Raw8:
// half the registers of float32 copies for 16-bit inputs), its absmax comes from packed pair
// maxima and minima (unitwise absmax_raw), and a code is one multiply and one add: for a unit with a finite multiplier m > 0 (0 < absmax < inf and 127 / absmax < inf) and
// a finite x, v = fl(x * m) has |v| <= 127 (1 + 2^-24)^2 < 127.5, and y = fl(v + 1.5 * 2^23) is
// the very rounding that rint_small performs (quantize_value computes (v' + 1.5 * 2^23) - 1.5 *
// 2^23 with v' = v clamped to [-127, 127]; the clamp moves v by less than 2^-16 and only from
// (127, 127.5), where both round to 127, likewise below -127). y is then 1.5 * 2^23 + q for the
// code q in [-127, 127], whose low byte is q's two's complement: codes are byte permutes of the
// sums' bits, 8 per 8-byte store. Units without a finite m > 0 (absmax 0, < 3.7e-37, inf or NaN)
// and threads holding a NaN (0 by the rule, where y would be a NaN's low byte) take
// quantize_value itself.
constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23

template <class T, int kMinCtas = uw::fused_min_ctas<T>()>
__global__ void __launch_bounds__(uw::kThreads, uw::min_ctas_for_arch(kMinCtas, uw::kThreads))
quantize_fused_kernel(const T* __restrict__ x, int64_t n_chunks, int log_s, int64_t n_teams, int8_t* __restrict__ q,
                      float* __restrict__ scale) {
  const uw::Team t = uw::team_of(log_s, 1, n_teams);
  const int64_t base = t.unit * n_chunks * kVec;  // the unit's first value
  uw::Raw8<T> r[kCpt];
#pragma unroll
  for (int i = 0; i < kCpt; ++i) {  // all loads first: kCpt 16-byte loads (32 for float32) in flight
    const int64_t c = t.chunk(i);
    if (t.active && c < n_chunks) uw::load_raw8(x + base + c * kVec, r[i]);
    else uw::zero_raw8(r[i]);  // +0: neutral for absmax, never stored
  }
  bool nan;
  float amax = uw::absmax_raw(r, nan);
  // (uw::absmax_or_fold, which int4 uses, is this; here it measured slower on the H200, so the
  // loop stays written out: benchmarks/README.md, "Design measurements behind kernel choices".)
  if (nan) {  // absmax_step's own NaN behaviour (a NaN input is outside the checked API)
    amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kCpt; ++i)
#pragma unroll
      for (int j = 0; j < kVec; ++j) amax = absmax_step(amax, uw::raw_value(r[i], j));
  }
  {
    __shared__ float red[uw::kWarps];
    amax = uw::team_reduce(amax, log_s, red, MaxOp{});  // every thread of the CTA gets here
  }
  if (!t.active) return;
  if (t.lane == 0) scale[t.unit] = scale_of(amax);
  const float m = multiplier(amax);
  uint8_t* qu = reinterpret_cast<uint8_t*>(q) + base;
  if (m > 0.0f && m < INFINITY && !nan) {
#pragma unroll
    for (int i = 0; i < kCpt; ++i) {
      uint32_t y[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) y[j] = __float_as_uint(__fadd_rn(__fmul_rn(uw::raw_value(r[i], j), m), kMagic));
      uint2 w;  // byte j = low byte of y[j]
      w.x = __byte_perm(__byte_perm(y[0], y[1], 0x0040), __byte_perm(y[2], y[3], 0x0040), 0x5410);
      w.y = __byte_perm(__byte_perm(y[4], y[5], 0x0040), __byte_perm(y[6], y[7], 0x0040), 0x5410);
      const int64_t c = t.chunk(i);
      if (c < n_chunks) *reinterpret_cast<uint2*>(qu + c * kVec) = w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kCpt; ++i) {
      uint8_t b[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) b[j] = static_cast<uint8_t>(quantize_value(uw::raw_value(r[i], j), m));
      const int64_t c = t.chunk(i);
      if (c < n_chunks) uw::store_bytes<kVec>(qu + c * kVec, b);
    }
  }
}

// One CTA per unit: the unit's spu partial maxima -> amax[unit] and scale[unit].
__global__ void __launch_bounds__(uw::kThreads)
unit_absmax_kernel(const float* __restrict__ partial, int64_t spu, float* __restrict__ amax_out,
                   float* __restrict__ scale) {
  __shared__ float red[uw::kWarps];
  const int64_t u = blockIdx.x;
  float a = 0.0f;
  for (int64_t s = threadIdx.x; s < spu; s += uw::kThreads) a = max_combine(a, partial[u * spu + s]);
  a = uw::team_reduce(a, uw::kLogThreads, red, MaxOp{});
  if (threadIdx.x == 0) {
    amax_out[u] = a;
    scale[u] = scale_of(a);
  }
}

template <class T, int V>
__global__ void __launch_bounds__(uw::kThreads)
dequantize_kernel(const int8_t* __restrict__ q, const float* __restrict__ scale, int64_t n_chunks, int log_s,
                  int64_t spu, int64_t n_teams, T* __restrict__ y) {
  const uw::Team t = uw::team_of(log_s, spu, n_teams);
  if (!t.active) return;  // no CTA-wide synchronization in this kernel
  const float s = scale[t.unit];
  const int64_t base = t.unit * n_chunks * V;
  const uint8_t* qu = reinterpret_cast<const uint8_t*>(q) + base;
  uint8_t b[kCpt][V] = {};
#pragma unroll
  for (int i = 0; i < kCpt; ++i) {
    const int64_t c = t.chunk(i);
    if (c < n_chunks) uw::load_bytes<V>(qu + c * V, b[i]);
  }
#pragma unroll
  for (int i = 0; i < kCpt; ++i) {
    const int64_t c = t.chunk(i);
    if (c < n_chunks) {
      float f[V];
#pragma unroll
      for (int j = 0; j < V; ++j) f[j] = dequantize_value(static_cast<int8_t>(b[i][j]), s);
      uw::store_chunk<T, V>(y + base + c * V, f);
    }
  }
}

template <class T, int V>
void quantize_launch(const T* x, int64_t n_units, int64_t n_chunks, int8_t* q, float* scale, cudaStream_t st) {
  const uw::Plan p = uw::make_plan(n_units, n_chunks);
  if (V == kVec && p.spu == 1) {
    quantize_fused_kernel<T><<<p.grid, uw::kThreads, 0, st>>>(x, n_chunks, p.log_s, p.n_teams, q, scale);
    cuda::check_launch("int8 quantize kernel");
    return;
  }
  if (p.spu == 1) {
    quantize_kernel<T, V, Pass::kFused><<<p.grid, uw::kThreads, 0, st>>>(x, n_chunks, p.log_s, 1, p.n_teams, q,
                                                                        scale, nullptr, nullptr);
    cuda::check_launch("int8 quantize kernel");
    return;
  }
  // Units longer than a CTA holds: partial absmax per segment, absmax and scale per unit, codes.
  uw::Workspace work(size_t(p.n_teams + n_units) * sizeof(float), st);
  float* partial = work.floats();
  float* amax = partial + p.n_teams;
  quantize_kernel<T, V, Pass::kPartial><<<p.grid, uw::kThreads, 0, st>>>(x, n_chunks, p.log_s, p.spu, p.n_teams, q,
                                                                        scale, partial, nullptr);
  cuda::check_launch("int8 absmax kernel");
  unit_absmax_kernel<<<cuda::grid_for(n_units, 1), uw::kThreads, 0, st>>>(partial, p.spu, amax, scale);
  cuda::check_launch("int8 absmax reduction kernel");
  quantize_kernel<T, V, Pass::kFromAmax><<<p.grid, uw::kThreads, 0, st>>>(x, n_chunks, p.log_s, p.spu, p.n_teams,
                                                                         q, scale, nullptr, amax);
  cuda::check_launch("int8 quantize kernel");
}

template <class T, int V>
void dequantize_launch(const int8_t* q, const float* scale, int64_t n_units, int64_t n_chunks, T* y,
                       cudaStream_t st) {
  const uw::Plan p = uw::make_plan(n_units, n_chunks);
  dequantize_kernel<T, V><<<p.grid, uw::kThreads, 0, st>>>(q, scale, n_chunks, p.log_s, p.spu, p.n_teams, y);
  cuda::check_launch("int8 dequantize kernel");
}

}  // namespace

template <class T>
void quantize_cuda(const T* x, int64_t n_units, int64_t unit_len, int8_t* q, float* scale, void* stream) {
  if (n_units <= 0) return;
  const cudaStream_t st = cuda::stream(stream);
  if (unit_len <= 0) {  // empty units: absmax 0, scale +0 (all-zero bits), no codes
    cuda::check(cudaMemsetAsync(scale, 0, size_t(n_units) * sizeof(float), st), "int8 quantize (empty units)");
    return;
  }
  // Vector path: every chunk of 8 values starts 16-byte aligned in x and 8-byte aligned in q.
  if (unit_len % kVec == 0 && cuda::aligned16(x) && uw::aligned_to(q, 8))
    quantize_launch<T, kVec>(x, n_units, unit_len / kVec, q, scale, st);
  else
    quantize_launch<T, 1>(x, n_units, unit_len, q, scale, st);
}

template <class T>
void dequantize_cuda(const int8_t* q, const float* scale, int64_t n_units, int64_t unit_len, T* y, void* stream) {
  if (n_units <= 0 || unit_len <= 0) return;
  const cudaStream_t st = cuda::stream(stream);
  if (unit_len % kVec == 0 && uw::aligned_to(q, 8) && cuda::aligned16(y))
    dequantize_launch<T, kVec>(q, scale, n_units, unit_len / kVec, y, st);
  else
    dequantize_launch<T, 1>(q, scale, n_units, unit_len, y, st);
}

#define QF_INSTANTIATE(T)                                                                       \
  template void quantize_cuda<T>(const T*, int64_t, int64_t, int8_t*, float*, void*);           \
  template void dequantize_cuda<T>(const int8_t*, const float*, int64_t, int64_t, T*, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::int8
