"""Sphinx extension: the benchmark and quality pages' tables and plots, generated at build time
from the result files (never drawn or typed by hand).

Reads ``benchmarks/results/gemm_h200.json`` and ``gemm_h200_resident.json`` (written by
``benchmarks/gemm.py --json``, the second with ``--resident``) and
``benchmarks/results/quality.json`` (written by ``benchmarks/quality.py``) and writes, under
``docs/_generated/``, Markdown fragments that the pages include (``{include}``) and the PNG
plots they show:

* ``gemm.md`` + ``gemm_h200.png``: GEMM time vs N per kernel against the peers (cuBLAS fp16,
  torch._int_mm, bitsandbytes), one column of panels per weight shape, with each weight's
  memory-bandwidth floor (stored weight bytes / the device-to-device copy bandwidth of the
  same run) drawn as a dotted line; then the rows as tables.
* ``gemm_resident.md`` + ``gemm_h200_resident.png``: the same in the resident mode (one weight
  kept in L2, calls replayed in a CUDA graph: llama.cpp's ``test-backend-ops perf``), no floors.
* ``quality.md`` + ``quality_pareto.png``: perplexity vs stored bits per weight, one marker per
  method, and the Pareto front (the points no other point beats in both bits and perplexity);
  then the table, and the MiniLM cosine table.

A missing result file gives a fragment that says so (the build still passes); CI builds with
the committed files. Also usable without Sphinx: ``python docs/_ext/qf_results.py OUTDIR``.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
ROOT = DOCS.parent

# -- GEMM ---------------------------------------------------------------------------------------

#: (panel row title, kernels drawn in it). Peers are drawn in grey/black.
GEMM_PANELS = (
    ("weight-only (fp16 activations)",
     ("fp16 cuBLAS", "bnb-nf4", "tinygemm-int4", "gemlite-a16w4", "nf4", "int4", "q4_0", "mixed2bit",
      "nf4+cuBLAS", "int4+cuBLAS", "q4_0+cuBLAS", "mixed2bit+cuBLAS")),
    ("integer kernels (quantized activations)",
     ("fp16 cuBLAS", "torch._int_mm", "bnb-int8", "q4_0xq8_1", "int8 fused", "int4xint4")),
)
PEERS = ("fp16 cuBLAS", "torch._int_mm", "bnb-nf4", "bnb-int8", "tinygemm-int4", "gemlite-a16w4")
COLORS = {
    "fp16 cuBLAS": "black", "torch._int_mm": "dimgray", "bnb-nf4": "darkgray", "bnb-int8": "darkgray",
    "tinygemm-int4": "tab:olive", "gemlite-a16w4": "tab:cyan",
    "nf4": "tab:blue", "int4": "tab:orange", "q4_0": "tab:green", "mixed2bit": "tab:red",
    "q4_0xq8_1": "tab:green", "int8 fused": "tab:purple", "int4xint4": "tab:orange",
}


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _style(kernel: str) -> dict:
    base = kernel.removesuffix("+cuBLAS")
    st = {"color": COLORS.get(base, "tab:brown"), "marker": "o", "markersize": 3.5, "linewidth": 1.4}
    if kernel.endswith("+cuBLAS"):
        st.update(linestyle="--", marker="s")
    if kernel in PEERS:
        st.update(linewidth=2.0, marker="^" if kernel != "fp16 cuBLAS" else "D")
        if kernel.startswith("bnb"):
            st["linestyle"] = "-."
    return st


def gemm_plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    resident = data.get("meta", {}).get("mode") == "resident"  # weight in L2: no DRAM floor
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(len(GEMM_PANELS), len(shapes), figsize=(5.2 * len(shapes), 4.6 * len(GEMM_PANELS)),
                             squeeze=False, sharex=True)
    for j, shape in enumerate(shapes):
        srows = [r for r in rows if r["shape"] == shape]
        copy_gbs = srows[0]["copy_gbs"]
        for i, (title, kernels) in enumerate(GEMM_PANELS):
            ax = axes[i][j]
            floors = {}
            for k in kernels:
                kr = sorted((r for r in srows if r["kernel"] == k), key=lambda r: r["N"])
                if not kr:
                    continue
                st = _style(k)
                ax.plot([r["N"] for r in kr], [r["time_us"] for r in kr], label=k, **st)
                base = k.removesuffix("+cuBLAS")
                floors.setdefault(base, (kr[0]["weight_bytes"], st["color"]))
            labels: list = []  # [floor us, names, bits]: weights of nearly equal size share a label
            mk = srows[0]["M"] * srows[0]["K"]
            for base, (wbytes, color) in sorted(floors.items(), key=lambda kv: kv[1][0]) if not resident else ():
                floor_us = wbytes / (copy_gbs * 1e3)  # bytes / (GB/s) -> us
                ax.axhline(floor_us, color=color, linestyle=":", linewidth=1.0, alpha=0.9)
                if labels and floor_us < 1.25 * labels[-1][0]:
                    labels[-1][1].append(base)
                    labels[-1][2].append(8 * wbytes / mk)
                else:
                    labels.append([floor_us, [base], [8 * wbytes / mk]])
            for floor_us, names, bits in labels:
                b = f"{min(bits):.2f}" if max(bits) - min(bits) < 0.01 else f"{min(bits):.2f}-{max(bits):.2f}"
                ax.annotate(f"floor, {b} bits/w: " + ", ".join(names), (0.99, floor_us),
                            xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=6.5,
                            color="dimgray")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.25)
            ax.set_title(f"W {shape} (M x K): {title}", fontsize=9.5)
            if j == 0:
                ax.set_ylabel("time per call, us (log)")
            if i == len(GEMM_PANELS) - 1:
                ax.set_xlabel("N (rows of X)")
            ns = sorted({r["N"] for r in srows})
            ax.set_xticks(ns)
            ax.set_xticklabels([str(n) for n in ns])
            if j == len(shapes) - 1:
                ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    meta = data.get("meta", {})
    if resident:
        fig.suptitle(f"Y = X . W^T on {meta.get('gpu', '?')} ({meta.get('date', '?')}), resident mode: one weight, "
                     f"{meta.get('calls', '?')} calls in a CUDA graph (llama.cpp's perf mode)", fontsize=10.5)
    else:
        fig.suptitle(f"Y = X . W^T on {meta.get('gpu', '?')} ({meta.get('date', '?')}); dotted: each weight's "
                     f"memory-bandwidth floor = stored weight bytes / copy bandwidth", fontsize=10.5)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _fmt_meta_gemm(meta: dict, fname: str) -> str:
    versions = ", ".join(f"{k} {meta[k]}" for k in ("driver", "torch", "cuda", "bitsandbytes", "qformats")
                         if meta.get(k))
    copy = "; ".join(f"{s}: {c['copy_gbs']:.0f} GB/s" for s, c in meta.get("copy", {}).items())
    return (f"- **measured**: {meta.get('date', '?')} on one {meta.get('gpu', '?')} ({versions}), "
            f"median of {meta.get('iters', '?')} calls per row\n"
            f"- **command**: `{meta.get('command', '?')}`\n"
            f"- **device-to-device copy bandwidth** (the floor's denominator): {copy}\n"
            f"- **file**: `benchmarks/results/{fname}`; source: {meta.get('source', '?')}\n")


def gemm_markdown(data: dict | None, png_name: str, fname: str = "gemm_h200.json") -> str:
    if data is None:
        return (f"```{{note}}\nThe GEMM result file `benchmarks/results/{fname}` is absent, so "
                "there is no plot or table here. It is written on a GPU machine by "
                f"`python benchmarks/gemm.py --json benchmarks/results/{fname}`.\n```\n")
    resident = data.get("meta", {}).get("mode") == "resident"
    out = [_fmt_meta_gemm(data.get("meta", {}), fname), "",
           f"```{{image}} /_generated/{png_name}\n:alt: GEMM time vs N per kernel and shape, with the "
           f"memory-bandwidth floors\n:width: 100%\n```", ""]
    rows = data["rows"]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        out += [f"### W {shape}", "",
                "| N | kernel | time us | floor us | TFLOP/s | weight GB/s | % copy | x fp16 |",
                "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in rows if r["shape"] == shape):
            floor = "-" if resident else f"{r['weight_bytes'] / (r['copy_gbs'] * 1e3):.1f}"
            out.append(f"| {r['N']} | {r['kernel']} | {r['time_us']:.1f} | {floor} | {r['tflops']:.1f} | "
                       f"{r['weight_gbs']:.0f} | {r['pct_copy']:.1f}% | {r['x_fp16']:.2f}x |")
        out.append("")
    return "\n".join(out) + "\n"


# -- quality ------------------------------------------------------------------------------------

METHOD_STYLE = {
    "rtn": {"marker": "o", "color": "tab:blue", "label": "round to nearest (rtn)"},
    "rtn+calibration": {"marker": "s", "color": "tab:purple",
                        "label": "round to nearest, 4-bit groups chosen on calibration data"},
    "signround": {"marker": "^", "color": "tab:green", "label": "trainable rounding (signround)"},
    "budget": {"marker": "*", "color": "tab:red", "label": "budgeted per-layer formats", "s": 140},
}


def pareto(rows: list[dict]) -> list[dict]:
    """The rows that no other row beats in both stored bits and perplexity, by bits."""
    front, best = [], math.inf
    for r in sorted(rows, key=lambda r: (r["bits"], r["ppl"])):
        if r["ppl"] < best:
            front.append(r)
            best = r["ppl"]
    return front


#: The parameters a plot label shows (short names); the tables show the whole params string.
LABEL_PARAMS = {"group_size": "g", "blocksize": "bs", "ratio_4bit": "r", "granularity": "",
                "symmetric": "sym="}


def _label(r: dict) -> str:
    if r["method"] == "budget":
        return "budget"
    parts = []
    for item in str(r.get("params") or "").split(", "):
        k, _, v = item.partition("=")
        if k in LABEL_PARAMS and not (k == "symmetric" and v == "False"):
            parts.append(f"{LABEL_PARAMS[k]}{v}")
    return " ".join([r["format"], *parts])


def _cell(v) -> str:
    """A value for a Markdown table cell."""
    return str(v).replace("|", "\\|").replace("\n", " ")


#: Points below this relative perplexity increase are drawn again in a zoomed panel.
ZOOM_DELTA = 0.025


def quality_plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if r.get("bits") is not None and r.get("ppl") is not None]
    meta = data.get("meta", {})
    ref = meta.get("fp32_ppl")
    near = [r for r in rows if ref is not None and r["ppl"] <= ref * (1 + ZOOM_DELTA)]
    panels = [rows] + ([near] if near else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(7.2 * len(panels), 5.6), squeeze=False,
                             gridspec_kw={"width_ratios": [1.3, 1][:len(panels)]})
    front = pareto(rows)
    for i, (ax, shown) in enumerate(zip(axes[0], panels)):
        zoom = i == 1
        for method in dict.fromkeys(r["method"] for r in rows):
            st = dict(METHOD_STYLE.get(method, {"marker": "s", "color": "tab:gray", "label": method}))
            mr = [r for r in shown if r["method"] == method]
            if not mr:
                continue
            ax.scatter([r["bits"] for r in mr], [r["ppl"] for r in mr], marker=st["marker"], color=st["color"],
                       s=st.get("s", 50), label=st["label"], zorder=3)
            for r in mr:
                if zoom or not near or r not in near:  # the zoomed panel labels the crowded points
                    ax.annotate(_label(r), (r["bits"], r["ppl"]), textcoords="offset points", xytext=(5, 4),
                                fontsize=7.5, color=st["color"])
        if front:
            xs, ys = [front[0]["bits"]], [front[0]["ppl"]]
            for r in front[1:]:
                xs += [r["bits"], r["bits"]]
                ys += [ys[-1], r["ppl"]]
            ax.plot(xs, ys, color="black", linewidth=1.2, alpha=0.7, label="Pareto front", zorder=2)
        if ref is not None:
            ax.axhline(ref, color="gray", linestyle="--", linewidth=1, label=f"float model ({ref:.3f})")
        if zoom:
            lo = min(r["bits"] for r in near)
            hi = max(r["bits"] for r in near)
            ax.set_xlim(lo - 0.3, hi + 0.9)
            ax.set_ylim(ref - 0.1 * (max(r["ppl"] for r in near) - ref) - 0.02,
                        max(r["ppl"] for r in near) + 0.15 * (max(r["ppl"] for r in near) - ref) + 0.02)
            ax.set_title(f"zoom: within {100 * ZOOM_DELTA:.1f}% of the float model", fontsize=10)
        else:
            ax.set_title(f"{Path(str(meta.get('model', '?'))).name}: perplexity vs stored bits "
                         f"({meta.get('date', '?')})", fontsize=10.5)
            ax.legend(fontsize=8, loc="upper right")
            ax.set_ylabel("perplexity (lower is better)")
        ax.set_xlabel("stored bits per weight of the quantized Linear weights")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def quality_markdown(data: dict | None, png_name: str) -> str:
    if data is None:
        return ("```{note}\nThe quality result file `benchmarks/results/quality.json` is absent, so "
                "there is no plot or table here. `python benchmarks/quality.py` writes it.\n```\n")
    meta = data.get("meta", {})
    rows = [r for r in data["rows"]]
    front = {id(r) for r in pareto([r for r in rows if r.get("bits") is not None and r.get("ppl") is not None])}
    windows = meta.get("windows", "?")
    if isinstance(windows, int):
        windows = f"{windows} evenly spaced non-overlapping 512-token windows"
    # Rows transcribed from earlier tables carry their own "source"; the file's note about them
    # is shown only while such rows are in it.
    transcribed = [r for r in rows if r.get("source")] + [r for r in data.get("minilm") or [] if r.get("source")]
    out = [f"- **model**: `{meta.get('model', '?')}`; **text**: `{meta.get('text', '?')}`, "
           f"{windows}; float model perplexity {meta.get('fp32_ppl', '?')}",
           f"- **measured**: {meta.get('date', '?')} on {meta.get('machine', '?')}",
           f"- **command**: `{meta.get('command', '?')}`",
           "- **file**: `benchmarks/results/quality.json`"
           + (f"; rows marked *transcribed*: {meta['source']}" if transcribed and meta.get("source") else ""),
           "",
           f"```{{image}} /_generated/{png_name}\n:alt: perplexity vs stored bits per method, with "
           f"the Pareto front\n:width: 100%\n```", "",
           "| method | format | params | bits/w | ppl | Δppl | Pareto |",
           "|---|---|---|---:|---:|---:|:---:|"]
    for r in sorted(rows, key=lambda r: (r.get("bits") is None, r.get("bits") or 0, r.get("ppl") or 0)):
        bits = "-" if r.get("bits") is None else f"{r['bits']:.3f}"
        dp = "-" if r.get("delta_pct") is None else f"{r['delta_pct']:+.2f}%"
        method = _cell(r["method"]) + (f" (*transcribed*: {_cell(r['source'])})" if r.get("source") else "")
        out.append(f"| {method} | {_cell(r['format'])} | {_cell(r.get('params') or '-')} | {bits} | "
                   f"{r['ppl']:.3f} | {dp} | {'yes' if id(r) in front else ''} |")
    out.append("")
    minilm = data.get("minilm") or []
    if minilm:
        out += [f"Encoder (MiniLM) embedding cosine similarity to the float model: "
                f"{meta.get('minilm_model', 'all-MiniLM-L6-v2')}.", "",
                "| format | params | bits/w | cosine |", "|---|---|---:|---:|"]
        for r in minilm:
            bits = "-" if r.get("bits") is None else f"{r['bits']:.3f}"
            src = f" (*transcribed*: {_cell(r['source'])})" if r.get("source") else ""
            out.append(f"| {_cell(r['format'])}{src} | {_cell(r.get('params') or '-')} | {bits} | {r['cosine']:.4g} |")
        out.append("")
    return "\n".join(out) + "\n"


# -- driver -------------------------------------------------------------------------------------

def generate(results_dir: Path, out_dir: Path) -> list[Path]:
    """Write the fragments and plots; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, md in (("gemm_h200", "gemm.md"), ("gemm_h200_resident", "gemm_resident.md")):
        gemm = _load(results_dir / f"{stem}.json")
        if gemm is not None:
            gemm_plot(gemm, out_dir / f"{stem}.png")
            written.append(out_dir / f"{stem}.png")
        (out_dir / md).write_text(gemm_markdown(gemm, f"{stem}.png", f"{stem}.json"))
        written.append(out_dir / md)
    quality = _load(results_dir / "quality.json")
    if quality is not None:
        quality_plot(quality, out_dir / "quality_pareto.png")
        written.append(out_dir / "quality_pareto.png")
    (out_dir / "quality.md").write_text(quality_markdown(quality, "quality_pareto.png"))
    return written + [out_dir / "quality.md"]


def _builder_inited(app) -> None:
    generate(Path(app.config.qf_results_dir), Path(app.srcdir) / "_generated")


def setup(app):
    app.add_config_value("qf_results_dir", str(ROOT / "benchmarks" / "results"), "env")
    app.connect("builder-inited", _builder_inited)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    for p in generate(ROOT / "benchmarks" / "results", Path(sys.argv[1]) if len(sys.argv) > 1 else DOCS / "_generated"):
        print(p)
