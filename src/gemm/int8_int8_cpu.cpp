#include "gemm/int8_int8.h"

namespace qf::gemm {

void int8_matmul_cpu(const int8_t* A, const int8_t* B, int32_t* out, int64_t N, int64_t M, int64_t K) {
  // int8 rows need no decoding: hand out pointers into B itself.
  int8_gemm_tiles_cpu(A, N, K, M, [&](int64_t m0, int64_t, int8_t*) { return B + m0 * K; }, out);
}

}  // namespace qf::gemm
