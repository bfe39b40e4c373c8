"""The backward pass of causal linear attention: dq, dk, dv (and the initial state's gradient, and the
per-position terms of a gate's gradient) in two chunkwise scans per head, one forward and one
backward in time, run as separate work items; when heads are few, each scan is cut into segments
as the forward kernel's are (a segment first sums the state entering it: the state updates alone
of the chunks before it).

Per head, with the state augmented by Z as one more value column (S, Dv + 1 columns; v1 = [v, 1]),
the forward's denominators ``den`` and outputs ``out``, and the output gradient g: ab_t = [a_t, b_t]
= [g_t / den_t, -(g_t . out_t) / den_t] (without normalisation [g_t, 0]); qs = scale phi(q). Then

- dq_t = scale phi'(q_t) S_t ab_t: causal attention forward in time with queries ab, keys v1 and
  values phi(k), from the initial state S_0^T;
- with H_t = sum_{i >= t} (factors of (t, i]) qs_i ab_i^T + (factors of (t, end]) dS_end, the adjoint
  of the state: dk_t = phi'(k_t) H_t v1_t and dv_t = H_t[:, :Dv]^T phi(k_t): causal attention
  backwards in time with queries v1 (and phi(k)), keys ab (and qs), values qs (and a), from dS_end^T,
  the log factors shifted by a position (the adjoint after t decays by t + 1's factor); its final
  state is the initial state's gradient (times position 0's factor: the caller's).

Each scan is the forward kernel's chunk: [X | tril(X Y^T), decayed] @ [state ; W], then the state
update (Y times its factors)^T W folded into float64 every FOLD_EVERY chunks (cpu/chunked.py's
helpers, cpu/gating.py's for the factors). The backward scan reads reversed views of its head, so
its "causal" order is time reversed and the same code serves both. Extra memory is O(chunk * (D +
Dv) + D * Dv) per item. With gates, rq_t = qs_t . dqs_t and rk_t = phi(k_t) . dkf_t (before phi')
are written for the gates' gradient (its running sums are the caller's).
"""
import numpy as np
from numba import types

from .._jit import array, njit
from .chunked import _current, _init_state, _segment, _state_buffers, _write_state, pending_added
from .elementwise import ELU, RELU, load_rows
from .gating import (chunk_gates, gate_buffers, gate_key_columns, gate_pending, gate_queries, gate_scores,
                     gate_state_factors)
from .schedule import take
from .smallgemm import noinline, small_gemm
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
def _scale_rows(X, c, s):
    if s != 1:
        for t in range(c):
            row = X[t]
            for a in range(X.shape[1]):
                row[a] *= s


@njit(helper=True)
def _times_derivative(R, Y, c, fm, s, one, dst, i0, r, has_r):
    """dst[i0 + t] = s R[t] phi'(x_t), from Y[t] = phi(x_t) (elu + 1: min(y, 1), the exp below 0;
    relu: 1 where y > 0; identity: 1), and r[i0 + t] = s Y[t] . R[t] when ``has_r``. ``one``: 1 in
    the arrays' dtype."""
    d = R.shape[1]
    zero = one - one
    for t in range(c):
        rt, yt, row = R[t], Y[t], as_contiguous(dst[i0 + t])
        if has_r:
            acc = 0.0
            for a in range(d):
                acc += np.float64(yt[a]) * np.float64(rt[a])
            r[i0 + t] = s * acc
        if fm == ELU:
            for a in range(d):
                y = yt[a]
                row[a] = s * rt[a] * (y if not y > one else one)
        elif fm == RELU:
            for a in range(d):
                row[a] = s * rt[a] * (one if yt[a] > zero else zero)
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
def _chunk_output(gates, QA, KT, SV, x, c, G, Rg, F, X, has_state, res):
    """res[:c] = [X | tril(X Y^T), decayed] @ [state ; W], with X in QA[:c, :x], Y^T in KT, the state
    in SV[:x] and W in SV[x:x + c] (the forward kernel's chunk; QA's X rows are left scaled by the
    factors of the state before the chunk)."""
    gate_scores(gates, QA, KT, SV, x, c, G, Rg, F, X)
    gate_queries(gates, QA, x, c, F)
    if has_state:
        small_gemm(QA[:c, :x + c], SV[:x + c], res, False, x, -1)
    else:
        small_gemm(QA[:c, x:x + c], SV[x:x + c], res, False, 0, -1)


@njit(helper=True)
def _chunk_update(gates, KT, SV, x, c, G, Rg, F, P, Pz, lam, has_p):
    """P = (decayed) P + (Y times its factors at the chunk's end)^T W (KT's columns are scaled)."""
    beta = gate_pending(gates, P, Pz, lam, c, G, Rg, F, has_p)
    gate_key_columns(gates, KT, SV, c, F, Pz)
    small_gemm(KT[:, :c], SV[x:x + c], P, beta if has_p else 0, -1, -1)


@njit(helper=True)
def _scan(q, k, v, g, out, den, fm, normalize, s, one, start, chunk, c0, c1, last, S0, Z0, h, gates, ld, status,
          backwards, dq, dk, dv, H_out, Z_out, r, has_r, QA, SV, KT, KF, R, QA2, SV2, KT2, sums, G, Rg, F, X):
    """Chunks [c0, c1) of one scan over positions [start, N) of one head's (N, X) views (reversed views
    when ``backwards``), the state before chunk c0 summed first (its update alone for the chunks
    before: the forward kernel's segment prefix): forward, dq from the state S0[h]; backwards, dk and
    dv from the adjoint S0[h] (= dS_end^T). The ``last`` segment zeroes the rows before ``start``
    (backwards: past the length) and writes the final adjoint to H_out[h] when it has rows."""
    noinline()  # called for both directions: one compiled copy
    n, e, d = q.shape[0], KT.shape[0], SV.shape[1]
    dvdim = e - 1
    decayed = gates.ndim > 1
    P, B, acc, Pz, Bz, Z, accz, lam = _state_buffers(e, d, QA.dtype)
    fb = np.empty(e if decayed else 0, QA.dtype)
    has_acc = _init_state(S0, Z0, h, acc, accz, B, Bz)
    has_p = False
    gate_state_factors(gates, lam, fb)
    _current(B, Bz, P, Pz, SV, Z, has_acc, has_p, fb, decayed)
    for ci in range(c1):
        i0 = start + ci * chunk
        c = min(chunk, n - i0)
        own = ci >= c0
        chunk_gates(gates, h, ld, i0, c, G, Rg, F, status)
        if not backwards:  # X = ab, Y = v1, W = phi(k); out: dq
            transpose_rows(v[i0:], KT, sums, c)
            for t in range(c):
                KT[dvdim, t] = 1
            load_rows(k, i0, c, fm, SV[e:])
            if own:
                _load_adjoints(g, out, den, i0, c, normalize, QA)
                _chunk_output(gates, QA, KT, SV, e, c, G, Rg, F, X, has_acc or has_p, R[:c])
                load_rows(q, i0, c, fm, KF)
                _times_derivative(R, KF, c, fm, s, one, dq, i0, r, has_r)
        else:  # X = v1, Y = ab, W = qs; out: dk; then X = phi(k), Y = qs, W = a, state H[:, :Dv]; out: dv
            _load_adjoints(g, out, den, i0, c, normalize, SV2[d:])  # [a, b] rows: a is dv's W
            transpose_rows(SV2[d:], KT, sums, c)
            load_rows(q, i0, c, fm, SV[e:])
            _scale_rows(SV[e:], c, s)
            if own:
                _load_values(v, i0, c, QA)
                transpose_rows(SV[e:], KT2, sums, c)
                load_rows(k, i0, c, fm, QA2)
                transpose_rows(SV, SV2, sums, dvdim)  # H[:, :Dv] from H^T
                _chunk_output(gates, QA, KT, SV, e, c, G, Rg, F, X, has_acc or has_p, R[:c])
                _times_derivative(R, QA2, c, fm, one, one, dk, i0, r, has_r)
                _chunk_output(gates, QA2, KT2, SV2, d, c, G, Rg, F, X, has_acc or has_p, dv[i0:i0 + c])
        _chunk_update(gates, KT, SV, e, c, G, Rg, F, P, Pz, lam, has_p)
        has_acc, has_p = pending_added(ci, acc, accz, B, Bz, P, Pz, has_acc, lam, decayed)
        gate_state_factors(gates, lam, fb)
        _current(B, Bz, P, Pz, SV, Z, has_acc, has_p, fb, decayed)
    if last and backwards:
        _zero_rows(dk, 0, start)
        _zero_rows(dv, 0, start)
        if H_out.shape[0] > 0:
            _write_state(acc, accz, P, Pz, h, H_out, Z_out, has_acc, has_p, lam, decayed)
    elif last:
        _zero_rows(dq, n, dq.shape[0])


def _causal_backward(q, k, v, g, out, den, fm, normalize, s, lengths, chunk, frac, S0, H0, Z0, gates, gates_rev, ld,
                     dq, dk, dv, H_out, Z_out, rq, rk, status, counter):
    """Gradients of causal linear attention for every head (see the module docstring).

    q, k: (G1, G2, N, D); v, g, out: (G1, G2, N, Dv); den: (G1, G2, N), the forward's denominators;
    all with unit stride along their last axis. ``fm``: cpu/elementwise.py's map code; ``s``: the
    scale of phi(q). S0: the initial state transposed, [S_0 | Z_0]^T (heads, Dv + 1, D), H0: the
    final state's gradient the same way, or arrays with no rows for zeros; Z0: zeros (heads, Dv + 1)
    (the Z of cpu/chunked.py's state helpers, unused here). ``gates``: the log factor of each position
    (G1, G2, N), zero past its head's length, or an empty 1-D array; ``gates_rev``: the same reversed
    in time and shifted by one position (position N - 1 - t holds the factor of t + 1, position 0
    zero); ld: zeros per head. Out: dq, dk, dv (zero past ``lengths``), H_out (heads, Dv + 1, D): the
    adjoint of the state before position 0's factor (unless it has no rows), rq, rk (heads, N) in
    float64 with gates (else (1, 0)); Z_out: scratch (heads, Dv + 1) where H_out has rows. Run by
    threaded.ThreadedKernel: each thread takes items (head, segment, direction) from ``counter``.
    """
    g2, n, d = q.shape[1], q.shape[2], q.shape[3]
    e, dt = v.shape[3] + 1, dq.dtype
    has_r = rq.shape[1] > 0
    one = np.ones(1, dt)[0]
    QA = np.empty((chunk, e + chunk), dt)  # [X | scores]
    SV = np.empty((e + chunk, d), dt)  # [state ; W]
    KT = np.empty((e, chunk), dt)
    KF = np.empty((chunk, d), dt)
    R = np.empty((chunk, d), dt)
    QA2 = np.empty((chunk, d + chunk), dt)
    SV2 = np.empty((d + chunk, e), dt)  # [H[:, :Dv] ; a], a column of b past the values
    KT2 = np.empty((d, chunk), dt)
    sums = np.zeros(max(d, e), dt)
    G, Rg, F, X = gate_buffers(gates, chunk, dt)
    nseg = frac.shape[0] - 1
    items = 2 * q.shape[0] * g2 * nseg
    item = take(counter)
    while item < items:
        backwards = item % 2 == 0  # the longer backward scans first
        length = lengths[item // (2 * nseg)]
        h, sg, c0, c1 = _segment(item // 2, nseg, frac, (length + chunk - 1) // chunk)
        h1, h2 = h // g2, h % g2
        r = (rk if backwards else rq)[h if has_r else 0]
        last = sg == nseg - 1
        if c0 < c1 or last:
            if backwards:
                _scan(q[h1, h2][::-1], k[h1, h2][::-1], v[h1, h2][::-1], g[h1, h2][::-1], out[h1, h2][::-1],
                      den[h1, h2][::-1], fm, normalize, s, one, n - length, chunk, c0, c1, last, H0, Z0, h, gates_rev,
                      ld, status, True, dq[h1, h2], dk[h1, h2][::-1], dv[h1, h2][::-1], H_out, Z_out, r[::-1], has_r,
                      QA, SV, KT, KF, R, QA2, SV2, KT2, sums, G, Rg, F, X)
            else:
                _scan(q[h1, h2][:length], k[h1, h2][:length], v[h1, h2][:length], g[h1, h2][:length],
                      out[h1, h2][:length], den[h1, h2][:length], fm, normalize, s, one, 0, chunk, c0, c1, last, S0,
                      Z0, h, gates, ld, status, False, dq[h1, h2], dk[h1, h2], dv[h1, h2], H_out, Z_out, r, has_r,
                      QA, SV, KT, KF, R, QA2, SV2, KT2, sums, G, Rg, F, X)
        item = take(counter)


def _signature(dt, kind):
    seq, i64, f64 = array(dt, 4, "A", readonly=True), types.int64, types.float64
    gate_t = array(dt, 3, "A", readonly=True) if kind else array(dt, 1, readonly=True)
    return types.void(seq, seq, seq, seq, seq, array(dt, 3, "A", readonly=True), i64, types.boolean, dt,
                      array(i64, 1, readonly=True), i64, array(f64, 1, readonly=True), array(dt, 3, readonly=True),
                      array(dt, 3, readonly=True),
                      array(dt, 2, readonly=True), gate_t, gate_t, array(f64, 1, readonly=True),
                      array(dt, 4, "A"), array(dt, 4, "A"), array(dt, 4, "A"), array(dt, 3), array(dt, 2),
                      array(f64, 2, "A"), array(f64, 2, "A"), array(i64, 1))


#: kind: 0 without gates, 1 with a log factor per position (decay and gates folded into it)
causal_backward = ThreadedKernel(_causal_backward, _signature)
