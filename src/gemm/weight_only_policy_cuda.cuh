// What a format's CUDA weight-only GEMM (src/formats/<fmt>/<fmt>_gemm_cuda.cu) builds on: the two
// drivers (gemm/weight_only_cuda.cuh, float32 FMA; gemm/weight_only_mma_cuda.cuh, tensor cores;
// from 9 rows on sm_90 gemm/weight_only_wgmma_cuda.cuh, for 9..64 gemm/weight_only_wide_cuda.cuh;
// from 33 fp16 or bf16 rows (16 for q4_0) on sm_90a gemm/weight_only_prefill_cuda.cuh for the
// formats with its hooks),
// the offset GEMV for one fp16 row (gemm/weight_only_gemv_cuda.cuh, formats with its hooks), the decode helpers that
// several formats' policies share, and launch_weight_only_any, which picks the driver. A format supplies only its
// policy struct (how a unit of one weight row is loaded and decoded: the interfaces are written above
// weight_only_kernel and weight_only_mma_kernel) and its launcher; the contract every launcher keeps is in
// gemm/weight_only_cuda.h.
//
// Units hold the loaded registers only: whatever depends on them (zero points, XORs, fp16
// scales) is computed when the unit is decoded, because an instruction that reads a register
// with a load in flight stalls the warp, and the loads of the next steps must stay in flight.
#pragma once
#include <cstdint>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "gemm/weight_only_cuda.cuh"
#include "gemm/weight_only_gemv_cuda.cuh"
#include "gemm/weight_only_mma_cuda.cuh"
#include "gemm/weight_only_prefill_cuda.cuh"
#include "gemm/weight_only_wgmma_cuda.cuh"
#include "gemm/weight_only_wide_cuda.cuh"

namespace qf::gemm::cuda_wo {

// Fmt::Shared of a policy without per-CTA tables.
struct NoShared {};

// Element 2b of a word's byte b in the LOW nibble, 2b+1 in the high one (int4, mixed2bit): v[]
// gets the codes in element order as exact floats (2^23 + c) - zf.
__device__ __forceinline__ void nibbles_lo_first(uint32_t w, float zf, float (&v)[8]) {
  const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    v[2 * b] = magic_u4(lo, b) - zf;
    v[2 * b + 1] = magic_u4(hi, b) - zf;
  }
}

// 8 2-bit fields in the low 16 bits -> 8 nibbles (field i to bits 4i..4i+3): mixed2bit's 2-bit
// codes to the layout of nibbles_lo_first.
__device__ __forceinline__ uint32_t spread2(uint32_t x) {
  x &= 0xFFFFu;
  x = (x | (x << 8)) & 0x00FF00FFu;
  x = (x | (x << 4)) & 0x0F0F0F0Fu;
  return (x | (x << 2)) & 0x33333333u;
}

// Fmt::xpair of the policies whose pairs are nibbles i and i + 4 of word j (elements 8j+i,
// 8j+i+4: int4's low-nibble-first bytes, and mixed2bit's tensor-core decode).
__device__ __forceinline__ uint32_t xpair_lo_first(const uint32_t (&x)[16], int p) {
  const int j = p / 4, i = p % 4;
  const uint32_t a = x[4 * j + i / 2], b = x[4 * j + 2 + i / 2];
  return i & 1 ? hi_hi(a, b) : lo_lo(a, b);
}

// 16-bit activations on sm_80+: for one fp16 row the offset GEMV of
// weight_only_gemv_cuda.cuh where the format has its hooks and the shape suits it; else the
// tensor-core kernel (one decode serves up to 16 rows), from N = Fmt::kMmaMinRows; from 9 rows
// (units of 32 values: not mixed2bit's 16) on compute capability 9.0 the wgmma kernel of
// weight_only_wgmma_cuda.cuh when the build has sm_90a code, else for 9..64 rows, where its
// launcher takes the shape, the wide kernel of weight_only_wide_cuda.cuh; before both, from 33
// rows (a format's kPrefillMinRows), the prefill kernel of weight_only_prefill_cuda.cuh where its
// launcher takes the format and shape. Otherwise (float32 activations, an older GPU, nf4 at N =
// 1) the float32 kernel; for nf4 at one row it measured faster on the H200 (the tensor-core
// kernel builds its pair table in every CTA; benchmarks/README.md, "Design measurements behind
// kernel choices").
template <class Fmt, class T>
void launch_weight_only_any(const Fmt& f, const T* X, int64_t N, int64_t K, int64_t M, T* Y, const T* bias,
                            GemmWorkspace ws, void* stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (N >= Fmt::kMmaMinRows && cuda::has_sm80_mma()) {
      if (launch_weight_only_gemv(f, X, N, K, M, Y, bias, stream)) return;
      if constexpr (Fmt::kUnit == 32) {  // (the wide kernel's unit)
        if (launch_weight_only_prefill(f, X, N, K, M, Y, bias, ws, stream)) return;
        if (launch_weight_only_wgmma(f, X, N, K, M, Y, bias, stream)) return;
        if (launch_weight_only_wide(f, X, N, K, M, Y, bias, stream)) return;
      }
      return launch_weight_only_mma(f, X, N, K, M, Y, bias, stream);
    }
  }
  launch_weight_only(f, X, N, K, M, Y, bias, stream);
}

}  // namespace qf::gemm::cuda_wo
