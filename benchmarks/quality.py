"""The quality table of the model-level methods on the pydoc Llama (and RTN on all-MiniLM-L6-v2).

    python benchmarks/quality.py                              # everything (about 75 minutes on 2 cores)
    python benchmarks/quality.py --only rtn,calibrated        # some parts, merged into the JSON
    python benchmarks/quality.py --only signround --points mixed2bit:gs=16:r=0.1 --iters 50

Parts (``--only``, comma-separated; default all):

* ``rtn``: round to nearest per format (:func:`qformats.compare.compare`, fake quant in fp32),
  plus the mixed2bit points of ``--points`` by range;
* ``calibrated``: ``rtn+calibration``: mixed2bit with ratio_4bit > 0 whose 4-bit groups are
  chosen by the activations' second moment (``quantize_model(method="rtn", calibration=...)``);
* ``signround``: trainable rounding (``quantize_model(method="signround")``) at each point of
  ``--points``; mixed2bit points with ratio_4bit > 0 choose their 4-bit groups by the
  calibrated sensitivity first;
* ``budget``: ``quantize_model(method="budget", max_perplexity_increase=--budget-pct)`` with
  ``--budget-candidates``; the budget is measured on ``--budget-windows`` 512-token windows
  of the evaluation text that are disjoint from the evaluation windows;
* ``minilm``: RTN per format on all-MiniLM-L6-v2, embedding cosine similarity to fp32
  (:func:`qformats.compare.compare` on its encoder path, pydoc_data.topics paragraphs).

Every perplexity is :func:`qformats.evaluate.perplexity` on the same ``--windows`` evenly
spaced 512-token windows of ``--text`` (the standard protocol: 96 windows of
``../shared/data/pydoc/valid.txt``). Calibration text (signround, calibrated RTN) is Python's
``pydoc_data.topics`` (the language-reference help text: the model's training domain, and
disjoint from valid.txt, which is the held-out tutorial/howto text; 0.07% of valid.txt's word
8-grams occur in it, quoted passages).

Writes ``--out`` (default ``benchmarks/results/quality.json``)::

    {"meta": {"date", "machine", "command", "model", "text", "windows", "fp32_ppl"},
     "rows": [{"method", "format", "params", "bits", "ppl", "delta_pct"}, ...],
     "minilm": [{"format", "params", "bits", "cosine"}, ...]}

merging into an existing file (a row replaces the one with the same method, format and
params), and prints the table as markdown.
"""
from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
PARTS = ("rtn", "calibrated", "signround", "budget", "minilm")
DEFAULT_POINTS = ("int4:gs=128,mixed2bit:gs=32:r=0,mixed2bit:gs=16:r=0.1,mixed2bit:gs=32:r=0.25,"
                  "mixed2bit:gs=16:r=0.12")
DEFAULT_BUDGET = "int4:gs=128,mixed2bit:gs=16:r=0.1:signround,mixed2bit:gs=32:r=0:signround"
#: A point's parameters where it does not give them: the format's defaults, except that a point
#: without ``r=`` has no 4-bit groups (plain 2-bit).
POINT_DEFAULTS = {"ratio_4bit": 0.0}


def format_spec(name: str):
    """``qformats.<name>.SPEC`` (SystemExit for an unknown or unbuilt format)."""
    from qformats._core import format_spec as spec_of

    try:
        return spec_of(name)
    except (ImportError, ValueError) as e:
        raise SystemExit(f"format {name!r}: {e}") from e


def parse_points(spec: str) -> list:
    """``"int4:gs=128,mixed2bit:gs=16:r=0.1[:signround]"`` -> ``[(format, params, method)]``:
    formats that trainable rounding applies to (``SPEC.trainable``); ``gs`` is the format's
    group parameter, ``r`` mixed2bit's ``ratio_4bit``; the rest from :data:`POINT_DEFAULTS`,
    then the format's defaults."""
    from qformats import FORMATS

    trainable = [f for f in FORMATS if format_spec(f).trainable(format_spec(f).defaults)]
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        fmt, *kv = item.split(":")
        if fmt not in trainable:
            raise SystemExit(f"bad point {item!r}: {' or '.join(trainable)}")
        fs = format_spec(fmt)
        params, method = {}, "rtn"
        for t in kv:
            if t in ("signround", "rtn"):
                method = t
                continue
            k, v = t.split("=")
            if k == "gs" and fs.group_param is not None:
                params[fs.group_param] = int(v)
            elif k == "r":
                params["ratio_4bit"] = float(v)
            else:
                raise SystemExit(f"bad point {item!r}: use gs=, r= and optionally :signround")
        for k, v in fs.defaults.items():
            params.setdefault(k, POINT_DEFAULTS.get(k, v))
        if not fs.trainable(params):
            raise SystemExit(f"bad point {item!r}: parameters that trainable rounding does not apply to")
        out.append((fmt, params, method))
    return out


def pstr(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "-"


class Ctx:
    """The model, the evaluation windows, the fp32 perplexity and the calibration text."""

    def __init__(self, args):
        import torch
        from qformats.evaluate import lm_windows, load_model, load_text, perplexity

        self.args = args
        self.lm = load_model(args.model)
        self.text = Path(args.text).read_text(encoding="utf-8")
        self.windows, self.winfo = lm_windows(self.lm.tokenizer, self.text, 512, args.windows * 512)
        self.calib_text, self.calib_desc = load_text(None)
        t0 = time.perf_counter()
        self.fp32 = perplexity(self.lm.model, self.windows, progress=False)["ppl"]
        log(f"fp32 perplexity {self.fp32:.3f} ({time.perf_counter() - t0:.0f} s)")
        self.torch = torch

    def ppl(self, model) -> float:
        from qformats.evaluate import perplexity

        return perplexity(model, self.windows, progress=False)["ppl"]

    def row(self, method, fmt, params, bits, ppl) -> dict:
        return {"method": method, "format": fmt, "params": params, "bits": round(float(bits), 4),
                "ppl": round(float(ppl), 4), "delta_pct": round(100.0 * (ppl / self.fp32 - 1.0), 3)}

    def disjoint_windows(self, k: int):
        """k 512-token windows of the evaluation text, evenly spaced among those that are not
        evaluation windows (int64 [k, 512])."""
        import torch

        ids = self.lm.tokenizer(self.text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        n = ids.numel() // 512
        used = {int((j + 0.5) * n / self.args.windows) for j in range(self.args.windows)}
        rest = [i for i in range(n) if i not in used]
        pick = [rest[int((j + 0.5) * len(rest) / k)] for j in range(k)]
        return torch.stack([ids[i * 512:(i + 1) * 512] for i in pick]).to(torch.int64)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- parts --------------------------------------------------------------------------------------

def part_rtn(ctx, points, emit):
    from qformats.compare import compare

    from qformats import FORMATS

    fmts = list(FORMATS)  # each at its defaults
    for fmt, p, _ in points:  # points of formats that choose their 4-bit groups: here by range
        fs = format_spec(fmt)
        if fs.calibrated(fs.defaults) and p != dict(fs.defaults):
            keys = list(fs.defaults) + [k for k in p if k not in fs.defaults]
            fmts.append(fmt + "".join(f":{k}={p[k]}" for k in keys))
    t0 = time.perf_counter()
    res = compare(ctx.args.model, fmts, ctx.args.text, max_tokens=ctx.args.windows * 512,
                  threads=ctx.args.threads, progress=False)
    base = res.rows[0].value
    if abs(base / ctx.fp32 - 1) > 1e-9:
        raise RuntimeError(f"compare's fp32 perplexity {base} != {ctx.fp32}: different windows?")
    for r in res.rows[1:]:
        if r.status == "ok":
            emit(ctx.row("rtn", r.format, r.params_str, r.bits_per_weight, r.value))
        else:
            log(f"rtn {r.format} {r.status}: {r.reason}")
    log(f"rtn: {time.perf_counter() - t0:.0f} s")


def part_calibrated(ctx, points, emit):
    import qformats

    a = ctx.args
    for fmt, p, _ in points:
        if not format_spec(fmt).calibrated(p):
            continue
        t0 = time.perf_counter()
        model = copy.deepcopy(ctx.lm.model)
        rep = qformats.quantize_model(model, format=fmt, **p, calibration=ctx.calib_text,
                                      tokenizer=ctx.lm.tokenizer, nsamples=a.nsamples, seqlen=a.seqlen)
        ppl = ctx.ppl(model)
        params = pstr(p) + f", calibration=pydoc_data.topics {a.nsamples}x{a.seqlen}"
        emit(ctx.row("rtn+calibration", fmt, params, rep.avg_bits, ppl))
        log(f"rtn+calibration {pstr(p)}: {time.perf_counter() - t0:.0f} s")


def part_signround(ctx, points, emit):
    import qformats

    a = ctx.args
    for fmt, p, _ in points:
        t0 = time.perf_counter()
        model = copy.deepcopy(ctx.lm.model)
        rep = qformats.quantize_model(model, format=fmt, **p, method="signround", calibration=ctx.calib_text,
                                      tokenizer=ctx.lm.tokenizer, iters=a.iters, nsamples=a.nsamples,
                                      seqlen=a.seqlen, batch_size=8, selection=a.selection)
        t_train = time.perf_counter() - t0
        ppl = ctx.ppl(model)
        params = (pstr(p) + (f", selection={a.selection}" if format_spec(fmt).calibrated(p) else "")
                  + f", iters={a.iters}, calibration=pydoc_data.topics {a.nsamples}x{a.seqlen}")
        emit(ctx.row("signround", fmt, params, rep.avg_bits, ppl))
        log(f"signround {pstr(p)}: train {t_train:.0f} s, total {time.perf_counter() - t0:.0f} s")


def part_budget(ctx, points, emit):
    import qformats

    a = ctx.args
    cands = [(f, dict(p), m) for f, p, m in parse_points(a.budget_candidates)]
    cal = ctx.disjoint_windows(a.budget_windows)
    t0 = time.perf_counter()
    model = copy.deepcopy(ctx.lm.model)
    rep = qformats.quantize_model(model, method="budget", calibration=cal, max_perplexity_increase=a.budget_pct,
                                  candidates=cands, nsamples=a.budget_windows, seqlen=512,
                                  signround={"calibration": ctx.calib_text, "tokenizer": ctx.lm.tokenizer,
                                             "iters": a.iters, "nsamples": a.nsamples, "seqlen": a.seqlen})
    b = rep.budget
    ppl = ctx.ppl(model)
    counts: dict = {}
    for c in b["choices"].values():
        key = f"{c['format']}:{c['method']}" + (f":g{c['params']['group_size']}" if "group_size" in c["params"] else "")
        if "ratio_4bit" in c["params"]:
            key += f":r{c['params']['ratio_4bit']}"
        counts[key] = counts.get(key, 0) + 1
    params = (f"max_perplexity_increase={a.budget_pct}; candidates={a.budget_candidates}; budget windows "
              f"{a.budget_windows}x512 of the text disjoint from the evaluation windows: "
              f"{b['ppl_increase_percent']:+.2f}% ({'holds' if b['holds'] else 'NOT met'}); chosen "
              + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    emit(ctx.row("budget", "+".join(sorted(rep.formats)), params, rep.avg_bits, ppl))
    log(f"budget: {time.perf_counter() - t0:.0f} s; on its windows {b['ppl_increase_percent']:+.2f}%, "
        f"{b['avg_bits']:.3f} bits; moves undone {b['moves_undone']}")


def part_minilm(args) -> list:
    from qformats.compare import compare

    res = compare(None, None, None, threads=args.threads, progress=False)
    out = []
    for r in res.rows[1:]:
        if r.status == "ok":
            out.append({"format": r.format, "params": r.params_str, "bits": round(r.bits_per_weight, 4),
                        "cosine": round(r.value, 6)})
    return out


# -- output -------------------------------------------------------------------------------------

def load_json(path: Path) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    return {"meta": {}, "rows": [], "minilm": []}


def save_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def markdown(data: dict) -> str:
    m = data["meta"]
    lines = [f"model {m.get('model')}; text {m.get('text')}: {m.get('windows')}; "
             f"fp32 perplexity {m.get('fp32_ppl')}", "",
             "| method | format | params | bits/w | ppl | Δ% |", "|---|---|---|---:|---:|---:|"]
    order = {"rtn": 0, "rtn+calibration": 1, "signround": 2, "budget": 3}
    rows = sorted(data["rows"], key=lambda r: (order.get(r["method"], 9), r["format"], -r["bits"]))
    for r in rows:
        lines.append(f"| {r['method']} | {r['format']} | {r['params']} | {r['bits']:.3f} | {r['ppl']:.3f} | "
                     f"{r['delta_pct']:+.2f}% |")
    if data.get("minilm"):
        lines += ["", "all-MiniLM-L6-v2, RTN, mean cosine similarity of the embeddings to fp32:", "",
                  "| format | params | bits/w | cosine |", "|---|---|---:|---:|"]
        for r in data["minilm"]:
            lines.append(f"| {r['format']} | {r['params']} | {r['bits']:.3f} | {r['cosine']:.5f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    ap.add_argument("--model", default=str(SHARED / "models" / "pydoc-llama-17m"))
    ap.add_argument("--text", default=str(SHARED / "data" / "pydoc" / "valid.txt"))
    ap.add_argument("--windows", type=int, default=96, help="evaluation windows of 512 tokens")
    ap.add_argument("--points", default=DEFAULT_POINTS, help="signround / calibrated / extra RTN points")
    ap.add_argument("--iters", type=int, default=100, help="signround steps per block")
    ap.add_argument("--nsamples", type=int, default=32, help="calibration windows (signround, calibrated)")
    ap.add_argument("--seqlen", type=int, default=512, help="tokens per calibration window")
    ap.add_argument("--selection", default="sensitivity", choices=("sensitivity", "range"),
                    help="signround: how mixed2bit's 4-bit groups are chosen")
    ap.add_argument("--budget-pct", type=float, default=5.0)
    ap.add_argument("--budget-windows", type=int, default=8)
    ap.add_argument("--budget-candidates", default=DEFAULT_BUDGET)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quality.json"))
    ap.add_argument("--no-merge", action="store_true", help="start a new JSON instead of merging")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; known: {PARTS}")

    import torch

    torch.set_num_threads(args.threads)
    from qformats import _runtime

    _runtime.set_num_threads(args.threads)
    out = Path(args.out)
    data = {"meta": {}, "rows": [], "minilm": []} if args.no_merge else load_json(out)
    points = parse_points(args.points)
    command = "python benchmarks/quality.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

    ctx = None

    def meta_update(fp32=None):
        m = data["meta"]
        cmds = [c for c in (m.get("command") or "").split(" ; ") if c]
        if command not in cmds:
            cmds.append(command)
        m.update({"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "machine": f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores "
                             f"({platform.processor() or platform.machine()}), "
                             f"{args.threads} threads, torch {torch.__version__}",
                  "command": " ; ".join(cmds)})
        if fp32 is not None:
            if m.get("fp32_ppl") is not None and abs(m["fp32_ppl"] - fp32) > 1e-3:
                raise SystemExit(f"fp32 perplexity {fp32} differs from the file's {m['fp32_ppl']}: "
                                 "different model / text / windows; use --no-merge")
            m.update({"model": os.path.relpath(args.model, ROOT), "text": os.path.relpath(args.text, ROOT),
                      "windows": f"{ctx.winfo['windows']} of {ctx.winfo['windows_total']} non-overlapping "
                                 f"512-token windows, evenly spaced",
                      "fp32_ppl": round(fp32, 4)})

    def emit(row):
        # re-read the file first, so that rows another run wrote meanwhile are kept
        if out.is_file():
            data["rows"] = load_json(out).get("rows", data["rows"])
        key = (row["method"], row["format"], row["params"])
        data["rows"] = [r for r in data["rows"] if (r["method"], r["format"], r["params"]) != key] + [row]
        save_json(out, data)
        log(f"{row['method']:16s} {row['format']:10s} {row['bits']:.3f} bits  ppl {row['ppl']:.3f} "
            f"({row['delta_pct']:+.2f}%)  {row['params']}")

    lm_parts = [p for p in parts if p != "minilm"]
    if lm_parts:
        ctx = Ctx(args)
        meta_update(ctx.fp32)
        save_json(out, data)
        for p in lm_parts:
            globals()[f"part_{p}"](ctx, points, emit)
    if "minilm" in parts:
        t0 = time.perf_counter()
        data["minilm"] = part_minilm(args)
        meta_update()
        save_json(out, data)
        log(f"minilm: {time.perf_counter() - t0:.0f} s")
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
