// qformats.q8_0._native: q8_0 codec (formats/q8_0). Adapters check, kernels run without the GIL.
#include "formats/q8_0/q8_0.h"
#include "bindings/nb_common.h"

using namespace qf;
using namespace qf::bind;

namespace {

void quantize(const InArray& x, const OutArray& out, uintptr_t stream) {
  const Device dev = device_of(x, stream, "x");
  require<uint8_t>(out, "out", dev);
  const int64_t n = numel(x, "x");
  if (n % q8_0::QK) throw std::invalid_argument("x: element count must be a multiple of 32");
  const int64_t n_blocks = n / q8_0::QK;
  require_numel(out, mul(n_blocks, int64_t(sizeof(q8_0::block_q8_0)), "out (34 bytes per block of x)"), "out");
  auto* y = mptr<q8_0::block_q8_0>(out);
  dispatch_float(x, "x", dev, [&](auto* px) {
    if (dev.cuda) {
      QF_ON_CUDA(q8_0::quantize_cuda(px, n_blocks, y, dev.stream));
    } else {
      q8_0::quantize_cpu(px, n_blocks, y);
    }
  });
}

// out: float32, float16 or bfloat16 with 32 values per block (decoded in float32, rounded once).
void dequantize(const InArray& blocks, const OutArray& out, uintptr_t stream) {
  const Device dev = device_of(blocks, stream, "blocks");
  require<uint8_t>(blocks, "blocks", dev);
  const int64_t nbytes = numel(blocks, "blocks");
  if (nbytes % int64_t(sizeof(q8_0::block_q8_0)))
    throw std::invalid_argument("blocks: size must be a multiple of 34 bytes");
  const int64_t n_blocks = nbytes / int64_t(sizeof(q8_0::block_q8_0));
  require_numel(out, mul(n_blocks, q8_0::QK, "out (32 values per block)"), "out");
  const auto* x = cptr<q8_0::block_q8_0>(blocks);
  dispatch_float_out(out, "out", dev, [&](auto* py) {
    if (dev.cuda) {
      QF_ON_CUDA(q8_0::dequantize_cuda(x, n_blocks, py, dev.stream));
    } else {
      q8_0::dequantize_cpu(x, n_blocks, py);
    }
  });
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "q8_0 (GGML) native codec; called through qformats.q8_0.";
  m.def("quantize", &quantize, nb::arg("x"), nb::arg("out"), nb::arg("stream") = 0, release_gil());
  m.def("dequantize", &dequantize, nb::arg("blocks"), nb::arg("out"), nb::arg("stream") = 0, release_gil());
}
