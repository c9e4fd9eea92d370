// mixed2bit CUDA 2-bit packing: 16 codes of 2 bits per uint32 word and back (pack_2bit_cuda,
// unpack_2bit_cuda of mixed2bit.h), a thread per word or per code.
#include <cstdint>

#include "formats/mixed2bit/mixed2bit_cuda_common.cuh"

namespace qf::mixed2bit {
namespace {

__global__ void
__launch_bounds__(kThreads)
pack_2bit_kernel(const uint8_t* __restrict__ values, int64_t n_words, uint32_t* __restrict__ out) {
  const int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= n_words) return;
  uint32_t word = 0;
  for (int i = 0; i < kCodes2PerWord; ++i)
    word |= static_cast<uint32_t>(values[w * kCodes2PerWord + i] & 3u) << (2 * i);
  out[w] = word;
}

__global__ void __launch_bounds__(kThreads)
unpack_2bit_kernel(const uint32_t* __restrict__ packed, int64_t n, uint8_t* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = static_cast<uint8_t>((packed[i / kCodes2PerWord] >> (2 * (i % kCodes2PerWord))) & 3u);
}

}  // namespace

void pack_2bit_cuda(const uint8_t* values, int64_t n_words, uint32_t* out, void* stream) {
  if (n_words <= 0) return;
  pack_2bit_kernel<<<cu::grid_for(n_words, kThreads), kThreads, 0, cu::stream(stream)>>>(values, n_words, out);
  cu::check_launch("mixed2bit pack_2bit kernel");
}

void unpack_2bit_cuda(const uint32_t* packed, int64_t n, uint8_t* out, void* stream) {
  if (n <= 0) return;
  unpack_2bit_kernel<<<cu::grid_for(n, kThreads), kThreads, 0, cu::stream(stream)>>>(packed, n, out);
  cu::check_launch("mixed2bit unpack_2bit kernel");
}

}  // namespace qf::mixed2bit
