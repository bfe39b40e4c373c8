"""The vector-Jacobian product of the pair maps (Taylor, ReBased, DPFP): features y_f = u[I_f] u[J_f] C_f
of a vector u, so du[I_f] += g_f C_f u[J_f] and du[J_f] += g_f C_f u[I_f], compiled (threads take
blocks of rows). For DPFP and Taylor the kernel also forms u from x (DPFP's [relu(x), relu(-x)], Taylor's
[s x, 1]) and turns du into dx. The same rows' code is a C function too, which the backward kernels call
chunk by chunk (as map_grad's for the elementwise maps): for Taylor and DPFP, and for ReBased, whose u
(gamma LN(s x) + beta) it forms too and whose du it returns (the norm's vjp follows the kernels); ReBased's
own vjp calls it too (cpu/norm_grad.py), so that both give the same bits.

Computed transposed, as the forward (mapfns._pairs), PAIR_ROWS rows at a time: u^T and g^T (one row
per element of u, per feature), then per feature two products of contiguous rows added into du^T
(vectors), transposed into du at the end. In NumPy (gathers of u's columns and two products with
one-hot matrices) this took 56-58 ms for each of q and k of a 142 ms forward and backward (B1 H8 N2048,
Taylor at D = 16, float32); compiled 2.5-2.8 ms on two threads, most of it reading g (10 MB).
"""
import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from .._jit import array, njit
from . import mapfns, symbols
from .buffers import empty
from .gating import like
from .mapfns import HEAD, PAIR_ROWS, rebased_norm
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


@njit(helper=True)
def rows_vjp(u, g, table, coef, form, s, du, UT, GT, DT, colsum):
    """du[r] from u[r] and g[r] for the rows of u and g (unit column stride; du's rows too), PAIR_ROWS at a
    time; I, J from ``table``, C as ``coef``; ``form`` and ``s`` as _pairs_vjp's. Scratch: UT, DT (len(u'),
    PAIR_ROWS) and GT (D', PAIR_ROWS), u' the pairs' vector; colsum (transpose_rows' sums, unused) at least
    max(len(u'), D') values."""
    d = u.shape[1]
    for s0 in range(0, u.shape[0], PAIR_ROWS):
        nb = min(PAIR_ROWS, u.shape[0] - s0)
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


@njit(helper=True)
def _pair_count(form, d):
    """The length of the pairs' vector u for rows of d values in ``form``."""
    return 2 * d if form == DPFP else d + 1 if form == TAYLOR else d


def _pairs_vjp(u, g, table, form, s, du, counter):
    """du[r] from u[r] and g[r] (rows of (R, len(u)) and (R, D') arrays, unit column stride; du
    C-contiguous) and table = I, J, C (D' each, float64), ROWS rows per work item taken from
    ``counter`` (threaded.ThreadedKernel). ``form`` DPFP: u holds DPFP's scaled input x instead (D values),
    the kernel forms [relu(x), relu(-x)], and du is the gradient of x times s; TAYLOR: u holds x, the
    kernel forms [s x, 1], du is the gradient of x (times s)."""
    u, g, du, table = unowned((u, g, du, table))  # (views not counted: both threads would count on one)
    rows, dk = u.shape[0], g.shape[1]
    nu = _pair_count(form, u.shape[1])
    coefs = empty(dk, du.dtype)
    coef = unowned(coefs)
    for f in range(dk):
        coef[f] = table[2 * dk + f]
    owners = (empty((nu, PAIR_ROWS), du.dtype), empty((dk, PAIR_ROWS), du.dtype), empty((nu, PAIR_ROWS), du.dtype),
              empty(max(nu, dk, PAIR_ROWS), du.dtype))
    UT, GT, DT, colsum = unowned(owners)
    items = (rows + ROWS - 1) // ROWS
    item = take(counter)
    while item < items:
        r0, r1 = item * ROWS, min(rows, (item + 1) * ROWS)
        rows_vjp(u[r0:r1], g[r0:r1], table, coef, form, s, du[r0:r1], UT, GT, DT, colsum)
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
    relu(-x)]); TAYLOR: u is Taylor's input x (..., D), the pairs those of [scale x, 1], the result dx.
    (ReBased's vjp: cpu/norm_grad.py.)"""
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


def _derivative_c(x, xrs, r, rrs, o, ors, c, d, code, s, t, fp, nfp, work):
    """The C function of Taylor's, DPFP's and ReBased's vjp in the backward kernels (map_grad's signature):
    o[i, :d] = dx of the row x[i, :d] from dphi = t r[i, :D'] (r scaled in place unless t is 1), for c rows
    (row strides xrs, rrs, ors); for ReBased du instead, the gradient of its u = gamma LN(s x) + beta (its
    norm's vjp follows the kernel: ReBased._vjps_of_u). The map's parameters ``fp`` (nfp values: input
    scale s, D', then ReBased's eps, gamma, beta, then the pairs' I, J, C: as the maps' vjps read them);
    ``work``: mapfns.work_size(d, D') values, which hold the scratch (2 len(u) + D') PAIR_ROWS +
    max(len(u), D', PAIR_ROWS) with len(u) <= 2 d. DPFP's input s x and ReBased's u are formed in x."""
    xm, rm, om, fpa = carray(x, (c, xrs)), carray(r, (c, rrs)), carray(o, (c, ors)), carray(fp, nfp)
    dk = np.intp(fpa[1])
    form = TAYLOR if code == mapfns.TAYLOR else (DPFP if code == mapfns.DPFP else PAIRS)
    nu = _pair_count(form, d)
    if t != 1:  # (1: r is only read, as pairs_vjp's g)
        for i in range(c):
            row = rm[i]
            for f in range(dk):
                row[f] = t * row[f]
    first = HEAD
    if form != TAYLOR:  # (DPFP's u from s x, as DPFP.vjp forms it, and ReBased's: Taylor's scales in rows_vjp)
        for i in range(c):
            row = xm[i]
            for a in range(d):
                row[a] = row[a] * s
    if form == PAIRS:  # ReBased: its u = gamma LN(s x) + beta, with its forward's code
        rebased_norm(xm[:c, :d], fpa)
        first = HEAD + 1 + 2 * d
    table = fpa[first:first + 3 * dk]
    w = carray(work, (2 * nu + dk) * PAIR_ROWS + max(nu, dk, PAIR_ROWS))
    UT = w[:nu * PAIR_ROWS].reshape(nu, PAIR_ROWS)
    GT = w[nu * PAIR_ROWS:(nu + dk) * PAIR_ROWS].reshape(dk, PAIR_ROWS)
    DT = w[(nu + dk) * PAIR_ROWS:(2 * nu + dk) * PAIR_ROWS].reshape(nu, PAIR_ROWS)
    colsum = w[(2 * nu + dk) * PAIR_ROWS:]
    rows_vjp(xm[:, :d], rm[:, :dk], table, table[2 * dk:], form, s, om[:, :d], UT, GT, DT, colsum)


@intrinsic
def call_derivative(typingctx, addr, xm, rm, om, c, code, s, t, fp, work):
    """Call a map derivative's C function (this module's or map_grad's, of derivative_signature) at ``addr``
    for xm[:c], rm[:c], om[:c] (2-D, unit-stride rows), with the map's parameters ``fp`` and scratch ``work``
    (1-D, contiguous). Only callable from Numba code."""
    sig = types.void(addr, xm, rm, om, c, code, s, t, fp, work)

    def codegen(context, builder, sig, args):
        dtype = sig.args[1].dtype
        size = context.get_abi_sizeof(context.get_data_type(dtype))
        intp = context.get_value_type(types.intp)
        xa, ra, oa, fa, wa = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (1, 2, 3, 8, 9))
        xrs, rrs, ors = (builder.sdiv(builder.extract_value(a.strides, 0), ir.Constant(intp, size))
                         for a in (xa, ra, oa))
        values = [xa.data, xrs, ra.data, rrs, oa.data, ors, context.cast(builder, args[4], sig.args[4], types.intp),
                  builder.extract_value(xa.shape, 1), context.cast(builder, args[5], sig.args[5], types.intp),
                  context.cast(builder, args[6], sig.args[6], dtype),
                  context.cast(builder, args[7], sig.args[7], dtype), fa.data, builder.extract_value(fa.shape, 0),
                  wa.data]
        symbols.emit_call_address(builder, context.cast(builder, args[0], sig.args[0], types.intp), values)
        return context.get_dummy_value()

    return sig, codegen


def derivative_signature(dt):
    """The C signature of the backward kernels' map derivatives (this module's and map_grad's)."""
    ptr, i = types.CPointer(dt), types.intp
    return types.void(ptr, i, ptr, i, ptr, i, i, i, i, dt, dt, ptr, i, ptr)


_SYMBOLS = {dt: symbols.define(f"pair_derivative_{dt}", _derivative_c, derivative_signature(dt))
            for dt in (types.float32, types.float64)}


def derivative_address(dtype):
    """The address of the C function above for a NumPy dtype (compiled or loaded on first use)."""
    return symbols.address(_SYMBOLS[numba.from_dtype(np.dtype(dtype))])
