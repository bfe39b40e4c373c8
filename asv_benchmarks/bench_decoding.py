"""Latency of one decoding step (linattn.step) next to a vectorised NumPy step."""
import numpy as np

import linattn

from .common import elu1


def numpy_step(q, k, v, S, Z, eps=1e-6):
    qf, kf = elu1(q), elu1(k)
    S += kf[..., :, None] * v[..., None, :]
    Z += kf
    num = np.einsum("...d,...de->...e", qf, S)
    return num / (np.einsum("...d,...d->...", qf, Z)[..., None] + eps)


class Step:
    params = ([1, 32], ["float32", "float64"])
    param_names = ["batch", "dtype"]

    def setup(self, batch, dtype):
        if not hasattr(linattn, "step"):
            raise NotImplementedError
        rng = np.random.default_rng(0)
        self.q, self.k, self.v = ((rng.standard_normal((batch, 8, 64)) * 0.5).astype(dtype) for _ in range(3))
        self.state = linattn.State.zeros((batch, 8), 64, 64, np.dtype(dtype))
        self.S, self.Z = self.state.S.copy(), self.state.Z.copy()
        self.S_copy = self.state.S.copy()
        linattn.step(self.q, self.k, self.v, self.state)

    def time_step(self, batch, dtype):
        linattn.step(self.q, self.k, self.v, self.state)

    def time_numpy_step(self, batch, dtype):
        numpy_step(self.q, self.k, self.v, self.S, self.Z)

    def time_copy_state(self, batch, dtype):
        np.copyto(self.S_copy, self.state.S)
