"""cpu/vector.py's explicit-vector loops: stream_copy (streaming stores) and transpose_rows, against NumPy."""
import numpy as np
import pytest
from numba import njit

from linattn.cpu.vector import store_fence, stream_copy, transpose_rows
from linattn.workspace import aligned_empty


@njit
def _copy(src, dst):
    stream_copy(src, dst)
    store_fence()


@njit
def _transpose(src, dst, colsum, nrows):
    transpose_rows(src, dst, colsum, nrows)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (65, 64), (7, 33), (2, 16)])
def test_stream_copy(dtype, shape):
    rng = np.random.default_rng(0)
    src = rng.standard_normal(shape).astype(dtype)
    n = src.size
    aligned = aligned_empty((n + 8,), dtype)  # at a multiple of 64 bytes: streaming stores
    assert aligned.ctypes.data % 64 == 0
    for offset in (0, 1):  # and one element off: plain stores
        aligned[:] = np.nan
        dst = aligned[offset:offset + n].reshape(shape)
        assert (dst.ctypes.data % 64 == 0) == (offset == 0)
        _copy(src, dst)
        np.testing.assert_array_equal(dst, src)
        assert np.isnan(aligned[offset + n:]).all() and (offset == 0 or np.isnan(aligned[0]))  # nothing outside


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transpose_rows(dtype):
    rng = np.random.default_rng(1)
    src = rng.standard_normal((40, 19)).astype(dtype)
    for nrows in (0, 1, 8, 17, 40):
        dst = np.full((19, 40), np.nan, dtype)
        colsum = np.ones(19, dtype)
        _transpose(src, dst, colsum, nrows)
        np.testing.assert_array_equal(dst[:, :nrows], src[:nrows].T)
        assert np.isnan(dst[:, nrows:]).all()
        np.testing.assert_allclose(colsum, 1 + src[:nrows].sum(0), rtol=1e-5)
