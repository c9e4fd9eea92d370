// Facts about the build and the machine, exported as qformats._runtime.
#pragma once

namespace qf {
bool cuda_built();        // compiled with CUDA kernels
int cuda_device_count();  // 0 without driver or GPU, and always 0 in a CPU-only build
}  // namespace qf
