// qformats.int8._native: symmetric absmax int8 codec (formats/int8) and the int8 x int8 ->
// int32 GEMM (gemm/int8_int8). Adapters check the arrays, then call the kernels without the GIL.
#include "formats/int8/int8.h"
#include <nanobind/stl/optional.h>
#include "bindings/nb_common.h"
#include "formats/int8/int8_gemm_cpu.h"

#include <optional>

#include "bindings/bind_args.h"
#include "bindings/linear.h"
#include "gemm/int8_int8.h"

using namespace qf;
using namespace qf::bind;

namespace {

// x: float [...] (C-contiguous), q: int8 with as many elements, scale: float32 with one
// element per unit of unit_len consecutive values (numel(x) == numel(scale) * unit_len).
// All on the CPU, or all on one CUDA device (launched on `stream`).
void quantize(const InArray& x, const OutArray& q, const OutArray& scale, int64_t unit_len, uintptr_t stream) {
  const Device dev = device_of(x, stream, "x");
  require<int8_t>(q, "q", dev);
  require<float>(scale, "scale", dev);
  nonneg(unit_len, "unit_len");
  const int64_t n = numel(x, "x"), n_units = numel(scale, "scale");
  if (n != mul(n_units, unit_len, "unit_len (numel(scale) * unit_len)"))
    throw std::invalid_argument("x: element count must be numel(scale) * unit_len");
  require_numel(q, n, "q");
  auto* pq = mptr<int8_t>(q);
  auto* ps = mptr<float>(scale);
  dispatch_float(x, "x", dev, [&](auto* px) {
    if (n_units == 0) return;  // no output (nb_common.h)
    if (dev.cuda) {
      QF_ON_CUDA(int8::quantize_cuda(px, n_units, unit_len, pq, ps, dev.stream));
    } else {
      int8::quantize_cpu(px, n_units, unit_len, pq, ps);
    }
  });
}

// out: float32, float16 or bfloat16 (decoded in float32, rounded once).
void dequantize(const InArray& q, const InArray& scale, const OutArray& out, int64_t unit_len, uintptr_t stream) {
  const Device dev = device_of(q, stream, "q");
  require<int8_t>(q, "q", dev);
  require<float>(scale, "scale", dev);
  nonneg(unit_len, "unit_len");
  const int64_t n = numel(q, "q"), n_units = numel(scale, "scale");
  if (n != mul(n_units, unit_len, "unit_len (numel(scale) * unit_len)"))
    throw std::invalid_argument("q: element count must be numel(scale) * unit_len");
  require_numel(out, n, "out");
  const auto* pq = cptr<int8_t>(q);
  const auto* ps = cptr<float>(scale);
  dispatch_float_out(out, "out", dev, [&](auto* py) {
    if (n_units == 0) return;  // no output (nb_common.h)
    if (dev.cuda) {
      QF_ON_CUDA(int8::dequantize_cuda(pq, ps, n_units, unit_len, py, dev.stream));
    } else {
      int8::dequantize_cpu(pq, ps, n_units, unit_len, py);
    }
  });
}

// a: int8 [N, K], b: int8 [M, K], out: int32 [N, M], all on one device (CPU or CUDA).
void int8_matmul(const InArray& a, const InArray& b, const OutArray& out, int64_t N, int64_t M, int64_t K,
                 uintptr_t stream) {
  nonneg(N, "N");
  nonneg(M, "M");
  nonneg(K, "K");
  if (K > gemm::kInt8MaxK) throw std::invalid_argument("K > 131071: the int32 result could overflow");
  const Device dev = device_of(a, stream, "a");
  require<int8_t>(a, "a", dev);
  require<int8_t>(b, "b", dev);
  require<int32_t>(out, "out", dev);
  require_numel(a, mul(N, K, "N * K"), "a");
  require_numel(b, mul(M, K, "M * K"), "b");
  require_numel(out, mul(N, M, "N * M"), "out");
  if (N == 0 || M == 0) return;  // no output (nb_common.h)
  if (dev.cuda) {
    QF_ON_CUDA(gemm::int8_matmul_cuda(cptr<int8_t>(a), cptr<int8_t>(b), mptr<int32_t>(out), N, M, K, dev.stream));
  } else {
    gemm::int8_matmul_cpu(cptr<int8_t>(a), cptr<int8_t>(b), mptr<int32_t>(out), N, M, K);
  }
}

// The fused int8 linear layer: a int8 [N, K], a_scale float32 [N] or [1], b int8 [M, K],
// b_scale float32 [M] or [1], bias None or [M] (CPU: float32/float16/bfloat16; CUDA: float32),
// out [N, M] of float32, float16 or bfloat16: relu?(acc * (a_scale * b_scale * scale_c) + bias).
void int8_linear(const InArray& a, const InArray& a_scale, const InArray& b, const InArray& b_scale,
                 const std::optional<InArray>& bias, bool relu, double scale_c, const OutArray& out, int64_t N,
                 int64_t M, int64_t K, uintptr_t stream) {
  nonneg(N, "N");
  nonneg(M, "M");
  nonneg(K, "K");
  if (K > gemm::kInt8MaxK) throw std::invalid_argument("K > 131071: the int32 result could overflow");
  const Device dev = device_of(a, stream, "x_q");
  require<int8_t>(a, "x_q", dev);
  require<int8_t>(b, "w_q", dev);
  require<float>(a_scale, "x_scale", dev);
  require<float>(b_scale, "w_scale", dev);
  require_numel(a, mul(N, K, "N * K"), "x_q");
  require_numel(b, mul(M, K, "M * K"), "w_q");
  require_numel(out, mul(N, M, "N * M"), "out");
  const int64_t na = numel(a_scale, "x_scale"), nw = numel(b_scale, "w_scale");
  if (na != N && na != 1) throw std::invalid_argument("x_scale: expected N or 1 elements");
  if (nw != M && nw != 1) throw std::invalid_argument("w_scale: expected M or 1 elements");
  std::vector<float> bias_buf;
  const float* pbias = nullptr;
  if (bias) {
    require_numel(*bias, M, "bias");
    if (dev.cuda) {
      require<float>(*bias, "bias", dev);
      pbias = cptr<float>(*bias);
    } else {
      pbias = float32_activations(*bias, "bias", bias_buf);
    }
  }
  dispatch_float_out(out, "out", dev, [&](auto* py) {
    if (N == 0 || M == 0) return;  // no output (nb_common.h)
    if (dev.cuda) {
      QF_ON_CUDA(gemm::int8_linear_cuda(cptr<int8_t>(a), cptr<float>(a_scale), na == N, cptr<int8_t>(b),
                                        cptr<float>(b_scale), nw == M, pbias, relu, static_cast<float>(scale_c), py, N,
                                        M, K, dev.stream));
    } else {
      gemm::int8_linear_cpu(cptr<int8_t>(a), cptr<float>(a_scale), na == N, cptr<int8_t>(b), cptr<float>(b_scale),
                            nw == M, pbias, relu, static_cast<float>(scale_c), py, N, M, K);
    }
  });
}

// The weight-only GEMM's policy (bindings/linear.h) over an [M, K] int8 weight: codes q and
// the scale of row m, unit u at scales[m * scale_stride + u] (units of `unit` values). The product
// runs on the CPU only; on CUDA the bound weight serves the dense path (dequantize).
struct Int8Linear {
  const int8_t* q;
  const float* scales;
  int64_t M, K, unit, scale_stride;
#if defined(QFORMATS_WITH_CUDA)
  template <class T>
  void cuda(const T*, int64_t, T*, const T*, gemm::GemmWorkspace, void*) const {
    throw std::invalid_argument("int8: no CUDA weight-only kernel");
  }
  int64_t workspace_cuda(int64_t) const { return 0; }
  template <class T>
  void dequantize_cuda(T* w, void*, int64_t, void* stream) const {
    int8::dequantize_cuda(q, scales, n_units(), unit_len(), w, stream);
  }
  int64_t dequantize_workspace_cuda() const { return 0; }
#endif
  // the scale units as int8's dequantize counts them: one per tensor (stride 0) or per unit
  int64_t n_units() const { return scale_stride ? M * scale_stride : 1; }
  int64_t unit_len() const { return scale_stride ? unit : M * K; }
  template <class T>
  void dequantize_cpu(T* w) const {
    int8::dequantize_cpu(q, scales, n_units(), unit_len(), w);
  }
  void cpu(const float* x, int64_t N, float* y) const {
    gemm::int8_gemm_cpu(x, N, K, M, q, scales, unit, scale_stride, y);
  }
};

// The int8 weight [M, K] (q int8, scale float32 with one element per unit of unit_len values:
// unit_len = M * K per tensor, K per row, or a divisor of K per group) as a Linear, checked here
// once. On CUDA only its dequantize runs (the product raises: no CUDA weight-only kernel).
PackedLinear<Int8Linear> make_linear(const InArray& q, const InArray& scale, int64_t M, int64_t K, int64_t unit_len) {
  nonneg(M, "M");
  nonneg(K, "K");
  const int64_t n = mul(M, K, "M * K");
  const Device dev = device_of(q, 0, "q");
  require<int8_t>(q, "q", dev);
  require<float>(scale, "scale", dev);
  require_numel(q, n, "q");
  int64_t unit = 1, stride = 0;  // an empty weight reads no scale
  if (n > 0) {
    if (unit_len <= 0 || (unit_len != n && K % unit_len))
      throw std::invalid_argument("unit_len must be M * K (per tensor) or divide K");
    const bool per_tensor = unit_len == n && numel(scale, "scale") == 1;
    unit = per_tensor ? K : unit_len;
    stride = per_tensor ? 0 : K / unit;
    require_numel(scale, per_tensor ? 1 : mul(M, stride, "M * (K / unit_len)"), "scale");
  }
  return packed_linear(Int8Linear{cptr<int8_t>(q), cptr<float>(scale), M, K, unit, stride}, M, K, q, {q, scale});
}

// x: float [N, K] (float32, float16 or bfloat16, converted exactly); out float32 [N, M].
void weight_only_gemm(const InArray& x, const InArray& q, const InArray& scale, const OutArray& out, int64_t N,
                      int64_t K, int64_t M, int64_t unit_len) {
  nonneg(N, "N");
  nonneg(K, "K");
  nonneg(M, "M");
  require_numel(x, mul(N, K, "N * K"), "x");
  make_linear(q, scale, M, K, unit_len)(x, out, std::nullopt, std::nullopt, 0);
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "int8 (symmetric absmax) native codec and int8 x int8 -> int32 GEMM; called through qformats.int8.";
  m.def("quantize", &quantize, nb::arg("x"), nb::arg("q"), nb::arg("scale"), nb::arg("unit_len"), nb::arg("stream") = 0,
        release_gil());
  m.def("dequantize", &dequantize, nb::arg("q"), nb::arg("scale"), nb::arg("out"), nb::arg("unit_len"),
        nb::arg("stream") = 0, release_gil());
  m.def("int8_matmul", &int8_matmul, nb::arg("a"), nb::arg("b"), nb::arg("out"), nb::arg("N"), nb::arg("M"),
        nb::arg("K"), nb::arg("stream") = 0, release_gil());
  m.def("int8_linear", &int8_linear, nb::arg("a"), nb::arg("a_scale"), nb::arg("b"), nb::arg("b_scale"),
        nb::arg("bias").none(), nb::arg("relu"), nb::arg("scale_c"), nb::arg("out"), nb::arg("N"), nb::arg("M"),
        nb::arg("K"), nb::arg("stream") = 0, release_gil());
  m.def("gemm", &weight_only_gemm, nb::arg("x"), nb::arg("q"), nb::arg("scale"), nb::arg("out"), nb::arg("N"),
        nb::arg("K"), nb::arg("M"), nb::arg("unit_len"), release_gil());
  bind_linear<Int8Linear>(m, "An int8 weight [M, K] bound for repeated x . W^T (+ bias) calls (CPU).");
  m.def("make_linear", &make_linear, nb::arg("q"), nb::arg("scale"), nb::arg("M"), nb::arg("K"), nb::arg("unit_len"));
  m.def("gemm_isa", &gemm_isa, "Instruction set of the CPU GEMM kernels in use (QFORMATS_GEMM_ISA lowers it).");
}
