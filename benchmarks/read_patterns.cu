// How fast can a kernel read a 4-bit weight matrix from DRAM, by access pattern? A standalone
// probe for the N = 1 GEMV question of issue 4: it reads the bytes of an int4 weight (M x K/2)
// the way a GEMV kernel would, with no decode (or with a fixed amount of integer work per
// 16 bytes standing in for it), and times each pattern with CUDA events from DRAM (buffers
// rotated through > 4x the L2), so that the gap between a pattern and the plain copy separates
// what the access pattern costs from what the decode costs.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/read_patterns.cu -o /tmp/read_patterns && /tmp/read_patterns
//
// Patterns:
//   linear    grid-stride 16-byte loads over the flat buffer, UNR loads in flight per lane
//   tile      the tensor-core GEMV kernels' pattern: a work item is 16 rows x 1/S of K; lane
//             (g, t) reads rows g and g + 8, U 16-byte chunks per row per step (a quad covers
//             64 U contiguous bytes of a row), with the next D - 1 steps' loads in flight;
//             W warps per CTA, one item each; `persist` = as many CTAs as fit, looping over items
//   rowwarp   a warp reads whole rows (32 lanes x 16 bytes per step), D steps in flight
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_probe.cuh"

// Stand-in for decode work: WORK integer multiply-adds per 16 bytes, in 4 independent chains.
template <int WORK>
__device__ __forceinline__ void work(const uint4& v, uint32_t (&a)[4]) {
  a[0] ^= v.x;
  a[1] ^= v.y;
  a[2] ^= v.z;
  a[3] ^= v.w;
#pragma unroll
  for (int i = 0; i < WORK; ++i) a[i & 3] = a[i & 3] * 0x9E3779B1u + (i + 1);
}

__device__ __forceinline__ void sink(const uint32_t (&a)[4], uint32_t* out) {
  const uint32_t s = a[0] ^ a[1] ^ a[2] ^ a[3];
  if (s == 0x12345679u) out[threadIdx.x] = s;  // (practically never): keeps the loads alive
}

template <int UNR, int WORK>
__global__ void linear(const uint4* __restrict__ p, int64_t n, uint32_t* out) {
  uint32_t a[4] = {0, 0, 0, 0};
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (UNR - 1) * stride < n; i += UNR * stride) {
    uint4 v[UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u) v[u] = __ldg(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < UNR; ++u) work<WORK>(v[u], a);
  }
  for (; i < n; i += stride) work<WORK>(__ldg(p + i), a);
  sink(a, out);
}

// rows x rb bytes; items = (rows / 16) * S; CTAs loop over items (grid-stride) so that the same
// kernel runs one item per warp (grid = items / W) or persistently (grid = what fits).
template <int U, int D, int WORK>
__global__ void tile(const uint8_t* __restrict__ p, int64_t rows, int64_t rb, int S, uint32_t* out) {
  uint32_t a[4] = {0, 0, 0, 0};
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t items = rows / 16 * S, part = rb / S, steps = part / (64 * U);
  for (int64_t it = int64_t(blockIdx.x) * W + warp; it < items; it += int64_t(gridDim.x) * W) {
    const int64_t tl = it / S, s = it % S;
    const uint8_t* ra = p + (tl * 16 + g) * rb + s * part + t * 16 * U;
    const uint8_t* rb8 = ra + 8 * rb;
    uint4 buf[D][2][U];
    auto ld = [&](int64_t k, uint4(&dst)[2][U]) {
#pragma unroll
      for (int i = 0; i < U; ++i) {
        dst[0][i] = __ldg(reinterpret_cast<const uint4*>(ra + k * 64 * U) + i);
        dst[1][i] = __ldg(reinterpret_cast<const uint4*>(rb8 + k * 64 * U) + i);
      }
    };
#pragma unroll
    for (int d = 0; d < D - 1; ++d)
      if (d < steps) ld(d, buf[d]);
    for (int64_t k0 = 0; k0 < steps; k0 += D) {
#pragma unroll
      for (int d = 0; d < D; ++d) {
        const int64_t k = k0 + d;
        if (k < steps) {
          if (k + D - 1 < steps) ld(k + D - 1, buf[(d + D - 1) % D]);
#pragma unroll
          for (int i = 0; i < U; ++i) {
            work<WORK>(buf[d][0][i], a);
            work<WORK>(buf[d][1][i], a);
          }
        }
      }
    }
  }
  sink(a, out);
}

template <int D, int WORK>
__global__ void rowwarp(const uint8_t* __restrict__ p, int64_t rows, int64_t rb, uint32_t* out) {
  uint32_t a[4] = {0, 0, 0, 0};
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  const int64_t steps = rb / 512;
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
    const uint4* q = reinterpret_cast<const uint4*>(p + r * rb) + lane;
    uint4 buf[D];
#pragma unroll
    for (int d = 0; d < D - 1; ++d)
      if (d < steps) buf[d] = __ldg(q + 32 * d);
    for (int64_t k0 = 0; k0 < steps; k0 += D) {
#pragma unroll
      for (int d = 0; d < D; ++d) {
        const int64_t k = k0 + d;
        if (k < steps) {
          if (k + D - 1 < steps) buf[(d + D - 1) % D] = __ldg(q + 32 * (k + D - 1));
          work<WORK>(buf[d], a);
        }
      }
    }
  }
  sink(a, out);
}

struct Bench {
  std::vector<uint8_t*> bufs;
  int64_t bytes;
  int64_t spin_cycles;
  int which = 0;
  Bench(int64_t b, int nbuf) : bytes(b) {
    for (int i = 0; i < nbuf; ++i) {
      uint8_t* d;
      CK(cudaMalloc(&d, b));
      CK(cudaMemset(d, i + 1, b));
      bufs.push_back(d);
    }
    int clk;
    CK(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0));
    spin_cycles = int64_t(clk) * 1000 / 1000;  // ~1 ms: the launch is queued behind it
  }
  template <class F>
  float time(F&& launch, int reps = 21) {
    return float(median_cold_us(reps, [](int) {}, [&](int) { launch(bufs[which++ % bufs.size()]); }, spin_cycles, 2));
  }
};

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
  uint32_t* out;
  CK(cudaMalloc(&out, 1024 * sizeof(uint32_t)));
  const int64_t shapes[][2] = {{14336, 4096}, {4096, 14336}, {4096, 4096}};
  for (auto& sh : shapes) {
    const int64_t rows = sh[0], rb = sh[1] / 2, bytes = rows * rb;
    Bench B(bytes, int(std::max<int64_t>(4, (int64_t(prop.l2CacheSize) * 5) / bytes + 1)));
    std::printf("\n== int4 codes of %lld x %lld: %.1f MB\n", (long long)rows, (long long)sh[1], bytes / 1e6);
    std::printf("%-44s %9s %9s\n", "pattern", "us", "GB/s");
    auto row = [&](const char* name, float us) { std::printf("%-44s %9.2f %9.0f\n", name, us, bytes / us / 1e3); };
    // a d2d copy of the same bytes (reads + writes: the "% copy" reference counts both)
    {
      uint8_t* dst;
      CK(cudaMalloc(&dst, bytes));
      float us = B.time([&](uint8_t* b) { CK(cudaMemcpyAsync(dst, b, bytes, cudaMemcpyDeviceToDevice)); });
      std::printf("%-44s %9.2f %9.0f (read + write)\n", "cudaMemcpy d2d", us, 2.0 * bytes / us / 1e3);
      CK(cudaFree(dst));
    }
    const int64_t n16 = bytes / 16;
    for (int bps : {4, 8, 16}) {
      char name[64];
      std::snprintf(name, sizeof name, "linear unroll 4, %d x 256 thr / SM", bps);
      row(name, B.time([&](uint8_t* b) { linear<4, 0><<<sms * bps, 256>>>((const uint4*)b, n16, out); }));
    }
    row("linear unroll 4, 8 x 256 / SM, work 64",
        B.time([&](uint8_t* b) { linear<4, 64><<<sms * 8, 256>>>((const uint4*)b, n16, out); }));
    row("linear unroll 4, 8 x 256 / SM, work 128",
        B.time([&](uint8_t* b) { linear<4, 128><<<sms * 8, 256>>>((const uint4*)b, n16, out); }));
    // the tensor-core kernels' pattern (U = 2, D = 2) at the K splits and CTA sizes they use
    for (int S : {1, 2, 4, 8}) {
      for (int W : {4, 8}) {
        const int64_t items = rows / 16 * S;
        if (rb / S < 128) continue;
        char name[64];
        std::snprintf(name, sizeof name, "tile U2 D2, S=%d, W=%d (%lld CTAs)", S, W, (long long)(items / W));
        row(name, B.time([&](uint8_t* b) { tile<2, 2, 0><<<(items + W - 1) / W, W * 32>>>(b, rows, rb, S, out); }));
      }
    }
    for (int S : {1, 4}) {
      const int64_t items = rows / 16 * S;
      char name[64];
      std::snprintf(name, sizeof name, "tile U2 D4, S=%d, W=4", S);
      row(name, B.time([&](uint8_t* b) { tile<2, 4, 0><<<(items + 3) / 4, 128>>>(b, rows, rb, S, out); }));
      std::snprintf(name, sizeof name, "tile U1 D4, S=%d, W=4", S);
      row(name, B.time([&](uint8_t* b) { tile<1, 4, 0><<<(items + 3) / 4, 128>>>(b, rows, rb, S, out); }));
      std::snprintf(name, sizeof name, "tile U2 D2, S=%d, W=4, work 128", S);
      row(name, B.time([&](uint8_t* b) { tile<2, 2, 128><<<(items + 3) / 4, 128>>>(b, rows, rb, S, out); }));
      std::snprintf(name, sizeof name, "tile U2 D4, S=%d, W=4, work 128", S);
      row(name, B.time([&](uint8_t* b) { tile<2, 4, 128><<<(items + 3) / 4, 128>>>(b, rows, rb, S, out); }));
    }
    // occupancy capped by dynamic shared memory: W=4 warps per CTA, ctas_per_sm CTAs per SM
    for (int cps : {2, 4, 8}) {
      const int smem = int(prop.sharedMemPerMultiprocessor / cps) - 2048;
      CK(cudaFuncSetAttribute(tile<2, 2, 0>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      CK(cudaFuncSetAttribute(tile<2, 4, 0>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const int64_t items = rows / 16 * 4;
      char name[64];
      std::snprintf(name, sizeof name, "tile U2 D2 S=4 W=4, %d warps / SM", 4 * cps);
      row(name, B.time([&](uint8_t* b) { tile<2, 2, 0><<<(items + 3) / 4, 128, smem>>>(b, rows, rb, 4, out); }));
      std::snprintf(name, sizeof name, "tile U2 D4 S=4 W=4, %d warps / SM", 4 * cps);
      row(name, B.time([&](uint8_t* b) { tile<2, 4, 0><<<(items + 3) / 4, 128, smem>>>(b, rows, rb, 4, out); }));
    }
    for (int per_sm : {4, 8, 16}) {
      char name[64];
      std::snprintf(name, sizeof name, "tile U2 D4 S=4 persistent, %d x 4 warps / SM", per_sm);
      row(name, B.time([&](uint8_t* b) { tile<2, 4, 0><<<sms * per_sm, 128>>>(b, rows, rb, 4, out); }));
      std::snprintf(name, sizeof name, "tile U2 D4 S=1 persistent, %d x 4 warps / SM", per_sm);
      row(name, B.time([&](uint8_t* b) { tile<2, 4, 0><<<sms * per_sm, 128>>>(b, rows, rb, 1, out); }));
    }
    for (int D : {2, 4}) {
      char name[64];
      std::snprintf(name, sizeof name, "rowwarp D%d, 1 warp per row", D);
      const int64_t ctas = (rows + 3) / 4;
      if (D == 2) row(name, B.time([&](uint8_t* b) { rowwarp<2, 0><<<ctas, 128>>>(b, rows, rb, out); }));
      else row(name, B.time([&](uint8_t* b) { rowwarp<4, 0><<<ctas, 128>>>(b, rows, rb, out); }));
    }
    row("rowwarp D4, persistent 16 warps / SM",
        B.time([&](uint8_t* b) { rowwarp<4, 0><<<sms * 4, 128>>>(b, rows, rb, out); }));
    row("rowwarp D8, persistent 16 warps / SM",
        B.time([&](uint8_t* b) { rowwarp<8, 0><<<sms * 4, 128>>>(b, rows, rb, out); }));
    for (auto d : B.bufs) CK(cudaFree(d));
  }
  return 0;
}
