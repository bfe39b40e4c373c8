"""Decay and gates (issue 11's targets), each as a ratio to the same call without them, measured in
one process, interleaved (``track_``: the dashboard shows a regression as the ratio rising): causal
forward with a constant decay (target <= 1.15), a scalar gate per position (<= 1.3), a gate per key
dimension (<= 2.5); ``step`` with a gate (<= 1.2)."""
import numpy as np

import linattn

from .common import SMOKE, inputs, interleaved_ratio


class GatedForward:
    params = (["B1 H8 N2048", "B2 H4 N8192"], ["decay", "scalar gate", "per-dimension gate"])
    param_names = ["shape", "gating"]
    timeout = 600

    def setup(self, shape, gating):
        b, h, n = {"B1 H8 N2048": (1, 8, 2048), "B2 H4 N8192": (2, 4, 8192)}[shape]
        if SMOKE:
            n = 256
        self.q, self.k, self.v = inputs((b, h, n, 64))
        rng = np.random.default_rng(1)
        self.kwargs = {
            "decay": {"decay": 1 - 2.0 ** (-5 - np.arange(h))},
            "scalar gate": {"gate": -0.1 * rng.random((b, h, n)).astype(np.float32)},
            "per-dimension gate": {"gate": -0.1 * rng.random((b, h, n, 64)).astype(np.float32)},
        }[gating]

    def track_over_ungated(self, shape, gating):
        q, k, v = self.q, self.k, self.v
        return interleaved_ratio(lambda: linattn.causal_linear_attention(q, k, v, **self.kwargs),
                                 lambda: linattn.causal_linear_attention(q, k, v), 5 if SMOKE else 15)

    track_over_ungated.unit = "x ungated"


class GatedStep:
    params = ([1, 32], ["decay", "scalar gate", "per-dimension gate"])
    param_names = ["batch", "gating"]

    def setup(self, batch, gating):
        rng = np.random.default_rng(0)
        self.q, self.k, self.v = ((rng.standard_normal((batch, 8, 64)) * 0.5).astype(np.float32) for _ in range(3))
        self.state = linattn.State.zeros((batch, 8), 64, 64)
        self.out = np.empty((batch, 8, 64), np.float32)
        self.kwargs = {
            "decay": {"decay": 1 - 2.0 ** (-5 - np.arange(8))},
            "scalar gate": {"gate": -0.1 * rng.random((batch, 8)).astype(np.float32)},
            "per-dimension gate": {"gate": -0.1 * rng.random((batch, 8, 64)).astype(np.float32)},
        }[gating]

    def track_over_ungated(self, batch, gating):
        q, k, v, st, out = self.q, self.k, self.v, self.state, self.out
        return interleaved_ratio(lambda: linattn.step(q, k, v, st, out=out, **self.kwargs),
                                 lambda: linattn.step(q, k, v, st, out=out), 50 if SMOKE else 300)

    track_over_ungated.unit = "x ungated"
