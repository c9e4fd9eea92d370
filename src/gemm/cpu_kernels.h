// The format-independent leaf kernels of the CPU GEMMs, one table per instruction set
// (gemm/cpu_isa.h picks one per call): the float32 panel of the weight-only driver, the fused
// kernel shared by the 4-bit nibble formats (gemm/nibble_gemm_cpu.h), and the integer panels of
// the format-pair GEMMs. A format's own kernels (its decoders, fused kernels) are in
// formats/<fmt>/<fmt>_gemm_cpu*.cpp, with a table of the same kind per instruction set.
//
// The leaves work on one panel of at most kPanelRows weight rows: they are serial and have no
// state; the threaded drivers (q4_0_q8_1_cpu.cpp, int8_int8_cpu.cpp, int4_int4_cpu.cpp,
// nibble_gemm_cpu.cpp, weight_only_cpu.h, driven by the formats' <fmt>_gemm_cpu.cpp) split the
// output among threads by panels, so every output element is computed by one leaf call in one fixed order: results do
// not depend on the thread count (they do depend on the instruction set, by float32 rounding, for the float kernels;
// the integer kernels are exact on every path).
//
// Versions: k_scalar (plain C++, cpu_kernels_scalar.cpp), k_avx2 (AVX2 + FMA + F16C,
// cpu_kernels_avx2.cpp) and k_avx512 (AVX-512 F/BW/VL/DQ/VNNI, cpu_kernels_avx512.cpp). The
// x86 versions are compiled with function target attributes, never with global -m flags, so
// no code that a CPU without them might run is built for them.
#pragma once
#include <cstdint>

#include "formats/q4_0/q4_0.h"
#include "gemm/cpu_isa.h"

namespace qf::gemm {

// Weight rows per leaf call (a "panel"); the float tile of the weight-only driver is
// kPanelRows x kTileK floats (32 KiB: stays in L1 while the activations stream past it).
constexpr int64_t kPanelRows = 8;
constexpr int64_t kTileK = 1024;

// A 4-bit weight whose 32-aligned runs of a row are one 16-byte code run with one scale: the
// formats the fused small-N kernel (CpuKernels::nibble_gemm) decodes in registers.
enum class Nibble : int { nf4 = 0, int4_asym = 1, int4_sym = 2, q4_0 = 3 };
struct NibbleWeights {
  Nibble fmt;
  const uint8_t* codes;  // nf4 packed / int4 qweight / q4_0 blocks
  const float* scales;   // nf4 absmax (decoded) / int4 scales; unused for q4_0
  const uint8_t* zeros;  // int4 asymmetric zero points
  int64_t K;             // row length, a multiple of 32
  int64_t group;         // nf4: log2(blocksize); int4: group size (a multiple of 32)
};

// Whether x must be given to nibble_gemm with each run of 32 values reordered as its 16 even
// elements, then its 16 odd ones (nf4, int4: the two nibbles of a byte are neighbours), rather
// than as is (q4_0: low nibbles are elements 0..15, high ones 16..31).
inline bool nibble_split_order(Nibble f) { return f != Nibble::q4_0; }

struct CpuKernels {
  Isa isa;

  // acc[n * kPanelRows + i] (= or, with accumulate, +=) sum_k X[n * ldx + k] * W[i * ldw + k]
  // over k < kc, for n < N and i < MT <= kPanelRows. Float32 products and sums (FMA in the
  // vector versions), in an order fixed by (kc, the instruction set) only.
  void (*f32_panel)(const float* X, int64_t ldx, int64_t N, const float* W, int64_t ldw, int64_t MT, int64_t kc,
                    float* acc, bool accumulate);

  // Fused weight-only GEMM for few activation rows (N <= 4): Y[j * ldy + i] = sum_k W[m0 + i, k]
  // * X[j, k] for i < MR <= kPanelRows, j < N, decoding W in registers (no tile). X is float32
  // [N, K], reordered per nibble_split_order. nullptr in tables without it (the tile path runs).
  void (*nibble_gemm)(const NibbleWeights& w, int64_t m0, int64_t MR, const float* X, int64_t N, float* Y, int64_t ldy);

  // q4_0 x q8_1: out[i * ldo_m + j * ldo_n] = sum_b d_w[i,b] * d_a[j,b] * sum_t (q_w - 8) q_a,
  // for i < MR <= kPanelRows weight rows (W: rows of nb blocks) and j < N activations given
  // as aq int8 [N, nb * 32] (the q8_1 codes) and ad float32 [N, nb] (the q8_1 scales d).
  // Block sums are exact integers; the sum over blocks is float32.
  void (*q4q8_panel)(const q4_0::block_q4_0* W, int64_t nb, int64_t MR, const int8_t* aq, const float* ad, int64_t N,
                     float* out, int64_t ldo_m, int64_t ldo_n);

  // int8 x int8 -> int32: out[j * ldo + i] = sum_k B[i * K + k] * A[j * K + k] for i < MR <=
  // kPanelRows, j < N. Exact (K <= 131071: gemm/int8_int8.h).
  void (*i8_panel)(const int8_t* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out, int64_t ldo);

  // int4 x int4 -> int32: B packed signed nibbles [MR, K / 2] (element 2t low nibble), A the
  // activations' codes as int8, rearranged by int4_split_rows (int4_int4.h): [N, Kp], Kp = K
  // rounded up to 128. out[j * ldo + i] = sum_k B[i, k] * A[j, k]; exact (K <= 33554431).
  void (*i4_panel)(const uint8_t* B, int64_t MR, const int8_t* A, int64_t N, int64_t K, int32_t* out, int64_t ldo);
};

// The table of `isa` (scalar where the build has no such kernels), and of active_isa().
const CpuKernels& cpu_kernels(Isa isa);
const CpuKernels& cpu_kernels();

namespace k_scalar {
const CpuKernels& kernels();
}
#if QF_GEMM_X86
namespace k_avx2 {
const CpuKernels& kernels();
}
namespace k_avx512 {
const CpuKernels& kernels();
}
#endif

}  // namespace qf::gemm
