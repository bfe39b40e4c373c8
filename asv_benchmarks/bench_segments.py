"""One long causal head cut into segments for many threads: the work of its segments over the unsplit
head's (``track_``), for both ways a segment can start (runtime.plan): after summing its prefix (one
run) and from the parts of the segments before it (two runs, after a first segment that runs whole in
the first run). Items run one after another on one thread, so the time is the sum of their work: a
machine with as many threads as segments takes about 1/nseg of it. The two-run ratio rising means the
split does more work than the cost model assumes. "as they run": the dynamic split (cpu/dynamic.py,
which both kernels take where their plan splits heads) on one thread, a runner alone: what its published
states cost over the unsplit head."""
import numpy as np

import linattn
from linattn import attention, gradients
from linattn.cpu import runtime

from .common import SMOKE, best_of, inputs

SEGMENTS = 8


def _fractions(scheme, cost):
    if scheme == "whole":
        return np.array([0.0, 1.0]), False
    if scheme == "as they run":
        return np.array([0.0, 0.5, 1.0]), True  # (the plan splits: the dynamic split)
    if scheme == "prefix":
        return runtime._segment_fractions(SEGMENTS, True, cost), False
    return runtime._segment_fractions(SEGMENTS + 1, False, cost, True), True  # (SEGMENTS items a run)


class SegmentWork:
    """forward: causal_linear_attention; backward: vjp(dout) of causal_linear_attention_vjp."""

    params = [["forward", "backward"], ["prefix", "two runs", "as they run"]]
    param_names = ["pass", "segments"]
    timeout = 300

    def setup(self, which, scheme):
        shape = (1, 1, 2048 if SMOKE else 16384, 64)
        self.q, self.k, self.v = inputs(shape)
        self.g = inputs(shape, seed=1)[0]
        self.plans = (attention.plan, gradients.plan, attention._causal_parts)

    def teardown(self, which, scheme):
        attention.plan, gradients.plan, attention._causal_parts = self.plans
        gradients._causal_parts = self.plans[2]
        attention._constants.clear()

    def _time(self, which, scheme):
        real_a, real_g, real_parts = self.plans
        f, two = _fractions(scheme, runtime.prefix_cost(*self.q.shape[-1:] * 2))
        fb, twob = _fractions(scheme, runtime.BACKWARD_PREFIX_COST)
        attention._constants.clear()  # (the plain call's cached plans)
        attention.plan = lambda *a, **kw: (real_a(*a, **kw)[0], f, 1, two)
        gradients.plan = lambda *a, **kw: (real_g(*a, **kw)[0], fb, 1, twob)
        # the two runs as planned, not the dynamic split (which the kernels take where a plan splits)
        attention._causal_parts = gradients._causal_parts = real_parts if scheme == "as they run" else (
            lambda two_runs, bh, n, chunk, frac, dk, dv, nthreads: attention._parts(two_runs, bh, frac, dk, dv, True))
        if which == "forward":
            return best_of(lambda: linattn.causal_linear_attention(self.q, self.k, self.v), 7)
        _, vjp = linattn.causal_linear_attention_vjp(self.q, self.k, self.v)
        return best_of(lambda: vjp(self.g), 7)

    def track_work_over_unsplit(self, which, scheme):
        whole = self._time(which, "whole")
        return self._time(which, scheme) / whole

    track_work_over_unsplit.unit = "x the unsplit head's time (one thread)"
