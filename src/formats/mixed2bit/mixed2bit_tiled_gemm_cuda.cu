// mixed2bit layout "tiled" (mixed2bit_tiled.h): the weight-only GEMM on the GPU, one policy for
// both shared drivers (gemm/weight_only_policy_cuda.cuh): the float32 kernel for float32
// activations, the tensor-core kernel for 16-bit ones on sm_80+; one or two 16-bit activation
// rows at groups of 16 take the layout's own GEMV instead (mixed2bit_tiled_gemv_cuda.cuh, which says why).
//
// What the layout buys the kernel: a unit (16 values of one row) finds its codes word, scale
// byte and second-order pair at addresses given by its column, whatever the kind of its group,
// so those loads never wait on the map. Only a 4-bit group (a tenth of them at the defaults)
// needs its slot in lo / mc4: the 4-bit groups of the row before it, which a lane keeps as the
// count before its current map word plus a popcount in that word. Every tile starts its count
// at t * n4_full, so the count never drifts across tiles, and a slot past the row is clamped to
// it (the callers check the map once with check_map_cuda; a bad one then reads no byte outside
// the buffers).
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "formats/mixed2bit/mixed2bit_tiled.h"
#include "formats/mixed2bit/mixed2bit_tiled_gemv_cuda.cuh"
#include "gemm/weight_only_cuda.h"
#include "gemm/weight_only_policy_cuda.cuh"

namespace qf::mixed2bit::tiled {
namespace {

using gemm::cuda_wo::kMagic;
using gemm::cuda_wo::nibbles_lo_first;
using gemm::cuda_wo::NoShared;
using gemm::cuda_wo::spread2;
using gemm::cuda_wo::xpair_lo_first;

struct TiledPolicy {
  // both drivers
  static constexpr int kUnit = 16;
  // float32 driver (weight_only_cuda.cuh)
  static constexpr bool kOffset = true;
  using Shared = NoShared;
  // tensor-core driver (weight_only_mma_cuda.cuh): a lane's units move forward through the row
  // (the map word state below relies on it); one 16-row group and activations from global
  // memory, as the global layout's policy measured best (benchmarks/README.md)
  static constexpr bool kContiguousSteps = true;
  static constexpr int kMaxRowGroups = 1;
  static constexpr int kStagedXMinRows = 9;
  static constexpr int kTableXMaxRows = 1;  // (one and two rows take the layout's own GEMV)
  static constexpr bool kLut = false;
  static constexpr bool kPairLoad = false;

  ConstBuffers q;
  // Per-row strides in 32 bits (gemm_cuda_supports: rows * K / 16 < 2^32 bounds every index).
  uint32_t K16, G, nb, mw, nt, n4_row, n4_full;
  int ushift, bshift;  // 16-value units per group = 2^ushift; scale_block = 2^bshift

  // A lane's position in its row's map: word wi (32 groups), the word and the next one (loaded a
  // word ahead), and the 4-bit groups of the row before word wi.
  struct RowState {
    uint32_t wi, word, next, n4w;
  };
  // The loaded registers only (weight_only_policy_cuda.cuh says why).
  struct Unit {
    uint32_t c;   // the codes word: 2-bit codes, or a 4-bit group's high bits
    uint32_t lo;  // a 4-bit group's low bits (0 for a 2-bit group)
    uint32_t s;   // the scales byte: sc | mc << 4, or a 4-bit group's sc
    uint32_t mc;  // a 4-bit group's mc4 byte
    uint32_t so;  // the second-order [d, dm] (fp16 bits): so's block, or so4's tile
    bool is4;
  };

  __device__ void init(Shared&) const {}

  __device__ RowState row_at(uint32_t m, uint32_t wi) const {
    const uint32_t* rm = q.map + size_t(m) * mw;
    uint32_t n = (wi / (kTileGroups / kMapBits)) * n4_full;
    for (uint32_t i = wi & ~uint32_t(kTileGroups / kMapBits - 1); i < wi; ++i) n += __popc(__ldg(rm + i));
    return {wi, __ldg(rm + wi), wi + 1 < mw ? __ldg(rm + wi + 1) : 0u, n};
  }
  __device__ RowState row(int64_t m, int64_t u0) const {
    const uint32_t wi = static_cast<uint32_t>(u0 >> ushift) / kMapBits;
    return row_at(static_cast<uint32_t>(m), wi < mw ? wi : mw - 1);  // a warp without steps: any word
  }

  __device__ Unit load(RowState& rs, int64_t m64, int64_t u64, bool valid) const {
    const uint32_t m = static_cast<uint32_t>(m64), u = static_cast<uint32_t>(u64);
    const uint32_t c = u >> ushift, sub = u & ((1u << ushift) - 1u), wi = c / kMapBits;
    if (wi == rs.wi + 1) {  // the next word: a tile's first word restarts the count
      rs.n4w = wi % (kTileGroups / kMapBits) ? rs.n4w + __popc(rs.word) : (wi / (kTileGroups / kMapBits)) * n4_full;
      rs.word = rs.next;
      rs.next = wi + 1 < mw ? __ldg(q.map + size_t(m) * mw + wi + 1) : 0u;
      rs.wi = wi;
    } else if (wi != rs.wi) {  // (not reached: a lane's units move forward a word at most per step)
      rs = row_at(m, wi);
    }
    const uint32_t b = c % kMapBits;
    Unit r;
    r.is4 = valid && n4_row > 0 && ((rs.word >> b) & 1u);
    r.c = __ldg(q.codes + size_t(m) * K16 + u);
    r.s = __ldg(q.scales + size_t(m) * G + c);
    const uint32_t* so = reinterpret_cast<const uint32_t*>(r.is4 ? q.so4 : q.so);
    r.so = __ldg(so + (r.is4 ? size_t(m) * nt + c / kTileGroups : size_t(m) * nb + (c >> bshift)));
    r.lo = 0u;
    r.mc = 0u;
    if (r.is4) {
      const uint32_t slot = rs.n4w + __popc(rs.word & ((1u << b) - 1u));
      const uint32_t j = m * n4_row + (slot < n4_row ? slot : n4_row - 1);
      r.lo = __ldg(q.lo + (size_t(j) << ushift) + sub);
      r.mc = __ldg(q.mc4 + j);
    }
    return r;
  }

  // float32 driver: w = v * scale - offset with s_eff = d16 * sc, m_eff = dm16 * mc (the format's
  // float32 products)
  __device__ float scale(const Unit& un) const {
    return fp16_bits_to_fp32(static_cast<uint16_t>(un.so)) * static_cast<float>(un.is4 ? un.s : un.s & 15u);
  }
  __device__ float offset(const Unit& un) const {
    return fp16_bits_to_fp32(static_cast<uint16_t>(un.so >> 16)) * static_cast<float>(un.is4 ? un.mc : un.s >> 4);
  }
  __device__ void decode8(const Shared&, const Unit& un, int j, float (&v)[8]) const {
    const uint32_t hi = spread2(un.c >> (16 * j)), lo = spread2(un.lo >> (16 * j));
    nibbles_lo_first(un.is4 ? (hi << 2) | lo : hi, kMagic, v);
  }

  // tensor-core driver: pairs (8j + i, 8j + i + 4), i = 0..3, as q * s_eff - m_eff in one HFMA2
  // (s_eff, m_eff rounded to the 16-bit type, as Mixed2Mma in mixed2bit_gemm_cuda.cu). A byte
  // permute puts the high fields of values 8j..8j+3 in the low half and 8j+4..8j+7 in the high
  // half; a 4-bit group's high fields are shifted up by 2 first and its low fields OR-ed in
  // (lo is 0 for a 2-bit group, whose fields keep the 2-bit mask).
  template <class Ops>
  __host__ __device__ static constexpr bool odd_x16() {
    return false;
  }
  template <class Ops>
  __device__ void pairs(const uint32_t (*)[32], int, const Unit& un, int j, uint32_t (&p)[4]) const {
    const uint32_t sc = un.is4 ? un.s : un.s & 15u, mc = un.is4 ? un.mc : un.s >> 4;
    const float s = fp16_bits_to_fp32(static_cast<uint16_t>(un.so)) * static_cast<float>(sc);
    const float mo = fp16_bits_to_fp32(static_cast<uint16_t>(un.so >> 16)) * static_cast<float>(mc);
    const uint32_t s2 = Ops::splat(s), nm2 = Ops::splat(-mo);
    const uint32_t sel = j ? 0x3322u : 0x1100u;
    const uint32_t hw = __byte_perm(un.c, 0u, sel) << (un.is4 ? 2 : 0), lw = __byte_perm(un.lo, 0u, sel);
    const uint32_t hmask = un.is4 ? 0x000C000Cu : 0x00030003u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t v =
          gemm::cuda_wo::and_or(hw >> (2 * i), hmask, gemm::cuda_wo::and_or(lw >> (2 * i), 0x00030003u, Ops::kMagic));
      p[i] = Ops::fma(Ops::sub(v, Ops::kMagic), s2, nm2);
    }
  }
  static __device__ uint32_t xpair(const uint32_t (&x)[16], int p) { return xpair_lo_first(x, p); }
};

}  // namespace

template <class T>
void gemm_cuda(const T* X, int64_t N, const ConstBuffers& q, const Dims& d, T* Y, const T* bias, void* stream) {
  check_dims(d);
  if (!gemm_cuda_supports(d))
    throw std::invalid_argument(
        "mixed2bit tiled CUDA GEMM: needs group_size = 16 * 2^j <= 512 and fewer than 2^32 "
        "units of 16 values");
  if ((reinterpret_cast<uintptr_t>(q.so) & 3u) || (reinterpret_cast<uintptr_t>(q.so4) & 3u))
    throw std::invalid_argument("mixed2bit tiled CUDA GEMM: so and so4 must be 4-byte aligned");
  if (N <= 0 || d.rows <= 0 || d.K <= 0) return;
  const TiledPolicy f{q,
                      static_cast<uint32_t>(d.K / kCodes2PerWord),
                      static_cast<uint32_t>(d.groups_per_row()),
                      static_cast<uint32_t>(d.blocks_per_row()),
                      static_cast<uint32_t>(d.map_words()),
                      static_cast<uint32_t>(d.tiles_per_row()),
                      static_cast<uint32_t>(d.n4_row()),
                      static_cast<uint32_t>(d.n4_full),
                      gemm::log2_exact(d.words_per_group()),
                      gemm::log2_exact(d.scale_block)};
  if constexpr (!std::is_same_v<T, float>) {
    if (cuda::has_sm80_mma()) {
      if (gemv::supports(q, d, N)) return gemv::launch(q, d, X, N, Y, bias, stream);
      return gemm::cuda_wo::launch_weight_only_mma(f, X, N, d.K, d.rows, Y, bias, stream);
    }
  }
  gemm::cuda_wo::launch_weight_only(f, X, N, d.K, d.rows, Y, bias, stream);
}

#define QF_INSTANTIATE(T) \
  template void gemm_cuda<T>(const T*, int64_t, const ConstBuffers&, const Dims&, T*, const T*, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::mixed2bit::tiled
