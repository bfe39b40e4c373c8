"""Run test_cuda.py in Numba's CUDA simulator (it must be enabled before numba is imported, hence a
subprocess), so the CUDA kernels are tested on machines without a GPU."""
import os
import pathlib
import re
import subprocess
import sys

import pytest


def test_cuda_kernels_in_simulator():
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        pytest.skip("already in the simulator: test_cuda.py runs directly")
    here = pathlib.Path(__file__).resolve().parent
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "test_cuda.py")],
                         env=env, capture_output=True, text=True, timeout=900, cwd=here.parent)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert " passed" in out and "failed" not in out, out
    if "numba.cuda is not installed" not in out:
        # only the tests that need no simulator may skip in it (the reasons, from -ra's summary)
        reasons = re.findall(r"^SKIPPED \[\d+\] \S+: (.*)$", out, re.MULTILINE)
        skipped = re.search(r"(\d+) skipped", out.splitlines()[-1])
        assert len(reasons) == (int(skipped.group(1)) if skipped else 0), out
        assert set(reasons) <= {"a GPU or the simulator is available", "the simulator compiles nothing"}, out
