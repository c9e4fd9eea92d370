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
#include <type_traits>

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

// Where a call runs: the device of its arrays (all must agree) and, for CUDA, the stream the
// Python layer passed (torch.cuda.current_stream().cuda_stream; the caller also made that
// device current). Adapters that take a Device accept CUDA arrays; every other check below
// demands CPU arrays, so an adapter that was never taught about CUDA cannot hand a device
// pointer to a CPU kernel.
struct Device {
  bool cuda = false;
  int id = 0;
  void* stream = nullptr;  // cudaStream_t, kept opaque so bindings need no CUDA headers
};

inline Device device_of(const Array& first, uintptr_t stream, const char* name) {
  Device d;
  if (first.device_type() == nb::device::cuda::value) {
    d.cuda = true;
    d.id = static_cast<int>(first.device_id());
    d.stream = reinterpret_cast<void*>(stream);
  } else if (first.device_type() != nb::device::cpu::value) {
    throw std::invalid_argument(std::string(name) + ": only CPU and CUDA arrays are supported");
  }
  return d;
}

inline void require_contiguous_on(const Array& a, const char* name, const Device& d) {
  const bool cuda = a.device_type() == nb::device::cuda::value;
  if (cuda != d.cuda || (cuda && static_cast<int>(a.device_id()) != d.id) ||
      (!cuda && a.device_type() != nb::device::cpu::value))
    throw std::invalid_argument(std::string(name) + ": all arrays of a call must be on the same device");
  if (!is_c_contiguous(a)) throw std::invalid_argument(std::string(name) + ": expected a C-contiguous array");
}

inline void require_cpu_contiguous(const Array& a, const char* name) {
  if (a.device_type() != nb::device::cpu::value)
    throw std::invalid_argument(std::string(name) + ": expected a CPU array");
  if (!is_c_contiguous(a)) throw std::invalid_argument(std::string(name) + ": expected a C-contiguous array");
}

template <class T>
void require(const Array& a, const char* name) {
  require_cpu_contiguous(a, name);
  if (a.dtype() != nb::dtype<T>()) throw nb::type_error((std::string(name) + ": wrong dtype").c_str());
}

inline void require_numel(const Array& a, int64_t n, const char* name) {
  if (numel(a) != n)
    throw std::invalid_argument(std::string(name) + ": expected " + std::to_string(n) + " elements, got " +
                                std::to_string(numel(a)));
}

template <class T>
void require(const Array& a, const char* name, const Device& d) {
  require_contiguous_on(a, name, d);
  if (a.dtype() != nb::dtype<T>()) throw nb::type_error((std::string(name) + ": wrong dtype").c_str());
}

template <class T>
const T* cptr(const Array& a) {
  return static_cast<const T*>(a.data());
}
template <class T>
T* mptr(const Array& a) {
  return static_cast<T*>(a.data());
}

namespace detail {
template <class Ptr, class Fn>
void dispatch_float_impl(const Array& a, const char* name, Fn&& fn) {
  const auto dt = a.dtype();
  using F32 = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const float, float>;
  using F16 = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const qf::half_t, qf::half_t>;
  using B16 = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const qf::bf16_t, qf::bf16_t>;
  if (dt == nb::dtype<float>()) return fn(static_cast<F32*>(a.data()));
  if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && dt.bits == 16 && dt.lanes == 1)
    return fn(static_cast<F16*>(a.data()));
  if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16 && dt.lanes == 1)
    return fn(static_cast<B16*>(a.data()));
  throw nb::type_error((std::string(name) + ": expected float32, float16 or bfloat16").c_str());
}
}  // namespace detail

// Calls fn(const T* x) with T = float, qf::half_t or qf::bf16_t after checking that `a` is a
// C-contiguous CPU array of float32, float16 or bfloat16.
template <class Fn>
void dispatch_float(const Array& a, const char* name, Fn&& fn) {
  require_cpu_contiguous(a, name);
  detail::dispatch_float_impl<const void*>(a, name, fn);
}

// The same for an input on device `d` (CPU or CUDA).
template <class Fn>
void dispatch_float(const Array& a, const char* name, const Device& d, Fn&& fn) {
  require_contiguous_on(a, name, d);
  detail::dispatch_float_impl<const void*>(a, name, fn);
}

// The same for an output (fn gets T*): dequantizers write the caller's dtype directly, so a
// float16 result costs one pass, not a float32 pass plus a cast.
template <class Fn>
void dispatch_float_out(const Array& a, const char* name, const Device& d, Fn&& fn) {
  require_contiguous_on(a, name, d);
  detail::dispatch_float_impl<void*>(a, name, fn);
}

// Runs a CUDA launcher in a CUDA build; in a CPU-only build, CUDA arrays get a clear error
// (the Python layer already refuses them there; this keeps direct _native calls safe).
#if defined(QFORMATS_WITH_CUDA)
#define QF_ON_CUDA(...) __VA_ARGS__
#else
#define QF_ON_CUDA(...) throw std::invalid_argument("this build of qformats has no CUDA kernels")
#endif

}  // namespace qf::bind
