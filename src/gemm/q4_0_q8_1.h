// q4_0 weights x q8_1 activations, llama.cpp's pair (ggml-cuda/vecdotq.cuh
// vec_dot_q4_0_q8_1, mmvq/mmq): out[m, n] = sum over K of W[m, k] * A[n, k], i.e. W . A^T,
// computed per 32-block with an exact integer dot product and float32 scales.
#pragma once
#include <cstdint>

#include "formats/q4_0/q4_0.h"
#include "formats/q8_1/q8_1.h"

namespace qf::gemm {

// W: [M, K/32] q4_0 blocks; A: [N, K/32] q8_1 blocks; out: float32 [M, N] row-major.
// Per block: d_w * d_a * sum_j (q_w[j] - 8) * q_a[j], summed over blocks in float32, in
// block order (so the result does not depend on threading).
void gemm_q4_0_q8_1_cpu(const q4_0::block_q4_0* W, const q8_1::block_q8_1* A, float* out,
                        int64_t M, int64_t N, int64_t K);

}  // namespace qf::gemm
