"""The feature-map loops of the kernels against NumPy, value by value (their exp is a polynomial)."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from linattn.cpu.elementwise import ELU, IDENTITY, RELU, abs_bits, elu1, exp_le0, float_of_bits, load_rows
from linattn.cpu.mapfns import exp_any

from conftest import exact_exp


@njit
def _apply(x, out):
    for i in range(x.shape[0]):
        out[i] = elu1(x[i])


@pytest.mark.parametrize("dtype, tol, low", [(np.float32, 1.2e-7, -87.3), (np.float64, 2.3e-16, -708.0)])
def test_elu1_over_the_whole_range(dtype, tol, low):
    """elu1 within one ulp of elu + 1 from the smallest normal's log to 30 (the exp's reduction by two
    parts of ln2 kept: folded into one, it was 4 ulp off in float32 and 200 in float64 down there)."""
    x = np.concatenate([-np.logspace(-30, np.log10(-low), 100_000), np.linspace(-30, 30, 100_001)]).astype(dtype)
    got = np.empty_like(x)
    _apply(x, got)
    ref = np.where(x > 0, x.astype(np.float64) + 1, exact_exp(np.minimum(x, 0)))
    assert np.max(np.abs(got - ref) / ref) < tol
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30], dtype)
    got = np.empty_like(special)
    _apply(special, got)
    assert np.isnan(got[0]) and got[1] == np.inf and got[3] == 1 and got[4] == 1 and got[5] == dtype(1e30) + 1
    assert 0 <= got[2] < np.finfo(dtype).tiny * 2 and 0 <= got[6] < np.finfo(dtype).tiny * 2


@njit
def _exps(x, le0, anywhere):
    for i in range(x.shape[0]):
        le0[i] = exp_le0(min(x[i], x.dtype.type(0)))
        anywhere[i] = exp_any(x[i])


def test_exps_over_their_range():
    """exp_le0 (decay factors; float32 and float64) and float32's exp_any (Performer) within one ulp
    of exp where it is a normal float: exactly 1 at 0, 0 below, inf above float32's largest."""
    for dtype, ulps, low in ((np.float32, 1.05, -87.33), (np.float64, 1.05, -708.3)):
        x = np.concatenate([-np.logspace(-30, np.log10(-low), 100_000),
                            np.linspace(low, 88.7 if dtype == np.float32 else 0, 100_001)]).astype(dtype)
        le0, anywhere = np.empty_like(x), np.empty_like(x)
        _exps(x, le0, anywhere)
        ref = exact_exp(x)
        for got, where in ((le0, x <= 0), (anywhere, slice(None))):
            if dtype == np.float64 and got is anywhere:
                continue  # (float64's exp_any is libm's)
            err = np.abs(got[where] - ref[where]) / np.spacing(ref[where].astype(dtype))
            assert err.max() <= ulps
    special = np.array([0.0, -0.0, -88.0, -np.inf, 89.0, np.inf], np.float32)
    le0, anywhere = np.empty_like(special), np.empty_like(special)
    _exps(special, le0, anywhere)
    assert list(le0) == [1, 1, 0, 0, 1, 1]
    assert list(anywhere[:4]) == [1, 1, 0, 0] and list(anywhere[4:]) == [np.inf, np.inf]


@njit
def _largest_magnitude(x):
    top = abs_bits(x[0] - x[0])
    for i in range(x.shape[0]):
        a = abs_bits(x[i])
        top = a if a > top else top
    return float_of_bits(top, x[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_abs_bits_order_as_magnitudes(rng, dtype):
    """The largest of abs_bits over an array, back as a float, is its largest |x| (signed zeros,
    subnormals, infinities included), or NaN where it holds one."""
    tiny = np.finfo(dtype).smallest_subnormal
    for x in (rng.standard_normal(1000), np.array([-0.0, 0.0, tiny, -2 * tiny]), np.array([-3.0, 2.0, -np.inf, 1.0]),
              rng.standard_normal(37) * 1e-310, np.array([1.0, np.nan, -np.inf, 5.0])):
        x = x.astype(dtype)
        got = _largest_magnitude(x)
        if np.isnan(x).any():
            assert np.isnan(got)
        else:
            assert got == np.abs(x).max() and not np.signbit(got)


@njit
def _load(src, i0, c, fm, dst):
    load_rows(src, i0, c, fm, dst)


@pytest.mark.parametrize("d", [1, 5, 16, 63, 64, 100])
@pytest.mark.parametrize("view", ["rows", "reversed", "apart", "strided"])
@pytest.mark.parametrize("extra", [3, 0])
def test_load_rows_every_layout(rng, d, view, extra):
    """load_rows maps a block of rows into a buffer (wider, or as wide as a row: adjacent rows into
    such a buffer go as one flat run), short rows into a wider one as one flat run too (rows forward
    or backward in memory), long ones, rows apart in memory (a fused projection's heads) and strided
    ones row by row; the same values either way, the buffer's other columns and rows untouched."""
    base = rng.standard_normal((40, 2 * d)).astype(np.float32)
    src = {"rows": base[:, :d].copy(), "reversed": base[::-1, :d].copy()[::-1], "apart": base[:, :d],
           "strided": base[:, ::2]}[view]
    for fm, ref in ((ELU, np.where(src > 0, src + 1, np.exp(np.minimum(src, 0)))), (RELU, np.maximum(src, 0)),
                    (IDENTITY, src)):
        dst = np.full((9, d + extra), -5.0, np.float32)
        _load(src, 11, 7, fm, dst)
        np.testing.assert_allclose(dst[:7, :d], ref[11:18], rtol=3e-7, atol=0)
        assert np.all(dst[:, d:] == -5.0) and np.all(dst[7:] == -5.0)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86 CPU model to compile for")
def test_without_fma(tmp_path):
    """Compiled for an x86 CPU without fused multiply-adds (some Atom, Celeron and Pentium cores), the fmas
    are a product and a sum that LLVM may not rewrite: the exps stay within 1.05 ulp of the exact exp (1.04 in
    float32, 0.96 in float64 seen; 1.15 and 1.18 before ``exp_tail`` summed their last terms smallest first),
    and every value maps to the same bits in any code path (tests/no_fma_check.py). With the kernels'
    fast-math flags on those two operations, LLVM folded the exp's rounding away (errors of 1e6 ulp)."""
    env = dict(os.environ, NUMBA_CPU_NAME="x86-64-v2", NUMBA_CPU_FEATURES="", NUMBA_CACHE_DIR=str(tmp_path))
    script = Path(__file__).with_name("no_fma_check.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
