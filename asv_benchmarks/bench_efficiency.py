"""Efficiency: time over a same-FLOP BLAS GEMM and achieved GFLOP/s, so the dashboard shows how
close to the hardware linattn runs, not only seconds."""
import numpy as np

import linattn

from .common import SMOKE, best_of, gemm_pair, inputs, interleaved_ratio

CASES = {  # the cases of ../shared/bench/run_peers.py
    "B1 H8 N2048 D64": (1, 8, 2048, 64),
    "B4 H8 N1024 D64": (4, 8, 1024, 64),
    "B2 H4 N8192 D64": (2, 4, 8192, 64),
    "B1 H1 N16384 D64": (1, 1, 16384, 64),
    "B1 H8 N4096 D128": (1, 8, 4096, 128),
}
if SMOKE:
    CASES = {name: shape[:2] + (256,) + shape[3:] for name, shape in CASES.items()}


class Efficiency:
    params = list(CASES)
    param_names = ["case"]
    timeout = 300

    def setup(self, case):
        shape = CASES[case]
        self.q, self.k, self.v = inputs(shape)
        self.gemm = gemm_pair(shape)
        self.flops = 4 * np.prod(shape) * shape[-1]
        self.run = lambda: linattn.causal_linear_attention(self.q, self.k, self.v)
        self.run()

    def track_ratio_to_gemm_roof(self, case):
        return interleaved_ratio(self.run, self.gemm)

    track_ratio_to_gemm_roof.unit = "x GEMM time"

    def track_gflops(self, case):
        return float(self.flops / best_of(self.run) / 1e9)

    track_gflops.unit = "GFLOP/s"
