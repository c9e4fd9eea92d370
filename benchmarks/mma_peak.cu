// The ceiling of the warp-level tensor-core instructions the GEMM kernels use (mma.sync, sm_80's
// interface), measured on the device at hand: every SM runs warps that issue nothing but
// independent mma.sync on register operands (no memory traffic), so the rate is the most a
// kernel built on them can reach. Compared in the issue 4 note with torch._int_mm / cuBLAS,
// which use Hopper's wgmma.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/mma_peak.cu -o /tmp/mma_peak && /tmp/mma_peak
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CK(x)                                                               \
  do {                                                                      \
    cudaError_t e = (x);                                                    \
    if (e != cudaSuccess) {                                                 \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      return 1;                                                             \
    }                                                                       \
  } while (0)

constexpr int kChains = 8;  // independent accumulators per warp: enough to cover the mma latency

// m16n8k16 f16 x f16 -> f32: 2 * 16 * 8 * 16 = 4096 flops per warp instruction
__global__ void mma_f16(int iters, float* out) {
  uint32_t a[4] = {threadIdx.x, threadIdx.x * 3u, threadIdx.x * 5u, threadIdx.x * 7u}, b0 = 0x3c003c00u, b1 = b0;
  float c[kChains][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int k = 0; k < kChains; ++k)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};\n"
                   : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  float s = 0;
#pragma unroll
  for (int k = 0; k < kChains; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  if (s == 1.2345f) out[0] = s;
}

// m16n8k32 s8 x s8 -> s32: 2 * 16 * 8 * 32 = 8192 ops per warp instruction
__global__ void mma_s8(int iters, int* out) {
  uint32_t a[4] = {threadIdx.x, threadIdx.x * 3u, threadIdx.x * 5u, threadIdx.x * 7u}, b0 = 0x01010101u, b1 = b0;
  int c[kChains][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int k = 0; k < kChains; ++k)
      asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};\n"
                   : "+r"(c[k][0]), "+r"(c[k][1]), "+r"(c[k][2]), "+r"(c[k][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  int s = 0;
#pragma unroll
  for (int k = 0; k < kChains; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  if (s == 12345) out[0] = s;
}

template <class F>
float median_ms(F&& launch) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> t;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(e0);
    launch();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main() {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  void* out;
  CK(cudaMalloc(&out, 64));
  const int iters = 4096;
  std::printf("%s, %d SMs\n%-34s %8s %10s\n", p.name, p.multiProcessorCount, "instruction (warps / SM)", "ms", "T(FL)OP/s");
  for (int wps : {8, 16, 32}) {
    const int blocks = p.multiProcessorCount * wps / 4;
    const double warps = double(blocks) * 4;
    float ms = median_ms([&] { mma_f16<<<blocks, 128>>>(iters, static_cast<float*>(out)); });
    CK(cudaGetLastError());
    std::printf("mma.sync m16n8k16 f16->f32 (%2d)    %8.3f %10.1f\n", wps, ms, warps * iters * kChains * 4096.0 / ms / 1e9);
    ms = median_ms([&] { mma_s8<<<blocks, 128>>>(iters, static_cast<int*>(out)); });
    CK(cudaGetLastError());
    std::printf("mma.sync m16n8k32 s8->s32  (%2d)    %8.3f %10.1f\n", wps, ms, warps * iters * kChains * 8192.0 / ms / 1e9);
  }
  return 0;
}
