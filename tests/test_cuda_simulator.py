"""Run test_cuda.py in Numba's CUDA simulator (it must be enabled before numba is imported, hence a
subprocess), so the CUDA kernels are tested on machines without a GPU."""
import os
import pathlib
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
    if "skipped" in out.splitlines()[-1] and "numba.cuda is not installed" not in out:
        # only the no-GPU test may skip in the simulator
        assert out.splitlines()[-1].count("skipped") == 1, out
