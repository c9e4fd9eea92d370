// qformats.q8_1._native: q8_1 codec (formats/q8_1). Adapters check, kernels run without the GIL.
#include "bindings/nb_common.h"
#include "formats/q8_1/q8_1.h"

using namespace qf;
using namespace qf::bind;

namespace {

void quantize(const Array& x, const Array& out) {
  require<uint8_t>(out, "out");
  const int64_t n = numel(x);
  if (n % q8_1::QK) throw std::invalid_argument("x: element count must be a multiple of 32");
  require_numel(out, n / q8_1::QK * int64_t(sizeof(q8_1::block_q8_1)), "out");
  dispatch_float(x, "x", [&](auto* px) {
    q8_1::quantize_cpu(px, n / q8_1::QK, mptr<q8_1::block_q8_1>(out));
  });
}

void dequantize(const Array& blocks, const Array& out) {
  require<uint8_t>(blocks, "blocks");
  require<float>(out, "out");
  const int64_t nbytes = numel(blocks);
  if (nbytes % int64_t(sizeof(q8_1::block_q8_1)))
    throw std::invalid_argument("blocks: size must be a multiple of 36 bytes");
  const int64_t n_blocks = nbytes / int64_t(sizeof(q8_1::block_q8_1));
  require_numel(out, n_blocks * q8_1::QK, "out");
  q8_1::dequantize_cpu(cptr<q8_1::block_q8_1>(blocks), n_blocks, mptr<float>(out));
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "q8_1 (GGML) native codec; called through qformats.q8_1.";
  m.def("quantize", &quantize, nb::arg("x"), nb::arg("out"), release_gil());
  m.def("dequantize", &dequantize, nb::arg("blocks"), nb::arg("out"), release_gil());
}
