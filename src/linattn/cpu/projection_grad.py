"""The gradients of the maps through a (D, m) matrix (Performer, Hedgehog, T2R) in one compiled pass over
blocks of rows: dz (the gradient of z = u W + b, u = s x) from dphi and phi, then dx = s dz W^T and the
parameters' gradients s x^T dz and the column sums of dz; threads take blocks of rows, each adds its
parameters' gradients into a slot of its own (summed after).

dz by map (y = phi(x)): T2R dphi [y > 0]; Hedgehog, through the softmax over [2z, -2z],
g = y (dphi - y . dphi), dz = 2 (g[:m] - g[m:]); Performer (phi = exp(z - |u|^2 / 2) / sqrt(m)) t = dphi y,
dz = t, and dx gets -s u sum(t) too. In NumPy these were 6-8 passes over (..., N, D') arrays beside the
two products (T2R's dx alone 3.1 ms at B1 H8 N2048 float32, against 1.6 ms for its product alone).
"""
import numpy as np
from numba import types

from .._jit import array, njit
from .buffers import empty
from .gating import like
from .mapfns import HEDGEHOG, PERFORMER
from .runtime import kernel_section, threads_for
from .schedule import take
from .smallgemm import small_gemm, small_gemm_tn
from .threaded import ThreadedKernel
from .views import as_contiguous, keep_alive, unit_rows, unowned

#: Rows per work item.
ROWS = 64
#: Multiply-adds per thread below which fewer threads run.
WORK_PER_THREAD = 1 << 21
#: Multiply-adds from which a second thread runs (each row's exp or softmax costs more than its
#: multiply-adds): measured on the 2-core Zen 4 (stop 55), Hedgehog D16 m8 on 1024 / 4096 / 16384 rows
#: 32 / 97 / 345 us on one thread, 25 / 72 / 205 on two; on 256 rows 16.4 either way.
SECOND_THREAD_WORK = 1 << 17


@njit(helper=True)
def _dz(code, g, y, dz, tsum):
    """dz[t] for the rows of g = dphi and y = phi (tsum[t]: Performer's sum of dz[t])."""
    m = dz.shape[1]
    zero, one, two = like(0.0, dz), like(1.0, dz), like(2.0, dz)
    for t in range(dz.shape[0]):
        gt, yt, zt = as_contiguous(g[t]), as_contiguous(y[t]), as_contiguous(dz[t])
        if code == PERFORMER:
            for j in range(m):
                zt[j] = gt[j] * yt[j]
            total = 0.0
            for j in range(m):
                total += zt[j]
            tsum[t] = total
        elif code == HEDGEHOG:
            dot = 0.0
            for j in range(2 * m):
                dot += yt[j] * gt[j]
            c = like(dot, dz)
            for j in range(m):
                zt[j] = two * (yt[j] * (gt[j] - c) - yt[m + j] * (gt[m + j] - c))
        else:  # T2R
            for j in range(m):
                zt[j] = gt[j] * (one if yt[j] > zero else zero)  # (NaN in dphi stays NaN, as in NumPy)


def _projection_vjp(x, g, y, wt, code, s, dx, dw, db, slots, counter):
    """dx (R, D) and, added into dw[slot] (D, m) and db[slot] (m) (float64), x^T dz and the sums of dz, for the
    rows of x (R, D), g = dphi and y = phi (R, D'), wt = W^T (m, D); ROWS rows per work item taken from
    ``counter``, the slot from ``slots`` (one per thread's worker)."""
    # views not reference-counted: both threads would count on one
    x, g, y, dx, wt, dw, db = unowned((x, g, y, dx, wt, dw, db))
    rows, d, m = x.shape[0], x.shape[1], wt.shape[0]
    slot = take(slots)
    dwp, dbp = dw[slot], db[slot]
    owners = (empty((ROWS, m), dx.dtype), empty(ROWS, dx.dtype), empty((d, m), dx.dtype))
    DZ, tsum, WB = unowned(owners)
    items = (rows + ROWS - 1) // ROWS
    item = take(counter)
    while item < items:
        r0 = item * ROWS
        nb = min(ROWS, rows - r0)
        dz, xb, dxb = DZ[:nb], x[r0:r0 + nb], dx[r0:r0 + nb]
        _dz(code, g[r0:r0 + nb], y[r0:r0 + nb], dz, tsum)
        small_gemm(dz, wt, dxb, False, -1, -1)
        for t in range(nb):
            row, xr = as_contiguous(dxb[t]), as_contiguous(xb[t])
            c = s * s * tsum[t] if code == PERFORMER else s - s  # (Performer: - s u sum(t), u = s x)
            for a in range(d):
                row[a] = s * row[a] - c * xr[a]
        small_gemm_tn(xb, dz, WB, False)  # (the sums over the blocks in float64)
        for a in range(d):
            wa, pa = as_contiguous(WB[a]), as_contiguous(dwp[a])
            for j in range(m):
                pa[j] += wa[j]
        for t in range(nb):
            zt = as_contiguous(dz[t])
            for j in range(m):
                dbp[j] += zt[j]
        item = take(counter)
    keep_alive(owners)


def _signature(dt, variant):
    rows = array(dt, 2, "A", readonly=True)
    return types.void(rows, rows, rows, array(dt, 2, readonly=True), types.int64, dt, array(dt, 2),
                      array(types.float64, 3), array(types.float64, 2), array(types.int64, 1))


#: (nthreads, x, dphi, phi, W^T, code, s, dx, dw, db, slots): x, dphi and phi with unit-stride rows,
#: W^T, dx, dw (nthreads, D, m) and db (nthreads, m) C-contiguous, dw and db float64 zeros, slots [0].
projection_vjp_kernel = ThreadedKernel(_projection_vjp, _signature)


def projection_vjp(code, x, dphi, y, weight, scale):
    """(dx, dW, db) of a map through ``weight`` (D, m) (mapfns code PERFORMER, HEDGEHOG or T2R) with input
    scale ``scale``, from x (..., D), dphi and y = phi(x) (..., D'): all float32 or all float64."""
    d, dk = x.shape[-1], dphi.shape[-1]
    dt = dphi.dtype
    x2, g2, y2 = unit_rows(x).reshape(-1, d), unit_rows(dphi).reshape(-1, dk), unit_rows(y).reshape(-1, dk)
    m = weight.shape[1]
    rows = x2.shape[0]
    nthreads = threads_for(rows * d * m, WORK_PER_THREAD, SECOND_THREAD_WORK)
    dx = np.empty(x.shape, dt)
    dw, db = np.zeros((nthreads, d, m)), np.zeros((nthreads, m))  # (float64: sums over every row)
    if rows:
        with kernel_section(nthreads):
            projection_vjp_kernel.get(dt, None)(nthreads, x2, g2, y2, np.ascontiguousarray(weight.T, dt), code,
                                                dt.type(scale), dx.reshape(-1, d), dw, db, np.zeros(1, np.int64))
    return dx, (dw.sum(0) * scale).astype(dt), db.sum(0).astype(dt)
