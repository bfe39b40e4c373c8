"""The first call in a new process: cold (compiling, no cache) and warm (loading the disk cache)."""
import os
import subprocess
import sys
import tempfile

SCRIPT = """
import time, numpy as np
t0 = time.perf_counter()
import linattn
x = np.ones((1, 2, 64, 16), np.float32)
linattn.causal_linear_attention(x, x, x)
print(time.perf_counter() - t0)
"""


def _first_call(cache_dir):
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


class FirstCall:
    timeout = 600
    number = 1
    repeat = 1

    def track_cold_first_call(self):
        with tempfile.TemporaryDirectory() as d:
            return _first_call(d)

    track_cold_first_call.unit = "s"

    def track_warm_first_call(self):
        with tempfile.TemporaryDirectory() as d:
            _first_call(d)
            return _first_call(d)

    track_warm_first_call.unit = "s"
