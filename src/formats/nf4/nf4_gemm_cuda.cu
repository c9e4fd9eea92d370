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
};

}  // namespace

template <class T>
void nf4_gemm_cuda(const T* X, int64_t N, int64_t K, int64_t M, const uint8_t* packed, const float* absmax,
                   int64_t blocksize, T* Y, const T* bias, void* stream) {
  const int lb = log2_exact(blocksize);
  if (K % 32 || lb < 5) throw std::invalid_argument("nf4 CUDA GEMM: K must be a multiple of 32");
  cuda_wo::launch_weight_only_any(Nf4{packed, absmax, K, lb}, X, N, K, M, Y, bias, stream);
}

#define QF_INSTANTIATE(T)                                                                                        \
  template void nf4_gemm_cuda<T>(const T*, int64_t, int64_t, int64_t, const uint8_t*, const float*, int64_t, T*, \
                                 const T*, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::gemm
