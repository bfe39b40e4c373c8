import os


def _default_threads():
    """Numba's default number of threads: this process's CPUs (its affinity where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# The suite runs the kernels' paths on two threads (heads split between threads, work items taken by two,
# OpenBLAS's jobs on the pool) on any machine, its one-thread paths through numba.set_num_threads(1) and the
# calls' own plans: Numba's pool needs two threads at least. On a machine with one CPU (or under
# NUMBA_NUM_THREADS=1) it would have one, and each test's numba.set_num_threads(2) failed (46 tests). Set
# here, before Numba is imported (a test module's import; subprocesses inherit it).
if int(os.environ.get("NUMBA_NUM_THREADS") or _default_threads()) < 2:
    os.environ["NUMBA_NUM_THREADS"] = "2"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

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


def assert_close(out, ref, dtype, cond=1.0):
    """rel_err(out, ref) <= TOL of dtype, times ``cond`` (a draw's condition number) when given."""
    err = rel_err(out, ref)
    assert err <= TOL[np.dtype(dtype)] * cond, f"relative error {err:.3e} > {TOL[np.dtype(dtype)]:.1e} x {cond:.3g}"


def exact_exp(x):
    """exp(x) for ulp checks of float64 results: in long double where it has more bits than float64 (x86: 64),
    so that the reference adds no rounding of its own. NumPy's float64 exp is within one ulp, not exact (NumPy
    1.24's, on AVX-512, one ulp off at x = -0.998703, where linattn's exp was one ulp off the other way: two
    ulps against it, 0.89 against the exact value)."""
    wide = np.finfo(np.longdouble).nmant > np.finfo(np.float64).nmant
    return np.exp(np.asarray(x).astype(np.longdouble if wide else np.float64))


def cancellation(want, size, dtype):
    """The condition number of sums that cancel: 1 + 8 eps (of the compute dtype: float32 for float16)
    times the largest sum of magnitudes ``size`` over TOL x max |want|. A sum far smaller than its terms
    carries their rounding: explore mode drew outputs 4100 and 5800 times smaller than their terms."""
    compute = np.float32 if np.dtype(dtype) == np.float16 else dtype
    largest = max(float(np.max(np.abs(want), initial=0.0)), float(np.finfo(dtype).tiny))
    return 1 + 8 * float(np.finfo(compute).eps) * float(np.max(size, initial=0.0)) / (TOL[np.dtype(dtype)] * largest)


def make_qkv(rng, lead, n, d, dv, dtype=np.float32, scale=0.5):
    q = (rng.standard_normal(lead + (n, d)) * scale).astype(dtype)
    k = (rng.standard_normal(lead + (n, d)) * scale).astype(dtype)
    v = rng.standard_normal(lead + (n, dv)).astype(dtype)
    return q, k, v


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def random_options(rng, lead, n, d, dv, dtype, fmap, gating, with_state, with_lengths, scale):
    """(map, D', keyword arguments) of a causal call with options drawn by a random test: ``fmap`` a name
    ("taylor", "dpfp", "hedgehog" or a built-in name), ``gating`` "none", "decay", "position",
    "dimension" or "decay+position"; a state, lengths (with leading dims) and ``scale`` as asked."""
    import linattn

    fm = linattn.feature_maps
    fmap = {"taylor": fm.Taylor(), "dpfp": fm.DPFP(1),
            "hedgehog": fm.Hedgehog(rng.standard_normal((d, 2)), rng.standard_normal(2) * 0.1)}.get(fmap, fmap)
    dk = fm.as_map(fmap).out_dim(d)
    kw = dict(feature_map=fmap, scale=scale)
    if "decay" in gating:
        kw["decay"] = rng.uniform(0.7, 1.0, lead[-1:] if lead else ())
    if gating in ("position", "decay+position", "dimension"):
        kw["gate"] = np.log(rng.uniform(0.6, 1.0, lead + (n,) + ((dk,) if gating == "dimension" else ()))).astype(dtype)
    if with_state:
        kw["initial_state"] = linattn.State((rng.standard_normal(lead + (dk, dv)) * 0.3).astype(dtype),
                                            rng.uniform(0.5, 1.5, lead + (dk,)).astype(dtype))
    if with_lengths and lead:
        kw["lengths"] = rng.integers(0, n + 1, lead)
    return fmap, dk, kw


def causal_results(q, k, v, options, W):
    """Everything the causal calls give for each keyword set in ``options`` (the plain call first): the
    output and final state, and the vjp's gradients along W; the vjp's forward must equal the call's bit
    for bit. The short path's cached plans are dropped first (a test may have forced the plan)."""
    import linattn

    linattn.attention._constants.clear()
    found = [linattn.causal_linear_attention(q, k, v)]
    for kw in options:
        out, state = linattn.causal_linear_attention(q, k, v, return_state=True, **kw)
        out2, _, vjp = linattn.causal_linear_attention_vjp(q, k, v, return_state=True, **kw)
        np.testing.assert_array_equal(out2, out)
        found += [out, state.S, state.Z] + [x for x in vjp(W)[:3]]
    return found
