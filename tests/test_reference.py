"""The two NumPy references agree with each other, and with a hand-computed case."""
import numpy as np
import pytest

from linattn import reference

from conftest import make_qkv, rel_err


@pytest.mark.parametrize("feature_map", ["elu", "relu", "identity"])
def test_loop_equals_masked(rng, feature_map):
    q, k, v = make_qkv(rng, (2,), 17, 3, 5, np.float64)
    if feature_map == "identity":
        q, k = np.abs(q), np.abs(k)  # keep denominators away from zero
    for normalize in (True, False):
        a = reference.loop(q, k, v, feature_map=feature_map, normalize=normalize)
        b = reference.masked(q, k, v, feature_map=feature_map, normalize=normalize)
        assert rel_err(a, b) < 1e-12


def test_loop_state_and_initial_state(rng):
    q, k, v = make_qkv(rng, (), 20, 4, 3, np.float64)
    full, (S, Z) = reference.loop(q, k, v, return_state=True)
    a, st = reference.loop(q[:7], k[:7], v[:7], return_state=True)
    b = reference.loop(q[7:], k[7:], v[7:], initial_state=st)
    assert rel_err(np.concatenate([a, b]), full) < 1e-12
    b2 = reference.masked(q[7:], k[7:], v[7:], initial_state=st)
    assert rel_err(b2, b) < 1e-12
    kf = np.where(k > 0, k + 1, np.exp(k))
    np.testing.assert_allclose(S, kf.T @ v, rtol=1e-12)
    np.testing.assert_allclose(Z, kf.sum(0), rtol=1e-12)


def test_textbook_value():
    # phi(0) = 1 for elu: with q = k = 0 every output is the running mean of v (eps = 0).
    v = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 9.0]])
    z = np.zeros((3, 2))
    expected = np.array([[1.0, 2.0], [2.0, 3.0], [3.0, 5.0]])
    np.testing.assert_allclose(reference.loop(z, z, v, eps=0.0), expected)
    np.testing.assert_allclose(reference.masked(z, z, v, eps=0.0, causal=False), np.tile([3.0, 5.0], (3, 1)))


@pytest.mark.parametrize("n", [0, 1, 5])
def test_masked_with_gates_from_a_state_at_any_length(rng, n):
    """The masked form with gates and an initial state equals the loop, down to no positions at all (an
    empty sequence once failed there: its decay factors of the initial state had no rows)."""
    q, k, v = make_qkv(rng, (2,), n, 3, 2, np.float64)
    gate = -rng.random((2, n)) * 0.5
    state = (rng.random((2, 3, 2)), rng.random((2, 3)))
    a = reference.masked(q, k, v, gate=gate, initial_state=state)
    b = reference.loop(q, k, v, gate=gate, initial_state=state)
    assert a.shape == (2, n, 2)
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=0)
