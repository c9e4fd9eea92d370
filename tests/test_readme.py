"""The README's Python example runs as written (so it cannot rot)."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    monkeypatch.chdir(tmp_path)  # the example writes w.safetensors
    for code in blocks:
        exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    assert (tmp_path / "w.safetensors").exists()
