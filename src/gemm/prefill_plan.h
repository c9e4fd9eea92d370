// The prefill kernel's tile and K split for a shape: the rules of gemm/weight_only_prefill_cuda.cuh's
// launcher, in host-only C++ so that they are testable without a GPU (qformats._runtime._native's
// prefill_plan, tests/gemm/test_prefill_plan.py). What the rules stand on is measured per shape in
// benchmarks/README.md ("A GEMM that decodes int4 in its main loop, for prefill", "Split K and
// persistent CTAs in the prefill kernel", "The prefill kernel from 33 rows", "The prefill tile
// counts waves").
#pragma once
#include <algorithm>
#include <cstdint>

#include "common/fp16.h"  // (QF_HOST_DEVICE)

namespace qf::gemm {

// The CTA shapes whose K the launcher can split over a cluster (weight x activation rows).
enum class PrefillKind : int {
  kWide = 0,  // 128 x 256, one CTA per SM
  kMid = 1,   // 128 x 128, one CTA per SM
  kLow = 2,   // 64 x 128, two CTAs per SM
  kN192 = 3,  // 128 x 192, one CTA per SM (K split over 2 or 4 only: its 24 column groups shared evenly)
};

struct PrefillPlan {
  int bm = 0;                  // weight rows of a tile (64 or 128); 0: the prefill kernel declines the shape
  int bn = 0;                  // activation rows of a tile (16, 32, 64, 128, 192 or 256)
  int split = 0;               // CTAs of a cluster sharing a tile, each a K span (1: no split)
  int64_t stream_k_tiles = 0;  // the last tiles shared out by stream-K (prefill_stream_k_tiles); 0: none
};

// Stream-K over the last waves (after CUTLASS's data-parallel + stream-K hybrid): where `tiles`
// unsplit tiles run on `ctas` persistent CTAs (one per SM) and the last wave leaves SMs idle, the
// tiles of the last two waves (`ctas` + tiles % ctas of them) are shared out as equal spans of
// their K steps, so that every CTA ends after tiles / ctas tiles' work instead of
// ceil(tiles / ctas); a tile cut between two CTAs is summed through a workspace in global memory.
// Returns how many tiles (the last ones) are shared out that way; 0: none, where there is no
// second wave or the last one is more than 70% full. On an H200 a run shared out that way took
// about a quarter of a wave more than tiles / ctas (the flags' memset, the cut tiles' partial sums;
// benchmarks/README.md, "Stream-K over the last waves"), so the rule asks for at least 30% of the
// SMs idle in the last wave. Each CTA's span is at least one tile's steps, so a tile is cut at most
// once.
constexpr int64_t prefill_stream_k_tiles(int64_t tiles, int64_t ctas) {
  if (ctas <= 0 || tiles <= ctas) return 0;
  const int64_t rem = tiles % ctas;
  return rem == 0 || 10 * rem > 7 * ctas ? 0 : ctas + rem;
}

// The tile for Y [N, M] = X [N, K] . W [M, K]^T on a device of `sms` SMs; `fits(kind, s, tiles)`
// says whether `tiles` clusters of s CTAs of that kind run at once (one wave). By the first rule
// that gives at least 3/4 of a CTA per SM (up to 128 activation rows, from the 128 x 128 rules on):
// - 128 x 256, persistent CTAs over the tiles; 128 x 192 instead where its tiles need no more waves
//   of one CTA per SM (each CTA then runs as many tiles, each with a quarter less of the multiplies
//   and the same decode);
// - 128 x 256 with K split over a cluster of 2, 4 or 8 CTAs (the fewest that reach the rule, each
//   cluster one tile, all in one wave, an even number of steps of 64 of at least 16 per CTA):
//   fewer, wider tiles decode each weight for more activation rows than the narrower kinds below;
//   above 128 rows, wherever a split plan is taken (this one or the narrower ones below), 128 x 192
//   split over 2 or 4 instead where each SM then multiplies fewer activation columns (192 / s
//   against the plan's bn / split; e.g. 4096 weight rows at 257-384 activation rows);
// - above 128 rows, the unsplit tile of the first rule short of the 3/4 where 128 x 128 would take
//   two waves (e.g. 11008 weight rows at 256 activation rows: 86 tiles of 128 x 256 in one wave,
//   not 172 of 128 x 128 in two over 132 SMs);
// - 128 x 128, persistent; then 128 x 128 with K split as above;
// - 64 x 128 (two CTAs per SM), with K split as above where its tiles alone are too few.
// Up to 64 rows the tiles of 128 activation rows are cut to 16, 32 or 64 (the fewest that hold N;
// the same grid and split, fewer multiplies).
// With `stream_k` (the caller has the workspace), unsplit tiles of 128 weight rows by 128 or more
// activation rows on `sms` CTAs take prefill_stream_k_tiles where it applies, and from 129 rows
// 128 x 192 or 128 x 256 is the one that multiplies fewer activation columns per SM, a shared-out
// run counted as tiles / sms + 1/4 waves, where that one is shared out and the plan without
// stream-K is unsplit (e.g. 11008 weight rows at 1024 rows: 344 tiles of 128 x 256 shared out,
// 2.9 waves, rather than 516 of 128 x 192 in four); otherwise, and without it, by whole waves as
// above.
// Up to 128 rows it declines the shapes whose tiles, split or not, leave the GPU short of the rule
// (few weight rows, e.g. a grouped-query attention's key / value projection): the wgmma kernel
// splits K more finely (64 unsplit 64 x 128 tiles of 4096x4096 measured slower than it).
// N, M >= 1 and K a positive multiple of 128 (the launcher checks).
template <class Fits>
PrefillPlan plan_prefill(int64_t N, int64_t M, int64_t K, int sms, Fits&& fits, bool stream_k = false) {
  const int64_t fill = 3 * int64_t(sms) / 4, steps = K / 64;
  auto ctas = [&](int bm, int bn) { return ((M + bm - 1) / bm) * ((N + bn - 1) / bn); };
  auto waves = [&](int64_t tiles) { return (tiles + sms - 1) / sms; };
  // The fewest K slices (2, 4, 8) that give `tiles` of `kind` the fill in one wave of clusters,
  // each slice an even number of at least 16 steps; 0 if none.
  auto split_for = [&](PrefillKind kind, int64_t tiles, int most) {
    for (int s = 2; s <= most; s *= 2) {
      if (steps % (2 * s) || steps / s < 16 || tiles * s < fill) continue;
      if (fits(kind, s, tiles)) return s;
    }
    return 0;
  };
  auto unsplit = [&](int b) { return PrefillPlan{128, b, 1}; };
  // 128 x 128 tiles, else 64 x 128 (two CTAs per SM), K split where their tiles are too few.
  auto narrow = [&]() -> PrefillPlan {
    if (ctas(128, 128) >= fill) return unsplit(128);
    if (const int s = split_for(PrefillKind::kMid, ctas(128, 128), 8)) return {128, 128, s};
    const int s = ctas(64, 128) < fill ? split_for(PrefillKind::kLow, ctas(64, 128), 8) : 0;
    return {64, 128, std::max(s, 1)};
  };
  if (stream_k) {
    // The plan without the workspace. Where it is unsplit, over tiles of 128 x 128 or more: above
    // 128 rows the width that multiplies fewer activation columns per SM (times 4 sms: a
    // shared-out run as tiles / sms + 1/4 waves) where that width is itself shared out, and its
    // stream-K tiles. A split plan stays as it is: its tiles run in one wave.
    PrefillPlan p = plan_prefill(N, M, K, sms, fits, false);
    if (p.bm != 128 || p.split != 1 || p.bn < 128) return p;
    auto columns = [&](int bn) {
      const int64_t t = ctas(128, bn);
      return prefill_stream_k_tiles(t, sms) ? bn * (4 * t + sms) : 4 * bn * waves(t) * sms;
    };
    const int cheaper = columns(192) <= columns(256) ? 192 : 256;
    if (N > 128 && prefill_stream_k_tiles(ctas(128, cheaper), sms)) p.bn = cheaper;
    p.stream_k_tiles = prefill_stream_k_tiles(ctas(128, p.bn), sms);
    return p;
  }
  // Above 128 rows: by whole waves.
  int bn = 256;
  if (N > 128 && waves(ctas(128, 192)) <= waves(ctas(128, 256))) bn = 192;
  if (N > 128 && ctas(128, bn) < fill) {
    const int s256 = split_for(PrefillKind::kWide, ctas(128, 256), 8);
    if (!s256 && ctas(128, 128) > sms) return PrefillPlan{128, bn, 1};
    // The plan otherwise taken, and 128 x 192 split instead where each SM then multiplies fewer
    // activation columns per weight row (192 / s against bn / split; e.g. 4096 weight rows at
    // 257-384 activation rows: 64 tiles of 128 x 192 split in two, not of 128 x 256).
    const PrefillPlan other = s256 ? PrefillPlan{128, 256, s256} : narrow();
    const int s192 = split_for(PrefillKind::kN192, ctas(128, 192), 4);
    if (s192 && 192 * other.split < other.bn * s192) return {128, 192, s192};
    return other;
  }
  if (N <= 128) {
    PrefillPlan p = narrow();
    if (ctas(p.bm, p.bn) * p.split < fill) return {};
    p.bn = N <= 16 ? 16 : N <= 32 ? 32 : N <= 64 ? 64 : 128;
    return p.split == 1 && p.bm == 128 ? unsplit(p.bn) : p;
  }
  return unsplit(bn);
}

// One piece of a CTA's work: a tile (weight-row tiles fastest), its steps kb .. kb + steps - 1.
struct PrefillPiece {
  int tile, kb, steps;  // tile < 0: no more pieces
};

// Piece i of CTA `cta` of `ctas` (the tile stride) in the prefill kernel: without stream-K
// (sk_tiles = 0), tile cta + i ctas, K span z of `splits`; with it (no split), first the whole
// tiles before the last sk_tiles, then the CTA's span of those tiles' ksteps steps, in pairs. The spans go to the CTAs
// in reverse order (CTA ctas - 1 takes the first), so that the CTA taking the start of a cut tile's steps (at the end
// of its span, last in its run) has the higher index, and the one it waits for (taking the rest, first in its run) was
// launched before it.
QF_HOST_DEVICE PrefillPiece prefill_piece(int i, int cta, int ctas, int z, int splits, int tiles, int ksteps,
                                          int sk_tiles) {
  const int whole = (tiles - sk_tiles) / ctas;  // rounds of whole tiles (all of them without stream-K)
  if (sk_tiles == 0 || i < whole) {
    const int t = cta + i * ctas, s = ksteps / splits;
    return {t < tiles ? t : -1, z * s, s};
  }
  const int64_t P = ksteps / 2, I = int64_t(sk_tiles) * P, j = ctas - 1 - cta;
  const int64_t first = j * I / ctas, end = (j + 1) * I / ctas, t0 = first / P, q = i - whole;
  const int64_t a = q == 0 ? first : (t0 + q) * P, e = end < (t0 + q + 1) * P ? end : (t0 + q + 1) * P;
  if (a >= end) return {-1, 0, 0};
  return {int(tiles - sk_tiles + t0 + q), int(2 * (a - (t0 + q) * P)), int(2 * (e - a))};
}

// The stream-K workspace of `ctas` CTAs of 128 weight rows by bn activation rows: a flag word per
// CTA (the region padded to 256 bytes), then each CTA's partial sums of one tile in float32.
constexpr int64_t prefill_stream_k_flag_bytes(int64_t ctas) { return (4 * ctas + 255) / 256 * 256; }
constexpr int64_t prefill_stream_k_bytes(int64_t ctas, int bn) {
  return prefill_stream_k_flag_bytes(ctas) + ctas * 128 * int64_t(bn) * 4;
}

// Bytes of workspace that a product of N activation rows by M weight rows may take on a device of
// `sms` SMs (0: stream-K cannot apply): an upper bound over the tiles plan_prefill may share out
// (from 65 rows; 128, 192 or 256 activation rows, at most 128 up to 128 rows and 192 up to 192),
// so that a caller can allocate it before the plan is made.
inline int64_t prefill_workspace_bytes(int64_t N, int64_t M, int sms) {
  if (N <= 64 || M <= 0 || sms <= 0) return 0;
  const int bn_max = N <= 128 ? 128 : N <= 192 ? 192 : 256;
  if ((M + 127) / 128 * ((N + 127) / 128) <= sms) return 0;
  return prefill_stream_k_bytes(sms, bn_max);
}

}  // namespace qf::gemm
