"""The first call in a new process: cold (compiling, no cache) and warm (loading the disk cache); cold
first calls of the public functions whose compile takes longest."""
import os
import subprocess
import sys
import tempfile

from .common import SMOKE

SCRIPT = """
import time, numpy as np
t0 = time.perf_counter()
import linattn
x = np.ones((1, 2, 64, 16), np.float32)
linattn.causal_linear_attention(x, x, x)
print(time.perf_counter() - t0)
"""


# each: seconds from before the call (after import) to its end, in a new process
CALLS = {
    "causal, gate per key dimension": """
import time, numpy as np, linattn
x = np.ones((1, 2, 64, 16), np.float32)
t0 = time.perf_counter()
linattn.causal_linear_attention(x, x, x, gate=-x)
print(time.perf_counter() - t0)
""",
    "vjp(dout) after causal_linear_attention_vjp": """
import time, numpy as np, linattn
x = np.ones((1, 2, 64, 16), np.float32)
out, vjp = linattn.causal_linear_attention_vjp(x, x, x)
t0 = time.perf_counter()
vjp(out)
print(time.perf_counter() - t0)
""",
    "linear_attention": """
import time, numpy as np, linattn
x = np.ones((1, 2, 64, 16), np.float32)
t0 = time.perf_counter()
linattn.linear_attention(x, x, x)
print(time.perf_counter() - t0)
""",
}


def _first_call(cache_dir, script=SCRIPT):
    """Seconds the script prints, run in a new process whose Numba cache is ``cache_dir`` (with
    LINATTN_ASV_SMOKE the package's own cache, which the tests fill: the same steps, without compiling again)."""
    env = dict(os.environ) if SMOKE else dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
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


class ColdFirstCalls:
    """Cold first calls of other public functions (the aim: <= 15 s each on a 2-core machine)."""
    timeout = 600
    number = 1
    repeat = 1
    params = list(CALLS)
    param_names = ["call"]

    def track_cold_first_call(self, call):
        with tempfile.TemporaryDirectory() as d:
            return _first_call(d, CALLS[call])

    track_cold_first_call.unit = "s"
