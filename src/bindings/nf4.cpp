// qformats.nf4._native: NF4 codec (formats/nf4), the double quantization of absmax, and the
// fp32-activation x nf4-weight GEMM (gemm/weight_only_cpu.h). Adapters check the arrays, then call
// the kernels without the GIL.
#include <nanobind/stl/vector.h>

#include <vector>

#include "bindings/bind_args.h"
#include "bindings/linear.h"
#include "bindings/nb_common.h"
#include "formats/nf4/nf4.h"
#include "formats/nf4/nf4_gemm_cpu.h"
#include "formats/nf4/nf4_gemm_cuda.h"

using namespace qf;
using namespace qf::bind;

namespace {

void check_blocksize(int64_t blocksize) {
  if (blocksize < nf4::kMinBlocksize || blocksize > nf4::kMaxBlocksize || (blocksize & (blocksize - 1)))
    throw std::invalid_argument("blocksize must be a power of two in [32, 4096], got " + std::to_string(blocksize));
}

int64_t n_blocks_of(int64_t n, int64_t blocksize) { return ceil_div(n, blocksize); }

// Each codec adapter runs where its first array lives: CPU arrays on the CPU kernels, CUDA arrays on
// the CUDA kernels, launched on `stream` (torch's current stream, passed by the Python layer, which
// also made the arrays' device current). Every array of a call must be on that device.

// x: float32/float16/bfloat16, any shape (flattened), C-contiguous.
// packed: uint8 [ceil(n/2)], absmax: float32 [ceil(n/blocksize)].
void quantize(const InArray& x, int64_t blocksize, const OutArray& packed, const OutArray& absmax, uintptr_t stream) {
  check_blocksize(blocksize);
  const Device dev = device_of(x, stream, "x");
  require<uint8_t>(packed, "packed", dev);
  require<float>(absmax, "absmax", dev);
  const int64_t n = numel(x, "x");
  require_numel(packed, ceil_div(n, 2), "packed");
  require_numel(absmax, n_blocks_of(n, blocksize), "absmax");
  auto* pk = mptr<uint8_t>(packed);
  auto* am = mptr<float>(absmax);
  dispatch_float(x, "x", dev, [&](auto* px) {
    if (dev.cuda) {
      QF_ON_CUDA(nf4::quantize_cuda(px, n, blocksize, pk, am, dev.stream));
    } else {
      nf4::quantize_cpu(px, n, blocksize, pk, am);
    }
  });
}

// packed uint8 [ceil(n/2)], absmax float32 [ceil(n/blocksize)] -> out [n] (n = out's size) of
// float32, float16 or bfloat16 (decoded in float32, rounded once).
void dequantize(const InArray& packed, const InArray& absmax, int64_t blocksize, const OutArray& out,
                uintptr_t stream) {
  check_blocksize(blocksize);
  const Device dev = device_of(packed, stream, "packed");
  require<uint8_t>(packed, "packed", dev);
  require<float>(absmax, "absmax", dev);
  const int64_t n = numel(out, "out");
  require_numel(packed, ceil_div(n, 2), "packed");
  require_numel(absmax, n_blocks_of(n, blocksize), "absmax");
  const auto* pk = cptr<uint8_t>(packed);
  const auto* am = cptr<float>(absmax);
  dispatch_float_out(out, "out", dev, [&](auto* py) {
    if (dev.cuda) {
      QF_ON_CUDA(nf4::dequantize_cuda(pk, am, n, blocksize, py, dev.stream));
    } else {
      nf4::dequantize_cpu(pk, am, n, blocksize, py);
    }
  });
}

// absmax float32 [nb] -> q uint8 [nb], absmax2 float32 [ceil(nb/256)], offset float32 [1].
void double_quant(const InArray& absmax, const OutArray& q, const OutArray& absmax2, const OutArray& offset,
                  uintptr_t stream) {
  const Device dev = device_of(absmax, stream, "absmax");
  require<float>(absmax, "absmax", dev);
  require<uint8_t>(q, "q", dev);
  require<float>(absmax2, "absmax2", dev);
  require<float>(offset, "offset", dev);
  const int64_t nb = numel(absmax, "absmax");
  require_numel(q, nb, "q");
  require_numel(absmax2, n_blocks_of(nb, nf4::kDoubleQuantBlock), "absmax2");
  require_numel(offset, 1, "offset");
  if (dev.cuda) {
    QF_ON_CUDA(nf4::double_quant_cuda(cptr<float>(absmax), nb, mptr<uint8_t>(q), mptr<float>(absmax2),
                                      mptr<float>(offset), dev.stream));
  } else {
    nf4::double_quant_cpu(cptr<float>(absmax), nb, mptr<uint8_t>(q), mptr<float>(absmax2), mptr<float>(offset));
  }
}

// q uint8 [nb], absmax2 float32 [ceil(nb/256)], offset float32 [1] -> out float32 [nb].
void dequantize_absmax(const InArray& q, const InArray& absmax2, const InArray& offset, const OutArray& out,
                       uintptr_t stream) {
  const Device dev = device_of(q, stream, "q");
  require<uint8_t>(q, "q", dev);
  require<float>(absmax2, "absmax2", dev);
  require<float>(offset, "offset", dev);
  require<float>(out, "out", dev);
  const int64_t nb = numel(q, "q");
  require_numel(out, nb, "out");
  require_numel(absmax2, n_blocks_of(nb, nf4::kDoubleQuantBlock), "absmax2");
  require_numel(offset, 1, "offset");
  if (dev.cuda) {
    // The offset stays on the device: the kernel reads it (no host round trip).
    QF_ON_CUDA(nf4::dequantize_absmax_cuda(cptr<uint8_t>(q), cptr<float>(absmax2), cptr<float>(offset), nb,
                                           mptr<float>(out), dev.stream));
  } else {
    const float off = *cptr<float>(offset);
    nf4::dequantize_absmax_cpu(cptr<uint8_t>(q), cptr<float>(absmax2), off, nb, mptr<float>(out));
  }
}

// The weight-only GEMM's policy (bindings/linear.h) over an nf4 weight [M, K]: packed codes and
// the decoded float32 absmax (the blocks run over the flattened W, so a block may straddle two
// rows when K % blocksize != 0: the CPU tile decoder works on flat ranges).
struct Nf4Linear {
  const uint8_t* packed;
  const float* absmax;
  int64_t M, K, blocksize;
#if defined(QFORMATS_WITH_CUDA)
  template <class T>
  void cuda(const T* x, int64_t N, T* y, const T* bias, gemm::GemmWorkspace ws, void* stream) const {
    gemm::nf4_gemm_cuda(x, N, K, M, packed, absmax, blocksize, y, bias, ws, stream);
  }
  int64_t workspace_cuda(int64_t N) const { return gemm::weight_only_workspace_bytes_cuda(N, M, K); }
  template <class T>
  void dequantize_cuda(T* w, void*, int64_t, void* stream) const {
    nf4::dequantize_cuda(packed, absmax, M * K, blocksize, w, stream);
  }
  int64_t dequantize_workspace_cuda() const { return 0; }
#endif
  template <class T>
  void dequantize_cpu(T* w) const {
    nf4::dequantize_cpu(packed, absmax, M * K, blocksize, w);
  }
  void cpu(const float* x, int64_t N, float* y) const { gemm::nf4_gemm_cpu(x, N, K, M, packed, absmax, blocksize, y); }
};

// An nf4 weight [M, K] (packed uint8 [ceil(M K / 2)], absmax float32 [ceil(M K / blocksize)]) as a
// Linear, checked here once. CUDA needs K % 32 == 0 (nf4_gemm_cuda.h).
PackedLinear<Nf4Linear> make_linear(const InArray& packed, const InArray& absmax, int64_t M, int64_t K,
                                    int64_t blocksize) {
  check_blocksize(blocksize);
  nonneg(M, "M");
  nonneg(K, "K");
  const Device dev = device_of(packed, 0, "packed");
  require<uint8_t>(packed, "packed", dev);
  require<float>(absmax, "absmax", dev);
  const int64_t n = mul(M, K, "M * K");
  require_numel(packed, ceil_div(n, 2), "packed");
  require_numel(absmax, n_blocks_of(n, blocksize), "absmax");
  if (dev.cuda && K % 32) throw std::invalid_argument("the CUDA GEMM needs K % 32 == 0");
  return packed_linear(Nf4Linear{cptr<uint8_t>(packed), cptr<float>(absmax), M, K, blocksize}, M, K, packed,
                       {packed, absmax});
}

// x: float [N, K] (float32, float16 or bfloat16); out: CPU float32 [N, M], CUDA x's dtype.
void gemm_nf4(const InArray& x, const InArray& packed, const InArray& absmax, const OutArray& out, int64_t M, int64_t K,
              int64_t blocksize, uintptr_t stream, const std::optional<OutArray>& workspace) {
  if (x.ndim() != 2) throw std::invalid_argument("x: expected shape [N, " + std::to_string(K) + "]");
  make_linear(packed, absmax, M, K, blocksize)(x, out, std::nullopt, workspace, stream);
}

// The format's constants as the native code sees them (tests compare them with the reference).
nb::dict constants() {
  nb::dict d;
  d["code"] = std::vector<float>(std::begin(nf4::kCode), std::end(nf4::kCode));
  d["midpoints"] = std::vector<float>(std::begin(nf4::kMidpoint), std::end(nf4::kMidpoint));
  d["dynamic_map"] = std::vector<float>(std::begin(nf4::kDynamicMap), std::end(nf4::kDynamicMap));
  d["tiny"] = nf4::kTiny;
  return d;
}

// Exposed for tests: the torch-order mean, and the 8-bit code of one scaled value.
float mean_torch_order(const InArray& x) {
  require<float>(x, "x");
  return nf4::mean_torch_order(cptr<float>(x), numel(x, "x"));
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() =
      "nf4 (bitsandbytes NormalFloat4) native codec, absmax double quantization and "
      "fp32 x nf4 GEMM; called through qformats.nf4.";
  m.def("quantize", &quantize, nb::arg("x"), nb::arg("blocksize"), nb::arg("packed"), nb::arg("absmax"),
        nb::arg("stream") = 0, release_gil());
  m.def("dequantize", &dequantize, nb::arg("packed"), nb::arg("absmax"), nb::arg("blocksize"), nb::arg("out"),
        nb::arg("stream") = 0, release_gil());
  m.def("double_quant", &double_quant, nb::arg("absmax"), nb::arg("q"), nb::arg("absmax2"), nb::arg("offset"),
        nb::arg("stream") = 0, release_gil());
  m.def("dequantize_absmax", &dequantize_absmax, nb::arg("q"), nb::arg("absmax2"), nb::arg("offset"), nb::arg("out"),
        nb::arg("stream") = 0, release_gil());
  bind_linear<Nf4Linear>(m, "An nf4 weight [M, K] bound for repeated x . W^T (+ bias) calls.");
  m.def("make_linear", &make_linear, nb::arg("packed"), nb::arg("absmax"), nb::arg("M"), nb::arg("K"),
        nb::arg("blocksize"));
  m.def("gemm", &gemm_nf4, nb::arg("x"), nb::arg("packed"), nb::arg("absmax"), nb::arg("out"), nb::arg("M"),
        nb::arg("K"), nb::arg("blocksize"), nb::arg("stream") = 0, nb::arg("workspace").none() = nb::none(),
        release_gil());
  m.def("gemm_isa", &gemm_isa, "Instruction set of the CPU GEMM kernels in use (QFORMATS_GEMM_ISA lowers it).");
  m.def("mean_torch_order", &mean_torch_order, nb::arg("x"));
  m.def("constants", &constants);
}
