"""Slow, obviously correct NumPy versions of linear attention, for tests and benchmarks.

They compute in float64 and return float64. ``masked`` is the O(N^2) masked form, ``loop`` the
textbook per-token recurrence. Neither is meant for real sizes: use
:func:`linattn.causal_linear_attention` and :func:`linattn.linear_attention`. Their arguments are
checked as those functions check theirs (a ValueError or TypeError naming the argument).

Decay and gates (``decay=``, ``gate=``, ``scale=``), for both: the state before position t is
multiplied by a_t = decay * exp(gate_t) (a scalar, or per key dimension for a gate of shape
(..., N, D')) before position t's own term enters:

    S_t = a_t * S_{t-1} + phi(k_t) v_t^T,   Z_t = a_t * Z_{t-1} + phi(k_t),
    out_t = scale phi(q_t)^T S_t / (scale phi(q_t)^T Z_t + eps)
"""
import numpy as np

from . import checks, gates
from .feature_maps import resolve


def _phi(x, feature_map):
    fn = resolve(feature_map)[0]
    return np.asarray(fn(np.asarray(x, dtype=np.float64)), dtype=np.float64)


def _checked(qf, lead, n, dv, *, eps, normalize, initial_state, decay, gate, scale):
    """The options checked as linattn's functions check them (the same messages: a bad one is a
    ValueError or TypeError naming it; q, k, v by checks.check_qkv before), for phi(q) ``qf`` of leading
    dims ``lead``, N = ``n``, and values of Dv = ``dv``; the computation stays the plain formula."""
    checks.check_eps(eps)
    checks.check_flag(normalize, "normalize")
    gates.check_scale(scale)
    if decay is not None:
        gates.check_decay(decay, lead)
    if gate is not None:
        gates.check_gate(gate, lead, n, qf.shape[-1], np.float64)
    if initial_state is not None:  # (of any real dtype: computed in float64)
        for part, x in zip("SZ", checks.check_state(initial_state, "initial_state", lead, qf.shape[-1], dv, None)):
            checks.check_real_dtype(x.dtype, f"initial_state.{part}")


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
    causal = checks.check_flag(causal, "causal")
    _, _, _, lead, n, _, dv, _, _ = checks.check_qkv(q, k, v, cross=not causal)
    qf, kf = _phi(q, feature_map), _phi(k, feature_map)
    _checked(qf, lead, n, dv, eps=eps, normalize=normalize, initial_state=initial_state, decay=decay, gate=gate,
             scale=scale)
    if scale is not None:
        qf = qf * scale
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
            first = np.concatenate([np.zeros(log_a.shape[:-2] + (1, log_a.shape[-1])), log_a], axis=-2)  # (N = 0 too)
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
    _, _, _, lead, n, _, dv, _, _ = checks.check_qkv(q, k, v)
    qf, kf = _phi(q, feature_map), _phi(k, feature_map)
    _checked(qf, lead, n, dv, eps=eps, normalize=normalize, initial_state=initial_state, decay=decay, gate=gate,
             scale=scale)
    return_state = checks.check_flag(return_state, "return_state")
    lens = np.broadcast_to(n if lengths is None else checks.check_lengths(lengths, lead, n).reshape(lead), lead)
    if scale is not None:
        qf = qf * scale
    v = np.asarray(v, dtype=np.float64)
    log_a = _log_decays(decay, gate, lead, n, qf.shape[-1])
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
