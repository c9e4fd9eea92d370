// The CUDA translation unit that is always built when nvcc is found: it lets the package
// report whether the CUDA runtime sees a device, and keeps CUDA compilation in CI from day one.
#include <cuda_runtime.h>

namespace qf {

// Number of CUDA devices the runtime sees; 0 when there is no driver or no GPU (a wheel
// built with CUDA must still import and answer on such a machine).
int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

}  // namespace qf
