"""Child of test_native_sizes.py (run in a capped Python: ``-c <this file> FORMAT``): calls every
function of ``qformats.<FORMAT>._native`` with hostile integer arguments and arrays, and prints
one JSON line with what happened. A crash ends the child before that line: the parent sees a
signal instead of a returncode of 0, and the case on the last stderr line.

Each function has a template (below): a valid call, whose arrays are read-only for inputs and
sit between guard bytes, so that a write out of bounds, or into an input, shows. The child
checks the template succeeds, then runs

- every integer argument (sizes and parameters; not ``stream``) replaced by each HOSTILE value,
  with the template's arrays and with arrays emptied (first dimension 0: one, all but one, all),
  so that a product that wraps to 0 meets arrays it would match (the crash of issue 17);
- Hypothesis-drawn calls: several integers replaced at once (from HOSTILE, small values and all
  of int64), any subset of the arrays emptied.

Outcomes allowed: success, ValueError or OverflowError, and TypeError for integers outside
int64 (nanobind refuses to convert them); a RuntimeError only where CUDA_CONTEXT says. A negative
or overflowing argument must be named in the message. Anything else, a guard byte changed or an
input modified is a failure.
"""
from __future__ import annotations

import importlib
import json
import sys

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qformats

FMT = sys.argv[1]
MOD = importlib.import_module(f"qformats.{FMT}._native")
CUDA_BUILT = importlib.import_module("qformats._runtime").cuda_built()

HOSTILE = (2**62, 2**63 - 1, -1, 2**31, -(2**63), 2**63)
POOL = HOSTILE + (0, 1, 4, 8, 16, 32, 64, 2**32, 2**61, 2**62 + 32, 2**63 - 32)
INT64 = (-(2**63), 2**63 - 1)
GUARD = 64  # bytes each side of every array, filled with 0xA5
NOT_SIZES = {"stream"}  # integer arguments that are no size (a CUDA stream handle)
NO_ARGS = {"gemm_isa", "constants"}  # functions without arguments


def _zeros(dtype, *shape):
    return np.zeros(shape, dtype)


def _ones(dtype, *shape):
    return np.ones(shape, dtype)


def _templates():
    """{function: {argument: value}}: one valid call per function of the module. Sizes are
    multiples of 4, so that 4 * 2**62 (which wraps to 0) is among the products formed."""
    f32, u8, i8, i32, i64 = np.float32, np.uint8, np.int8, np.int32, np.int64
    if FMT in ("q4_0", "q8_0", "q8_1"):
        B = importlib.import_module(f"qformats.{FMT}").BLOCK_BYTES
        t = {
            "quantize": dict(x=_ones(f32, 4, 32), out=_zeros(u8, 4 * B)),
            "dequantize": dict(blocks=_zeros(u8, 4 * B), out=_zeros(f32, 128)),
        }
        if FMT == "q4_0":
            w, a = _zeros(u8, 4, 1, 18), _zeros(u8, 4, 1, 36)
            x, out = _ones(f32, 4, 32), _zeros(f32, 4, 4)
            t.update({
                "gemm_q4_0_q8_1": dict(weight_q=w, activation_q=a, out=out, M=4, N=4, K=32, out_nm=False,
                                       workspace=None),
                "gemm_q4_0_q8_1_workspace_bytes": dict(M=4, N=4, K=32),
                "linear": dict(x=x, w=w, out=out, M=4, N=4, K=32),
                "make_linear": dict(w=w, M=4, K=32, q8_1_activations=False),
                "gemm": dict(x=x, w=w, out=out, M=4, N=4, K=32),
            })
        return t
    if FMT == "int8":
        x, q, s, out = _ones(f32, 4, 8), _zeros(i8, 4, 8), _ones(f32, 4), _zeros(f32, 4, 8)
        return {
            "quantize": dict(x=x, q=_zeros(i8, 32), scale=_zeros(f32, 4), unit_len=8),
            "dequantize": dict(q=q, scale=s, out=out, unit_len=8),
            "int8_matmul": dict(a=q, b=q, out=_zeros(i32, 4, 4), N=4, M=4, K=8),
            "int8_linear": dict(a=q, a_scale=s, b=q, b_scale=s, bias=_ones(f32, 4), relu=False, scale_c=1.0,
                                out=_zeros(f32, 4, 4), N=4, M=4, K=8),
            "gemm": dict(x=x, q=q, scale=s, out=_zeros(f32, 4, 4), N=4, K=8, M=4, unit_len=8),
            "make_linear": dict(q=q, scale=s, M=4, K=8, unit_len=8),
        }
    if FMT == "int4":
        qw, sc, zp = _zeros(u8, 4, 16), _ones(f32, 4), _zeros(u8, 4)
        return {
            "quantize": dict(x=_ones(f32, 4, 32), qweight=_zeros(u8, 64), scales=_zeros(f32, 4),
                             zeros=_zeros(u8, 4), group_size=32),
            # (the tiles layout of a [16, 32] weight: tiles_K is K)
            "dequantize": dict(qweight=_zeros(u8, 256), scales=_ones(f32, 16), zeros=_zeros(u8, 16),
                               out=_zeros(f32, 512), group_size=32, tiles_K=32),
            "pack": dict(values=_zeros(u8, 4, 8), out=_zeros(u8, 16)),
            "unpack": dict(packed=_zeros(u8, 16), out=_zeros(u8, 32)),
            "gemm": dict(x=_ones(f32, 4, 32), qweight=qw, scales=sc, zeros=zp, out=_zeros(f32, 4, 4), N=4, K=32,
                         M=4, group_size=32),
            "make_linear": dict(qweight=qw, scales=sc, zeros=zp, M=4, K=32, group_size=32),
            "gemm_cuda_supports": dict(group_size=32),
            "int4_matmul": dict(a=_zeros(u8, 4, 4), b=_zeros(u8, 4, 4), out=_zeros(i32, 4, 4), N=4, M=4, K=8),
        }
    if FMT == "nf4":
        pk, am = _zeros(u8, 128), _ones(f32, 4)
        return {
            "quantize": dict(x=_ones(f32, 4, 64), blocksize=64, packed=_zeros(u8, 128), absmax=_zeros(f32, 4)),
            "dequantize": dict(packed=pk, absmax=am, blocksize=64, out=_zeros(f32, 256)),
            "double_quant": dict(absmax=am, q=_zeros(u8, 4), absmax2=_zeros(f32, 1), offset=_zeros(f32, 1)),
            "dequantize_absmax": dict(q=_zeros(u8, 4), absmax2=_ones(f32, 1), offset=_zeros(f32, 1),
                                      out=_zeros(f32, 4)),
            "make_linear": dict(packed=pk, absmax=am, M=4, K=64, blocksize=64),
            "gemm": dict(x=_ones(f32, 4, 64), packed=pk, absmax=am, out=_zeros(f32, 4, 4), M=4, K=64,
                         blocksize=64),
            "mean_torch_order": dict(x=_ones(f32, 8)),
        }
    if FMT == "mixed2bit":
        # real buffers (a consistent map: the CPU index checks it against n4), 4 of 16 groups 4-bit
        w = np.random.default_rng(0).standard_normal((4, 64)).astype(f32)
        q = qformats.mixed2bit.quantize(w, group_size=16, ratio_4bit=0.25, scale_block=4)
        dims = dict(rows=4, K=64, group_size=16, scale_block=4, n4=q.params["n4"], n_out=q.params["n_out"])
        bufs = {k: np.ascontiguousarray(v) for k, v in q.buffers.items()}
        empty = {k: np.zeros_like(v) for k, v in bufs.items()}
        return {
            "quantize": dict(w=w, sensitivity=None, **{k: v for k, v in dims.items() if k not in ("rows", "K")},
                             **empty, workspace=None),
            "dequantize": dict(**dims, **bufs, out=_zeros(f32, 256), workspace=None),
            "quantize_workspace_bytes": dict(dims),
            "dequantize_workspace_bytes": dict(dims),
            "gemm": dict(x=_ones(f32, 4, 64), **dims, **bufs, out=_zeros(f32, 4, 4), n4_before=None),
            "make_linear": dict(**dims, **bufs, n4_before=None),
            "row_index": dict(group_map=bufs["group_map"], rows=4, groups_per_row=4, n4_before=_zeros(i64, 5)),
            "gemm_cuda_supports": dict(dims),
            "pack_2bit": dict(values=_zeros(u8, 4, 16), out=_zeros(i32, 4)),
            "unpack_2bit": dict(packed=_zeros(i32, 4), out=_zeros(u8, 60)),
            **_tiled_templates(),
        }
    raise SystemExit(f"no templates for format {FMT!r}: add them to {__file__}")


def _tiled_templates():
    """mixed2bit's tiled layout: real buffers (each row's map marks its n4_row groups)."""
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    q = qformats.mixed2bit.quantize(w, group_size=16, ratio_4bit=0.5, scale_block=2, layout="tiled")
    dims = dict(rows=4, K=64, group_size=16, scale_block=2, n4_full=128, n4_last=2)
    bufs = {k: np.ascontiguousarray(v) for k, v in q.buffers.items()}
    empty = {k: np.zeros_like(v) for k, v in bufs.items()}
    return {
        "tiled_quantize": dict(w=w, sensitivity=None, group_size=16, scale_block=2, n4_full=128, n4_last=2, **empty),
        "tiled_dequantize": dict(**dims, **bufs, out=_zeros(np.float32, 256)),
        "make_tiled_linear": dict(**dims, **bufs),
        "tiled_check_map": dict(**dims, map=bufs["map"], bad_tiles=_zeros(np.int32, 1)),
        "tiled_gemm_cuda_supports": dict(dims),
    }


# Functions whose valid template call still raises a ValueError here (the size checks before
# that run all the same): row_index and tiled_check_map take CUDA arrays only (the child passes CPU
# arrays), the workspace queries need a CUDA build.
REFUSED_HERE = {"row_index", "tiled_check_map"} | (
    set() if CUDA_BUILT else {"quantize_workspace_bytes", "dequantize_workspace_bytes"})
# In a CUDA build, mixed2bit's quantize workspace query asks CUB (with outliers), which needs a
# CUDA context: the capped child may fail to create one, a RuntimeError naming the CUDA error.
CUDA_CONTEXT = {"quantize_workspace_bytes"} if CUDA_BUILT else set()


def _params(fn):
    """[(name, kind)] of a nanobind function, kind "int", "array", "array_ro" or "other", from
    its __nb_signature__ ("def f(x: ndarray[writable=False], n: int, stream: int = 0) -> ...")."""
    sig = fn.__nb_signature__[0][0]
    inner = sig[sig.index("(") + 1: sig.rindex(") ->")]
    parts, depth, cur = [], 0, ""
    for ch in inner:  # split at the commas outside brackets
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out = []
    for p in (p.strip() for p in parts if p.strip()):
        name, rest = p.split(":", 1)
        typ = rest.split(" = ")[0].strip()  # (a default follows " = "; "writable=False" has no spaces)
        if "ndarray" in typ:
            kind = "array_ro" if "writable=False" in typ else "array"
        else:
            kind = "int" if typ == "int" else "other"
        out.append((name.strip(), kind))
    return out


class Guarded:
    """An array between guard bytes (and, for an input, read-only), with a check that nothing
    outside it was written, nor anything inside it if it is an input."""

    def __init__(self, content: np.ndarray, read_only: bool):
        nbytes = content.nbytes
        self.base = np.full(2 * GUARD + nbytes, 0xA5, np.uint8)
        self.array = self.base[GUARD:GUARD + nbytes].view(content.dtype).reshape(content.shape)
        self.array[...] = content
        self.before = self.base.copy() if read_only else None
        if read_only:
            self.array.flags.writeable = False

    def damaged(self) -> str | None:
        n = self.base.size - GUARD
        if (self.base[:GUARD] != 0xA5).any() or (self.base[n:] != 0xA5).any():
            return "wrote past the array"
        if self.before is not None and not np.array_equal(self.base, self.before):
            return "modified an input"
        return None


def _build(template, kinds, emptied=()):
    """The call's arguments: arrays guarded (the ones named in ``emptied`` with a first
    dimension of 0), everything else as given."""
    args, guards = {}, {}
    for name, value in template.items():
        if isinstance(value, np.ndarray):
            if name in emptied:
                value = np.zeros((0,) + value.shape[1:], value.dtype)
            g = Guarded(value, kinds.get(name) == "array_ro")
            args[name], guards[name] = g.array, g
        else:
            args[name] = value
    return args, guards


RESULTS = {"ok": 0, "ValueError": 0, "OverflowError": 0, "TypeError": 0}
FAILURES: list[str] = []


def _call_linear(case, lin):
    """A bound weight (make_linear's result), called as a layer calls it: x [N, K] for N = 4 and
    0, out [N, M] (sizes capped at 64: a weight accepted with a huge M or K has no elements, and
    the call must then refuse the mismatch or do nothing)."""
    M, K = min(int(lin.M), 64), min(int(lin.K), 64)
    for n in (4, 0):
        xg = Guarded(np.ones((n, K), np.float32), True)
        og = Guarded(np.zeros((n, M), np.float32), False)
        try:
            lin(xg.array, og.array)
        except ValueError:
            pass
        except BaseException as e:  # noqa: BLE001 - see run_case
            FAILURES.append(f"{case} -> Linear(x [{n}, {K}]): {type(e).__name__}: {e}")
        for g in (xg, og):
            if g.damaged():
                FAILURES.append(f"{case} -> Linear(x [{n}, {K}]): {g.damaged()}")


def run_case(fname, template, kinds, ints, emptied):
    """Calls fname with the template's integers replaced by ``ints`` and the arrays in
    ``emptied`` emptied; records the outcome, or a failure."""
    fn = getattr(MOD, fname)
    call = dict(template, **ints)
    args, guards = _build(call, kinds, emptied)
    case = f"{FMT}._native.{fname}({', '.join(f'{k}={v}' for k, v in ints.items())}; emptied={sorted(emptied)})"
    print(case, file=sys.stderr, flush=True)  # the last line names the case if the call crashes
    outside_int64 = any(not (INT64[0] <= v <= INT64[1]) for v in ints.values())
    try:
        result = fn(**args)
        if fname in ("make_linear", "make_tiled_linear"):
            _call_linear(case, result)
        outcome = "ok"
        if outside_int64:
            FAILURES.append(f"{case}: accepted an integer outside int64")
    except (ValueError, OverflowError) as e:
        outcome = type(e).__name__
        if outside_int64:
            FAILURES.append(f"{case}: {outcome} ({e}) where nanobind's TypeError was expected")
        bad = [k for k, v in ints.items() if v < 0 or isinstance(e, OverflowError)]
        if len(ints) == 1 and bad and bad[0] not in str(e) and not emptied:
            FAILURES.append(f"{case}: {outcome} does not name {bad[0]}: {e}")
    except TypeError as e:
        outcome = "TypeError"
        if not outside_int64:
            FAILURES.append(f"{case}: TypeError for int64 arguments: {e}")
    except RuntimeError as e:
        outcome = "RuntimeError"
        if fname not in CUDA_CONTEXT:
            FAILURES.append(f"{case}: RuntimeError: {e}")
    except BaseException as e:  # noqa: BLE001 - any other exception is the failure being looked for
        outcome = type(e).__name__
        FAILURES.append(f"{case}: {outcome}: {e}")
    RESULTS[outcome] = RESULTS.get(outcome, 0) + 1
    for name, g in guards.items():
        if g.damaged():
            FAILURES.append(f"{case}: {name}: {g.damaged()}")
    return outcome


TEMPLATES = _templates()


def main():
    found = {n for n in dir(MOD) if not n.startswith("_") and callable(getattr(MOD, n))}
    classes = {n for n in found if isinstance(getattr(MOD, n), type)}
    missing = found - classes - NO_ARGS - set(TEMPLATES)
    if missing or set(TEMPLATES) - found:
        FAILURES.append(f"templates out of date: untested {sorted(missing)}, "
                        f"gone {sorted(set(TEMPLATES) - found)}")
    kinds_of = {f: dict(_params(getattr(MOD, f))) for f in TEMPLATES if f in found}
    if not any("array_ro" in k.values() for k in kinds_of.values()):
        FAILURES.append("no function of the module takes a read-only input (nb::ro): the signatures "
                        "did not parse, or the inputs are writable arrays again")
    sizes_of = {}
    for f, kinds in kinds_of.items():
        t = TEMPLATES[f]
        declared = {k for k, v in kinds.items() if v == "int"} - NOT_SIZES
        given_ints = {k for k, v in t.items() if isinstance(v, int) and not isinstance(v, bool)}
        if declared != given_ints:
            FAILURES.append(f"{f}: template integers {sorted(given_ints)} != the function's {sorted(declared)}")
        sizes_of[f] = sorted(declared & given_ints)
        # the template itself is a valid call (else the hostile calls would fail for other reasons)
        outcome = run_case(f, t, kinds, {}, ())
        if outcome != ("ValueError" if f in REFUSED_HERE else "ok"):
            FAILURES.append(f"{f}: the template call gave {outcome}")

    # every integer, one at a time, x every HOSTILE value, x the template's arrays, one of them
    # emptied, all but one emptied (a product that wraps to 0 then matches every array but the
    # one its other factor is counted from: int8's dequantize(q [0], scale [4], out [0], 2**62)),
    # or all emptied
    for f, kinds in kinds_of.items():
        arrays = [k for k, v in TEMPLATES[f].items() if isinstance(v, np.ndarray)]
        variants = {()} | {(a,) for a in arrays} | {tuple(b for b in arrays if b != a) for a in arrays}
        for emptied in sorted(variants | {tuple(arrays)}, key=lambda v: (len(v), v)):
            for p in sizes_of[f]:
                for v in HOSTILE:
                    run_case(f, TEMPLATES[f], kinds, {p: v}, emptied)
            if not sizes_of[f] and emptied:
                run_case(f, TEMPLATES[f], kinds, {}, emptied)

    names = sorted(kinds_of)

    @settings(max_examples=150, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def explore(data):
        f = data.draw(st.sampled_from(names))
        t = TEMPLATES[f]
        ints = {p: data.draw(st.sampled_from(POOL) | st.integers(*INT64), label=p)
                for p in data.draw(st.sets(st.sampled_from(sizes_of[f])), label="replaced")} if sizes_of[f] else {}
        arrays = [k for k, v in t.items() if isinstance(v, np.ndarray)]
        emptied = data.draw(st.sets(st.sampled_from(arrays)), label="emptied") if arrays else set()
        run_case(f, t, kinds_of[f], ints, tuple(sorted(emptied)))

    explore()
    print(json.dumps({"results": RESULTS, "failures": FAILURES[:50], "n_failures": len(FAILURES)}))


main()
