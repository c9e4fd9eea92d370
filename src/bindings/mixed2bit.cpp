// qformats.mixed2bit._native: mixed 2/4-bit codec (formats/mixed2bit) and the fp32-activation x
// mixed2bit-weight GEMM. Adapters check every array (dtype, contiguity, size from the dims), then
// call the kernels without the GIL. The Python layer allocates all outputs: n4 and n_out are
// known from the parameters before the call, so every buffer size is.
#include "bindings/nb_common.h"
#include "formats/mixed2bit/mixed2bit.h"

using namespace qf;
using namespace qf::bind;
namespace m2 = qf::mixed2bit;

namespace {

// float16 arrays (numpy float16 / torch.float16): dtype code Float, 16 bits.
void require_f16(const Array& a, const char* name) {
  require_cpu_contiguous(a, name);
  const auto dt = a.dtype();
  if (!(dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && dt.bits == 16 && dt.lanes == 1))
    throw nb::type_error((std::string(name) + ": expected float16").c_str());
}

m2::Dims make_dims(int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4,
                   int64_t n_out) {
  if (rows < 0 || K < 0 || group_size < m2::kGroupMultiple || group_size % m2::kGroupMultiple ||
      K % group_size || scale_block < 1)
    throw std::invalid_argument("mixed2bit: bad rows/K/group_size/scale_block");
  m2::Dims d;
  d.rows = rows; d.K = K; d.group_size = group_size; d.scale_block = scale_block;
  d.n4 = n4; d.n_out = n_out;
  if (n4 < 0 || n4 > d.n_groups()) throw std::invalid_argument("mixed2bit: n4 out of range");
  if (n_out < 0 || n_out > d.n2() * group_size) throw std::invalid_argument("mixed2bit: n_out out of range");
  return d;
}

// Checks the nine buffers against the dims: dtypes, contiguity, element counts.
void check_buffers(const m2::Dims& d, const Array& group_map, const Array& codes2, const Array& codes4,
                   const Array& scales2, const Array& scales4, const Array& so2, const Array& so4,
                   const Array& outlier_idx, const Array& outlier_val) {
  require<uint8_t>(group_map, "group_map");
  require<int32_t>(codes2, "codes2");
  require<int32_t>(codes4, "codes4");
  require<uint8_t>(scales2, "scales2");
  require<uint8_t>(scales4, "scales4");
  require_f16(so2, "so2");
  require_f16(so4, "so4");
  require<int32_t>(outlier_idx, "outlier_idx");
  require_f16(outlier_val, "outlier_val");
  require_numel(group_map, d.map_bytes(), "group_map");
  require_numel(codes2, d.n2() * d.words2(), "codes2");
  require_numel(codes4, d.n4 * d.words4(), "codes4");
  require_numel(scales2, d.n2(), "scales2");
  require_numel(scales4, 2 * d.n4, "scales4");
  require_numel(so2, 2 * d.blocks2(), "so2");
  require_numel(so4, 2 * d.blocks4(), "so4");
  require_numel(outlier_idx, d.n_out, "outlier_idx");
  require_numel(outlier_val, d.n_out, "outlier_val");
}

m2::ConstBuffers const_buffers(const Array& group_map, const Array& codes2, const Array& codes4,
                               const Array& scales2, const Array& scales4, const Array& so2,
                               const Array& so4, const Array& outlier_idx, const Array& outlier_val) {
  return {cptr<uint8_t>(group_map), cptr<uint32_t>(codes2), cptr<uint32_t>(codes4),
          cptr<uint8_t>(scales2),   cptr<uint8_t>(scales4), cptr<half_t>(so2),
          cptr<half_t>(so4),        cptr<int32_t>(outlier_idx), cptr<half_t>(outlier_val)};
}

// w: float [rows, K]; sensitivity: float32 [K] or None; outputs as in mixed2bit.h.
void quantize(const Array& w, const Array& sensitivity, int64_t group_size, int64_t scale_block,
              int64_t n4, int64_t n_out, const Array& group_map, const Array& codes2,
              const Array& codes4, const Array& scales2, const Array& scales4, const Array& so2,
              const Array& so4, const Array& outlier_idx, const Array& outlier_val) {
  if (w.ndim() != 2) throw std::invalid_argument("w: expected a 2-D array");
  const m2::Dims d = make_dims(static_cast<int64_t>(w.shape(0)), static_cast<int64_t>(w.shape(1)),
                               group_size, scale_block, n4, n_out);
  check_buffers(d, group_map, codes2, codes4, scales2, scales4, so2, so4, outlier_idx, outlier_val);
  const float* sens = nullptr;
  if (sensitivity.is_valid()) {  // None when selecting by range
    require<float>(sensitivity, "sensitivity");
    require_numel(sensitivity, d.K, "sensitivity");
    sens = cptr<float>(sensitivity);
  }
  const m2::Buffers out{mptr<uint8_t>(group_map), mptr<uint32_t>(codes2), mptr<uint32_t>(codes4),
                        mptr<uint8_t>(scales2),   mptr<uint8_t>(scales4), mptr<half_t>(so2),
                        mptr<half_t>(so4),        mptr<int32_t>(outlier_idx), mptr<half_t>(outlier_val)};
  dispatch_float(w, "w", [&](auto* pw) { m2::quantize_cpu(pw, sens, d, out); });
}

void dequantize(int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4,
                int64_t n_out, const Array& group_map, const Array& codes2, const Array& codes4,
                const Array& scales2, const Array& scales4, const Array& so2, const Array& so4,
                const Array& outlier_idx, const Array& outlier_val, const Array& out) {
  const m2::Dims d = make_dims(rows, K, group_size, scale_block, n4, n_out);
  check_buffers(d, group_map, codes2, codes4, scales2, scales4, so2, so4, outlier_idx, outlier_val);
  require<float>(out, "out");
  require_numel(out, rows * K, "out");
  m2::dequantize_cpu(const_buffers(group_map, codes2, codes4, scales2, scales4, so2, so4, outlier_idx,
                                   outlier_val),
                     d, mptr<float>(out));
}

// Y [N, rows] = X [N, K] . W^T.
void gemm(const Array& x, int64_t rows, int64_t K, int64_t group_size, int64_t scale_block, int64_t n4,
          int64_t n_out, const Array& group_map, const Array& codes2, const Array& codes4,
          const Array& scales2, const Array& scales4, const Array& so2, const Array& so4,
          const Array& outlier_idx, const Array& outlier_val, const Array& out) {
  const m2::Dims d = make_dims(rows, K, group_size, scale_block, n4, n_out);
  check_buffers(d, group_map, codes2, codes4, scales2, scales4, so2, so4, outlier_idx, outlier_val);
  require<float>(x, "x");
  require<float>(out, "out");
  if (x.ndim() != 2 || static_cast<int64_t>(x.shape(1)) != K)
    throw std::invalid_argument("x: expected float32 [N, K]");
  const int64_t N = static_cast<int64_t>(x.shape(0));
  require_numel(out, N * rows, "out");
  m2::gemm_cpu(cptr<float>(x), N,
               const_buffers(group_map, codes2, codes4, scales2, scales4, so2, so4, outlier_idx, outlier_val),
               d, mptr<float>(out));
}

// values: uint8 with 16 * numel(out) elements; out: int32.
void pack_2bit(const Array& values, const Array& out) {
  require<uint8_t>(values, "values");
  require<int32_t>(out, "out");
  require_numel(values, numel(out) * m2::kCodes2PerWord, "values");
  m2::pack_2bit_cpu(cptr<uint8_t>(values), numel(out), mptr<uint32_t>(out));
}

// packed: int32; out: uint8 with at most 16 * numel(packed) elements.
void unpack_2bit(const Array& packed, const Array& out) {
  require<int32_t>(packed, "packed");
  require<uint8_t>(out, "out");
  if (numel(out) > numel(packed) * m2::kCodes2PerWord)
    throw std::invalid_argument("out: more elements than the packed words hold");
  m2::unpack_2bit_cpu(cptr<uint32_t>(packed), numel(out), mptr<uint8_t>(out));
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "mixed2bit (2/4-bit groups, second-order scales, fp16 outliers) native codec and "
            "fp32 x mixed2bit GEMM; called through qformats.mixed2bit.";
  m.def("quantize", &quantize, nb::arg("w"), nb::arg("sensitivity").none(), nb::arg("group_size"),
        nb::arg("scale_block"), nb::arg("n4"), nb::arg("n_out"), nb::arg("group_map"),
        nb::arg("codes2"), nb::arg("codes4"), nb::arg("scales2"), nb::arg("scales4"), nb::arg("so2"),
        nb::arg("so4"), nb::arg("outlier_idx"), nb::arg("outlier_val"), release_gil());
  m.def("dequantize", &dequantize, nb::arg("rows"), nb::arg("K"), nb::arg("group_size"),
        nb::arg("scale_block"), nb::arg("n4"), nb::arg("n_out"), nb::arg("group_map"),
        nb::arg("codes2"), nb::arg("codes4"), nb::arg("scales2"), nb::arg("scales4"), nb::arg("so2"),
        nb::arg("so4"), nb::arg("outlier_idx"), nb::arg("outlier_val"), nb::arg("out"), release_gil());
  m.def("gemm", &gemm, nb::arg("x"), nb::arg("rows"), nb::arg("K"), nb::arg("group_size"),
        nb::arg("scale_block"), nb::arg("n4"), nb::arg("n_out"), nb::arg("group_map"),
        nb::arg("codes2"), nb::arg("codes4"), nb::arg("scales2"), nb::arg("scales4"), nb::arg("so2"),
        nb::arg("so4"), nb::arg("outlier_idx"), nb::arg("outlier_val"), nb::arg("out"), release_gil());
  m.def("pack_2bit", &pack_2bit, nb::arg("values"), nb::arg("out"), release_gil());
  m.def("unpack_2bit", &unpack_2bit, nb::arg("packed"), nb::arg("out"), release_gil());
}
