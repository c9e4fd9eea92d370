// qformats.mixed2bit._native: mixed 2/4-bit codec (formats/mixed2bit) and the fp32-activation x
// mixed2bit-weight GEMM. Adapters check every array (device, dtype, contiguity, size from the
// dims), then call the CPU or CUDA kernels without the GIL. The Python layer allocates all
// outputs (n4 and n_out are known from the parameters before the call, so every buffer size is)
// and, for CUDA calls, the kernels' scratch workspace (sized by *_workspace_bytes) as torch
// tensors on the caller's stream. The GEMM runs on both (formats/mixed2bit/mixed2bit_gemm_cpu.h; CUDA:
// formats/mixed2bit/mixed2bit_gemm_cuda.h).
#include <memory>

#include "bindings/bind_args.h"
#include "bindings/linear.h"
#include "bindings/nb_common.h"
#include "formats/mixed2bit/mixed2bit.h"
#include "formats/mixed2bit/mixed2bit_gemm_cpu.h"
#include "formats/mixed2bit/mixed2bit_gemm_cuda.h"
#include "formats/mixed2bit/mixed2bit_tiled.h"

using namespace qf;
using namespace qf::bind;
namespace m2 = qf::mixed2bit;
namespace m2t = qf::mixed2bit::tiled;

namespace {

// float16 arrays (numpy float16 / torch.float16): dtype code Float, 16 bits, on device d.
template <class Arr>
void require_f16(const Arr& a, const char* name, const Device& d) {
  require_contiguous_on(a, name, d);
  const auto dt = a.dtype();
  if (!(dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && dt.bits == 16 && dt.lanes == 1))
    throw nb::type_error((std::string(name) + ": expected float16").c_str());
}

// The dims of a call, checked: every buffer size of mixed2bit.h follows from them within int64
// once rows * K does (the group counts are at most rows * K / 16, the ceilings of Dims do not
// add before dividing).
// The checks both layouts make on the shape: rows, K >= 0, group_size a positive multiple of 16
// dividing K, rows * K within int64.
void check_shape(int64_t rows, int64_t K, int64_t group_size) {
  nonneg(rows, "rows");
  nonneg(K, "K");
  if (group_size < m2::kGroupMultiple || group_size % m2::kGroupMultiple)
    throw std::invalid_argument("group_size must be a positive multiple of 16, got " + std::to_string(group_size));
  if (K % group_size) throw std::invalid_argument("K must be a multiple of group_size");
  mul(rows, K, "rows * K");
}

m2::Dims make_dims(int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4, int64_t n_out) {
  check_shape(rows, K, group_size);
  if (scale_block < 1) throw std::invalid_argument("scale_block must be >= 1, got " + std::to_string(scale_block));
  m2::Dims d;
  d.rows = rows;
  d.K = K;
  d.group_size = group_size;
  d.scale_block = scale_block;
  d.n4 = n4;
  d.n_out = n_out;
  if (n4 < 0 || n4 > d.n_groups()) throw std::invalid_argument("n4 out of range [0, rows * K / group_size]");
  if (n_out < 0 || n_out > d.n2() * group_size)
    throw std::invalid_argument("n_out out of range [0, values in 2-bit groups]");
  return d;
}

// mixed2bit_chunk_index_size (rows * ceil(groups_per_row / 32) + 1 entries), checked.
int64_t chunk_index_size(int64_t rows, int64_t groups_per_row) {
  add(mul(rows, ceil_div(groups_per_row, 32), "rows * ceil(groups_per_row / 32)"), 1, "n4_before entries");
  return ::qf::gemm::mixed2bit_chunk_index_size(rows, groups_per_row);
}

// Checks the nine buffers against the dims: device, dtypes, contiguity, element counts.
template <class Arr>
void check_buffers(const m2::Dims& d, const Device& dev, const Arr& group_map, const Arr& codes2, const Arr& codes4,
                   const Arr& scales2, const Arr& scales4, const Arr& so2, const Arr& so4, const Arr& outlier_idx,
                   const Arr& outlier_val) {
  require<uint8_t>(group_map, "group_map", dev);
  require<int32_t>(codes2, "codes2", dev);
  require<int32_t>(codes4, "codes4", dev);
  require<uint8_t>(scales2, "scales2", dev);
  require<uint8_t>(scales4, "scales4", dev);
  require_f16(so2, "so2", dev);
  require_f16(so4, "so4", dev);
  require<int32_t>(outlier_idx, "outlier_idx", dev);
  require_f16(outlier_val, "outlier_val", dev);
  require_numel(group_map, d.map_bytes(), "group_map");
  require_numel(codes2, mul(d.n2(), d.words2(), "codes2 (2-bit groups * words)"), "codes2");
  require_numel(codes4, mul(d.n4, d.words4(), "codes4 (n4 * words)"), "codes4");
  require_numel(scales2, d.n2(), "scales2");
  require_numel(scales4, mul(2, d.n4, "scales4 (2 * n4)"), "scales4");
  require_numel(so2, mul(2, d.blocks2(), "so2 (2 per scale block)"), "so2");
  require_numel(so4, mul(2, d.blocks4(), "so4 (2 per scale block)"), "so4");
  require_numel(outlier_idx, d.n_out, "outlier_idx");
  require_numel(outlier_val, d.n_out, "outlier_val");
}

m2::ConstBuffers const_buffers(const InArray& group_map, const InArray& codes2, const InArray& codes4,
                               const InArray& scales2, const InArray& scales4, const InArray& so2, const InArray& so4,
                               const InArray& outlier_idx, const InArray& outlier_val) {
  return {cptr<uint8_t>(group_map), cptr<uint32_t>(codes2),     cptr<uint32_t>(codes4),
          cptr<uint8_t>(scales2),   cptr<uint8_t>(scales4),     cptr<half_t>(so2),
          cptr<half_t>(so4),        cptr<int32_t>(outlier_idx), cptr<half_t>(outlier_val)};
}

// The CUDA kernels' scratch: a uint8 array on the call's device (None on the CPU).
struct Workspace {
  void* data = nullptr;
  int64_t bytes = 0;
};
Workspace workspace_of(const OutArray& ws, const Device& dev) {
  Workspace w;
  if (!dev.cuda) return w;  // the CPU kernels allocate their own scratch; a workspace is ignored
  if (!ws.is_valid()) throw std::invalid_argument("workspace: a CUDA call needs a workspace array");
  require<uint8_t>(ws, "workspace", dev);
  w.data = mptr<void>(ws);
  w.bytes = numel(ws, "workspace");
  return w;
}

// Bytes of workspace quantize / dequantize need on CUDA for these dims (the CUDA device of the
// call must be current: the size comes from CUB's query).
int64_t quantize_workspace_bytes(int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4,
                                 int64_t n_out) {
  const m2::Dims d = make_dims(rows, K, group_size, scale_block, n4, n_out);
  (void)d;
  QF_ON_CUDA(return m2::quantize_workspace_bytes_cuda(d));
}

int64_t dequantize_workspace_bytes(int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4,
                                   int64_t n_out) {
  const m2::Dims d = make_dims(rows, K, group_size, scale_block, n4, n_out);
  (void)d;
  QF_ON_CUDA(return m2::dequantize_workspace_bytes_cuda(d));
}

// w: float [rows, K]; sensitivity: float32 [K] or None; outputs as in mixed2bit.h; workspace:
// uint8 of quantize_workspace_bytes() on CUDA (None on the CPU).
void quantize(const InArray& w, const InArray& sensitivity, int64_t group_size, int64_t scale_block, int64_t n4,
              int64_t n_out, const OutArray& group_map, const OutArray& codes2, const OutArray& codes4,
              const OutArray& scales2, const OutArray& scales4, const OutArray& so2, const OutArray& so4,
              const OutArray& outlier_idx, const OutArray& outlier_val, const OutArray& workspace, uintptr_t stream) {
  const Device dev = device_of(w, stream, "w");
  if (w.ndim() != 2) throw std::invalid_argument("w: expected a 2-D array");
  const m2::Dims d =
      make_dims(static_cast<int64_t>(w.shape(0)), static_cast<int64_t>(w.shape(1)), group_size, scale_block, n4, n_out);
  check_buffers(d, dev, group_map, codes2, codes4, scales2, scales4, so2, so4, outlier_idx, outlier_val);
  const float* sens = nullptr;
  if (sensitivity.is_valid()) {  // None when selecting by range
    require<float>(sensitivity, "sensitivity", dev);
    require_numel(sensitivity, d.K, "sensitivity");
    sens = cptr<float>(sensitivity);
  }
  const Workspace ws = workspace_of(workspace, dev);
  (void)ws;  // unused in CPU-only builds
  const m2::Buffers out{mptr<uint8_t>(group_map), mptr<uint32_t>(codes2),     mptr<uint32_t>(codes4),
                        mptr<uint8_t>(scales2),   mptr<uint8_t>(scales4),     mptr<half_t>(so2),
                        mptr<half_t>(so4),        mptr<int32_t>(outlier_idx), mptr<half_t>(outlier_val)};
  dispatch_float(w, "w", dev, [&](auto* pw) {
    if (d.n_groups() == 0) return;  // no output (nb_common.h)
    if (dev.cuda) {
      QF_ON_CUDA(m2::quantize_cuda(pw, sens, d, out, ws.data, ws.bytes, dev.stream));
    } else {
      m2::quantize_cpu(pw, sens, d, out);
    }
  });
}

// out: float32, float16 or bfloat16 [rows * K] (decoded in float32, rounded once); workspace:
// uint8 of dequantize_workspace_bytes() on CUDA (None on the CPU).
void dequantize(int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4, int64_t n_out,
                const InArray& group_map, const InArray& codes2, const InArray& codes4, const InArray& scales2,
                const InArray& scales4, const InArray& so2, const InArray& so4, const InArray& outlier_idx,
                const InArray& outlier_val, const OutArray& out, const OutArray& workspace, uintptr_t stream) {
  const Device dev = device_of(out, stream, "out");
  const m2::Dims d = make_dims(rows, K, group_size, scale_block, n4, n_out);
  check_buffers(d, dev, group_map, codes2, codes4, scales2, scales4, so2, so4, outlier_idx, outlier_val);
  const Workspace ws = workspace_of(workspace, dev);
  (void)ws;  // unused in CPU-only builds
  const m2::ConstBuffers q =
      const_buffers(group_map, codes2, codes4, scales2, scales4, so2, so4, outlier_idx, outlier_val);
  dispatch_float_out(out, "out", dev, [&](auto* py) {
    require_numel(out, mul(rows, K, "rows * K"), "out");
    if (d.n_groups() == 0) return;  // no output (nb_common.h)
    if (dev.cuda) {
      QF_ON_CUDA(m2::dequantize_cuda(q, d, py, ws.data, ws.bytes, dev.stream));
    } else {
      m2::dequantize_cpu(q, d, py);
    }
  });
}

// The policy of bindings/linear.h over a mixed2bit weight [rows, K]. CPU: W decoded a tile at a
// time in float32, with the row and tile index made (and the map and outliers validated) when
// the weight is bound. CUDA: decoded in registers, with the chunk index of row_index().
struct Mixed2Linear {
  m2::ConstBuffers q;
  m2::Dims d;
  const uint64_t* index;                                           // CUDA only
  std::shared_ptr<const ::qf::gemm::Mixed2bitCpuIndex> cpu_index;  // CPU only
#if defined(QFORMATS_WITH_CUDA)
  template <class T>
  void cuda(const T* x, int64_t N, T* y, const T* bias, ::qf::gemm::GemmWorkspace, void* stream) const {
    ::qf::gemm::mixed2bit_gemm_cuda(x, N, q, d, index, y, bias, stream);
  }
  int64_t workspace_cuda(int64_t) const { return 0; }
  template <class T>
  void dequantize_cuda(T* w, void* workspace, int64_t workspace_bytes, void* stream) const {
    m2::dequantize_cuda(q, d, w, workspace, workspace_bytes, stream);
  }
  int64_t dequantize_workspace_cuda() const { return m2::dequantize_workspace_bytes_cuda(d); }
#endif
  template <class T>
  void dequantize_cpu(T* w) const {
    m2::dequantize_cpu(q, d, w);
  }
  void cpu(const float* x, int64_t N, float* y) const { ::qf::gemm::mixed2bit_gemm_cpu(x, N, q, d, *cpu_index, y); }
};

// A mixed2bit weight [rows, K] (the nine buffers of mixed2bit.h and its dims) as a Linear, checked
// here once. CUDA: n4_before = row_index()'s chunk index (mixed2bit_gemm_cuda.h) and the
// parameters gemm_cuda_supports() accepts.
PackedLinear<Mixed2Linear> make_linear(int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4,
                                       int64_t n_out, const InArray& group_map, const InArray& codes2,
                                       const InArray& codes4, const InArray& scales2, const InArray& scales4,
                                       const InArray& so2, const InArray& so4, const InArray& outlier_idx,
                                       const InArray& outlier_val, const InArray& n4_before) {
  const Device dev = device_of(group_map, 0, "group_map");
  const m2::Dims d = make_dims(rows, K, group_size, scale_block, n4, n_out);
  check_buffers(d, dev, group_map, codes2, codes4, scales2, scales4, so2, so4, outlier_idx, outlier_val);
  std::vector<InArray> keep{group_map, codes2, codes4, scales2, scales4, so2, so4, outlier_idx, outlier_val};
  const uint64_t* index = nullptr;
  if (dev.cuda) {
    if (!n4_before.is_valid()) throw std::invalid_argument("n4_before: required for CUDA arrays");
    require<int64_t>(n4_before, "n4_before", dev);
    require_numel(n4_before, chunk_index_size(rows, d.groups_per_row()), "n4_before");
    if (!::qf::gemm::mixed2bit_gemm_cuda_supports(d))
      throw std::invalid_argument(
          "the CUDA GEMM needs group_size = 16 * 2^j <= 512, a power-of-two "
          "scale_block, no outliers and fewer than 2^32 units of 16 values");
    index = reinterpret_cast<const uint64_t*>(cptr<int64_t>(n4_before));
    keep.push_back(n4_before);
  }
  const m2::ConstBuffers q =
      const_buffers(group_map, codes2, codes4, scales2, scales4, so2, so4, outlier_idx, outlier_val);
  std::shared_ptr<const ::qf::gemm::Mixed2bitCpuIndex> cpu_index;
  if (!dev.cuda)
    cpu_index = std::make_shared<const ::qf::gemm::Mixed2bitCpuIndex>(::qf::gemm::mixed2bit_cpu_index(q, d));
  return packed_linear(Mixed2Linear{q, d, index, std::move(cpu_index)}, rows, K, group_map, std::move(keep));
}

// Y [N, rows] = X [N, K] . W^T, X float32, float16 or bfloat16 [N, K]: make_linear's product for
// one call (out float32 on the CPU, x's dtype on CUDA).
void weight_only_gemm(const InArray& x, int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4,
                      int64_t n_out, const InArray& group_map, const InArray& codes2, const InArray& codes4,
                      const InArray& scales2, const InArray& scales4, const InArray& so2, const InArray& so4,
                      const InArray& outlier_idx, const InArray& outlier_val, const OutArray& out,
                      const InArray& n4_before, uintptr_t stream) {
  if (x.ndim() != 2 || static_cast<int64_t>(x.shape(1)) != K) throw std::invalid_argument("x: expected float [N, K]");
  make_linear(rows, K, group_size, scale_block, n4, n_out, group_map, codes2, codes4, scales2, scales4, so2, so4,
              outlier_idx, outlier_val, n4_before)(x, out, std::nullopt, std::nullopt, stream);
}

// n4_before: int64 [rows * ceil(groups_per_row / 32) + 1] on the device of group_map, filled
// with the chunk index of mixed2bit_gemm_cuda.h (per row and 32-group chunk: the 4-bit
// groups before it in the low 32 bits, its map bits in the high 32; the last entry is the total).
// CUDA only (the CPU GEMM indexes itself).
void row_index(const InArray& group_map, int64_t rows, int64_t groups_per_row, const OutArray& n4_before,
               uintptr_t stream) {
  nonneg(rows, "rows");
  nonneg(groups_per_row, "groups_per_row");
  const Device dev = device_of(group_map, stream, "group_map");
  if (!dev.cuda) throw std::invalid_argument("group_map: row_index is for CUDA arrays");
  require<uint8_t>(group_map, "group_map", dev);
  require_numel(group_map, ceil_div(mul(rows, groups_per_row, "rows * groups_per_row"), 8), "group_map");
  require<int64_t>(n4_before, "n4_before", dev);
  require_numel(n4_before, chunk_index_size(rows, groups_per_row), "n4_before");
  // With no rows the index is its total alone (0); groups_per_row, which no array bounds then,
  // does not reach the kernel.
  if (rows == 0) groups_per_row = 0;
  QF_ON_CUDA(::qf::gemm::mixed2bit_row_index_cuda(cptr<uint8_t>(group_map), rows, groups_per_row,
                                                  reinterpret_cast<uint64_t*>(mptr<int64_t>(n4_before)), dev.stream));
}

bool gemm_cuda_supports(int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4, int64_t n_out) {
  return ::qf::gemm::mixed2bit_gemm_cuda_supports(make_dims(rows, K, group_size, scale_block, n4, n_out));
}

// values: uint8 with 16 * numel(out) elements; out: int32.
void pack_2bit(const InArray& values, const OutArray& out, uintptr_t stream) {
  const Device dev = device_of(values, stream, "values");
  require<uint8_t>(values, "values", dev);
  require<int32_t>(out, "out", dev);
  const int64_t n_words = numel(out, "out");
  require_numel(values, mul(n_words, m2::kCodes2PerWord, "values (16 per word of out)"), "values");
  if (dev.cuda) {
    QF_ON_CUDA(m2::pack_2bit_cuda(cptr<uint8_t>(values), n_words, mptr<uint32_t>(out), dev.stream));
  } else {
    m2::pack_2bit_cpu(cptr<uint8_t>(values), n_words, mptr<uint32_t>(out));
  }
}

// packed: int32; out: uint8 with at most 16 * numel(packed) elements.
void unpack_2bit(const InArray& packed, const OutArray& out, uintptr_t stream) {
  const Device dev = device_of(packed, stream, "packed");
  require<int32_t>(packed, "packed", dev);
  require<uint8_t>(out, "out", dev);
  const int64_t n_out = numel(out, "out");
  // Compared as out / 16 <= words (rounded up), not out <= words * 16, which can wrap.
  if (ceil_div(n_out, m2::kCodes2PerWord) > numel(packed, "packed"))
    throw std::invalid_argument("out: more elements than the packed words hold");
  if (dev.cuda) {
    QF_ON_CUDA(m2::unpack_2bit_cuda(cptr<uint32_t>(packed), n_out, mptr<uint8_t>(out), dev.stream));
  } else {
    m2::unpack_2bit_cpu(cptr<uint32_t>(packed), n_out, mptr<uint8_t>(out));
  }
}

// -- layout "tiled" (formats/mixed2bit/mixed2bit_tiled.h) ----------------------------------------

m2t::Dims make_tiled_dims(int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4_full,
                          int64_t n4_last) {
  check_shape(rows, K, group_size);
  m2t::Dims d;
  d.rows = rows;
  d.K = K;
  d.group_size = group_size;
  d.scale_block = scale_block;
  d.n4_full = n4_full;
  d.n4_last = n4_last;
  m2t::check_dims(d);
  return d;
}

// Checks the seven buffers against the dims: device, dtypes, contiguity, element counts.
template <class Arr>
void check_tiled_buffers(const m2t::Dims& d, const Device& dev, const Arr& codes, const Arr& scales, const Arr& so,
                         const Arr& map, const Arr& lo, const Arr& mc4, const Arr& so4) {
  require<int32_t>(codes, "codes", dev);
  require<uint8_t>(scales, "scales", dev);
  require_f16(so, "so", dev);
  require<uint32_t>(map, "map", dev);
  require<int32_t>(lo, "lo", dev);
  require<uint8_t>(mc4, "mc4", dev);
  require_f16(so4, "so4", dev);
  const int64_t rows = d.rows;
  require_numel(codes, mul(rows, d.K / m2::kCodes2PerWord, "codes"), "codes");
  require_numel(scales, mul(rows, d.groups_per_row(), "scales"), "scales");
  require_numel(so, mul(mul(rows, d.blocks_per_row(), "so"), 2, "so"), "so");
  require_numel(map, mul(rows, d.map_words(), "map"), "map");
  require_numel(lo, mul(mul(rows, d.n4_row(), "lo"), d.words_per_group(), "lo"), "lo");
  require_numel(mc4, mul(rows, d.n4_row(), "mc4"), "mc4");
  require_numel(so4, mul(mul(rows, d.tiles_per_row(), "so4"), 2, "so4"), "so4");
}

m2t::ConstBuffers tiled_const_buffers(const InArray& codes, const InArray& scales, const InArray& so,
                                      const InArray& map, const InArray& lo, const InArray& mc4, const InArray& so4) {
  return {cptr<uint32_t>(codes), cptr<uint8_t>(scales), cptr<half_t>(so), cptr<uint32_t>(map),
          cptr<uint32_t>(lo),    cptr<uint8_t>(mc4),    cptr<half_t>(so4)};
}

// w: float [rows, K]; sensitivity: float32 [K] or None; outputs as in mixed2bit_tiled.h; flags:
// uint8 of m2t::kFlagsBytes on CUDA (None on the CPU). CUDA: synchronizes `stream` once.
void tiled_quantize(const InArray& w, const InArray& sensitivity, int64_t group_size, int64_t scale_block,
                    int64_t n4_full, int64_t n4_last, const OutArray& codes, const OutArray& scales, const OutArray& so,
                    const OutArray& map, const OutArray& lo, const OutArray& mc4, const OutArray& so4,
                    const OutArray& flags, uintptr_t stream) {
  const Device dev = device_of(w, stream, "w");
  if (w.ndim() != 2) throw std::invalid_argument("w: expected a 2-D array");
  const m2t::Dims d = make_tiled_dims(static_cast<int64_t>(w.shape(0)), static_cast<int64_t>(w.shape(1)), group_size,
                                      scale_block, n4_full, n4_last);
  check_tiled_buffers(d, dev, codes, scales, so, map, lo, mc4, so4);
  const float* sens = nullptr;
  if (sensitivity.is_valid()) {
    require<float>(sensitivity, "sensitivity", dev);
    require_numel(sensitivity, d.K, "sensitivity");
    sens = cptr<float>(sensitivity);
  }
  const m2t::Buffers out{mptr<uint32_t>(codes), mptr<uint8_t>(scales), mptr<half_t>(so), mptr<uint32_t>(map),
                         mptr<uint32_t>(lo),    mptr<uint8_t>(mc4),    mptr<half_t>(so4)};
  void* pflags = nullptr;
  if (dev.cuda) {
    if (!flags.is_valid()) throw std::invalid_argument("flags: a CUDA call needs a flags array");
    require<uint8_t>(flags, "flags", dev);
    require_numel(flags, m2t::kFlagsBytes, "flags");
    pflags = mptr<void>(flags);
  }
  (void)pflags;  // unused in CPU-only builds
  dispatch_float(w, "w", dev, [&](auto* pw) {
    if (d.rows * d.groups_per_row() == 0) return;  // no output (nb_common.h)
    if (dev.cuda) {
      QF_ON_CUDA(m2t::quantize_cuda(pw, sens, d, out, pflags, dev.stream));
    } else {
      m2t::quantize_cpu(pw, sens, d, out);
    }
  });
}

// out: float32, float16 or bfloat16 [rows * K]. CUDA: asynchronous on `stream`; a tile whose
// map breaks its count decodes to NaN (the CPU raises).
void tiled_dequantize(int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4_full,
                      int64_t n4_last, const InArray& codes, const InArray& scales, const InArray& so,
                      const InArray& map, const InArray& lo, const InArray& mc4, const InArray& so4,
                      const OutArray& out, uintptr_t stream) {
  const Device dev = device_of(out, stream, "out");
  const m2t::Dims d = make_tiled_dims(rows, K, group_size, scale_block, n4_full, n4_last);
  check_tiled_buffers(d, dev, codes, scales, so, map, lo, mc4, so4);
  const m2t::ConstBuffers q = tiled_const_buffers(codes, scales, so, map, lo, mc4, so4);
  dispatch_float_out(out, "out", dev, [&](auto* py) {
    require_numel(out, mul(rows, K, "rows * K"), "out");
    if (rows * d.groups_per_row() == 0) return;
    if (dev.cuda) {
      QF_ON_CUDA(m2t::dequantize_cuda(q, d, py, dev.stream));
    } else {
      m2t::dequantize_cpu(q, d, py);
    }
  });
}

// bad_tiles: int32 [1] on map's device, increased by the number of tiles whose map words do not
// mark their n4 groups (CUDA, asynchronous on `stream`; the CPU kernels check it themselves).
void tiled_check_map(int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4_full, int64_t n4_last,
                     const InArray& map, const OutArray& bad_tiles, uintptr_t stream) {
  const m2t::Dims d = make_tiled_dims(rows, K, group_size, scale_block, n4_full, n4_last);
  const Device dev = device_of(map, stream, "map");
  if (!dev.cuda) throw std::invalid_argument("map: tiled_check_map is for CUDA arrays");
  require<uint32_t>(map, "map", dev);
  require_numel(map, mul(rows, d.map_words(), "map"), "map");
  require<int32_t>(bad_tiles, "bad_tiles", dev);
  require_numel(bad_tiles, 1, "bad_tiles");
  QF_ON_CUDA(m2t::check_map_cuda(cptr<uint32_t>(map), d, mptr<int32_t>(bad_tiles), dev.stream));
}

// The policy of bindings/linear.h over a tiled-layout weight. CUDA: the caller has checked the
// map with tiled_check_map (the kernels trust its counts; mixed2bit_tiled.h).
struct TiledLinear {
  m2t::ConstBuffers q;
  m2t::Dims d;
#if defined(QFORMATS_WITH_CUDA)
  template <class T>
  void cuda(const T* x, int64_t N, T* y, const T* bias, ::qf::gemm::GemmWorkspace, void* stream) const {
    m2t::gemm_cuda(x, N, q, d, y, bias, stream);
  }
  int64_t workspace_cuda(int64_t) const { return 0; }
  template <class T>
  void dequantize_cuda(T* w, void*, int64_t, void* stream) const {
    m2t::dequantize_cuda(q, d, w, stream);
  }
  int64_t dequantize_workspace_cuda() const { return 0; }
#endif
  template <class T>
  void dequantize_cpu(T* w) const {
    m2t::dequantize_cpu(q, d, w);
  }
  void cpu(const float* x, int64_t N, float* y) const { m2t::gemm_cpu(x, N, q, d, y); }
};

PackedLinear<TiledLinear> make_tiled_linear(int64_t rows, int64_t K, int64_t group_size, int64_t scale_block,
                                            int64_t n4_full, int64_t n4_last, const InArray& codes,
                                            const InArray& scales, const InArray& so, const InArray& map,
                                            const InArray& lo, const InArray& mc4, const InArray& so4) {
  const Device dev = device_of(codes, 0, "codes");
  const m2t::Dims d = make_tiled_dims(rows, K, group_size, scale_block, n4_full, n4_last);
  check_tiled_buffers(d, dev, codes, scales, so, map, lo, mc4, so4);
  if (dev.cuda && !m2t::gemm_cuda_supports(d))
    throw std::invalid_argument(
        "the tiled layout's CUDA GEMM needs group_size = 16 * 2^j <= 512 and fewer than "
        "2^32 units of 16 values");
  std::vector<InArray> keep{codes, scales, so, map, lo, mc4, so4};
  return packed_linear(TiledLinear{tiled_const_buffers(codes, scales, so, map, lo, mc4, so4), d}, rows, K, codes,
                       std::move(keep));
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() =
      "mixed2bit (2/4-bit groups, second-order scales, fp16 outliers) native codec and "
      "fp32 x mixed2bit GEMM; called through qformats.mixed2bit.";
  m.def("quantize", &quantize, nb::arg("w"), nb::arg("sensitivity").none(), nb::arg("group_size"),
        nb::arg("scale_block"), nb::arg("n4"), nb::arg("n_out"), nb::arg("group_map"), nb::arg("codes2"),
        nb::arg("codes4"), nb::arg("scales2"), nb::arg("scales4"), nb::arg("so2"), nb::arg("so4"),
        nb::arg("outlier_idx"), nb::arg("outlier_val"), nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0,
        release_gil());
  m.def("dequantize", &dequantize, nb::arg("rows"), nb::arg("K"), nb::arg("group_size"), nb::arg("scale_block"),
        nb::arg("n4"), nb::arg("n_out"), nb::arg("group_map"), nb::arg("codes2"), nb::arg("codes4"), nb::arg("scales2"),
        nb::arg("scales4"), nb::arg("so2"), nb::arg("so4"), nb::arg("outlier_idx"), nb::arg("outlier_val"),
        nb::arg("out"), nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0, release_gil());
  m.def("quantize_workspace_bytes", &quantize_workspace_bytes, nb::arg("rows"), nb::arg("K"), nb::arg("group_size"),
        nb::arg("scale_block"), nb::arg("n4"), nb::arg("n_out"));
  m.def("dequantize_workspace_bytes", &dequantize_workspace_bytes, nb::arg("rows"), nb::arg("K"), nb::arg("group_size"),
        nb::arg("scale_block"), nb::arg("n4"), nb::arg("n_out"));
  m.def("gemm", &weight_only_gemm, nb::arg("x"), nb::arg("rows"), nb::arg("K"), nb::arg("group_size"),
        nb::arg("scale_block"), nb::arg("n4"), nb::arg("n_out"), nb::arg("group_map"), nb::arg("codes2"),
        nb::arg("codes4"), nb::arg("scales2"), nb::arg("scales4"), nb::arg("so2"), nb::arg("so4"),
        nb::arg("outlier_idx"), nb::arg("outlier_val"), nb::arg("out"), nb::arg("n4_before").none() = nb::none(),
        nb::arg("stream") = 0, release_gil());
  bind_linear<Mixed2Linear>(m, "A mixed2bit weight [rows, K] bound for repeated x . W^T (+ bias) calls.");
  m.def("make_linear", &make_linear, nb::arg("rows"), nb::arg("K"), nb::arg("group_size"), nb::arg("scale_block"),
        nb::arg("n4"), nb::arg("n_out"), nb::arg("group_map"), nb::arg("codes2"), nb::arg("codes4"), nb::arg("scales2"),
        nb::arg("scales4"), nb::arg("so2"), nb::arg("so4"), nb::arg("outlier_idx"), nb::arg("outlier_val"),
        nb::arg("n4_before").none() = nb::none());
  m.def("row_index", &row_index, nb::arg("group_map"), nb::arg("rows"), nb::arg("groups_per_row"), nb::arg("n4_before"),
        nb::arg("stream") = 0, release_gil());
  m.def("gemm_cuda_supports", &gemm_cuda_supports, nb::arg("rows"), nb::arg("K"), nb::arg("group_size"),
        nb::arg("scale_block"), nb::arg("n4"), nb::arg("n_out"));
  m.def("gemm_isa", &gemm_isa, "Instruction set of the CPU GEMM kernels in use (QFORMATS_GEMM_ISA lowers it).");
  m.def("pack_2bit", &pack_2bit, nb::arg("values"), nb::arg("out"), nb::arg("stream") = 0, release_gil());
  m.def("unpack_2bit", &unpack_2bit, nb::arg("packed"), nb::arg("out"), nb::arg("stream") = 0, release_gil());
  m.def("tiled_quantize", &tiled_quantize, nb::arg("w"), nb::arg("sensitivity").none(), nb::arg("group_size"),
        nb::arg("scale_block"), nb::arg("n4_full"), nb::arg("n4_last"), nb::arg("codes"), nb::arg("scales"),
        nb::arg("so"), nb::arg("map"), nb::arg("lo"), nb::arg("mc4"), nb::arg("so4"),
        nb::arg("flags").none() = nb::none(), nb::arg("stream") = 0, release_gil());
  m.def("tiled_dequantize", &tiled_dequantize, nb::arg("rows"), nb::arg("K"), nb::arg("group_size"),
        nb::arg("scale_block"), nb::arg("n4_full"), nb::arg("n4_last"), nb::arg("codes"), nb::arg("scales"),
        nb::arg("so"), nb::arg("map"), nb::arg("lo"), nb::arg("mc4"), nb::arg("so4"), nb::arg("out"),
        nb::arg("stream") = 0, release_gil());
  m.def("tiled_check_map", &tiled_check_map, nb::arg("rows"), nb::arg("K"), nb::arg("group_size"),
        nb::arg("scale_block"), nb::arg("n4_full"), nb::arg("n4_last"), nb::arg("map"), nb::arg("bad_tiles"),
        nb::arg("stream") = 0, release_gil());
  m.def(
      "tiled_gemm_cuda_supports",
      [](int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4_full, int64_t n4_last) {
        return m2t::gemm_cuda_supports(make_tiled_dims(rows, K, group_size, scale_block, n4_full, n4_last));
      },
      nb::arg("rows"), nb::arg("K"), nb::arg("group_size"), nb::arg("scale_block"), nb::arg("n4_full"),
      nb::arg("n4_last"));
  bind_linear<TiledLinear>(m, "A mixed2bit weight in the tiled layout [rows, K] bound for repeated x . W^T calls.",
                           "TiledLinear");
  m.def("make_tiled_linear", &make_tiled_linear, nb::arg("rows"), nb::arg("K"), nb::arg("group_size"),
        nb::arg("scale_block"), nb::arg("n4_full"), nb::arg("n4_last"), nb::arg("codes"), nb::arg("scales"),
        nb::arg("so"), nb::arg("map"), nb::arg("lo"), nb::arg("mc4"), nb::arg("so4"));
}
