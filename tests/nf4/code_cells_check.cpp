// Exhaustive check of nf4.h's code_of_cells (the CUDA quantizer's table form of the NF4 code)
// against code_of, over all 2^32 float32 bit patterns (NaN, +-inf, subnormals, +-0 included),
// of its premise (no cell holds two midpoints), and that cell_of_unclamped (the GPU's index for
// finite input) equals cell_of wherever |s| <= 1 + 2^-20. The device computes cell_of with the
// same operations (fminf / fmaxf clamp, NaN -> -1, as here; one correctly rounded fma).
//   c++ -std=c++17 -O2 -ffp-contract=off -Isrc tests/nf4/code_cells_check.cpp -o /tmp/ccc && /tmp/ccc
// (about half a minute; an optional argument k checks every k-th pattern only). Exit status 0
// and "ok" when every pattern agrees.
#include <cstdint>
#include <cstdio>
#include <cmath>
#include <cstdlib>

#include "formats/nf4/nf4.h"

int main(int argc, char** argv) {
  using namespace qf::nf4;
  const uint64_t stride = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1;
  CodeCell cells[kCodeCells];
  int per_cell[kCodeCells] = {};
  for (int i = 0; i < kCodeCells; ++i) cells[i] = code_cell(i);
  for (int j = 0; j < 15; ++j) {
    const int c = cell_of(kMidpoint[j]);
    if (c < 0 || c >= kCodeCells) { std::printf("midpoint %d: cell %d out of range\n", j, c); return 1; }
    if (++per_cell[c] > 1) { std::printf("cell %d holds two midpoints\n", c); return 1; }
  }
  uint64_t checked = 0, bad = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += stride) {
    const float s = qf::f32_from_bits(static_cast<uint32_t>(u));
    const int c = cell_of(s);
    const bool near = std::fabs(s) <= 1.0f + 0x1p-20f;  // false for NaN
    if (c < 0 || c >= kCodeCells || code_of_cells(s, cells) != code_of(s) || (near && cell_of_unclamped(s) != c)) {
      if (bad++ < 10) std::printf("mismatch at bits 0x%08llx (cell %d)\n", static_cast<unsigned long long>(u), c);
    }
    ++checked;
  }
  std::printf("%llu patterns checked, %llu mismatches\n", static_cast<unsigned long long>(checked),
              static_cast<unsigned long long>(bad));
  if (bad) return 1;
  std::printf("ok\n");
  return 0;
}
