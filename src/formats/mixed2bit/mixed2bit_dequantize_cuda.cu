// mixed2bit CUDA dequantize: mixed2bit.h's decode as a short pipeline of kernels on one stream,
// asynchronous (shared helpers: mixed2bit_cuda_common.cuh), its workspace layout and the host
// driver.
//
// Dequantize (asynchronous):
//   counts    CTA/16 tiles                map popcount per tile, prefix within the CTA; the last
//             CTA scans the CTA sums and checks popcount == n4; outlier_idx increasing, in range
//   decode    CTA/1024 groups             warp ballots of the map bits -> each group's slot;
//                                         decode_group in float32 (2-bit codes widened to nibbles:
//                                         one code path), rounded once to T, staged per warp in
//                                         shared memory and written with 16-byte stores (all-NaN if
//                                         the check failed)
//   outliers  thread/outlier              y[idx] = float(val) rounded to T
#include <cstdint>

#include "formats/mixed2bit/mixed2bit_cuda_common.cuh"

namespace qf::mixed2bit {
namespace {

__device__ __forceinline__ unsigned map_bit(const uint8_t* map, int64_t g) { return (map[g >> 3] >> (g & 7)) & 1u; }

// Map popcount per tile (a warp's 32 bytes), local[t] = the sum over the CTA's earlier tiles,
// cta_sum scanned by the last CTA, which checks the total against n4. Also the CPU's outlier
// checks: outlier_idx strictly increasing and in range. Any failure sets kFlagBad.
__global__ void
__launch_bounds__(kThreads)
map_count_kernel(const uint8_t* __restrict__ map, int64_t ng, int64_t n_tiles, int64_t n4,
                 const int32_t* __restrict__ idx, int64_t n_out, int64_t numel, uint32_t* ctl,
                 uint32_t* __restrict__ local, uint32_t* __restrict__ cta_sum) {
  constexpr int kBytesPerTile = kTile / 8;  // 32: one warp
  __shared__ uint32_t tc[kTilesPerCta];
  const int64_t map_bytes = (ng + 7) / 8;
  const int64_t b0 = int64_t(blockIdx.x) * kTilesPerCta * kBytesPerTile;
#pragma unroll
  for (int it = 0; it < kTilesPerCta * kBytesPerTile / kThreads; ++it) {
    const int64_t byte = b0 + it * kThreads + threadIdx.x;
    uint32_t c = 0;
    if (byte < map_bytes) {
      uint32_t v = map[byte];
      if (byte == map_bytes - 1 && (ng & 7)) v &= (1u << (ng & 7)) - 1u;  // padding bits are not counted
      c = __popc(v);
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) c += __shfl_xor_sync(kFull, c, o);
    if (lane_id() == 0) tc[it * kWarps + warp_id()] = c;
  }
  __syncthreads();
  const int64_t t0 = int64_t(blockIdx.x) * kTilesPerCta;
  if (threadIdx.x < 32) {
    const uint32_t v = threadIdx.x < kTilesPerCta ? tc[threadIdx.x] : 0u;
    const uint32_t incl = cu::warp_inclusive_sum(v);
    if (threadIdx.x < kTilesPerCta && t0 + threadIdx.x < n_tiles) local[t0 + threadIdx.x] = incl - v;
    if (threadIdx.x == 31) cta_sum[blockIdx.x] = incl;
  }
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n_out; i += stride) {
    const int64_t v = idx[i];
    if (v < 0 || v >= numel || (i > 0 && v <= int64_t(idx[i - 1]))) ctl[kFlagBad] = 1u;
  }
  if (!cta_is_last(ctl + kDone1)) return;
  const uint32_t total = cta_scan_in_place(cta_sum, int64_t(gridDim.x));
  if (threadIdx.x == 0 && int64_t(total) != n4) ctl[kFlagBad] = 1u;
}

// group_params with the block index from DivB.
__device__ __forceinline__ void slot_params(const ConstBuffers& q, bool four, int64_t j, DivB B, float* s_eff,
                                            float* m_eff) {
  const int64_t b = B.div(j);
  if (four) {
    *s_eff = effective(q.so4[2 * b].bits, q.scales4[2 * j]);
    *m_eff = effective(q.so4[2 * b + 1].bits, q.scales4[2 * j + 1]);
  } else {
    const uint8_t codes = q.scales2[j];
    *s_eff = effective(q.so2[2 * b].bits, codes & 0x0F);
    *m_eff = effective(q.so2[2 * b + 1].bits, codes >> 4);
  }
}

// A CTA per 1024 groups (4 per thread; each warp 128 consecutive ones, 32 at a time). GS = 16:
// each warp stages its 32 groups' 512 outputs in shared memory and writes them with 16-byte
// stores (a thread's 16 values are contiguous, so direct stores would be strided across the
// warp); GS = 0 (other group sizes) stores directly. All of a thread's loads are issued before
// any decoding, and 2-bit and 4-bit groups share one code path (2-bit codes widened to nibbles).
constexpr int kDecPer = 4;
constexpr int kDecGroups = kThreads * kDecPer;
template <int GS, class T>
__global__ void __launch_bounds__(kThreads)
decode_kernel(ConstBuffers q, int64_t ng, int gs, DivB B, const uint32_t* __restrict__ local,
              const uint32_t* __restrict__ cta_off, const uint32_t* __restrict__ ctl, T* __restrict__ y, bool vec) {
  __shared__ uint32_t warp_counts[kWarps];
  const int64_t first = int64_t(blockIdx.x) * kDecGroups;
  const int64_t tile = first / kTile;
  const uint32_t base = local[tile] + cta_off[tile / kTilesPerCta];  // 4-bit groups before the CTA's
  const bool bad = ctl[kFlagBad] != 0;  // inconsistent buffers: all NaN, no index is trusted
  const int64_t wfirst = first + int64_t(warp_id()) * 32 * kDecPer;
  uint32_t bit[kDecPer], rank[kDecPer], run = 0;
#pragma unroll
  for (int i = 0; i < kDecPer; ++i) {
    const int64_t g = wfirst + 32 * i + lane_id();
    bit[i] = map_bit(q.group_map, g < ng ? g : ng - 1) & (g < ng ? 1u : 0u);  // unconditional load
  }
#pragma unroll
  for (int i = 0; i < kDecPer; ++i) {
    const unsigned bal = __ballot_sync(kFull, bit[i] != 0);
    rank[i] = run + __popc(bal & lanes_below());
    run += __popc(bal);
  }
  if (lane_id() == 0) warp_counts[warp_id()] = run;
  __syncthreads();
  uint32_t wbefore = base;
#pragma unroll
  for (int i = 0; i < kWarps; ++i)
    if (i < warp_id()) wbefore += warp_counts[i];
  const int words2 = gs / kCodes2PerWord, words4 = gs / kCodes4PerWord;
  T nan_t;
  from_f32(f32_from_bits(0x7FC00000u), &nan_t);
  if constexpr (GS > 0) {
    static_assert(GS == 16, "the staged path is for 16-value groups");
    __shared__ __align__(16) T stage[kWarps][32 * 16];
    float s_eff[kDecPer], m_eff[kDecPer];
    uint32_t lo[kDecPer], hi[kDecPer];
    // slot_params and the codes, with every load unconditional (a load behind a branch waits for
    // the earlier ones): groups past the end or of inconsistent buffers read the control words.
    const uint32_t* dummy = ctl;
#pragma unroll
    for (int i = 0; i < kDecPer; ++i) {
      const int64_t g = wfirst + 32 * i + lane_id();
      const bool ok = g < ng && !bad, four = bit[i] != 0;
      const int64_t i4 = int64_t(wbefore) + rank[i];  // 4-bit groups before g
      const int64_t j = four ? i4 : g - i4;            // slot in g's list
      const int64_t b = B.div(j);
      const uint32_t* cp = !ok ? dummy : four ? q.codes4 + 2 * j : q.codes2 + j;
      const uint32_t* hp = ok && four ? cp + 1 : dummy;
      const uint8_t* sp = !ok ? reinterpret_cast<const uint8_t*>(dummy) : four ? q.scales4 + 2 * j : q.scales2 + j;
      const uint8_t* mp = ok && four ? sp + 1 : sp;
      const half_t* op = !ok ? reinterpret_cast<const half_t*>(dummy) : (four ? q.so4 : q.so2) + 2 * b;
      lo[i] = cp[0];
      hi[i] = four ? hp[0] : 0u;
      const uint8_t c0 = sp[0], c1 = mp[0];
      const uint16_t d = op[0].bits, dm = op[1].bits;
      // group_params
      s_eff[i] = effective(d, four ? c0 : c0 & 0x0F);
      m_eff[i] = effective(dm, four ? c1 : c0 >> 4);
    }
    T* ws = stage[warp_id()];
#pragma unroll
    for (int i = 0; i < kDecPer; ++i) {
      const int64_t g0 = wfirst + 32 * i;  // the warp's 32 groups this round
      if (g0 >= ng) break;
      if (g0 + lane_id() < ng) {
        T o[16];
        if (bad) {
#pragma unroll
          for (int e = 0; e < 16; ++e) o[e] = nan_t;
        } else {
          const uint32_t a = bit[i] ? lo[i] : nibbles_of_2bit(lo[i]);
          const uint32_t b = bit[i] ? hi[i] : nibbles_of_2bit(lo[i] >> 16);
          decode16(a, b, s_eff[i], m_eff[i], o);
        }
        cu::store_run(ws + 16 * lane_id(), o, true);
      }
      __syncwarp();
      const int groups = ng - g0 < 32 ? static_cast<int>(ng - g0) : 32;
      T* dst = y + g0 * 16;
      if (vec) {
        const int n16 = groups * 16 * static_cast<int>(sizeof(T)) / 16;
        for (int e = lane_id(); e < n16; e += 32)
          reinterpret_cast<uint4*>(dst)[e] = reinterpret_cast<const uint4*>(ws)[e];
      } else {
        for (int e = lane_id(); e < groups * 16; e += 32) dst[e] = ws[e];
      }
      __syncwarp();
    }
  } else {
#pragma unroll
    for (int i = 0; i < kDecPer; ++i) {
      const int64_t g = wfirst + 32 * i + lane_id();
      if (g >= ng) continue;
      T* out = y + g * gs;
      const int64_t i4 = int64_t(wbefore) + rank[i];
      const int64_t j = bit[i] ? i4 : g - i4;
      float s_eff = 0.0f, m_eff = 0.0f;
      if (!bad) slot_params(q, bit[i] != 0, j, B, &s_eff, &m_eff);
      for (int c = 0; c < gs / 16; ++c) {
        T o[16];
        if (bad) {
#pragma unroll
          for (int e = 0; e < 16; ++e) o[e] = nan_t;
        } else if (bit[i]) {
          decode16(q.codes4[j * words4 + 2 * c], q.codes4[j * words4 + 2 * c + 1], s_eff, m_eff, o);
        } else {
          const uint32_t c2 = q.codes2[j * words2 + c];
          decode16(nibbles_of_2bit(c2), nibbles_of_2bit(c2 >> 16), s_eff, m_eff, o);
        }
        cu::store_run(out + 16 * c, o, vec);
      }
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
outlier_write_kernel(const int32_t* __restrict__ idx, const half_t* __restrict__ val, int64_t n_out,
                     const uint32_t* __restrict__ ctl, T* __restrict__ y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_out || ctl[kFlagBad]) return;
  from_f32(fp16_bits_to_fp32(val[i].bits), y + idx[i]);
}

struct DequantizeLayout {
  int64_t ctl = 0, local = 0, cta = 0;
  int64_t total = 0;
};

DequantizeLayout dequantize_layout(const Dims& d) {
  DequantizeLayout L;
  const int64_t ng = d.n_groups();
  if (ng == 0) return L;
  const int64_t n_tiles = n_tiles_of(d);
  Carver c;
  L.ctl = c.take(sizeof(uint32_t) * kCtlWordsDequantize);
  L.local = c.take(4 * n_tiles);
  L.cta = c.take(4 * n_count_ctas(n_tiles));
  L.total = c.off + kAlign;
  return L;
}

}  // namespace

int64_t dequantize_workspace_bytes_cuda(const Dims& dims) {
  check_cuda_dims(dims);
  return dequantize_layout(dims).total;
}

template <class T>
void dequantize_cuda(const ConstBuffers& q, const Dims& d, T* y, void* workspace, int64_t workspace_bytes,
                     void* stream) {
  check_cuda_dims(d);
  const int64_t ng = d.n_groups();
  if (ng == 0) return;
  const DequantizeLayout L = dequantize_layout(d);
  uint8_t* base = workspace_base(workspace, workspace_bytes, L.total);
  auto* ctl = reinterpret_cast<uint32_t*>(base + L.ctl);
  auto* local = reinterpret_cast<uint32_t*>(base + L.local);
  auto* cta = reinterpret_cast<uint32_t*>(base + L.cta);
  const cudaStream_t s = cu::stream(stream);
  const int64_t n_tiles = n_tiles_of(d);

  cu::check(cudaMemsetAsync(ctl, 0, sizeof(uint32_t) * kCtlWordsDequantize, s), "mixed2bit: clear flags");
  map_count_kernel<<<cu::grid_for(n_tiles, kTilesPerCta), kThreads, 0, s>>>(
      q.group_map, ng, n_tiles, d.n4, q.outlier_idx, d.n_out, d.rows * d.K, ctl, local, cta);
  cu::check_launch("mixed2bit map count kernel");
  const int gs = static_cast<int>(d.group_size);
  const bool vec = cu::aligned16(y);
  const DivB B = make_div(d.scale_block);
  if (gs == 16)
    decode_kernel<16, T><<<cu::grid_for(ng, kDecGroups), kThreads, 0, s>>>(q, ng, gs, B, local, cta, ctl, y, vec);
  else
    decode_kernel<0, T><<<cu::grid_for(ng, kDecGroups), kThreads, 0, s>>>(q, ng, gs, B, local, cta, ctl, y, vec);
  cu::check_launch("mixed2bit decode kernel");
  if (d.n_out > 0) {
    outlier_write_kernel<T><<<cu::grid_for(d.n_out, kThreads), kThreads, 0, s>>>(q.outlier_idx, q.outlier_val,
                                                                               d.n_out, ctl, y);
    cu::check_launch("mixed2bit outlier write kernel");
  }
}

#define QF_INSTANTIATE(T) \
  template void dequantize_cuda<T>(const ConstBuffers&, const Dims&, T*, void*, int64_t, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::mixed2bit
