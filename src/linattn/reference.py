"""Slow, obviously correct NumPy versions of linear attention, for tests and benchmarks.

They compute in float64 and return float64. ``masked`` is the O(N^2) masked form, ``loop`` the
textbook per-token recurrence. Neither is meant for real sizes: use
:func:`linattn.causal_linear_attention` and :func:`linattn.linear_attention`.
"""
import numpy as np

from .feature_maps import resolve


def _phi(x, feature_map):
    fn = resolve(feature_map)[0]
    return np.asarray(fn(np.asarray(x, dtype=np.float64)), dtype=np.float64)


def masked(q, k, v, *, causal=True, feature_map="elu", eps=1e-6, normalize=True, initial_state=None):
    """The O(N^2) form: ``A = phi(Q) phi(K)^T`` (lower triangle when causal), ``out = A V / (A 1 + eps)``.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn import reference
    >>> q = k = np.zeros((3, 2)); v = np.arange(6.0).reshape(3, 2)
    >>> reference.masked(q, k, v, eps=0.0)  # phi(0) = 1: causal running means of v
    array([[0., 1.],
           [1., 2.],
           [2., 3.]])
    """
    qf, kf = _phi(q, feature_map), _phi(k, feature_map)
    a = qf @ np.swapaxes(kf, -1, -2)
    if causal:
        a = np.tril(a)
    num = a @ np.asarray(v, dtype=np.float64)
    den = a.sum(-1)
    if initial_state is not None:
        S0, Z0 = (np.asarray(x, dtype=np.float64) for x in initial_state)
        num = num + qf @ S0
        den = den + np.einsum("...nd,...d->...n", qf, Z0)
    return num / (den[..., None] + eps) if normalize else num


def loop(q, k, v, *, feature_map="elu", eps=1e-6, normalize=True, initial_state=None, return_state=False):
    """The textbook per-token loop: ``S += phi(k_i) v_i^T``, ``Z += phi(k_i)``, then read out.

    Returns ``out`` or ``(out, (S, Z))`` with ``return_state=True``.
    """
    qf, kf = _phi(q, feature_map), _phi(k, feature_map)
    v = np.asarray(v, dtype=np.float64)
    lead, n = qf.shape[:-2], qf.shape[-2]
    out = np.zeros(lead + (n, v.shape[-1]))
    S_all = np.zeros(lead + (qf.shape[-1], v.shape[-1]))
    Z_all = np.zeros(lead + (qf.shape[-1],))
    if initial_state is not None:
        S_all[...] = initial_state[0]
        Z_all[...] = initial_state[1]
    for idx in np.ndindex(*lead):
        S, Z = S_all[idx], Z_all[idx]
        for i in range(n):
            S += np.outer(kf[idx][i], v[idx][i])
            Z += kf[idx][i]
            num = qf[idx][i] @ S
            out[idx][i] = num / (qf[idx][i] @ Z + eps) if normalize else num
    return (out, (S_all, Z_all)) if return_state else out
