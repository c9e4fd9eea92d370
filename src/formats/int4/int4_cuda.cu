// int4 CUDA codec: the per-value rules of int4.h (min_step / max_step / absmax_step,
// asym_params, asym_code, sym_scale, sym_code, pack_pair, decode_asym, decode_sym) under the
// team work split of common/unitwise_cuda.cuh, so GPU bytes equal CPU bytes. Inside this file
// the namespace is always spelled qf::int4 (or reached from inside it): `int4` alone is also
// CUDA's built-in vector type.
//
// Quantize, vector path (16-byte aligned input, group_size % 8 == 0), groups of up to 16384
// values: quantize_fused_kernel. A team of 1..512 threads holds its group in registers as the
// loaded 16-byte words (each thread 4 consecutive chunks of 8 values; group_size 128 -> 4
// threads), reduces min/max (asymmetric) or absmax (symmetric) on packed pairs and then with
// team_reduce, writes scale (and zero), and computes the codes by a reciprocal multiply with a
// tie guard that is exact (the proof is at the kernel), one 16-byte store per thread. DRAM
// traffic: the input once, qweight/scales/zeros once.
// Unaligned input (2 values per chunk, groups up to 4096) and longer groups: quantize_kernel,
// the rule value by value (a true division per value); longer groups in three passes: (1)
// partial extrema per segment of 16384 values into a workspace, (2) one CTA per group combines
// them and writes scale and zero, (3) the codes per segment from the stored scale and zero.
// Dequantize: the same split: 4 bytes (one load) -> 8 values (one or two 16-byte stores).
// pack / unpack: 4 packed bytes per thread (8-byte code loads/stores when aligned).
#include "common/cuda_utils.cuh"
#include "common/unitwise_cuda.cuh"
#include "formats/int4/int4.h"

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
__global__ void
__launch_bounds__(uw::kThreads, 2
)  // <= 64 registers: 2 CTAs (1024 threads) per SM
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

// ---- The fused vector-path quantizer: codes by a reciprocal multiply, exact by a tie guard ----
//
// The rule's code needs rint(fl(x / s)) for the group's scale s (asymmetric: + zero, clamped to
// [0, 15]; symmetric: clamped to [-8, 7]). A true division costs ~10 instructions per value
// (reciprocal, Newton steps, range check, slow-path branch). This kernel takes inv = fl(1 / s)
// once and per value p = x * inv, unrounded, inside two fused multiply-adds:
//   y = fl(p + M), M = 1.5 * 2^23 + c (c = zero, asymmetric; 8, symmetric), k' = y - M,
//   d = fl(p - k'),  flagged unless |d| < kTieGuard = 0.5 - 2^-17,
// and takes the code of an unflagged value from y's bits; a flagged value (p within about 2^-17
// of a half-integer, or NaN) gets the rule's code from tie_code, exactly and without a division.
// Proof, for a group with kFastMin = 2^-100 <= s < inf (other groups: the rule, value by value):
//
// (1) |x / s| <= 15 (1 + 2^-22) for every x of an asymmetric group: |x| <= max(hi, -lo) <=
//     hi - lo, and s >= ((hi - lo) / 15)(1 - 2^-24)^2 in both branches of asym_scale (every
//     rounding here has a normal result: relative error at most 2^-24). Symmetric: |x| <= amax
//     and s = fl(amax / 7) >= (amax / 7)(1 - 2^-24), so |x / s| <= 7 (1 + 2^-23). So for the
//     true quotient q = x / s: |q| < 16, fl(q) <= 15.0001 is within 2^-21 of q (half an ulp
//     below 16), and the rule's clamp of x / s to [-16, 16] (symmetric: [-8, 7], before
//     rounding) acts on the rounded integer at most as said in (4).
// (2) inv = (1 / s)(1 + e), |e| <= 2^-24, so |p - q| <= |q| 2^-24 < 2^-20 and |p - fl(q)| <
//     2^-20 + 2^-21.
// (3) |p| < 16, so p + M lies in [2^23, 2^24), where floats are the integers: y = M + k' with k'
//     an integer nearest p (at an exact tie either neighbour, |p - k'| = 0.5: flagged below),
//     k' = y - M exactly. Rounding is monotone and kTieGuard is a float, so |d| < kTieGuard means
//     |p - k'| < kTieGuard: every half-integer is more than 2^-17 > |p - fl(q)| away from p, so
//     fl(q) is on p's side of each, and rint(fl(q)) = k', the rule's rounded quotient. The test
//     is written !(|d| < kTieGuard), so a NaN (a NaN input) is flagged too.
// (4) Asymmetric clamp to [0, 15] of k' + zero: k' >= -zero always (x >= lo, so fl(x / s) >=
//     fl(lo / s) = -fl(-lo / s), rint is monotone and odd, and zero = rint(fl(-lo / s))
//     unclamped, as 0 <= -lo / s <= 15 (1 + 2^-22) < 15.5 by (1)). k' + zero >= 16 would need
//     fl(q) >= k' - 0.5 and fl(-lo / s) >= zero - 0.5, while fl(q) + fl(-lo / s) <= ((hi - lo) /
//     s)(1 + 2^-24) <= 15 + 2^-18.3: fl(q) within 2^-18.3 of the half-integer k' - 0.5, so p
//     within 2^-18.3 + 2^-19.4 < 2^-17 of it, which (3) flags. So an unflagged c + k' is the
//     rule's code, in [0, 15]. Symmetric: |fl(q)| <= 7.0001, so rint(fl(q)) is in [-7, 7] and
//     the clamp to [-8, 7] never acts; c + k' is in [1, 15].
//     Codes come out of y's bits: bits(y) - bits(1.5 * 2^23) = c + k' (asymmetric: the code;
//     symmetric: the code + 8, fixed by an xor with 8 per nibble); a chunk's word is sum_j (c +
//     k'_j) 16^j, accumulated from the raw bits (the constant subtracted once per word).
// (5) A flagged value (tie_code): h = k' + copysign(1/2, d) is the half-integer next to p
//     (|p - h| <= 2^-17 + 2^-25), so |x / s - h| < 2^-16. z = fma(-h, s, x) is x - h s exactly:
//     |x| > s / 4, so x and h s = (2h) s / 2 are multiples of ulp(s) / 4, and their difference,
//     below 2^-16 s < 2^8 ulp(s) in magnitude, has at most 10 significant bits. fl(x / s) = h
//     exactly when x / s lies in h's rounding interval [h - u_in, h + u_out] (u: half the float
//     spacing on either side of h, 2^(E - 24) for 2^E <= |h| < 2^(E + 1), except 2^-26 below
//     |h| = 1/2, a power of two; the interval is closed because h, with at most 5 significant
//     bits, ends in a 0 bit, so ties go to h): with u s exact (no underflow: s >= 2^-100), that
//     is |z| <= u s on z's side. Then rint(fl(x / s)) = rint(h), the even one of h -+ 1/2;
//     otherwise fl(x / s) != h is on z's side of h, within 2^-16 of it, and rounds to h + 1/2 or
//     h - 1/2 on that side. A NaN gets the rule's code of a NaN (0; symmetric -8). The clamps
//     are the rule's.
// Per value, unflagged: the conversion (16-bit inputs), two fused multiply-adds, one add, the
// guard compare and one shift-add. Flagged on Gaussian data: ~1 thread in 100 for fp16 input,
// ~6 in 100 for bf16 (whose few significand bits put many x / s exactly on half-integers),
// 1 in 1000 for float32. tests/int4/fast_path_check.cpp checks all of this against the rule on
// the CPU over half a billion values built to hit the ties.
constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
constexpr uint32_t kMagicBits = 0x4B400000u;
constexpr float kTieGuard = 0.5f - 0x1p-17f;
constexpr float kFastMin = 0x1p-100f;  // smallest scale of the fast path (see (5))

// The rule's code of a value v that the fast path flagged (fl(v * inv - k') not below kTieGuard,
// or NaN), without a division; y and d are the fast path's for v, m = 1.5 * 2^23 + c. See (5) in
// the comment above. Needs kFastMin <= s < inf.
template <bool kAsym>
__device__ __forceinline__ uint32_t tie_code(float v, float y, float d, float m, float s, float zero) {
  if (!(d == d)) return kAsym ? 0u : 8u;  // NaN: the rule's clamps give code 0 / -8
  const float h = __fadd_rn(__fsub_rn(y, m), copysignf(0.5f, d));  // the half-integer next to v / s
  const float z = __fmaf_rn(-h, s, v);                              // v - h s, exactly
  const float ah = fabsf(h);                                          // 0.5 .. 15.5
  const float half_ulp = ah >= 8.0f ? 0x1p-21f : ah >= 4.0f ? 0x1p-22f : ah >= 2.0f ? 0x1p-23f
                       : ah >= 1.0f ? 0x1p-24f : 0x1p-25f;            // half an ulp of h, away from 0
  const bool outward = (z > 0.0f) == (h > 0.0f);
  const float lim = __fmul_rn(ah == 0.5f && !outward ? 0x1p-26f : half_ulp, s);  // exact
  const int a = __float2int_rn(__fsub_rn(h, 0.5f));  // the integers around h: a, a + 1
  int k;
  if (fabsf(z) <= lim) k = a + (a & 1);  // fl(v / s) = h: rint(h) rounds to the even one
  else k = z > 0.0f ? a + 1 : a;         // fl(v / s) on z's side of h, within 2^-16 of it
  if constexpr (kAsym) {
    const int q = k + static_cast<int>(zero);
    return static_cast<uint32_t>(q < 0 ? 0 : q > kAsymMax ? kAsymMax : q);
  } else {
    return static_cast<uint32_t>(k < kSymMin ? kSymMin : k > kSymMax ? kSymMax : k) & 0x0Fu;
  }
}

// Layout: a team of S = 2^log_s threads per group as in unitwise, but thread `lane` holds the
// kCpt CONSECUTIVE chunks lane * kCpt .. lane * kCpt + kCpt - 1 of its group (32 values): one
// base address and immediate offsets for its loads, and one 16-byte store of its 16 code bytes
// (`vec_store`: qweight 16-byte aligned and n_chunks a multiple of kCpt, so that every thread's
// bytes start 16-byte aligned), instead of per-chunk index arithmetic and 4-byte stores. The
// warp's loads are then strided by 64 bytes, but a thread's four loads read whole sectors
// between them, back to back (L1 serves the second half of each sector).
template <bool kAsym, class T, int kMinCtas>
__global__ void __launch_bounds__(uw::kThreads, uw::min_ctas_for_arch(kMinCtas, uw::kThreads))
quantize_fused_kernel(const T* __restrict__ x, int n_chunks, int log_s, int64_t n_teams,
                      uint8_t* __restrict__ qweight, float* __restrict__ scales, uint8_t* __restrict__ zeros,
                      bool vec_store) {
  const int64_t team = int64_t(blockIdx.x) * (uw::kThreads >> log_s) + (threadIdx.x >> log_s);
  const int lane = static_cast<int>(threadIdx.x) & ((1 << log_s) - 1);
  const int c0 = lane * kCpt;  // this thread's first chunk
  const bool active = team < n_teams;
  const int64_t first = (active ? team : 0) * n_chunks + c0;  // global chunk index of chunk c0
  uw::Raw8<T> r[kCpt];
  {
    const T* p = x + first * kVec;
    if (active && c0 + kCpt <= n_chunks) {  // all loads first: kCpt 16-byte loads (2 kCpt for float32)
#pragma unroll
      for (int i = 0; i < kCpt; ++i) uw::load_raw8(p + i * kVec, r[i]);
    } else {
#pragma unroll
      for (int i = 0; i < kCpt; ++i) {
        if (active && c0 + i < n_chunks) uw::load_raw8(p + i * kVec, r[i]);
        else uw::zero_raw8(r[i]);  // +0: neutral for the extrema, never stored
      }
    }
  }
  float a, b = 0.0f;
  if constexpr (kAsym) {
    uw::range_raw(r, a, b);  // the thread's lo, hi: min_step / max_step's result from +0
  } else {
    a = uw::absmax_or_fold(r, [](float m, float v) { return absmax_step(m, v); });
  }
  {  // every thread of the CTA gets here
    __shared__ float red_a[uw::kWarps];
    if constexpr (kAsym) {
      // fminf / fmaxf: one instruction each, and min_step / max_step's results here (no NaN, no -0:
      // range_raw's extrema are +0 or of the right sign)
      __shared__ float red_b[uw::kWarps];
      a = uw::team_reduce(a, log_s, red_a, [](float u, float v) { return fminf(u, v); });
      b = uw::team_reduce(b, log_s, red_b, [](float u, float v) { return fmaxf(u, v); });
    } else {
      a = uw::team_reduce(a, log_s, red_a, MaxOp{});
    }
  }
  if (!active) return;
  AsymParams ap{0.0f, 0.0f};
  float s;
  if constexpr (kAsym) {
    ap = asym_params(a, b);
    s = ap.scale;
    if (lane == 0) {
      scales[team] = ap.scale;
      zeros[team] = static_cast<uint8_t>(ap.zero);
    }
  } else {
    s = sym_scale(a);
    if (lane == 0) scales[team] = s;
  }
  uint32_t word[kCpt];
  const bool exact = !(s >= kFastMin && s < INFINITY);  // scale 0, tiny, inf or NaN: the rule itself
  if (!exact) {
    const float inv = 1.0f / s;
    const float m = kMagic + (kAsym ? ap.zero : 8.0f);  // exact: an integer below 2^24
    bool tie = false;
#pragma unroll
    for (int i = 0; i < kCpt; ++i) {
      uint32_t w = 0;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float v = uw::raw_value(r[i], j);
        const float y = __fmaf_rn(v, inv, m);                // m + round(v * inv), the product unrounded
        const float d = __fmaf_rn(v, inv, -__fsub_rn(y, m));  // v * inv - that integer, rounded once
        tie |= !(fabsf(d) < kTieGuard);
        w += __float_as_uint(y) << (4 * j);
      }
      w -= kMagicBits * 0x11111111u;           // sum_j (c + k_j) 16^j
      word[i] = kAsym ? w : w ^ 0x88888888u;   // symmetric: (k + 8) ^ 8 = k's two's-complement nibble
    }
    if (tie) {
      // Some value near a tie (~1% of threads on fp16 data, ~6% on bf16): each chunk's word
      // again, nibble by nibble (a flagged sum may be 16 or -1 and carry into its neighbour),
      // with the flagged values' nibbles left at the code of 0; then the rule's code for each
      // flagged value of the chunk, one at a time (tie_code: no division). The reciprocal goes
      // through a shuffle (the same value, opaque to the compiler), so that the compiler does not
      // keep the main loop's 32 sums alive for this rare path (it spilled them to do so).
      const float inv2 = __shfl_sync(0xffffffffu, inv, static_cast<int>(threadIdx.x) & 31);
#pragma unroll
      for (int i = 0; i < kCpt; ++i) {
        uint32_t w = 0, flagged = 0;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float v = uw::raw_value(r[i], j);
          const float y = __fmaf_rn(v, inv2, m);  // as above
          const float d = __fmaf_rn(v, inv2, -__fsub_rn(y, m));
          const bool near = !(fabsf(d) < kTieGuard);
          flagged |= near ? 1u << j : 0u;
          w |= (near ? (kAsym ? 0u : 8u) : __float_as_uint(y) - kMagicBits) << (4 * j);  // c + k in [0, 15]
        }
        if (!kAsym) w ^= 0x88888888u;
        while (flagged) {
          const int j = __ffs(flagged) - 1;
          flagged &= flagged - 1;
          const float v = uw::raw_value_at(r[i], j);
          const float y = __fmaf_rn(v, inv2, m);
          const float d = __fmaf_rn(v, inv2, -__fsub_rn(y, m));
          w |= tie_code<kAsym>(v, y, d, m, s, ap.zero) << (4 * j);
        }
        word[i] = w;
      }
    }
  } else {  // the rule, value by value (also every code of a scale-0 group: 0); a rolled loop,
            // one division site: this path is for odd scales only and should not cost registers
#pragma unroll
    for (int i = 0; i < kCpt; ++i) word[i] = 0;
#pragma unroll 1
    for (int e = 0; e < kCpt * kVec; ++e) {
      const float v = uw::raw_value_at(r, e);
      const uint32_t bits = ((kAsym ? asym_code(v, ap) : sym_code(v, s)) & 0x0Fu) << (4 * (e % kVec));
#pragma unroll
      for (int i = 0; i < kCpt; ++i)
        if (e / kVec == i) word[i] |= bits;
    }
  }
  uint8_t* qw = qweight + first * (kVec / 2);
  if (vec_store && c0 + kCpt <= n_chunks) {
    *reinterpret_cast<uint4*>(qw) = make_uint4(word[0], word[1], word[2], word[3]);
  } else {
#pragma unroll
    for (int i = 0; i < kCpt; ++i)
      if (c0 + i < n_chunks) *reinterpret_cast<uint32_t*>(qw + i * (kVec / 2)) = word[i];
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
                  T* __restrict__ y, int64_t tiles_C) {
  static_assert(V % 2 == 0, "a chunk is whole bytes of qweight");
  const uw::Team t = uw::team_of(log_s, spu, n_teams);
  if (!t.active) return;  // no CTA-wide synchronization in this kernel
  const float s = scales[t.unit];
  int z = 0;
  if constexpr (kAsym) z = zeros[t.unit];
  const int64_t base = t.unit * n_chunks * V;
  const uint8_t* qw = qweight + base / 2;
  T* yg = y + (tiles_C > 0 ? rows_group(t.unit, tiles_C) : t.unit) * n_chunks * V;  // the group's row order
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
      uw::store_chunk<T, V>(yg + c * V, f);
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
  if (V == kVec && p.spu == 1) {
    static_assert(kCpt == 4, "a thread's 16 code bytes are one 16-byte store");
    const bool vec_store = n_chunks % kCpt == 0 && uw::aligned_to(qweight, 16);
    quantize_fused_kernel<kAsym, T, uw::fused_min_ctas<T>()><<<p.grid, uw::kThreads, 0, st>>>(
        x, static_cast<int>(n_chunks), p.log_s, p.n_teams, qweight, scales, zeros, vec_store);
    cuda::check_launch("int4 quantize kernel");
    return;
  }
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
                       int64_t n_chunks, T* y, cudaStream_t st, int64_t tiles_C) {
  const uw::Plan p = uw::make_plan(n_groups, n_chunks);
  dequantize_kernel<kAsym, T, V><<<p.grid, uw::kThreads, 0, st>>>(qweight, scales, zeros, n_chunks, p.log_s, p.spu,
                                                                   p.n_teams, y, tiles_C);
  cuda::check_launch("int4 dequantize kernel");
}

template <bool kAsym, class T>
void dequantize_dispatch(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t n_groups,
                         int64_t gs, T* y, cudaStream_t st, int64_t tiles_C) {
  if (gs % kVec == 0 && uw::aligned_to(qweight, 4) && cuda::aligned16(y))
    dequantize_launch<kAsym, T, kVec>(qweight, scales, zeros, n_groups, gs / kVec, y, st, tiles_C);
  else
    dequantize_launch<kAsym, T, 2>(qweight, scales, zeros, n_groups, gs / 2, y, st, tiles_C);
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
                     int64_t gs, T* y, void* stream, int64_t tiles_C) {
  if (n_groups <= 0 || gs <= 0) return;
  const cudaStream_t st = cuda::stream(stream);
  if (zeros) dequantize_dispatch<true>(qweight, scales, zeros, n_groups, gs, y, st, tiles_C);
  else dequantize_dispatch<false>(qweight, scales, zeros, n_groups, gs, y, st, tiles_C);
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
  template void dequantize_cuda<T>(const uint8_t*, const float*, const uint8_t*, int64_t, int64_t, T*, void*, int64_t);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::int4
