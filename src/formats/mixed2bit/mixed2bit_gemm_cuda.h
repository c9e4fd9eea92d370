// mixed2bit's weight-only GEMM on the GPU (mixed2bit_gemm_cuda.cu), under the contract of
// gemm/weight_only_cuda.h: Y [N, M] = X [N, K] . W^T, with M = dims.rows and K = dims.K (the
// weight's dimensions travel in `dims`, so the argument list names only N), W [M, K] in the
// buffers of mixed2bit.h. Needs group_size = 16 * 2^j <= 512, a power-of-two scale_block, no
// outliers and fewer than 2^32 16-value units (mixed2bit_gemm_cuda_supports), plus the chunk index
// of mixed2bit_row_index_cuda.
#pragma once
#include <cstdint>

#include "formats/mixed2bit/mixed2bit.h"
#include "gemm/weight_only_cuda.h"

namespace qf::gemm {

// The parameters the CUDA kernel takes (the Python layers ask before choosing them).
inline bool mixed2bit_gemm_cuda_supports(const mixed2bit::Dims& d) {
  const int us = d.group_size % 16 ? -1 : log2_exact(d.group_size / 16);
  return us >= 0 && us <= 5 && log2_exact(d.scale_block) >= 0 && d.n_out == 0 &&
         d.rows * (d.K / 16) < (int64_t(1) << 32);  // 16-value units (so also groups) index in 32 bits
}

// The chunk index of a mixed2bit weight on the GPU: a row's groups in chunks of 32, C =
// ceil(groups_per_row / 32) per row, and entry r * C + c (uint64) = the 4-bit groups before
// chunk c of row r in the low 32 bits (an exclusive prefix over the whole map, so the index of
// the chunk's first 4-bit group in codes4) | the chunk's 32 group_map bits in the high 32 (bit
// i = group 32 c + i; 0 past the row's end). A final entry r * C = rows * C holds the total,
// which the caller compares with dims.n4 to reject inconsistent buffers. With it, any unit finds
// its group's slot in either list with one load and a popcount.
inline int64_t mixed2bit_chunk_index_size(int64_t rows, int64_t groups_per_row) {
  return rows * (groups_per_row / 32 + (groups_per_row % 32 != 0)) + 1;
}
void mixed2bit_row_index_cuda(const uint8_t* group_map, int64_t rows, int64_t groups_per_row, uint64_t* index,
                              void* stream);

template <class T>
void mixed2bit_gemm_cuda(const T* X, int64_t N, const mixed2bit::ConstBuffers& q, const mixed2bit::Dims& dims,
                         const uint64_t* index, T* Y, const T* bias, void* stream);

}  // namespace qf::gemm
