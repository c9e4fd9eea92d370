"""The CPU models behind the GPU kernels' exact fast paths still agree with the format rules.

tests/int4/fast_path_check.cpp and tests/nf4/code_cells_check.cpp re-derive the CUDA
quantizers' shortcuts (int4's reciprocal with a tie guard, nf4's code table) from the shared
headers and compare them with the rules; here they are compiled and run on a sample (the nf4
check takes every 64th of the 2^32 float patterns; run it with no argument for all of them).
"""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("source, arg", [("tests/int4/fast_path_check.cpp", "20000"),
                                         ("tests/nf4/code_cells_check.cpp", "64")])
def test_fast_path_model_agrees_with_rule(tmp_path, source, arg):
    exe = tmp_path / "check"
    subprocess.run([CXX, "-std=c++17", "-O2", "-ffp-contract=off", f"-I{ROOT / 'src'}",
                    str(ROOT / source), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe), arg], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:]
