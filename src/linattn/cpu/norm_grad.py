"""ReBased's vjp: its pair map's (cpu/pair_grad.py's C function, the backward kernels' own) and its layer
norm's (u = gamma n + beta, n = (x - mean) r, r = 1 / sqrt(var + eps), the variance biased, the sums in
float64), compiled, threads taking blocks of rows. Per row, from du (the gradient of u), dx = s r (dn -
mean(dn) - n mean(dn n)) with dn = gamma du, and gamma's and beta's gradients (the sums of du n and of du
over every row), each thread into a float64 slot of its own (summed after).

Two kernels: ``norm_vjp`` from du (what the backward kernels give, their pair map's vjp made there), and
``rebased_vjp`` from the features' gradient (ReBased.vjp on its own), which makes each block's du with the
pair map's C function and the norm's vjp from it while the block is in the cache.

In NumPy these were some fifteen passes over (..., N, D) arrays: 5 ms of a 17.9 ms forward and backward
(B1 H8 N2048, ReBased at D = 16, float32).
"""
import math

import numpy as np
from numba import types

from .._jit import array, njit
from . import mapfns
from .buffers import empty
from .elementwise import IDENTITY, load_rows
from .gating import like
from .pair_grad import WORK_PER_THREAD as PAIR_WORK, call_derivative, derivative_address
from .runtime import kernel_section, threads_for
from .schedule import take
from .threaded import ThreadedKernel
from .views import as_contiguous, keep_alive, unit_rows, unowned

#: Rows per work item.
ROWS = 256
#: Values per thread below which fewer threads run (waking one costs more than this much work).
WORK_PER_THREAD = 1 << 16


@njit(helper=True)
def _rows(item, rows):
    """The rows [r0, r1) of work item ``item``."""
    r0 = item * ROWS
    return r0, min(rows, r0 + ROWS)


@njit(helper=True)
def _norm_rows(x, du, dx, r0, r1, off, gamma, eps, s, g, b):
    """dx[t] for the rows t in [r0, r1) of x (unit-stride rows) from du[t - off], gamma's and beta's parts
    added into g and b (float64); each row's n and r made here again."""
    d = x.shape[1]
    for t in range(r0, r1):
        xt, dut, dxt = as_contiguous(x[t]), as_contiguous(du[t - off]), as_contiguous(dx[t])
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


def _norm_vjp(x, du, gamma, eps, s, dx, dg, db, slots, counter):
    """dx (R, D) from the rows of x (R, D) and du (R, D), and, added into dg[slot] and db[slot] (float64),
    the sums of du n and du over the rows; the slot from ``slots`` (one per thread's worker)."""
    x, gamma, du, dx, dg, db = unowned((x, gamma, du, dx, dg, db))  # (views not counted: the threads share them)
    rows = x.shape[0]
    slot = take(slots)
    g, b = dg[slot], db[slot]
    item = take(counter)
    while item * ROWS < rows:
        r0, r1 = _rows(item, rows)
        _norm_rows(x, du, dx, r0, r1, int(0), gamma, eps, s, g, b)  # (int(0): see _jit.njit)
        item = take(counter)


def _rebased_vjp(x, dphi, fp, da, gamma, eps, s, dx, dg, db, slots, counter):
    """``_norm_vjp`` from the features' gradient dphi (R, D') instead of du: each block's du made first by
    the pair map's C function at ``da`` (with the map's parameters ``fp``), as the backward kernels make
    it, so the same bits; x (R, D) holds the scaled inputs."""
    x, dphi, fp, gamma, dx, dg, db = unowned((x, dphi, fp, gamma, dx, dg, db))
    rows, d = x.shape
    owners = (empty((ROWS, d), dx.dtype), empty((ROWS, d), dx.dtype),
              empty(mapfns.work_size(d, dphi.shape[1]), dx.dtype))
    X, DU, work = unowned(owners)  # (X: the block's rows, which the C function turns into u in place)
    one = like(1.0, dx)
    slot = take(slots)
    g, b = dg[slot], db[slot]
    item = take(counter)
    while item * ROWS < rows:
        r0, r1 = _rows(item, rows)
        c = r1 - r0
        load_rows(x, r0, c, int(IDENTITY), X)  # (int(): a run-time value, not a literal: see _jit)
        call_derivative(da, X[:c], dphi[r0:r1], DU[:c], c, mapfns.REBASED, one, one, fp, work)
        _norm_rows(x, DU, dx, r0, r1, r0, gamma, eps, s, g, b)
        item = take(counter)
    keep_alive(owners)


def _tail(dt):
    """The types of the kernels' last arguments: gamma, eps, s, then dx, dg, db, slots."""
    return (array(dt, 1, readonly=True), types.float64, dt, array(dt, 2), array(types.float64, 2),
            array(types.float64, 2), array(types.int64, 1))


def _vjp_signature(dt, variant):
    rows = array(dt, 2, readonly=True)
    return types.void(rows, rows, *_tail(dt))


def _rebased_signature(dt, variant):
    return types.void(array(dt, 2, readonly=True), array(dt, 2, "A", readonly=True), array(dt, 1, readonly=True),
                      types.int64, *_tail(dt))


#: (nthreads, x, du, gamma, eps, s, dx, dg, db, slots): C-contiguous, dg and db (nthreads, D) float64 zeros.
norm_vjp_kernel = ThreadedKernel(_norm_vjp, _vjp_signature)
#: (nthreads, x, dphi, fp, da, gamma, eps, s, dx, dg, db, slots): x and dx C-contiguous, dphi with unit-stride
#: rows, dg and db (nthreads, D) float64 zeros.
rebased_vjp_kernel = ThreadedKernel(_rebased_vjp, _rebased_signature)


def _run(kernel, nthreads, x, gamma, eps, scale, first):
    """(dx, dgamma, dbeta): ``kernel`` run over x's rows (R, D) with the arguments ``first`` after x."""
    (rows, d), dt = x.shape, x.dtype
    dx = np.empty((rows, d), dt)
    dg, db = np.zeros((nthreads, d)), np.zeros((nthreads, d))
    if rows:
        with kernel_section(nthreads):
            kernel.get(dt, None)(nthreads, x, *first, np.ascontiguousarray(gamma, dt), float(eps), dt.type(scale),
                                 dx, dg, db, np.zeros(1, np.int64))
    return dx, dg.sum(0).astype(dt), db.sum(0).astype(dt)


def norm_vjp(x, du, gamma, eps, scale):
    """(dx, dgamma, dbeta) from the rows of x (..., D) (the norm's inputs, already scaled by ``scale``) and
    the gradient du of u = gamma LN(x) + beta (float32 or float64, x and du of one dtype; gamma (D) of it; eps
    as the forward read it); dx is the gradient of the unscaled inputs."""
    d = x.shape[-1]
    x2 = np.ascontiguousarray(x.reshape(-1, d))
    nthreads = threads_for(x2.shape[0] * d, WORK_PER_THREAD)  # (1 for no rows)
    dx, dg, db = _run(norm_vjp_kernel, nthreads, x2, gamma, eps, scale,
                      (np.ascontiguousarray(du.reshape(-1, d), x.dtype),))
    return dx.reshape(x.shape), dg, db


def rebased_vjp(x, dphi, params, gamma, eps, scale):
    """``norm_vjp`` from the gradient dphi (..., D') of ReBased's features instead of du: x (..., D) its
    inputs already scaled by ``scale``, ``params`` the map's (FeatureMap.params in x's dtype, with an input
    scale of 1: x is scaled), the rest as ``norm_vjp``'s."""
    d, dk, dt = x.shape[-1], dphi.shape[-1], x.dtype
    x2, g2 = np.ascontiguousarray(x.reshape(-1, d)), unit_rows(dphi).reshape(-1, dk)
    nthreads = threads_for(x2.shape[0] * dk, PAIR_WORK)
    dx, dg, db = _run(rebased_vjp_kernel, nthreads, x2, gamma, eps, scale,
                      (g2, params, derivative_address(dt)))
    return dx.reshape(x.shape), dg, db
