"""The CPU thread pool and its one process-wide setting (issue 17): set_num_threads, the
QFORMATS_NUM_THREADS variable and the CLI change the threads of every format; the OS threads
follow the setting; a thread the OS refuses to create is done without (no abort, no hang);
results never depend on the count. Each case runs in a capped child (reliability_helpers)."""
from __future__ import annotations

import sys

import pytest
from reliability.reliability_helpers import run_capped

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")

# Runs in the child: one call of every format's codec, and a GEMM of each that has one, on
# inputs big enough to be split (so a format with its own thread setting would start threads).
WORK = """
import os, threading, time
import numpy as np
import qformats
from qformats import _runtime

def os_threads():
    return len(os.listdir("/proc/self/task"))

rng = np.random.default_rng(0)
W = rng.standard_normal((1024, 4096), dtype=np.float32)
X = rng.standard_normal((4, 4096), dtype=np.float32)

def every_format():
    out = {}
    for name in qformats.FORMATS:
        fmt = getattr(qformats, name)
        qt = fmt.quantize(W)
        out[name] = [np.asarray(b).tobytes() for b in qt.buffers.values()]
        out[name].append(np.asarray(qt.dequantize()).tobytes())
        if hasattr(fmt, "gemm") and name != "q8_1":
            out[name].append(np.asarray(fmt.gemm(X, qt)).tobytes())
    return out

def peak_threads(fn):
    # The most OS threads seen while fn runs (the kernels release the GIL, so this thread polls).
    peak, done = [os_threads()], threading.Event()
    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], os_threads())
            time.sleep(0.0005)
    t = threading.Thread(target=poll)
    t.start()
    try:
        r = fn()
    finally:
        done.set()
        t.join()
    return peak[0] - 1, r  # less the poller
"""


def _ok(r):
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    return r


def test_one_setting_for_every_format_and_the_os_threads_follow_it():
    r = _ok(run_capped(WORK + """
base = os_threads()
qformats.set_num_threads(1)
peak, one = peak_threads(every_format)
assert peak == base, ("a format started threads with the setting at 1", peak, base)
assert _runtime.pool_workers() == 0
for n in (7, 3, 1, 5):
    qformats.set_num_threads(n)
    peak, res = peak_threads(every_format)
    assert qformats.num_threads() == n
    assert _runtime.pool_workers() == n - 1, (n, _runtime.pool_workers())
    if n > 1:  # a joined thread can stay listed in /proc a moment longer on a loaded machine
        deadline = time.monotonic() + 2.0
        while os_threads() != base + n - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os_threads() == base + n - 1, (n, os_threads(), base)
    assert peak <= base + n - 1, ("more threads than the setting", n, peak, base)
    assert res == one, f"results differ with {n} threads"
print("ok")
""", mem_mb=3456, timeout=180))
    assert "ok" in r.stdout


@pytest.mark.parametrize("value, threads, note", [
    ("0", None, "not an integer >= 1"),
    ("-3", None, "not an integer >= 1"),
    ("seven", None, "not an integer >= 1"),
    ("7", 7, None),
    ("99999999999", 1024, "above the maximum"),
    ("1" + "0" * 40, 1024, "above the maximum"),
])
def test_env_variable_parsed_with_range_checks(value, threads, note):
    r = _ok(run_capped("""
import os, warnings
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import qformats._runtime as rt
print(rt.num_threads(), len(os.sched_getaffinity(0)))
print("|".join(str(x.message) for x in w))
""", env={"QFORMATS_NUM_THREADS": value}))
    n, cpus = map(int, r.stdout.splitlines()[0].split())
    assert n == (threads if threads is not None else min(cpus, 1024))
    warned = r.stdout.splitlines()[1] if len(r.stdout.splitlines()) > 1 else ""
    if note is None:
        assert warned == ""
    else:
        assert note in warned and "QFORMATS_NUM_THREADS" in warned


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-1, ValueError), (1025, ValueError),
                                      (2**63, ValueError), (2.0, TypeError), (True, TypeError),
                                      ("4", TypeError), (None, TypeError)])
def test_set_num_threads_refuses_bad_values(bad, exc):
    import qformats

    before = qformats.num_threads()
    with pytest.raises(exc, match="set_num_threads"):
        qformats.set_num_threads(bad)
    assert qformats.num_threads() == before


@pytest.mark.parametrize("fmt_call", [
    "qformats.q4_0.quantize(np.ones((16384, 4096), np.float32))",
    "qformats.nf4.gemm(np.ones((8, 4096), np.float32), qformats.nf4.quantize(np.ones((4096, 4096), np.float32)))",
])
def test_thousand_threads_under_a_memory_cap_run_with_what_the_os_gives(fmt_call):
    # 1000 threads of 8 MiB stacks do not fit in ~1.9 GiB of address space: thread creation fails
    # part-way, and the call must finish with the threads that were created (it used to abort in
    # the codecs and deadlock in the GEMM pool).
    r = _ok(run_capped(f"""
import numpy as np, qformats
from qformats import _runtime
assert qformats.num_threads() == 1000
out = {fmt_call}
print("workers", _runtime.pool_workers())
""", mem_mb=1920, timeout=120, env={"QFORMATS_NUM_THREADS": "1000"}))
    workers = int(r.stdout.split("workers")[1])
    assert 0 <= workers < 999, workers  # the cap bit: not every thread could be made


def test_a_pool_cut_short_by_a_memory_cap_leaves_the_caller_room():
    # The pool used to keep every thread it could make, leaving less than one stack (8 MiB) of the
    # address space: the caller's next allocation failed (a 2 MiB array inside q4_0.quantize
    # failed or not by a few MiB of the cap). It now keeps three quarters of them.
    r = _ok(run_capped("""
import numpy as np, qformats
from qformats import _runtime
w = np.ones((16384, 4096), np.float32)
out = qformats.q4_0.quantize(w)  # the pool starts here; w and out stay alive
room = np.ones(8 << 20)  # 64 MiB more
print("workers", _runtime.pool_workers())
""", mem_mb=1920, timeout=120, env={"QFORMATS_NUM_THREADS": "1000"}))
    workers = int(r.stdout.split("workers")[1])
    assert 0 < workers < 999, workers


def test_forked_child_gets_its_own_pool():
    # After fork the child has none of the parent's workers; it must not wait for them.
    r = _ok(run_capped(WORK + """
qformats.set_num_threads(4)
parent = every_format()
pid = os.fork()
if pid == 0:
    try:
        ok = every_format() == parent and _runtime.pool_workers() == 3
    except BaseException:
        ok = False
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
print("ok")
""", mem_mb=3456, timeout=120))
    assert "ok" in r.stdout
