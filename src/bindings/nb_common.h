// Adapter helpers shared by every binding file: checks on nb::ndarray arguments (device,
// dtype, contiguity, size) and dispatch on the input float type. Arguments are taken as
// unconstrained nb::ndarray<> so that nanobind never makes a silent converted copy: an output
// that were copied would be written into a temporary and lost. The Python layer checks first
// and gives the friendlier message; these checks make the native calls safe on their own.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/fp16.h"

namespace nb = nanobind;

namespace qf::bind {

using Array = nb::ndarray<>;
// Kernels run without the GIL (arguments are converted before it is released).
using release_gil = nb::call_guard<nb::gil_scoped_release>;

inline int64_t numel(const Array& a) {
  int64_t n = 1;
  for (size_t i = 0; i < a.ndim(); ++i) n *= static_cast<int64_t>(a.shape(i));
  return n;
}

inline bool is_c_contiguous(const Array& a) {
  if (numel(a) == 0) return true;  // empty arrays may carry any strides; nothing is accessed
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

inline void require_cpu_contiguous(const Array& a, const char* name) {
  if (a.device_type() != nb::device::cpu::value)
    throw std::invalid_argument(std::string(name) + ": expected a CPU array");
  if (!is_c_contiguous(a))
    throw std::invalid_argument(std::string(name) + ": expected a C-contiguous array");
}

template <class T>
void require(const Array& a, const char* name) {
  require_cpu_contiguous(a, name);
  if (a.dtype() != nb::dtype<T>())
    throw nb::type_error((std::string(name) + ": wrong dtype").c_str());
}

inline void require_numel(const Array& a, int64_t n, const char* name) {
  if (numel(a) != n)
    throw std::invalid_argument(std::string(name) + ": expected " + std::to_string(n) +
                                " elements, got " + std::to_string(numel(a)));
}

template <class T> const T* cptr(const Array& a) { return static_cast<const T*>(a.data()); }
template <class T> T* mptr(const Array& a) { return static_cast<T*>(a.data()); }

// Calls fn(const T* x) with T = float, qf::half_t or qf::bf16_t after checking that `a` is a
// C-contiguous CPU array of float32, float16 or bfloat16.
template <class Fn>
void dispatch_float(const Array& a, const char* name, Fn&& fn) {
  require_cpu_contiguous(a, name);
  const auto dt = a.dtype();
  if (dt == nb::dtype<float>()) return fn(cptr<float>(a));
  if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && dt.bits == 16 && dt.lanes == 1)
    return fn(static_cast<const qf::half_t*>(a.data()));
  if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16 && dt.lanes == 1)
    return fn(static_cast<const qf::bf16_t*>(a.data()));
  throw nb::type_error((std::string(name) + ": expected float32, float16 or bfloat16").c_str());
}

}  // namespace qf::bind
