#include "formats/int8/int8.h"

#include <algorithm>
#include <vector>

#include "common/parallel.h"

namespace qf::int8 {

namespace {

// Work is split into segments: a unit longer than kSegment values (per-tensor or long rows)
// is cut into several, so that one huge unit still spreads over every thread. A segment
// never straddles two units.
constexpr int64_t kSegment = int64_t(1) << 16;
constexpr int64_t kGrainValues = 16384;  // values per thread at least

struct Segments {
  int64_t unit_len, per_unit, len, count, grain;
  Segments(int64_t n_units, int64_t unit_len_)
      : unit_len(unit_len_),
        per_unit((unit_len_ + kSegment - 1) / kSegment),
        len(std::min(unit_len_, kSegment)),
        count(n_units * per_unit),
        grain(std::max<int64_t>(1, kGrainValues / std::max<int64_t>(len, 1))) {}
  // Segment i: unit i / per_unit, values [begin, begin + size) of the flat array.
  int64_t unit(int64_t i) const { return i / per_unit; }
  int64_t begin(int64_t i) const { return unit(i) * unit_len + (i % per_unit) * len; }
  int64_t size(int64_t i) const { return std::min(len, unit_len - (i % per_unit) * len); }
};

}  // namespace

template <class T>
void quantize_cpu(const T* x, int64_t n_units, int64_t unit_len, int8_t* q, float* scale) {
  if (n_units <= 0) return;
  if (unit_len <= 0) {  // empty units: absmax 0, scale 0, no codes
    std::fill(scale, scale + n_units, 0.0f);
    return;
  }
  const Segments seg(n_units, unit_len);
  // Pass 1: max |x| per segment, then per unit. max is exact and order-free, so the split
  // cannot change the result.
  std::vector<float> part(static_cast<size_t>(seg.count));
  parallel_for(seg.count, seg.grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) part[size_t(i)] = absmax_run(x + seg.begin(i), seg.size(i));
  });
  std::vector<float> mult(static_cast<size_t>(n_units));
  parallel_for(n_units, kGrainValues, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      float amax = 0.0f;
      for (int64_t s = 0; s < seg.per_unit; ++s) amax = max_combine(amax, part[size_t(u * seg.per_unit + s)]);
      mult[size_t(u)] = multiplier(amax);
      scale[u] = scale_of(amax);
    }
  });
  // Pass 2: the codes, each element independent.
  parallel_for(seg.count, seg.grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = seg.begin(i);
      quantize_run(x + b, seg.size(i), mult[size_t(seg.unit(i))], q + b);
    }
  });
}

template <class T>
void dequantize_cpu(const int8_t* q, const float* scale, int64_t n_units, int64_t unit_len, T* y) {
  if (n_units <= 0 || unit_len <= 0) return;
  const Segments seg(n_units, unit_len);
  parallel_for(seg.count, seg.grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = seg.begin(i);
      dequantize_run(q + b, seg.size(i), scale[seg.unit(i)], y + b);
    }
  });
}

#define QF_INSTANTIATE(T)                                                     \
  template void quantize_cpu<T>(const T*, int64_t, int64_t, int8_t*, float*); \
  template void dequantize_cpu<T>(const int8_t*, const float*, int64_t, int64_t, T*);
QF_FOR_EACH_INPUT_TYPE(QF_INSTANTIATE)
#undef QF_INSTANTIATE

}  // namespace qf::int8
