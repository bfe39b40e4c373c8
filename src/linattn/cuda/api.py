"""Launch the CUDA kernels on (BH, N, D)-shaped arrays, on the device or copied from the host."""
import numpy as np

from . import _simulating, cuda_module, is_device_array

_SHARED_BYTES = 48 * 1024  # static limit for dynamic shared memory without an opt-in


def shared_doubles(c, te, d):
    """Size of the dynamic shared buffer of the sequence kernels, in float64 values."""
    return 2 * c * d + c * te + c * c + d * te + d + c


def tiles(d, dv):
    """(C, TE): positions per chunk and value columns per block (C*TE threads per block)."""
    c, te = (4, 4) if _simulating() else (16, 16)  # the simulator runs each thread as a Python thread
    while shared_doubles(c, te, d) * 8 > _SHARED_BYTES and (c > 1 or te > 1):
        if te >= c and te > 1:
            te //= 2
        else:
            c //= 2
    if shared_doubles(c, te, d) * 8 > _SHARED_BYTES:
        raise ValueError(f"q: feature dimension D={d} is too large for the CUDA kernels' shared memory")
    return c, te


def _on_device(x):
    """x as a Numba device array: a view of a device array, a copy of a host array."""
    return as_device(x) if is_device_array(x) else to_device(np.ascontiguousarray(x))


def to_device(x):
    """A copy of host array ``x`` on the device."""
    return cuda_module().to_device(x)


def as_device(x):
    """A Numba device array viewing the device array ``x`` (no copy)."""
    return x if _simulating() else cuda_module().as_cuda_array(x)


def flat_state(S, Z, bh, dk, dv, where):
    """A checked state as (BH, D', Dv), (BH, D') arrays: device views, or host arrays for "cuda-host"."""
    if where == "device":
        from ..checks import check_device_inputs

        S, Z = as_device(S), as_device(Z)
        check_device_inputs({"initial_state.S": S, "initial_state.Z": Z}, np.dtype(S.dtype), np.dtype(S.dtype))
        return S.reshape(bh, dk, dv), Z.reshape(bh, dk)
    return np.ascontiguousarray(np.asarray(S).reshape(bh, dk, dv)), np.ascontiguousarray(np.asarray(Z).reshape(bh, dk))


def _result(x, host):
    return x.copy_to_host() if host else x


def causal(q, k, v, code, eps, normalize, lengths, S0, Z0, want_state, dtype):
    """Causal forward of (BH, N, D) arrays; returns (out, S, Z) (S, Z have no rows unless
    ``want_state``) on the host if q is a host array, else on the device."""
    cuda = cuda_module()
    from .kernels import causal as kern
    host = not is_device_array(q)
    bh, n, d = q.shape
    dv = v.shape[2]
    q, k, v, S0, Z0 = (_on_device(x) for x in (q, k, v, S0, Z0))
    lens = cuda.to_device(np.ascontiguousarray(lengths, dtype=np.int64))
    out = cuda.device_array((bh, n, dv), dtype)
    rows = bh if want_state else 0
    S, Z = cuda.device_array((rows, d, dv), dtype), cuda.device_array((rows, d), dtype)
    if bh and n:
        c, te = tiles(d, dv)
        kern[(bh, -(-dv // te)), (te, c), 0, shared_doubles(c, te, d) * 8](
            q, k, v, code, float(eps), bool(normalize), lens, S0, Z0, out, S, Z, c, te)
    elif want_state and S0.shape[0]:
        S, Z = S0, Z0
    elif want_state:
        S, Z = to_device(np.zeros((bh, d, dv), dtype)), to_device(np.zeros((bh, d), dtype))
    return _result(out, host), _result(S, host), _result(Z, host)


def noncausal(q, k, v, code, eps, normalize, dtype):
    cuda = cuda_module()
    from .kernels import noncausal as kern
    host = not is_device_array(q)
    bh, n, d = q.shape
    dv = v.shape[2]
    q, k, v = (_on_device(x) for x in (q, k, v))
    out = cuda.device_array((bh, n, dv), dtype)
    if bh and n:
        c, te = tiles(d, dv)
        kern[(bh, -(-dv // te)), (te, c), 0, shared_doubles(c, te, d) * 8](
            q, k, v, code, float(eps), bool(normalize), out, c, te)
    return _result(out, host)


def step(q, k, v, code, eps, normalize, S, Z, out, dtype):
    """One step on (BH, D) arrays; S, Z (device arrays) are updated in place. Host q, k, v are
    copied over; returns out (a device array, or a host array for host q)."""
    cuda = cuda_module()
    from .kernels import step as kern
    host = not is_device_array(q)
    bh, d = q.shape
    dv = v.shape[1]
    q, k, v = (_on_device(x) for x in (q, k, v))
    res = out if out is not None else cuda.device_array((bh, dv), dtype)
    if bh:
        t = 4 if _simulating() else min(256, max(32, -(-dv // 32) * 32))
        kern[bh, t, 0, 2 * d * 8](q, k, v, code, float(eps), bool(normalize), S, Z, res, t)
    return _result(res, host)
