"""Test configuration: Hypothesis profiles and the path to ../shared (models, data)."""
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# CI runs derandomized (the same examples every run: a red CI is reproducible); local runs
# explore new examples each time. Per-test max_examples still apply.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

#: ../shared beside the repository: real models and text. Tests that need it skip without it.
SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent")
    return SHARED


def cuda_device_available() -> bool:
    try:
        import qformats

        return qformats.cuda_available()
    except Exception:  # a broken build must fail the CPU tests, not hide here
        return False


#: Marks a test that needs a CUDA device and a CUDA build; such tests skip elsewhere.
requires_cuda = pytest.mark.skipif(not cuda_device_available(), reason="no CUDA device / CUDA build")
