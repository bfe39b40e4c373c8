"""Every keyword of every public attention function and of the NumPy references, given values that are
wrong for any keyword (a string, a complex number, a float array of the wrong size, a complex array, a
ragged list, a State where it is not one), raises a ValueError or TypeError whose message names that
keyword: never NumPy's or Numba's own error, never a silent acceptance."""
import numpy as np
import pytest

import linattn
from linattn import reference

F = np.float32
_q = np.random.default_rng(0).standard_normal((2, 3, 5, 4)).astype(F)
_v = np.random.default_rng(1).standard_normal((2, 3, 5, 6)).astype(F)


def _state():
    return linattn.State.zeros((2, 3), 4, 6)


CALLS = {
    "causal_linear_attention": (lambda **kw: linattn.causal_linear_attention(_q, _q, _v, **kw),
                                ["feature_map", "eps", "normalize", "initial_state", "return_state", "lengths", "decay",
                                 "gate", "scale", "out", "device"]),
    "linear_attention": (lambda **kw: linattn.linear_attention(_q, _q, _v, **kw),
                         ["feature_map", "eps", "normalize", "initial_state", "return_state", "lengths",
                          "query_lengths", "scale", "out", "device"]),
    "step": (lambda **kw: linattn.step(_q[:, :, 0], _q[:, :, 0], _v[:, :, 0], _state(), **kw),
             ["feature_map", "eps", "normalize", "decay", "gate", "scale", "out", "device"]),
    "attention_weights": (lambda **kw: linattn.attention_weights(_q, _q, **kw),
                          ["causal", "feature_map", "eps", "decay", "gate", "scale", "lengths", "query_lengths"]),
    "causal_linear_attention_vjp": (lambda **kw: linattn.causal_linear_attention_vjp(_q, _q, _v, **kw),
                                    ["feature_map", "eps", "normalize", "initial_state", "return_state", "lengths",
                                     "scale", "decay", "gate"]),
    "linear_attention_vjp": (lambda **kw: linattn.linear_attention_vjp(_q, _q, _v, **kw),
                             ["feature_map", "eps", "normalize", "initial_state", "return_state", "lengths",
                              "query_lengths", "scale"]),
    "reference.masked": (lambda **kw: reference.masked(_q, _q, _v, **kw),
                         ["causal", "feature_map", "eps", "normalize", "initial_state", "decay", "gate", "scale"]),
    "reference.loop": (lambda **kw: reference.loop(_q, _q, _v, **kw),
                       ["feature_map", "eps", "normalize", "initial_state", "return_state", "decay", "gate", "scale",
                        "lengths"]),
}
BAD = {
    "str": "abc",
    "complex": 1j,
    "float array of 7": np.ones(7),
    "complex array": np.ones((2, 3), complex),
    "ragged list": [[1], [1, 2]],
    "State": _state(),  # (a valid initial_state: skipped there)
}
CASES = [(fn, kw, bad) for fn, (_, kws) in CALLS.items() for kw in kws for bad in BAD
         if not (kw == "initial_state" and bad == "State")]


@pytest.mark.parametrize("fn, keyword, bad", CASES)
def test_a_bad_value_names_its_keyword(fn, keyword, bad):
    with pytest.raises((ValueError, TypeError)) as info:
        CALLS[fn][0](**{keyword: BAD[bad]})
    assert keyword in str(info.value).split(":")[0], str(info.value)
