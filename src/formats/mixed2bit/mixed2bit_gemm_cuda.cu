// mixed2bit's weight-only GEMM on the GPU (declared in formats/mixed2bit/mixed2bit_gemm_cuda.h):
// the chunk index it reads, and two policies of the shared drivers (gemm/weight_only_policy_cuda.cuh)
// that load and decode a unit of one weight row to the values of mixed2bit's dequantize
// (mixed2bit.h), split as w = v * scale - offset: one for the float32 kernel, one for the
// tensor-core kernel.
#include <stdexcept>
#include <type_traits>

#include "formats/mixed2bit/mixed2bit.h"
#include "formats/mixed2bit/mixed2bit_gemm_cuda.h"
#include "gemm/weight_only_policy_cuda.cuh"

namespace qf::gemm {
namespace {

using cuda_wo::hi_hi;
using cuda_wo::kMagic;
using cuda_wo::lo_lo;
using cuda_wo::magic_u4;
using cuda_wo::nibbles_lo_first;
using cuda_wo::NoShared;
using cuda_wo::spread2;
using cuda_wo::word_of;
using cuda_wo::xpair_lo_first;

// 4-bit groups before group b (0..31) of a chunk, from the chunk's index entry (the count before
// the chunk in the low half, the chunk's map bits in the high half; mixed2bit_gemm_cuda.h).
__device__ __forceinline__ uint32_t fours_before(uint64_t entry, uint32_t b) {
  return static_cast<uint32_t>(entry) + __popc(static_cast<uint32_t>(entry >> 32) & ((1u << b) - 1u));
}

// mixed2bit (formats/mixed2bit) on the float32 kernel: a unit is 16 values of one group (one
// codes2 word or two codes4 words); group_size = 16 * 2^ushift <= 512 so a warp's 32 units hold
// whole groups, and scale_block = 2^bshift. A lane finds its group's slot in the 2-bit or 4-bit
// list from the row's running counts plus a vote over the group starts of this warp step (the
// paper's per-row offsets); the counts start from the chunk index (mixed2bit_gemm_cuda.h).
// w = q * s_eff - m_eff.
struct Mixed2 {
  static constexpr int kUnit = 16;
  static constexpr bool kOffset = true;
  mixed2bit::ConstBuffers q;
  const uint64_t* index;  // mixed2bit_row_index_cuda's chunk index
  int64_t G, C;           // groups and chunks per row
  int ushift, bshift;
  using Shared = NoShared;
  struct RowState {
    int64_t n4, n2;  // 4-bit / 2-bit groups before the current warp step
    uint32_t map;    // the group_map byte of this lane's group at the next load (read a step early)
  };
  // The loaded registers only (see gemm/weight_only_policy_cuda.cuh): codes, scale codes and second-order scales.
  struct Unit {
    uint32_t c0, c1;  // 4-bit: the unit's two codes4 words; 2-bit: c0 = its codes2 word
    uint32_t s0, s1;  // 4-bit: the scale and min codes (scales4); 2-bit: s0 = the packed scales2 byte
    uint32_t d, dm;   // fp16 bits of the second-order block's scale and min scale
    bool is4;
  };
  __device__ void init(Shared&) const {}
  __device__ uint32_t map_byte(int64_t m, int64_t u) const {
    const int64_t g = m * G + (u >> ushift);
    return u < (G << ushift) ? __ldg(q.group_map + (g >> 3)) : 0u;
  }
  __device__ RowState row(int64_t m, int64_t u0) const {
    const int64_t gb = u0 >> ushift;  // groups before u0 (u0 is a multiple of 32 >= a group's units)
    const int64_t n4 = fours_before(__ldg(index + m * C + (gb >> 5)), static_cast<uint32_t>(gb & 31));
    return {n4, m * G + gb - n4, map_byte(m, u0 + (threadIdx.x & 31))};
  }
  __device__ Unit load(RowState& rs, int64_t m, int64_t u, bool valid) const {
    const int sub = static_cast<int>(u & ((1 << ushift) - 1));
    const int64_t g = m * G + (u >> ushift);
    const bool start = valid && sub == 0;
    const bool is4 = valid && ((rs.map >> (g & 7)) & 1u);
    // The map byte for this lane's unit of the next step (lanes past the end got u0 = u & ~31).
    rs.map = map_byte(m, (u & ~int64_t(31)) + (threadIdx.x & 31) + 32);
    const uint32_t m4 = __ballot_sync(0xFFFFFFFFu, start && is4);
    const uint32_t m2 = __ballot_sync(0xFFFFFFFFu, start && !is4);
    const uint32_t before = (1u << ((threadIdx.x & 31) - sub)) - 1u;  // group starts before ours
    const int64_t i4 = rs.n4 + __popc(m4 & before), i2 = rs.n2 + __popc(m2 & before);
    rs.n4 += __popc(m4);
    rs.n2 += __popc(m2);
    Unit r{0u, 0u, 0u, 0u, 0u, 0u, false};  // decodes to 0 with scale and offset 0
    if (!valid) return r;
    r.is4 = is4;
    const half_t* so;  // [d, dm] of the group's second-order block
    if (is4) {
      const uint32_t* c = q.codes4 + ((i4 << ushift) + sub) * 2;
      r.c0 = __ldg(c);
      r.c1 = __ldg(c + 1);
      r.s0 = __ldg(q.scales4 + 2 * i4);
      r.s1 = __ldg(q.scales4 + 2 * i4 + 1);
      so = q.so4 + 2 * (i4 >> bshift);
    } else {
      r.c0 = __ldg(q.codes2 + (i2 << ushift) + sub);
      r.s0 = __ldg(q.scales2 + i2);
      so = q.so2 + 2 * (i2 >> bshift);
    }
    r.d = __ldg(&so[0].bits);
    r.dm = __ldg(&so[1].bits);
    return r;
  }
  // s_eff = d16 * sc, m_eff = dm16 * mc: the format's float32 products
  __device__ float scale(const Unit& un) const {
    return fp16_bits_to_fp32(static_cast<uint16_t>(un.d)) * static_cast<float>(un.is4 ? un.s0 : un.s0 & 15u);
  }
  __device__ float offset(const Unit& un) const {
    return fp16_bits_to_fp32(static_cast<uint16_t>(un.dm)) * static_cast<float>(un.is4 ? un.s1 : un.s0 >> 4);
  }
  __device__ void decode8(const Shared&, const Unit& un, int j, float (&v)[8]) const {
    const uint32_t w = un.is4 ? (j == 0 ? un.c0 : un.c1) : spread2(j == 0 ? un.c0 : un.c0 >> 16);
    nibbles_lo_first(w, kMagic, v);
  }
};

// mixed2bit on the tensor-core kernel (16-bit activations, sm_80+). A lane's unit is 16 values
// of one group; warps take contiguous runs of K, so a lane's units only move forward and its
// chunk-index entry (the 4-bit count before the chunk and the chunk's 32 map bits) changes once
// per 32 groups, with the next entry loaded a chunk ahead: each unit then finds its slot in the
// 2-bit or 4-bit list with a popcount, no vote and no dependent load. Both kinds decode the same
// way: a byte permute puts the unit's fields for values (8j + i, 8j + i + 4) at bits (s i, 16 +
// s i) of one word (s = 4 for codes4, 2 for codes2; i = 0..3), a LOP3 ORs each pair into the
// magic, HSUB2 takes the magic away exactly, and HFMA2 gives q * s_eff - m_eff rounded once to
// the 16-bit type (as dequantize followed by F.linear would round it, up to the fp16 rounding of
// s_eff and m_eff).
struct Mixed2Mma {
  static constexpr int kUnit = 16;
  static constexpr bool kLut = false;
  static constexpr bool kPairLoad = false;
  static constexpr bool kContiguousSteps = true;
  static constexpr int kMaxRowGroups = 1;    // more measured slower (benchmarks/README.md, "Row groups")
  static constexpr int kStagedXMinRows = 9;  // benchmarks/README.md, "Activations through shared memory"
  static constexpr int kTableXMaxRows = 1;   // two measured no faster (benchmarks/README.md)
  mixed2bit::ConstBuffers q;
  const uint64_t* index;
  int64_t G, C;
  int ushift, bshift;
  // Index arithmetic in 32 bits: mixed2bit_gemm_cuda_supports keeps rows * K / 16 below 2^32.
  struct RowState {
    const uint64_t* entries;  // the row's chunk entries
    uint32_t g0, chunk;       // the row's first group id; the chunk of cur
    uint64_t cur, next;       // entries of chunks `chunk` and chunk + 1
  };
  struct Unit {
    uint32_t c0, c1;  // 4-bit: the two codes4 words; 2-bit: c0 = the codes2 word, c1 = 0
    uint32_t sc;      // 4-bit: scales4's [sc, mc] as a halfword; 2-bit: the scales2 byte
    uint32_t so;      // the second-order [d, dm] (fp16 bits)
    bool is4;
  };
  __device__ RowState row(int64_t m, int64_t u0) const {
    uint32_t ch = static_cast<uint32_t>((u0 >> ushift) >> 5);
    ch =
        ch < C ? ch : static_cast<uint32_t>(C - 1);  // a warp without steps: any entry (ch + 1 <= C stays in the index)
    const uint64_t* e = index + m * C;
    return {e, static_cast<uint32_t>(m * G), ch, __ldg(e + ch), __ldg(e + ch + 1)};
  }
  __device__ Unit load(RowState& rs, int64_t, int64_t u64, bool) const {
    const uint32_t u = static_cast<uint32_t>(u64), c = u >> ushift, ch = c >> 5;
    if (ch != rs.chunk) {  // forward by one chunk (the steps of a warp are contiguous and chunk-aligned)
      rs.cur = rs.next;
      rs.next = __ldg(rs.entries + ch + 1);
      rs.chunk = ch;
    }
    const uint32_t b = c & 31u, i4 = fours_before(rs.cur, b), i2 = rs.g0 + c - i4;  // 4-/2-bit groups before
    Unit r;
    r.is4 = (rs.cur >> (32 + b)) & 1u;
    const uint32_t i = r.is4 ? i4 : i2, w = (i << ushift) + (u & ((1u << ushift) - 1u));  // group; its unit's word
    // Branch-free: one address per array, the second codes word and scale byte only for 4-bit.
    const uint32_t* cp = r.is4 ? q.codes4 + 2 * size_t(w) : q.codes2 + w;
    r.c0 = __ldg(cp);
    r.c1 = r.is4 ? __ldg(cp + 1) : 0u;
    const uint8_t* sp = r.is4 ? q.scales4 + 2 * size_t(i) : q.scales2 + i;
    r.sc = r.is4 ? uint32_t(__ldg(reinterpret_cast<const uint16_t*>(sp))) : uint32_t(__ldg(sp));
    r.so = __ldg(reinterpret_cast<const uint32_t*>(r.is4 ? q.so4 : q.so2) + (i >> bshift));
    return r;
  }
  template <class Ops>
  __host__ __device__ static constexpr bool odd_x16() {
    return false;
  }
  template <class Ops>
  __device__ void pairs(const uint32_t (*)[32], int, const Unit& un, int j, uint32_t (&p)[4]) const {
    // s_eff = d16 * sc and m_eff = dm16 * mc in float32, as the format computes them
    const uint32_t sc = un.is4 ? un.sc & 0xFFu : un.sc & 15u, mc = un.is4 ? un.sc >> 8 : (un.sc >> 4) & 15u;
    const float s = fp16_bits_to_fp32(static_cast<uint16_t>(un.so)) * static_cast<float>(sc);
    const float mo = fp16_bits_to_fp32(static_cast<uint16_t>(un.so >> 16)) * static_cast<float>(mc);
    const uint32_t s2 = Ops::splat(s), nm2 = Ops::splat(-mo);
    // codes4: word j as it is; codes2: bytes 2j, 2j + 1 (values 8j..8j+3, 8j+4..8j+7) to bytes 0, 2
    const uint32_t w = __byte_perm(un.c0, un.c1, un.is4 ? (j ? 0x7654u : 0x3210u) : (j ? 0x3322u : 0x1100u));
    const int sh = un.is4 ? 4 : 2;
    const uint32_t mask = un.is4 ? 0x000F000Fu : 0x00030003u;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      p[i] = Ops::fma(Ops::sub(cuda_wo::and_or(w >> (sh * i), mask, Ops::kMagic), Ops::kMagic), s2, nm2);
  }
  static __device__ uint32_t xpair(const uint32_t (&x)[16], int p) { return xpair_lo_first(x, p); }
};

// One warp per row: each chunk's 32 map bits by a vote, and their count in the low half (the
// scan below turns the counts into the exclusive prefix). The last warp writes the final entry.
__global__ void chunk_bits_kernel(const uint8_t* __restrict__ map, int64_t rows, int64_t G, int64_t C,
                                  uint64_t* __restrict__ out) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t i = 32 * c + lane, g = r * G + i;
    const bool bit = i < G && ((__ldg(map + (g >> 3)) >> (g & 7)) & 1u);
    const uint32_t bits = __ballot_sync(0xFFFFFFFFu, bit);
    if (lane == 0) out[r * C + c] = uint64_t(__popc(bits)) | uint64_t(bits) << 32;
  }
  if (r == rows - 1 && lane == 0) out[rows * C] = 0;
}

// In-place exclusive scan of the low 32 bits of out[0 .. n) (the high halves kept) by one CTA of
// 1024 threads: each thread scans a contiguous run, after a Hillis-Steele scan of the run totals.
__global__ void
__launch_bounds__(1024) scan_low_kernel(uint64_t* __restrict__ out, int64_t n) {
  __shared__ uint64_t part[1024];
  const int64_t per = (n + 1023) / 1024, i0 = threadIdx.x * per, i1 = i0 + per < n ? i0 + per : n;
  uint64_t s = 0;
  for (int64_t i = i0; i < i1; ++i) s += out[i] & 0xFFFFFFFFu;
  part[threadIdx.x] = s;
  __syncthreads();
  for (int o = 1; o < 1024; o <<= 1) {
    const uint64_t v = threadIdx.x >= o ? part[threadIdx.x - o] : 0;
    __syncthreads();
    part[threadIdx.x] += v;
    __syncthreads();
  }
  s = threadIdx.x ? part[threadIdx.x - 1] : 0;  // total before this thread's run
  for (int64_t i = i0; i < i1; ++i) {
    const uint64_t v = out[i];
    out[i] = (v & 0xFFFFFFFF00000000ull) | s;  // s < 2^32: the GEMM takes fewer than 2^32 groups
    s += v & 0xFFFFFFFFu;
  }
}

}  // namespace

void mixed2bit_row_index_cuda(const uint8_t* group_map, int64_t rows, int64_t G, uint64_t* index, void* stream) {
  cudaStream_t s = cuda::stream(stream);
  const int64_t C = (G + 31) / 32, n = mixed2bit_chunk_index_size(rows, G);
  if (rows > 0 && C > 0) chunk_bits_kernel<<<cuda::grid_for(rows, 8), 256, 0, s>>>(group_map, rows, G, C, index);
  else cuda::check(cudaMemsetAsync(index, 0, sizeof(uint64_t) * n, s), "mixed2bit chunk index");
  scan_low_kernel<<<1, 1024, 0, s>>>(index, n);
  cuda::check_launch("mixed2bit chunk index");
}

template <class T>
void mixed2bit_gemm_cuda(const T* X, int64_t N, const mixed2bit::ConstBuffers& q, const mixed2bit::Dims& d,
                         const uint64_t* index, T* Y, const T* bias, void* stream) {
  if (!mixed2bit_gemm_cuda_supports(d))
    throw std::invalid_argument("mixed2bit CUDA GEMM: needs group_size = 16 * 2^j <= 512, a power-of-two "
                                "scale_block, no outliers and fewer than 2^32 units of 16 values");
  const int64_t G = d.groups_per_row(), C = (G + 31) / 32;
  const int us = log2_exact(d.group_size / 16), bs = log2_exact(d.scale_block);
  if constexpr (!std::is_same_v<T, float>) {
    // the tensor-core policy reads scales4 as halfwords and so2 / so4 as words
    const bool aligned = (reinterpret_cast<uintptr_t>(q.scales4) & 1u) == 0 &&
                         (reinterpret_cast<uintptr_t>(q.so2) & 3u) == 0 && (reinterpret_cast<uintptr_t>(q.so4) & 3u) == 0;
    if (aligned && cuda::has_sm80_mma())
      return cuda_wo::launch_weight_only_mma(Mixed2Mma{q, index, G, C, us, bs}, X, N, d.K, d.rows, Y, bias, stream);
  }
  cuda_wo::launch_weight_only(Mixed2{q, index, G, C, us, bs}, X, N, d.K, d.rows, Y, bias, stream);
}

#define QF_INSTANTIATE(T) \
  template void mixed2bit_gemm_cuda<T>(const T*, int64_t, const mixed2bit::ConstBuffers&, const mixed2bit::Dims&, const uint64_t*, T*, const T*, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::gemm
