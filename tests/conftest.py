import os

import numpy as np
import pytest
from hypothesis import settings

# The random tests (hypothesis) draw the same examples in every run unless LINATTN_HYPOTHESIS=explore
# (then new ones each run, as when looking for bugs): a CI run cannot fail on a draw no run saw before.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if os.environ.get("LINATTN_HYPOTHESIS") == "explore" else "fixed")

#: Largest error relative to the largest reference value that each compute dtype must meet.
TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-11, np.dtype(np.float16): 2e-3}


def rel_err(out, ref):
    """max |out - ref| / max |ref| (0 when both are empty)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if ref.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    return float(np.max(np.abs(out - ref))) / scale


def assert_close(out, ref, dtype):
    err = rel_err(out, ref)
    assert err <= TOL[np.dtype(dtype)], f"relative error {err:.3e} > {TOL[np.dtype(dtype)]:.1e}"


def make_qkv(rng, lead, n, d, dv, dtype=np.float32, scale=0.5):
    q = (rng.standard_normal(lead + (n, d)) * scale).astype(dtype)
    k = (rng.standard_normal(lead + (n, d)) * scale).astype(dtype)
    v = rng.standard_normal(lead + (n, dv)).astype(dtype)
    return q, k, v


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
