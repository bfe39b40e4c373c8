"""cpu/threaded.py: parallel kernels whose loop calls a separately compiled worker by its address."""
import os
import subprocess
import sys

import numpy as np
import pytest
from numba.core import types

from linattn._jit import array
from linattn.cpu import threaded
from linattn.cpu.runtime import kernel_section
from linattn.cpu.schedule import take


def _tally(items, weight, fail_at, seen, counter):
    """Adds ``weight`` to seen[item] for every item taken; raises at item ``fail_at``."""
    item = take(counter)
    while item < items:
        if item == fail_at:
            raise ValueError("item failed")
        seen[item] += weight
        item = take(counter)


def _signature(dt, variant):
    return types.void(types.int64, dt, types.int64, array(dt, 1, variant))


TALLY = threaded.ThreadedKernel(_tally, _signature)


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_item_taken_once(nthreads, dtype):
    seen = np.zeros(1000, dtype)
    run = TALLY.get(np.dtype(dtype), "C")
    with kernel_section(nthreads):
        run(nthreads, 1000, dtype(0.5), -1, seen)
    np.testing.assert_array_equal(seen, 0.5)  # each item once, whichever thread took it
    strided = np.zeros(20, dtype)[::2]  # the "A" variant: any strides
    TALLY.get(np.dtype(dtype), "A")(1, 10, dtype(2), -1, strided)
    np.testing.assert_array_equal(strided, 2)
    assert TALLY.get(np.dtype(dtype), "C") is run  # compiled once per (dtype, variant)


@pytest.mark.parametrize("nthreads", [1, 2])
def test_the_workers_exception_reaches_the_caller(nthreads):
    """Whichever thread fails (Numba's parallel loop propagates only the calling thread's failure: a
    failure on the other one was lost in ~30% of the runs before threaded._raise_recorded)."""
    for _ in range(1 if nthreads == 1 else 40):
        seen = np.zeros(1000)
        with kernel_section(nthreads), pytest.raises(ValueError, match="item failed"):
            TALLY.get(np.dtype(np.float64), "C")(nthreads, 1000, 1.0, 3, seen)
        if nthreads == 1:
            np.testing.assert_array_equal(seen, [1, 1, 1] + [0] * 997)
        else:  # the other thread stops at the counter's end or at its own failure
            assert seen[3] == 0 and set(np.unique(seen)) <= {0, 1}


def test_arguments_reach_every_thread_and_stay_owned():
    """The parallel path hands the worker's arguments to the threads through a pointer into the
    launching frame: each thread sees the same arrays, and their reference counts come back even."""
    import sys as _sys
    seen = np.zeros(4000)
    before = _sys.getrefcount(seen)
    run = TALLY.get(np.dtype(np.float64), "C")
    for _ in range(50):
        with kernel_section(2):
            run(2, 4000, 0.25, -1, seen)
    np.testing.assert_array_equal(seen, 50 * 0.25)
    assert _sys.getrefcount(seen) == before


_CACHE_PROBE = """
import numpy as np, linattn
from linattn.cpu import chunked, threaded
x = np.ones((1, 2, 40, 3), np.float32)
out = linattn.causal_linear_attention(x, x, x)
run = chunked.causal_forward.get(np.dtype(np.float32), ("C", 0))
loop = threaded._generic_loop()[0]
print(*(sum(getattr(f.stats, s).values()) for f in (run.worker, run.launch, run.trampoline, loop)
        for s in ("cache_hits", "cache_misses")), bool(abs(out - 1).max() < 1e-6))
"""


def test_worker_and_loop_load_from_the_disk_cache(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))

    def run():
        res = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True,
                             timeout=600, check=False)
        assert res.returncode == 0, res.stderr
        return res.stdout.split()

    assert run() == ["0", "1"] * 4 + ["True"]  # compiled (and cached); v averaged: all ones
    assert run() == ["1", "0"] * 4 + ["True"]  # all loaded, and the addresses still right
