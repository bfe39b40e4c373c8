"""The speed targets of the "speed where users run it" work, each as a ratio measured in one process
(``track_``: the dashboard shows a regression as the ratio rising), plus the tiny call's time."""
import time

import numpy as np

import linattn

from .common import SMOKE, gemm_pair, inputs, interleaved_ratio


class AfterNumpyMatmul:
    """Causal forward right after a NumPy matmul (a model's QKV projection) over the same call alone
    (target <= 1.15): NumPy's OpenBLAS used to leave threads spinning on the kernel's cores. The
    same-FLOP GEMM pair's own ratio, measured the same way, says what the machine takes from any
    call that follows other work."""

    params = ["B1 H8 N2048", "B1 H1 N16384"]
    param_names = ["case"]
    timeout = 300

    def setup(self, case):
        shape = {"B1 H8 N2048": (1, 8, 2048, 64), "B1 H1 N16384": (1, 1, 16384, 64)}[case]
        if SMOKE:
            shape = shape[:2] + (256,) + shape[3:]
        self.q, self.k, self.v = inputs(shape)
        rng = np.random.default_rng(1)
        rows = 256 if SMOKE else 2048
        self.x = rng.standard_normal((rows, 512)).astype(np.float32)
        self.w = rng.standard_normal((512, 1536)).astype(np.float32)
        self.roof = gemm_pair(shape)
        self._call()

    def _call(self):
        linattn.causal_linear_attention(self.q, self.k, self.v)

    @staticmethod
    def _after(before, call):
        """Median time of ``call()`` right after ``before()``."""
        times = []
        for _ in range(15):
            before()
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    def _ratio_after_matmul(self, call):
        time.sleep(0.3)  # no BLAS thread of an earlier call may still be spinning
        by_itself = self._after(lambda: None, call)
        return self._after(lambda: self.x @ self.w, call) / by_itself

    def track_ratio_after_matmul(self, case):
        return self._ratio_after_matmul(self._call)

    track_ratio_after_matmul.unit = "x alone"

    def track_roof_ratio_after_matmul(self, case):
        """The GEMM pair of the same FLOPs (NumPy's BLAS) right after the matmul over itself alone."""
        return self._ratio_after_matmul(self.roof)

    track_roof_ratio_after_matmul.unit = "x alone"

    def track_ratio_after_matmul_over_cold_caches(self, case):
        """The same over the call after a single-threaded copy of 48 MB (no BLAS): the matmul's own
        effect (its threads) apart from what any work before the call costs it. On a Xeon VM, 3 ms of a
        Python loop, a sleep or the copy before the call cost it as much as the matmul, and reading its
        inputs right after the matmul did not win that back: the call alone runs back to back."""
        src = np.ones(12 << 20, np.float32)
        dst = np.empty_like(src)
        time.sleep(0.3)
        cold = self._after(lambda: np.copyto(dst, src), self._call)
        return self._after(lambda: self.x @ self.w, self._call) / cold

    track_ratio_after_matmul_over_cold_caches.unit = "x cold caches"


class StepOut:
    """step(..., out=buf) over step(...) (target <= 1)."""

    params = [1, 32]
    param_names = ["batch"]

    def setup(self, batch):
        rng = np.random.default_rng(0)
        self.q, self.k, self.v = ((rng.standard_normal((batch, 8, 64)) * 0.5).astype(np.float32) for _ in range(3))
        self.state = linattn.State.zeros((batch, 8), 64, 64)
        self.out = np.empty((batch, 8, 64), np.float32)

    def track_out_over_plain(self, batch):
        # (interleaved: timed one after the other, the two read 0.94 and 1.40 in two runs of the same code)
        return interleaved_ratio(lambda: linattn.step(self.q, self.k, self.v, self.state, out=self.out),
                                 lambda: linattn.step(self.q, self.k, self.v, self.state), rounds=15, inner=30)

    track_out_over_plain.unit = "x"


class StepFloat64:
    """step in float64 over float32, B=32 H=8 D=Dv=64 (target <= 3: twice the bytes)."""

    def setup(self):
        rng = np.random.default_rng(0)
        self.args = {}
        for dt in (np.float32, np.float64):
            qkv = [(rng.standard_normal((32, 8, 64)) * 0.5).astype(dt) for _ in range(3)]
            self.args[dt] = qkv + [linattn.State.zeros((32, 8), 64, 64, dt)]

    def track_float64_over_float32(self):
        return interleaved_ratio(lambda: linattn.step(*self.args[np.float64]),
                                 lambda: linattn.step(*self.args[np.float32]), rounds=15, inner=20)

    track_float64_over_float32.unit = "x"


class Tiny:
    """A tiny causal forward, B1 H1 N16 D64 (target <= 12 us): the call on the calling thread alone; and
    the same into ``out=`` (17.8 us while out= took the checked path)."""

    def setup(self):
        self.q, self.k, self.v = inputs((1, 1, 16, 64))
        self.out = np.empty_like(self.v)
        linattn.causal_linear_attention(self.q, self.k, self.v)
        linattn.causal_linear_attention(self.q, self.k, self.v, out=self.out)

    def time_tiny_causal(self):
        linattn.causal_linear_attention(self.q, self.k, self.v)

    def time_tiny_causal_out(self):
        linattn.causal_linear_attention(self.q, self.k, self.v, out=self.out)


class TinyOptions:
    """The tiny call (B1 H8 N16 D64) with a model's options over the same call without them: a decay
    (RetNet's one per head), gates (Mamba-2's per position, GLA's per key dimension) and a scale take the
    plain call's short path (before: 25-37 us at B1 H1 N16 D16, 3.5-5.5x the plain call's 6.7)."""

    params = ["decay per head", "gate", "gate per dim", "scale"]
    param_names = ["option"]

    def setup(self, option):
        self.q, self.k, self.v = inputs((1, 8, 16, 64))
        rng = np.random.default_rng(1)
        self.kw = {"decay per head": dict(decay=1 - 2.0 ** (-5 - np.arange(8)), scale=0.125),
                   "gate": dict(gate=-rng.random((1, 8, 16)).astype(np.float32)),
                   "gate per dim": dict(gate=-rng.random((1, 8, 16, 64)).astype(np.float32) * 0.1),
                   "scale": dict(scale=0.125)}[option]

    def track_over_plain(self, option):
        return interleaved_ratio(lambda: linattn.causal_linear_attention(self.q, self.k, self.v, **self.kw),
                                 lambda: linattn.causal_linear_attention(self.q, self.k, self.v), rounds=15, inner=30)

    track_over_plain.unit = "x"


class TinyNoncausal:
    """A non-causal call of few positions for its features (B1 H8 N16 D64) over the causal call of the same
    shape: its outputs from the scores phi(Q) phi(K)^T V, a quarter of the state's multiply-adds (before
    stop 54, from the state: 1.5x the causal call)."""

    def setup(self):
        self.q, self.k, self.v = inputs((1, 8, 16, 64))
        linattn.linear_attention(self.q, self.k, self.v)
        linattn.causal_linear_attention(self.q, self.k, self.v)

    def track_over_causal(self):
        return interleaved_ratio(lambda: linattn.linear_attention(self.q, self.k, self.v),
                                 lambda: linattn.causal_linear_attention(self.q, self.k, self.v), rounds=15, inner=30)

    track_over_causal.unit = "x causal"


class RoofRatios:
    """Non-causal forward (its two products do exactly the roof's FLOPs; target <= 1.5 in float32,
    <= 2 in float64) and causal float64 (target <= 3) over a same-FLOP GEMM of their dtype."""

    params = ["float32", "float64"]
    param_names = ["dtype"]
    timeout = 300

    def setup(self, dtype):
        shape = (1, 8, 256 if SMOKE else 2048, 64)
        self.q, self.k, self.v = inputs(shape, np.dtype(dtype))
        self.roof = gemm_pair(shape, np.dtype(dtype))

    def track_noncausal_over_roof(self, dtype):
        return interleaved_ratio(lambda: linattn.linear_attention(self.q, self.k, self.v), self.roof)

    def track_causal_over_roof(self, dtype):
        return interleaved_ratio(lambda: linattn.causal_linear_attention(self.q, self.k, self.v), self.roof)

    track_noncausal_over_roof.unit = track_causal_over_roof.unit = "x GEMM time"
