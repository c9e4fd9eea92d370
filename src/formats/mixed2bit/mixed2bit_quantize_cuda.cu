// mixed2bit CUDA quantize: the steps of mixed2bit.h as a short pipeline of kernels on one stream
// (kernels: mixed2bit_select_cuda.cuh, mixed2bit_outliers_cuda.cuh; shared helpers:
// mixed2bit_cuda_common.cuh), its workspace layout and the host driver.
//
// Groups are handled in tiles of 256 (one CTA of 256 threads, a thread per group). A group's
// selection key is ~score_order_key(score): the n4 smallest keys, ties to the smaller id, are the
// 4-bit groups. The threshold key K* and the number need3 of ties (key == K*) taken are found by
// a radix select of 11 + 11 + 10 bits; then g is 4-bit iff key < K*, or key == K* and fewer than
// need3 ties come before it. Per-tile counts of (key < K*, key == K*) and their prefix over the
// tiles give every group its slot in its list without materializing any per-group array.
//
// Quantize (n = n_groups; scratch in the caller's workspace, one memset of a 21 KB header):
//   stats     grid-stride, thread/group   w -> min/max per group (rm, in T's precision: exact),
//             [key]; NaN score -> flag; histogram of the key's top 11 bits; the last CTA picks
//             the first digit (or settles n4 = 0 / n4 = n); zeroes the block maxima
//   select x2 grid-stride                 histograms of the next 11 and 10 bits among the keys
//             that match the digits so far; the last CTA picks the digit -> K*, need3
//   counts    CTA/16 tiles                per-tile (less, tie) counts and their prefix within the
//             CTA; the last CTA scans the CTA sums
//   -- only with outliers (element-wise, 64-bit radix select) --
//   mark      CTA/tile                    is4[g]
//   okeys, select x8, omark, scan (CUB), oscatter, ogroups (rm again for the groups with outliers)
//   --
//   place     CTA/2048 groups             slot[g] (g's index in its list), group_map (warp
//             ballots), step 5's maxima per second-order block from the groups' range and m
//             staged in list order: so2/so4 for the blocks inside the CTA, atomicMax into bmax
//             for the (at most 4) blocks it shares with a neighbour
//   finish    thread/shared block         so2/so4 of the shared blocks from bmax
//   encode    thread/group                w, slot, map bit, rm, so -> scales and codes (steps 5 +
//             6; the codes by a multiply with an exact-division fallback near k + 1/2)
//   then one 16-byte device-to-host copy of the flags and a stream synchronization.
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "formats/mixed2bit/mixed2bit_cuda_common.cuh"
#include "formats/mixed2bit/mixed2bit_outliers_cuda.cuh"
#include "formats/mixed2bit/mixed2bit_select_cuda.cuh"

namespace qf::mixed2bit {
namespace {

// Temporary bytes of CUB's exclusive sum over n uint32 (the size depends on n and the types
// only, not on the pointers or on whether the scan is in place).
size_t scan_temp_bytes(int64_t n) {
  size_t bytes = 0;
  uint32_t* p = nullptr;
  cu::check(cub::DeviceScan::ExclusiveSum(nullptr, bytes, p, p, n), "mixed2bit: scan size");
  return bytes;
}

// out = exclusive prefix sum of in (n items; in == out allowed), with `capacity` bytes of
// temporary storage at tmp (checked against CUB's own size query).
void exclusive_sum(void* tmp, size_t capacity, uint32_t* in, uint32_t* out, int64_t n, cudaStream_t s,
                   const char* what) {
  size_t bytes = 0;
  cu::check(cub::DeviceScan::ExclusiveSum(nullptr, bytes, in, out, n, s), what);
  if (bytes > capacity) throw std::runtime_error(std::string(what) + ": scan workspace too small");
  cu::check(cub::DeviceScan::ExclusiveSum(tmp, bytes, in, out, n, s), what);
}

struct QuantizeLayout {
  int64_t ctl = 0, key = 0, rm = 0, slot = 0, local = 0, cta = 0, bmax = 0, bnd = 0;
  int64_t state = 0, hist = 0, is4 = 0, okey = 0, opos = 0, scan = 0;  // outliers only
  size_t scan_bytes = 0;
  int64_t total = 0;  // bytes the caller provides (alignment slack included)
};

QuantizeLayout quantize_layout(const Dims& d) {
  QuantizeLayout L;
  const int64_t ng = d.n_groups(), numel = d.rows * d.K;
  if (ng == 0) return L;  // nothing to do, no workspace
  const int64_t n_tiles = n_tiles_of(d);
  Carver c;
  L.ctl = c.take(sizeof(uint32_t) * kCtlWords);
  L.key = c.take(4 * ng);  // used with a sensitivity or outliers only
  L.rm = c.take(8 * ng);   // float2 for float32 inputs, 4 bytes for 16-bit ones
  L.local = c.take(8 * n_tiles);
  L.cta = c.take(8 * n_count_ctas(n_tiles));
  L.slot = c.take(4 * ng);
  L.bmax = c.take(8 * (d.blocks2() + d.blocks4()));
  L.bnd = c.take(16 * ((ng + kPlaceGroups - 1) / kPlaceGroups));
  if (d.n_out > 0) {
    L.state = c.take(sizeof(SelectState));
    L.hist = c.take(sizeof(ull) * kRadix * kSelectPasses);
    L.is4 = c.take(4 * ng);
    L.okey = c.take(4 * numel);
    L.opos = c.take(4 * numel);
    L.scan_bytes = scan_temp_bytes(numel);
    L.scan = c.take(static_cast<int64_t>(L.scan_bytes));
  }
  L.total = c.off + kAlign;
  return L;
}

// CTAs of the grid-stride kernels: a few per SM of the current device.
unsigned stride_grid(int64_t n, int per_sm) {
  int dev = 0, sms = 0;
  cu::check(cudaGetDevice(&dev), "mixed2bit: device");
  cu::check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "mixed2bit: SM count");
  const int64_t want = std::min<int64_t>(cu::grid_for(n, kThreads), int64_t(sms) * per_sm);
  return static_cast<unsigned>(std::max<int64_t>(1, want));
}

}  // namespace

int64_t quantize_workspace_bytes_cuda(const Dims& dims) {
  check_cuda_dims(dims);
  return quantize_layout(dims).total;
}

namespace {

template <class T, class Keys>
void quantize_after_stats(const T* w, const Dims& d, const Buffers& out, uint8_t* base, const QuantizeLayout& L,
                          Keys keys, cudaStream_t s) {
  const int64_t ng = d.n_groups(), n4 = d.n4, n2 = d.n2(), n_out = d.n_out;
  const DivB B = make_div(d.scale_block);
  const int64_t n_tiles = n_tiles_of(d), n_ctas = n_count_ctas(n_tiles);
  const int gs = static_cast<int>(d.group_size);
  auto* ctl = reinterpret_cast<uint32_t*>(base + L.ctl);
  auto* key = reinterpret_cast<uint32_t*>(base + L.key);
  auto* rm = reinterpret_cast<RM<T>*>(base + L.rm);
  auto* local = reinterpret_cast<ull*>(base + L.local);
  auto* cta = reinterpret_cast<ull*>(base + L.cta);
  auto* slot = reinterpret_cast<uint32_t*>(base + L.slot);
  auto* bmax = reinterpret_cast<uint32_t*>(base + L.bmax);
  const int64_t blocks2 = d.blocks2();
  auto* bnd = reinterpret_cast<uint32_t*>(base + L.bnd);

  // Step 2: the remaining digits of K*, then the tile counts.
  if (n4 > 0 && n4 < ng) {
    const unsigned grid = stride_grid(ng, 4);
    select_pass_kernel<kBits2, kShift2><<<grid, kThreads, 0, s>>>(keys, ng, ctl);
    cu::check_launch("mixed2bit select pass");
    select_pass_kernel<kBits3, kShift3><<<grid, kThreads, 0, s>>>(keys, ng, ctl);
    cu::check_launch("mixed2bit select pass");
  }
  tile_count_kernel<<<cu::grid_for(n_tiles, kTilesPerCta), kThreads, 0, s>>>(keys, ng, n_tiles, n4, ctl, local, cta);
  cu::check_launch("mixed2bit tile count kernel");

  // Step 3: outliers, then step 4 again for the groups that hold some.
  if (n_out > 0) {
    const int64_t numel = d.rows * d.K;
    auto* st = reinterpret_cast<SelectState*>(base + L.state);
    auto* hist = reinterpret_cast<ull*>(base + L.hist);
    auto* is4 = reinterpret_cast<uint32_t*>(base + L.is4);
    auto* okey = reinterpret_cast<uint32_t*>(base + L.okey);
    auto* opos = reinterpret_cast<uint32_t*>(base + L.opos);
    mark_kernel<<<cu::grid_for(ng, kTile), kThreads, 0, s>>>(keys, ng, local, cta, ctl, is4);
    cu::check_launch("mixed2bit mark kernel");
    const unsigned grid_elems = cu::grid_for(numel, kThreads);
    outlier_keys_kernel<T><<<grid_elems, kThreads, 0, s>>>(w, numel, gs, is4, okey);
    cu::check_launch("mixed2bit outlier keys kernel");
    radix_select(okey, numel, n_out, st, hist, s);
    outlier_mark_kernel<<<grid_elems, kThreads, 0, s>>>(okey, numel, st, opos);
    cu::check_launch("mixed2bit outlier mark kernel");
    exclusive_sum(base + L.scan, L.scan_bytes, opos, opos, numel, s, "mixed2bit: outlier scan");
    outlier_scatter_kernel<T>
        <<<grid_elems, kThreads, 0, s>>>(w, okey, opos, numel, n_out, st, out.outlier_idx, out.outlier_val, ctl);
    cu::check_launch("mixed2bit outlier scatter kernel");
    outlier_groups_kernel<T><<<cu::grid_for(ng, kThreads), kThreads, 0, s>>>(w, ng, gs, out.outlier_idx, n_out, rm);
    cu::check_launch("mixed2bit outlier groups kernel");
  }

  // Step 2's slots and map, step 5's second order, then steps 5 + 6.
  const unsigned place_ctas = cu::grid_for(ng, kPlaceGroups);
  place_kernel<T>
      <<<place_ctas, kThreads, 0, s>>>(keys, rm, ng, B, n2, n4, blocks2, local, cta, ctl, bmax, bnd, slot, out);
  cu::check_launch("mixed2bit place kernel");
  finish_kernel<<<cu::grid_for(4 * int64_t(place_ctas), kThreads), kThreads, 0, s>>>(
      bnd, 4 * int64_t(place_ctas), blocks2, bmax, out.so2, out.so4, ctl);
  cu::check_launch("mixed2bit finish kernel");
  const bool vec = cu::aligned16(w);
  if (gs == 16)
    encode_kernel<16, T><<<cu::grid_for(ng, kThreads), kThreads, 0, s>>>(w, rm, slot, ng, gs, B, n2, n4, ctl, out, vec);
  else
    encode_kernel<0, T><<<cu::grid_for(ng, kThreads), kThreads, 0, s>>>(w, rm, slot, ng, gs, B, n2, n4, ctl, out, vec);
  cu::check_launch("mixed2bit encode kernel");
  (void)n_ctas;
  (void)key;
}

}  // namespace

template <class T>
void quantize_cuda(const T* w, const float* sens, const Dims& d, const Buffers& out, void* workspace,
                   int64_t workspace_bytes, void* stream) {
  check_cuda_dims(d);
  const int64_t ng = d.n_groups();
  if (ng == 0) return;  // every buffer is empty
  const QuantizeLayout L = quantize_layout(d);
  uint8_t* base = workspace_base(workspace, workspace_bytes, L.total);
  auto* ctl = reinterpret_cast<uint32_t*>(base + L.ctl);
  auto* rm = reinterpret_cast<RM<T>*>(base + L.rm);
  auto* bmax = reinterpret_cast<uint32_t*>(base + L.bmax);
  const cudaStream_t s = cu::stream(stream);
  const int gs = static_cast<int>(d.group_size);
  const bool vec = cu::aligned16(w);  // 16 values of T are 32 or 64 bytes: every group aligned too
  const bool svec = cu::aligned16(sens);
  const bool store_key = sens != nullptr || d.n_out > 0;
  uint32_t* key = store_key ? reinterpret_cast<uint32_t*>(base + L.key) : nullptr;
  const int64_t n_bmax = 2 * (d.blocks2() + d.blocks4());  // block maxima, cleared by the stats kernel

  cu::check(cudaMemsetAsync(ctl, 0, sizeof(uint32_t) * kCtlWords, s), "mixed2bit: clear control words");

  // Steps 1 and 4 (no outliers yet) and the first digit of the selection.
  const unsigned grid = stride_grid(ng, 8);
  auto stats = [&](auto gs_c, auto sens_c) {
    constexpr int GS = decltype(gs_c)::value;
    constexpr bool SENS = decltype(sens_c)::value;
    stats_kernel<GS, T, SENS>
        <<<grid, kThreads, 0, s>>>(w, sens, ng, gs, d.groups_per_row(), vec, svec, key, rm, bmax, n_bmax, ctl, d.n4);
  };
  using Gs16 = std::integral_constant<int, 16>;
  using Gs0 = std::integral_constant<int, 0>;
  using Yes = std::true_type;
  using No = std::false_type;
  if (gs == 16) {
    if (sens) stats(Gs16{}, Yes{});
    else stats(Gs16{}, No{});
  } else {
    if (sens) stats(Gs0{}, Yes{});
    else stats(Gs0{}, No{});
  }
  cu::check_launch("mixed2bit stats kernel");

  if (store_key) quantize_after_stats(w, d, out, base, L, ArrayKeys{key}, s);
  else quantize_after_stats(w, d, out, base, L, RangeKeys<T>{rm}, s);

  // The one synchronization: the error flags.
  uint32_t host_flags[4] = {};
  cu::check(cudaMemcpyAsync(host_flags, ctl, sizeof(host_flags), cudaMemcpyDeviceToHost, s), "mixed2bit: copy flags");
  cu::check(cudaStreamSynchronize(s), "mixed2bit quantize");
  if (host_flags[kFlagInternal])
    throw std::runtime_error("mixed2bit (CUDA): internal error: inconsistent selection (please report)");
  if (host_flags[kFlagTooLarge]) throw std::invalid_argument(kTooLargeMessage);
}

#define QF_INSTANTIATE(T) \
  template void quantize_cuda<T>(const T*, const float*, const Dims&, const Buffers&, void*, int64_t, void*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::mixed2bit
