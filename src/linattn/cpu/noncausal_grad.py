"""The elementwise work of the non-causal vjp, one pass per head (parallel over heads): phi(q), phi(k)
(elu + 1, relu, identity; the other maps' features, computed before, are copied as by identity), the
denominators from phi(k)'s sum, the output adjoints [a | b] and the values with a ones column; then
phi' applied to the gradients of phi(q), phi(k) in place (elu + 1, relu). The
products between them are linear_attention calls (gradients.linear_attention_vjp). In NumPy this
was ~10 passes over (..., N, D) arrays and fresh temporaries; here q, k, v, dout and out are each read
once (phi(k) twice), the results written once.
"""
import numpy as np
from numba import prange, types

from .._jit import Kernel, array
from .backward import _load_adjoints, _load_values
from .elementwise import ELU, RELU, map_row
from .views import as_contiguous


def _adjoints(q, k, v, g, out, fm, s, eps, normalize, qf, kf, ab, v1):
    """Per head h of (BH, N, X) arrays with unit-stride rows: qf = phi(q), kf = phi(k), v1 = [v, 1] and
    ab = [g / den, -(g . out) / den] with den = s phi(q) . sum(phi(k)) + eps (the forward's
    denominators; its sum in float64), or [g, 0] without normalisation."""
    bh, n, d = q.shape
    for h in prange(bh):
        z = np.zeros(d)
        for t in range(n):
            row = kf[h, t]
            map_row(as_contiguous(k[h, t]), fm, row)
            for a in range(d):
                z[a] += row[a]
        zc = z.astype(qf.dtype)
        den = np.ones(n, qf.dtype)  # (not read without normalisation)
        for t in range(n):
            qrow = qf[h, t]
            map_row(as_contiguous(q[h, t]), fm, qrow)
            if normalize:
                acc = qrow[0] - qrow[0]
                for a in range(d):
                    acc += qrow[a] * zc[a]
                den[t] = s * acc + eps
        _load_adjoints(g[h], out[h], den, 0, n, normalize, ab[h])
        _load_values(v[h], int(0), n, v1[h])  # bool()/int(): run-time values, not literals (see _jit)


def _adjoints_signature(dt, variant):
    seq = array(dt, 3, "A", readonly=True)
    return types.void(seq, seq, seq, seq, seq, types.int64, dt, dt, types.boolean, array(dt, 3), array(dt, 3),
                      array(dt, 3), array(dt, 3))


def _times_derivative(dx, y, fm):
    """dx *= phi'(x) from y = phi(x) (BH, N, D), C-contiguous: elu + 1's is min(y, 1), relu's y > 0
    (identity: nothing to do)."""
    flat_dx, flat_y = dx.reshape(-1), y.reshape(-1)
    m = flat_dx.shape[0]
    step = 16384
    for b in prange((m + step - 1) // step):
        i1 = min(m, (b + 1) * step)
        if fm == ELU:  # (NaN stays NaN)
            for i in range(b * step, i1):
                yi = flat_y[i]
                flat_dx[i] *= yi if not yi > 1 else 1
        elif fm == RELU:  # (an inf gradient times 0: NaN, as in NumPy)
            for i in range(b * step, i1):
                flat_dx[i] *= 1 if flat_y[i] > 0 else 0


def _derivative_signature(dt, variant):
    return types.void(array(dt, 3), array(dt, 3, "C", readonly=True), types.int64)


adjoints = Kernel(_adjoints, _adjoints_signature)
times_derivative = Kernel(_times_derivative, _derivative_signature)
#: the same on the calling thread alone (runtime.num_threads() == 1: a forked child of a GNU OpenMP pool
#: must not enter a parallel region)
adjoints_serial = Kernel(_adjoints, _adjoints_signature, parallel=False)
times_derivative_serial = Kernel(_times_derivative, _derivative_signature, parallel=False)
