"""Every Python example in the documentation and the README runs as written (so none can rot).

Each Markdown page (README.md, docs/**/*.md) is one test: its ```python blocks (and MyST
``{code-block} python`` / ``{code} python`` blocks) run in order, in one namespace, in a fresh
temporary folder, on the CPU. A page is a tutorial: later blocks may use earlier names. Examples
must not need a GPU or the network; none may be skipped.
"""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(p for p in (ROOT / "docs").rglob("*.md")
                                      if not ({"_build", "_generated"} & set(p.relative_to(ROOT / "docs").parts)))])

# ```python ... ``` and ```{code-block} python ... ``` (options lines ":key: value" allowed).
FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})[ \t]*(?:python|py|\{code-block\}[ \t]+python|\{code\}[ \t]+python)"
                   r"[ \t]*\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of every Python block, options lines of a directive removed."""
    out = []
    for m in FENCE.finditer(text):
        body = m.group("body")
        lines = body.splitlines(keepends=True)
        while lines and re.match(r"^:[\w-]+:", lines[0]):
            lines.pop(0)
        out.append((text.count("\n", 0, m.start()) + 2, "".join(lines)))
    return out


def test_pages_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/getting-started.md"} <= names
    assert python_blocks((ROOT / "docs" / "getting-started.md").read_text())


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_page_examples_run(page, tmp_path, monkeypatch):
    blocks = python_blocks(page.read_text())
    if not blocks:
        return
    monkeypatch.chdir(tmp_path)  # examples write files (w.safetensors, net-q/, ...)
    # A real, importable module: torch.compile looks up the module of classes defined here.
    name = "docs_example_" + re.sub(r"\W", "_", page.relative_to(ROOT).as_posix())
    mod = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, mod)
    for line, code in blocks:
        # Pad with newlines so that a traceback names the page's own line numbers.
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), mod.__dict__)
