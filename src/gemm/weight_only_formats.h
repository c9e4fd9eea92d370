// Weight-only GEMMs of the quantized weight formats on the CPU: Y [N, M] = X [N, K] . W^T, X
// float32 (16-bit activations are converted first: to_float32), W [M, K] in the format's packed
// buffers, decoded a kPanelRows x kTileK tile at a time by the instruction set's vectorized
// decoder (gemm/cpu_kernels.h) into exactly the values of the format's dequantize, then
// multiplied in float32 (gemm/weight_only_cpu.h). Threaded; results independent of the thread
// count. Sources of the formats: nf4 = bitsandbytes NF4 (quantize_4bit, dequantize_4bit), int4 =
// GPTQ/AWQ-style groups, q4_0 = llama.cpp block_q4_0, mixed2bit = arXiv 2311.16442.
#pragma once
#include <cstdint>
#include <vector>

#include "common/fp16.h"
#include "common/parallel.h"
#include "formats/mixed2bit/mixed2bit.h"
#include "formats/q4_0/q4_0.h"

namespace qf::gemm {

// nf4: packed uint8 [ceil(M K / 2)], absmax float32 [ceil(M K / blocksize)] (decoded), blocks over
// the flattened W (so they may straddle rows), blocksize a power of two in [32, 4096].
void nf4_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const uint8_t* packed, const float* absmax,
                  int64_t blocksize, float* Y);

// int4: qweight uint8 [M, K / 2], scales float32 [M, K / gs], zeros uint8 [M, K / gs] or
// nullptr (symmetric); K % gs == 0, gs a positive multiple of 8.
void int4_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const uint8_t* qweight, const float* scales,
                   const uint8_t* zeros, int64_t gs, float* Y);

// q4_0: W as [M, K / 32] blocks, K % 32 == 0.
void q4_0_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const q4_0::block_q4_0* W, float* Y);

// int8: codes q [M, K] with one float32 scale per unit of `unit` values along a row: the scale
// of row m, unit u is scales[m * scale_stride + u] (int8's row granularity: unit = K, stride 1;
// group: unit = group_size, stride K / unit; tensor: unit = K, stride 0). unit >= 1 divides K.
// For N <= 4 and unit % 16 == 0 each unit's float32 sum of q x is scaled once (CpuKernels::
// int8_gemm); otherwise the values q * s are decoded exactly as int8's dequantize, a tile at a time.
void int8_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const int8_t* q, const float* scales,
                   int64_t unit, int64_t scale_stride, float* Y);

// mixed2bit: what the CPU product reads besides the buffers, made once per weight (a bound
// Linear keeps it): the outliers before each row ([rows + 1]) and, per row and tile of
// mixed2bit_cpu_tile(dims) values, the 4-bit groups before the tile ([rows * tiles]). Making it
// validates the buffers as mixed2bit's build_row_index does (std::invalid_argument with its
// messages): group_map must mark n4 groups, outlier_idx must be strictly increasing and < rows * K.
struct Mixed2bitCpuIndex {
  std::vector<int64_t> out_before, win4;
};
Mixed2bitCpuIndex mixed2bit_cpu_index(const mixed2bit::ConstBuffers& q, const mixed2bit::Dims& dims);
// The product with an index made for these buffers and dims.
void mixed2bit_gemm_cpu(const float* X, int64_t N, const mixed2bit::ConstBuffers& q, const mixed2bit::Dims& dims,
                        const Mixed2bitCpuIndex& index, float* Y);
// The same making the index first (one call).
void mixed2bit_gemm_cpu(const float* X, int64_t N, const mixed2bit::ConstBuffers& q, const mixed2bit::Dims& dims,
                        float* Y);
// That validation and the per-row offsets ([rows + 1] each): 4-bit groups before row r, and
// outliers before row r (mixed2bit's RowIndex, computed with a byte popcount).
void mixed2bit_row_index(const mixed2bit::ConstBuffers& q, const mixed2bit::Dims& dims, int64_t* n4_before,
                         int64_t* out_before);

// --- CUDA: each format's own formats/<fmt>/<fmt>_gemm_cuda.h (contract: gemm/weight_only_cuda.h) ---

// x [n] of float, half_t or bf16_t -> float32 (exact), threaded for large n.
template <class T>
void to_float32(const T* x, int64_t n, float* out) {
  parallel_for(n, int64_t(1) << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = to_f32(x[i]);
  });
}

}  // namespace qf::gemm
