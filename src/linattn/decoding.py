"""Incremental decoding: one position at a time through the state, and the explicit attention
weights for inspection."""
import math
from contextlib import nullcontext

import numpy as np

from . import checks
from .cpu import step as step_kernels
from .cpu.runtime import kernel_section
from .feature_maps import NAMED, resolve, resolve_for_device
from .state import State

_NAMED_CODES = {name: code for name, (_, code) in NAMED.items()}
_FAST = {}  # (feature map name, dtype, ndim) -> (map code, serial step kernel) for step's fast path
_ndarray, _empty, _INF = np.ndarray, np.empty, math.inf  # module globals: cheaper to look up per step

# Batches with at least this many state elements (B*H*D*Dv) are stepped in parallel. Measured: from 8
# heads of 64 x 64 threads win when steps come back to back, but in a decode loop the threads sleep
# between steps and waking them costs more than a few heads' work.
_PARALLEL_MIN = 1 << 18


def _flat_view(x, shape):
    """x reshaped to ``shape`` as a view, or None when the strides do not allow one."""
    view = x.view()
    try:
        view.shape = shape
    except AttributeError:
        return None
    return view


def _fast_entry(feature_map, dtype, ndim):
    """The fast-path entry for a named map and a float32/float64 dtype (compiled once), else None."""
    code = _NAMED_CODES.get(feature_map)
    if code is None or dtype not in (np.float32, np.float64) or ndim < 1:
        return None
    entry = _FAST[feature_map, dtype, ndim] = (code, step_kernels.step_nd_serial.get(dtype, ndim - 1))
    return entry


def step(q, k, v, state, *, feature_map="elu", eps=1e-6, normalize=True, out=None, device=None):
    r"""Advance causal linear attention by one position for every sequence of a batch.

    Updates ``state`` **in place** (:math:`S \mathrel{+}= \phi(k) v^T`, :math:`Z \mathrel{+}= \phi(k)`)
    and returns :math:`\phi(q)^T S / (\phi(q)^T Z + eps)`. The work is O(D'·Dv) per sequence; nothing
    the size of the state is allocated (only the output, unless ``out`` is given, and phi(q), phi(k)).

    Parameters
    ----------
    q, k : array_like, shape (..., D)
        Query and key of the new position, any leading (batch) dimensions.
    v : array_like, shape (..., Dv)
        Its value.
    state : State
        ``S`` of shape (..., D', Dv) and ``Z`` of (..., D'), writable, of the computation's dtype
        (float32 for float16/float32 inputs, float64 otherwise): from :meth:`State.zeros` or from
        ``causal_linear_attention(..., return_state=True)`` (prefill).
    feature_map, eps, normalize
        As for :func:`causal_linear_attention`; a callable maps (..., D) to (..., D').
    out : ndarray, shape (..., Dv), optional
        Where to write the result (the inputs' float dtype).
    device : {None, "cpu", "cuda"}, optional
        As for :func:`causal_linear_attention`: device arrays (q, k, v, the state, ``out``) step on
        their GPU; ``"cuda"`` steps host arrays on the GPU and writes the state back.

    Returns
    -------
    ndarray, shape (..., Dv)

    Examples
    --------
    Prefill a prompt, then generate: the steps continue the sequence exactly.

    >>> import numpy as np, linattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 10, 8), dtype=np.float32) for _ in range(3))
    >>> full = linattn.causal_linear_attention(q, k, v)
    >>> _, state = linattn.causal_linear_attention(q[..., :7, :], k[..., :7, :], v[..., :7, :],
    ...                                            return_state=True)
    >>> steps = [linattn.step(q[..., i, :], k[..., i, :], v[..., i, :], state) for i in range(7, 10)]
    >>> bool(np.allclose(np.stack(steps, axis=-2), full[..., 7:, :], rtol=1e-5, atol=1e-6))
    True
    """
    # Fast path for the common call (C-contiguous float32/float64 arrays, a named feature map): the
    # compiled kernel checks dtypes and layouts by its signature and shapes itself, so a decoding
    # step costs little more than the arithmetic. Anything else takes the validating path below.
    if (device is None and type(state) is State and type(q) is _ndarray and type(v) is _ndarray
            and type(feature_map) is str and type(eps) is float):
        dt = q.dtype
        fast = _FAST.get((feature_map, dt, q.ndim)) or _fast_entry(feature_map, dt, q.ndim)
        if (fast is not None and (normalize is True or normalize is False) and 0.0 <= eps < _INF
                and (out is None or (type(out) is _ndarray and out.dtype is dt))):
            S, Z = state
            # the kernel checks out's shape and layout (C-contiguous, writable) like the others'
            res = _empty(v.shape, dt) if out is None else out
            try:
                if type(S) is not _ndarray or S.size < _PARALLEL_MIN:
                    status = fast[1](q, k, v, fast[0], eps, normalize, S, Z, res)
                else:
                    kernel = step_kernels.step_nd_parallel.get(dt, q.ndim - 1)
                    with kernel_section():
                        status = kernel(q, k, v, fast[0], eps, normalize, S, Z, res)
                if status == 0:
                    return res
            except TypeError:  # no compiled signature fits: let the checks below say why
                pass
    return _step_checked(q, k, v, state, feature_map, eps, normalize, out, device)


def _step_checked(q, k, v, state, feature_map, eps, normalize, out, device):
    S_in, Z_in = checks.state_parts(state)
    where = checks.check_placement({"q": q, "k": k, "v": v, "state.S": S_in, "state.Z": Z_in, "out": out},
                                   device)
    if where == "device":
        return _step_device(q, k, v, state, feature_map, eps, normalize, out)
    q, k, v, lead, _, _, dv, comp, out_dt = checks.check_qkv(q, k, v, seq_axis=False)
    eps = checks.check_eps(eps)
    normalize = checks.check_flag(normalize, "normalize")
    fn, code, is_callable = resolve(feature_map)
    q, k, v = q.astype(comp, copy=False), k.astype(comp, copy=False), v.astype(comp, copy=False)
    if is_callable:
        q = checks.check_mapped(fn(q), "q", lead, None).astype(comp, copy=False)
        k = checks.check_mapped(fn(k), "k", lead, None, q.shape[-1]).astype(comp, copy=False)
    dk = q.shape[-1]
    S, Z = checks.check_state(state, "state", lead, dk, dv, comp)
    for name, arr in (("state.S", S), ("state.Z", Z)):
        if not isinstance(arr, np.ndarray) or not arr.flags.writeable:
            raise ValueError(f"{name}: expected a writable NumPy array (step updates the state in place)")
    bh = math.prod(lead)
    # The kernel updates (BH, D', Dv) views in place; a state whose strides allow no such view is
    # stepped in a contiguous copy and written back.
    S3, Z2 = _flat_view(S, (bh, dk, dv)), _flat_view(Z, (bh, dk))
    S3c = S3 if S3 is not None else np.ascontiguousarray(S).reshape(bh, dk, dv)
    Z2c = Z2 if Z2 is not None else np.ascontiguousarray(Z).reshape(bh, dk)
    if out is not None:
        checks.check_out(out, lead + (dv,), out_dt)
    res = out if (out is not None and out_dt == comp) else np.empty(lead + (dv,), comp)
    res2 = _flat_view(res, (bh, dv))
    if res2 is None:  # an `out` with strides that allow no view
        res = np.empty(lead + (dv,), comp)
        res2 = res.reshape(bh, dv)
    if bh and where == "cuda-host":
        from .cuda import api as cuda_api

        S_dev, Z_dev = cuda_api.to_device(np.ascontiguousarray(S3c)), cuda_api.to_device(np.ascontiguousarray(Z2c))
        res2[...] = cuda_api.step(q.reshape(bh, dk), k.reshape(bh, dk), v.reshape(bh, dv), code, eps,
                                  normalize, S_dev, Z_dev, None, comp)
        S3c[...] = S_dev.copy_to_host()
        Z2c[...] = Z_dev.copy_to_host()
    elif bh:
        parallel = bh * dk * dv >= _PARALLEL_MIN
        kernels = step_kernels.step_strided_parallel if parallel else step_kernels.step_strided_serial
        with kernel_section() if parallel else nullcontext():
            kernels.get(comp, None)(q.reshape(bh, dk), k.reshape(bh, dk), v.reshape(bh, dv), code, eps,
                                    normalize, S3c, Z2c, res2)
    if S3 is None:  # write the contiguous copy back
        S[...] = S3c.reshape(S.shape)
    if Z2 is None:
        Z[...] = Z2c.reshape(Z.shape)
    if out is not None and res is not out:
        out[...] = res
        return out
    return res.astype(out_dt, copy=False)


def _step_device(q, k, v, state, feature_map, eps, normalize, out):
    """step on CUDA device arrays: validated like the host path, computed on the GPU in place."""
    from .cuda import api as cuda_api

    q, k, v = cuda_api.as_device(q), cuda_api.as_device(k), cuda_api.as_device(v)
    q, k, v, lead, _, d, dv, comp, out_dt = checks.check_qkv(q, k, v, seq_axis=False, host=False)
    checks.check_device_inputs({"q": q, "k": k, "v": v}, comp, out_dt)
    eps = checks.check_eps(eps)
    normalize = checks.check_flag(normalize, "normalize")
    code = resolve_for_device(feature_map)
    S_in, Z_in = checks.state_parts(state)
    if Z_in is not None:
        state = (cuda_api.as_device(S_in), cuda_api.as_device(Z_in))
    S, Z = checks.check_state(state, "state", lead, d, dv, comp)
    checks.check_device_inputs({"state.S": S, "state.Z": Z}, comp, comp)
    bh = math.prod(lead)
    if out is not None:
        out = cuda_api.as_device(out)
        if tuple(out.shape) != lead + (dv,) or np.dtype(out.dtype) != comp:
            raise ValueError(f"out: expected a device array of shape {lead + (dv,)} and dtype {comp}, "
                             f"got shape {tuple(out.shape)}, dtype {out.dtype}")
        checks.check_device_inputs({"out": out}, comp, comp)
        out = out.reshape(bh, dv)
    res = cuda_api.step(q.reshape(bh, d), k.reshape(bh, d), v.reshape(bh, dv), code, eps, normalize,
                        S.reshape(bh, d, dv), Z.reshape(bh, d), out, comp)
    return res.reshape(lead + (dv,))


def attention_weights(q, k, *, causal=True, feature_map="elu", eps=1e-6):
    r"""The (..., N, N) matrix of normalised weights that linear attention applies implicitly.

    ``W[i, j] = phi(q_i).phi(k_j) / (sum_j' phi(q_i).phi(k_j') + eps)`` over j <= i when causal (the
    upper triangle is 0), over all j otherwise, so row i sums to ~1 and ``W @ v`` equals the
    attention output. O(N²) memory: for inspection and teaching on small N.

    Examples
    --------
    >>> import numpy as np, linattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 3)) for _ in range(3))
    >>> w = linattn.attention_weights(q, k)
    >>> bool(np.allclose(w.sum(-1), 1)), bool(np.all(np.triu(w, 1) == 0))
    (True, True)
    >>> bool(np.allclose(w @ v, linattn.causal_linear_attention(q, k, v)))
    True
    """
    q = checks.as_array(q, "q", 2)
    k = checks.as_array(k, "k", 2)
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected leading dimensions and D like q {q.shape[:-2]}, D={q.shape[-1]}; "
                         f"got shape {k.shape}")
    eps = checks.check_eps(eps)
    causal = checks.check_flag(causal, "causal")
    comp, out_dt = checks.compute_dtypes(q.dtype, k.dtype)
    fn, _, is_callable = resolve(feature_map)
    lead, n = q.shape[:-2], q.shape[-2]
    qf = np.asarray(fn(q.astype(comp, copy=False)))
    kf = np.asarray(fn(k.astype(comp, copy=False)))
    if is_callable:
        qf = checks.check_mapped(qf, "q", lead, n)
        kf = checks.check_mapped(kf, "k", lead, k.shape[-2], qf.shape[-1])
    a = (qf @ np.swapaxes(kf, -1, -2)).astype(comp, copy=False)
    if causal:
        a = np.tril(a)
    return (a / (a.sum(-1, keepdims=True) + comp.type(eps))).astype(out_dt, copy=False)
