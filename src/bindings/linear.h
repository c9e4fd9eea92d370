// A quantized weight W [M, K] checked once and bound to its buffers, for repeated products
// y [N, M] = x [N, K] . W^T (+ bias): what qformats.nn.QuantizedLinear calls on every forward,
// and what each format's public `gemm` adapter builds for a single call.
//
// The Python object holds the weight's nb::ndarray buffers (which keep their owners, numpy
// arrays or torch tensors, alive) and a format policy `Impl` with the raw pointers and sizes,
// so a call converts only x, out and bias: the weight's buffers and parameters are validated
// when the object is made, not per call. Calls still check what they are given (device, dtype,
// contiguity, sizes, alignment), so a direct call cannot reach a kernel with a wrong pointer.
//
// Impl provides
//   template <class T> void cuda(const T* x, int64_t N, T* y, const T* bias, gemm::GemmWorkspace ws,
//                                void* stream) const;
//       (CUDA builds; y and bias in x's dtype, bias may be nullptr; ws: the caller's workspace,
//       gemm/weight_only_cuda.h, maybe empty)
//   int64_t workspace_cuda(int64_t N) const;   bytes of workspace a product of N rows may use (CUDA builds)
//   void cpu(const float* x, int64_t N, float* y) const;     float32 activations and output
// and, for the dense path above the kernel's rows (W decoded, then a dense GEMM), W [M, K]
// decoded exactly as the format's dequantize decodes it, T float / half_t / bf16_t:
//   template <class T> void dequantize_cuda(T* w, void* workspace, int64_t workspace_bytes,
//                                           void* stream) const;    (CUDA builds)
//   int64_t dequantize_workspace_cuda() const;  bytes of device workspace it needs (CUDA builds)
//   template <class T> void dequantize_cpu(T* w) const;
// Each extension binds its own PackedLinear<Impl> type (Impl differs), so the Python name
// `Linear` may repeat across the format modules without a nanobind type clash.
#pragma once
#include <nanobind/stl/optional.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings/bind_args.h"
#include "bindings/dlpack_exchange.h"
#include "bindings/nb_common.h"
#include "gemm/weight_only_cuda.h"

namespace qf::bind {

template <class Impl>
struct PackedLinear {
  Impl impl;
  int64_t M = 0, K = 0;
  Device dev;                 // where the weight lives (stream unset)
  std::vector<InArray> keep;  // the buffers Impl points into

  // x [..., K] (float32 / float16 / bfloat16, C-contiguous) on the weight's device; out [N, M]
  // with N = numel(x) / K: x's dtype on CUDA, float32 on the CPU; bias [M] of out's dtype or None.
  // CUDA: launched on `stream` of the current device (the caller makes the weight's device
  // current), x and out 16-byte aligned; workspace: uint8 on that device (16-byte aligned), of
  // gemm_workspace(N) bytes where that is > 0 (a smaller one or none: the same product to within
  // float32 rounding, maybe slower), its contents overwritten. CPU: threaded; the bias is added
  // after the product, and the workspace is not used.
  void operator()(const InArray& x, const OutArray& out, const std::optional<InArray>& bias,
                  const std::optional<OutArray>& workspace, uintptr_t stream) const {
    Device d = device_of(x, stream, "x");
    if (d.cuda != dev.cuda || (d.cuda && d.id != dev.id))
      throw std::invalid_argument("x: all arrays of a call must be on the same device (x is not on the weight's)");
    require_contiguous_on(x, "x", d);
    if (x.ndim() < 1 || static_cast<int64_t>(x.shape(x.ndim() - 1)) != K)
      throw std::invalid_argument("x: expected shape [..., " + std::to_string(K) + "]");
    // x's rows: the product of its leading dimensions, checked (with K = 0 they are not
    // bounded by x's element count)
    int64_t N = 1;
    for (size_t i = 0; i + 1 < x.ndim(); ++i) N = mul(N, static_cast<int64_t>(x.shape(i)), "x (rows)");
    require_numel(out, mul(N, M, "out (N * M)"), "out");
    if (bias) {
      require_contiguous_on(*bias, "bias", d);
      require_numel(*bias, M, "bias");
      if (bias->dtype() != out.dtype()) throw nb::type_error("bias: expected the dtype of out");
    }
    gemm::GemmWorkspace ws;
    if (workspace) {
      require<uint8_t>(*workspace, "workspace", d);
      ws = {mptr<void>(*workspace), numel(*workspace, "workspace")};
      // (the kernel writes it while it reads x and writes out)
      auto overlaps = [&](const void* p, size_t n) {
        const auto* a = static_cast<const uint8_t*>(ws.ptr);
        const auto* b = static_cast<const uint8_t*>(p);
        return ws.bytes > 0 && n > 0 && a < b + n && b < a + ws.bytes;
      };
      if (overlaps(x.data(), x.nbytes()) || overlaps(out.data(), out.nbytes()))
        throw std::invalid_argument("workspace: must not overlap x or out");
    }
    if (d.cuda) {
      dispatch_cuda_x_out(x, out, d, [&](auto* px, auto* py) {
        using T = std::remove_pointer_t<decltype(py)>;
        const T* pb = bias ? cptr<T>(*bias) : nullptr;
        if (N == 0 || M == 0) return;  // no output (nb_common.h)
        QF_ON_CUDA(impl.cuda(px, N, py, pb, ws, d.stream));
        (void)pb;
      });
      return;
    }
    require<float>(out, "out");
    std::vector<float> buf;
    const float* px = float32_activations(x, "x", buf);
    float* py = mptr<float>(out);
    if (N == 0 || M == 0) return;  // no output (nb_common.h)
    impl.cpu(px, N, py);
    if (bias) {
      const float* pb = cptr<float>(*bias);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t m = 0; m < M; ++m) py[n * M + m] += pb[m];
    }
  }

  // out [M, K] (float32 / float16 / bfloat16, C-contiguous) on the weight's device: W decoded
  // as the format's dequantize decodes it. workspace: uint8 of at least `dequantize_workspace`
  // bytes on the same device where that is > 0 (ignored otherwise). CUDA: on `stream`.
  void dequantize(const OutArray& out, const std::optional<OutArray>& workspace, uintptr_t stream) const {
    Device d = device_of(out, stream, "out");
    if (d.cuda != dev.cuda || (d.cuda && d.id != dev.id))
      throw std::invalid_argument("out: must be on the weight's device");
    require_numel(out, mul(M, K, "M * K"), "out");
    void* ws = nullptr;
    int64_t ws_bytes = 0;
    const int64_t need = workspace_bytes();
    if (need > 0) {
      if (!workspace) throw std::invalid_argument("workspace: this weight needs " + std::to_string(need) + " bytes");
      require<uint8_t>(*workspace, "workspace", d);
      ws_bytes = numel(*workspace, "workspace");
      if (ws_bytes < need)
        throw std::invalid_argument("workspace: expected at least " + std::to_string(need) + " bytes");
      ws = mptr<void>(*workspace);
    }
    (void)ws;  // unused in CPU-only builds
    dispatch_float_out(out, "out", d, [&](auto* pw) {
      if (M == 0 || K == 0) return;  // no output (nb_common.h)
      if (d.cuda) {
        QF_ON_CUDA(impl.dequantize_cuda(pw, ws, ws_bytes, d.stream));
      } else {
        impl.dequantize_cpu(pw);
      }
    });
  }

  // Device workspace bytes that a product of `rows` activation rows may use (0: none; always 0 on
  // the CPU). CUDA: for the current device, which must be the weight's.
  int64_t gemm_workspace(int64_t rows) const {
#if defined(QFORMATS_WITH_CUDA)
    if (dev.cuda && rows > 0) return impl.workspace_cuda(rows);
#endif
    (void)rows;
    return 0;
  }

  // Device workspace bytes that dequantize needs (0: none).
  int64_t workspace_bytes() const {
#if defined(QFORMATS_WITH_CUDA)
    if (dev.cuda) return impl.dequantize_workspace_cuda();
#endif
    return 0;
  }

  void dequantize_call(nb::handle out, nb::handle workspace, uintptr_t stream) const {
    const OutArray oa = import_array<OutArray>(out, "out");
    std::optional<OutArray> wa;
    if (!workspace.is_none()) wa = import_array<OutArray>(workspace, "workspace");
    nb::gil_scoped_release release;
    dequantize(oa, wa, stream);
  }

  // The Python-facing call: arguments imported without the __dlpack__ protocol where their type
  // allows (bindings/dlpack_exchange.h), then the product without the GIL.
  void call(nb::handle x, nb::handle out, nb::handle bias, uintptr_t stream, nb::handle workspace) const {
    const InArray xa = import_array<InArray>(x, "x");
    const OutArray oa = import_array<OutArray>(out, "out");
    std::optional<InArray> ba;
    if (!bias.is_none()) ba = import_array<InArray>(bias, "bias");
    std::optional<OutArray> wa;
    if (!workspace.is_none()) wa = import_array<OutArray>(workspace, "workspace");
    nb::gil_scoped_release release;
    (*this)(xa, oa, ba, wa, stream);
  }
};

// Binds PackedLinear<Impl> as `<module>.<name>` (default Linear; one name per Impl of a module): call(x, out,
// bias=None, stream=0, workspace=None) and dequantize(out, workspace=None, stream=0) without the GIL,
// gemm_workspace(rows) (bytes), and read-only M, K, dequantize_workspace (bytes), device ("cpu" or
// "cuda:<id>").
template <class Impl>
void bind_linear(nb::module_& m, const char* doc, const char* name = "Linear") {
  using L = PackedLinear<Impl>;
  // Layers kept by module-level objects (a model in a script's globals) are still alive when the
  // interpreter exits; nanobind would report each bound weight as a leak then.
  nb::set_leak_warnings(false);
  nb::class_<L>(m, name, doc)
      .def("__call__", &L::call, nb::arg("x"), nb::arg("out"), nb::arg("bias").none() = nb::none(),
           nb::arg("stream") = 0, nb::arg("workspace").none() = nb::none(),
           "out [N, M] = x [..., K] . W^T (+ bias [M]); stream: a cudaStream_t as an int (CUDA); workspace: "
           "None or uint8 on the weight's device of gemm_workspace(N) bytes (CUDA; the product may run "
           "faster with it, same numbers to within float32 rounding). ValueError for another device, shape "
           "or size, TypeError for another dtype.")
      .def("gemm_workspace", &L::gemm_workspace, nb::arg("rows"),
           "Bytes of device workspace that a product of `rows` activation rows may use (0: none; the "
           "weight's device must be the current one).")
      .def("dequantize", &L::dequantize_call, nb::arg("out"), nb::arg("workspace").none() = nb::none(),
           nb::arg("stream") = 0,
           "Decode W into out [M, K] (float32 / float16 / bfloat16, C-contiguous, on the weight's device) "
           "as the format's dequantize does; workspace: uint8 of at least dequantize_workspace bytes on "
           "that device where that is > 0; stream: a cudaStream_t as an int (CUDA). ValueError for another "
           "device, size or a missing workspace, TypeError for another dtype.")
      .def_prop_ro("dequantize_workspace", &L::workspace_bytes,
                   "Bytes of device workspace that dequantize needs (0: none).")
      .def_ro("M", &L::M)
      .def_ro("K", &L::K)
      .def_prop_ro("device",
                   [](const L& l) { return l.dev.cuda ? "cuda:" + std::to_string(l.dev.id) : std::string("cpu"); });
}

// A PackedLinear on the device of `first` (every buffer in `keep` must be there too, which the
// format's own checks ensure).
template <class Impl>
PackedLinear<Impl> packed_linear(Impl impl, int64_t M, int64_t K, const InArray& first, std::vector<InArray> keep) {
  nonneg(M, "M");
  nonneg(K, "K");
  PackedLinear<Impl> l{std::move(impl), M, K, device_of(first, 0, "weight"), std::move(keep)};
  return l;
}

}  // namespace qf::bind
