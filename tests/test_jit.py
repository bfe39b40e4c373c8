"""Kernels still compile and run when no cache directory is writable."""
import numba
import numpy as np

from linattn import _jit


def test_uncacheable_falls_back(monkeypatch):
    real = numba.njit

    def fake_njit(*args, **kwargs):
        if kwargs.get("cache"):
            raise RuntimeError("cannot cache function 'f': no locator available for file '/ro/f.py'")
        return real(*args, **kwargs)

    monkeypatch.setattr(numba, "njit", fake_njit)
    monkeypatch.setattr(_jit, "cache_problem", None)

    def f(x):
        return x.sum() * 2

    g = _jit.njit()(f)
    assert g(np.arange(4.0)) == 12.0
    assert "cannot cache" in _jit.cache_problem


def test_other_errors_are_not_swallowed(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("something else")

    monkeypatch.setattr(numba, "njit", broken)
    try:
        _jit.njit()(lambda x: x)
    except RuntimeError as exc:
        assert "something else" in str(exc)
    else:
        raise AssertionError("expected RuntimeError")
