// CPU model of the int4 CUDA quantizer's fast path (int4_cuda.cu, quantize_fused_kernel): codes
// from p = x * fl(1 / scale) (unrounded) rounded by one fused multiply-add with 1.5 * 2^23 + c,
// with the exact rule wherever fl(p - that integer) is not below 0.5 - 2^-17. Checks, over random groups built to stress the argument
// (Gaussian and uniform data at scales from 2^-120 to 2^120, integer data, fp16- and bf16-rounded
// data, values placed on and next to every rounding tie and at the range ends), that every code the fast path keeps equals
// asym_code / sym_code of int4.h, and that the flagged values' codes from tie_code (the
// division-free exact decision) equal them too; reports how often values are flagged.
//   c++ -std=c++17 -O2 -ffp-contract=off -Isrc tests/int4/fast_path_check.cpp -o /tmp/fpc && /tmp/fpc [groups]
// Exit status 0 and "ok" when no code differs.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "formats/int4/int4.h"

using namespace qf::int4;

static uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static float bf16(float f) {  // round to bfloat16 (nearest even), as torch's .to(bfloat16)
  uint32_t u = bits(f);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float r; std::memcpy(&r, &u, 4); return r;
}

static uint64_t n_values = 0, n_flagged = 0, n_bad = 0, n_fast_groups = 0;

// int4_cuda.cu's tie_code (the rule's code of a flagged value, without a division).
static int tie_code(bool asym, float v, float y, float d, float m, float s, float zero) {
  if (!(d == d)) return asym ? 0 : 8;
  const float h = (y - m) + std::copysign(0.5f, d);
  const float z = std::fma(-h, s, v);
  const float ah = std::fabs(h);
  const float half_ulp = ah >= 8.0f ? 0x1p-21f : ah >= 4.0f ? 0x1p-22f : ah >= 2.0f ? 0x1p-23f
                       : ah >= 1.0f ? 0x1p-24f : 0x1p-25f;
  const bool outward = (z > 0.0f) == (h > 0.0f);
  const float lim = (ah == 0.5f && !outward ? 0x1p-26f : half_ulp) * s;
  const int a = static_cast<int>(std::nearbyint(h - 0.5f));
  int k;
  if (std::fabs(z) <= lim) k = a + (a & 1);
  else k = z > 0.0f ? a + 1 : a;
  if (asym) {
    const int q = k + static_cast<int>(zero);
    return q < 0 ? 0 : q > 15 ? 15 : q;
  }
  return (k < -8 ? -8 : k > 7 ? 7 : k) & 15;
}

// One group: the fast path's code for every value it does not flag, against the rule.
static void check_group(const std::vector<float>& x, bool asym) {
  float lo = 0.0f, hi = 0.0f, amax = 0.0f;
  for (float v : x) { lo = min_step(lo, v); hi = max_step(hi, v); amax = absmax_step(amax, v); }
  const AsymParams ap = asym_params(lo, hi);
  const float s = asym ? ap.scale : sym_scale(amax);
  if (!(s >= 0x1p-100f && s < INFINITY)) return;  // the kernel's exact-rule groups
  ++n_fast_groups;
  const float inv = 1.0f / s;
  const float m = 12582912.0f + (asym ? ap.zero : 8.0f);
  for (float v : x) {
    ++n_values;
    const float y = std::fma(v, inv, m);          // m + round(v * inv), the product unrounded
    const float d = std::fma(v, inv, -(y - m));   // v * inv - that integer, rounded once
    int fast;
    if (!(std::fabs(d) < 0.5f - 0x1p-17f)) {
      ++n_flagged;
      fast = tie_code(asym, v, y, d, m, s, ap.zero) ^ (asym ? 0 : 8);  // compared as c + k below
    } else {
      fast = static_cast<int>(bits(y) - 0x4B400000u);  // c + k
    }
    const int want = asym ? asym_code(v, ap) : (sym_code(v, s) & 15) ^ 8;
    if (fast < 0 || fast > 15 || fast != want) {
      if (n_bad++ < 10)
        std::printf("%s: x = %a scale = %a zero = %g: fast %d, rule %d\n", asym ? "asym" : "sym", v, s,
                    asym ? ap.zero : 0.0f, fast, want);
    }
  }
}

int main(int argc, char** argv) {
  const long groups = argc > 1 ? std::atol(argv[1]) : 2000000;
  std::mt19937_64 rng(12345);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_real_distribution<float> unif(-1.0f, 1.0f);
  std::vector<float> x;
  for (long g = 0; g < groups; ++g) {
    const int gs = 8 << (rng() % 6);  // 8 .. 256
    x.assign(gs, 0.0f);
    const int kind = static_cast<int>(rng() % 8);
    const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 241) - 120);
    const float shift = (rng() % 3 == 0) ? 0.0f : unif(rng) * 2.0f;
    for (int i = 0; i < gs; ++i) {
      switch (kind) {
        case 0: x[i] = (gauss(rng) + shift) * scale; break;
        case 1: x[i] = (unif(rng) + shift * 0.5f) * scale; break;
        case 2: x[i] = static_cast<float>(static_cast<int>(rng() % 41) - 20); break;  // integers
        case 6: x[i] = qf::round_to_fp16((gauss(rng) + shift) * std::ldexp(1.0f, static_cast<int>(g % 21) - 10)); break;
        case 7: x[i] = bf16((gauss(rng) + shift) * scale); break;  // bf16 data: many exact ties
        default: x[i] = (gauss(rng) + shift) * scale; break;  // ties placed below
      }
    }
    if (kind >= 3) {
      // Place values on and around the rounding ties of this group's own scale: (h + 0.5) * s,
      // for h across the code range, nudged by -3..3 ulps.
      float lo = 0.0f, hi = 0.0f, amax = 0.0f;
      for (float v : x) { lo = min_step(lo, v); hi = max_step(hi, v); amax = absmax_step(amax, v); }
      const bool asym = kind != 5;
      const float s = asym ? asym_params(lo, hi).scale : sym_scale(amax);
      if (s > 0.0f && std::isfinite(s)) {
        for (int i = 1; i < gs; i += 2) {  // keep the extrema (even slots may hold them)
          const int h = static_cast<int>(rng() % 16) - 8;
          float v = (static_cast<float>(h) + 0.5f) * s;
          const int nudge = static_cast<int>(rng() % 7) - 3;
          for (int k = 0; k < std::abs(nudge); ++k) v = std::nextafter(v, nudge > 0 ? INFINITY : -INFINITY);
          if (v >= lo && v <= hi) x[i] = v;  // inside the group's range: the extrema stay
        }
      }
    }
    check_group(x, true);
    check_group(x, false);
  }
  std::printf("%llu fast-path groups, %llu values, %llu flagged (%.2e), %llu mismatches\n",
              static_cast<unsigned long long>(n_fast_groups), static_cast<unsigned long long>(n_values),
              static_cast<unsigned long long>(n_flagged), double(n_flagged) / double(n_values ? n_values : 1),
              static_cast<unsigned long long>(n_bad));
  if (n_bad) return 1;
  std::printf("ok\n");
  return 0;
}
