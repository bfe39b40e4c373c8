"""Compilation: kernels still work when no cache directory is writable, and the disk cache never
serves a kernel compiled from other sources."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np

import linattn
from linattn import _jit


def test_uncacheable_falls_back(monkeypatch):
    real = numba.njit

    def fake_njit(*args, **kwargs):
        if kwargs.get("cache"):
            raise RuntimeError("cannot cache function 'f': no locator available for file '/ro/f.py'")
        return real(*args, **kwargs)

    monkeypatch.setattr(numba, "njit", fake_njit)
    monkeypatch.setattr(_jit, "cache_problem", None)

    def f(x):
        return x.sum() * 2

    g = _jit.njit()(f)
    assert g(np.arange(4.0)) == 12.0
    assert "cannot cache" in _jit.cache_problem


def test_other_errors_are_not_swallowed(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("something else")

    monkeypatch.setattr(numba, "njit", broken)
    try:
        _jit.njit()(lambda x: x)
    except RuntimeError as exc:
        assert "something else" in str(exc)
    else:
        raise AssertionError("expected RuntimeError")


_CACHE_PROBE = """
import numpy as np, linattn
from linattn.cpu import step
linattn.step(np.ones((2, 3), np.float32), np.ones((2, 3), np.float32), np.ones((2, 4), np.float32),
             linattn.State.zeros((2,), 3, 4))
stats = step.step_nd_serial.get(np.dtype(np.float32), (1, 0, False)).stats
print("hits", sum(stats.cache_hits.values()), "misses", sum(stats.cache_misses.values()))
"""


def test_editing_a_helper_module_invalidates_the_cache(tmp_path):
    # Numba's cache checks only the kernel's own file; the kernels' cache names carry a hash of all
    # of linattn's sources, so a change to a helper in another module (here vector.py, compiled
    # into the step kernel) is not served from a stale cache.
    pkg = tmp_path / "linattn"
    shutil.copytree(Path(linattn.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("NUMBA_CACHE_DIR", None)

    def run():
        res = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True,
                             cwd=tmp_path, timeout=600, check=False)
        assert res.returncode == 0, res.stderr
        return res.stdout.split()

    assert run() == ["hits", "0", "misses", "1"]  # compiled, and cached
    assert run() == ["hits", "1", "misses", "0"]  # loaded from the cache
    with open(pkg / "cpu" / "vector.py", "a") as f:
        f.write("\n# an edit\n")
    assert run() == ["hits", "0", "misses", "1"]  # compiled again
