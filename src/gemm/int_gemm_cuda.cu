// Integer-dot-product GEMMs on the GPU: int8 x int8 -> int32 (and its fused epilogue), int4 x
// int4 -> int32, and llama.cpp's q4_0 x q8_1 (declared in gemm/int8_int8.h, int4_int4.h,
// q4_0_q8_1.h). All of them reduce to products of int8 codes:
// * tensor-core tile kernel (N > kIntGemvMaxN, sm_80+): mma_tile_kernel below, 128 x 128 tiles,
//   the same row fetches, mma.m16n8k32 s8 instead of dp4a.
// * tile kernel (older GPUs): a CTA computes a 64 x 64 tile of the output, K in steps of 32 values.
//   Each step, 64 threads fetch one row of A each and 64 threads one row of B (a "row fetch" of
//   the operand's policy turns 32 values of its format into 8 words of 4 signed bytes: int8
//   as is, int4 nibbles sign-extended, q4_0 nibbles minus 8, q8_1 codes), store them to shared
//   memory, and every thread accumulates a 4 x 4 block of outputs with 8 dp4a per output. The
//   next step's fetch is issued before this step's dot products (register double buffer).
//   For the block formats a step is one block: its exact int32 sum is scaled by d_w * d_a and
//   added in float32 (the CPU's order within a block: (d_w * d_a) * sumi).
// * GEMV kernel (N <= kIntGemvMaxN, every pair): one warp per 4 weight rows, one lane per 32-value
//   step, as llama.cpp's mmvq: the weight is streamed once per 8 activation rows.
// Integer results are exact (the adapters bound K), so they equal the CPU's bit for bit; the
// fused int8 epilogue uses the CPU's float32 formula, so it does too.
#include <cuda_runtime.h>

#include <stdexcept>

#include "common/cuda_utils.cuh"
#include "common/fp16.h"
#include "gemm/block_loads_cuda.cuh"
#include "gemm/int4_int4.h"
#include "gemm/int8_int8.h"
#include "gemm/int8_mma_cuda.cuh"
#include "gemm/q4_0_q8_1.h"

namespace qf::gemm {
namespace {

constexpr int kTile = 64;      // output tile rows (A) and columns (B)
constexpr int kLdw = 9;        // words per shared row: 8 + 1 of padding (rows hit distinct banks)
constexpr int kThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each

// --- row fetches: 32 values of row `row`, step s (values 32 s .. 32 s + 31) -> 8 words ----------
// Rows past the end (the ragged edge of a tile or GEMV warp) fetch zeros with scale 0, so they
// add nothing and their outputs are never written.

// Zero codes and scale for a row past the end; returns true so a fetch can `if (...) return`.
__device__ __forceinline__ bool past_end(int64_t row, int64_t rows, uint32_t (&w)[8], float& d) {
  if (row < rows) return false;
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = 0;
  d = 0.0f;
  return true;
}

struct Int8Rows {  // int8 [rows, K]
  const int8_t* p;
  bool vec;  // K % 16 == 0 and p 16-byte aligned: two 16-byte loads per full step
  __device__ void fetch(int64_t row, int64_t s, int64_t rows, int64_t K, uint32_t (&w)[8], float& d) const {
    if (past_end(row, rows, w, d)) return;
    d = 0.0f;
    const int64_t k0 = 32 * s;
    const int8_t* r = p + row * K + k0;
    if (vec && k0 + 32 <= K) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(r)), b = __ldg(reinterpret_cast<const uint4*>(r) + 1);
      w[0] = a.x;
      w[1] = a.y;
      w[2] = a.z;
      w[3] = a.w;
      w[4] = b.x;
      w[5] = b.y;
      w[6] = b.z;
      w[7] = b.w;
      return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // the ragged end of a row (or an unaligned row): bytes, zero-filled
      uint32_t v = 0;
#pragma unroll
      for (int t = 0; t < 4; ++t)
        if (k0 + 4 * i + t < K) v |= uint32_t(uint8_t(__ldg(r + 4 * i + t))) << (8 * t);
      w[i] = v;
    }
  }
};

// Low nibbles n of v's 4 bytes -> 4 signed bytes, without __vsub4 (which sm_80/90 emulate in
// several instructions): n + 0x78 stays below 0x100, so the add carries into no neighbour, and
// 0x78 + n is 0x78 | n for n < 8 and 0x80 | (n - 8) for n >= 8. XOR kMinus8 then gives n - 8
// (q4_0's offset codes), XOR kTwos gives n read as a two's-complement nibble (int4).
constexpr uint32_t kMinus8 = 0x80808080u, kTwos = 0x78787878u;
template <uint32_t kXor>
__device__ __forceinline__ uint32_t nibbles_to_s8(uint32_t v) {
  return ((v & 0x0F0F0F0Fu) + 0x78787878u) ^ kXor;
}

// Two's-complement nibbles (element 2j low, 2j+1 high) -> signed bytes: the low nibbles of 4
// bytes and the high nibbles. The dot product pairs A's and B's values in the same order, so
// the interleaving does not matter.
__device__ __forceinline__ void split_s4(uint32_t v, uint32_t& lo, uint32_t& hi) {
  lo = nibbles_to_s8<kTwos>(v);
  hi = nibbles_to_s8<kTwos>(v >> 4);
}

struct Int4Rows {  // packed uint8 [rows, K / 2]
  const uint8_t* p;
  bool vec;  // K % 32 == 0 and p 16-byte aligned
  __device__ void fetch(int64_t row, int64_t s, int64_t rows, int64_t K, uint32_t (&w)[8], float& d) const {
    if (past_end(row, rows, w, d)) return;
    d = 0.0f;
    const int64_t kb = K / 2, b0 = 16 * s;  // bytes per row, first byte of the step
    const uint8_t* r = p + row * kb + b0;
    uint32_t v[4];
    if (vec && b0 + 16 <= kb) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(r));
      v[0] = a.x;
      v[1] = a.y;
      v[2] = a.z;
      v[3] = a.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t x = 0;
#pragma unroll
        for (int t = 0; t < 4; ++t)
          if (b0 + 4 * i + t < kb) x |= uint32_t(__ldg(r + 4 * i + t)) << (8 * t);
        v[i] = x;  // zero bytes are two zero codes
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) split_s4(v[i], w[2 * i], w[2 * i + 1]);
  }
};

struct Q4_0Rows {  // block_q4_0 [rows, K / 32] as halfwords (blocks are 2-byte aligned)
  const uint16_t* p;
  __device__ void fetch(int64_t row, int64_t s, int64_t rows, int64_t K, uint32_t (&w)[8], float& d) const {
    if (past_end(row, rows, w, d)) return;
    uint32_t q[4];
    d = load_q4_0_block(p + (row * (K / 32) + s) * 9, q);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // qs[j]: element j low nibble, element j + 16 high nibble
      w[i] = nibbles_to_s8<kMinus8>(q[i]);
      w[4 + i] = nibbles_to_s8<kMinus8>(q[i] >> 4);
    }
  }
};

struct Q8_1Rows {  // block_q8_1 [rows, K / 32] as words: [d | s << 16, qs[0..31]]
  const uint32_t* p;
  __device__ void fetch(int64_t row, int64_t s, int64_t rows, int64_t K, uint32_t (&w)[8], float& d) const {
    if (past_end(row, rows, w, d)) return;
    const uint32_t* b = p + (row * (K / 32) + s) * 9;
    d = fp16_bits_to_fp32(static_cast<uint16_t>(__ldg(b) & 0xFFFFu));
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = __ldg(b + 1 + i);
  }
};

// --- epilogues: called once per output element (n < N, m < M) ----------------------------------

struct Int32Out {
  int32_t* out;
  int64_t M;
  __device__ void operator()(int64_t n, int64_t m, int32_t acc, float) const { out[n * M + m] = acc; }
};

template <class T>
struct Int8Fused {  // int8_linear_cpu's formula, operation for operation
  T* out;
  int64_t M;
  const float *x_scale, *w_scale, *bias;
  bool x_per_row, w_per_row, relu;
  float scale_c;
  __device__ void operator()(int64_t n, int64_t m, int32_t acc, float) const {
    const float s = (x_scale[x_per_row ? n : 0] * w_scale[w_per_row ? m : 0]) * scale_c;
    float v = static_cast<float>(acc) * s;
    if (bias) v = v + bias[m];
    if (relu) v = v < 0.0f ? 0.0f : v;
    from_f32(v, out + n * M + m);
  }
};

template <class T>
struct FloatOut {  // out[n * ldo_n + m * ldo_m]
  T* out;
  int64_t ldo_n, ldo_m;
  __device__ void operator()(int64_t n, int64_t m, int32_t, float acc) const {
    from_f32(acc, out + n * ldo_n + m * ldo_m);
  }
};

// out[n, m] = sum_k A[n, k] B[m, k]; kScaled: per 32-step, (dB[m] * dA[n]) * int32 sum in float.
template <class PA, class PB, class Epi, bool kScaled>
__global__ void
__launch_bounds__(kThreads)
tile_kernel(const PA pa, const PB pb, const Epi epi, int64_t N, int64_t M, int64_t K) {
  __shared__ uint32_t as[kTile][kLdw], bs[kTile][kLdw];
  __shared__ float ad[kTile], bd[kTile];
  const int tid = threadIdx.x, tn = tid / 16, tm = tid % 16;
  const int64_t n0 = int64_t(blockIdx.y) * kTile, m0 = int64_t(blockIdx.x) * kTile;
  int32_t iacc[4][4];
  float facc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      iacc[i][j] = 0;
      facc[i][j] = 0.0f;
    }
  const int64_t steps = (K + 31) / 32;
  uint32_t reg[8];
  float rd = 0.0f;
  auto fetch = [&](int64_t s) {
    if (tid < kTile) pa.fetch(n0 + tid, s, N, K, reg, rd);
    else if (tid < 2 * kTile) pb.fetch(m0 + tid - kTile, s, M, K, reg, rd);
  };
  if (steps > 0) fetch(0);
  for (int64_t s = 0; s < steps; ++s) {
    if (tid < 2 * kTile) {
      uint32_t(*dst)[kLdw] = tid < kTile ? as : bs;
      const int r = tid % kTile;
#pragma unroll
      for (int i = 0; i < 8; ++i) dst[r][i] = reg[i];
      (tid < kTile ? ad : bd)[r] = rd;
    }
    __syncthreads();
    if (s + 1 < steps) fetch(s + 1);  // in flight while the dot products run
    int32_t part[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) part[i][j] = kScaled ? 0 : iacc[i][j];
#pragma unroll
    for (int kw = 0; kw < 8; ++kw) {
      int a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = static_cast<int>(as[tn + 16 * i][kw]);
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = static_cast<int>(bs[tm + 16 * j][kw]);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) part[i][j] = __dp4a(a[i], b[j], part[i][j]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (kScaled) facc[i][j] += (bd[tm + 16 * j] * ad[tn + 16 * i]) * static_cast<float>(part[i][j]);
        else iacc[i][j] = part[i][j];
      }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + tn + 16 * i, m = m0 + tm + 16 * j;
      if (n < N && m < M) epi(n, m, iacc[i][j], facc[i][j]);
    }
}

// --- tensor-core tiles (sm_80+): the same row fetches, int8 mma instead of dp4a --------------
// A CTA computes a 128 (activation rows n) x 128 (weight rows m) tile, K in stages of kMmaSteps
// 32-value steps. 256 threads fetch one row of A or B each (all steps of the stage, into
// registers) and store it to one of two shared buffers with 16-byte stores; 8 warps (2 along n x
// 4 along m) each multiply a 64 x 32 block with mma.m16n8k32 (s8 x s8 -> s32), fragments read
// by ldmatrix. Stage st+1 is fetched before stage st is multiplied and stored after it, into the
// other buffer, so each stage costs one barrier and the loads have the whole mma phase to land.
// A 32-value step is exactly one k32 mma, so for the block formats each step's int32 sum is
// scaled by d_w, then d_a, into a float32 accumulator (see i8mma::kMagicBits).
constexpr int kMmaTile = 128, kMmaSteps = 2;
// Words per shared row: 8 per step + 4. 80 bytes keeps rows 16-byte aligned (16-byte stores,
// ldmatrix rows) and puts the 8 rows of an ldmatrix matrix (80 r mod 128) in 8 distinct
// 16-byte bank groups: no bank conflicts.
constexpr int kMmaLdw = 8 * kMmaSteps + 4;

// The int8 mma, ldmatrix and the biased-float block sums (kMagicBits) are the pipelined kernel's.
using i8mma::kMagic;
using i8mma::kMagicBits;
using i8mma::ldmatrix_x4;
using i8mma::mma_s8;

template <class PA, class PB, class Epi, bool kScaled>
__global__ void __launch_bounds__(kThreads, 2)  // two CTAs per SM: one's barrier, the other's mma
mma_tile_kernel(const PA pa, const PB pb, const Epi epi, int64_t N, int64_t M, int64_t K) {
  __shared__ __align__(16) uint32_t as[2][kMmaTile][kMmaLdw];
  __shared__ __align__(16) uint32_t bs[2][kMmaTile][kMmaLdw];
  __shared__ float ad[2][kMmaSteps][kMmaTile], bd[2][kMmaSteps][kMmaTile];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int wn = (warp >> 2) * 64, wm = (warp & 3) * 32;  // this warp's block in the tile
  const int64_t n0 = int64_t(blockIdx.y) * kMmaTile, m0 = int64_t(blockIdx.x) * kMmaTile;
  int32_t iacc[4][4][4] = {};  // [n tile of 16][m tile of 8][fragment]
  float facc[4][4][4] = {};
  const int64_t steps = (K + 31) / 32, stages = (steps + kMmaSteps - 1) / kMmaSteps;
  uint32_t reg[kMmaSteps][8];
  float rd[kMmaSteps];
  const bool is_a = tid < kMmaTile;
  const int r = tid % kMmaTile;
  auto fetch = [&](int64_t st) {
#pragma unroll
    for (int q = 0; q < kMmaSteps; ++q) {
      const int64_t s = st * kMmaSteps + q;
      if (s >= steps) {  // past the end of K: zeros
#pragma unroll
        for (int i = 0; i < 8; ++i) reg[q][i] = 0;
        rd[q] = 0.0f;
      } else if (is_a) {
        pa.fetch(n0 + r, s, N, K, reg[q], rd[q]);
      } else {
        pb.fetch(m0 + r, s, M, K, reg[q], rd[q]);
      }
    }
  };
  auto store = [&](int buf) {
    uint32_t* dst = (is_a ? as : bs)[buf][r];
#pragma unroll
    for (int q = 0; q < kMmaSteps; ++q) {
      reinterpret_cast<uint4*>(dst + 8 * q)[0] = make_uint4(reg[q][0], reg[q][1], reg[q][2], reg[q][3]);
      reinterpret_cast<uint4*>(dst + 8 * q)[1] = make_uint4(reg[q][4], reg[q][5], reg[q][6], reg[q][7]);
      if (kScaled) (is_a ? ad : bd)[buf][q][r] = rd[q];
    }
  };
  // ldmatrix row addresses of this lane. A (m16 x k32 per n tile i): matrices (rows 0-7, k 0-15),
  // (rows 8-15, k 0-15), (rows 0-7, k 16-31), (rows 8-15, k 16-31) = fragment registers a0..a3.
  // B (two n8 tiles j, j+1 per load): (tile j, k 0-15), (tile j, k 16-31), then tile j+1 = b0, b1
  // of tile j, b0, b1 of tile j+1.
  const int a_row = wn + (lane & 15), a_word = (lane >> 4) * 4;
  const int b_row = wm + (lane & 7) + ((lane >> 4) << 3), b_word = ((lane >> 3) & 1) * 4;
  if (stages > 0) {
    fetch(0);
    store(0);
  }
  __syncthreads();
  for (int64_t st = 0; st < stages; ++st) {
    const int buf = static_cast<int>(st & 1);
    if (st + 1 < stages) fetch(st + 1);  // in flight while the mma run
#pragma unroll
    for (int q = 0; q < kMmaSteps; ++q) {
      uint32_t bf[4][2];
      i8mma::ldmatrix_b4(bf, reinterpret_cast<const uint8_t*>(&bs[buf][b_row][8 * q + b_word]), 4 * kMmaLdw);
      if (kScaled) {
        // C fragment: (n row g, m cols 2t, 2t+1), (n row g + 8, same cols): their scales, read
        // once per step; A fragments one n tile at a time (registers: 2 CTAs per SM)
        float dw[4][2], ndw[4][2];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            dw[j][h] = bd[buf][q][wm + 8 * j + 2 * t + h];
            ndw[j][h] = -kMagic * dw[j][h];
          }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint32_t af[4];
          ldmatrix_x4(af, &as[buf][a_row + 16 * i][8 * q + a_word]);
          const float da[2] = {ad[buf][q][wn + 16 * i + g], ad[buf][q][wn + 16 * i + g + 8]};
          i8mma::scaled_block_mma(facc[i], af, bf, dw, ndw, da);
        }
      } else {
        uint32_t af[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) ldmatrix_x4(af[i], &as[buf][a_row + 16 * i][8 * q + a_word]);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) mma_s8(iacc[i][j], af[i], bf[j][0], bf[j][1], iacc[i][j]);
      }
    }
    // The other buffer was last read in stage st - 1, before the barrier that ended it.
    if (st + 1 < stages) store(buf ^ 1);
    __syncthreads();
  }
  i8mma::store_acc(epi, iacc, facc, n0 + wn, m0 + wm, g, t, N, M);
}

template <bool kScaled, class PA, class PB, class Epi>
void launch_tile(const PA& pa, const PB& pb, const Epi& epi, int64_t N, int64_t M, int64_t K, void* stream) {
  if (N <= 0 || M <= 0) return;
  if (cuda::has_sm80_mma()) {
    const dim3 grid(cuda::grid_for(M, kMmaTile), cuda::grid_for(N, kMmaTile));
    if (grid.y > 65535) throw std::invalid_argument("integer GEMM: too many activation rows for one launch");
    mma_tile_kernel<PA, PB, Epi, kScaled><<<grid, kThreads, 0, cuda::stream(stream)>>>(pa, pb, epi, N, M, K);
    cuda::check_launch("integer GEMM (tensor cores)");
    return;
  }
  const dim3 grid(cuda::grid_for(M, kTile), cuda::grid_for(N, kTile));
  if (grid.y > 65535) throw std::invalid_argument("integer GEMM: too many activation rows for one launch");
  tile_kernel<PA, PB, Epi, kScaled><<<grid, kThreads, 0, cuda::stream(stream)>>>(pa, pb, epi, N, M, K);
  cuda::check_launch("integer GEMM");
}

// Few activation rows (N <= kIntGemvMaxN): warp = 4 weight rows, lane = one 32-value step of
// each per iteration, as llama.cpp's mmvq, so the weight is streamed once per 8 activation rows
// with every lane busy (the 64 x 64 tiles would leave most of the GPU idle at N = 1).
// out[n, m] = sum_k A[n, k] W[m, k]; kScaled: per step (dW * dA) * int32 sum in float.
constexpr int kGemvRows = 4, kGemvWarps = 4, kGemvNT = 8;

template <class PW, class PA, class Epi, bool kScaled>
__global__ void __launch_bounds__(kGemvWarps * 32)
gemv_kernel(const PW w, const PA a, const Epi epi, int64_t N, int64_t M, int64_t K) {
  const int lane = threadIdx.x & 31;
  const int64_t m0 = (int64_t(blockIdx.x) * kGemvWarps + threadIdx.x / 32) * kGemvRows;
  if (m0 >= M) return;
  const int64_t n0 = int64_t(blockIdx.y) * kGemvNT;
  const int nt = static_cast<int>(N - n0 < kGemvNT ? N - n0 : kGemvNT);
  float facc[kGemvRows][kGemvNT];
  int32_t iacc[kGemvRows][kGemvNT];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
    for (int n = 0; n < kGemvNT; ++n) {
      facc[r][n] = 0.0f;
      iacc[r][n] = 0;
    }
  const int64_t steps = (K + 31) / 32;
  for (int64_t s = lane; s < steps; s += 32) {
    uint32_t wq[kGemvRows][8];
    float dw[kGemvRows];
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) w.fetch(m0 + r, s, M, K, wq[r], dw[r]);
#pragma unroll
    for (int n = 0; n < kGemvNT; ++n) {
      if (n < nt) {
        uint32_t aq[8];
        float da;
        a.fetch(n0 + n, s, N, K, aq, da);
#pragma unroll
        for (int r = 0; r < kGemvRows; ++r) {
          int sumi = kScaled ? kMagicBits : iacc[r][n];  // kScaled: the block sum as a biased float
#pragma unroll
          for (int i = 0; i < 8; ++i) sumi = __dp4a(static_cast<int>(wq[r][i]), static_cast<int>(aq[i]), sumi);
          if (kScaled) facc[r][n] += (dw[r] * da) * (__int_as_float(sumi) - kMagic);
          else iacc[r][n] = sumi;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
    for (int n = 0; n < kGemvNT; ++n) {
      const float v = kScaled ? cuda::warp_sum(facc[r][n]) : 0.0f;
      const int32_t iv = kScaled ? 0 : cuda::warp_sum(iacc[r][n]);
      if (lane == 0 && m0 + r < M && n < nt) epi(n0 + n, m0 + r, iv, v);
    }
}

// out = A . W^T for A [N, K] (policy PA) and W [M, K] (policy PW): the GEMV kernel for few
// activation rows, tiles otherwise.
template <bool kScaled, class PA, class PW, class Epi>
void launch_int(const PA& pa, const PW& pw, const Epi& epi, int64_t N, int64_t M, int64_t K, void* stream) {
  if (N <= 0 || M <= 0) return;
  if (N <= kIntGemvMaxN) {
    const dim3 grid(cuda::grid_for(M, kGemvRows * kGemvWarps), cuda::grid_for(N, kGemvNT));
    gemv_kernel<PW, PA, Epi, kScaled><<<grid, kGemvWarps * 32, 0, cuda::stream(stream)>>>(pw, pa, epi, N, M, K);
    cuda::check_launch("integer GEMV");
    return;
  }
  launch_tile<kScaled>(pa, pw, epi, N, M, K, stream);
}

// int8 x int8 above the GEMV's rows on sm_80+: the pipelined kernel (int8_mma_cuda.cuh) when its
// copies can be 16-byte aligned chunks, the register-fetch tiles otherwise.
template <class Epi>
void launch_int8(const int8_t* A, const int8_t* B, const Epi& epi, int64_t N, int64_t M, int64_t K, void* stream) {
  const bool vec = K % 16 == 0 && cuda::aligned16(A) && cuda::aligned16(B);
  if (N > kIntGemvMaxN && M > 0 && vec && cuda::has_sm80_mma()) {
    i8mma::launch<false>(A, B, nullptr, nullptr, epi, N, M, K, cuda::stream(stream));
    return;
  }
  launch_int<false>(Int8Rows{A, vec}, Int8Rows{B, vec}, epi, N, M, K, stream);
}

// Blocks -> int8 codes [rows, K] (the row fetch's words) and their scales d in the pipelined
// kernel's ScaledLayout (kPairs: B's (d, -kMagic d) pairs; else A's floats in a_slot order),
// rows padded to rows_pad with zero scales, so that the kernel copies whole 16-byte chunks of
// both. A warp takes 4 rows x 8 blocks (lane % 4: row, lane / 4: block): its reads are 4 runs
// of 8 consecutive blocks, each lane stores its block's 32 code bytes, and the pair stores are
// 32 bytes per block (4 rows x 8 bytes), where one thread per block along a row would scatter them.
template <class P, bool kPairs>
__global__ void unpack_blocks_kernel(const P p, int64_t rows, int64_t rows_pad, int64_t K, int8_t* __restrict__ codes,
                                     float* __restrict__ d) {
  const int64_t kb = K / 32, row_groups = rows_pad / 4, blk_groups = (kb + 7) / 8;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int lane = threadIdx.x & 31;
  for (int64_t wp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; wp < row_groups * blk_groups; wp += warps) {
    const int64_t row = (wp / blk_groups) * 4 + (lane & 3), b = (wp % blk_groups) * 8 + (lane >> 2);
    if (b >= kb) continue;
    uint32_t w[8];
    float s;
    p.fetch(row, b, rows, K, w, s);  // rows past the end: zero codes (not stored) and scale 0
    if (row < rows) {
      uint4* dst = reinterpret_cast<uint4*>(codes + row * K + 32 * b);
      dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
      dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
    if (kPairs) reinterpret_cast<float2*>(d)[b * rows_pad + row] = i8mma::b_scale_pair(s);
    else d[b * rows_pad + i8mma::ScaledLayout::a_slot(row)] = s;
  }
}

template <bool kPairs, class P>
void unpack_blocks(const P& p, int64_t rows, int64_t rows_pad, int64_t K, int8_t* codes, float* d, void* stream) {
  const int64_t warps = rows_pad / 4 * ((K / 32 + 7) / 8);
  if (warps == 0) return;
  const unsigned grid = static_cast<unsigned>(warps / 8 + 1 < 8192 ? warps / 8 + 1 : 8192);
  unpack_blocks_kernel<P, kPairs><<<grid, 256, 0, cuda::stream(stream)>>>(p, rows, rows_pad, K, codes, d);
  cuda::check_launch("q4_0 x q8_1: unpacking blocks");
}

}  // namespace

void int8_matmul_cuda(const int8_t* A, const int8_t* B, int32_t* out, int64_t N, int64_t M, int64_t K, void* stream) {
  launch_int8(A, B, Int32Out{out, M}, N, M, K, stream);
}

template <class T>
void int8_linear_cuda(const int8_t* A, const float* x_scale, bool x_scale_per_row, const int8_t* B,
                      const float* w_scale, bool w_scale_per_row, const float* bias, bool relu, float scale_c,
                      T* out, int64_t N, int64_t M, int64_t K, void* stream) {
  const Int8Fused<T> epi{out, M, x_scale, w_scale, bias, x_scale_per_row, w_scale_per_row, relu, scale_c};
  launch_int8(A, B, epi, N, M, K, stream);
}

void int4_matmul_cuda(const uint8_t* A, const uint8_t* B, int32_t* out, int64_t N, int64_t M, int64_t K,
                      void* stream) {
  const bool vec = K % 32 == 0 && cuda::aligned16(A) && cuda::aligned16(B);
  launch_int<false>(Int4Rows{A, vec}, Int4Rows{B, vec}, Int32Out{out, M}, N, M, K, stream);
}

int64_t q4_0_q8_1_cuda_workspace_bytes(int64_t M, int64_t N, int64_t K) {
  if (N <= kIntGemvMaxN || M <= 0 || K <= 0) return 0;
  return (M + N) * K + i8mma::ScaledLayout::bytes(N, M, K);
}

template <class T>
void q4_0_q8_1_cuda(const q4_0::block_q4_0* W, const q8_1::block_q8_1* A, int64_t M, int64_t N, int64_t K, T* out,
                    int64_t ldo_m, int64_t ldo_n, void* workspace, void* stream) {
  if (K % 32) throw std::invalid_argument("q4_0 x q8_1: K must be a multiple of 32");
  const Q4_0Rows w{reinterpret_cast<const uint16_t*>(W)};
  const Q8_1Rows a{reinterpret_cast<const uint32_t*>(A)};
  const FloatOut<T> epi{out, ldo_n, ldo_m};
  if (workspace && N > kIntGemvMaxN && M > 0 && K > 0 && cuda::aligned16(workspace) && cuda::has_sm80_mma()) {
    // workspace: W's codes [M, K], A's codes [N, K] (K % 32 == 0: 16-byte aligned ends), then
    // the scales in i8mma::ScaledLayout: W's pairs [K/32][b_rows(M)], A's [K/32][a_rows(N)]
    using L = i8mma::ScaledLayout;
    int8_t* wc = static_cast<int8_t*>(workspace);
    int8_t* ac = wc + M * K;
    float* wd = reinterpret_cast<float*>(ac + N * K);
    float* ad = wd + 2 * (K / 32) * L::b_rows(M);
    unpack_blocks<true>(w, M, L::b_rows(M), K, wc, wd, stream);
    unpack_blocks<false>(a, N, L::a_rows(N), K, ac, ad, stream);
    i8mma::launch<true>(ac, wc, ad, wd, epi, N, M, K, cuda::stream(stream));
    return;
  }
  launch_int<true>(a, w, epi, N, M, K, stream);
}

#define QF_INSTANTIATE(T)                                                                                         \
  template void int8_linear_cuda<T>(const int8_t*, const float*, bool, const int8_t*, const float*, bool,         \
                                    const float*, bool, float, T*, int64_t, int64_t, int64_t, void*);             \
  template void q4_0_q8_1_cuda<T>(const q4_0::block_q4_0*, const q8_1::block_q8_1*, int64_t, int64_t, int64_t, T*, \
                                  int64_t, int64_t, void*, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::gemm
