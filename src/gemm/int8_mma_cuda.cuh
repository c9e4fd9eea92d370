// Pipelined int8 tensor-core GEMM (sm_80+), used by int_gemm_cuda.cu above kIntGemvMaxN rows:
//   out[n, m] = epi(sum_k A[n, k] B[m, k])  for int8 A [N, K], B [M, K], row-major, K % 16 == 0,
// both 16-byte aligned. kScaled (llama.cpp's q4_0 x q8_1 arithmetic, after int_gemm_cuda.cu has
// unpacked the blocks to codes and scales; K % 32 == 0): a float32 scale per 32-value block of
// every row, each block's exact int32 sum multiplied by B's scale, then by A's, and added in
// float32. The scales are stored block-major, in the order the fragments read them (ScaledLayout
// below), so that a stage's scales are a few 16-byte copies and a lane's are one vector load.
//
// A CTA computes a 128 (n) x 128 (m) tile (kScaled: 64 x 128), K in stages of kBK = 128 bytes.
// Every thread copies its 16-byte chunks of a stage with cp.async straight into shared memory
// (no registers, no conversion; consecutive lanes take consecutive chunks of one row, so a warp
// reads whole 128-byte row segments). kStages = 3 stages are in flight: one barrier per stage,
// and the copies of stage s + kStages - 1 overlap the mma of stage s. 8 warps (2 along n x 4
// along m) each multiply a 64 (kScaled: 32) x 32 block with mma.m16n8k32 (s8 x s8 -> s32),
// fragments read by ldmatrix. Rows and K chunks past the end are zero-filled by the copy
// (src-size 0), so they add nothing.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>

#include "common/cp_async_cuda.cuh"
#include "common/cuda_utils.cuh"

namespace qf::gemm::i8mma {

// CTA tile: activation rows (n) x weight rows (m). kScaled: 64 rows of n, so that its float
// accumulators and scales fit 128 registers (two CTAs per SM; ptxas spills 28 bytes); at 128 x
// 128 it needed ~250 registers, one CTA per SM, and measured the same on the H200.
template <bool kScaled>
constexpr int kBN = kScaled ? 64 : 128;
constexpr int kBM = 128;
// K bytes per stage and stages in flight: 128-byte stages (four k32 mma steps per barrier), three
// in flight (108 KB of shared memory per CTA, kScaled 96 KB: two CTAs per SM on sm_90's 228 KB,
// one on sm_80's 164 KB): measured faster on the H200 than 64-byte stages, four in flight
// (benchmarks/README.md, "Design measurements behind kernel choices").
constexpr int kBK = 128;
constexpr int kStages = 3;
constexpr int kThreads = 256;
// Shared row stride: kBK + 16 bytes. Rows stay 16-byte aligned (cp.async, ldmatrix) and the 8
// rows of an ldmatrix matrix (144 r mod 128) fall in 8 distinct 16-byte bank groups: no
// conflicts.
constexpr int kRowBytes = kBK + 16;
constexpr int kBlocksPerStage = kBK / 32;  // kScaled: scale blocks per row per stage

template <bool kScaled>
constexpr int smem_bytes() {
  constexpr int rows = kBN<kScaled> + kBM;
  // kScaled: per stage and block, A's BN floats and B's kBM float pairs
  return kStages * rows * kRowBytes + (kScaled ? kStages * kBlocksPerStage * (kBN<kScaled> * 4 + kBM * 8) : 0);
}

// kScaled's scale arrays, as the caller writes them (kb = K / 32 blocks per row):
//   sa float  [kb][a_rows(N)]: A's scale of row n, block b at sa[b * a_rows + a_slot(n)]. Rows
//             are permuted within each 16 (a_slot) so that rows g and g + 8, the two rows of a
//             lane's accumulators, are adjacent: one 8-byte load.
//   sb float2 [kb][b_rows(M)]: b_scale_pair(d) of B's row m, block b at sb[b * b_rows + m]:
//             the pair of columns 2t, 2t + 1 is one 16-byte load, and the product -kMagic * d
//             that the epilogue needs (kMagicBits below) is made once, not by every warp.
// Both are padded to whole CTA tiles with zeros, so a stage's copies need no row test.
struct ScaledLayout {
  __host__ __device__ static constexpr int64_t a_rows(int64_t N) { return (N + kBN<true> - 1) / kBN<true> * kBN<true>; }
  __host__ __device__ static constexpr int64_t b_rows(int64_t M) { return (M + kBM - 1) / kBM * kBM; }
  __host__ __device__ static constexpr int64_t a_slot(int64_t n) {
    return (n & ~int64_t(15)) | (n & 7) << 1 | (n >> 3 & 1);
  }
  static constexpr int64_t bytes(int64_t N, int64_t M, int64_t K) {
    return (K / 32) * (a_rows(N) * int64_t(sizeof(float)) + b_rows(M) * 2 * int64_t(sizeof(float)));
  }
};

// An int32 sum c with |c| < 2^22 added to the bits of the float 1.5 * 2^23 gives the bits of the
// float 1.5 * 2^23 + c, exactly. Starting each block's mma at kMagicBits (its C operand) converts
// the block sum to float for free, instead of an I2F, which sm_80/90 issue at a quarter of the
// FMA rate; then d * c = fma(f, d, -kMagic * d), rounded once (kMagic * d is exact for d from
// fp16: 11 significant bits). The caller bounds |c| (q4_0 x q8_1: 32 * 8 * 127).
constexpr int32_t kMagicBits = 0x4B400000;
constexpr float kMagic = 12582912.0f;

// An element of ScaledLayout's sb: B's block scale d and the -kMagic * d of the epilogue's FMA.
__device__ __forceinline__ float2 b_scale_pair(float d) { return make_float2(d, -kMagic * d); }

#if __CUDA_ARCH__ >= 800
#define QF_SM80_ASM(...) asm volatile(__VA_ARGS__)
#else
#define QF_SM80_ASM(...) \
  do {                   \
  } while (0)
#endif

// d = a * b + c (m16n8k32, s8 x s8 -> s32); d and c may be the same registers.
__device__ __forceinline__ void mma_s8(int32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                       const int32_t (&c)[4]) {
  QF_SM80_ASM(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n" : "=r"(d[0]),
      "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]),
      "r"(c[1]), "r"(c[2]), "r"(c[3]));
}

// One n tile's step of the block-scaled epilogue (q4_0 x q8_1), for the warp's four m8
// fragments j: each block's mma starts at kMagicBits, so its int32 sum arrives as the float
// kMagic + sum; one FMA with dw and ndw = -kMagic * dw (d_w of columns 2t, 2t+1) gives d_w * sum,
// a second one adds d_w * sum * d_a (da: rows g, g + 8) to facc.
__device__ __forceinline__ void scaled_block_mma(float (&facc)[4][4], const uint32_t (&af)[4],
                                                 const uint32_t (&bf)[4][2], const float (&dw)[4][2],
                                                 const float (&ndw)[4][2], const float (&da)[2]) {
  const int32_t c_magic[4] = {kMagicBits, kMagicBits, kMagicBits, kMagicBits};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    int32_t c[4];
    mma_s8(c, af, bf[j][0], bf[j][1], c_magic);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float dc = fmaf(__int_as_float(c[e]), dw[j][e & 1], ndw[j][e & 1]);
      facc[j][e] = fmaf(dc, da[e >> 1], facc[j][e]);
    }
  }
}

// Four 8 x 16-byte matrices from shared memory: lanes 8i .. 8i+7 give the row addresses of matrix
// i; each lane receives word (lane % 4) of row (lane / 4) of each, which for int8 is the
// mma.m16n8k32 fragment layout.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  QF_SM80_ASM("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]),
              "=r"(r[3]) : "r"(a));
}

// The warp's B fragments of one k32 step for its four n8 tiles (two ldmatrix.x4): `row` points at
// this lane's ldmatrix row of tile 0 (see b_row below), `stride` is the shared row stride.
__device__ __forceinline__ void ldmatrix_b4(uint32_t (&bf)[4][2], const uint8_t* row, int stride) {
#pragma unroll
  for (int j = 0; j < 4; j += 2) {
    uint32_t b4[4];
    ldmatrix_x4(b4, row + 8 * j * stride);
    bf[j][0] = b4[0];
    bf[j][1] = b4[1];
    bf[j + 1][0] = b4[2];
    bf[j + 1][1] = b4[3];
  }
}

// The accumulators of a warp's TI x 4 grid of m16n8 fragments (zero-initialized where declared)
// to the epilogue (n_base, m_base: the warp block's first row and column; fragment element e is
// row g (+8 for e >= 2), column 2t + (e & 1)).
template <int TI, class Epi>
__device__ __forceinline__ void store_acc(const Epi& epi, const int32_t (&iacc)[TI][4][4],
                                          const float (&facc)[TI][4][4], int64_t n_base, int64_t m_base, int g, int t,
                                          int64_t N, int64_t M) {
#pragma unroll
  for (int i = 0; i < TI; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t n = n_base + 16 * i + g + (e >= 2 ? 8 : 0), m = m_base + 8 * j + 2 * t + (e & 1);
        if (n < N && m < M) epi(n, m, iacc[i][j][e], facc[i][j][e]);
      }
}

using cuda::cp_async;
using cuda::cp_async_commit;
using cuda::cp_async_wait;

template <class Epi, bool kScaled>
__global__ void
__launch_bounds__(kThreads, 2
)  // two CTAs per SM
kernel(const int8_t* __restrict__ A, const int8_t* __restrict__ B, const float* __restrict__ sa,
       const float* __restrict__ sb, const Epi epi, int64_t N, int64_t M, int64_t K) {
  constexpr int BN = kBN<kScaled>, TI = BN / 32;  // TI: n tiles of 16 per warp
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* a_s = smem;                              // [kStages][BN][kRowBytes]
  uint8_t* b_s = smem + kStages * BN * kRowBytes;  // [kStages][kBM][kRowBytes]
  float* s_s = reinterpret_cast<float*>(b_s + kStages * kBM * kRowBytes);  // [kStages][kScaleSlot]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int wn = (warp >> 2) * (BN / 2), wm = (warp & 3) * 32;  // this warp's block in the tile
  const int64_t n0 = int64_t(blockIdx.y) * BN, m0 = int64_t(blockIdx.x) * kBM;
  const int64_t ktiles = (K + kBK - 1) / kBK, kb = K / 32;

  // This thread's 16-byte chunks of a stage: chunk lc of tile rows lr + kRowStep i (A: i < kLoadsA,
  // B: i < kLoadsB). Their row validity is fixed and their addresses advance by kBK per stage, so a
  // stage's copies cost an address add and a K test each (Nsight Compute on the earlier per-chunk
  // index arithmetic: ~6 instructions per mma, the kernel issue-bound at 16 warps per SM).
  constexpr int kChunks = kBK / 16, kRowStep = kThreads / kChunks;
  constexpr int kLoadsA = BN / kRowStep, kLoadsB = kBM / kRowStep;
  const int lr = tid / kChunks, lc = tid % kChunks;
  const int8_t* a_src = A + (n0 + lr) * K + 16 * lc;  // (formed for rows past N too; read only when valid)
  const int8_t* b_src = B + (m0 + lr) * K + 16 * lc;
  uint32_t a_ok = 0, b_ok = 0;  // bit i: row lr + kRowStep i exists
#pragma unroll
  for (int i = 0; i < kLoadsA; ++i) a_ok |= uint32_t(n0 + lr + kRowStep * i < N) << i;
#pragma unroll
  for (int i = 0; i < kLoadsB; ++i) b_ok |= uint32_t(m0 + lr + kRowStep * i < M) << i;
  // kScaled: a stage's scales are copied two blocks at a time (kScalePasses passes): threads
  // [0, kScaleChunksB) copy B's scale pairs (chunk c: block c / (kBM / 2) of the two, rows
  // 2 (c % (kBM / 2)) and the next), the next kScaleChunksA threads A's scales (4 rows per
  // chunk); the sources advance by kBlocksPerStage blocks per stage.
  constexpr int kScalePasses = kScaled ? kBlocksPerStage / 2 : 0;
  constexpr int kScaleChunksB = kBM, kScaleChunksA = BN / 2;  // per pass
  static_assert(!kScaled || (kBlocksPerStage % 2 == 0 && kScaleChunksA + kScaleChunksB <= kThreads),
                "one scale chunk per thread and pass");
  const bool s_is_b = tid < kScaleChunksB, s_copies = tid < kScaleChunksB + kScaleChunksA;
  const int s_id = s_is_b ? tid : tid - kScaleChunksB;
  const int s_blk = s_is_b ? s_id / (kBM / 2) : s_id / (BN / 4);  // block within the pass
  const int64_t a_ld = ScaledLayout::a_rows(N), b_ld = ScaledLayout::b_rows(M);
  // This thread's first source; a copy past the last block names it and reads 0 bytes, so it must
  // lie inside the buffer: with a single block (K = 32), block 1's address would not.
  const int64_t s_b0 = kb > 1 ? s_blk : 0;
  const float* s_src = !kScaled ? nullptr
                       : s_is_b ? sb + 2 * (s_b0 * b_ld + m0 + 2 * (s_id % (kBM / 2)))
                                : sa + s_b0 * a_ld + n0 + 4 * (s_id % (BN / 4));
  const int64_t s_pass = 2 * (s_is_b ? 2 * b_ld : a_ld);  // floats per pass (two blocks)
  // destination within a slot: B's pairs [kBlocksPerStage][kBM][2] after A's [kBlocksPerStage][BN]
  const int s_dst = s_is_b ? kBlocksPerStage * BN + 2 * (s_blk * kBM + 2 * (s_id % (kBM / 2)))
                           : s_blk * BN + 4 * (s_id % (BN / 4));
  const int s_dst_pass = 2 * (s_is_b ? 2 * kBM : BN);
  constexpr int kScaleSlot = kBlocksPerStage * (BN + 2 * kBM);  // floats of one stage's scales
  auto load = [&](int64_t kt, int slot) {
    const int64_t k0 = kt * kBK;
    const bool kok = k0 + 16 * lc < K;
#pragma unroll
    for (int i = 0; i < kLoadsA; ++i) {
      const bool ok = kok && ((a_ok >> i) & 1u);
      cp_async<16>(a_s + (slot * BN + lr + kRowStep * i) * kRowBytes + 16 * lc,
                   ok ? a_src + int64_t(kRowStep * i) * K + k0 : A, ok);
    }
#pragma unroll
    for (int i = 0; i < kLoadsB; ++i) {
      const bool ok = kok && ((b_ok >> i) & 1u);
      cp_async<16>(b_s + (slot * kBM + lr + kRowStep * i) * kRowBytes + 16 * lc,
                   ok ? b_src + int64_t(kRowStep * i) * K + k0 : B, ok);
    }
    if (kScaled && s_copies) {
#pragma unroll
      for (int p = 0; p < kScalePasses; ++p) {
        const bool ok = kBlocksPerStage * kt + 2 * p + s_blk < kb;  // (a partial last stage)
        cp_async<16>(s_s + slot * kScaleSlot + s_dst + p * s_dst_pass,
                     ok ? s_src + (kScalePasses * kt + p) * s_pass : s_src, ok);
      }
    }
  };

  int32_t iacc[TI][4][4] = {};  // [n tile of 16][m tile of 8][fragment]
  float facc[TI][4][4] = {};
  // ldmatrix rows of this lane. A (m16 x k32 per n tile i): matrices (rows 0-7, k 0-15), (rows
  // 8-15, k 0-15), (rows 0-7, k 16-31), (rows 8-15, k 16-31) = fragment registers a0..a3. B (two
  // n8 tiles per load): (tile j, k 0-15), (tile j, k 16-31), then tile j+1 = b0, b1 of each.
  const int a_row = wn + (lane & 15), a_off = (lane >> 4) * 16;
  const int b_row = wm + (lane & 7) + ((lane >> 4) << 3), b_off = ((lane >> 3) & 1) * 16;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load(s, s);
    cp_async_commit();  // empty groups keep the count that cp_async_wait relies on
  }
  int slot = 0, wslot = kStages - 1;  // stages read and written this iteration: kt, kt - 1 (mod kStages)
  for (int64_t kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kStages - 2>();  // this thread's copies of stage kt have landed
    __syncthreads();               // everyone's have, and everyone is done with stage kt - 1
    if (kt + kStages - 1 < ktiles) load(kt + kStages - 1, wslot);
    cp_async_commit();
    const uint8_t* as = a_s + slot * BN * kRowBytes;
    const uint8_t* bs = b_s + slot * kBM * kRowBytes;
#pragma unroll
    for (int q = 0; q < kBK / 32; ++q) {
      uint32_t bf[4][2];
      ldmatrix_b4(bf, bs + b_row * kRowBytes + 32 * q + b_off, kRowBytes);
      if (kScaled) {
        // C fragment (n row g, m cols 2t, 2t+1), (n row g + 8, same cols): their block scales
        const float* sas = s_s + slot * kScaleSlot + q * BN;
        const float4* sbs =
            reinterpret_cast<const float4*>(s_s + slot * kScaleSlot + kBlocksPerStage * BN) + q * kBM / 2;
        float dw[4][2], ndw[4][2];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float4 p = sbs[(wm + 8 * j) / 2 + t];  // (d, -kMagic d) of columns 2t, 2t + 1
          dw[j][0] = p.x;
          ndw[j][0] = p.y;
          dw[j][1] = p.z;
          ndw[j][1] = p.w;
        }
#pragma unroll
        for (int i = 0; i < TI; ++i) {
          uint32_t af[4];
          ldmatrix_x4(af, as + (a_row + 16 * i) * kRowBytes + 32 * q + a_off);
          const float2 d2 = *reinterpret_cast<const float2*>(sas + wn + 16 * i + 2 * g);  // rows g, g + 8
          const float da[2] = {d2.x, d2.y};
          scaled_block_mma(facc[i], af, bf, dw, ndw, da);
        }
      } else {
        uint32_t af[TI][4];
#pragma unroll
        for (int i = 0; i < TI; ++i) ldmatrix_x4(af[i], as + (a_row + 16 * i) * kRowBytes + 32 * q + a_off);
#pragma unroll
        for (int i = 0; i < TI; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) mma_s8(iacc[i][j], af[i], bf[j][0], bf[j][1], iacc[i][j]);
      }
    }
    wslot = slot;  // (no % kStages: a division by 3)
    slot = slot + 1 == kStages ? 0 : slot + 1;
  }
  cp_async_wait<0>();  // no copy outlives the CTA (the trailing groups are empty, but be exact)
  store_acc(epi, iacc, facc, n0 + wn, m0 + wm, g, t, N, M);
}

#undef QF_SM80_ASM

// Host launcher: the caller has checked has_sm80_mma(), N, M > 0, K % 16 == 0 (kScaled: K % 32
// == 0, sa and sb as ScaledLayout says) and 16-byte aligned A and B (kScaled: sa and sb too).
template <bool kScaled, class Epi>
void launch(const int8_t* A, const int8_t* B, const float* sa, const float* sb, const Epi& epi, int64_t N, int64_t M,
            int64_t K, cudaStream_t stream) {
  constexpr int smem = smem_bytes<kScaled>();
  const dim3 grid(cuda::grid_for(M, kBM), cuda::grid_for(N, kBN<kScaled>));
  if (grid.y > 65535) throw std::invalid_argument("integer GEMM: too many activation rows for one launch");
  cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel<Epi, kScaled>));  // (smem is over 48 KB)
  kernel<Epi, kScaled><<<grid, kThreads, smem, stream>>>(A, B, sa, sb, epi, N, M, K);
  cuda::check_launch("integer GEMM (pipelined tensor cores)");
}

}  // namespace qf::gemm::i8mma
