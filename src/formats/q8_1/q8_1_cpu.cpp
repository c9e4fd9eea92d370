#include "formats/q8_1/q8_1.h"

#include "common/parallel.h"

namespace qf::q8_1 {

template <class T>
void quantize_cpu(const T* x, int64_t n_blocks, block_q8_1* y) {
  for_each_block(n_blocks, [&](int64_t b) { quantize_block(x + b * QK, y + b); });
}

void dequantize_cpu(const block_q8_1* x, int64_t n_blocks, float* y) {
  for_each_block(n_blocks, [&](int64_t b) { dequantize_block(x + b, y + b * QK); });
}

#define QF_INSTANTIATE(T) template void quantize_cpu<T>(const T*, int64_t, block_q8_1*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::q8_1
