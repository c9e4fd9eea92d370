"""Each format's self-check (``qformats.<fmt>._selfcheck``, run on the installed wheel by
tools/wheel_check.py) passes on this build, and a format without one fails."""
import sys
import types

import pytest

from qformats import FORMATS
from qformats._selfcheck import Checks, run_format


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_selfcheck_passes(fmt, capsys):
    check = Checks()
    run_format(fmt, check)
    out = capsys.readouterr().out
    assert not check.failures, out
    assert out.count("  ok    ") >= 1, out   # it ran checks


def test_format_without_selfcheck_fails(tmp_path, monkeypatch, capsys):
    pkg = types.ModuleType("qformats.newfmt")   # a format package (an empty folder) without one
    pkg.__path__ = [str(tmp_path)]
    monkeypatch.setitem(sys.modules, "qformats.newfmt", pkg)
    check = Checks()
    run_format("newfmt", check)
    assert check.failures == ["newfmt: no self-check"]
    assert "add python/qformats/newfmt/_selfcheck.py" in capsys.readouterr().out


def test_failed_check_is_recorded_and_the_rest_run(capsys):
    check = Checks()
    ran = []

    @check("fails")
    def _():
        raise AssertionError("bytes differ")

    @check("passes")
    def _():
        ran.append(1)

    assert check.failures == ["fails"] and ran == [1]
    out = capsys.readouterr().out
    assert "FAIL  fails" in out and "bytes differ" in out and "ok    passes" in out
