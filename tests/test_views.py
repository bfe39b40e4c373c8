"""cpu/views.py: arrays without reference counting (unowned, keep_alive) and what the kernels do with them."""
import sys

import numpy as np
from numba import njit

import linattn
from linattn.cpu.views import keep_alive, unowned


@njit
def _rows_sum(x):
    """Sums of the rows of x through per-row views of an unowned x (a tuple of arrays comes back as one)."""
    (u,), out = unowned((x,)), np.empty(x.shape[0], x.dtype)
    own = np.zeros(x.shape[1], x.dtype)
    acc = unowned(own)
    for t in range(u.shape[0]):
        row = u[t]
        acc[:] = row
        out[t] = acc.sum()
    keep_alive(own)
    return out


def test_unowned_views_read_the_same_data():
    x = np.arange(12.0).reshape(3, 4)[:, ::-1]  # a strided view
    np.testing.assert_array_equal(_rows_sum(x), x.sum(axis=1))


def test_kernels_leave_reference_counts_alone(rng):
    """The kernels drop no reference they did not take (the arguments are unowned inside them)."""
    q, k, v = (rng.standard_normal((2, 3, 40, 8)).astype(np.float32) for _ in range(3))
    state = linattn.State.zeros((2, 3), 8, 8)
    linattn.causal_linear_attention(q, k, v)
    linattn.linear_attention(q, k, v)
    linattn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :], state)
    before = [sys.getrefcount(x) for x in (q, k, v, state.S, state.Z)]
    for _ in range(50):
        linattn.causal_linear_attention(q, k, v)
        linattn.linear_attention(q, k, v)
        linattn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :], state)
    assert [sys.getrefcount(x) for x in (q, k, v, state.S, state.Z)] == before
