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

#include "cuda_probe.cuh"

constexpr int kChains = 8;  // independent accumulators per warp: enough to cover the mma latency

// One mma.sync on register operands: d = a b + d. Op::kOps = operations per warp instruction.
struct F16 {  // m16n8k16 f16 x f16 -> f32: 2 * 16 * 8 * 16
  static constexpr double kOps = 4096;
  using Acc = float;
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
struct S8 {  // m16n8k32 s8 x s8 -> s32: 2 * 16 * 8 * 32
  static constexpr double kOps = 8192;
  using Acc = int;
  static __device__ __forceinline__ void mma(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <class Op>
__global__ void mma_loop(int iters, typename Op::Acc* out) {
  const uint32_t a[4] = {threadIdx.x, threadIdx.x * 3u, threadIdx.x * 5u, threadIdx.x * 7u}, b = 0x3c003c00u;
  typename Op::Acc c[kChains][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int k = 0; k < kChains; ++k) Op::mma(c[k], a, b, b);
  }
  typename Op::Acc s = 0;
#pragma unroll
  for (int k = 0; k < kChains; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  if (s == typename Op::Acc(12345)) out[0] = s;  // (practically never): keeps the mma alive
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
  std::printf("%s, %d SMs\n%-34s %8s %10s\n", p.name, p.multiProcessorCount, "instruction (warps / SM)", "ms",
              "T(FL)OP/s");
  auto row = [&](auto op, const char* name, int wps) {
    using Op = decltype(op);
    const int blocks = p.multiProcessorCount * wps / 4;
    const float ms = median_ms([&] { mma_loop<Op><<<blocks, 128>>>(iters, static_cast<typename Op::Acc*>(out)); });
    std::printf("%-26s (%2d)    %8.3f %10.1f\n", name, wps, ms, blocks * 4.0 * iters * kChains * Op::kOps / ms / 1e9);
  };
  for (int wps : {8, 16, 32}) {
    row(F16{}, "mma.sync m16n8k16 f16->f32", wps);
    row(S8{}, "mma.sync m16n8k32 s8->s32", wps);
    CK(cudaGetLastError());
  }
  return 0;
}
