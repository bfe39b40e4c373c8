"""Slow, obviously correct NumPy versions of linear attention, for tests and benchmarks.

They compute in float64 and return float64. ``masked`` is the O(N^2) masked form, ``loop`` the
textbook per-token recurrence. Neither is meant for real sizes: use
:func:`linattn.causal_linear_attention` and :func:`linattn.linear_attention`.

Decay and gates (``decay=``, ``gate=``, ``scale=``), for both: the state before position t is
multiplied by a_t = decay * exp(gate_t) (a scalar, or per key dimension for a gate of shape
(..., N, D')) before position t's own term enters:

    S_t = a_t * S_{t-1} + phi(k_t) v_t^T,   Z_t = a_t * Z_{t-1} + phi(k_t),
    out_t = scale phi(q_t)^T S_t / (scale phi(q_t)^T Z_t + eps)
"""
import numpy as np

from .feature_maps import resolve


def _phi(x, feature_map):
    fn = resolve(feature_map)[0]
    return np.asarray(fn(np.asarray(x, dtype=np.float64)), dtype=np.float64)


def _log_decays(decay, gate, lead, n, d):
    """log a_t as an array of shape lead + (N, D) (float64, -inf for a reset), or None without either."""
    if decay is None and gate is None:
        return None
    la = np.zeros(lead + (n, d))
    if decay is not None:
        with np.errstate(divide="ignore"):
            la += np.log(np.asarray(decay, np.float64)).reshape(np.shape(decay) + (1, 1))
    if gate is not None:
        g = np.asarray(gate, np.float64)
        la = la + (g[..., None] if g.shape == lead + (n,) else g)
    return la


def decay_matrix(log_a):
    """(..., N, N, D): the factor of position s's term at position t, prod_{s < u <= t} a_u, for s <= t
    (0 above the diagonal); from log a_t (..., N, D), where -inf (a reset) zeroes every earlier term.

    Written as products of exp(sums of the log gates in between), with the resets counted so that
    -inf never meets -inf."""
    n = log_a.shape[-2]
    finite = np.where(np.isneginf(log_a), 0.0, log_a)
    cum = np.cumsum(finite, axis=-2)  # (..., N, D)
    resets = np.cumsum(np.isneginf(log_a), axis=-2)
    t, s = np.arange(n)[:, None], np.arange(n)[None, :]
    diff = cum[..., :, None, :] - cum[..., None, :, :]  # [t, s] = sum over s < u <= t
    blocked = resets[..., :, None, :] > resets[..., None, :, :]  # a reset in (s, t]
    dec = np.where(blocked, 0.0, np.exp(np.minimum(diff, 0.0)))
    return np.where((s <= t)[..., None], dec, 0.0)


def masked(q, k, v, *, causal=True, feature_map="elu", eps=1e-6, normalize=True, initial_state=None,
           decay=None, gate=None, scale=None):
    """The O(N^2) form: ``A = phi(Q) phi(K)^T`` (lower triangle when causal), ``out = A V / (A 1 + eps)``;
    with decay or gates, ``A[t, s] = sum_d phi(q_t)_d phi(k_s)_d prod_{s<u<=t} a_u,d`` (and the
    initial state decayed by prod_{u<=t} a_u). Not causal, k and v may have another length than q.

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
    if scale is not None:
        qf = qf * scale
    lead, n = qf.shape[:-2], qf.shape[-2]
    log_a = _log_decays(decay, gate, lead, n, qf.shape[-1])
    if log_a is None:
        a = qf @ np.swapaxes(kf, -1, -2)
        if causal:
            a = np.tril(a)
    else:  # only causal attention decays
        a = np.einsum("...td,...sd,...tsd->...ts", qf, kf, decay_matrix(log_a))
    num = a @ np.asarray(v, dtype=np.float64)
    den = a.sum(-1)
    if initial_state is not None:
        S0, Z0 = (np.asarray(x, dtype=np.float64) for x in initial_state)
        q0 = qf
        if log_a is not None:  # the initial state is decayed by everything up to t
            first = np.concatenate([np.zeros_like(log_a[..., :1, :]), log_a], axis=-2)
            q0 = qf * decay_matrix(first)[..., 1:, 0, :]
        num = num + q0 @ S0
        den = den + np.einsum("...nd,...d->...n", q0, Z0)
    return num / (den[..., None] + eps) if normalize else num


def loop(q, k, v, *, feature_map="elu", eps=1e-6, normalize=True, initial_state=None, return_state=False,
         decay=None, gate=None, scale=None, lengths=None):
    """The textbook per-token loop: ``S = a S + phi(k_i) v_i^T``, ``Z = a Z + phi(k_i)``, then read
    out (a = 1 without decay and gates). ``lengths`` (the shape of the leading dims): positions at or
    past a sequence's length are skipped (output 0; the state stays the one at its length).

    Returns ``out`` or ``(out, (S, Z))`` with ``return_state=True``.
    """
    qf, kf = _phi(q, feature_map), _phi(k, feature_map)
    if scale is not None:
        qf = qf * scale
    v = np.asarray(v, dtype=np.float64)
    lead, n = qf.shape[:-2], qf.shape[-2]
    log_a = _log_decays(decay, gate, lead, n, qf.shape[-1])
    lens = np.broadcast_to(n if lengths is None else np.asarray(lengths), lead)
    out = np.zeros(lead + (n, v.shape[-1]))
    S_all = np.zeros(lead + (qf.shape[-1], v.shape[-1]))
    Z_all = np.zeros(lead + (qf.shape[-1],))
    if initial_state is not None:
        S_all[...] = initial_state[0]
        Z_all[...] = initial_state[1]
    for idx in np.ndindex(*lead):
        S, Z = S_all[idx], Z_all[idx]
        for i in range(int(lens[idx])):
            if log_a is not None:
                a = np.exp(log_a[idx][i])  # exp(-inf) = 0: a reset
                S *= a[:, None]
                Z *= a
            S += np.outer(kf[idx][i], v[idx][i])
            Z += kf[idx][i]
            num = qf[idx][i] @ S
            out[idx][i] = num / (qf[idx][i] @ Z + eps) if normalize else num
    return (out, (S_all, Z_all)) if return_state else out
