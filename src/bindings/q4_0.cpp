// qformats.q4_0._native: q4_0 codec (formats/q4_0) and the q4_0 x q8_1 GEMM (gemm/).
// Adapters check the arrays, then call the kernels without the GIL.
#include "formats/q4_0/q4_0.h"
#include "bindings/bind_args.h"
#include "bindings/linear.h"
#include "bindings/nb_common.h"
#include "formats/q4_0/q4_0_gemm_cpu.h"
#include "formats/q4_0/q4_0_gemm_cuda.h"
#include "gemm/q4_0_q8_1.h"

using namespace qf;
using namespace qf::bind;

namespace {

// x: float [rows, K] (any leading shape, C-contiguous), out: uint8 with K/32 * 18 bytes per row.
void quantize(const InArray& x, const OutArray& out, uintptr_t stream) {
  const Device dev = device_of(x, stream, "x");
  require<uint8_t>(out, "out", dev);
  const int64_t n = numel(x, "x");
  if (n % q4_0::QK) throw std::invalid_argument("x: element count must be a multiple of 32");
  const int64_t n_blocks = n / q4_0::QK;
  require_numel(out, mul(n_blocks, int64_t(sizeof(q4_0::block_q4_0)), "out (18 bytes per block of x)"), "out");
  auto* y = mptr<q4_0::block_q4_0>(out);
  dispatch_float(x, "x", dev, [&](auto* px) {
    if (dev.cuda) {
      QF_ON_CUDA(q4_0::quantize_cuda(px, n_blocks, y, dev.stream));
    } else {
      q4_0::quantize_cpu(px, n_blocks, y);
    }
  });
}

// out: float32, float16 or bfloat16 with 32 values per block (decoded in float32, rounded once).
void dequantize(const InArray& blocks, const OutArray& out, uintptr_t stream) {
  const Device dev = device_of(blocks, stream, "blocks");
  require<uint8_t>(blocks, "blocks", dev);
  const int64_t nbytes = numel(blocks, "blocks");
  if (nbytes % int64_t(sizeof(q4_0::block_q4_0)))
    throw std::invalid_argument("blocks: size must be a multiple of 18 bytes");
  const int64_t n_blocks = nbytes / int64_t(sizeof(q4_0::block_q4_0));
  require_numel(out, mul(n_blocks, q4_0::QK, "out (32 values per block)"), "out");
  const auto* x = cptr<q4_0::block_q4_0>(blocks);
  dispatch_float_out(out, "out", dev, [&](auto* py) {
    if (dev.cuda) {
      QF_ON_CUDA(q4_0::dequantize_cuda(x, n_blocks, py, dev.stream));
    } else {
      q4_0::dequantize_cpu(x, n_blocks, py);
    }
  });
}

// M, N, K of the q4_0 x q8_1 GEMM: non-negative, K a multiple of 32, and the sizes the CPU and
// CUDA paths compute from them (the operands' bytes, the output, the CUDA workspace's
// (M + N) * K codes and its K / 32 blocks of scales for N and M rows padded to 64 and 128, 4 and
// 8 bytes each: at most 12 bytes for each of M + N + 192 rows) within int64.
void check_gemm_dims(int64_t M, int64_t N, int64_t K) {
  nonneg(M, "M");
  nonneg(N, "N");
  nonneg(K, "K");
  if (K % q4_0::QK) throw std::invalid_argument("K must be a multiple of 32, got " + std::to_string(K));
  const int64_t rows = add(M, N, "M + N");
  add(mul(rows, K, "(M + N) * K"),
      mul({add(rows, 192, "M + N + 192"), K / q4_0::QK, int64_t(3 * sizeof(float))}, "(M + N + 192) * K / 32 * 12"),
      "workspace bytes");
  mul({M, K / q4_0::QK, int64_t(sizeof(q4_0::block_q4_0))}, "M * K / 32 * 18");
  mul({N, K / q8_1::QK, int64_t(sizeof(q8_1::block_q8_1))}, "N * K / 32 * 36");
  mul(M, N, "M * N");
}

// Bytes of CUDA workspace gemm_q4_0_q8_1 can use for these dims (0: none needed; CPU-only
// builds: 0).
int64_t gemm_q4_0_q8_1_workspace_bytes(int64_t M, int64_t N, int64_t K) {
  check_gemm_dims(M, N, K);
#if defined(QFORMATS_WITH_CUDA)
  return gemm::q4_0_q8_1_cuda_workspace_bytes(M, N, K);
#else
  return 0;
#endif
}

// out: [M, N] (W . A^T, the seed's layout) or, with out_nm, [N, M] (a linear layer's output).
// CPU: float32. CUDA: float32, float16 or bfloat16 (the float32 sum rounded once).
// workspace (CUDA, optional): uint8 of at least gemm_q4_0_q8_1_workspace_bytes(M, N, K) on the
// call's device; with it, N > 16 runs on the pipelined int8 tensor-core kernel.
void gemm_q4_0_q8_1(const InArray& w, const InArray& a, const OutArray& out, int64_t M, int64_t N, int64_t K,
                    bool out_nm, const OutArray& workspace, uintptr_t stream) {
  check_gemm_dims(M, N, K);
  const Device dev = device_of(w, stream, "weight_q");
  require<uint8_t>(w, "weight_q", dev);
  require<uint8_t>(a, "activation_q", dev);
  require_numel(w, mul({M, K / q4_0::QK, int64_t(sizeof(q4_0::block_q4_0))}, "M * K / 32 * 18"), "weight_q");
  require_numel(a, mul({N, K / q8_1::QK, int64_t(sizeof(q8_1::block_q8_1))}, "N * K / 32 * 36"), "activation_q");
  require_numel(out, mul(M, N, "M * N"), "out");
  const bool empty = M == 0 || N == 0;  // no output (nb_common.h)
  const int64_t ldo_m = out_nm ? 1 : N, ldo_n = out_nm ? M : 1;
  const auto* pw = cptr<q4_0::block_q4_0>(w);
  const auto* pa = cptr<q8_1::block_q8_1>(a);
  if (dev.cuda) {
    void* ws = nullptr;
    if (workspace.is_valid()) {
      require<uint8_t>(workspace, "workspace", dev);
      if (numel(workspace, "workspace") < gemm_q4_0_q8_1_workspace_bytes(M, N, K))
        throw std::invalid_argument("workspace: smaller than gemm_q4_0_q8_1_workspace_bytes(M, N, K)");
      ws = workspace.data();
    }
    dispatch_float_out(out, "out", dev, [&](auto* py) {
      if (empty) return;
      QF_ON_CUDA(gemm::q4_0_q8_1_cuda(pw, pa, M, N, K, py, ldo_m, ldo_n, ws, dev.stream));
    });
    return;
  }
  require<float>(out, "out");
  if (empty) return;
  gemm::q4_0_q8_1_cpu(pw, pa, M, N, K, mptr<float>(out), ldo_m, ldo_n);
}

// Checks of the weight-side GEMMs: x [N, K] float (float32/float16/bfloat16), w q4_0 blocks of
// an [M, K] tensor, out float32 [N, M]; all CPU, C-contiguous.
void check_x_w_out(const InArray& x, const InArray& w, const OutArray& out, int64_t M, int64_t N, int64_t K) {
  nonneg(M, "M");
  nonneg(N, "N");
  nonneg(K, "K");
  if (K % q4_0::QK) throw std::invalid_argument("K must be a multiple of 32, got " + std::to_string(K));
  require<uint8_t>(w, "w");
  require<float>(out, "out");
  require_cpu_contiguous(x, "x");
  require_numel(x, mul(N, K, "N * K"), "x");
  require_numel(w, mul({M, K / q4_0::QK, int64_t(sizeof(q4_0::block_q4_0))}, "M * K / 32 * 18"), "w");
  require_numel(out, mul(N, M, "N * M"), "out");
}

// llama.cpp's linear layer: x quantized to q8_1 on the fly, then the integer q4_0 x q8_1 GEMM;
// out [N, M] = (W . x_q^T)^T.
void linear(const InArray& x, const InArray& w, const OutArray& out, int64_t M, int64_t N, int64_t K) {
  check_x_w_out(x, w, out, M, N, K);
  const auto* pw = cptr<q4_0::block_q4_0>(w);
  dispatch_float(x, "x", [&](auto* px) {
    if (N == 0 || M == 0) return;  // no output (nb_common.h)
    gemm::linear_q4_0_cpu(px, N, K, pw, M, mptr<float>(out));
  });
}

// The policy of bindings/linear.h over q4_0 blocks of an [M, K] weight. CUDA: the weight-only
// kernel (blocks decoded in registers, x's dtype out). CPU: with q8_1_activations, llama.cpp's
// path (each row of x quantized to q8_1 blocks, integer q4_0 x q8_1 dot products); otherwise the
// weight-only float32 GEMM (blocks decoded exactly, as dequantize gives them).
struct Q4_0Linear {
  const q4_0::block_q4_0* w;
  int64_t M, K;
  bool q8_1_activations;
#if defined(QFORMATS_WITH_CUDA)
  template <class T>
  void cuda(const T* x, int64_t N, T* y, const T* bias, gemm::GemmWorkspace ws, void* stream) const {
    gemm::q4_0_gemm_cuda(x, N, K, M, w, y, bias, ws, stream);
  }
  int64_t workspace_cuda(int64_t N) const { return gemm::weight_only_workspace_bytes_cuda(N, M, K); }
  template <class T>
  void dequantize_cuda(T* out, void*, int64_t, void* stream) const {
    q4_0::dequantize_cuda(w, M * K / q4_0::QK, out, stream);
  }
  int64_t dequantize_workspace_cuda() const { return 0; }
#endif
  template <class T>
  void dequantize_cpu(T* out) const {
    q4_0::dequantize_cpu(w, M * K / q4_0::QK, out);
  }
  void cpu(const float* x, int64_t N, float* y) const {
    if (q8_1_activations) gemm::linear_q4_0_cpu(x, N, K, w, M, y);
    else gemm::q4_0_gemm_cpu(x, N, K, M, w, y);
  }
};

// q4_0 blocks (uint8 [M, K / 32, 18]) of an [M, K] weight as a Linear, checked here once.
PackedLinear<Q4_0Linear> make_linear(const InArray& w, int64_t M, int64_t K, bool q8_1_activations) {
  nonneg(M, "M");
  nonneg(K, "K");
  if (K % q4_0::QK) throw std::invalid_argument("K must be a multiple of 32, got " + std::to_string(K));
  const Device dev = device_of(w, 0, "w");
  require<uint8_t>(w, "w", dev);
  require_numel(w, mul({M, K / q4_0::QK, int64_t(sizeof(q4_0::block_q4_0))}, "M * K / 32 * 18"), "w");
  return packed_linear(Q4_0Linear{cptr<q4_0::block_q4_0>(w), M, K, q8_1_activations}, M, K, w, {w});
}

// Weight-only: out [N, M] = x . W^T, W decoded a tile at a time (CPU: float32 out) or in
// registers (CUDA: out in x's dtype).
void weight_only_gemm(const InArray& x, const InArray& w, const OutArray& out, int64_t M, int64_t N, int64_t K,
                      uintptr_t stream, const std::optional<OutArray>& workspace) {
  nonneg(N, "N");
  nonneg(K, "K");
  require_numel(x, mul(N, K, "N * K"), "x");
  make_linear(w, M, K, false)(x, out, std::nullopt, workspace, stream);
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "q4_0 (GGML) native codec and q4_0 x q8_1 GEMM; called through qformats.q4_0.";
  m.def("quantize", &quantize, nb::arg("x"), nb::arg("out"), nb::arg("stream") = 0, release_gil());
  m.def("dequantize", &dequantize, nb::arg("blocks"), nb::arg("out"), nb::arg("stream") = 0, release_gil());
  m.def("gemm_q4_0_q8_1", &gemm_q4_0_q8_1, nb::arg("weight_q"), nb::arg("activation_q"), nb::arg("out"), nb::arg("M"),
        nb::arg("N"), nb::arg("K"), nb::arg("out_nm") = false, nb::arg("workspace").none() = nb::none(),
        nb::arg("stream") = 0, release_gil());
  m.def("gemm_q4_0_q8_1_workspace_bytes", &gemm_q4_0_q8_1_workspace_bytes, nb::arg("M"), nb::arg("N"), nb::arg("K"));
  m.def("linear", &linear, nb::arg("x"), nb::arg("w"), nb::arg("out"), nb::arg("M"), nb::arg("N"), nb::arg("K"),
        release_gil());
  bind_linear<Q4_0Linear>(m, "A q4_0 weight [M, K] bound for repeated x . W^T (+ bias) calls.");
  m.def("make_linear", &make_linear, nb::arg("w"), nb::arg("M"), nb::arg("K"), nb::arg("q8_1_activations"));
  m.def("gemm", &weight_only_gemm, nb::arg("x"), nb::arg("w"), nb::arg("out"), nb::arg("M"), nb::arg("N"), nb::arg("K"),
        nb::arg("stream") = 0, nb::arg("workspace").none() = nb::none(), release_gil());
  m.def("gemm_isa", &gemm_isa, "Instruction set of the CPU GEMM kernels in use (QFORMATS_GEMM_ISA lowers it).");
}
