"""Time of the causal and non-causal forward, with the NumPy chunked form as a baseline."""
import numpy as np

import linattn

from .common import SHAPES, inputs, numpy_chunked


class Causal:
    params = (list(SHAPES), ["float32", "float64"])
    param_names = ["shape", "dtype"]

    def setup(self, shape, dtype):
        self.q, self.k, self.v = inputs(SHAPES[shape], np.dtype(dtype))
        linattn.causal_linear_attention(self.q, self.k, self.v)  # compile / load from cache

    def time_linattn(self, shape, dtype):
        linattn.causal_linear_attention(self.q, self.k, self.v)

    def time_numpy_chunked(self, shape, dtype):
        numpy_chunked(self.q, self.k, self.v)


class NonCausal:
    params = (list(SHAPES), ["float32", "float64"])
    param_names = ["shape", "dtype"]

    def setup(self, shape, dtype):
        if not hasattr(linattn, "linear_attention"):
            raise NotImplementedError
        self.q, self.k, self.v = inputs(SHAPES[shape], np.dtype(dtype))
        linattn.linear_attention(self.q, self.k, self.v)

    def time_linattn(self, shape, dtype):
        linattn.linear_attention(self.q, self.k, self.v)


class StateHandoff:
    """Prefill returning the state, as a server does before decoding."""

    def setup(self):
        self.q, self.k, self.v = inputs(SHAPES["medium"])
        linattn.causal_linear_attention(self.q, self.k, self.v, return_state=True)

    def time_prefill_with_state(self):
        linattn.causal_linear_attention(self.q, self.k, self.v, return_state=True)
