"""Feature maps on CUDA device arrays that the sequence kernels do not apply themselves (Taylor,
ReBased, DPFP, Performer, Hedgehog, T2R and scaled maps): phi of every row of a (R, D) device array
into a new (R, D') one, which the kernels then read with the identity map.

The maps are the CPU kernels' (cpu/mapfns.py): a code and the same parameter vector ``fp`` (fp[0] the
input scale, fp[1] = D', then the family's parameters, with the Taylor, ReBased and DPFP tables I, J,
C of the pair products y_f = u[I_f] u[J_f] C_f), computed in float64 like the CUDA kernels. One block
per row: its first thread computes what the row's features share (ReBased's mean and inverse
deviation, Performer's |x|^2 / 2, Hedgehog's largest |z| and the sum of its exponentials), then the
block's threads compute one feature each.
"""
import math

import numpy as np
from numba import cuda, float64

from ..cpu import mapfns as M
from .kernels import phi, relu

_THREADS = 64


@cuda.jit(device=True)
def _projection(x, r, s, fp, j, d, m):
    """(s x_r) . W[:, j] for W (D, m) at fp[HEAD:]."""
    acc = 0.0
    for a in range(d):
        acc += s * float64(x[r, a]) * fp[M.HEAD + a * m + j]
    return acc


@cuda.jit(device=True)
def _u(x, r, s, fp, i, d, code, stats):
    """Element i of the pair maps' vector u: [s x, 1] (Taylor), gamma LN(s x) + beta (ReBased),
    [relu(s x), relu(-s x)] (DPFP)."""
    if code == M.TAYLOR:
        return s * float64(x[r, i]) if i < d else 1.0
    if code == M.REBASED:
        return (s * float64(x[r, i]) - stats[0]) * stats[1] * fp[M.HEAD + 1 + i] + fp[M.HEAD + 1 + d + i]
    if i < d:
        return relu(s * float64(x[r, i]))
    return relu(-s * float64(x[r, i - d]))


@cuda.jit
def _map_rows(x, fp, code, y):
    r = cuda.blockIdx.x
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    d, dk = x.shape[1], y.shape[1]
    s = fp[0]
    stats = cuda.shared.array(2, float64)
    if tid == 0:
        if code == M.REBASED:
            mean = 0.0
            for a in range(d):
                mean += s * float64(x[r, a])
            mean /= d
            var = 0.0
            for a in range(d):
                var += (s * float64(x[r, a]) - mean) ** 2
            stats[0] = mean
            stats[1] = 1.0 / math.sqrt(var / d + fp[M.HEAD])
        elif code == M.PERFORMER:
            half = 0.0
            for a in range(d):
                half += (s * float64(x[r, a])) ** 2
            stats[0] = 0.5 * half
        elif code == M.HEDGEHOG:  # softmax over [2z, -2z], shifted by 2 max |z|
            m = dk // 2
            top = 0.0
            for j in range(m):
                top = max(top, abs(_projection(x, r, s, fp, j, d, m) + fp[M.HEAD + d * m + j]))
            total = 0.0
            for j in range(m):
                z = _projection(x, r, s, fp, j, d, m) + fp[M.HEAD + d * m + j]
                total += math.exp(2.0 * z - 2.0 * top) + math.exp(-2.0 * z - 2.0 * top)
            stats[0] = top
            stats[1] = 1.0 / total
    cuda.syncthreads()
    for f in range(tid, dk, nt):
        if code < M.SQUARED_RELU:  # identity, elu + 1, relu of a scaled input
            val = phi(s * float64(x[r, f]), code - M.SCALED_IDENTITY)
        elif code < M.TAYLOR:  # the other elementwise maps (the kernels' codes)
            val = phi(s * float64(x[r, f]), code)
        elif code == M.TAYLOR or code == M.REBASED or code == M.DPFP:
            off = M.HEAD + 1 + 2 * d if code == M.REBASED else M.HEAD
            i, j = int(fp[off + f]), int(fp[off + dk + f])
            val = _u(x, r, s, fp, i, d, code, stats) * _u(x, r, s, fp, j, d, code, stats) * fp[off + 2 * dk + f]
        elif code == M.PERFORMER:
            val = math.exp(_projection(x, r, s, fp, f, d, dk) - stats[0]) / math.sqrt(dk)
        elif code == M.HEDGEHOG:
            m = dk // 2
            j = f % m
            z = _projection(x, r, s, fp, j, d, m) + fp[M.HEAD + d * m + j]
            val = math.exp((2.0 if f < m else -2.0) * z - 2.0 * stats[0]) * stats[1]
        else:  # T2R
            val = relu(_projection(x, r, s, fp, f, d, dk) + fp[M.HEAD + d * dk + f])
        y[r, f] = val


def device_features(q, k, feature_map, d, dtype):
    """``(q', k', code, D')`` for device arrays q, k (..., D): the code of a map the sequence kernels
    apply themselves with q, k as they are, or any other FeatureMap applied here first (then the
    identity's code); a callable is a TypeError (feature_maps.resolve_for_device)."""
    from ..feature_maps import resolve_for_device

    code, premap = resolve_for_device(feature_map)
    if premap is None:
        return q, k, code, d
    return apply(q, premap, dtype), apply(k, premap, dtype), code, premap.out_dim(d)


def apply(x, fmap, dtype):
    """phi of device array ``x`` (..., D) with FeatureMap ``fmap``, as a new device array (..., D')."""
    from .api import cuda_module, to_device

    shape = tuple(x.shape)  # (the simulator's shapes take no negative indices)
    d = shape[-1]
    rows = int(np.prod(shape[:-1]))
    dk = fmap.out_dim(d)
    y = cuda_module().device_array((rows, dk), dtype)
    if rows:
        fp = to_device(np.asarray(fmap.params(d, np.float64)))
        threads = 4 if _simulating() else _THREADS
        _map_rows[rows, threads](x.reshape(rows, d), fp, fmap.kernel_code(), y)
    return y.reshape(shape[:-1] + (dk,))


def _simulating():
    from . import _simulating as sim

    return sim()
