"""The public attention functions: check the inputs, apply a callable feature map, run one kernel,
reshape back."""
import math

import numpy as np

from . import checks
from .cpu import chunked
from .cpu.runtime import kernel_section, plan
from .feature_maps import resolve, resolve_for_device
from .state import State


def _features(q, k, feature_map, lead, n, comp):
    """(q', k', kernel code, D'): inputs in the compute dtype, mapped already if the map is a callable."""
    fn, code, is_callable = resolve(feature_map)
    q, k = q.astype(comp, copy=False), k.astype(comp, copy=False)
    if is_callable:
        q = checks.check_mapped(fn(q), "q", lead, n).astype(comp, copy=False)
        k = checks.check_mapped(fn(k), "k", lead, n, q.shape[-1]).astype(comp, copy=False)
    return q, k, code, q.shape[-1]


def _flat(x, bh, tail):
    """(*lead, *tail_dims) -> (bh, *tail_dims) for the last ``tail`` dims, a view when possible."""
    return x.reshape((bh,) + x.shape[x.ndim - tail:])


def _flat_seq(q, k, v, bh):
    """q, k, v as (bh, N, X) views and the kernel layout: "C" if all are C-contiguous, else "A"."""
    arrs = tuple(_flat(x, bh, 2) for x in (q, k, v))
    return arrs + ("C" if all(a.flags.c_contiguous for a in arrs) else "A",)


def _prepare(q, k, v, feature_map, eps, normalize, where="cpu"):
    """Checked inputs. On a CUDA device ("device") nothing is copied and only named maps run."""
    if where == "device":
        from .cuda.api import as_device

        q, k, v = as_device(q), as_device(k), as_device(v)
    q, k, v, lead, n, d, dv, comp, out_dt = checks.check_qkv(q, k, v, host=where != "device")
    eps = checks.check_eps(eps)
    normalize = checks.check_flag(normalize, "normalize")
    if where == "device":
        checks.check_device_inputs({"q": q, "k": k, "v": v}, comp, out_dt)
        code = resolve_for_device(feature_map)
        return q, k, v, lead, n, d, dv, comp, out_dt, eps, normalize, code
    q, k, code, dk = _features(q, k, feature_map, lead, n, comp)
    v = v.astype(comp, copy=False)
    return q, k, v, lead, n, dk, dv, comp, out_dt, eps, normalize, code


def causal_linear_attention(q, k, v, *, feature_map="elu", eps=1e-6, normalize=True,
                            initial_state=None, return_state=False, lengths=None, device=None):
    r"""Causal linear attention: position i attends to positions j <= i.

    .. math:: out_i = \frac{\phi(q_i)^T S_i}{\phi(q_i)^T Z_i + eps},\quad
              S_i = S_0 + \sum_{j\le i} \phi(k_j) v_j^T,\quad Z_i = Z_0 + \sum_{j\le i} \phi(k_j)

    Parameters
    ----------
    q, k : array_like, shape (..., N, D)
        Queries and keys. Any number of leading dimensions (batch, heads, ...), equal for q, k, v.
    v : array_like, shape (..., N, Dv)
        Values.
    feature_map : {"elu", "relu", "identity"} or callable, default "elu"
        phi. "elu" is elu(x) + 1. A callable maps an array (..., N, D) to (..., N, D'), in the
        computation's dtype.
    eps : float, default 1e-6
        Added to the denominator; finite and >= 0.
    normalize : bool, default True
        False returns the numerator :math:`\phi(q_i)^T S_i` only.
    initial_state : State, optional
        State ``(S, Z)`` to continue from (``S`` of shape (..., D', Dv), ``Z`` of (..., D')), as
        returned by ``return_state=True``; its dtype must be the computation's dtype.
    return_state : bool, default False
        Also return the :class:`State` after the last position.
    lengths : array_like of int, optional
        True lengths of right-padded sequences, of the shape of the leading dims or of their first
        dims (``(B,)`` for ``(B, H, N, D)`` inputs). Positions at or past a sequence's length do not
        enter its state, their outputs are 0, and the returned state is the one at its length.
    device : {None, "cpu", "cuda"}, optional
        Where to compute. By default CUDA device arrays (anything with ``__cuda_array_interface__``)
        run on their GPU and return device arrays (the state too), host arrays on the CPU.
        ``"cuda"`` runs host arrays on the GPU and returns host arrays.

    Returns
    -------
    out : ndarray, shape (..., N, Dv)
        In the inputs' float dtype (float16 is computed in float32; integers become float64).
    state : State
        Only with ``return_state=True``.

    Examples
    --------
    >>> import numpy as np, linattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 100, 16), dtype=np.float32) for _ in range(3))
    >>> out, state = linattn.causal_linear_attention(q, k, v, return_state=True)
    >>> out.shape, state.S.shape, state.Z.shape
    ((2, 4, 100, 16), (2, 4, 16, 16), (2, 4, 16))

    Two calls through the state equal one call on the whole sequence:

    >>> a, st = linattn.causal_linear_attention(q[..., :60, :], k[..., :60, :], v[..., :60, :],
    ...                                         return_state=True)
    >>> b = linattn.causal_linear_attention(q[..., 60:, :], k[..., 60:, :], v[..., 60:, :],
    ...                                     initial_state=st)
    >>> bool(np.allclose(np.concatenate([a, b], axis=-2), out, rtol=1e-5, atol=1e-6))
    True
    """
    S_in, Z_in = checks.state_parts(initial_state)
    where = checks.check_placement({"q": q, "k": k, "v": v, "initial_state.S": S_in,
                                    "initial_state.Z": Z_in}, device)
    q, k, v, lead, n, dk, dv, comp, out_dt, eps, normalize, code = _prepare(
        q, k, v, feature_map, eps, normalize, where)
    return_state = checks.check_flag(return_state, "return_state")
    if where == "device" and initial_state is not None and Z_in is not None:
        from .cuda.api import as_device

        initial_state = (as_device(S_in), as_device(Z_in))
    bh = math.prod(lead)
    lens = (np.full(bh, n, np.int64) if lengths is None
            else checks.check_lengths(lengths, lead, n))
    if initial_state is None:  # no rows: the kernels start from zero
        S0, Z0 = np.zeros((0, dk, dv), comp), np.zeros((0, dk), comp)
    else:
        S0, Z0 = checks.check_state(initial_state, "initial_state", lead, dk, dv, comp)
        if where == "cpu":
            S0 = np.ascontiguousarray(_flat(np.asarray(S0), bh, 2))
            Z0 = np.ascontiguousarray(_flat(np.asarray(Z0), bh, 1))
    if where != "cpu":
        from .cuda import api as cuda_api

        if initial_state is not None:
            S0, Z0 = cuda_api.flat_state(S0, Z0, bh, dk, dv, where)
        out, S, Z = cuda_api.causal(_flat(q, bh, 2), _flat(k, bh, 2), _flat(v, bh, 2), code, eps,
                                    normalize, lens, S0, Z0, return_state, comp)
    else:
        out = np.empty((bh, n, dv), comp)
        rows = bh if return_state else 0  # no rows: the kernel skips writing the state
        S, Z = np.empty((rows, dk, dv), comp), np.empty((rows, dk), comp)
        if bh and n:
            chunk, frac = plan(bh, n, causal=True)
            q3, k3, v3, layout = _flat_seq(q, k, v, bh)
            kernel = chunked.causal_forward.get(comp, layout)
            with kernel_section(chunk * (dk + chunk) * dv):
                kernel(q3, k3, v3, code, comp.type(eps), normalize, lens, chunk, frac, S0, Z0, out, S, Z)
        elif return_state:
            S[...] = S0 if len(S0) else 0
            Z[...] = Z0 if len(Z0) else 0
    out = out.reshape(lead + (n, dv))
    if where != "device":  # device arrays are already in their (only) dtype
        out = out.astype(out_dt, copy=False)
    if return_state:
        return out, State(S.reshape(lead + (dk, dv)), Z.reshape(lead + (dk,)))
    return out


def linear_attention(q, k, v, *, feature_map="elu", eps=1e-6, normalize=True, device=None):
    r"""Non-causal linear attention: every position attends to all N positions.

    .. math:: out_i = \frac{\phi(q_i)^T S}{\phi(q_i)^T Z + eps},\quad
              S = \sum_j \phi(k_j) v_j^T,\quad Z = \sum_j \phi(k_j)

    Parameters and returns are as for :func:`causal_linear_attention`, without the state and
    ``lengths``.

    Examples
    --------
    >>> import numpy as np, linattn
    >>> q = k = np.zeros((4, 2), np.float32); v = np.arange(8, dtype=np.float32).reshape(4, 2)
    >>> linattn.linear_attention(q, k, v, eps=0.0)  # phi(0) = 1: every row is the mean of v
    array([[3., 4.],
           [3., 4.],
           [3., 4.],
           [3., 4.]], dtype=float32)
    """
    where = checks.check_placement({"q": q, "k": k, "v": v}, device)
    q, k, v, lead, n, dk, dv, comp, out_dt, eps, normalize, code = _prepare(
        q, k, v, feature_map, eps, normalize, where)
    bh = math.prod(lead)
    if where != "cpu":
        from .cuda import api as cuda_api

        out = cuda_api.noncausal(_flat(q, bh, 2), _flat(k, bh, 2), _flat(v, bh, 2), code, eps, normalize, comp)
    else:
        out = np.empty((bh, n, dv), comp)
        if bh and n:
            chunk, frac = plan(bh, n, causal=False)
            q3, k3, v3, layout = _flat_seq(q, k, v, bh)
            kernel = chunked.noncausal_forward.get(comp, layout)
            with kernel_section(dk * chunk * dv):
                kernel(q3, k3, v3, code, comp.type(eps), normalize, chunk, frac, out)
    out = out.reshape(lead + (n, dv))
    return out if where == "device" else out.astype(out_dt, copy=False)
