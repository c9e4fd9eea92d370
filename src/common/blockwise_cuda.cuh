// CUDA driver shared by the fixed-size-block formats (q4_0, q8_1, ...): one thread per block,
// so every block is computed by exactly the per-block rule the CPU uses (the same
// QF_HOST_DEVICE functions from the format's header), hence the same bytes.
//
// Memory: each thread reads its block's QK inputs with 16-byte loads (a warp's loads are
// strided by one block, but consecutive loads of a thread hit the same L1 lines, so DRAM
// sees each byte once); the odd-sized records (18 or 36 bytes) go through shared memory so
// the CTA writes its contiguous slice of the output with full 16-byte stores; the
// dequantizer stages both its records and its decoded values the same way.
#pragma once
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/fp16.h"

namespace qf::cuda {

constexpr int kBlocksPerCta = 256;

// Codec: struct with `Block`, `QK`, `template <class T> static __device__ void
// quantize_block(const T* x, Block* y)` and `static __device__ void dequantize_block(const
// Block* b, float* y)`.
template <class Codec, class T>
__global__ void
__launch_bounds__(kBlocksPerCta)
blockwise_quantize_kernel(const T* __restrict__ x, int64_t n_blocks, uint8_t* __restrict__ y, bool vec) {
  using Block = typename Codec::Block;
  __shared__ __align__(16) uint8_t stage[kBlocksPerCta * sizeof(Block)];
  const int64_t first = int64_t(blockIdx.x) * kBlocksPerCta;
  const int64_t b = first + threadIdx.x;
  if (b < n_blocks) {
    T v[Codec::QK];
    load_run(x + b * Codec::QK, v, vec);
    Codec::quantize_block(v, reinterpret_cast<Block*>(stage) + threadIdx.x);
  }
  __syncthreads();
  const int64_t nb = n_blocks - first < kBlocksPerCta ? n_blocks - first : kBlocksPerCta;
  cta_copy(y + first * int64_t(sizeof(Block)), stage, nb * int64_t(sizeof(Block)));
}

template <class Codec, class T>
__global__ void __launch_bounds__(kBlocksPerCta)
blockwise_dequantize_kernel(const uint8_t* __restrict__ x, int64_t n_blocks, T* __restrict__ y) {
  using Block = typename Codec::Block;
  __shared__ __align__(16) uint8_t stage[kBlocksPerCta * sizeof(Block)];
  // Decoded values are staged too: a thread's QK outputs are contiguous, so direct stores
  // would be strided by QK * sizeof(T) across the warp; through shared memory the CTA writes
  // its contiguous slice with whole 16-byte stores (measured much faster: benchmarks/README.md,
  // "Design measurements behind kernel choices").
  __shared__ __align__(16) T out_stage[kBlocksPerCta * Codec::QK];
  const int64_t first = int64_t(blockIdx.x) * kBlocksPerCta;
  const int64_t nb = n_blocks - first < kBlocksPerCta ? n_blocks - first : kBlocksPerCta;
  cta_copy(stage, x + first * int64_t(sizeof(Block)), nb * int64_t(sizeof(Block)));
  __syncthreads();
  if (threadIdx.x < nb) {
    float f[Codec::QK];
    Codec::dequantize_block(reinterpret_cast<const Block*>(stage) + threadIdx.x, f);
    T o[Codec::QK];
#pragma unroll
    for (int j = 0; j < Codec::QK; ++j) from_f32(f[j], &o[j]);
    store_run(out_stage + threadIdx.x * Codec::QK, o, true);
  }
  __syncthreads();
  cta_copy(reinterpret_cast<uint8_t*>(y + first * Codec::QK), reinterpret_cast<const uint8_t*>(out_stage),
           nb * Codec::QK * int64_t(sizeof(T)));
}

template <class Codec, class T>
void blockwise_quantize(const T* x, int64_t n_blocks, void* y, void* s) {
  if (n_blocks <= 0) return;
  blockwise_quantize_kernel<Codec, T><<<grid_for(n_blocks, kBlocksPerCta), kBlocksPerCta, 0, stream(s)>>>(
      x, n_blocks, static_cast<uint8_t*>(y), aligned16(x));
  check_launch("quantize kernel");
}

template <class Codec, class T>
void blockwise_dequantize(const void* x, int64_t n_blocks, T* y, void* s) {
  if (n_blocks <= 0) return;
  blockwise_dequantize_kernel<Codec, T><<<grid_for(n_blocks, kBlocksPerCta), kBlocksPerCta, 0, stream(s)>>>(
      static_cast<const uint8_t*>(x), n_blocks, y);
  check_launch("dequantize kernel");
}

}  // namespace qf::cuda
