"""cpu/buffers.py: the kernels' scratch arrays (empty, zeros) against NumPy's, and one_of."""
import numpy as np
import pytest
from numba import from_dtype, njit, types
from numba.core.errors import TypingError

from linattn.cpu.buffers import empty, one_of, zeros

SUB = 8


@njit
def _make(n, like):
    dirty = empty(n * SUB, like.dtype)  # memory that the allocator may hand out again below
    dirty[:] = 7
    dirty = None
    return (zeros((n, SUB), like.dtype), empty(n, np.int64), zeros(n + 1, np.float64), empty((0, n), np.float32),
            zeros(np.int32(n), np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 5, 1000])
def test_shapes_dtypes_and_zeros(dtype, n):
    z, e, z1, e0, zi = _make(n, np.ones(1, dtype))
    for got, shape, dt in ((z, (n, SUB), dtype), (e, (n,), np.int64), (z1, (n + 1,), np.float64),
                           (e0, (0, n), np.float32), (zi, (n,), np.float32)):
        assert got.shape == shape and got.dtype == dt and got.flags.c_contiguous and got.flags.writeable
    assert not z.any() and not z1.any() and not zi.any()
    e[:] = 3  # each its own memory
    assert not z.any()


def test_bad_arguments_do_not_type():
    @njit
    def bad_shape(x):
        return empty(x, np.float32)

    @njit
    def bad_dtype(n):
        return zeros(n, n)

    with pytest.raises(TypingError):
        bad_shape(1.5)
    with pytest.raises(TypingError):
        bad_dtype(3)


@njit
def _ones(x):
    return one_of(x.dtype), one_of(np.float64), one_of(np.int32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_one_of_is_one_in_that_dtype(dtype):
    assert _ones(np.zeros(2, dtype)) == (1, 1, 1)  # (as np.ones(1, dtype)[0], which the kernels used)
    returned = {sig.args[0].dtype: sig.return_type for sig in _ones.nopython_signatures}
    assert returned[from_dtype(dtype)] == types.Tuple((from_dtype(dtype), types.float64, types.int32))


def test_one_of_needs_a_dtype():
    @njit
    def bad(x):
        return one_of(x)

    with pytest.raises(TypingError):
        bad(2.0)
