"""The CUDA prefill kernel's tile rules (src/gemm/prefill_plan.h), on the CPU: the tile and K split
the launcher takes for a shape, given a device's SM count and how many clusters of each CTA kind
run at once. The device here is modeled on an H200 (132 SMs; 30 clusters of 4 of the 128 x 256,
128 x 192 or 128 x 128 CTAs at once, as measured there for 128 x 256 and 128 x 128, else SMs x CTAs
per SM / cluster size), so the shapes
that tests/gemm/test_gemm_cuda.py names for each tile are checked to take it. With the workspace,
the stream-K plans, and how the kernel shares the tiles out among its CTAs (prefill_piece)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qformats._runtime import _native

SMS = 132
WIDE, MID, LOW, N192 = 0, 1, 2, 3  # 128 x 256, 128 x 128, 128 x 192 (one CTA per SM), 64 x 128 (two)


def h200_fits(kind: int, s: int, tiles: int) -> bool:
    per_sm = 2 if kind == LOW else 1
    clusters = 30 if (kind != LOW and s == 4) else SMS * per_sm // s
    return tiles <= clusters


def plan(n: int, m: int, k: int, sms: int = SMS, fits=h200_fits) -> tuple:
    """(bm, bn, split) without stream-K (no workspace)."""
    bm, bn, split, sk = _native.prefill_plan(n, m, k, sms, fits)
    assert sk == 0
    return bm, bn, split


def plan_sk(n: int, m: int, k: int, sms: int = SMS, fits=h200_fits) -> tuple:
    """(bm, bn, split, stream-K tiles) with the workspace."""
    return tuple(_native.prefill_plan(n, m, k, sms, fits, stream_k=True))


@pytest.mark.parametrize("n,m,k,want", [
    # Llama-2-7B's gate / up (11008 x 4096): 86 tiles of 128 x 192 or 128 x 256 in one wave, short
    # of 3/4 of the SMs, rather than 172 of 128 x 128 in two; 128 x 192 where it needs no more waves
    (160, 11008, 4096, (128, 192, 1)), (256, 11008, 4096, (128, 256, 1)), (512, 11008, 4096, (128, 192, 1)),
    (1024, 11008, 4096, (128, 256, 1)),
    # Llama-3-8B's shapes
    (256, 14336, 4096, (128, 256, 1)), (300, 14336, 4096, (128, 192, 1)), (512, 14336, 4096, (128, 256, 1)),
    (256, 4096, 14336, (128, 128, 2)), (512, 4096, 14336, (128, 256, 2)), (600, 4096, 14336, (128, 192, 1)),
    # 257-384 rows of a 4096-row weight: 64 tiles of 128 x 192 or of 128 x 256, split in two; the
    # narrower ones
    (300, 4096, 14336, (128, 192, 2)), (384, 4096, 4096, (128, 192, 2)), (385, 4096, 14336, (128, 256, 2)),
    # 129-192 rows of 8192 x 8192: 128 x 192 split in two rather than 128 x 128 unsplit (64 or 128
    # activation columns an SM)
    (150, 8192, 8192, (128, 192, 2)),
    (64, 4096, 14336, (64, 64, 2)), (64, 17000, 512, (128, 64, 1)),
    # up to 64 rows the same grids with tiles of 16, 32 or 64 rows of X
    (16, 14336, 4096, (128, 16, 1)), (20, 4096, 14336, (64, 32, 2)), (33, 14336, 4096, (128, 64, 1)),
    (65, 14336, 4096, (128, 128, 1)),
    # a grouped-query attention's key / value projection at 64 rows: declined (the wgmma kernel)
    (64, 1024, 4096, (0, 0, 0)),
    # the shapes of test_gemm_cuda.py's PREFILL_SHAPES and what its comment says they take
    (250, 3150, 4096, (128, 256, 4)), (200, 4050, 4096, (128, 128, 2)), (100, 4050, 2304, (64, 128, 2)),
    (160, 12800, 512, (128, 192, 1)), (150, 8900, 512, (128, 192, 1)), (250, 8900, 512, (128, 256, 1)),
    (500, 14333, 512, (128, 256, 1)), (300, 14333, 512, (128, 192, 1)), (600, 4000, 512, (128, 192, 1)),
    (500, 4000, 2304, (128, 256, 2)), (300, 4000, 2304, (128, 192, 2)), (300, 1800, 4096, (128, 192, 4)),
    (200, 520, 8192, (64, 128, 8)), (2048, 77, 512, (64, 128, 1)), (40, 20000, 512, (128, 64, 1)),
    (40, 4050, 2304, (64, 64, 2)), (40, 3150, 4096, (128, 64, 4)), (20, 14333, 512, (128, 32, 1)),
    (16, 3150, 4096, (128, 16, 4)),
])
def test_plan_on_a_modeled_h200(n, m, k, want):
    assert plan(n, m, k) == want


def test_cluster_occupancy_decides_the_split():
    """25 tiles of 128 x 256 split in clusters of 4 where 25 such clusters run at once; where none
    of 2, 4, 8 does, 128 x 128 tiles, split in two."""
    assert plan(250, 3150, 4096) == (128, 256, 4)
    assert plan(250, 3150, 4096, fits=lambda kind, s, tiles: kind != WIDE and h200_fits(kind, s, tiles)) == \
        (128, 128, 2)


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 5000), m=st.integers(1, 40000), k=st.integers(1, 160).map(lambda u: 128 * u),
       sms=st.sampled_from([16, 78, 114, 132]))
def test_plan_invariants(n, m, k, sms):
    """Whatever the shape: a known tile; a split only where each CTA gets an even number of at
    least 16 steps of 64 and one wave of clusters holds the tiles, 128 x 192 only above 128 rows and
    split over 2 or 4 at most; up to 128 rows, the fewest rows of X of 16, 32, 64, 128 that hold
    them, and a declined shape only there."""
    def fits(kind, s, tiles):
        return tiles <= SMS * (2 if kind == LOW else 1) // s * sms // SMS

    bm, bn, split = plan(n, m, k, sms, fits)
    if bm == 0:
        assert n <= 128 and (bn, split) == (0, 0)
        return
    assert bm in (64, 128) and bn in (16, 32, 64, 128, 192, 256) and (bm == 128 or bn <= 128)
    assert split in (1, 2, 4, 8)
    if split > 1:
        steps = k // 64
        assert steps % (2 * split) == 0 and steps // split >= 16
        tiles = -(-m // bm) * -(-n // bn)
        assert fits({256: WIDE, 192: N192}.get(bn, MID if bm == 128 else LOW), split, tiles)
    if bn == 192:
        assert split in (1, 2, 4) and n > 128
    if n <= 128:
        assert bn == next(b for b in (16, 32, 64, 128) if n <= b)


@pytest.mark.parametrize("n,m,k,want", [
    # 14336 x 4096 at 512 rows: 224 tiles of 128 x 256, 1.7 waves: all shared out
    (512, 14336, 4096, (128, 256, 1, 224)),
    # at 1024 rows: 448 tiles, 3.4 waves: the last 132 + 52; at 2048 rows 896 tiles, 6.8 waves: the
    # last wave 79% full, not shared out
    (1024, 14336, 4096, (128, 256, 1, 184)), (2048, 14336, 4096, (128, 256, 1, 0)),
    # 11008 x 4096: at 300 rows 172 tiles of 128 x 192 (two columns either way); at 512 rows 258 of
    # 128 x 192 in two waves (the second 95% full) rather than 172 of 128 x 256 shared out (1.3 +
    # 1/4 waves of wider tiles); at 1024 rows 344 of 128 x 256 shared out (2.9 waves) rather than
    # 516 of 128 x 192 in four; at 256 rows 86 of 128 x 256 in one wave (not 172 of 128 x 192
    # shared out)
    (300, 11008, 4096, (128, 192, 1, 172)), (512, 11008, 4096, (128, 192, 1, 0)),
    (1024, 11008, 4096, (128, 256, 1, 212)), (2048, 11008, 4096, (128, 256, 1, 160)),
    # split plans and the few-tile shapes do not change; nor do tiles of up to 64 rows
    (512, 4096, 14336, (128, 256, 2, 0)), (256, 11008, 4096, (128, 256, 1, 0)), (64, 28672, 4096, (128, 64, 1, 0)),
    # 65-128 rows: 128 x 128 tiles shared out (28672 weight rows: 224 tiles)
    (128, 28672, 4096, (128, 128, 1, 224)),
    # 28672 x 4096 at 577 rows: 128 x 192 would multiply fewer columns (896 tiles in 7 waves, the
    # last 79% full) but is not shared out, so by whole waves: 672 of 128 x 256, the last 12 with
    # one wave shared out
    (577, 28672, 4096, (128, 256, 1, 144)),
    # the shapes of test_gemm_cuda.py's test_prefill_stream_k, with 132 SMs
    (256, 128 * 198 + 77, 768, (128, 256, 1, 199)), (300, 128 * 132 + 1, 1024, (128, 192, 1, 134)),
    (129, 128 * 308, 512, (128, 192, 1, 176)), (80, 128 * 198 - 5, 1024, (128, 128, 1, 198)),
])
def test_stream_k_plan_on_a_modeled_h200(n, m, k, want):
    assert plan_sk(n, m, k) == want


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 5000), m=st.integers(1, 40000), k=st.integers(1, 160).map(lambda u: 128 * u),
       sms=st.sampled_from([16, 78, 114, 132]))
def test_stream_k_plan_invariants(n, m, k, sms):
    """With the workspace, stream-K only on unsplit tiles of 128 x 128 or more, over more than one
    wave of `sms`, with the tiles of the last two waves; the tile otherwise as without it, but for
    the choice between 128 x 256 and 128 x 192 where shared-out waves change which is the cheaper,
    and then only for a tile that is shared out."""
    bm, bn, split, sk = plan_sk(n, m, k, sms)
    base = plan(n, m, k, sms)
    assert (bm, bn, split) == base or ((bm, split) == base[::2] and {base[1], bn} == {192, 256} and sk)
    if sk:
        tiles = -(-m // bm) * -(-n // bn)
        assert bm == 128 and split == 1 and bn >= 128 and tiles > sms
        assert sk == sms + tiles % sms and tiles % sms


@pytest.mark.parametrize("n,m,k,sms,want", [(498, 3496, 3328, 78, (128, 256, 2, 0)),
                                             (211, 7543, 3840, 114, (128, 256, 2, 0))])
def test_stream_k_keeps_a_split_plan(n, m, k, sms, want):
    """Where the plan without the workspace splits K (its tiles run in one wave), the workspace does
    not turn it into unsplit stream-K tiles of the other width (found by
    test_stream_k_plan_invariants: 84 tiles of 128 x 192 shared out over 78 SMs, 1.3 waves, were
    taken over 56 tiles of 128 x 256 split in two)."""
    assert plan_sk(n, m, k, sms) == want


def check_stream_k_pieces(tiles: int, ctas: int, ksteps: int, sk: int) -> None:
    """Every step of every tile taken once; a tile cut at most once, into the first steps (the
    last piece of a CTA's run) and the rest (the first stream-K piece of the next lower CTA's
    run), so the CTA that waits for a cut tile's partial sums has the higher index; every CTA's
    stream-K work within one step pair of the others'."""
    seen = {}
    cut_head, cut_tail, work = {}, {}, []
    for cta in range(ctas):
        pieces = _native.prefill_pieces(cta, ctas, tiles, ksteps, sk)
        total = 0
        for i, (tile, kb, steps) in enumerate(pieces):
            assert 0 <= tile < tiles and steps >= 2 and steps % 2 == 0 and kb % 2 == 0 and kb + steps <= ksteps
            for k in range(kb, kb + steps):
                assert (tile, k) not in seen
                seen[tile, k] = cta
            if steps < ksteps:
                assert sk and tile >= tiles - sk
                if kb == 0:
                    assert i == len(pieces) - 1 and tile not in cut_head
                    cut_head[tile] = cta
                else:
                    assert kb + steps == ksteps and tile not in cut_tail
                    cut_tail[tile] = cta
            if tile >= tiles - sk:
                total += steps
        work.append(total)
    assert len(seen) == tiles * ksteps
    assert set(cut_head) == set(cut_tail)
    for tile, cta in cut_head.items():
        assert cut_tail[tile] == cta - 1
    if sk:
        assert max(work) - min(work) <= 2


@pytest.mark.parametrize("n,m,k", [(512, 14336, 4096), (1024, 14336, 4096), (300, 11008, 4096), (1024, 11008, 4096),
                                   (2048, 11008, 4096), (128, 28672, 4096), (256, 128 * 198 + 77, 768),
                                   (300, 128 * 132 + 1, 1024), (129, 128 * 308, 512), (80, 128 * 198 - 5, 1024)])
def test_stream_k_pieces_of_the_plans(n, m, k):
    """The pieces of the modeled H200's stream-K plans (those above and test_gemm_cuda.py's)."""
    bm, bn, split, sk = plan_sk(n, m, k)
    assert sk > 0
    check_stream_k_pieces(-(-m // bm) * -(-n // bn), SMS, k // 64, sk)


@settings(max_examples=200, deadline=None)
@given(ctas=st.integers(1, 140), tiles_over=st.integers(1, 400), pairs=st.integers(1, 40), data=st.data())
def test_stream_k_pieces(ctas, tiles_over, pairs, data):
    """The same for any tile count above one wave, step count and shared-out tail (the last
    `ctas` + tiles % ctas tiles, or more whole waves), and without stream-K."""
    tiles = ctas + tiles_over
    whole = data.draw(st.integers(0, (tiles - ctas) // ctas))
    sk = tiles - whole * ctas if data.draw(st.booleans()) else 0
    if sk and sk < ctas:
        sk = 0
    check_stream_k_pieces(tiles, ctas, 2 * pairs, sk)


@pytest.mark.parametrize("args", [(0, 100, 512), (100, 0, 512), (100, 100, 100), (100, 100, 0), (2**31, 1, 128),
                                  (1, 2**31, 128)])
def test_bad_arguments_raise(args):
    with pytest.raises(ValueError, match="prefill_plan"):
        plan(*args)
    with pytest.raises(ValueError, match="prefill_plan"):
        _native.prefill_plan(100, 100, 512, 0, h200_fits)
