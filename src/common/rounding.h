// Rounding helpers shared by the integer codecs (int8, int4, ...).
#pragma once
#include "common/fp16.h"

namespace qf {

// Round half to even for |v| <= 2^22 without a libm call: adding 1.5 * 2^23 moves the
// binary point so that the float32 add itself rounds v to an integer (round to nearest
// even, the default IEEE mode), and subtracting the constant back is exact. Same result as
// std::nearbyint / np.rint on that range, but vectorizable. Needs the default rounding mode
// and no fast-math (the build guarantees both), and |v| <= 2^22: callers clamp first (the
// clamp bounds are integers, so clamp(rint(v)) == rint(clamp(v))).
QF_HOST_DEVICE float rint_small(float v) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return (v + magic) - magic;
}

}  // namespace qf
