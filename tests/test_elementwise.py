"""The feature-map loops of the kernels against NumPy, value by value (their exp is a polynomial)."""
import numpy as np
import pytest
from numba import njit

from linattn.cpu.elementwise import elu1


@njit
def _apply(x, out):
    for i in range(x.shape[0]):
        out[i] = elu1(x[i])


@pytest.mark.parametrize("dtype, tol, low", [(np.float32, 3e-7, -87.3), (np.float64, 1e-13, -708.0)])
def test_elu1_over_the_whole_range(dtype, tol, low):
    x = np.concatenate([-np.logspace(-30, np.log10(-low), 100_000), np.linspace(-30, 30, 100_001)]).astype(dtype)
    got = np.empty_like(x)
    _apply(x, got)
    ref = np.where(x > 0, x.astype(np.float64) + 1, np.exp(np.minimum(x, 0).astype(np.float64)))
    assert np.max(np.abs(got - ref) / ref) < tol
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30], dtype)
    got = np.empty_like(special)
    _apply(special, got)
    assert np.isnan(got[0]) and got[1] == np.inf and got[3] == 1 and got[4] == 1 and got[5] == dtype(1e30) + 1
    assert 0 <= got[2] < np.finfo(dtype).tiny * 2 and 0 <= got[6] < np.finfo(dtype).tiny * 2
