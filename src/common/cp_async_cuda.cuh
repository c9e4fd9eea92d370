// Asynchronous global -> shared copies (sm_80's cp.async), shared by the pipelined GEMM kernels.
// They compile to nothing below sm_80: the kernels that use them need sm_80, which their host
// launchers check before launching.
#pragma once
#include <cuda_runtime.h>

namespace qf::cuda {

// Copies kBytes (16: .cg, cached in L2 only; 4 or 8: .ca) from global src to shared dst; !valid
// copies nothing and zero-fills dst (src must still be a valid address).
template <int kBytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) {
#if __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int n = valid ? kBytes : 0;
  if constexpr (kBytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(d), "l"(src), "n"(kBytes), "r"(n));
#endif
}
// Closes the group of this thread's copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most kPending of this thread's groups are in flight. Other threads see the data
// after a barrier (__syncwarp / __syncthreads) that follows their own wait.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

}  // namespace qf::cuda
