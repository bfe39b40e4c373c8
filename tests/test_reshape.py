"""``view_as``: a view under another shape exactly where NumPy could make one, and never a copy."""
import tracemalloc

import numpy as np
import pytest

from linattn._reshape import view_as


def _numpy_view(x, shape):
    """NumPy's own answer (which copies the array to find out when the answer is no)."""
    view = x.view()
    try:
        view.shape = shape
    except AttributeError:
        return None
    return view


def _factors(rng, size):
    """A random shape of ``size`` elements, with some dims of 1."""
    dims = []
    while size > 1:
        d = int(rng.choice([d for d in range(2, size + 1) if size % d == 0]))
        dims.append(d)
        size //= d
        if rng.random() < 0.2:
            dims.insert(int(rng.integers(len(dims) + 1)), 1)
    return tuple(dims) or (1,)


def test_views_exactly_where_numpy_makes_them(rng):
    made = refused = 0
    for _ in range(3000):
        nd = int(rng.integers(1, 6))
        shape = tuple(int(s) for s in rng.integers(1, 4, nd))
        full = np.arange(2 * np.prod(shape) * 3, dtype=np.float32).reshape((2 * shape[0],) + shape[1:] + (3,))
        x = (full[::2] if rng.random() < 0.5 else full[:shape[0]])[..., int(rng.integers(3))]
        x = x.transpose(rng.permutation(nd))
        new = _factors(rng, x.size)
        got, expected = view_as(x, new), _numpy_view(x, new)
        assert (got is None) == (expected is None), (x.shape, x.strides, new)
        if got is None:
            refused += 1
            continue
        made += 1
        assert got.shape == new and np.shares_memory(got, x)
        np.testing.assert_array_equal(got, x.reshape(new))
        before = x.reshape(-1)[-1]
        got.flat[-1] += 1  # the same memory: x sees the change
        assert x.reshape(-1)[-1] == before + 1
    assert made > 500 and refused > 500


@pytest.mark.parametrize("shape", [(0, 3), (3, 0, 2)])
def test_empty_arrays(shape):
    x = np.zeros(shape, np.float32)[::-1]
    assert view_as(x, (x.size,)).shape == (x.size,)


def test_a_refusal_copies_nothing():
    """A fused projection's head views (B, H, N, D) merge into no single (BH, N, D) view: the answer
    comes from the strides, with no array-sized allocation on the way (NumPy 2.4's shape assignment
    copies the 8 MB first; the view (B, H, N, D) itself costs nothing either)."""
    qkv = np.zeros((8, 512, 3, 8, 64), np.float32)
    q = qkv[:, :, 0].transpose(0, 2, 1, 3)
    tracemalloc.start()
    try:
        assert view_as(q, (64, 512, 64)) is None
        assert view_as(q, (8, 8, 512, 64)) is not None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100_000
