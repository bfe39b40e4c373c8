"""What decay and gates change in a chunk of cpu/chunked.py: the chunk's decay factors from its log
gates, and their effect on the scores, the query rows, the key columns and the pending state.

The gate array's type says the kind, at compile time (each helper is an overload on it):

- a 1-D array (empty): no decay (every helper does nothing, or what the ungated kernel does);
- (G1, G2, N): a log-decay per position (a constant decay arrives as a view with stride 0);
- (G1, G2, N, D'): a log-decay per position and key dimension (GLA).

``ld[h]`` (float64, <= 0) is added to every log gate of head h (the ``decay=`` argument). Per chunk,
G[t] is the sum of the log gates of positions (reset, t] where "reset" is the last -inf at or before
t in the chunk (R[t], -1 when none: then the sum starts at the chunk's start), in float64 (per
dimension for D'). The factor of position s's term at position t (s <= t) is exp(G[t] - G[s]),
and 0 when a reset lies in (s, t]; the state before the chunk reaches t with exp(G[t]) (0 after a
reset). Only exponentials of non-positive numbers are taken, so gates down to -1e4 and -inf
resets neither overflow nor give NaN.
"""
import numpy as np
from numba import types
from numba.extending import overload
from numba.np.numpy_support import as_dtype

from .._jit import FASTMATH, njit
from .elementwise import exp_le0
from .smallgemm import small_gemm

_OPTS = {"fastmath": set(FASTMATH), "error_model": "numpy"}

#: status[0] after a kernel: 0, or the first bad gate's kind (1: positive, 2: NaN); status[1]: its
#: head, status[2]: its position
POSITIVE, NAN = 1, 2


def _kind(gates):
    """0 (none), 1 (scalar per position) or 2 (per key dimension) from the gate array's type."""
    if not isinstance(gates, types.Array):
        return None
    return {1: 0, 3: 1, 4: 2}.get(gates.ndim)


def _stub(name):
    def fn(*args):
        raise NotImplementedError(f"{name} runs inside Numba kernels only")

    fn.__name__ = name
    return fn


chunk_gates = _stub("chunk_gates")
gate_scores = _stub("gate_scores")
gate_queries = _stub("gate_queries")
gate_key_columns = _stub("gate_key_columns")
gate_key_rows = _stub("gate_key_rows")
gate_pending = _stub("gate_pending")


@overload(chunk_gates, jit_options=_OPTS)
def _chunk_gates(gates, h, ld, i0, c, G, R, status):
    """G, R of the chunk [i0, i0 + c) of head h (see the module docstring); a positive or NaN gate is
    reported in ``status``."""
    kind = _kind(gates)
    if kind == 0:
        return lambda gates, h, ld, i0, c, G, R, status: None

    def impl(gates, h, ld, i0, c, G, R, status):
        g2 = gates.shape[1]
        row = gates[h // g2, h % g2]
        extra = ld[h]
        width = 1 if kind == 1 else row.shape[1]
        for a in range(width):
            total = 0.0
            last = -1
            for t in range(c):
                x = row[i0 + t] if kind == 1 else row[i0 + t, a]
                if x > 0 or x != x:
                    status[0] = POSITIVE if x > 0 else NAN
                    status[1] = h
                    status[2] = i0 + t
                g = np.float64(x) + extra
                if g == -np.inf:
                    total, last = 0.0, t
                else:
                    total += g
                if kind == 1:
                    G[t], R[t] = total, last
                else:
                    G[t, a], R[t, a] = total, last

    return impl


def _factor(G, R, t, s):
    """Factor of position s's term at position t >= s (scalar kind), float64; s = -1: the state before
    the chunk. Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_factor, jit_options=_OPTS)
def _factor_impl(G, R, t, s):
    def impl(G, R, t, s):
        if R[t] > s:
            return 0.0
        return exp_le0(G[t] - (G[s] if s >= 0 else 0.0))

    return impl


@njit(helper=True)
def masked_product(QA, KT, d_, c):
    """QA[:c, d_:d_+c] = phi(Q) phi(K)^T (QA[:c, :d_] and KT), zero above the diagonal."""
    small_gemm(QA[:c, :d_], KT[:, :c], QA[:c, d_:d_ + c], False, -1, 0)  # to the diagonal's tile
    for t in range(c):
        for u in range(t + 1, c):
            QA[t, d_ + u] = 0


@overload(gate_scores, jit_options=_OPTS)
def _gate_scores(gates, QA, KT, Kf, d_, c, G, R):
    """QA[:c, d_:d_+c] = the chunk's decayed scores, lower triangle (zero above)."""
    kind = _kind(gates)
    if kind == 0:
        def impl(gates, QA, KT, Kf, d_, c, G, R):
            masked_product(QA, KT, d_, c)
        return impl
    if kind == 1:
        def impl(gates, QA, KT, Kf, d_, c, G, R):
            masked_product(QA, KT, d_, c)
            for t in range(c):
                for s in range(t + 1):
                    QA[t, d_ + s] *= _factor(G, R, t, s)
        return impl
    dt = as_dtype(QA.dtype).type

    def impl(gates, QA, KT, Kf, d_, c, G, R):  # per dimension: no product, each score its own sum
        for t in range(c):
            for s in range(t + 1):
                acc = dt(0.0)
                for a in range(d_):
                    f = exp_le0(dt(G[t, a] - G[s, a]))
                    acc += QA[t, a] * Kf[s, a] * (dt(0.0) if R[t, a] > s else f)
                QA[t, d_ + s] = acc
            for s in range(t + 1, c):
                QA[t, d_ + s] = 0
    return impl


@overload(gate_queries, jit_options=_OPTS)
def _gate_queries(gates, QA, d_, c, G, R):
    """phi(q_t) times the factor of the state before the chunk at t (its part of the output)."""
    kind = _kind(gates)
    if kind == 0:
        return lambda gates, QA, d_, c, G, R: None
    dt = as_dtype(QA.dtype).type
    if kind == 1:
        def impl(gates, QA, d_, c, G, R):
            for t in range(c):
                f = dt(_factor(G, R, t, -1))
                for a in range(d_):
                    QA[t, a] *= f
        return impl

    def impl(gates, QA, d_, c, G, R):
        for t in range(c):
            for a in range(d_):
                QA[t, a] *= dt(0.0) if R[t, a] >= 0 else exp_le0(dt(G[t, a]))
    return impl


@overload(gate_key_columns, jit_options=_OPTS)
def _gate_key_columns(gates, KT, c, G, R, Pz):
    """phi(K)^T's column s times the factor of position s at the chunk's end; Pz += its row sums
    (without gates the transpose added them)."""
    kind = _kind(gates)
    if kind == 0:
        return lambda gates, KT, c, G, R, Pz: None
    dt = as_dtype(KT.dtype).type
    if kind == 1:
        def impl(gates, KT, c, G, R, Pz):
            w = np.empty(c, dt)
            for s in range(c):
                w[s] = _factor(G, R, c - 1, s)
            for a in range(KT.shape[0]):
                z = dt(0.0)
                for s in range(c):
                    x = KT[a, s] * w[s]
                    KT[a, s] = x
                    z += x
                Pz[a] += z
        return impl

    def impl(gates, KT, c, G, R, Pz):
        for a in range(KT.shape[0]):
            z = dt(0.0)
            for s in range(c):
                f = exp_le0(dt(G[c - 1, a] - G[s, a]))
                x = KT[a, s] * (dt(0.0) if R[c - 1, a] > s else f)
                KT[a, s] = x
                z += x
            Pz[a] += z
    return impl


@overload(gate_key_rows, jit_options=_OPTS)
def _gate_key_rows(gates, Kf, c, G, R, Pz):
    """The same for phi(K) as rows (a segment's prefix): row s times its factor; Pz += column sums."""
    kind = _kind(gates)
    dt = as_dtype(Kf.dtype).type

    def impl(gates, Kf, c, G, R, Pz):
        for s in range(c):
            for a in range(Kf.shape[1]):
                if kind == 1:
                    Kf[s, a] *= dt(_factor(G, R, c - 1, s))
                elif kind == 2:
                    f = exp_le0(dt(G[c - 1, a] - G[s, a]))
                    Kf[s, a] *= dt(0.0) if R[c - 1, a] > s else f
                Pz[a] += Kf[s, a]
    return impl


@overload(gate_pending, jit_options=_OPTS)
def _gate_pending(gates, P, Pz, lam, c, G, R, has_p):
    """Decay the pending sums P (if they hold values), Pz by the chunk's whole factor; lam += its log
    (lam: log-decay per key dimension since the last fold, float64, -inf after a reset)."""
    kind = _kind(gates)
    if kind == 0:
        return lambda gates, P, Pz, lam, c, G, R, has_p: None

    dt = as_dtype(P.dtype).type

    def impl(gates, P, Pz, lam, c, G, R, has_p):
        for a in range(P.shape[0]):
            if kind == 1:
                reset, g = R[c - 1] >= 0, G[c - 1]
            else:
                reset, g = R[c - 1, a] >= 0, G[c - 1, a]
            f = dt(0.0) if reset else exp_le0(dt(g))
            lam[a] = -np.inf if reset else lam[a] + g
            if has_p:
                for e in range(P.shape[1]):
                    P[a, e] *= f
            Pz[a] *= f
    return impl


gate_buffers = _stub("gate_buffers")


@overload(gate_buffers, jit_options=_OPTS)
def _gate_buffers(gates, chunk):
    """(G, R) for a chunk of ``chunk`` positions: (chunk,) arrays, (chunk, D') per dimension, or empty."""
    kind = _kind(gates)
    if kind == 0:
        return lambda gates, chunk: (np.empty(0, np.float64), np.empty(0, np.int64))
    if kind == 1:
        return lambda gates, chunk: (np.empty(chunk, np.float64), np.empty(chunk, np.int64))
    return lambda gates, chunk: (np.empty((chunk, gates.shape[3]), np.float64),
                                 np.empty((chunk, gates.shape[3]), np.int64))


like = _stub("like")


@overload(like, jit_options=_OPTS)
def _like(x, arr):
    """x converted to arr's element type."""
    dt = as_dtype(arr.dtype).type
    return lambda x, arr: dt(x)
