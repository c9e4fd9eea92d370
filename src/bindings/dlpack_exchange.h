// Tensor arguments imported through the DLPack C exchange API (DLPack 1.3, dlpack.h
// `DLPackExchangeAPI`; torch >= 2.10 publishes it on its tensor type as
// `__dlpack_c_exchange_api__`): one C call describes a tensor, where the Python `__dlpack__`
// protocol that nanobind's ndarray import uses costs microseconds per torch tensor
// (benchmarks/README.md, "Design measurements behind kernel choices"). Types without the API (numpy arrays, older
// torch) go through nanobind's import, with its errors. The per-call path of bindings/linear.h uses this: a decode step
// makes hundreds of such calls.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <stdexcept>

#include "bindings/nb_common.h"

namespace qf::bind {

namespace dlx {
// The stable prefix of dlpack.h's DLPackExchangeAPI (same field order and types); only
// dltensor_from_py_object_no_sync is called, the other entries are kept for the layout.
struct Version {
  uint32_t major, minor;
};
struct Header {
  Version version;
  Header* prev_api;
};
struct API {
  Header header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, nb::dlpack::dltensor* out);  // 0 or -1 (error set)
  void* current_work_stream;
};
static_assert(sizeof(nb::dlpack::dltensor) == 48, "DLTensor layout (dlpack.h)");
}  // namespace dlx

// The exchange API of `tp`, or nullptr (no API, another major version, or no non-owning entry).
// A one-entry cache: the arguments of a call are almost always of one type. Holds a reference
// to the cached type so that its address cannot be reused by another. Needs the GIL.
inline const dlx::API* exchange_api(PyTypeObject* tp) {
  static PyTypeObject* cached_type = nullptr;
  static const dlx::API* cached_api = nullptr;
  if (tp == cached_type) return cached_api;
  const dlx::API* api = nullptr;
  PyObject* cap = PyObject_GetAttrString(reinterpret_cast<PyObject*>(tp), "__dlpack_c_exchange_api__");
  if (cap == nullptr) {
    PyErr_Clear();
  } else {
    if (PyCapsule_IsValid(cap, "dlpack_exchange_api")) {
      api = static_cast<const dlx::API*>(PyCapsule_GetPointer(cap, "dlpack_exchange_api"));
      if (api != nullptr && (api->header.version.major != 1 || api->dltensor_from_py_object_no_sync == nullptr))
        api = nullptr;
    }
    Py_DECREF(cap);
  }
  Py_INCREF(reinterpret_cast<PyObject*>(tp));
  Py_XDECREF(reinterpret_cast<PyObject*>(cached_type));
  cached_type = tp;
  cached_api = api;
  return api;
}

// `h` as an InArray or OutArray (a view that references `h`, no copy): through its type's
// exchange API when it has one, else nanobind's import (TypeError for what is no array, and for
// a read-only array asked for as an OutArray). Needs the GIL.
template <class Arr>
Arr import_array(nb::handle h, const char* name) {
  if (const dlx::API* api = exchange_api(Py_TYPE(h.ptr()))) {
    nb::dlpack::dltensor t;
    if (api->dltensor_from_py_object_no_sync(h.ptr(), &t) != 0) nb::raise_python_error();
    constexpr int kMaxDims = 16;
    if (t.ndim < 0 || t.ndim > kMaxDims) throw std::invalid_argument(std::string(name) + ": too many dimensions");
    size_t shape[kMaxDims];
    for (int i = 0; i < t.ndim; ++i) {
      if (t.shape[i] < 0) throw std::invalid_argument(std::string(name) + ": negative dimension");
      shape[i] = static_cast<size_t>(t.shape[i]);
    }
    return Arr(t.data, static_cast<size_t>(t.ndim), shape, h, t.strides, t.dtype, t.device.device_type,
               t.device.device_id, 0, t.byte_offset);
  }
  try {
    return nb::cast<Arr>(h);
  } catch (const nb::cast_error&) {
    throw nb::type_error((std::string(name) + ": expected a numpy array or a torch tensor").c_str());
  }
}

}  // namespace qf::bind
