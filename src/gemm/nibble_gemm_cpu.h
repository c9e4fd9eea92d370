// The fused small-N weight-only product shared by the 4-bit "nibble" formats (nf4, int4, q4_0:
// 32-aligned runs of a row are one 16-byte code run with one scale): for N <= 4 activation rows,
// each panel of weights is decoded in registers and multiplied right away (CpuKernels::
// nibble_gemm, gemm/cpu_kernels.h), with no float tile. Called first by those formats' CPU GEMMs
// (formats/<fmt>/<fmt>_gemm_cpu.cpp), which fall back to their tiled decoders when it declines.
//
// It stays here rather than in the formats' folders because its vector kernels are one family:
// int4 (both kinds) and q4_0 share one integer-code micro-kernel (per group: sum q x, then
// s (d - z sum x)), and all four share the row blocking, the x reordering and the dispatch on N.
#pragma once
#include <cstdint>

#include "gemm/cpu_kernels.h"

namespace qf::gemm {

// The fused path when the instruction set has it and the weight qualifies (1 <= N <= 4, M > 0,
// K % 32 == 0; the caller checked the rest, e.g. int4's group size % 32); false otherwise (the
// caller runs its tiled path). Y float32 [N, M].
bool nibble_gemm_cpu(const NibbleWeights& w, const float* X, int64_t N, int64_t M, float* Y);

}  // namespace qf::gemm
