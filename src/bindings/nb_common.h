// Adapter helpers shared by every binding file: checks on nb::ndarray arguments (device,
// dtype, contiguity, size), overflow-checked size arithmetic for the integers a call is given,
// and dispatch on the input float type. The Python layer checks first and gives the friendlier
// message; these checks make the native calls safe on their own: no argument a Python caller
// can pass (huge, negative or inconsistent sizes included) reaches a kernel with a size that
// does not match the arrays it is given.
//
// Arrays a call only reads are InArray (nb::ndarray<nb::ro>): read-only numpy arrays and
// np.memmap(mode="r") are taken as they are, without a copy. Arrays a call writes are OutArray
// (nb::ndarray<>), which nanobind refuses when read-only; only OutArray hands out a writable
// pointer (mptr). Neither constrains dtype, shape or order, so nanobind never makes a silent
// converted copy: an output that were copied would be written into a temporary and lost.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/fp16.h"

namespace nb = nanobind;

namespace qf::bind {

using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;
// Kernels run without the GIL (arguments are converted before it is released).
using release_gil = nb::call_guard<nb::gil_scoped_release>;

// ---------------------------------------------------------------------------------------------
// Sizes. Every size an adapter compares with an array's element count is computed with these,
// from arguments checked first: an int64 product that wraps (4 * 2**62 == 0) would otherwise
// match an empty array and send a kernel through 2**62 values of it. std::invalid_argument is
// Python's ValueError, std::overflow_error its OverflowError (nanobind's translation).
// ---------------------------------------------------------------------------------------------

// v itself, or ValueError "<name> must be >= 0, got <v>".
inline int64_t nonneg(int64_t v, const char* name) {
  if (v < 0) throw std::invalid_argument(std::string(name) + " must be >= 0, got " + std::to_string(v));
  return v;
}

[[noreturn]] inline void throw_overflow(const char* what, int64_t a, const char* op, int64_t b) {
  throw std::overflow_error(std::string(what) + ": " + std::to_string(a) + op + std::to_string(b) + " overflows int64");
}

// a * b, or OverflowError naming `what` (the arguments the product is made of).
inline int64_t mul(int64_t a, int64_t b, const char* what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw_overflow(what, a, " * ", b);
  return r;
}

// The product of `factors`, or OverflowError naming `what`.
inline int64_t mul(std::initializer_list<int64_t> factors, const char* what) {
  int64_t r = 1;
  for (int64_t f : factors) r = mul(r, f, what);
  return r;
}

// a + b, or OverflowError naming `what`.
inline int64_t add(int64_t a, int64_t b, const char* what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) throw_overflow(what, a, " + ", b);
  return r;
}

// A call whose outputs are all empty returns after its checks without running a kernel: a size
// that only an empty array is checked against (unit_len with no units, K with no rows) is
// bounded by nothing, and a kernel's own arithmetic on it could still wrap.

// ceil(n / d) for n >= 0, d > 0, without the n + d - 1 that can wrap.
inline int64_t ceil_div(int64_t n, int64_t d) { return n / d + (n % d != 0); }

// The element count of `a` (1 for a 0-d array), or ValueError for a negative dimension and
// OverflowError for a count past int64 (only a crafted DLPack capsule can claim either).
template <class... Ts>
int64_t numel(const nb::ndarray<Ts...>& a, const char* name = "array") {
  int64_t n = 1;
  bool empty = false;
  for (size_t i = 0; i < a.ndim(); ++i) {
    const auto d = static_cast<int64_t>(a.shape(i));
    if (d < 0) throw std::invalid_argument(std::string(name) + ": negative dimension");
    empty |= d == 0;
  }
  if (empty) return 0;  // (0, 2**62, 2**62) holds nothing, whatever the product of the others
  for (size_t i = 0; i < a.ndim(); ++i) n = mul(n, static_cast<int64_t>(a.shape(i)), name);
  return n;
}

template <class... Ts>
bool is_c_contiguous(const nb::ndarray<Ts...>& a) {
  if (numel(a) == 0) return true;  // empty arrays may carry any strides; nothing is accessed
  int64_t expected = 1;            // a running product of dims, bounded by numel: cannot wrap
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

template <class... Ts>
Device device_of(const nb::ndarray<Ts...>& first, uintptr_t stream, const char* name) {
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

template <class... Ts>
void require_contiguous_on(const nb::ndarray<Ts...>& a, const char* name, const Device& d) {
  const bool cuda = a.device_type() == nb::device::cuda::value;
  if (cuda != d.cuda || (cuda && static_cast<int>(a.device_id()) != d.id) ||
      (!cuda && a.device_type() != nb::device::cpu::value))
    throw std::invalid_argument(std::string(name) + ": all arrays of a call must be on the same device");
  if (!is_c_contiguous(a)) throw std::invalid_argument(std::string(name) + ": expected a C-contiguous array");
}

template <class... Ts>
void require_cpu_contiguous(const nb::ndarray<Ts...>& a, const char* name) {
  if (a.device_type() != nb::device::cpu::value)
    throw std::invalid_argument(std::string(name) + ": expected a CPU array");
  if (!is_c_contiguous(a)) throw std::invalid_argument(std::string(name) + ": expected a C-contiguous array");
}

template <class T, class... Ts>
void require(const nb::ndarray<Ts...>& a, const char* name) {
  require_cpu_contiguous(a, name);
  if (a.dtype() != nb::dtype<T>()) throw nb::type_error((std::string(name) + ": wrong dtype").c_str());
}

// `n` comes from the size helpers above: a negative n (an unchecked difference) matches nothing.
template <class... Ts>
void require_numel(const nb::ndarray<Ts...>& a, int64_t n, const char* name) {
  const int64_t have = numel(a, name);
  if (have != n)
    throw std::invalid_argument(std::string(name) + ": expected " + std::to_string(n) + " elements, got " +
                                std::to_string(have));
}

template <class T, class... Ts>
void require(const nb::ndarray<Ts...>& a, const char* name, const Device& d) {
  require_contiguous_on(a, name, d);
  if (a.dtype() != nb::dtype<T>()) throw nb::type_error((std::string(name) + ": wrong dtype").c_str());
}

template <class T, class... Ts>
const T* cptr(const nb::ndarray<Ts...>& a) {
  return static_cast<const T*>(a.data());
}
// Writable pointers come from outputs only: an InArray may be a read-only numpy array or map.
template <class T>
T* mptr(const OutArray& a) {
  return static_cast<T*>(a.data());
}

namespace detail {
template <class Arr, class Fn>
void dispatch_float_impl(const Arr& a, const char* name, Fn&& fn) {
  const auto dt = a.dtype();
  // const element types for inputs (InArray::data() is const void*), mutable for outputs
  constexpr bool kConst = std::is_const_v<std::remove_pointer_t<decltype(a.data())>>;
  using F32 = std::conditional_t<kConst, const float, float>;
  using F16 = std::conditional_t<kConst, const qf::half_t, qf::half_t>;
  using B16 = std::conditional_t<kConst, const qf::bf16_t, qf::bf16_t>;
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
void dispatch_float(const InArray& a, const char* name, Fn&& fn) {
  require_cpu_contiguous(a, name);
  detail::dispatch_float_impl(a, name, fn);
}

// The same for an input on device `d` (CPU or CUDA).
template <class Fn>
void dispatch_float(const InArray& a, const char* name, const Device& d, Fn&& fn) {
  require_contiguous_on(a, name, d);
  detail::dispatch_float_impl(a, name, fn);
}

// The same for an output (fn gets T*): dequantizers write the caller's dtype directly, so a
// float16 result costs one pass, not a float32 pass plus a cast.
template <class Fn>
void dispatch_float_out(const OutArray& a, const char* name, const Device& d, Fn&& fn) {
  require_contiguous_on(a, name, d);
  detail::dispatch_float_impl(a, name, fn);
}

// Runs a CUDA launcher in a CUDA build; in a CPU-only build, CUDA arrays get a clear error
// (the Python layer already refuses them there; this keeps direct _native calls safe), unless
// the call had nothing to write and returned before its launch.
#if defined(QFORMATS_WITH_CUDA)
#define QF_ON_CUDA(...) __VA_ARGS__
#else
#define QF_ON_CUDA(...) throw std::invalid_argument("this build of qformats has no CUDA kernels")
#endif

}  // namespace qf::bind
