// What the standalone CUDA probes of benchmarks/ (mma_peak.cu, read_patterns.cu,
// gemv_bulk_probe.cu) share: an error check that exits, and a kernel that keeps the GPU busy for
// a number of cycles before a timed launch (so that the launch, not the host, is timed).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                               \
  do {                                                                      \
    cudaError_t e = (x);                                                    \
    if (e != cudaSuccess) {                                                 \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

__global__ void spin(int64_t cycles) {
  const int64_t t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
