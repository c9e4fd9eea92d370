// mixed2bit's weight-only GEMM on the CPU (mixed2bit_gemm_cpu.cpp): Y [N, M] = X [N, K] . W^T, X
// float32, W decoded a kPanelRows x kTileK tile at a time by the instruction set's decoder into
// exactly the values of mixed2bit's dequantize (outliers patched in) and multiplied in float32
// (gemm/weight_only_cpu.h); for N <= 4 the instruction set's fused kernel multiplies each weight
// row while it is decoded in registers. Threaded; results independent of the thread count.
// Format: arXiv 2311.16442.
#pragma once
#include <cstdint>
#include <vector>

#include "formats/mixed2bit/mixed2bit.h"
#include "formats/mixed2bit/mixed2bit_tiled.h"
#include "gemm/cpu_isa.h"

namespace qf::gemm {

// What the CPU product reads besides the buffers, made once per weight (a bound
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

// One group of a mixed2bit weight row, as the decoder needs it: its packed codes (16 2-bit
// codes per word, or 8 4-bit codes per word), 2 or 4 bits, and the effective scale and offset
// (value = fl(q * s) - m).
struct M2Group {
  const uint32_t* words;
  float s;
  float m;
  int32_t is4;
};

// A window of one row of a mixed2bit weight: n groups of gs values from flat group g0 on, whose
// slots in the 4-bit and 2-bit lists start at j4 and j2 (B groups per second-order block).
struct M2Window {
  const mixed2bit::ConstBuffers* q;
  int64_t gs, B, g0, n, j4, j2;
  int64_t n4, n2;  // the lists' lengths (reads stay inside them)
};

// The activations of the fused mixed2bit product: X [N, ldx] and, for group_size 16 (else
// nullptr), xt: per activation row (stride ldt) and step of 8 groups from the row's start, the
// 128 values as [value i][group t] (8 floats per i; zero past the row's end), and sx: per row
// (stride lds) each group's float32 sum of its 16 values, in order (zero padded likewise).
struct M2Act {
  const float* X;
  int64_t ldx;
  const float* xt;
  const float* sx;
  int64_t ldt, lds;
};

// X [N, K] (K a multiple of 16) arranged as M2Act's xt and sx for group_size 16, in the two
// vectors (resized here); the returned M2Act points into them.
M2Act m2_act_gs16(const float* X, int64_t N, int64_t K, std::vector<float>& xt, std::vector<float>& sx);

// mixed2bit's leaf kernels, one table per instruction set (plain C++ in mixed2bit_gemm_cpu.cpp,
// the others in mixed2bit_gemm_cpu_avx2.cpp and mixed2bit_gemm_cpu_avx512.cpp).
struct Mixed2bitCpuKernels {
  // mixed2bit: n groups of gs values (gs a multiple of 16), without the outliers.
  void (*decode)(const M2Group* groups, int64_t n, int64_t gs, float* out);
  // The same straight from the buffers, 16 groups' parameters at a time in vector registers
  // (nullptr where the instruction set has none: the driver builds M2Group lists). Needs every
  // slot * words-per-group to fit int32.
  void (*decode_window)(const M2Window& w, float* out);

  // Fused mixed2bit product of one weight row for few activation rows (N <= 4): y[j * ldy] =
  // sum_k W[row, k] X[j, k] over the window's groups (k from the window's start), W without its
  // outliers. Without a.xt each value is decoded exactly as dequantize and multiplied in; with it
  // (group_size 16), 2-bit groups are summed as s * sum q x - m * sum x (within float32 rounding
  // of that). nullptr in tables without it (the tile path runs).
  void (*gemm_row)(const M2Window& w, const M2Act& a, int64_t N, float* y, int64_t ldy);

  // The tiled layout's fused product of weight row `row` (group_size 16, a map checked against
  // its counts) with N <= 4 activation rows given as a.xt / a.sx: y[j * ldy] = sum over the
  // row's groups of s * sum_i q_i x_i - m * sum_i x_i (a 4-bit group's sum_i q_i x_i as 4 times
  // its high bits' sum plus its low bits' sum; within float32 rounding of the decoded product).
  // nullptr in tables without it (the decoding path runs).
  void (*tiled_gemm_row)(const mixed2bit::tiled::ConstBuffers& q, const mixed2bit::tiled::Dims& d, int64_t row,
                         const M2Act& a, int64_t N, float* y, int64_t ldy);
};
const Mixed2bitCpuKernels& mixed2bit_cpu_kernels();  // the table of active_isa()
namespace k_scalar {
const Mixed2bitCpuKernels& mixed2bit_kernels();
}
#if QF_GEMM_X86
namespace k_avx2 {
const Mixed2bitCpuKernels& mixed2bit_kernels();
}
namespace k_avx512 {
const Mixed2bitCpuKernels& mixed2bit_kernels();
}
#endif

}  // namespace qf::gemm
