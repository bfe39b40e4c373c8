"""One decoding step for every sequence of a batch: S += phi(k) v^T, Z += phi(k), then read out.

Per head it is one pass over S (update two rows, accumulate phi(q)[a] * row into the output), so the
work is O(D * Dv) and the memory traffic is reading and writing the state once.
"""
import numpy as np
from numba import prange, types

from .._jit import Kernel, array, njit
from .elementwise import ELU, RELU, elu1, relu


@njit(helper=True)
def _map_vector(x, h, fm, dst):
    """dst[:] = phi(x[h, :])."""
    if fm == ELU:
        for a in range(dst.shape[0]):
            dst[a] = elu1(x[h, a])
    elif fm == RELU:
        for a in range(dst.shape[0]):
            dst[a] = relu(x[h, a])
    else:
        for a in range(dst.shape[0]):
            dst[a] = x[h, a]


@njit(helper=True)
def _step_head(q, k, v, h, fm, eps, normalize, S, Z, out, scratch):
    d_, dv = S.shape[1], S.shape[2]
    qf, kf = scratch[0], scratch[1]
    _map_vector(q, h, fm, qf)
    _map_vector(k, h, fm, kf)
    orow, vrow = out[h], v[h]
    for e in range(dv):
        orow[e] = 0
    for a in range(0, d_ - 1, 2):  # two rows per pass: half the stores to the output row
        k0, k1, q0, q1 = kf[a], kf[a + 1], qf[a], qf[a + 1]
        r0, r1 = S[h, a], S[h, a + 1]
        for e in range(dv):
            s0 = r0[e] + k0 * vrow[e]
            s1 = r1[e] + k1 * vrow[e]
            r0[e] = s0
            r1[e] = s1
            orow[e] += q0 * s0 + q1 * s1
    if d_ % 2:
        a = d_ - 1
        r0 = S[h, a]
        for e in range(dv):
            s0 = r0[e] + kf[a] * vrow[e]
            r0[e] = s0
            orow[e] += qf[a] * s0
    for a in range(d_):
        Z[h, a] += kf[a]
    den = qf[0] - qf[0]  # zero in the compute dtype
    for a in range(d_):
        den += qf[a] * Z[h, a]
    if normalize:
        scratch[2, 0] = 1.0 / (den + eps)  # rounded to the compute dtype
        r = scratch[2, 0]
        for e in range(dv):
            orow[e] *= r


def _step(q, k, v, fm, eps, normalize, S, Z, out):
    """q, k: (BH, D) (already mapped when fm is IDENTITY); v: (BH, Dv); S: (BH, D, Dv) and
    Z: (BH, D) updated in place; out: (BH, Dv). Any strides; the caller checked the shapes."""
    scratch = np.empty((S.shape[0], 3, S.shape[1]), out.dtype)  # one allocation per call
    for h in prange(S.shape[0]):
        _step_head(q, k, v, h, fm, eps, normalize, S, Z, out, scratch[h])
    return 0


def _step_nd(q, k, v, fm, eps, normalize, S, Z, out):
    """The same on C-contiguous arrays with any number of leading dims, reshaped here for free.

    Checks the shapes itself and returns 1, touching nothing, when they do not fit (the caller then
    takes the validating path, which raises the error); 0 on success.
    """
    lead = q.shape[:-1]
    if (k.shape != q.shape or v.shape[:-1] != lead or S.shape[:-1] != q.shape
            or S.shape[-1] != v.shape[-1] or Z.shape != q.shape or out.shape != v.shape):
        return 1
    d_, dv = S.shape[S.ndim - 2], S.shape[S.ndim - 1]
    if d_ == 0:
        return 1
    bh = q.size // d_
    q2, k2, v2 = q.reshape((bh, d_)), k.reshape((bh, d_)), v.reshape((bh, dv))
    S3, Z2, out2 = S.reshape((bh, d_, dv)), Z.reshape((bh, d_)), out.reshape((bh, dv))
    scratch = np.empty((bh, 3, d_), out.dtype)  # one allocation per call
    for h in prange(bh):
        _step_head(q2, k2, v2, h, fm, eps, normalize, S3, Z2, out2, scratch[h])
    return 0


def _strided_signature(dt, _):
    vec, i64 = array(dt, 2, "A", readonly=True), types.int64
    return types.int64(vec, vec, vec, i64, types.float64, types.boolean, array(dt, 3, "A"),
                      array(dt, 2, "A"), array(dt, 2, "A"))


def _nd_signature(dt, lead_ndim):
    vec, i64 = array(dt, lead_ndim + 1, "C", readonly=True), types.int64
    return types.int64(vec, vec, vec, i64, types.float64, types.boolean, array(dt, lead_ndim + 2),
                      array(dt, lead_ndim + 1), array(dt, lead_ndim + 1))


#: variant: number of leading dims (C-contiguous arrays, reshaped inside the kernel)
step_nd_serial = Kernel(_step_nd, _nd_signature, parallel=False)
step_nd_parallel = Kernel(_step_nd, _nd_signature, parallel=True)
#: any strides, already flattened to (BH, ...); variant unused
step_strided_serial = Kernel(_step, _strided_signature, parallel=False)
step_strided_parallel = Kernel(_step, _strided_signature, parallel=True)
