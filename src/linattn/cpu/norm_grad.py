"""The vjp of ReBased's layer norm (u = gamma n + beta, n = (x - mean) r, r = 1 / sqrt(var + eps), the
variance biased, the sums in float64), in one compiled pass over blocks of rows (threads take blocks): each
row's n and r again, then, from du (the pair map's vjp: cpu/pair_grad.py), dx = s r (dn - mean(dn) -
n mean(dn n)) with dn = gamma du, and gamma's and beta's gradients (the sums of du n and of du over every
row), each thread into a float64 slot of its own (summed after).

In NumPy these were some fifteen passes over (..., N, D) arrays: 5 ms of a 17.9 ms forward and backward
(B1 H8 N2048, ReBased at D = 16, float32).
"""
import math

import numpy as np
from numba import types

from .._jit import array, njit
from .runtime import kernel_section, threads_for
from .schedule import take
from .threaded import ThreadedKernel
from .views import as_contiguous, unowned

#: Rows per work item.
ROWS = 256
#: Values per thread below which fewer threads run (waking one costs more than this much work).
WORK_PER_THREAD = 1 << 16


@njit(helper=True)
def _rows(item, rows):
    """The rows [r0, r1) of work item ``item``."""
    r0 = item * ROWS
    return r0, min(rows, r0 + ROWS)


def _norm_vjp(x, gamma, eps, s, du, dx, dg, db, slots, counter):
    """dx (R, D) from the rows of x (R, D) and du (R, D), and, added into dg[slot] and db[slot] (float64),
    the sums of du n and du over the rows; the slot from ``slots`` (one per thread's worker). Each row's
    n and r are made here, in the pass that uses them."""
    x, gamma, du, dx, dg, db = unowned((x, gamma, du, dx, dg, db))  # (views not counted: the threads share them)
    rows, d = x.shape
    slot = take(slots)
    g, b = dg[slot], db[slot]
    item = take(counter)
    while item * ROWS < rows:
        r0, r1 = _rows(item, rows)
        for t in range(r0, r1):
            xt, dut, dxt = as_contiguous(x[t]), as_contiguous(du[t]), as_contiguous(dx[t])
            total = 0.0
            for a in range(d):
                total += xt[a]
            mean = total / d
            var = 0.0
            for a in range(d):
                c = xt[a] - mean
                var += c * c
            inv = 1.0 / math.sqrt(var / d + eps)
            nt = dxt  # (n in dx's row until dx is written over it)
            m1 = 0.0
            m2 = 0.0
            for a in range(d):
                nt[a] = (xt[a] - mean) * inv
                v = nt[a]  # (n in the dtype, as the forward's u is made)
                dn = dut[a] * gamma[a]
                m1 += dn
                m2 += dn * v
                g[a] += dut[a] * v
                b[a] += dut[a]
            m1 /= d
            m2 /= d
            w = s * inv
            for a in range(d):
                dxt[a] = w * (dut[a] * gamma[a] - m1 - nt[a] * m2)
        item = take(counter)


def _vjp_signature(dt, variant):
    rows, vec = array(dt, 2, readonly=True), array(dt, 1, readonly=True)
    return types.void(rows, vec, types.float64, dt, rows, array(dt, 2), array(types.float64, 2),
                      array(types.float64, 2), array(types.int64, 1))


#: (nthreads, x, gamma, eps, s, du, dx, dg, db, slots): C-contiguous, dg and db (nthreads, D) float64 zeros.
norm_vjp_kernel = ThreadedKernel(_norm_vjp, _vjp_signature)


def _threads(rows, d):
    return threads_for(rows * d, WORK_PER_THREAD)


def norm_vjp(x, du, gamma, eps, scale):
    """(dx, dgamma, dbeta) from the rows of x (..., D) (the norm's inputs, already scaled by ``scale``) and
    the gradient du of u = gamma LN(x) + beta (float32 or float64, x and du of one dtype; gamma (D) of it; eps
    as the forward read it); dx is the gradient of the unscaled inputs."""
    d, dt = x.shape[-1], x.dtype
    x2, du2 = np.ascontiguousarray(x.reshape(-1, d)), np.ascontiguousarray(du.reshape(-1, d), dt)
    rows = x2.shape[0]
    nthreads = _threads(rows, d)  # (1 for no rows)
    dx = np.empty((rows, d), dt)
    dg, db = np.zeros((nthreads, d)), np.zeros((nthreads, d))
    if rows:
        with kernel_section(nthreads):
            norm_vjp_kernel.get(dt, None)(nthreads, x2, np.ascontiguousarray(gamma, dt), float(eps), dt.type(scale),
                                          du2, dx, dg, db, np.zeros(1, np.int64))
    return dx.reshape(x.shape), dg.sum(0).astype(dt), db.sum(0).astype(dt)
