"""The vector-Jacobian product of the pair maps (Taylor, ReBased, DPFP): features y_f = u[I_f] u[J_f] C_f
of a vector u, so du[I_f] += g_f C_f u[J_f] and du[J_f] += g_f C_f u[I_f], compiled (threads take
blocks of rows). For DPFP and Taylor the kernel also forms u from x (DPFP's [relu(x), relu(-x)], Taylor's
[s x, 1]) and turns du into dx.

Computed transposed, as the forward (mapfns._pairs), PAIR_ROWS rows at a time: u^T and g^T (one row
per element of u, per feature), then per feature two products of contiguous rows added into du^T
(vectors), transposed into du at the end. In NumPy (gathers of u's columns and two products with
one-hot matrices) this took 56-58 ms for each of q and k of a 142 ms forward and backward (B1 H8 N2048,
Taylor at D = 16, float32); compiled 2.5-2.8 ms on two threads, most of it reading g (10 MB).
"""
import numpy as np
from numba import types

from .._jit import array, njit
from .buffers import empty
from .gating import like
from .mapfns import PAIR_ROWS
from .runtime import kernel_section, threads_for
from .schedule import take
from .threaded import ThreadedKernel
from .vector import transpose_rows
from .views import keep_alive, unit_rows, unowned

#: What the rows given as u hold (``pairs_vjp``'s ``form``): u itself; DPFP's x (u = [relu(x), relu(-x)]);
#: Taylor's x (u = [s x, 1]).
PAIRS, DPFP, TAYLOR = 0, 1, 2
#: Rows per work item.
ROWS = 256
#: Features per thread below which fewer threads run (waking one costs more than this much work).
WORK_PER_THREAD = 1 << 16


@njit(helper=True)
def _block(UT, GT, DT, table, coef, nb):
    """DT[:, :nb] = du^T of the block from UT = u^T and GT = g^T (rows of PAIR_ROWS); I, J from
    ``table``, C as ``coef`` (in the compute dtype)."""
    dk = GT.shape[0]
    zero = like(0.0, DT)
    for a in range(DT.shape[0]):
        row = DT[a]
        for t in range(nb):
            row[t] = zero
    for f in range(dk):
        i, j = np.intp(table[f]), np.intp(table[dk + f])
        c = coef[f]
        gt, ui, uj, di, dj = GT[f], UT[i], UT[j], DT[i], DT[j]
        if i == j:  # d(c u_i^2) = 2 c u_i
            for t in range(nb):
                di[t] += (gt[t] * c) * (ui[t] + ui[t])
        else:  # (two loops: each stores to one row, which LLVM checks against the rows it reads)
            for t in range(nb):
                di[t] += (gt[t] * c) * uj[t]
            for t in range(nb):
                dj[t] += (gt[t] * c) * ui[t]


@njit(helper=True)
def _dpfp_input(UT, d, nb):
    """u^T = [relu(x), relu(-x)]^T from x^T in UT's first d rows."""
    zero = like(0.0, UT)
    for a in range(d):
        pos, neg = UT[a], UT[d + a]
        for t in range(nb):
            x = pos[t]
            pos[t] = zero if x <= zero else x  # (NaN stays NaN, as NumPy's maximum)
            neg[t] = zero if x >= zero else -x


@njit(helper=True)
def _taylor_input(UT, d, nb, s):
    """u^T = [s x, 1]^T from x^T in UT's first d rows."""
    one = like(1.0, UT)
    for a in range(d):
        row = UT[a]
        for t in range(nb):
            row[t] = s * row[t]
    last = UT[d]
    for t in range(nb):
        last[t] = one


@njit(helper=True)
def _scale_rows(DT, d, nb, s):
    """DT[:d, :nb] *= s."""
    for a in range(d):
        row = DT[a]
        for t in range(nb):
            row[t] = row[t] * s


@njit(helper=True)
def _dpfp_output(UT, DT, d, nb, s):
    """dx^T (in DT's first d rows) = s (du^T[:d] [x > 0] - du^T[d:] [x < 0]) (x > 0 where relu(x) > 0)."""
    zero, one = like(0.0, DT), like(1.0, DT)
    for a in range(d):
        dpos, dneg, pos, neg = DT[a], DT[d + a], UT[a], UT[d + a]
        for t in range(nb):
            dpos[t] = s * (dpos[t] * (one if pos[t] > zero else zero) - dneg[t] * (one if neg[t] > zero else zero))


def _pairs_vjp(u, g, table, form, s, du, counter):
    """du[r] from u[r] and g[r] (rows of (R, len(u)) and (R, D') arrays, unit column stride; du
    C-contiguous) and table = I, J, C (D' each, float64), ROWS rows per work item taken from
    ``counter`` (threaded.ThreadedKernel). ``form`` DPFP: u holds DPFP's scaled input x instead (D values),
    the kernel forms [relu(x), relu(-x)], and du is the gradient of x times s; TAYLOR: u holds x, the
    kernel forms [s x, 1], du is the gradient of x (times s)."""
    u, g, du, table = unowned((u, g, du, table))  # (views not reference-counted: both threads would count on one)
    rows, dk = u.shape[0], g.shape[1]
    d = u.shape[1]
    nu = 2 * d if form == DPFP else d + 1 if form == TAYLOR else d
    coefs = empty(dk, du.dtype)
    coef = unowned(coefs)
    for f in range(dk):
        coef[f] = table[2 * dk + f]
    owners = (empty((nu, PAIR_ROWS), du.dtype), empty((dk, PAIR_ROWS), du.dtype), empty((nu, PAIR_ROWS), du.dtype),
              empty(max(nu, dk, PAIR_ROWS), du.dtype))
    UT, GT, DT, colsum = unowned(owners)  # (colsum: transpose_rows' column sums, unused)
    items = (rows + ROWS - 1) // ROWS
    item = take(counter)
    while item < items:
        end = min(rows, (item + 1) * ROWS)
        for s0 in range(item * ROWS, end, PAIR_ROWS):
            nb = min(PAIR_ROWS, end - s0)
            transpose_rows(u[s0:s0 + nb], UT, colsum, nb)
            if form == DPFP:
                _dpfp_input(UT, d, nb)
            elif form == TAYLOR:
                _taylor_input(UT, d, nb, s)
            transpose_rows(g[s0:s0 + nb], GT, colsum, nb)
            _block(UT, GT, DT, table, coef, nb)
            if form == DPFP:
                _dpfp_output(UT, DT, d, nb, s)
            elif form == TAYLOR:
                _scale_rows(DT, d, nb, s)
            transpose_rows(DT[:d, :nb], du[s0:s0 + nb], colsum, d)
        item = take(counter)
    keep_alive((owners, coefs))


def _signature(dt, variant):
    rows = array(dt, 2, "A", readonly=True)
    return types.void(rows, rows, array(types.float64, 1, readonly=True), types.int64, dt, array(dt, 2))


#: (nthreads, u, g, table, form, s, du): u and g with unit-stride rows, du C-contiguous.
pairs_vjp_kernel = ThreadedKernel(_pairs_vjp, _signature)


def pairs_vjp(u, g, table, form=PAIRS, scale=1.0):
    """du (..., len(u)) for the features f = u[I] u[J] C (``table``: I, J, C concatenated) from their
    gradient g (..., D'): u and g float32 or float64, of the same dtype and leading shape. ``form``
    DPFP: u is DPFP's scaled input x (..., D) and the result dx times ``scale`` (the pairs of [relu(x),
    relu(-x)]); TAYLOR: u is Taylor's input x (..., D), the pairs those of [scale x, 1], the result dx."""
    nu, dk = u.shape[-1], g.shape[-1]
    u2, g2 = unit_rows(u).reshape(-1, nu), unit_rows(g).reshape(-1, dk)
    du = np.empty(u.shape, u.dtype)
    rows = u2.shape[0]
    if rows:
        nthreads = threads_for(rows * dk, WORK_PER_THREAD)
        with kernel_section(nthreads):
            pairs_vjp_kernel.get(du.dtype, None)(nthreads, u2, g2, np.ascontiguousarray(table, np.float64),
                                                 int(form), du.dtype.type(scale), du.reshape(-1, nu))
    return du
