#include "common/runtime.h"

namespace qf {
#if defined(QFORMATS_WITH_CUDA)
bool cuda_built() { return true; }
#else
bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
#endif
}  // namespace qf
