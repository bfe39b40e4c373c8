"""The elementwise feature maps' vector-Jacobian products, dx = dphi phi'(s x) s, in one compiled pass
(threads take blocks of rows) with the forward's vectorising exp and erf.

The maps by their cpu/mapfns.py codes (u = s x; the scaled variants and the plain elu+1, relu and
identity alike): elu+1: 1 for u > 0, else e^u; relu: [u > 0]; identity: 1; squared relu: 2 relu(u);
gelu: Phi(u) + u exp(-u^2 / 2) / sqrt(2 pi); silu: sig(u) (1 + u (1 - sig(u))); sigmoid:
sig(u) (1 - sig(u)); softplus: sig(u). NaN in x gives NaN (relu's: 0, as [u > 0]). In NumPy this was
6-10 passes over (..., N, D): 30-50 ms of a 45-60 ms backward at B1 H8 N2048 D64 float32.
"""
from numba import types

from .._jit import array, njit
from .elementwise import ELU, IDENTITY, RELU, exp_le0, relu
from .gating import like
from .mapfns import (GELU, SCALED_ELU, SCALED_IDENTITY, SCALED_RELU, SIGMOID, SILU, SOFTPLUS, SQUARED_RELU,
                     normal_cdf)
from .runtime import kernel_section, threads_for
from .schedule import take
from .threaded import ThreadedKernel
from .vector import wide_vectors
from .views import as_contiguous, unit_rows, unowned

#: Rows per work item.
ROWS = 256
#: Values per thread below which fewer threads run (waking one costs more than this much work).
WORK_PER_THREAD = 1 << 15


@njit(helper=True)
def _sigmoid(u, one):
    e = exp_le0(-abs(u))  # sig(u) = 1 / (1 + e) for u >= 0, e / (1 + e) below
    return (one if u >= 0 else e) / (one + e)


@njit(helper=True)
def _row(x, g, code, s, out):
    """out = g * phi'(s x) * s for one row (unit stride)."""
    wide_vectors()
    one = like(1.0, out)
    zero = one - one
    d = x.shape[0]
    if code == ELU or code == SCALED_ELU:
        for a in range(d):
            u = s * x[a]
            f = one if u > zero else exp_le0(u)
            out[a] = g[a] * (f if u == u else u) * s
    elif code == RELU or code == SCALED_RELU:
        for a in range(d):
            out[a] = g[a] * (s if s * x[a] > zero else zero)
    elif code == IDENTITY or code == SCALED_IDENTITY:
        for a in range(d):
            out[a] = g[a] * s
    elif code == SQUARED_RELU:
        for a in range(d):
            out[a] = g[a] * (relu(s * x[a]) * (s + s))
    elif code == GELU:
        c = like(0.3989422804014327, out)  # 1 / sqrt(2 pi)
        half = like(-0.5, out)
        for a in range(d):
            u = s * x[a]
            f = normal_cdf(u) + u * exp_le0(half * u * u) * c
            out[a] = g[a] * (f if u == u else u) * s
    elif code == SILU:
        for a in range(d):
            u = s * x[a]
            sig = _sigmoid(u, one)
            f = sig * (one + u * (one - sig))
            out[a] = g[a] * (f if u == u else u) * s
    elif code == SIGMOID:
        for a in range(d):
            u = s * x[a]
            sig = _sigmoid(u, one)
            out[a] = g[a] * (sig * (one - sig) if u == u else u) * s
    elif code == SOFTPLUS:
        for a in range(d):
            u = s * x[a]
            out[a] = g[a] * (_sigmoid(u, one) if u == u else u) * s


def _elementwise_vjp(x, g, code, s, out, counter):
    """out[r] = g[r] * phi'(s x[r]) * s for the rows r of (R, D) arrays (``out`` may be ``g``), ROWS
    rows per work item taken from ``counter`` (threaded.ThreadedKernel)."""
    x, g, out = unowned((x, g, out))  # (row views not reference-counted: both threads would count on one)
    rows = x.shape[0]
    items = (rows + ROWS - 1) // ROWS
    item = take(counter)
    while item < items:
        for r in range(item * ROWS, min(rows, (item + 1) * ROWS)):
            _row(as_contiguous(x[r]), as_contiguous(g[r]), code, s, out[r])
        item = take(counter)


def _signature(dt, variant):
    rows = array(dt, 2, "A", readonly=True)
    return types.void(rows, rows, types.int64, dt, array(dt, 2))


#: (nthreads, x, dphi, code, s, out): x and dphi with unit-stride rows, out C-contiguous. (Threaded: a
#: prange cost ~2 s more of the first call's compilation; one thread alone takes about twice as long.)
elementwise_vjp = ThreadedKernel(_elementwise_vjp, _signature)


def times_derivative(x, dphi, code, scale, out):
    """out = dphi * phi'(scale x) * scale for (..., D) arrays of the same shape: x and dphi in out's dtype,
    out C-contiguous (it may be dphi itself)."""
    d = x.shape[-1]
    x2, g2 = (unit_rows(a).reshape(-1, d) for a in (x, dphi))
    nthreads = threads_for(x2.shape[0] * d, WORK_PER_THREAD)
    if x2.shape[0]:
        with kernel_section(nthreads):
            elementwise_vjp.get(out.dtype, None)(nthreads, x2, g2, code, out.dtype.type(scale), out.reshape(-1, d))
    return out
