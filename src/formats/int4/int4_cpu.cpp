#include "formats/int4/int4.h"

#include <algorithm>

#include "common/parallel.h"
#include "gemm/weight_only_cpu.h"

namespace qf::int4 {

namespace {
constexpr int64_t kGrainValues = 16384;  // values (or bytes) per thread at least
int64_t group_grain(int64_t gs) { return std::max<int64_t>(1, kGrainValues / std::max<int64_t>(gs, 1)); }
}  // namespace

template <class T>
void quantize_asym_cpu(const T* x, int64_t n_groups, int64_t gs, uint8_t* qweight, float* scales, uint8_t* zeros) {
  for_each_block(
      n_groups, [&](int64_t g) { quantize_group_asym(x + g * gs, gs, qweight + g * (gs / 2), scales + g, zeros + g); },
      group_grain(gs));
}

template <class T>
void quantize_sym_cpu(const T* x, int64_t n_groups, int64_t gs, uint8_t* qweight, float* scales) {
  for_each_block(
      n_groups, [&](int64_t g) { quantize_group_sym(x + g * gs, gs, qweight + g * (gs / 2), scales + g); },
      group_grain(gs));
}

template <class T>
void dequantize_cpu(const uint8_t* qweight, const float* scales, const uint8_t* zeros, int64_t n_groups, int64_t gs,
                    T* y, int64_t tiles_C) {
  parallel_for(n_groups, group_grain(gs), [&](int64_t g0, int64_t g1) {
    if (tiles_C <= 0) return dequantize_groups(qweight, scales, zeros, gs, g0, g1, y + g0 * gs);
    for (int64_t g = g0; g < g1; ++g)
      dequantize_groups(qweight, scales, zeros, gs, g, g + 1, y + rows_group(g, tiles_C) * gs);
  });
}

void pack_cpu(const uint8_t* codes, int64_t n_bytes, uint8_t* packed) {
  parallel_for(n_bytes, kGrainValues, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) packed[j] = pack_pair(codes[2 * j], codes[2 * j + 1]);
  });
}

void unpack_cpu(const uint8_t* packed, int64_t n_bytes, bool is_signed, uint8_t* codes) {
  parallel_for(n_bytes, kGrainValues, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      // Signed codes are written as int8 bytes: the value's two's-complement bit pattern.
      codes[2 * j] = unpack_nibble(packed[j] & 0x0F, is_signed);
      codes[2 * j + 1] = unpack_nibble(packed[j] >> 4, is_signed);
    }
  });
}

void weight_only_gemm_cpu(const float* X, int64_t N, int64_t K, int64_t M, const uint8_t* qweight, const float* scales,
                          const uint8_t* zeros, int64_t gs, float* Y) {
  const int64_t groups_per_row = K / gs;
  // Rows [m0, m1) of W are the consecutive groups [m0 * K/gs, m1 * K/gs): the same decode
  // as dequantize_cpu, so the GEMM sees exactly the dequantized weights.
  gemm::weight_only_gemm_cpu(
      X, N, K, M,
      [&](int64_t m0, int64_t m1, float* tile) {
        dequantize_groups(qweight, scales, zeros, gs, m0 * groups_per_row, m1 * groups_per_row, tile);
      },
      Y);
}

#define QF_INSTANTIATE(T)                                                                     \
  template void quantize_asym_cpu<T>(const T*, int64_t, int64_t, uint8_t*, float*, uint8_t*); \
  template void quantize_sym_cpu<T>(const T*, int64_t, int64_t, uint8_t*, float*);            \
  template void dequantize_cpu<T>(const uint8_t*, const float*, const uint8_t*, int64_t, int64_t, T*, int64_t);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::int4
