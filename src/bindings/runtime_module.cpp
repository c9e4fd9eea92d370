// qformats._runtime._native: build and machine facts (exports only).
#include <nanobind/nanobind.h>

#include "common/parallel.h"
#include "common/runtime.h"

namespace nb = nanobind;

NB_MODULE(_native, m) {
  m.doc() = "qformats runtime facts: CUDA build and devices, CPU thread count.";
  m.def("cuda_built", &qf::cuda_built, "True if the extension was compiled with CUDA kernels.");
  m.def("cuda_device_count", &qf::cuda_device_count,
        "Number of CUDA devices the runtime sees (0 without driver, GPU or CUDA build).");
  m.def("num_threads", &qf::num_threads, "Threads used by the CPU kernels.");
  m.def("set_num_threads", &qf::set_num_threads, nb::arg("n"),
        "Set the threads used by the CPU kernels (default: QFORMATS_NUM_THREADS or all cores).");
}
