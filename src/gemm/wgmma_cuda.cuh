// Hopper's warpgroup MMA (wgmma.mma_async, sm_90a) with A in registers and B in shared memory,
// for the wide weight-only kernel (weight_only_wide_cuda.cuh): the decoded weights are A (each
// warp of the warpgroup holds 16 of the 64 rows, in the register layout of mma.sync.m16n8k16's A
// fragment), the activations are B, read by the tensor cores straight from a K-major table with
// the 128-byte swizzle, and the fp32 accumulators of m64nNk16 have, per warp, the C-fragment
// layout of N / 8 mma.sync n8 tiles (c[nt][0..1]: row g, columns 8 nt + 2t, + 1; c[nt][2..3]:
// row g + 8). The instruction is asynchronous: the warp decodes the next weights while the tensor
// cores multiply, which mma.sync's register-to-register dependencies did not allow (the wide
// kernel's `wait` stalls, benchmarks/README.md "Where the wide kernel's time goes").
// PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions"; the
// descriptor and swizzle are CUTLASS's GmmaDescriptor and Swizzle<3, 4, 3>.
//
// The rules the caller keeps (PTX ISA, wgmma.fence / commit_group / wait_group):
// - fence() after writing A or the accumulators with other instructions and before the wgmma
//   that reads them;
// - A's registers stay unchanged until the wgmma that reads them has completed (wait<n>);
// - the accumulators are read only after wait<0>;
// - shared memory written by ordinary stores is made visible to the tensor cores' (async proxy)
//   reads with proxy_fence() before the barrier that publishes it.
// Everything compiles empty unless the target is sm_90a (__CUDA_ARCH_FEAT_SM90_ALL): the host
// launches these kernels only when the build has sm_90a code (QFORMATS_SM90A).
#pragma once
#include <cstdint>

namespace qf::gemm::cuda_wo::wg {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QF_WG_ASM(...) asm volatile(__VA_ARGS__)
#else
#define QF_WG_ASM(...) ((void)0)
#endif

__device__ __forceinline__ void fence() { QF_WG_ASM("wgmma.fence.sync.aligned;\n" :: : "memory"); }
__device__ __forceinline__ void commit() { QF_WG_ASM("wgmma.commit_group.sync.aligned;\n" :: : "memory"); }
// Waits until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wait() {
  QF_WG_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy shared-memory stores of this thread become visible to later async-proxy reads.
__device__ __forceinline__ void proxy_fence() { QF_WG_ASM("fence.proxy.async.shared::cta;\n" :: : "memory"); }
// Keeps the compiler from moving reads or writes of an accumulator across a wgmma fence or wait.
__device__ __forceinline__ void pin(float& r) { QF_WG_ASM("" : "+f"(r)::"memory"); }
// Four 8 x 8 matrices of 16-bit values, each held as an mma C fragment (lane (g, t): row g, columns
// 2t and 2t + 1 in the low and high half of r[j]), stored transposed: lane l gives the shared
// address of column l % 8 of matrix l / 8, which receives that column's 8 rows (16 bytes).
// PTX ISA, "stmatrix" (sm_90).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  QF_WG_ASM("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
            "r"(r2), "r"(r3) : "memory");
}
#undef QF_WG_ASM

// Bytes of one 64-element row of a K-major 128-byte-swizzle tile (fp16 / bf16), and of the
// 8-row swizzle atom (the descriptor's stride between 8-row groups).
constexpr int kRowBytes = 128;
constexpr int kAtomBytes = 8 * kRowBytes;

// Byte offset of 16-bit element k (0..63) of row n in a tile of such rows whose base is
// 1024-byte aligned: the 16-byte chunk k / 8 is XOR-ed with n mod 8 (Swizzle<3, 4, 3>), so that
// eight rows' same chunk lie in eight distinct bank quads.
__host__ __device__ constexpr int sw128_offset(int n, int k) {
  return n * kRowBytes + ((((k >> 3) ^ (n & 7)) << 4) | ((k & 7) << 1));
}

// Matrix descriptor of a K-major tile with the 128-byte swizzle at shared address `addr`
// (1024-byte aligned tile; + 32 bytes per further k16 slice of a 64-element row): start address
// >> 4 in bits 0-13, leading byte offset 1 (unused for this layout) in 16-29, stride byte offset
// (8 rows: 1024 B) >> 4 in 32-45, layout "128-byte swizzle" (1) in 62-63.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return (uint64_t(1) << 62) | (uint64_t(kAtomBytes >> 4) << 32) | (uint64_t(1) << 16) | ((addr & 0x3FFFF) >> 4);
}

// D [64, 8 NT] += A [64, 16] (registers) . B [16, 8 NT] (descriptor), fp32 accumulators; BF16
// picks bf16 inputs, else fp16.
template <int NT>
struct WgmmaRS;

// The instruction for one NT: N = 8 NT, ACC the accumulators' operand numbers, then A's four
// registers, the descriptor and the scale-d predicate's operand; the constraints follow.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QF_WGMMA_RS(T, N, ACC, A, DESC, PRED, ...)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED                                              \
               ", 0;\n"                                                                              \
               "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." T "." T " {" ACC "}, {" A "}, " DESC \
               ", p, 1, 1, 0;\n}\n"                                                                  \
               : __VA_ARGS__                                                                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))
#define QF_WGMMA_RS_TYPED(...)                          \
  if constexpr (BF16) QF_WGMMA_RS("bf16", __VA_ARGS__); \
  else QF_WGMMA_RS("f16", __VA_ARGS__)
#else
#define QF_WGMMA_RS_TYPED(...) ((void)0)
#endif

// The constraints of NT rows of accumulators c[i][0..3], "+f" each (the instruction reads and
// writes them), in operand order.
#define QF_ACC1(i) "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3])
#define QF_ACC2(i) QF_ACC1(i), QF_ACC1(i + 1)
#define QF_ACC4(i) QF_ACC2(i), QF_ACC2(i + 2)
#define QF_ACC8(i) QF_ACC4(i), QF_ACC4(i + 4)

template <>
struct WgmmaRS<2> {
  template <bool BF16>
  static __device__ __forceinline__ void run(float (&c)[2][4], const uint32_t (&a)[4], uint64_t desc) {
    QF_WGMMA_RS_TYPED("16", "%0, %1, %2, %3, %4, %5, %6, %7", "%8, %9, %10, %11", "%12", "%13", QF_ACC2(0));
  }
};

template <>
struct WgmmaRS<4> {
  template <bool BF16>
  static __device__ __forceinline__ void run(float (&c)[4][4], const uint32_t (&a)[4], uint64_t desc) {
    QF_WGMMA_RS_TYPED("32", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15",
                      "%16, %17, %18, %19", "%20", "%21", QF_ACC4(0));
  }
};

template <>
struct WgmmaRS<8> {
  template <bool BF16>
  static __device__ __forceinline__ void run(float (&c)[8][4], const uint32_t (&a)[4], uint64_t desc) {
    QF_WGMMA_RS_TYPED("64",
                      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
                      "%32, %33, %34, %35", "%36", "%37", QF_ACC8(0));
  }
};

template <>
struct WgmmaRS<16> {
  template <bool BF16>
  static __device__ __forceinline__ void run(float (&c)[16][4], const uint32_t (&a)[4], uint64_t desc) {
    QF_WGMMA_RS_TYPED(
        "128",
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "
        "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63",
        "%64, %65, %66, %67", "%68", "%69", QF_ACC8(0), QF_ACC8(8));
  }
};

template <>
struct WgmmaRS<24> {  // m64n192k16: 96 accumulators per thread (weight_only_prefill_cuda.cuh)
  template <bool BF16>
  static __device__ __forceinline__ void run(float (&c)[24][4], const uint32_t (&a)[4], uint64_t desc) {
    QF_WGMMA_RS_TYPED(
        "192",
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "
        "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "
        "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "
        "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95",
        "%96, %97, %98, %99", "%100", "%101", QF_ACC8(0), QF_ACC8(8), QF_ACC8(16));
  }
};

template <>
struct WgmmaRS<32> {  // m64n256k16: 128 accumulators per thread (weight_only_prefill_cuda.cuh)
  template <bool BF16>
  static __device__ __forceinline__ void run(float (&c)[32][4], const uint32_t (&a)[4], uint64_t desc) {
    QF_WGMMA_RS_TYPED(
        "256",
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "
        "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "
        "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "
        "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, "
        "%101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, "
        "%117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127",
        "%128, %129, %130, %131", "%132", "%133", QF_ACC8(0), QF_ACC8(8), QF_ACC8(16), QF_ACC8(24));
  }
};

#undef QF_WGMMA_RS_TYPED
#undef QF_ACC1
#undef QF_ACC2
#undef QF_ACC4
#undef QF_ACC8
#undef QF_WGMMA_RS

}  // namespace qf::gemm::cuda_wo::wg
