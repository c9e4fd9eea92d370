// What the standalone CUDA probes of benchmarks/ (mma_peak.cu, read_patterns.cu,
// gemv_bulk_probe.cu, gemv_frag_probe.cu, prefill_probe.cu) share: an error check that exits, a
// kernel that keeps the GPU busy for a number of cycles before a timed launch (so that the launch,
// not the host, is timed), the resident-mode timing, and the int4 probes' random operands and
// device helpers.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/tma_cuda.cuh"

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

// Median time in us of `iters` launches (after `warmup` more, not counted), each after a GPU spin
// of spin_cycles (~1 ms) so that the launch itself is timed, with CUDA events: prepare(i) runs
// before the spin (untimed), launch(i) between the events.
template <class Prepare, class Launch>
double median_cold_us(int iters, Prepare prepare, Launch launch, int64_t spin_cycles = 2000000, int warmup = 0) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> us;
  for (int i = 0; i < warmup + iters; ++i) {
    prepare(i);
    spin<<<1, 1>>>(spin_cycles);
    CK(cudaEventRecord(a));
    launch(i);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (i >= warmup) us.push_back(ms * 1000);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// Median time in us of one call when `calls` launches run back to back (llama.cpp's perf mode with
// the weight resident in L2, without a CUDA graph): the median of `rounds` event-timed batches.
template <class Launch>
double median_resident_us(Launch launch, int calls = 200, int rounds = 5) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> us;
  for (int r = 0; r < rounds; ++r) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < calls; ++i) launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(ms * 1000 / calls);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// Device helpers of the int4 probes: shared-memory addresses and mbarriers (the library's, in
// common/tma_cuda.cuh), and the fp16 decode steps.
using qf::cuda::mbar_arrive;
using qf::cuda::mbar_expect;
using qf::cuda::mbar_init;
using qf::cuda::mbar_wait;
using qf::cuda::smem_u32;
__device__ __forceinline__ uint32_t lop3_or(uint32_t w, uint32_t mask) {  // (w & mask) | 0x64006400
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(w), "r"(mask), "r"(0x64006400u));
  return r;
}
__device__ __forceinline__ uint32_t hsub2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("sub.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// D += A B, m16n8k16, fp16 in, float32 accumulators
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// word j of 16 bytes (j a constant after unrolling)
__device__ __forceinline__ uint32_t word(const uint4& q, int j) {
  return j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w;
}
__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// Random int4 g128 weights [M, K] in qformats.int4's layout (codes two per byte, low nibble first;
// zero points 0..15 and float32 scales per group of 128) and fp16 activations [x_rows, K] in
// [-1, 1], from one xorshift stream.
struct Int4Host {
  std::vector<uint8_t> q, z;
  std::vector<float> s;
  std::vector<__half> x;
};
inline Int4Host random_int4(int M, int K, size_t x_rows) {
  const size_t groups = size_t(M) * (K / 128);
  Int4Host h{std::vector<uint8_t>(size_t(M) * K / 2), std::vector<uint8_t>(groups), std::vector<float>(groups),
             std::vector<__half>(x_rows * K)};
  uint64_t r = 88172645463325252ull;
  auto rnd = [&]() {
    r ^= r << 13;
    r ^= r >> 7;
    r ^= r << 17;
    return r;
  };
  for (auto& v : h.q) v = uint8_t(rnd());
  for (auto& v : h.z) v = uint8_t(rnd() % 16);
  for (auto& v : h.s) v = 0.001f + 0.01f * float(rnd() % 1000) / 1000.f;
  for (auto& v : h.x) v = __float2half(float(int(rnd() % 2001) - 1000) / 1000.f);
  return h;
}

// Device copies of the weight, enough of them (>= 240 MB in all, at least 2) that a timed call
// rotating through them reads its weight from DRAM, not L2.
struct Int4Set {
  uint8_t *q, *z;
  float* s;
};
inline std::vector<Int4Set> device_sets(const Int4Host& h) {
  const size_t bytes = h.q.size() + h.z.size() * 5;
  std::vector<Int4Set> sets(std::max<size_t>(2, (4 * 60ull << 20) / bytes + 1));
  for (auto& st : sets) {
    CK(cudaMalloc(&st.q, h.q.size()));
    CK(cudaMalloc(&st.z, h.z.size()));
    CK(cudaMalloc(&st.s, h.s.size() * 4));
    CK(cudaMemcpy(st.q, h.q.data(), h.q.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(st.z, h.z.data(), h.z.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(st.s, h.s.data(), h.s.size() * 4, cudaMemcpyHostToDevice));
  }
  return sets;
}
inline void free_sets(std::vector<Int4Set>& sets) {
  for (auto& st : sets) {
    CK(cudaFree(st.q));
    CK(cudaFree(st.z));
    CK(cudaFree(st.s));
  }
  sets.clear();
}
