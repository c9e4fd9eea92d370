// Hopper's tensor memory accelerator (TMA) and the shared-memory barriers it completes on: 2-D
// and 4-D tile copies global -> shared issued by one thread, mbarriers that count arrivals and the bytes
// of copies in flight, and the host side, a tensor map per operand. PTX ISA,
// "cp.async.bulk.tensor" and "mbarrier"; CUDA driver API, cuTensorMapEncodeTiled (reached through
// the runtime's driver entry point, so the library does not link libcuda).
// The device functions compile to nothing below sm_90; callers launch them only on compute
// capability 9.0 from a build with sm_90a code.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

namespace qf::cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define QF_TMA_ASM(...) asm volatile(__VA_ARGS__)
#else
#define QF_TMA_ASM(...) ((void)0)
#endif

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// An mbarrier expecting `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
  QF_TMA_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(count));
}
// Makes the initialized barriers visible to the async proxy (the TMA unit) and the other threads
// (after a __syncthreads).
__device__ __forceinline__ void mbar_init_fence() {
  QF_TMA_ASM("fence.mbarrier_init.release.cluster;\n" :: : "memory");
}
// Arrives, and adds `bytes` to the transaction count the phase waits for (the copies that
// complete on this barrier bring them).
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t bytes) {
  QF_TMA_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  QF_TMA_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
// Waits until the phase with this parity (0, 1, 0, ...: phase number & 1) has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  QF_TMA_ASM("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(
                 smem_u32(b)),
             "r"(parity) : "memory");
}
// The box of `tm` at element coordinates (c0 along the contiguous dimension, c1 along rows) into
// dst, completing on `bar`. Elements outside the tensor arrive as zeros (and count as bytes).
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* tm, int c0, int c1, uint64_t* bar) {
  QF_TMA_ASM(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(tm)), "r"(c0), "r"(c1), "r"(smem_u32(bar)) : "memory");
}
// The box of a 4-D tensor map at element coordinates c0 (contiguous dimension) .. c3 into dst.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* tm, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  QF_TMA_ASM(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(tm)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar)) : "memory");
}
#undef QF_TMA_ASM

// A tensor map of `rank` dimensions (dims[0] the contiguous one, in elements; strides[i] the
// bytes between consecutive entries of dimension i + 1, multiples of 16; base 16-byte aligned),
// copied in boxes of box[0] x ... elements. False when the driver refuses it (the caller then
// takes another path).
inline bool tensor_map(CUtensorMap* tm, const void* base, CUtensorMapDataType type, int rank, const uint64_t* dims,
                       const uint64_t* strides, const uint32_t* box, CUtensorMapSwizzle swizzle) {
  static std::once_flag once;
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  std::call_once(once, [] {
    cudaDriverEntryPointQueryResult q{};
    void* fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    else cudaGetLastError();  // (clear the error: the caller falls back)
  });
  if (!encode || rank < 1 || rank > 5) return false;
  cuuint64_t d[5], st[4];
  cuuint32_t b[5], estr[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    estr[i] = 1;
    if (i + 1 < rank) st[i] = strides[i];
  }
  return encode(tm, type, cuuint32_t(rank), const_cast<void*>(base), d, st, b, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A 2-D tensor map of a row-major array [rows, cols] of elem_bytes-sized elements (row stride
// cols * elem_bytes, a multiple of 16; base 16-byte aligned), copied in boxes of box_rows x
// box_cols. False when the driver refuses it (the caller then takes another path).
inline bool tensor_map_2d(CUtensorMap* tm, const void* base, CUtensorMapDataType type, int elem_bytes, uint64_t cols,
                          uint64_t rows, uint32_t box_cols, uint32_t box_rows, CUtensorMapSwizzle swizzle) {
  const uint64_t dims[2] = {cols, rows}, strides[1] = {cols * elem_bytes};
  const uint32_t box[2] = {box_cols, box_rows};
  return tensor_map(tm, base, type, 2, dims, strides, box, swizzle);
}

}  // namespace qf::cuda
