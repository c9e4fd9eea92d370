// Helpers for the GEMM adapters of src/bindings (included by them only: it needs nanobind).
// Every adapter uses the GEMM terms of docs/developer.md ("GEMM conventions"): N activation rows,
// K the reduction, M weight rows; x / a [N, K], the weight [M, K], out [N, M] (gemm_q4_0_q8_1:
// [M, N] unless out_nm). The comment above each adapter gives its arrays' shapes.
#pragma once
#include <string>
#include <type_traits>
#include <vector>

#include <nanobind/stl/string.h>

#include "bindings/nb_common.h"
#include "gemm/cpu_isa.h"
#include "gemm/weight_only_cpu.h"

namespace qf::bind {

// Activations x (a C-contiguous CPU array of float32, float16 or bfloat16) as float32: x's own
// data, or an exact converted copy held in buf. Raises TypeError / ValueError as dispatch_float.
inline const float* float32_activations(const InArray& x, const char* name, std::vector<float>& buf) {
  const float* p = nullptr;
  dispatch_float(x, name, [&](auto* px) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(px)>>;
    if constexpr (std::is_same_v<T, float>) {
      p = px;
    } else {
      const int64_t n = numel(x, name);
      buf.resize(static_cast<size_t>(n));
      gemm::to_float32(px, n, buf.data());
      p = buf.data();
    }
  });
  return p;
}

// The CUDA weight-only GEMM adapters: x float [N, K] (float32, float16 or bfloat16) on device
// `dev`, 16-byte aligned (the kernels load 8 values at a time), out of x's dtype; calls
// fn(const T* x, T* out).
template <class Fn>
void dispatch_cuda_x_out(const InArray& x, const OutArray& out, const Device& dev, Fn&& fn) {
  require_contiguous_on(out, "out", dev);
  if (out.dtype() != x.dtype()) throw nb::type_error("out: expected the dtype of x");
  if (reinterpret_cast<uintptr_t>(x.data()) % 16)
    throw std::invalid_argument("x: the CUDA GEMM needs a 16-byte aligned array (x.contiguous().clone())");
  dispatch_float(x, "x", dev, [&](auto* px) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(px)>>;
    fn(px, mptr<T>(out));
  });
}

// The instruction set the CPU GEMMs of this extension use now ("avx512", "avx2" or "scalar").
inline std::string gemm_isa() { return gemm::isa_name(gemm::active_isa()); }

}  // namespace qf::bind
