// CUDA helpers shared by every format's kernels: error checks that become Python exceptions,
// grid sizing, and coalesced byte copies between global and shared memory.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace qf::cuda {

// cudaError_t -> std::runtime_error (nanobind turns it into a Python RuntimeError).
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
// After a launch: configuration errors show up here, execution errors at the next sync.
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

inline cudaStream_t stream(void* s) { return static_cast<cudaStream_t>(s); }

// Compute capability major of the current device (9: Hopper's clusters and distributed shared memory).
inline int cc_major() {
  int dev = 0, major = 0;
  check(cudaGetDevice(&dev), "CUDA device");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "CUDA device");
  return major;
}

// The most shared memory a CTA of the current device may opt in to (static and dynamic together).
inline int max_dynamic_smem() {
  int dev = 0, n = 0;
  check(cudaGetDevice(&dev), "CUDA device");
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "CUDA device");
  return n;
}

// Whether the current device has sm_80's warp-level mma shapes (m16n8k16 f16/bf16, m16n8k32 s8)
// that the tensor-core GEMM kernels use; older GPUs take their CUDA-core kernels.
inline bool has_sm80_mma() { return cc_major() >= 8; }

// Streaming multiprocessors of the current device.
inline int sm_count() {
  int dev = 0, n = 0;
  check(cudaGetDevice(&dev), "CUDA device");
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "CUDA device");
  return n;
}

// Lets `kernel` launch with up to all the shared memory the current device allows a CTA beside
// the kernel's static arrays. By default a kernel's static and dynamic shared memory together stay
// within 48 KB; past that it must opt in, once per device (remembered here per kernel and device).
inline void allow_dynamic_smem(const void* kernel) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  int dev = 0;
  check(cudaGetDevice(&dev), "CUDA device");
  std::lock_guard<std::mutex> lock(mu);
  if (done.count({kernel, dev})) return;
  cudaFuncAttributes at{};
  int optin = 0;
  check(cudaFuncGetAttributes(&at, kernel), "kernel attributes");
  check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "CUDA device");
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin - int(at.sharedSizeBytes)),
        "kernel shared memory");
  done.insert({kernel, dev});
}

inline unsigned grid_for(int64_t n_items, int items_per_cta) {
  const int64_t g = (n_items + items_per_cta - 1) / items_per_cta;
  if (g > 0x7FFFFFFF) throw std::invalid_argument("input too large for one launch");
  return static_cast<unsigned>(g);
}

// Sum of v over the 32 lanes of a warp (every lane gets it). All 32 lanes must call. For 32-bit
// integers the sum is exact and, on sm_80+, one REDUX instruction (redux.sync) instead of five
// dependent shuffle-add rounds; otherwise a butterfly, whose order is fixed for floats.
template <class V>
__device__ __forceinline__ V warp_sum(V v) {
#if __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<V, int> || std::is_same_v<V, unsigned>) {
    return __reduce_add_sync(0xFFFFFFFFu, v);
  } else
#endif
  {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
  }
}

// Maximum (kMax) or minimum of an unsigned v over the 32 lanes of a warp (every lane gets it);
// all 32 lanes must call. One REDUX instruction on sm_80+, a butterfly before.
template <bool kMax>
__device__ __forceinline__ unsigned warp_extreme_u32(unsigned v) {
#if __CUDA_ARCH__ >= 800
  if constexpr (kMax) return __reduce_max_sync(0xFFFFFFFFu, v);
  else return __reduce_min_sync(0xFFFFFFFFu, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned u = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = kMax ? max(v, u) : min(v, u);
  }
  return v;
#endif
}
__device__ __forceinline__ unsigned warp_max_u32(unsigned v) { return warp_extreme_u32<true>(v); }
__device__ __forceinline__ unsigned warp_min_u32(unsigned v) { return warp_extreme_u32<false>(v); }

// Inclusive prefix sum of v over the 32 lanes of a warp (Hillis-Steele with shuffles; exact for
// integers). All 32 lanes must call.
template <class V>
__device__ __forceinline__ V warp_inclusive_sum(V v) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const V n = __shfl_up_sync(0xFFFFFFFFu, v, o);
    if (static_cast<int>(threadIdx.x & 31u) >= o) v += n;
  }
  return v;
}

__host__ __device__ inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// (a & mask) | c in one LOP3. Written as C, (x & imm) | imm2 compiles to two instructions (a LOP3
// takes one immediate), and the compiler splits it again when a comes from an XOR.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(c));
  return r;
}

// (a & mask) ^ c in one LOP3; equals and_or where c has no bit of mask, and with bits of mask in
// c it also flips those bits of a (int4's symmetric codes: two's complement to q + 8, for free).
__device__ __forceinline__ uint32_t and_xor(uint32_t a, uint32_t mask, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(r) : "r"(a), "r"(mask), "r"(c));
  return r;
}

// The CTA copies nbytes from src to dst, 16 bytes per thread per step when both ends are
// 16-byte aligned (whole sectors per warp instruction), bytewise otherwise. One side is
// shared memory (always 16-byte aligned here), the other a CTA's contiguous slice of a global
// array; blockwise formats stage their odd-sized records (18, 36 bytes...) this way so that
// global memory sees full, coalesced transactions.
__device__ inline void cta_copy(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, int64_t nbytes) {
  int64_t done = 0;
  if (aligned16(dst) && aligned16(src)) {
    const int64_t n16 = nbytes / 16;
    for (int64_t i = threadIdx.x; i < n16; i += blockDim.x)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    done = n16 * 16;
  }
  for (int64_t i = done + threadIdx.x; i < nbytes; i += blockDim.x) dst[i] = src[i];
}

// N consecutive elements of T from global memory into registers: 16-byte loads when the
// source is aligned (the caller passes `vec` from a host-side check of the base pointer;
// every record then starts 16-byte aligned too), element loads otherwise. N * sizeof(T) must
// be a multiple of 16 for the vector path. kStreaming: evict-first loads (__ldcs) for data a
// kernel reads once and should not keep in L2.
template <bool kStreaming = false, class T, int N>
__device__ inline void load_run(const T* __restrict__ src, T (&dst)[N], bool vec) {
  static_assert((N * sizeof(T)) % 16 == 0, "vector path needs whole 16-byte words");
  if (vec) {
    uint4 w[N * sizeof(T) / 16];
#pragma unroll
    for (int i = 0; i < int(N * sizeof(T) / 16); ++i) {
      const uint4* p = reinterpret_cast<const uint4*>(src) + i;
      w[i] = kStreaming ? __ldcs(p) : __ldg(p);
    }
    memcpy(dst, w, sizeof(w));  // register-to-register: compiles to nothing
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = src[i];
  }
}

template <class T, int N>
__device__ inline void store_run(T* __restrict__ dst, const T (&src)[N], bool vec) {
  static_assert((N * sizeof(T)) % 16 == 0, "vector path needs whole 16-byte words");
  if (vec) {
    uint4 w[N * sizeof(T) / 16];
    memcpy(w, src, sizeof(w));
#pragma unroll
    for (int i = 0; i < int(N * sizeof(T) / 16); ++i) reinterpret_cast<uint4*>(dst)[i] = w[i];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = src[i];
  }
}

}  // namespace qf::cuda
