"""cpu/gate_sums.py: the log gates' gradients as running sums, against NumPy's cumsum."""
import numpy as np
import pytest

from linattn.cpu import gate_sums


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("w", [1, 5, 64])
def test_reverse_sums(rng, dtype, w):
    bh, n = 4, 37
    rq, rk = rng.standard_normal((bh, n, w)), rng.standard_normal((bh, n, w))
    rows = rng.standard_normal((bh, w))
    lengths = np.array([n, 0, 1, 20], np.int64)
    rq[3, 20:] = rk[3, 20:] = np.nan  # past a length: never read
    dlam = np.full((bh, n, w), np.nan, dtype)
    totals = np.full(bh, np.nan)
    gate_sums.reverse_sums.get(np.dtype(dtype), "C")(rq, rk, rows, lengths, dlam, totals)
    expected = np.zeros((bh, n, w))
    for h, length in enumerate(lengths):
        terms = rq[h, :length] - rk[h, :length]
        expected[h, :length] = np.cumsum(terms[::-1], 0)[::-1] + rows[h]
    tol = 1e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(dlam, expected, rtol=tol, atol=tol * np.abs(expected).max())
    np.testing.assert_allclose(totals, expected.sum((1, 2)), rtol=1e-12, atol=1e-12 * np.abs(expected).sum())
    assert totals[1] == 0 and not dlam[1].any()
