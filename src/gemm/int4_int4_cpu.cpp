#include "gemm/int4_int4.h"

#include <vector>

#include "formats/int4/int4.h"

namespace qf::gemm {

namespace {
// Signed codes of n_bytes packed bytes into 2 * n_bytes int8 values (serial).
void unpack_signed(const uint8_t* p, int64_t n_bytes, int8_t* out) {
  for (int64_t j = 0; j < n_bytes; ++j) {
    out[2 * j] = static_cast<int8_t>(int4::nibble_to_signed(p[j] & 0x0F));
    out[2 * j + 1] = static_cast<int8_t>(int4::nibble_to_signed(p[j] >> 4));
  }
}
}  // namespace

void int4_matmul_cpu(const uint8_t* A, const uint8_t* B, int32_t* out, int64_t N, int64_t M, int64_t K) {
  const int64_t kb = K / 2;  // bytes per row
  // A is unpacked once (N * K bytes, the size of an int8 copy): every B tile reuses it.
  std::vector<int8_t> a(static_cast<size_t>(N * K));
  parallel_for(N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) unpack_signed(A + n * kb, kb, a.data() + n * K);
  });
  int8_gemm_tiles_cpu(a.data(), N, K, M, [&](int64_t m0, int64_t m1, int8_t* buf) {
    unpack_signed(B + m0 * kb, (m1 - m0) * kb, buf);
    return static_cast<const int8_t*>(buf);
  }, out);
}

}  // namespace qf::gemm
