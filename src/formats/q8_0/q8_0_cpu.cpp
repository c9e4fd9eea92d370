#include "formats/q8_0/q8_0.h"

#include "common/parallel.h"

namespace qf::q8_0 {

template <class T>
void quantize_cpu(const T* x, int64_t n_blocks, block_q8_0* y) {
  for_each_block(n_blocks, [&](int64_t b) { quantize_block(x + b * QK, y + b); });
}

template <class T>
void dequantize_cpu(const block_q8_0* x, int64_t n_blocks, T* y) {
  for_each_block(n_blocks, [&](int64_t b) {
    float f[QK];
    dequantize_block(x + b, f);
    for (int j = 0; j < QK; ++j) from_f32(f[j], y + b * QK + j);
  });
}

#define QF_INSTANTIATE(T)                                        \
  template void quantize_cpu<T>(const T*, int64_t, block_q8_0*); \
  template void dequantize_cpu<T>(const block_q8_0*, int64_t, T*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::q8_0
