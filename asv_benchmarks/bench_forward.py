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


class AfterMatmul:
    """A layer as a NumPy model runs it: a multithreaded projection (NumPy's BLAS), then attention.

    OpenMP workers spinning idle after the attention kernel used to starve the projection's BLAS
    threads (measured 8.2 ms for the layer against 3.4 ms for its two parts apart): compare
    time_layer with time_projection + time_attention.
    """

    def setup(self):
        b, h, n, d = 1, 8, 256, 64
        self.q, self.k, self.v = inputs((b, h, n, d))
        rng = np.random.default_rng(1)
        self.x = rng.standard_normal((n, h * d)).astype(np.float32)
        self.w = rng.standard_normal((h * d, 3 * h * d)).astype(np.float32)
        linattn.causal_linear_attention(self.q, self.k, self.v)

    def time_attention(self):
        linattn.causal_linear_attention(self.q, self.k, self.v)

    def time_projection(self):
        self.x @ self.w

    def time_layer(self):
        self.x @ self.w
        linattn.causal_linear_attention(self.q, self.k, self.v)
