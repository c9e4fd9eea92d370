// q8_0 CUDA codec: the shared blockwise driver (common/blockwise_cuda.cuh) around this
// format's per-block rules (q8_0.h), so GPU bytes equal CPU bytes by construction.
#include "common/blockwise_cuda.cuh"
#include "formats/q8_0/q8_0.h"

namespace qf::q8_0 {
namespace {
struct Codec {
  using Block = block_q8_0;
  static constexpr int QK = q8_0::QK;
  template <class T>
  static __device__ void quantize_block(const T* x, Block* y) {
    q8_0::quantize_block(x, y);
  }
  static __device__ void dequantize_block(const Block* b, float* y) { q8_0::dequantize_block(b, y); }
};
}  // namespace

template <class T>
void quantize_cuda(const T* x, int64_t n_blocks, block_q8_0* y, void* stream) {
  cuda::blockwise_quantize<Codec>(x, n_blocks, y, stream);
}

template <class T>
void dequantize_cuda(const block_q8_0* x, int64_t n_blocks, T* y, void* stream) {
  cuda::blockwise_dequantize<Codec>(x, n_blocks, y, stream);
}

#define QF_INSTANTIATE(T)                                                \
  template void quantize_cuda<T>(const T*, int64_t, block_q8_0*, void*); \
  template void dequantize_cuda<T>(const block_q8_0*, int64_t, T*, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::q8_0
