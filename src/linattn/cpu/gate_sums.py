"""The log gates' gradients from the backward kernel's per-position terms: one reverse running sum per
head, in float64, written once in the gradient's dtype.

With lam_t the log factor of position t (per key dimension j, or one per position), the backward
kernel leaves rq_t - rk_t = qf_t dqf_t - kf_t dkf_t per position (and dimension), and d lam_t =
sum_{t <= i < length} (rq_i - rk_i) + R, R = <dS_end, S_end> + <dZ_end, Z_end> (per row j of the final
state with a gate per key dimension). NumPy's ``cumsum`` along the positions took ~7 ns per value
(one strided scalar accumulation per column: 7-10 ms of a 24 ms backward at B1 H8 N2048 D64); this
loop takes whole rows as vectors (1.0-1.3 ms there).
"""
import numpy as np
from numba import types

from .._jit import Kernel, array
from .buffers import empty


def _reverse_sums(rq, rk, rows, lengths, dlam, totals):
    """dlam[h, t] = sum over t <= i < lengths[h] of (rq[h, i] - rk[h, i]), plus rows[h], for t <
    lengths[h], and 0 past it; totals[h] = the sum of dlam[h] over positions and columns (float64).

    rq, rk: (BH, N, W) float64; rows: (BH, W) float64; dlam: (BH, N, W) in the gradient's dtype.
    Two passes forward in time: the sum over all positions, then the running sum taken off it (a loop
    backwards in time took 3-5x as long here: rows read in descending order).
    """
    bh, n, w = rq.shape
    acc = empty(w, np.float64)
    for h in range(bh):
        length = lengths[h]
        out = dlam[h]
        for j in range(w):
            acc[j] = rows[h, j]
        for t in range(length):
            a, b = rq[h, t], rk[h, t]
            for j in range(w):
                acc[j] += a[j] - b[j]
        total = 0.0
        for t in range(length):  # acc = rows[h] + the sum over i >= t
            a, b, o = rq[h, t], rk[h, t], out[t]
            for j in range(w):
                o[j] = acc[j]
            for j in range(w):
                total += acc[j]
            for j in range(w):
                acc[j] -= a[j] - b[j]
        for t in range(length, n):
            for j in range(w):
                out[t, j] = 0
        totals[h] = total


def _signature(dt, variant):
    f64 = types.float64
    terms = array(f64, 3, "C", readonly=True)
    return types.void(terms, terms, array(f64, 2, "C", readonly=True), array(types.int64, 1, "C", readonly=True),
                      array(dt, 3, "C"), array(f64, 1, "C"))


reverse_sums = Kernel(_reverse_sums, _signature, parallel=False)
