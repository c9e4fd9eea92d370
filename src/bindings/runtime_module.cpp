// qformats._runtime._native: build and machine facts, and the process's CPU thread setting
// (exports only).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "common/runtime.h"
#include "common/thread_pool.h"

namespace nb = nanobind;

NB_MODULE(_native, m) {
  m.doc() = "qformats runtime facts: CUDA build and devices, CPU thread count.";
  m.def("cuda_built", &qf::cuda_built, "True if the extension was compiled with CUDA kernels.");
  m.def("cuda_device_count", &qf::cuda_device_count,
        "Number of CUDA devices the runtime sees (0 without driver, GPU or CUDA build).");
  m.attr("MAX_THREADS") = qf::kMaxThreads;
  m.def("num_threads", &qf::num_threads, "Threads used by the CPU kernels of every format.");
  // Without the GIL: resizing a started pool waits for a running job, which may belong to a
  // thread that needs the GIL to finish its call.
  m.def("set_num_threads", &qf::set_num_threads, nb::arg("n"), nb::call_guard<nb::gil_scoped_release>(),
        "Set the threads of the CPU kernels of every format (clamped to [1, MAX_THREADS]).");
  m.def("num_threads_env_note", &qf::num_threads_env_note,
        "Why QFORMATS_NUM_THREADS was ignored or capped; empty when it was not.");
  m.def("pool_workers", &qf::pool_workers,
        "Worker threads of the CPU pool alive now (0 before the first parallel job).");
}
