#include "formats/nf4/nf4.h"

#include <algorithm>

#include "common/parallel.h"

namespace qf::nf4 {

template <class T>
void quantize_cpu(const T* x, int64_t n, int64_t blocksize, uint8_t* packed, float* absmax) {
  const int64_t n_blocks = (n + blocksize - 1) / blocksize;
  // Grain in blocks: about 32 K values per thread at least, whatever the blocksize.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / blocksize);
  for_each_block(
      n_blocks,
      [&](int64_t b) {
        uint8_t q[kMaxBlocksize];
        const int64_t s = b * blocksize, len = std::min(blocksize, n - s);
        absmax[b] = quantize_block(x + s, len, len == blocksize, q);
        // blocksize is even, so every block starts on a byte boundary: blocks own disjoint bytes.
        uint8_t* out = packed + s / 2;
        int64_t i = 0;
        for (; i + 1 < len; i += 2) out[i / 2] = static_cast<uint8_t>(q[i] << 4 | q[i + 1]);
        if (i < len) out[i / 2] = static_cast<uint8_t>(q[i] << 4 | kPadCode);  // odd n: pad with 7
      },
      grain);
}

void dequantize_range(const uint8_t* packed, const float* absmax, int64_t i0, int64_t i1, int64_t blocksize, float* y) {
  // Walk block by block so that the scale is loaded once per block, not per element.
  int64_t i = i0;
  while (i < i1) {
    const int64_t b = i / blocksize;
    const int64_t e = std::min(i1, (b + 1) * blocksize);
    const float a = absmax[b];
    for (; i < e; ++i) {
      const uint8_t byte = packed[i >> 1];
      const uint8_t code = (i & 1) ? (byte & 0x0F) : (byte >> 4);  // even element: high nibble
      y[i - i0] = dequantize_value(code, a);
    }
  }
}

template <class T>
void dequantize_cpu(const uint8_t* packed, const float* absmax, int64_t n, int64_t blocksize, T* y) {
  const int64_t n_blocks = (n + blocksize - 1) / blocksize;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / blocksize);
  for_each_block(
      n_blocks,
      [&](int64_t b) {
        const int64_t s = b * blocksize, e = std::min(n, s + blocksize);
        const float a = absmax[b];
        for (int64_t i = s; i < e; ++i) {
          const uint8_t byte = packed[i >> 1];
          const uint8_t code = (i & 1) ? (byte & 0x0F) : (byte >> 4);  // even element: high nibble
          from_f32(dequantize_value(code, a), y + i);                  // float32, rounded once to T
        }
      },
      grain);
}

// torch's single-thread float32 mean (the order is specified in nf4.h): the 32 streams side by side
// in one pass over x, through the helpers the CUDA kernel uses too.
float mean_torch_order(const float* x, int64_t n) {
  if (n < kSumLanes) return mean_small(x, n);
  const int64_t groups = n / kSumLanes / 4;
  const int p = sum_level_power(groups);
  const int64_t step = int64_t(1) << p, n_chunks = groups / step;
  SumCascade cascade[kSumStreams];
  float acc[kSumStreams];
  for (int64_t c = 0; c < n_chunks; ++c) {
    for (float& a : acc) a = 0.0f;
    for (int64_t g = c * step; g < (c + 1) * step; ++g)
      for (int s = 0; s < kSumStreams; ++s) acc[s] = acc[s] + x[g * kSumStreams + s];
    for (int s = 0; s < kSumStreams; ++s) cascade_push(cascade[s], acc[s], (c + 1) * step, p);
  }
  for (float& a : acc) a = 0.0f;
  for (int64_t g = n_chunks * step; g < groups; ++g)
    for (int s = 0; s < kSumStreams; ++s) acc[s] = acc[s] + x[g * kSumStreams + s];
  float ps[kSumStreams];
  for (int s = 0; s < kSumStreams; ++s) ps[s] = cascade_result(cascade[s], acc[s]);
  return mean_finish(ps, x, n);
}

void double_quant_cpu(const float* absmax, int64_t n_blocks, uint8_t* q, float* absmax2, float* offset) {
  const float off = mean_torch_order(absmax, n_blocks);
  *offset = off;
  const int64_t n2 = (n_blocks + kDoubleQuantBlock - 1) / kDoubleQuantBlock;
  for_each_block(
      n2,
      [&](int64_t b) {
        float d[kDoubleQuantBlock];
        const int64_t s = b * kDoubleQuantBlock, len = std::min<int64_t>(kDoubleQuantBlock, n_blocks - s);
        for (int64_t i = 0; i < len; ++i) d[i] = absmax[s + i] - off;  // float32 subtraction
        absmax2[b] = double_quant_block(d, len, q + s);
      },
      128);
}

void dequantize_absmax_cpu(const uint8_t* q, const float* absmax2, float offset, int64_t n_blocks, float* absmax) {
  const int64_t n2 = (n_blocks + kDoubleQuantBlock - 1) / kDoubleQuantBlock;
  for_each_block(
      n2,
      [&](int64_t b) {
        const int64_t s = b * kDoubleQuantBlock, e = std::min<int64_t>(n_blocks, s + kDoubleQuantBlock);
        for (int64_t i = s; i < e; ++i) absmax[i] = dequantize_absmax_value(q[i], absmax2[b], offset);
      },
      128);
}

#define QF_INSTANTIATE(T)                                                      \
  template void quantize_cpu<T>(const T*, int64_t, int64_t, uint8_t*, float*); \
  template void dequantize_cpu<T>(const uint8_t*, const float*, int64_t, int64_t, T*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::nf4
