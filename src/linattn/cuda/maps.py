"""Feature maps inside the CUDA kernels: phi of row r of a (R, D) device array, one feature at a time,
for every map of linattn.feature_maps (elementwise, scaled, Taylor, ReBased, DPFP, Performer,
Hedgehog, T2R). The kernels compute phi(q) and phi(k) of a chunk into their shared memory with these,
so nothing of shape (..., N, D') is allocated.

The maps are the CPU kernels' (cpu/mapfns.py): a code and the same parameter vector ``fp`` (fp[0] the
input scale, fp[1] = D', then the family's parameters, with the Taylor, ReBased and DPFP tables I, J,
C of the pair products y_f = u[I_f] u[J_f] C_f), computed in float64 like the CUDA kernels. What a
row's features share (ReBased's mean and inverse deviation, Performer's |x|^2 / 2, Hedgehog's largest
|z| and the inverse sum of its exponentials) is ``row_stats``, computed once per row before its
features (``feature``).
"""
import math

import numpy as np
from numba import cuda, float64

from ..cpu import mapfns as M


@cuda.jit(device=True)
def relu(x):
    """max(x, 0) keeping NaN (0 for -inf)."""
    return x if (x > 0 or x != x) else 0.0


@cuda.jit(device=True)
def phi(x, fm):
    """The elementwise feature maps by code (cpu/elementwise.py, cpu/mapfns.py), in float64."""
    if fm == 1:  # elu + 1
        return x + 1.0 if x > 0 else math.exp(x)
    if fm == 2:
        return relu(x)
    if fm == 6:  # squared relu
        r = relu(x)
        return r * r
    if fm == 7:  # gelu: x Phi(x), with erfc (no cancellation on the left)
        return 0.5 * x * math.erfc(-x * 0.7071067811865476)
    if fm == 8 or fm == 9:  # silu, sigmoid: exp of -|x| only
        e = math.exp(-abs(x))
        sig = (1.0 if x >= 0 else e) / (1.0 + e)
        if x != x:
            return x
        return x * sig if fm == 8 else sig
    if fm == 10:  # softplus: max(x, 0) + log(1 + exp(-|x|))
        if x != x:
            return x
        return (x if x > 0 else 0.0) + math.log1p(math.exp(-abs(x)))
    return x


@cuda.jit(device=True)
def _projection(x, r, s, fp, j, d, m):
    """(s x_r) . W[:, j] for W (D, m) at fp[HEAD:]."""
    acc = 0.0
    for a in range(d):
        acc += s * float64(x[r, a]) * fp[M.HEAD + a * m + j]
    return acc


@cuda.jit(device=True)
def _u(x, r, s, fp, i, d, code, st0, st1):
    """Element i of the pair maps' vector u: [s x, 1] (Taylor), gamma LN(s x) + beta (ReBased),
    [relu(s x), relu(-s x)] (DPFP)."""
    if code == M.TAYLOR:
        return s * float64(x[r, i]) if i < d else 1.0
    if code == M.REBASED:
        return (s * float64(x[r, i]) - st0) * st1 * fp[M.HEAD + 1 + i] + fp[M.HEAD + 1 + d + i]
    if i < d:
        return relu(s * float64(x[r, i]))
    return relu(-s * float64(x[r, i - d]))


@cuda.jit(device=True)
def has_stats(code):
    """Whether a row's features share statistics (``row_stats``)."""
    return code == M.REBASED or code == M.PERFORMER or code == M.HEDGEHOG


@cuda.jit(device=True)
def row_stats(x, r, fp, code, d, dk):
    """(st0, st1) of row r: ReBased's mean and inverse deviation, Performer's |s x|^2 / 2, Hedgehog's
    largest |z| and the inverse sum of its softmax's exponentials; (0, 0) for the other maps."""
    s = fp[0]
    st0, st1 = 0.0, 0.0
    if code == M.REBASED:
        for a in range(d):
            st0 += s * float64(x[r, a])
        st0 /= d
        var = 0.0
        for a in range(d):
            var += (s * float64(x[r, a]) - st0) ** 2
        st1 = 1.0 / math.sqrt(var / d + fp[M.HEAD])
    elif code == M.PERFORMER:
        for a in range(d):
            st0 += (s * float64(x[r, a])) ** 2
        st0 *= 0.5
    elif code == M.HEDGEHOG:  # softmax over [2z, -2z], shifted by 2 max |z|
        m = dk // 2
        for j in range(m):
            st0 = max(st0, abs(_projection(x, r, s, fp, j, d, m) + fp[M.HEAD + d * m + j]))
        total = 0.0
        for j in range(m):
            z = _projection(x, r, s, fp, j, d, m) + fp[M.HEAD + d * m + j]
            total += math.exp(2.0 * z - 2.0 * st0) + math.exp(-2.0 * z - 2.0 * st0)
        st1 = 1.0 / total
    return st0, st1


@cuda.jit(device=True)
def feature(x, r, fp, code, f, d, dk, st0, st1):
    """Feature f of row r of x (R, D) under map ``code`` (D' = dk features), in float64, from the row's
    ``row_stats``."""
    s = fp[0]
    if code < M.SQUARED_RELU:  # identity, elu + 1, relu, and the same of a scaled input
        return phi(s * float64(x[r, f]), code - M.SCALED_IDENTITY if code >= M.SCALED_IDENTITY else code)
    if code < M.TAYLOR:  # the other elementwise maps
        return phi(s * float64(x[r, f]), code)
    if code == M.TAYLOR or code == M.REBASED or code == M.DPFP:
        off = M.HEAD + 1 + 2 * d if code == M.REBASED else M.HEAD
        i, j = int(fp[off + f]), int(fp[off + dk + f])
        return _u(x, r, s, fp, i, d, code, st0, st1) * _u(x, r, s, fp, j, d, code, st0, st1) * fp[off + 2 * dk + f]
    if code == M.PERFORMER:
        return math.exp(_projection(x, r, s, fp, f, d, dk) - st0) / math.sqrt(dk)
    if code == M.HEDGEHOG:
        m = dk // 2
        j = f % m
        z = _projection(x, r, s, fp, j, d, m) + fp[M.HEAD + d * m + j]
        return math.exp((2.0 if f < m else -2.0) * z - 2.0 * st0) * st1
    return relu(_projection(x, r, s, fp, f, d, dk) + fp[M.HEAD + d * dk + f])  # T2R


def device_map(feature_map, d):
    """``(code, fp, D')`` of a map for the CUDA kernels, ``fp`` a host float64 vector; a callable is a
    TypeError (it maps host arrays)."""
    from ..feature_maps import resolve_for_device

    fmap = resolve_for_device(feature_map)
    return fmap.kernel_code(), np.asarray(fmap.params(d, np.float64)), fmap.out_dim(d)
