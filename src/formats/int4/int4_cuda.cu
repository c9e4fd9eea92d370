// int4 CUDA codec: the per-value rules of int4.h (min_step / max_step / absmax_step,
// asym_params, asym_code, sym_scale, sym_code, pack_pair, decode_asym, decode_sym) under the
// team work split of common/unitwise_cuda.cuh, so GPU bytes equal CPU bytes by
// construction. Inside this file the namespace is always spelled qf::int4 (or reached from
// inside it): `int4` alone is also CUDA's built-in vector type.
//
// Quantize, groups of up to 16384 values (8 per chunk on the vector path; 4096 on the
// unaligned path, 2 values per chunk): one kernel. A team of 1..512 threads holds its group
// in registers (at most 4 chunks of 8 values per thread; group_size 128 -> 4 threads),
// reduces min/max (asymmetric) or absmax (symmetric) with team_reduce (warp shuffles; shared
// memory for teams wider than a warp), writes scale (and zero) and the packed codes: 8 values
// -> 4 bytes, one 4-byte store per chunk (element 2j low nibble, 2j+1 high). DRAM traffic: the
// input once, qweight/scales/zeros once. Longer groups: (1) partial extrema per segment of
// 16384 values into a workspace, (2) one CTA per group combines them and writes scale and
// zero, (3) the codes per segment from the stored scale and zero.
// Dequantize: the same split: 4 bytes (one load) -> 8 values (one or two 16-byte stores).
// pack / unpack: 4 packed bytes per thread (8-byte code loads/stores when aligned).
#include "common/cuda_utils.cuh"
#include "formats/int4/int4.h"
#include "common/unitwise_cuda.cuh"

namespace qf::int4 {
namespace {

namespace uw = ::qf::cuda::unitwise;
constexpr int kCpt = uw::kChunksPerThread;
constexpr int kVec = 8;  // values per chunk on the vector path (2 on the unaligned path: one byte)

struct MinOp {
  __device__ float operator()(float a, float b) const { return min_step(a, b); }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return max_step(a, b); }
};

enum class Pass {
  kFused,       // the team holds its whole group: extrema, scale (and zero), codes
  kPartial,     // extrema of the team's segment -> partial (asym: lo, hi pairs; sym: absmax)
  kFromParams,  // codes of the team's segment from the stored scales[g] (and zeros[g])
};

// Asymmetric: (a, b) = (lo, hi), started at +0; symmetric: a = absmax, started at +0.
template <bool kAsym, class T, int V, Pass P>
__global__ void __launch_bounds__(uw::kThreads, 2)  // <= 64 registers: 2 CTAs (1024 threads) per SM
quantize_kernel(const T* __restrict__ x, int64_t n_chunks, int log_s, int64_t spu, int64_t n_teams,
                uint8_t* __restrict__ qweight, float* __restrict__ scales, uint8_t* __restrict__ zeros,
                float* __restrict__ partial) {
  static_assert(V % 2 == 0, "a chunk is whole bytes of qweight");
  const uw::Team t = uw::team_of(log_s, spu, n_teams);
  const int64_t base = t.unit * n_chunks * V;  // the group's first value
  float f[kCpt][V] = {};
  float a = 0.0f, b = 0.0f;
#pragma unroll
  for (int i = 0; i < kCpt; ++i) {
    const int64_t c = t.chunk(i);
    if (t.active && c < n_chunks) {
      uw::load_chunk<T, V>(x + base + c * V, f[i]);
      if constexpr (P != Pass::kFromParams) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if constexpr (kAsym) {
            a = min_step(a, f[i][j]);
            b = max_step(b, f[i][j]);
          } else {
            a = absmax_step(a, f[i][j]);
          }
        }
      }
    }
  }
  if constexpr (P != Pass::kFromParams) {  // every thread of the CTA gets here
    __shared__ float red_a[uw::kWarps];
    if constexpr (kAsym) {
      __shared__ float red_b[uw::kWarps];
      a = uw::team_reduce(a, log_s, red_a, MinOp{});
      b = uw::team_reduce(b, log_s, red_b, MaxOp{});
    } else {
      a = uw::team_reduce(a, log_s, red_a, MaxOp{});
    }
  }
  if constexpr (P == Pass::kPartial) {
    if (t.active && t.lane == 0) {
      if constexpr (kAsym) {
        partial[2 * t.index] = a;
        partial[2 * t.index + 1] = b;
      } else {
        partial[t.index] = a;
      }
    }
  } else {
    if (!t.active) return;
    AsymParams ap{0.0f, 0.0f};  // asymmetric
    float s = 0.0f;             // symmetric
    if constexpr (P == Pass::kFromParams) {
      s = scales[t.unit];
      if constexpr (kAsym) ap = AsymParams{s, static_cast<float>(zeros[t.unit])};
    } else if constexpr (kAsym) {
      ap = asym_params(a, b);
      if (t.lane == 0) {
        scales[t.unit] = ap.scale;
        zeros[t.unit] = static_cast<uint8_t>(ap.zero);
      }
    } else {
      s = sym_scale(a);
      if (t.lane == 0) scales[t.unit] = s;
    }
    uint8_t* qw = qweight + base / 2;
    // asym_code / sym_code give 0 for every value of a scale-0 group: that test is uniform
    // over the group, so it is taken once here rather than once per value (inside the branch
    // below the compiler knows the scale is nonzero and drops the codes' own test).
    if ((kAsym ? ap.scale : s) == 0.0f) {
#pragma unroll
      for (int i = 0; i < kCpt; ++i) {
        const int64_t c = t.chunk(i);
        if (c < n_chunks) {
          const uint8_t zeros_out[V / 2] = {};
          uw::store_bytes<V / 2>(qw + c * (V / 2), zeros_out);
        }
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < kCpt; ++i) {
      const int64_t c = t.chunk(i);
      if (c < n_chunks) {
        uint8_t bytes[V / 2];
#pragma unroll
        for (int k = 0; k < V / 2; ++k) {
          const float lo = f[i][2 * k], hi = f[i][2 * k + 1];
          if constexpr (kAsym) bytes[k] = pack_pair(asym_code(lo, ap), asym_code(hi, ap));
          else bytes[k] = pack_pair(sym_code(lo, s), sym_code(hi, s));
        }
        uw::store_bytes<V / 2>(qw + c * (V / 2), bytes);
      }
    }
  }
}

// One CTA per group: the group's spu partial extrema -> scales[g] (and zeros[g]).
template <bool kAsym>
__global__ void __launch_bounds__(uw::kThreads)
group_params_kernel(const float* __restrict__ partial, int64_t spu, float* __restrict__ scales,
                    uint8_t* __restrict__ zeros) {
  __shared__ float red_a[uw::kWarps];
  __shared__ float red_b[uw::kWarps];
  const int64_t g = blockIdx.x;
  float a = 0.0f, b = 0.0f;
  for (int64_t s = threadIdx.x; s < spu; s += uw::kThreads) {
    if constexpr (kAsym) {
      a = min_step(a, partial[2 * (g * spu + s)]);
      b = max_step(b, partial[2 * (g * spu + s) + 1]);
    } else {
      a = max_step(a, partial[g * spu + s]);
    }
  }
  if constexpr (kAsym) {
    a = uw::team_reduce(a, uw::kLogThreads, red_a, MinOp{});
    b = uw::team_reduce(b, uw::kLogThreads, red_b, MaxOp{});
  } else {
    a = uw::team_reduce(a, uw::kLogThreads, red_a, MaxOp{});
  }
  if (threadIdx.x == 0) {
    if constexpr (kAsym) {
      const AsymParams p = asym_params(a, b);
      scales[g] = p.scale;
      zeros[g] = static_cast<uint8_t>(p.zero);
    } else {
      scales[g] = sym_scale(a);
    }
  }
}

template <bool kAsym, class T, int V>
__global__ void __launch_bounds__(uw::kThreads)
dequantize_kernel(const uint8_t* __restrict__ qweight, const float* __restrict__ scales,
                  const uint8_t* __restrict__ zeros, int64_t n_chunks, int log_s, int64_t spu, int64_t n_teams,
                  T* __restrict__ y) {
  static_assert(V % 2 == 0, "a chunk is whole bytes of qweight");
  const uw::Team t = uw::team_of(log_s, spu, n_teams);
  if (!t.active) return;  // no CTA-wide synchronization in this kernel
  const float s = scales[t.unit];
  int z = 0;
  if constexpr (kAsym) z = zeros[t.unit];
  const int64_t base = t.unit * n_chunks * V;
  const uint8_t* qw = qweight + base / 2;
  uint8_t bytes[kCpt][V / 2] = {};
#pragma unroll
  for (int i = 0; i < kCpt; ++i) {
    const int64_t c = t.chunk(i);
    if (c < n_chunks) uw::load_bytes<V / 2>(qw + c * (V / 2), bytes[i]);
  }
#pragma unroll
  for (int i = 0; i < kCpt; ++i) {
    const int64_t c = t.chunk(i);
    if (c < n_chunks) {
      float f[V];
#pragma unroll
      for (int k = 0; k < V / 2; ++k) {
        const int lo = bytes[i][k] & 0x0F, hi = bytes[i][k] >> 4;
        if constexpr (kAsym) {
          f[2 * k] = decode_asym(lo, z, s);
          f[2 * k + 1] = decode_asym(hi, z, s);
        } else {
          f[2 * k] = decode_sym(lo, s);
          f[2 * k + 1] = decode_sym(hi, s);
        }
      }
      uw::store_chunk<T, V>(y + base + c * V, f);
    }
  }
}

// pack / unpack: thread i takes packed bytes [4i, 4i + 4) and codes [8i, 8i + 8).
constexpr int kPackThreads = 256;
constexpr int kPackBytes = 4;

__global__ void __launch_bounds__(kPackThreads)
pack_kernel(const uint8_t* __restrict__ codes, int64_t n_bytes, uint8_t* __restrict__ packed, bool vec) {
  const int64_t j0 = (int64_t(blockIdx.x) * kPackThreads + threadIdx.x) * kPackBytes;
  if (j0 >= n_bytes) return;
  if (vec && j0 + kPackBytes <= n_bytes) {
    uint8_t c[2 * kPackBytes], p[kPackBytes];
    uw::load_bytes<2 * kPackBytes>(codes + 2 * j0, c);
#pragma unroll
    for (int k = 0; k < kPackBytes; ++k) p[k] = pack_pair(c[2 * k], c[2 * k + 1]);
    uw::store_bytes<kPackBytes>(packed + j0, p);
  } else {
    const int64_t j1 = j0 + kPackBytes < n_bytes ? j0 + kPackBytes : n_bytes;
    for (int64_t j = j0; j < j1; ++j) packed[j] = pack_pair(codes[2 * j], codes[2 * j + 1]);
  }
}

__global__ void __launch_bounds__(kPackThreads)
unpack_kernel(const uint8_t* __restrict__ packed, int64_t n_bytes, bool is_signed, uint8_t* __restrict__ codes,
              bool vec) {
  const int64_t j0 = (int64_t(blockIdx.x) * kPackThreads + threadIdx.x) * kPackBytes;
  if (j0 >= n_bytes) return;
  if (vec && j0 + kPackBytes <= n_bytes) {
    uint8_t p[kPackBytes], c[2 * kPackBytes];
    uw::load_bytes<kPackBytes>(packed + j0, p);
#pragma unroll
    for (int k = 0; k < kPackBytes; ++k) {
      c[2 * k] = unpack_nibble(p[k] & 0x0F, is_signed);
      c[2 * k + 1] = unpack_nibble(p[k] >> 4, is_signed);
    }
    uw::store_bytes<2 * kPackBytes>(codes + 2 * j0, c);
  } else {
    const int64_t j1 = j0 + kPackBytes < n_bytes ? j0 + kPackBytes : n_bytes;
    for (int64_t j = j0; j < j1; ++j) {
      codes[2 * j] = unpack_nibble(packed[j] & 0x0F, is_signed);
      codes[2 * j + 1] = unpack_nibble(packed[j] >> 4, is_signed);
    }
  }
}

template <bool kAsym, class T, int V>
void quantize_launch(const T* x, int64_t n_groups, int64_t n_chunks, uint8_t* qweight, float* scales,
                     uint8_t* zeros, cudaStream_t st) {
  const uw::Plan p = uw::make_plan(n_groups, n_chunks);
  if (p.spu == 1) {
    quantize_kernel<kAsym, T, V, Pass::kFused><<<p.grid, uw::kThreads, 0, st>>>(
        x, n_chunks, p.log_s, 1, p.n_teams, qweight, scales, zeros, nullptr);
    cuda::check_launch("int4 quantize kernel");
    return;
  }
  // Groups longer than a CTA holds: partial extrema per segment, scale (and zero) per group, codes.
  uw::Workspace work(size_t(p.n_teams) * (kAsym ? 2 : 1) * sizeof(float), st);
  quantize_kernel<kAsym, T, V, Pass::kPartial><<<p.grid, uw::kThreads, 0, st>>>(
      x, n_chunks, p.log_s, p.spu, p.n_teams, qweight, scales, zeros, work.floats());
  cuda::check_launch("int4 extrema kernel");
  group_params_kernel<kAsym><<<cuda::grid_for(n_groups, 1), uw::kThreads, 0, st>>>(work.floats(), p.spu, scales,
                                                                                    zeros);
  cuda::check_launch("int4 group parameters kernel");
  quantize_kernel<kAsym, T, V, Pass::kFromParams><<<p.grid, uw::kThreads, 0, st>>>(
      x, n_chunks, p.log_s, p.spu, p.n_teams, qweight, scales, zeros, nullptr);
  cuda::check_launch("int4 quantize kernel");
}

template <bool kAsym, class T>
void quantize_dispatch(const T* x, int64_t n_groups, int64_t gs, uint8_t* qweight, float* scales, uint8_t* zeros,
                       void* stream) {
  if (n_groups <= 0 || gs <= 0) return;
  const cudaStream_t st = cuda::stream(stream);
  // Vector path: every chunk of 8 values starts 16-byte aligned in x and 4-byte aligned in qweight.
  if (gs % kVec == 0 && cuda::aligned16(x) && uw::aligned_to(qweight, 4))
    quantize_launch<kAsym, T, kVec>(x, n_groups, gs / kVec, qweight, scales, zeros, st);
  else
    quantize_launch<kAsym, T, 2>(x, n_groups, gs / 2, qweight, scales, zeros, st);
}

template <bool kAsym, class T, int V>
void dequantize_launch(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t n_groups,
                       int64_t n_chunks, T* y, cudaStream_t st) {
  const uw::Plan p = uw::make_plan(n_groups, n_chunks);
  dequantize_kernel<kAsym, T, V><<<p.grid, uw::kThreads, 0, st>>>(qweight, scales, zeros, n_chunks, p.log_s, p.spu,
                                                                   p.n_teams, y);
  cuda::check_launch("int4 dequantize kernel");
}

template <bool kAsym, class T>
void dequantize_dispatch(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t n_groups,
                         int64_t gs, T* y, cudaStream_t st) {
  if (gs % kVec == 0 && uw::aligned_to(qweight, 4) && cuda::aligned16(y))
    dequantize_launch<kAsym, T, kVec>(qweight, scales, zeros, n_groups, gs / kVec, y, st);
  else
    dequantize_launch<kAsym, T, 2>(qweight, scales, zeros, n_groups, gs / 2, y, st);
}

}  // namespace

template <class T>
void quantize_asym_cuda(const T* x, int64_t n_groups, int64_t gs, uint8_t* qweight, float* scales,
                        uint8_t* zeros, void* stream) {
  quantize_dispatch<true>(x, n_groups, gs, qweight, scales, zeros, stream);
}

template <class T>
void quantize_sym_cuda(const T* x, int64_t n_groups, int64_t gs, uint8_t* qweight, float* scales, void* stream) {
  quantize_dispatch<false>(x, n_groups, gs, qweight, scales, nullptr, stream);
}

template <class T>
void dequantize_cuda(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t n_groups,
                     int64_t gs, T* y, void* stream) {
  if (n_groups <= 0 || gs <= 0) return;
  const cudaStream_t st = cuda::stream(stream);
  if (zeros) dequantize_dispatch<true>(qweight, scales, zeros, n_groups, gs, y, st);
  else dequantize_dispatch<false>(qweight, scales, zeros, n_groups, gs, y, st);
}

void pack_cuda(const uint8_t* codes, int64_t n_bytes, uint8_t* packed, void* stream) {
  if (n_bytes <= 0) return;
  const bool vec = uw::aligned_to(codes, 2 * kPackBytes) && uw::aligned_to(packed, kPackBytes);
  const int64_t n_threads = (n_bytes + kPackBytes - 1) / kPackBytes;
  pack_kernel<<<cuda::grid_for(n_threads, kPackThreads), kPackThreads, 0, cuda::stream(stream)>>>(codes, n_bytes,
                                                                                                 packed, vec);
  cuda::check_launch("int4 pack kernel");
}

void unpack_cuda(const uint8_t* packed, int64_t n_bytes, bool is_signed, uint8_t* codes, void* stream) {
  if (n_bytes <= 0) return;
  const bool vec = uw::aligned_to(packed, kPackBytes) && uw::aligned_to(codes, 2 * kPackBytes);
  const int64_t n_threads = (n_bytes + kPackBytes - 1) / kPackBytes;
  unpack_kernel<<<cuda::grid_for(n_threads, kPackThreads), kPackThreads, 0, cuda::stream(stream)>>>(
      packed, n_bytes, is_signed, codes, vec);
  cuda::check_launch("int4 unpack kernel");
}

#define QF_INSTANTIATE(T)                                                                                   \
  template void quantize_asym_cuda<T>(const T*, int64_t, int64_t, uint8_t*, float*, uint8_t*, void*);       \
  template void quantize_sym_cuda<T>(const T*, int64_t, int64_t, uint8_t*, float*, void*);                  \
  template void dequantize_cuda<T>(const uint8_t*, const float*, const uint8_t*, int64_t, int64_t, T*, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::int4
