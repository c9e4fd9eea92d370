// qformats.int4._native: int4 codec (formats/int4: asymmetric / symmetric groups, nibble
// packing), the float32 x int4 weight-only GEMM and the int4 x int4 -> int32 GEMM
// (gemm/int4_int4). Adapters check the arrays, then call the kernels without the GIL.
#include <nanobind/stl/optional.h>

#include <optional>

#include "bindings/bind_args.h"
#include "bindings/linear.h"
#include "bindings/nb_common.h"
#include "formats/int4/int4.h"
#include "formats/int4/int4_gemm_cpu.h"
#include "formats/int4/int4_gemm_cuda.h"
#include "gemm/int4_int4.h"

using namespace qf;
using namespace qf::bind;

namespace {

void check_group_size(int64_t gs) {
  if (gs <= 0 || gs % int4::kGroupMultiple)
    throw std::invalid_argument("group_size must be a positive multiple of 8, got " + std::to_string(gs));
}

// Checks the packed buffers of n values in groups of gs on device `dev` (inputs of dequantize
// and the GEMMs, outputs of quantize); returns the group count. zeros may be None (symmetric).
template <class Arr>
int64_t check_buffers(int64_t n, int64_t gs, const Arr& qweight, const Arr& scales, const std::optional<Arr>& zeros,
                      const Device& dev) {
  check_group_size(gs);
  nonneg(n, "element count");
  if (n % gs) throw std::invalid_argument("element count must be a multiple of group_size");
  require<uint8_t>(qweight, "qweight", dev);
  require<float>(scales, "scales", dev);
  require_numel(qweight, n / 2, "qweight");
  require_numel(scales, n / gs, "scales");
  if (zeros) {
    require<uint8_t>(*zeros, "zeros", dev);
    require_numel(*zeros, n / gs, "zeros");
  }
  return n / gs;
}

const uint8_t* zeros_ptr(const std::optional<InArray>& zeros) { return zeros ? cptr<uint8_t>(*zeros) : nullptr; }

// x: float [..., K] (C-contiguous); zeros None selects the symmetric mode. All arrays on the
// CPU, or all on one CUDA device (launched on `stream`).
void quantize(const InArray& x, const OutArray& qweight, const OutArray& scales, const std::optional<OutArray>& zeros,
              int64_t group_size, uintptr_t stream) {
  const Device dev = device_of(x, stream, "x");
  const int64_t n_groups = check_buffers(numel(x, "x"), group_size, qweight, scales, zeros, dev);
  auto* qw = mptr<uint8_t>(qweight);
  auto* sc = mptr<float>(scales);
  auto* zp = zeros ? mptr<uint8_t>(*zeros) : nullptr;
  dispatch_float(x, "x", dev, [&](auto* px) {
    if (n_groups == 0) return;  // no output (nb_common.h)
    if (dev.cuda) {
      if (zp) {
        QF_ON_CUDA(qf::int4::quantize_asym_cuda(px, n_groups, group_size, qw, sc, zp, dev.stream));
      } else {
        QF_ON_CUDA(qf::int4::quantize_sym_cuda(px, n_groups, group_size, qw, sc, dev.stream));
      }
    } else if (zp) {
      qf::int4::quantize_asym_cpu(px, n_groups, group_size, qw, sc, zp);
    } else {
      qf::int4::quantize_sym_cpu(px, n_groups, group_size, qw, sc);
    }
  });
}

// Checks `tiles_K` of the "tiles" layout (formats/int4/int4.h) for n values: 0 (the rows layout),
// or the K of a weight [M, K] with M % 16 == 0 and K % group_size == 0; returns the groups per row
// (0 for rows).
int64_t tiles_groups(int64_t tiles_K, int64_t n, int64_t gs, const char* name) {
  if (tiles_K == 0) return 0;
  if (tiles_K < 0 || tiles_K % gs || n % tiles_K || (n / tiles_K) % int4::kTileRows)
    throw std::invalid_argument(std::string(name) + "=" + std::to_string(tiles_K) +
                                ": the tiles layout needs a weight [M, K] with M % 16 == 0 and K % group_size == 0");
  return tiles_K / gs;
}

// out: float32, float16 or bfloat16 (decoded in float32, rounded once). tiles_K > 0: the buffers
// are the "tiles" layout of a weight [numel(out) / tiles_K, tiles_K], decoded in row order.
void dequantize(const InArray& qweight, const InArray& scales, const std::optional<InArray>& zeros, const OutArray& out,
                int64_t group_size, uintptr_t stream, int64_t tiles_K) {
  const Device dev = device_of(qweight, stream, "qweight");
  const int64_t n_groups = check_buffers(numel(out, "out"), group_size, qweight, scales, zeros, dev);
  const int64_t tiles_C = tiles_groups(tiles_K, numel(out, "out"), group_size, "tiles_K");
  const auto* qw = cptr<uint8_t>(qweight);
  const auto* sc = cptr<float>(scales);
  const uint8_t* zp = zeros_ptr(zeros);
  dispatch_float_out(out, "out", dev, [&](auto* py) {
    if (n_groups == 0) return;  // no output (nb_common.h)
    if (dev.cuda) {
      QF_ON_CUDA(qf::int4::dequantize_cuda(qw, sc, zp, n_groups, group_size, py, dev.stream, tiles_C));
    } else {
      qf::int4::dequantize_cpu(qw, sc, zp, n_groups, group_size, py, tiles_C);
    }
  });
}

// codes: int8 or uint8 with 2 * numel(out) elements; out: uint8.
void pack(const InArray& codes, const OutArray& out, uintptr_t stream) {
  const Device dev = device_of(codes, stream, "values");
  require_contiguous_on(codes, "values", dev);
  if (codes.dtype() != nb::dtype<uint8_t>() && codes.dtype() != nb::dtype<int8_t>())
    throw nb::type_error("values: expected int8 or uint8");
  require<uint8_t>(out, "out", dev);
  const int64_t n_out = numel(out, "out");
  require_numel(codes, mul(2, n_out, "values (2 per byte of out)"), "values");
  const auto* pc = static_cast<const uint8_t*>(codes.data());
  if (dev.cuda) {
    QF_ON_CUDA(qf::int4::pack_cuda(pc, n_out, mptr<uint8_t>(out), dev.stream));
  } else {
    qf::int4::pack_cpu(pc, n_out, mptr<uint8_t>(out));
  }
}

// out: int8 (signed codes) or uint8 (unsigned) with 2 * numel(packed) elements.
void unpack(const InArray& packed, const OutArray& out, uintptr_t stream) {
  const Device dev = device_of(packed, stream, "packed");
  require<uint8_t>(packed, "packed", dev);
  require_contiguous_on(out, "out", dev);
  const bool is_signed = out.dtype() == nb::dtype<int8_t>();
  if (!is_signed && out.dtype() != nb::dtype<uint8_t>()) throw nb::type_error("out: expected int8 or uint8");
  const int64_t n_packed = numel(packed, "packed");
  require_numel(out, mul(2, n_packed, "out (2 per byte of packed)"), "out");
  auto* pc = mptr<uint8_t>(out);
  if (dev.cuda) {
    QF_ON_CUDA(qf::int4::unpack_cuda(cptr<uint8_t>(packed), n_packed, is_signed, pc, dev.stream));
  } else {
    qf::int4::unpack_cpu(cptr<uint8_t>(packed), n_packed, is_signed, pc);
  }
}

// The weight-only GEMM's policy (bindings/linear.h) over an [M, K] int4 weight's buffers.
struct Int4Linear {
  const uint8_t* qweight;
  const float* scales;
  const uint8_t* zeros;  // nullptr: symmetric
  int64_t M, K, group_size;
  bool tiles;  // the "tiles" layout
  int64_t tiles_C() const { return tiles ? K / group_size : 0; }
#if defined(QFORMATS_WITH_CUDA)
  template <class T>
  void cuda(const T* x, int64_t N, T* y, const T* bias, gemm::GemmWorkspace ws, void* stream) const {
    gemm::int4_gemm_cuda(x, N, K, M, qweight, scales, zeros, group_size, y, bias, ws, stream, tiles);
  }
  int64_t workspace_cuda(int64_t N) const { return gemm::weight_only_workspace_bytes_cuda(N, M, K); }
  template <class T>
  void dequantize_cuda(T* w, void*, int64_t, void* stream) const {
    qf::int4::dequantize_cuda(qweight, scales, zeros, M * K / group_size, group_size, w, stream, tiles_C());
  }
  int64_t dequantize_workspace_cuda() const { return 0; }
#endif
  template <class T>
  void dequantize_cpu(T* w) const {
    qf::int4::dequantize_cpu(qweight, scales, zeros, M * K / group_size, group_size, w, tiles_C());
  }
  void cpu(const float* x, int64_t N, float* y) const {
    gemm::int4_gemm_cpu(x, N, K, M, qweight, scales, zeros, group_size, y, tiles);
  }
};

// The int4 weight [M, K] as a Linear (checked here, once). CUDA: group_size = 32 * 2^j
// (formats/int4/int4_gemm_cuda.h); CPU: any multiple of 8 dividing K. tiles: the buffers are in
// the "tiles" layout (M % 16 == 0).
PackedLinear<Int4Linear> make_linear(const InArray& qweight, const InArray& scales, const std::optional<InArray>& zeros,
                                     int64_t M, int64_t K, int64_t group_size, bool tiles) {
  nonneg(M, "M");
  nonneg(K, "K");
  const Device dev = device_of(qweight, 0, "qweight");
  check_buffers(mul(M, K, "M * K"), group_size, qweight, scales, zeros, dev);
  if (K % group_size) throw std::invalid_argument("K must be a multiple of group_size");
  if (dev.cuda && !gemm::int4_gemm_cuda_supports(group_size))
    throw std::invalid_argument("the CUDA GEMM needs group_size = 32 * 2^j");
  if (tiles) tiles_groups(K, mul(M, K, "M * K"), group_size, "K");
  std::vector<InArray> keep{qweight, scales};
  if (zeros) keep.push_back(*zeros);
  return packed_linear(
      Int4Linear{cptr<uint8_t>(qweight), cptr<float>(scales), zeros_ptr(zeros), M, K, group_size, tiles}, M, K, qweight,
      std::move(keep));
}

// x: float [N, K] (float32, float16 or bfloat16); weight buffers of an [M, K] int4 tensor. CPU:
// x converted to float32 exactly, out float32 [N, M]. CUDA: out [N, M] in x's dtype.
void weight_only_gemm(const InArray& x, const InArray& qweight, const InArray& scales,
                      const std::optional<InArray>& zeros, const OutArray& out, int64_t N, int64_t K, int64_t M,
                      int64_t group_size, uintptr_t stream, const std::optional<OutArray>& workspace, bool tiles) {
  nonneg(N, "N");
  nonneg(K, "K");
  nonneg(M, "M");
  require_numel(x, mul(N, K, "N * K"), "x");
  make_linear(qweight, scales, zeros, M, K, group_size, tiles)(x, out, std::nullopt, workspace, stream);
}

// a: uint8 [N, K/2], b: uint8 [M, K/2] (symmetric packed codes); out: int32 [N, M].
void int4_matmul(const InArray& a, const InArray& b, const OutArray& out, int64_t N, int64_t M, int64_t K,
                 uintptr_t stream) {
  nonneg(N, "N");
  nonneg(M, "M");
  nonneg(K, "K");
  if (K % 2) throw std::invalid_argument("K must be even, got " + std::to_string(K));
  if (K > gemm::kInt4MaxK) throw std::invalid_argument("K > 33554431: the int32 result could overflow");
  const Device dev = device_of(a, stream, "a");
  require<uint8_t>(a, "a", dev);
  require<uint8_t>(b, "b", dev);
  require<int32_t>(out, "out", dev);
  require_numel(a, mul(N, K / 2, "N * K / 2"), "a");
  require_numel(b, mul(M, K / 2, "M * K / 2"), "b");
  require_numel(out, mul(N, M, "N * M"), "out");
  if (N == 0 || M == 0) return;  // no output (nb_common.h)
  if (dev.cuda) {
    QF_ON_CUDA(gemm::int4_matmul_cuda(cptr<uint8_t>(a), cptr<uint8_t>(b), mptr<int32_t>(out), N, M, K, dev.stream));
  } else {
    gemm::int4_matmul_cpu(cptr<uint8_t>(a), cptr<uint8_t>(b), mptr<int32_t>(out), N, M, K);
  }
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() =
      "int4 native codec (asymmetric/symmetric groups), weight-only GEMM and int4 x int4 GEMM; "
      "called through qformats.int4.";
  m.def("quantize", &quantize, nb::arg("x"), nb::arg("qweight"), nb::arg("scales"), nb::arg("zeros").none(),
        nb::arg("group_size"), nb::arg("stream") = 0, release_gil());
  m.def("dequantize", &dequantize, nb::arg("qweight"), nb::arg("scales"), nb::arg("zeros").none(), nb::arg("out"),
        nb::arg("group_size"), nb::arg("stream") = 0, nb::arg("tiles_K") = 0, release_gil());
  m.def("pack", &pack, nb::arg("values"), nb::arg("out"), nb::arg("stream") = 0, release_gil());
  m.def("unpack", &unpack, nb::arg("packed"), nb::arg("out"), nb::arg("stream") = 0, release_gil());
  m.def("gemm", &weight_only_gemm, nb::arg("x"), nb::arg("qweight"), nb::arg("scales"), nb::arg("zeros").none(),
        nb::arg("out"), nb::arg("N"), nb::arg("K"), nb::arg("M"), nb::arg("group_size"), nb::arg("stream") = 0,
        nb::arg("workspace").none() = nb::none(), nb::arg("tiles") = false, release_gil());
  bind_linear<Int4Linear>(m, "An int4 weight [M, K] bound for repeated x . W^T (+ bias) calls.");
  m.def("make_linear", &make_linear, nb::arg("qweight"), nb::arg("scales"), nb::arg("zeros").none(), nb::arg("M"),
        nb::arg("K"), nb::arg("group_size"), nb::arg("tiles") = false);
  m.def("gemm_cuda_supports", &gemm::int4_gemm_cuda_supports, nb::arg("group_size"),
        "Whether the CUDA weight-only GEMM takes this group_size (32 * 2^j).");
  m.def("int4_matmul", &int4_matmul, nb::arg("a"), nb::arg("b"), nb::arg("out"), nb::arg("N"), nb::arg("M"),
        nb::arg("K"), nb::arg("stream") = 0, release_gil());
  m.def("gemm_isa", &gemm_isa, "Instruction set of the CPU GEMM kernels in use (QFORMATS_GEMM_ISA lowers it).");
}
