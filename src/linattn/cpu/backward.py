"""The backward pass of causal linear attention: dq, dk, dv (and the initial state's gradient, and the
per-position terms of a gate's gradient) in one chunkwise scan per head, backwards in time, from the
states at the chunk boundaries that the vjp's forward kept (cpu/chunked.py's ``states``). When heads
are few the scan is cut into segments as the forward kernel's are (a segment first sums the adjoint
entering it: the adjoint updates alone of the chunks after it).

Per head, with the state augmented by Z as one more value column ([S | Z], D x e, e = Dv + 1; v1 =
[v, 1]), the output gradient g, the forward's outputs and denominators: ab_t = [a_t, b_t] = [g_t /
den_t, -(g_t . out_t) / den_t] (without normalisation [g_t, 0]); qs = scale phi(q), kf = phi(k);
within a chunk L_t the sum of the log factors from the chunk's start to t, so that (the factors of
(s, t]) = exp(L_t - L_s), ef_t = exp(L_t) and wf_t = exp(L_end - L_t) (gating.chunk_gates' e and w).
With C the adjoint of the state entering the chunk from after it (the final state's gradient after
the last chunk), M = tril(ab v1^T) and A = tril(qs kf^T), both decayed by exp(L_t - L_s):

- dqf = M kf + ef (ab [S | Z]_start^T)   (then dq = scale phi'(q) dqf)
- dkf = M^T qs + wf (v1 C^T)             (then dk = phi'(k) dkf)
- dv = A^T a + wf (kf C[:, :Dv])
- C before the chunk = exp(L_end) C + (ef ab)^T qs: after the first chunk, the initial state's
  gradient.

The scores M serve dq and dk; no forward state is recomputed. C is kept as the forward kernel keeps
its state (transposed, e x D): pending sums in the compute dtype folded into float64 every
FOLD_EVERY chunks. Extra memory is O(chunk * (D + Dv + chunk) + D * Dv) per item. With gates (one log
factor per position: decay and gates folded into it), rq_t = qs_t . dqs_t and rk_t = kf_t . dkf_t
(before phi') are written for the gates' gradient (its running sums are the caller's).
"""
import numpy as np
from numba import types

from .._jit import array, njit
from .chunked import _current, _init_state, _segment, _state_buffers, _write_state, pending_added
from .elementwise import ELU, RELU, load_rows
from .gating import chunk_gates, gate_buffers, gate_pending, gate_queries, gate_scores, gate_state_factors
from .schedule import take
from .smallgemm import small_gemm, small_gemm_tn, small_gemm_tn_lower
from .threaded import ThreadedKernel
from .vector import transpose_rows
from .views import as_contiguous


@njit(helper=True)
def _load_adjoints(g, out, den, i0, c, normalize, AB):
    """AB[t, :Dv + 1] = [a_t, b_t] of position i0 + t (the gradients of the numerator and of the
    denominator): [g / den, -(g . out) / den], or [g, 0] without normalisation."""
    dv = g.shape[1]
    for t in range(c):
        gt, row = as_contiguous(g[i0 + t]), AB[t]
        if normalize:
            ot = as_contiguous(out[i0 + t])
            inv = 1 / den[i0 + t]
            dot = gt[0] - gt[0]
            for e in range(dv):
                dot += gt[e] * ot[e]
            for e in range(dv):
                row[e] = gt[e] * inv
            row[dv] = -dot * inv
        else:
            for e in range(dv):
                row[e] = gt[e]
            row[dv] = 0


@njit(helper=True)
def _load_values(v, i0, c, V1):
    """V1[t, :Dv + 1] = [v_{i0+t}, 1]."""
    dv = v.shape[1]
    for t in range(c):
        src, row = as_contiguous(v[i0 + t]), V1[t]
        for e in range(dv):
            row[e] = src[e]
        row[dv] = 1


@njit(helper=True)
def _times_derivative(R, Y, c, fm, s, dst, i0, r, has_r):
    """dst[i0 + t] = R[t] times the derivative of s phi at x_t, from Y[t] = s phi(x_t) (s > 0; elu + 1:
    min(Y, s), the exp below 0 times s; relu: s where Y > 0; identity: s), and r[i0 + t] = Y[t] . R[t]
    when ``has_r``."""
    d = R.shape[1]
    zero = s - s
    for t in range(c):
        rt, yt, row = R[t], Y[t], as_contiguous(dst[i0 + t])
        if has_r:
            acc = 0.0
            for a in range(d):
                acc += np.float64(yt[a]) * np.float64(rt[a])
            r[i0 + t] = acc
        if fm == ELU:
            for a in range(d):
                y = yt[a]
                row[a] = rt[a] * (y if not y > s else s)
        elif fm == RELU:
            for a in range(d):
                row[a] = rt[a] * (s if yt[a] > zero else zero)
        else:
            for a in range(d):
                row[a] = s * rt[a]


@njit(helper=True)
def _zero_rows(x, i0, i1):
    for i in range(i0, i1):
        row = as_contiguous(x[i])
        for e in range(row.shape[0]):
            row[e] = 0


@njit(helper=True)
def _scale_columns(X, c, ncols, s):
    """X[:c, :ncols] *= s."""
    if s != 1:
        for t in range(c):
            row = X[t]
            for a in range(ncols):
                row[a] *= s


@njit(helper=True)
def _times_factors(X, c, f, decayed):
    """Row t of X times f[t] (with gates)."""
    if decayed:
        for t in range(c):
            row, ft = X[t], f[t]
            for a in range(X.shape[1]):
                row[a] *= ft


@njit(helper=True)
def _chunk(q, k, v, g, out, den, fm, normalize, s, one, i0, c, St, has_st, has_c, own, gates, dq, dk, dv, rq, rk,
           has_r, QA, QA2, KT, KT2, V1, KF, R, CT, C, sums, G, Rg, F, X):
    """Positions [i0, i0 + c) of one head: dq, dk, dv when ``own`` (the adjoint after the chunk in CT,
    e x D, when ``has_c``; the state before it in St when ``has_st``). Leaves QA[:c, :e] = ef ab and
    QA2[:c, :D] = qs for the adjoint's update."""
    e, d = KT.shape[0], KT2.shape[0]
    dvd, decayed = e - 1, gates.ndim > 1
    _load_adjoints(g, out, den, i0, c, normalize, QA)
    load_rows(q, i0, c, fm, QA2)
    _scale_columns(QA2, c, d, s)
    if own:
        _load_values(v, i0, c, V1)
        transpose_rows(V1, KT, sums, c)
        load_rows(k, i0, c, fm, KF)
        transpose_rows(KF, KT2, sums, c)
        gate_scores(gates, QA, KT, KF, e, c, G, Rg, F, X)  # M
        gate_scores(gates, QA2, KT2, KF, d, c, G, Rg, F, X)  # A
        dvc = dv[i0:i0 + c]
        if has_c:  # dv = wf (kf C[:, :Dv]) + A^T a
            transpose_rows(CT, C, sums, dvd)
            small_gemm(KF[:c], C, dvc, False, -1, -1)
            _times_factors(dvc, c, F[1], decayed)
        small_gemm_tn_lower(QA2[:c, d:d + c], QA[:c, :dvd], dvc, has_c)
        if has_c:  # dkf = wf (v1 C^T) + M^T qs
            small_gemm(V1[:c], CT, R[:c], False, -1, -1)
            _times_factors(R, c, F[1], decayed)
        small_gemm_tn_lower(QA[:c, e:e + c], QA2[:c, :d], R[:c], has_c)
        _times_derivative(R, KF, c, fm, one, dk, i0, rk, has_r)
    gate_queries(gates, QA, e, c, F)  # ab rows times ef
    if own:  # dqf = ef (ab S^T) + M kf
        if has_st:
            small_gemm(QA[:c, :e], St, R[:c], False, -1, -1)
        small_gemm(QA[:c, e:e + c], KF[:c], R[:c], has_st, 0, -1)
        _times_derivative(R, QA2, c, fm, s, dq, i0, rq, has_r)


@njit(helper=True)
def _segment_backward(q, k, v, g, out, den, fm, normalize, s, one, length, chunk, c0, c1, nch, last, states, has_s0,
                      H0, Z0, h, gates, ld, status, dq, dk, dv, H_out, Z_out, rq, rk, has_r, QA, QA2, KT, KT2, V1, KF,
                      R, CT, C, sums, G, Rg, F, X):
    """Chunks [c0, c1) of one head (views (N, X)) from the adjoint after them: the update alone of the
    chunks [c1, nch) first, from H0[h] (the final state's gradient, transposed; none when H0 has no
    rows). The ``last`` segment (the one with chunk 0) zeroes the rows past ``length`` and writes the
    adjoint before chunk 0, the initial state's gradient, to H_out[h] when it has rows."""
    e, d = KT.shape[0], KT2.shape[0]
    decayed = gates.ndim > 1
    P, B, acc, Pz, Bz, Z, accz, lam = _state_buffers(e, d, QA.dtype)
    fb = np.empty(e if decayed else 0, QA.dtype)
    has_acc = _init_state(H0, Z0, h, acc, accz, B, Bz)
    has_p = False
    gate_state_factors(gates, lam, fb)
    _current(B, Bz, P, Pz, CT, Z, has_acc, has_p, fb, decayed)
    for j in range(nch - c0):
        ci = nch - 1 - j
        i0 = ci * chunk
        c = min(chunk, length - i0)
        chunk_gates(gates, h, ld, i0, c, G, Rg, F, status)
        has_st = ci > 0 or has_s0
        has_c = has_acc or has_p
        own = ci < c1
        _chunk(q, k, v, g, out, den, fm, normalize, s, one, i0, c, states[ci], has_st, has_c, own, gates, dq, dk, dv,
               rq, rk, has_r, QA, QA2, KT, KT2, V1, KF, R, CT, C, sums, G, Rg, F, X)
        beta = gate_pending(gates, P, Pz, lam, c, G, Rg, F, has_p)
        small_gemm_tn(QA[:c, :e], QA2[:c, :d], P, beta if has_p else 0)  # the adjoint's pending update
        has_acc, has_p = pending_added(j, acc, accz, B, Bz, P, Pz, has_acc, lam, decayed)
        gate_state_factors(gates, lam, fb)
        _current(B, Bz, P, Pz, CT, Z, has_acc, has_p, fb, decayed)
    if last:
        for x in (dq, dk):
            _zero_rows(x, length, x.shape[0])
        _zero_rows(dv, length, dv.shape[0])
        if H_out.shape[0] > 0:
            _write_state(acc, accz, P, Pz, h, H_out, Z_out, has_acc, has_p, lam, decayed)


def _causal_backward(q, k, v, g, out, den, fm, normalize, s, lengths, chunk, frac, states, has_s0, H0, Z0, gates, ld,
                     dq, dk, dv, H_out, Z_out, rq, rk, status, counter):
    """Gradients of causal linear attention for every head (see the module docstring).

    q, k: (G1, G2, N, D); v, g, out: (G1, G2, N, Dv); den: (G1, G2, N), the forward's denominators;
    all with unit stride along their last axis. ``fm``: cpu/elementwise.py's map code; ``s``: the
    scale of phi(q). ``states`` (G1, G2, chunks, Dv + 1, D): the forward's state [S | Z]^T at the
    start of every chunk of ``chunk`` positions (the first one zero unless ``has_s0``). H0: the final
    state's gradient transposed, [dS | dZ]^T (heads, Dv + 1, D), or an array with no rows for zero;
    Z0: zeros (heads, Dv + 1) (the Z of cpu/chunked.py's state helpers, unused here). ``gates``: the
    log factor of each position (G1, G2, N), zero past its head's length, or an empty 1-D array; ld:
    zeros per head. Out: dq, dk, dv (zero past ``lengths``), H_out (heads, Dv + 1, D): the initial
    state's gradient transposed (unless it has no rows), rq, rk (heads, N) in float64 with gates
    (else (1, 0)); Z_out: scratch (heads, Dv + 1) where H_out has rows. Run by
    threaded.ThreadedKernel: each thread takes items (head, segment) from ``counter``.
    """
    g2, n, d = q.shape[1], q.shape[2], q.shape[3]
    e, dt = v.shape[3] + 1, dq.dtype
    has_r = rq.shape[1] > 0
    one = np.ones(1, dt)[0]
    QA = np.empty((chunk, e + chunk), dt)  # [ab | M]
    QA2 = np.empty((chunk, d + chunk), dt)  # [qs | A]
    KT = np.empty((e, chunk), dt)  # v1^T
    KT2 = np.empty((d, chunk), dt)  # kf^T
    V1 = np.empty((chunk, e), dt)
    KF = np.empty((chunk, d), dt)
    R = np.empty((chunk, d), dt)
    CT = np.empty((e, d), dt)  # the adjoint, transposed
    C = np.empty((d, e - 1), dt)  # its value columns
    sums = np.zeros(max(d, e), dt)
    G, Rg, F, X = gate_buffers(gates, chunk, dt)
    nseg = frac.shape[0] - 1
    items = q.shape[0] * g2 * nseg
    item = take(counter)
    while item < items:
        length = lengths[item // nseg]
        nch = (length + chunk - 1) // chunk
        h, sg, f0, f1 = _segment(item, nseg, frac, nch)  # mirrored: a segment's prefix is the chunks after it
        h1, h2 = h // g2, h % g2
        last = sg == nseg - 1
        r = h if has_r else 0
        if f0 < f1 or last:
            _segment_backward(q[h1, h2], k[h1, h2], v[h1, h2], g[h1, h2], out[h1, h2], den[h1, h2], fm, normalize, s,
                              one, length, chunk, nch - f1, nch - f0, nch, last, states[h1, h2], has_s0, H0, Z0, h,
                              gates, ld, status, dq[h1, h2], dk[h1, h2], dv[h1, h2], H_out, Z_out,
                              rq[r], rk[r], has_r, QA, QA2, KT, KT2, V1, KF, R,
                              CT, C, sums, G, Rg, F, X)
        item = take(counter)


def _signature(dt, kind):
    seq, i64, f64 = array(dt, 4, "A", readonly=True), types.int64, types.float64
    gate_t = array(dt, 3, "A", readonly=True) if kind else array(dt, 1, readonly=True)
    return types.void(seq, seq, seq, seq, seq, array(dt, 3, "A", readonly=True), i64, types.boolean, dt,
                      array(i64, 1, readonly=True), i64, array(f64, 1, readonly=True),
                      array(dt, 5, "A", readonly=True), types.boolean, array(dt, 3, readonly=True),
                      array(dt, 2, readonly=True), gate_t, array(f64, 1, readonly=True),
                      array(dt, 4, "A"), array(dt, 4, "A"), array(dt, 4, "A"), array(dt, 3), array(dt, 2),
                      array(f64, 2, "A"), array(f64, 2, "A"), array(i64, 1))


#: kind: 0 without gates, 1 with a log factor per position (decay and gates folded into it)
causal_backward = ThreadedKernel(_causal_backward, _signature)
