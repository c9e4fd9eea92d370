// nf4's weight-only GEMM on the GPU (declared in formats/nf4/nf4_gemm_cuda.h): the policy of
// the shared drivers (gemm/weight_only_policy_cuda.cuh) that loads and decodes a unit of one
// weight row to the values of nf4's dequantize (nf4.h), split as w = v * scale, and its launcher.
#include <stdexcept>
#include <type_traits>

#include "formats/nf4/nf4.h"
#include "formats/nf4/nf4_gemm_cuda.h"
#include "gemm/weight_only_policy_cuda.cuh"

namespace qf::gemm {
namespace {

using cuda_wo::hi_hi;
using cuda_wo::kMagic;
using cuda_wo::lo_lo;
using cuda_wo::magic_u4;
using cuda_wo::nibbles_lo_first;
using cuda_wo::NoShared;
using cuda_wo::word_of;
using cuda_wo::xpair_lo_first;

// nf4 (bitsandbytes): element 2b in the HIGH nibble of byte b; value CODE[c] * absmax, blocks of
// blocksize >= 32 over the flattened W, so a unit of 32 never straddles two.
struct Nf4 {
  static constexpr int kUnit = 32;
  static constexpr bool kOffset = false;
  const uint8_t* packed;
  const float* absmax;
  int64_t K;
  int log2_bs;
  struct Shared {
    float code[16];  // 16 floats in 16 banks: any lookup pattern is conflict-free
  };
  struct RowState {
    const uint4* q;  // the row's codes, 16 bytes per unit
    int64_t e0;      // index of the row's first element in the flattened W
  };
  struct Unit {
    uint4 q;
    float absmax;
  };
  __device__ void init(Shared& s) const {
    if (threadIdx.x < 16) s.code[threadIdx.x] = nf4::code_value(static_cast<int>(threadIdx.x));
  }
  __device__ RowState row(int64_t m, int64_t) const {
    return {reinterpret_cast<const uint4*>(packed + m * K / 2), m * K};
  }
  __device__ Unit load(RowState& r, int64_t, int64_t u, bool) const {
    return {__ldg(r.q + u), __ldg(absmax + ((r.e0 + u * kUnit) >> log2_bs))};
  }
  __device__ float scale(const Unit& un) const { return un.absmax; }
  __device__ float offset(const Unit&) const { return 0.0f; }
  __device__ void decode8(const Shared& s, const Unit& un, int j, float (&v)[8]) const {
    const uint32_t w = word_of(un.q, j);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      v[2 * b] = s.code[(w >> (8 * b + 4)) & 15u];
      v[2 * b + 1] = s.code[(w >> (8 * b)) & 15u];
    }
  }
  // Tensor-core path: a byte (elements 2b, 2b+1 of its word) looks up both codes at once.
  static constexpr bool kLut = true;
  static constexpr int kMmaMinRows = 2;
  template <class Ops>
  __device__ uint32_t lut_entry(int byte) const {
    return Ops::pack(nf4::code_value(byte >> 4), nf4::code_value(byte & 15));
  }
  template <class Ops>
  __host__ __device__ static constexpr bool odd_x16() {
    return false;
  }
  template <class Ops>
  __device__ void pairs(const uint32_t (*lut)[32], int lane, const Unit& un, int j, uint32_t (&p)[4]) const {
    const uint32_t w = word_of(un.q, j), s = Ops::splat(un.absmax);
#pragma unroll
    for (int b = 0; b < 4; ++b) p[b] = Ops::mul(lut[__byte_perm(w, 0, 0x4440 | b)][lane], s);
  }
  static __device__ uint32_t xpair(const uint32_t (&x)[16], int p) { return x[p]; }  // elements 2p, 2p+1
  static constexpr bool kPairLoad = false;
  static constexpr bool kContiguousSteps = false;
  static constexpr int kMaxRowGroups = 4;    // benchmarks/README.md, "Row groups"
  static constexpr int kStagedXMinRows = 4;  // benchmarks/README.md, "Activations through shared memory"
  static constexpr int kTableXMaxRows = 1;   // (the pair table leaves no room for it)
  // The prefill kernel (gemm/weight_only_prefill_cuda.cuh, fp16 or bf16 activations): a step of 64 codes
  // is 32 bytes of a row; blocks of >= 64 values that start at every row's start (K a multiple of
  // the blocksize) hold whole steps.
  static constexpr bool kPrefill = true;
  static constexpr int kPrefillStepBytes = 32;
  // lut[byte][lane]: the byte's pair (code of the high nibble, code of the low nibble) as fp16 or bf16,
  // once per lane so that a warp's 32 lookups of any bytes hit 32 distinct banks.
  static constexpr int kPrefillTableBytes = 256 * 32 * 4;
  bool prefill_ok() const { return log2_bs >= 6 && K % (int64_t(1) << log2_bs) == 0; }
  const void* prefill_codes() const { return packed; }
  // A step's metadata, its block's absmax as stored (the decode makes it an H pair): by TMA with the
  // step's codes, absmax viewed as [M, K / blocksize], where that array's row pitch is a multiple of
  // 16 bytes (K / blocksize a multiple of 4: benchmarks/README.md, "nf4's block scales by TMA"),
  // else loaded by the consumers a block ahead.
  static constexpr bool kPrefillMetaTma = true;
  bool prefill_meta_tma_ok() const { return (K >> log2_bs) % 4 == 0 && reinterpret_cast<uintptr_t>(absmax) % 16 == 0; }
  const void* prefill_meta_base() const { return absmax; }
  int64_t prefill_meta_cols() const { return K >> log2_bs; }
  static constexpr int kPrefillMetaWords = 1;
  struct PrefillMeta {
    float absmax;
  };
// (a build without sm_90a code compiles the kernel empty: the hooks below are then unused)
#pragma nv_diag_suppress 177
  __device__ int prefill_meta_col(int k) const { return k >> (log2_bs - 6); }
  __device__ int prefill_group_steps() const { return 1 << (log2_bs - 6); }
  __device__ PrefillMeta prefill_meta(int m, int k) const {
    return {__ldg(absmax + ((int64_t(m) * K) >> log2_bs) + prefill_meta_col(k))};
  }
  template <class H>
  __device__ void prefill_meta_words(const PrefillMeta& p, uint32_t (&w)[1]) const {
    w[0] = __float_as_uint(p.absmax);
  }
  template <class H>
  __device__ void prefill_table(uint32_t* lut) const {
    for (int i = threadIdx.x; i < 256 * 32; i += blockDim.x) lut[i] = lut_entry<cuda_wo::PairOps<H>>(i >> 5);
  }
  // In k16 slice j, lane (g, t = lane & 3) needs values 2t, 2t + 1 and 2t + 8, 2t + 9 of rows r and
  // r + 8: byte t of words 2j and 2j + 1, one lookup each, times the block's absmax (rounded to H).
  template <class H>
  __device__ void prefill_decode(const uint8_t* tile, int r, int lane, const uint32_t* lut, const uint32_t* wa,
                                 const uint32_t* wb, uint32_t (&a)[4][4]) const {
    using Ops = cuda_wo::PairOps<H>;
    // wa, wb: the rows' absmax as stored (float32), made an H pair here
    const uint32_t sel = 0x4440u | uint32_t(lane & 3), sa = Ops::splat(__uint_as_float(*wa)),
                   sb = Ops::splat(__uint_as_float(*wb));
    cuda_wo::byte_pair_fragments(
        tile, r, [&](uint32_t w, int h) { return Ops::mul(lut[(__byte_perm(w, 0u, sel) << 5) | lane], h ? sb : sa); },
        a);
  }
#pragma nv_diag_default 177
};

}  // namespace

template <class T>
void nf4_gemm_cuda(const T* X, int64_t N, int64_t K, int64_t M, const uint8_t* packed, const float* absmax,
                   int64_t blocksize, T* Y, const T* bias, GemmWorkspace ws, void* stream) {
  const int lb = log2_exact(blocksize);
  if (K % 32 || lb < 5) throw std::invalid_argument("nf4 CUDA GEMM: K must be a multiple of 32");
  cuda_wo::launch_weight_only_any(Nf4{packed, absmax, K, lb}, X, N, K, M, Y, bias, ws, stream);
}

#define QF_INSTANTIATE(T)                                                                                        \
  template void nf4_gemm_cuda<T>(const T*, int64_t, int64_t, int64_t, const uint8_t*, const float*, int64_t, T*, \
                                 const T*, GemmWorkspace, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::gemm
