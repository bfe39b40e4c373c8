"""Cross-attention (keys and values of another length than the queries) against a same-FLOP GEMM and
against self-attention of the same FLOPs, and a decoder's query over the keys' state against a step."""
import numpy as np

import linattn

from .common import SMOKE, inputs, interleaved_ratio

CASES = {  # (B, H, N, Nk), D = Dv = 64
    "B1 H8 N2048 Nk512": (1, 8, 2048, 512),
    "B1 H8 N512 Nk4096": (1, 8, 512, 4096),
}
if SMOKE:
    CASES = {name: (b, h, n // 8, nk // 8) for name, (b, h, n, nk) in CASES.items()}


def _gemm_rows(rows_a, rows_b, d, dv):
    """Two products of rows_a and rows_b rows by (d, dv): the kernel's FLOPs (its state from the keys'
    rows, the outputs from the queries')."""
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((r, d)).astype(np.float32) for r in (rows_a, rows_b))
    w = rng.standard_normal((d, dv)).astype(np.float32)
    ca, cb = np.empty((rows_a, dv), np.float32), np.empty((rows_b, dv), np.float32)

    def run():
        np.matmul(a, w, out=ca)
        np.matmul(b, w, out=cb)

    return run


class CrossAttention:
    params = list(CASES)
    param_names = ["case"]
    timeout = 300

    def setup(self, case):
        b, h, n, nk = CASES[case]
        self.q = inputs((b, h, n, 64))[0]
        _, self.k, self.v = inputs((b, h, nk, 64), seed=1)
        self.same_flops = inputs((b, h, (n + nk) // 2, 64), seed=2)
        self.roof = _gemm_rows(b * h * n, b * h * nk, 64, 64)
        self.run = lambda: linattn.linear_attention(self.q, self.k, self.v)
        self.run()

    def track_over_roof(self, case):
        return interleaved_ratio(self.run, self.roof)

    def track_over_self_attention_of_the_same_flops(self, case):
        return interleaved_ratio(self.run, lambda: linattn.linear_attention(*self.same_flops))

    track_over_roof.unit = "x GEMM time"
    track_over_self_attention_of_the_same_flops.unit = "x"


class QueryOverKeysState:
    """A decoder step's cross-attention, H8 D64: its query over the state of 512 encoder keys
    (``linear_attention(q, initial_state=memory)``), timed, and over a self-attention ``step``."""

    params = [1, 8]
    param_names = ["batch"]

    def setup(self, batch):
        q, k, v = inputs((batch, 8, 512, 64))
        self.q = np.ascontiguousarray(q[:, :, :1])
        _, self.memory = linattn.linear_attention(self.q, k, v, return_state=True)
        self.step_args = (q[:, :, 0].copy(), k[:, :, 0].copy(), v[:, :, 0].copy(),
                          linattn.State.zeros((batch, 8), 64, 64))
        self.run = lambda: linattn.linear_attention(self.q, initial_state=self.memory)
        self.run()

    def time_query_over_state(self, batch):
        self.run()

    def track_over_step(self, batch):
        return interleaved_ratio(self.run, lambda: linattn.step(*self.step_args), rounds=7, inner=50)

    track_over_step.unit = "x"


class PaddedBatch:
    """A padded batch's self-attention, B8 H8 N512 D64, sequences of 200-512 tokens (0.74 of the
    padded size): ``lengths=`` and ``query_lengths=`` (padding neither read nor computed) over the
    same call without them; forward and vjp. Near 0.74 when the padding costs nothing."""

    params = ["forward", "vjp"]
    param_names = ["pass"]
    timeout = 300

    def setup(self, which):
        n = 64 if SMOKE else 512
        self.q, self.k, self.v = inputs((8, 8, n, 64))
        lens = np.array([512, 300, 480, 200, 350, 512, 260, 400]) * n // 512
        if which == "forward":
            self.padded = lambda: linattn.linear_attention(self.q, self.k, self.v, lengths=lens, query_lengths=lens)
            self.whole = lambda: linattn.linear_attention(self.q, self.k, self.v)
        else:
            out, vjp = linattn.linear_attention_vjp(self.q, self.k, self.v, lengths=lens, query_lengths=lens)
            _, vjp_whole = linattn.linear_attention_vjp(self.q, self.k, self.v)
            g = np.ones_like(out)
            self.padded, self.whole = (lambda: vjp(g)), (lambda: vjp_whole(g))

    def track_over_unpadded(self, which):
        return interleaved_ratio(self.padded, self.whole)

    track_over_unpadded.unit = "x"
