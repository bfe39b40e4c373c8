"""One decoding step for every sequence of a batch: S += phi(k) v^T, Z += phi(k), then read out.

Per head it is one pass over S (vector.state_pass: each element updated once, the output kept in
registers, Z and the normalisation folded in; plain loops for states without unit-stride rows), so
the work is O(D * Dv) and the memory traffic is reading and writing the state once.
"""
import numpy as np
from numba import prange, types

from .._jit import Kernel, array, njit
from .elementwise import map_flat, map_row
from .vector import state_pass
from .views import as_contiguous, head_matrix, head_row


@njit(helper=True)
def _head_loops(Sh, Zh, vrow, qf, kf, orow, eps, normalize, scratch):
    """What ``state_pass`` does, with plain loops for any strides: two rows of S per pass, then
    Zh += phi(k) and the division of orow by phi(q).Zh + eps."""
    d_, dv = Sh.shape
    for e in range(dv):
        orow[e] = 0
    for a in range(0, d_ - 1, 2):  # two rows per pass: half the stores to the output row
        k0, k1, q0, q1 = kf[a], kf[a + 1], qf[a], qf[a + 1]
        r0, r1 = Sh[a], Sh[a + 1]
        for e in range(dv):
            s0 = r0[e] + k0 * vrow[e]
            s1 = r1[e] + k1 * vrow[e]
            r0[e] = s0
            r1[e] = s1
            orow[e] += q0 * s0 + q1 * s1
    if d_ % 2:
        a = d_ - 1
        r0 = Sh[a]
        for e in range(dv):
            s0 = r0[e] + kf[a] * vrow[e]
            r0[e] = s0
            orow[e] += qf[a] * s0
    den = qf[0] - qf[0]  # zero in the compute dtype
    for a in range(d_):
        z = Zh[a] + kf[a]
        Zh[a] = z
        den += qf[a] * z
    if normalize:
        scratch[0] = 1.0 / (den + eps)  # rounded to the compute dtype
        r = scratch[0]
        for e in range(dv):
            orow[e] *= r


def _step(q, k, v, fm, eps, normalize, S, Z, out):
    """q, k: (BH, D) (already mapped when fm is IDENTITY); v: (BH, Dv); S: (BH, D, Dv) and
    Z: (BH, D) updated in place; out: (BH, Dv). Any strides; the caller checked the shapes."""
    bh, d_ = S.shape[0], S.shape[1]
    maps = np.empty((bh, 2, d_), out.dtype)
    scratch = np.empty(bh, out.dtype)
    for h in range(bh):
        for a in range(d_):
            maps[h, 0, a] = q[h, a]
            maps[h, 1, a] = k[h, a]
    map_flat(maps.reshape(bh * 2 * d_), fm, maps.reshape(bh * 2 * d_))
    unit = S.itemsize
    vector = S.strides[2] == unit and Z.strides[1] == unit and v.strides[1] == unit and out.strides[1] == unit
    for h in prange(bh):
        if vector:
            state_pass(S[h], Z[h], v[h], maps[h, 0], maps[h, 1], out[h], S.strides[1] // unit, eps, normalize)
        else:
            _head_loops(S[h], Z[h], v[h], maps[h, 0], maps[h, 1], out[h], eps, normalize, scratch[h:h + 1])
    return 0


def _step_nd(q, k, v, fm, eps, normalize, S, Z, out):
    """The same on arrays with any number of leading dims and any strides along them (the heads of
    a fused QKV projection, say), each row of adjacent elements; heads are indexed in place.

    Checks the shapes and strides itself and returns 1, touching nothing, when they do not fit
    (the caller then takes the validating path, which raises the error or copies); 0 on success.
    """
    lead = q.shape[:-1]
    if (k.shape != q.shape or v.shape[:-1] != lead or S.shape[:-1] != q.shape
            or S.shape[-1] != v.shape[-1] or Z.shape != q.shape or out.shape != v.shape):
        return 1
    d_, dv = S.shape[S.ndim - 2], S.shape[S.ndim - 1]
    isz = S.itemsize
    if d_ == 0 or q.strides[-1] != isz or k.strides[-1] != isz or v.strides[-1] != isz or S.strides[-1] != isz:
        return 1
    if out.strides[-1] != isz or Z.strides[-1] != isz:
        return 1
    bh = q.size // d_
    qf, kf = np.empty(bh * d_, out.dtype), np.empty(bh * d_, out.dtype)
    for h in range(bh):
        map_row(as_contiguous(head_row(q, h)), fm, qf[h * d_:(h + 1) * d_])
        map_row(as_contiguous(head_row(k, h)), fm, kf[h * d_:(h + 1) * d_])
    for h in prange(bh):
        Sh = head_matrix(S, h)
        state_pass(Sh, head_row(Z, h), head_row(v, h), qf[h * d_:(h + 1) * d_], kf[h * d_:(h + 1) * d_],
                   head_row(out, h), Sh.strides[0] // isz, eps, normalize)
    return 0


def _strided_signature(dt, _):
    vec, i64 = array(dt, 2, "A", readonly=True), types.int64
    return types.int64(vec, vec, vec, i64, types.float64, types.boolean, array(dt, 3, "A"),
                      array(dt, 2, "A"), array(dt, 2, "A"))


def _nd_signature(dt, lead_ndim):
    vec, i64 = array(dt, lead_ndim + 1, "A", readonly=True), types.int64
    return types.int64(vec, vec, vec, i64, types.float64, types.boolean, array(dt, lead_ndim + 2, "A"),
                      array(dt, lead_ndim + 1, "A"), array(dt, lead_ndim + 1, "A"))


#: variant: number of leading dims (any strides along them, rows of adjacent elements)
step_nd_serial = Kernel(_step_nd, _nd_signature, parallel=False)
step_nd_parallel = Kernel(_step_nd, _nd_signature, parallel=True)
#: any strides, already flattened to (BH, ...); variant unused
step_strided_serial = Kernel(_step, _strided_signature, parallel=False)
step_strided_parallel = Kernel(_step, _strided_signature, parallel=True)
