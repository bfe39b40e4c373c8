"""The backward of non-causal linear attention: dq, dk, dv in one kernel, a pass over a head's queries, then its keys.

Per head, with v1 = [v, 1], the state [S | Z] = sum_s phi(k_s) v1_s^T (D x e, e = Dv + 1), qs = scale
phi(q), den_t = qs_t . Z + eps, the output gradient g and the forward's output out: ab_t = [a_t, b_t] =
[g_t / den_t, -(g_t . out_t) / den_t] (without normalisation [g_t, 0]) and G = sum_t qs_t ab_t^T
(D x e, the state's gradient). Then

- dq_t = scale phi'(q_t) (ab_t [S | Z]^T)
- dk_s = phi'(k_s) (v1_s G^T)
- dv_s = phi(k_s) G[:, :Dv]

[S | Z] is the forward's (its state, which linear_attention_vjp keeps: summing it again read k and v and
computed phi(k), a quarter of the backward's time). One pass over a head's queries makes, chunk by chunk,
scale phi(q), den and ab once for dq's rows and for G's sum (a product each); a second over its keys
writes dk's and dv's rows from G (two products per chunk): four products per position against the
forward's two, each input read once (B1 H8 N2048 D64 float32: 3.9-4.0 times the same-FLOP GEMM with
[S | Z] summed again and the queries read twice, 3.1 without the first, 2.75-2.9 with neither). k and v may have
another length than q (cross-attention): the two passes walk the queries' chunks and the keys' chunks
apart. G is summed as the forward kernel sums its state (pending float32 sums folded into float64 every
FOLD_EVERY chunks). When heads are few, a head is cut into segments (runtime.plan) and the kernel runs
twice: each segment's item sums its own query chunks' part of G and writes their dq, then its key chunks'
dk and dv from the sum of the parts. phi and phi' are elu + 1, relu or identity (other maps: their
features are the inputs, their ``vjp`` is applied after). dq, dk, dv are written once; no array of the
inputs' size is made. A head of few queries and keys for its features (the
forward's chunked.few_positions) takes its rows from its scores instead of the sums (_scores_backward).
"""
import numpy as np
from numba import types

from .._jit import array, njit
from .backward import _load_adjoints, _load_values, _scale_columns, _times_derivative
from .buffers import empty, one_of
from .chunked import (FOLD_EVERY, _rows_to_touch, _segment, _state_buffers, few_positions, folded_after,
                      zero_unless_summed)
from .mapfns import load_features, map_state, mapped_dim
from .runtime import kernel_section
from .schedule import take
from .smallgemm import noinline, small_gemm, small_gemm_tn
from .threaded import ThreadedKernel
from .vector import transpose_rows
from .views import keep_alive, touch_rows, unowned


@njit(helper=True)
def _queries_and_adjoints(q, g, out, i0, c, mp, s, eps, normalize, Z, QS, AB, DEN):
    """QS[:c] = scale phi(q) and AB[:c] = [a, b] for positions [i0, i0 + c) of one head (Z: the state's
    Z; DEN: scratch for the denominators; ``mp``: the map, mapfns.map_state's tuple)."""
    load_features(q, i0, c, mp, QS)
    d = QS.shape[1]
    if normalize:
        for t in range(c):
            row = QS[t]
            acc = row[0] - row[0]
            for a in range(d):
                acc += row[a] * Z[a]
            DEN[t] = s * acc + eps
    _scale_columns(QS, c, d, s)
    _load_adjoints(g[i0:i0 + c], out[i0:i0 + c], DEN, int(0), c, normalize, AB)


@njit(helper=True)
def _queries_pass(q, g, out, mp, fm, da, s, eps, normalize, chunk, c0, c1, QS, AB, DEN, R, Z, ST, no_r, XB, dq, sbuf):
    """For chunks [c0, c1) of one head's queries: dq's rows (from the state's [S | Z]^T, ST, and Z) and, in
    the float64 accumulator of ``sbuf`` (_state_buffers' acc, D x e), G's sum (scale phi(Q))^T [a | b] (zero
    when there are no chunks): the queries, their features and adjoints made once for both."""
    P = sbuf[0]
    n = q.shape[0]
    has_acc = bool(False)  # bool()/int(): run-time values, not literals (see _jit)
    for ci in range(c0, c1):
        i0 = ci * chunk
        c = min(chunk, n - i0)
        beta = 1.0 if (ci - c0) % FOLD_EVERY else 0.0
        t = _rows_to_touch(ci, c0, c1, chunk, n)  # the next chunks' rows into the cache
        for x in (q, g, out):
            touch_rows(x, i0, t)
        _queries_and_adjoints(q, g, out, i0, c, mp, s, eps, normalize, Z, QS, AB, DEN)
        small_gemm_tn(QS[:c], AB[:c], P, beta)
        has_acc = folded_after(ci, c0, c1, sbuf, has_acc)
        small_gemm(AB[:c], ST, R[:c], False, -1, -1)  # ab [S | Z]^T
        _times_derivative(R, QS, c, fm, s, dq, i0, no_r, bool(False), q, mp, da, XB)
    zero_unless_summed(has_acc, sbuf)


@njit(helper=True)
def _scores_backward(q, k, v, g, out, mp, da, s, eps, normalize, KF, V1, QS, AB, DEN, R, Z, sums, one, no_r, XB, dq, dk,
                     dv):
    """dq, dk, dv of one head of few queries and keys (chunked.few_positions: views (nq, X), (nk, X), each at
    most a chunk, nq > 0) from their scores instead of the sums: with A = qs phi(K)^T and M = ab v1^T
    (nq x nk; M[t, s] = ab_t . v1_s), ab [S | Z]^T = M phi(K), v1 G^T = M^T qs and phi(K) G[:, :Dv] = A^T a,
    three products of nq nk (D' or Dv) against the sums' five of (nq or nk) D' (Dv + 1) (B1 H8 N16 D64:
    a quarter of the multiply-adds). Z (the keys' sum, for the denominators) into ``Z``; ``sums``: a sink
    of at least Dv + 1 values; ``mp``, ``da``, XB: the map, its derivative's address and scratch, as
    backward._times_derivative takes them."""
    noinline()  # (compiled once, not again where it is called)
    nq, nk, d, e = q.shape[0], k.shape[0], KF.shape[1], V1.shape[1]
    dt = KF.dtype
    i0 = int(0)  # bool()/int(): run-time values, not literals (see _jit)
    KT, VT, A, M = empty((d, nk), dt), empty((e, nk), dt), empty((nq, nk), dt), empty((nq, nk), dt)
    load_features(k, i0, nk, mp, KF)
    _load_values(v, i0, nk, V1)
    for a in range(d):
        Z[a] = 0
    transpose_rows(KF, KT, Z, nk)
    transpose_rows(V1, VT, sums, nk)
    _queries_and_adjoints(q, g, out, i0, nq, mp, s, eps, normalize, Z, QS, AB, DEN)
    small_gemm(QS[:nq], KT, A, False, -1, -1)  # A = qs phi(K)^T
    small_gemm(AB[:nq], VT, M, False, -1, -1)  # M = ab v1^T
    small_gemm(M, KF[:nk], R[:nq], False, -1, -1)  # ab [S | Z]^T
    _times_derivative(R, QS, nq, mp[0], s, dq, i0, no_r, bool(False), q, mp, da, XB)
    small_gemm_tn(M, QS[:nq], R[:nk], 0)  # v1 G^T
    _times_derivative(R, KF, nk, mp[0], one, dk, i0, no_r, bool(False), k, mp, da, XB)
    small_gemm_tn(A, AB[:nq, :e - 1], dv[:nk], 0)  # phi(K) G[:, :Dv]


@njit(helper=True)
def _add_parts(parts, acc):
    """acc = the sum of a head's segments' parts (nseg, D, e), in float64."""
    for a in range(acc.shape[0]):
        for e in range(acc.shape[1]):
            acc[a, e] = 0
    for s in range(parts.shape[0]):
        for a in range(acc.shape[0]):
            row = parts[s, a]
            for e in range(acc.shape[1]):
                acc[a, e] += row[e]


@njit(helper=True)
def _copy_matrix(src, dst):
    """dst = src (D x e; a float64 sum into the compute dtype or into a part; the forward's [S | Z])."""
    for a in range(src.shape[0]):
        row = dst[a]
        for e in range(src.shape[1]):
            row[e] = src[a, e]


def _noncausal_backward(q, k, v, g, out, fm, fp, fa, da, s, eps, normalize, lengths, qlengths, chunk, frac, known, dq,
                        dk, dv, phase, parts, counter):
    """Gradients of non-causal linear attention for every head (see the module docstring).

    q: (G1, G2, N, D), k: (G1, G2, Nk, D); v: (G1, G2, Nk, Dv), g (the output's gradient), out (the
    forward's result): (G1, G2, N, Dv); dq, dk, dv like q, k, v; every array with unit stride along its
    last axis. Only the first lengths[head] keys of a head are read (right-padded keys), and its first
    qlengths[head] rows of q, g and out (right-padded queries); dk, dv and dq are 0 past them. ``fm``, ``fp``,
    ``fa``, ``da``: the map (map_grad.kernel_map: its code, parameters, the addresses of its C function and
    of its derivative's; codes 0-2 applied inline; an elementwise map, or Taylor or DPFP: D' features of D,
    dq and dk the gradients of q and k), ``s``: the scale of phi(q). ``known`` (heads, D', Dv + 1): each
    head's [S | Z] as the forward made it (its state). ``frac`` splits each head's chunks into segments, one
    work item each. Run by threaded.ThreadedKernel: each thread takes items from ``counter``. ``phase`` 2:
    each item writes its head's dq and sums its G, then writes dk and dv. With several segments a head the
    kernel runs twice instead: ``phase`` 0, each item writes its query chunks' dq and sums their part of G
    into parts[head, segment]; 1, its key chunks' dk and dv from the sum of the parts (float64, (heads, nseg,
    D', Dv + 1)).
    """
    g2, d = q.shape[1], mapped_dim(fm, fp, q.shape[3])  # (d: D', the features)
    e, dt = v.shape[3] + 1, dq.dtype
    one = one_of(dt)
    mapper = map_state(fm, fp, fa, q.shape[3], d, dt)
    mp = unowned(mapper)  # (its parameters are shared by the threads: each view's atomic add contended)
    q, k, v, g, out, known, dq, dk, dv, parts = unowned((q, k, v, g, out, known, dq, dk, dv, parts))  # (see chunked)
    owners = (empty((chunk, d), dt), empty((chunk, e), dt), empty((chunk, d), dt), empty((chunk, e), dt),
              empty((chunk, d), dt), empty(chunk, dt), empty((d, e), dt), empty((d, e), dt), empty(d, dt),
              empty((e, d), dt), empty((e, d), dt), empty(max(d, e), dt), empty((1, 1), np.float64),
              empty((2 * chunk if da != 0 else 0, q.shape[3]), dt))
    # phi(K), [v, 1], scale phi(Q), [a | b], the products' rows, the denominators, [S | Z], G, Z, their
    # transposes, a sink for transpose_rows' sums, no gate terms (for _times_derivative), the rows of q or k
    # for a map's derivative and its result
    KF, V1, QS, AB, R, DEN, S, G, Z, ST, GT, sums, no_r, XB = unowned(owners)
    sbuf = _state_buffers(d, e, dt)
    acc = sbuf[2]
    nseg = frac.shape[0] - 1
    n = q.shape[2]
    nchunks, kchunks = (n + chunk - 1) // chunk, (k.shape[2] + chunk - 1) // chunk
    items = q.shape[0] * g2 * nseg
    item = take(counter)
    while item < items:
        h, sg, c0, c1 = _segment(item, nseg, frac, nchunks)  # the segment's query chunks, then its key chunks
        nk, nq = lengths[h], qlengths[h]
        kc, qc = (nk + chunk - 1) // chunk, (nq + chunk - 1) // chunk  # (this head's chunks of keys, queries)
        k0, k1 = _segment(item, nseg, frac, kchunks)[2:]
        k0, k1, c0, c1 = min(k0, kc), min(k1, kc), min(c0, qc), min(c1, qc)
        h1, h2 = h // g2, h % g2
        qh, kh, vh, gh, oh = q[h1, h2][:nq], k[h1, h2][:nk], v[h1, h2][:nk], g[h1, h2][:nq], out[h1, h2][:nq]
        if phase == 2 and nq > 0 and few_positions(nq, nk, d, e - 1, chunk):  # (one segment a head)
            dqh, dkh, dvh = dq[h1, h2], dk[h1, h2], dv[h1, h2]
            dqh[nq:] = 0
            dkh[nk:] = 0
            dvh[nk:] = 0
            _scores_backward(qh, kh, vh, gh, oh, mp, da, s, eps, normalize, KF, V1, QS, AB, DEN, R, Z, sums, one,
                             no_r, XB, dqh, dkh, dvh)
            item = take(counter)
            continue
        dqh, dkh, dvh = dq[h1, h2], dk[h1, h2], dv[h1, h2]
        if phase != 1:  # the queries' chunks: dq, and G (the whole head's, or this segment's part for the next run)
            _copy_matrix(known[h], S)  # [S | Z]: the forward's
            for a in range(d):
                Z[a] = S[a, e - 1]
            transpose_rows(S, ST, sums, d)
            _queries_pass(qh, gh, oh, mp, fm, da, s, eps, normalize, chunk, c0, c1, QS, AB, DEN, R, Z, ST, no_r, XB,
                          dqh, sbuf)
            if phase == 0:
                _copy_matrix(acc, parts[h, sg])
                item = take(counter)
                continue
        else:
            _add_parts(parts[h], acc)
        _copy_matrix(acc, G)
        transpose_rows(G, GT, sums, d)
        if sg == nseg - 1:  # (the padding's rows: 0)
            dqh[nq:] = 0
            dkh[nk:] = 0
            dvh[nk:] = 0
        for ci in range(k0, k1):  # dk, dv
            i0 = ci * chunk
            c = min(chunk, nk - i0)
            t = _rows_to_touch(ci, k0, k1, chunk, nk)
            if t > 0:
                for x in (kh, vh):
                    touch_rows(x, i0, t)
            load_features(kh, i0, c, mp, KF)
            _load_values(vh, i0, c, V1)
            small_gemm(V1[:c], GT, R[:c], False, -1, -1)  # v1 G^T
            _times_derivative(R, KF, c, fm, one, dkh, i0, no_r, bool(False), kh, mp, da, XB)
            small_gemm(KF[:c], G[:, :e - 1], dvh[i0:i0 + c], False, -1, -1)  # phi(k) G[:, :Dv]
        item = take(counter)
    keep_alive((owners, sbuf, mapper))


def _signature(dt, variant):
    seq, i64 = array(dt, 4, "A", readonly=True), types.int64
    return types.void(seq, seq, seq, seq, seq, i64, array(dt, 1, readonly=True), i64, i64, dt, dt, types.boolean,
                      array(i64, 1, readonly=True), array(i64, 1, readonly=True), i64,
                      array(types.float64, 1, readonly=True), array(dt, 3, readonly=True), array(dt, 4, "A"),
                      array(dt, 4, "A"), array(dt, 4, "A"), i64, array(types.float64, 4))


noncausal_backward = ThreadedKernel(_noncausal_backward, _signature)
_NO_PARTS = np.zeros((0, 1, 1, 1))  # the segments' partial sums, none
#: ``known`` where every head is taken from its scores (few_positions): never read.
NO_SUMS = {np.dtype(dt): np.zeros((0, 1, 1), dt) for dt in (np.float32, np.float64)}


def backward(nthreads, q, k, v, g, out, fm, s, eps, normalize, lengths, qlengths, chunk, frac, known, dq, dk, dv,
             base=None):
    """Run the kernel (arguments as ``_noncausal_backward``'s, 4-D arrays of one float dtype, ``known``
    C-contiguous; ``fm`` the map as map_grad.kernel_map's tuple) on ``nthreads`` threads: once when every head
    is one segment, else twice (the segments' dq and parts of G, then their dk and dv). ``base`` (heads, D', Dv + 1),
    float64: what G starts from (the gradient of the state returned), one more part of each head's sum (the
    kernel then runs twice); G's sums are then returned, (heads, D', Dv + 1)."""
    kernel = noncausal_backward.get(dq.dtype, None)
    args = (q, k, v, g, out, *fm, s, eps, normalize, lengths, qlengths, chunk, frac, known, dq, dk, dv)
    if base is None and nthreads <= 1 and len(frac) == 2:  # the worker on this thread through its unchecked entry
        # point (no type dispatch of its 22 arguments): they have the signature's types (dtype scalars, float64 frac)
        kernel.unchecked(*args, 2, _NO_PARTS, np.zeros(1, np.int64))
        return None
    with kernel_section(nthreads):
        if base is None and len(frac) == 2:
            kernel(nthreads, *args, 2, _NO_PARTS)
            return None
        nseg = len(frac) - 1
        d = mapped_dim.py_func(fm[0], fm[1], q.shape[3])  # (D', the features)
        parts = np.empty((q.shape[0] * q.shape[1], nseg + (base is not None), d, v.shape[3] + 1))
        if base is not None:
            parts[:, nseg] = base
        for phase in range(2):
            kernel(nthreads, *args, phase, parts)
    return parts.sum(1) if base is not None else None
