"""The backward pass of causal linear attention: dq, dk, dv (and the initial state's gradient, and the
per-position terms of the gates' gradient) in one chunkwise scan per head, backwards in time, from the
states at the chunk boundaries that the vjp's forward kept (cpu/chunked.py's ``states``). When heads
are few the scan is cut into segments as the forward kernel's are (a segment first sums the adjoint
entering it: the adjoint updates alone of the chunks after it), or split between the threads as they
run (cpu/dynamic.py, mirrored: boundaries every fold counted from a head's end).

Per head, with the state augmented by Z as one more value column ([S | Z], D x e, e = Dv + 1; v1 =
[v, 1]), the output gradient g, the forward's outputs and denominators: ab_t = [a_t, b_t] = [g_t /
den_t, -(g_t . out_t) / den_t] (without normalisation [g_t, 0]); qs = scale phi(q), kf = phi(k);
F(s, t) the product of the factors of the positions in (s, t] (one per position, or one per position
and key dimension: then a vector over the key dimensions, and products with it elementwise), ef_t =
F(chunk start, t) and wf_t = F(t, chunk end) (gating.chunk_gates' e and w). With C the adjoint of
the state entering the chunk from after it (the final state's gradient after the last chunk), M =
tril(ab v1^T) and A = the forward's decayed scores tril(qs kf^T):

- dqf_t = ef_t (ab_t [S | Z]_start^T) + sum_{s <= t} M[t, s] F(s, t) kf_s   (dq = scale phi'(q) dqf)
- dkf_s = wf_s (C v1_s) + sum_{t >= s} M[t, s] F(s, t) qs_t                (dk = phi'(k) dkf)
- dv_s = (wf_s kf_s) C[:, :Dv] + sum_{t >= s} A[t, s] a_t
- C before the chunk = F(chunk) C + (ef qs)^T ab: after the first chunk, the initial state's gradient.

With a factor per position the M sums are one product each (M decayed first); per key dimension they
go through the SUB-position blocks of gating's scores (_vector_intra_queries, _vector_intra_keys).
The scores M serve dq and dk; no forward state is recomputed. The adjoint is kept as the forward
kernel keeps its state ([C | Cz], D x Dv and D: pending sums in the compute dtype folded into float64
every FOLD_EVERY chunks). Extra memory is O(chunk * (D + Dv + chunk) + D * Dv) per item. With gates,
rq_t = qs_t . dqf_t and rk_t = kf_t . dkf_t (elementwise per key dimension) are written for the gates'
gradient (its running sums are the caller's).
"""
import numpy as np
from numba import types
from numba.extending import overload
from numba.np.numpy_support import as_dtype

from .._jit import OVERLOAD_OPTIONS, array, njit
from .buffers import empty, one_of, zeros
from .chunked import (FOLD_EVERY, _copy_row, _current, _init_state, _rows_to_touch, _state_buffers, _write_state,
                      job_of, pending_added, reset_state_buffers, segment_parts, split_state)
from .dynamic import DONE, RUN_SPLIT, SPLIT, STARTING, mark_swap, next_job, publish
from .elementwise import ELU, RELU
from .gating import (SUB, VECTOR, _kind, _stub, chunk_gates, gate_buffers, gate_key_rows, gate_log_sum, gate_pending,
                     gate_queries, gate_scores, gate_state_factors, masked_product, one_product, prepare_kernel,
                     touch_gates)
from .map_grad import times_map_derivative
from .mapfns import load_features, map_state, mapped_dim
from .runtime import BACKWARD_PREFIX_COST
from .schedule import take
from .smallgemm import small_gemm, small_gemm_tn, small_gemm_tn_lower
from .threaded import ThreadedKernel
from .vector import transpose_padded, transpose_rows
from .views import as_contiguous, keep_alive, touch_rows, unowned


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
def _times_derivative(R, Y, c, fm, s, dst, i0, r, has_r, src, mp, da, X):
    """dst[i0 + t] = the gradient of x_t = src[i0 + t] from R[t], that of Y[t] = s phi(x_t) (s > 0): for elu + 1,
    relu and identity (codes below mapfns.FIRST, ``da`` 0) inline from Y (elu + 1: R min(Y, s), the exp below
    0 times s; relu: s R where Y > 0; identity: s R); through the C function at ``da`` from x_t for the others
    that have one (``mp``: mapfns.map_state's tuple; X: a (2 chunk, D) scratch; R is overwritten): the
    elementwise maps of codes from mapfns.FIRST, Taylor and DPFP (dst then D wide, R D'); else (ReBased and
    the projection maps: the caller applies their vjps) s R[t], the gradient of phi. When ``has_r``
    r[i0 + t] = Y[t] . R[t] (r: (N, 1)) or Y[t] * R[t] (r: (N, D'), a gate per key dimension)."""
    d = R.shape[1]
    zero = s - s
    for t in range(c):
        rt, yt, row = R[t], Y[t], as_contiguous(dst[i0 + t])
        if has_r and r.shape[1] == 1:
            acc = 0.0
            for a in range(d):
                acc += np.float64(yt[a]) * np.float64(rt[a])
            r[i0 + t, 0] = acc
        elif has_r:  # per key dimension (r's rows have unit stride: gradients.py allocates it so)
            rr = as_contiguous(r[i0 + t])
            for a in range(d):
                rr[a] = np.float64(yt[a]) * np.float64(rt[a])
        if da != 0:
            continue  # (below, for the whole chunk)
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
    if da != 0:
        times_map_derivative(src, i0, c, mp, da, X, R, s)
        out = X[X.shape[0] // 2:]
        for t in range(c):
            rt, row = out[t], as_contiguous(dst[i0 + t])
            for a in range(out.shape[1]):
                row[a] = rt[a]


@njit(helper=True)
def _zero_rows(x, i0, i1):
    for i in range(i0, i1):
        row = as_contiguous(x[i])
        for e in range(row.shape[0]):
            row[e] = 0


@njit(helper=True)
def _keep_rows(X, c, ncols, dst, i0):
    """dst[i0 + t] = X[t, :ncols] for t < c (dst's rows: unit stride)."""
    for t in range(c):
        src, row = X[t], as_contiguous(dst[i0 + t])
        for a in range(ncols):
            row[a] = src[a]


@njit(helper=True)
def _scale_columns(X, c, ncols, s):
    """X[:c, :ncols] *= s."""
    if s != 1:
        for t in range(c):
            row = X[t]
            for a in range(ncols):
                row[a] *= s


adjoint_scores = _stub("adjoint_scores")
intra_queries = _stub("intra_queries")
intra_keys = _stub("intra_keys")


@overload(adjoint_scores, jit_options=OVERLOAD_OPTIONS)
def _adjoint_scores(gates, QA, KT, KF, e, c, G, Rg, F, X):
    """QA[:c, e:e + c] = M = tril(ab v1^T): decayed by the factors of (s, t] with one per position;
    per key dimension plain (the factors go with the features: intra_queries, intra_keys)."""
    if _kind(gates) == VECTOR:
        return lambda gates, QA, KT, KF, e, c, G, Rg, F, X: masked_product(QA, KT, e, c)
    return lambda gates, QA, KT, KF, e, c, G, Rg, F, X: gate_scores(gates, QA, KT, KF, e, c, G, Rg, F, X)


@overload(intra_queries, jit_options=OVERLOAD_OPTIONS)
def _intra_queries(gates, M, KF, R, c, G, F, beta, W):
    """R[t] = beta R[t] + sum_{s <= t} M[t, s] (the factors of (s, t]) kf_s (M decayed already
    unless per key dimension). W: scratch (see _vector_intra_queries)."""
    if _kind(gates) == VECTOR:
        tiny = as_dtype(R.dtype).type(np.finfo(as_dtype(R.dtype)).tiny)

        def impl(gates, M, KF, R, c, G, F, beta, W):
            if not beta:
                _zero_rows(R, 0, c)
            _vector_intra_queries(M, KF, G, F[0], R, c, W[0], W[1], W[2], tiny)
        return impl
    return lambda gates, M, KF, R, c, G, F, beta, W: small_gemm(M, KF[:c], R[:c], beta, 0, -1)


@overload(intra_keys, jit_options=OVERLOAD_OPTIONS)
def _intra_keys(gates, M, QS, d, R, c, G, F, beta, W):
    """R[s] = beta R[s] + sum_{t >= s} M[t, s] (the factors of (s, t]) qs_t (QS[t, :d])."""
    if _kind(gates) == VECTOR:
        tiny = as_dtype(R.dtype).type(np.finfo(as_dtype(R.dtype)).tiny)

        def impl(gates, M, QS, d, R, c, G, F, beta, W):
            if not beta:
                _zero_rows(R, 0, c)
            _vector_intra_keys(M, QS, d, G, F[0], R, c, W[0], W[1], W[2], tiny)
        return impl
    return lambda gates, M, QS, d, R, c, G, F, beta, W: small_gemm_tn_lower(M, QS[:c, :d], R[:c], beta)


@njit(helper=True)
def _flushed(fac, a, tiny, zero):
    """fac *= a, below the smallest normal number 0 (as gating's running products; those stay written
    inline: calling this helper there made the per-key-dimension backward ~12% slower, measured)."""
    for j in range(fac.shape[0]):
        x = fac[j] * a[j]
        fac[j] = x if x >= tiny else zero


@njit(helper=True)
def _vector_intra_queries(M, KF, a, e, R, c, Ksc, TB, fac, tiny):
    """R[t] += sum_{s <= t} M[t, s] (prod_{u in (s, t]} a_u) * kf_s, per key dimension. Where the chunk
    allows it (gating.one_product), e_t * [M @ (kf_s / e_s)] (e: the running products from the chunk's
    start), one product. Otherwise within a block of SUB positions term by term with running products;
    from earlier blocks through the block's start p (the last position before it): (the factors of
    (p, t]) * [M[t, :p + 1] @ (kf_s times the factors of (s, p])], one product per block. a: the
    per-position factors (c, D'); Ksc, TB (c, D'), fac (D'): scratch. Every factor is a product of
    factors <= 1."""
    d = KF.shape[1]
    one, zero = tiny / tiny, tiny - tiny  # in the compute dtype
    if one_product(e, c, tiny):
        for s in range(c):
            ks, ksc, es = KF[s], Ksc[s], e[s]
            for j in range(d):
                ksc[j] = ks[j] / es[j]
        small_gemm(M, Ksc[:c], TB[:c], False, 0, -1)  # (M is lower triangular)
        for t in range(c):
            rt, tb, et = R[t], TB[t], e[t]
            for j in range(d):
                rt[j] += et[j] * tb[j]
        return
    for i0 in range(0, c, SUB):
        i1 = min(i0 + SUB, c)
        for t in range(i0, i1):  # within the block
            rt = R[t]
            fac[:] = one
            for s in range(t, i0 - 1, -1):
                m, ks = M[t, s], KF[s]
                for j in range(d):
                    rt[j] += m * fac[j] * ks[j]
                _flushed(fac, a[s], tiny, zero)
        if i0 == 0:
            continue
        fac[:] = one
        for s in range(i0 - 1, -1, -1):  # kf_s times the factors of (s, i0 - 1]
            ks, ksc = KF[s], Ksc[s]
            for j in range(d):
                ksc[j] = ks[j] * fac[j]
            _flushed(fac, a[s], tiny, zero)
        small_gemm(M[i0:i1, :i0], Ksc[:i0], TB[:i1 - i0], False, -1, -1)
        fac[:] = one
        for t in range(i0, i1):  # times the factors of (i0 - 1, t]
            _flushed(fac, a[t], tiny, zero)
            rt, tb = R[t], TB[t - i0]
            for j in range(d):
                rt[j] += fac[j] * tb[j]


@njit(helper=True)
def _vector_intra_keys(M, QS, d, a, e, R, c, Qsc, TB, fac, tiny):
    """R[s] += sum_{t >= s} M[t, s] (prod_{u in (s, t]} a_u) * qs_t, per key dimension. Where the chunk
    allows it, [M^T @ (qs_t e_t)] / e_s, one product; otherwise within a block term by term; from later
    blocks through the block's end b: (the factors of (s, b]) * [M[b + 1:, s]^T @ (qs_t times the
    factors of (b, t])], one product per block. Scratch as _vector_intra_queries."""
    one, zero = tiny / tiny, tiny - tiny  # in the compute dtype
    if one_product(e, c, tiny):
        for t in range(c):
            qt, qsc, et = QS[t], Qsc[t], e[t]
            for j in range(d):
                qsc[j] = qt[j] * et[j]
        small_gemm_tn_lower(M, Qsc[:c, :d], TB[:c, :d], False)
        for s in range(c):
            rs, tb, es = R[s], TB[s], e[s]
            for j in range(d):
                rs[j] += tb[j] / es[j]
        return
    for j0 in range(0, c, SUB):
        j1 = min(j0 + SUB, c)
        for s in range(j0, j1):  # within the block
            rs = R[s]
            fac[:] = one
            for t in range(s, j1):
                if t > s:
                    _flushed(fac, a[t], tiny, zero)
                m, qt = M[t, s], QS[t]
                for j in range(d):
                    rs[j] += m * fac[j] * qt[j]
        if j1 == c:
            continue
        fac[:] = one
        for t in range(j1, c):  # qs_t times the factors of (j1 - 1, t]
            _flushed(fac, a[t], tiny, zero)
            qt, qsc = QS[t], Qsc[t]
            for j in range(d):
                qsc[j] = qt[j] * fac[j]
        small_gemm_tn(M[j1:c, j0:j1], Qsc[j1:c], TB[:j1 - j0], False)
        fac[:] = one
        for s in range(j1 - 1, j0 - 1, -1):  # times the factors of (s, j1 - 1]
            rs, tb = R[s], TB[s - j0]
            for j in range(d):
                rs[j] += fac[j] * tb[j]
            _flushed(fac, a[s], tiny, zero)


@njit(helper=True)
def _chunk(q, k, v, g, out, den, mp, da, normalize, s, one, i0, c, St, has_st, C, Cz, has_c, own, gates, dq, dk, dv,
           rq, rk, has_r, qf, kf, keep, QA, QA2, KT, KT2, V1, KF, KW, QE, R, CT, sums, G, Rg, F, X, W, XB):
    """Positions [i0, i0 + c) of one head: dq, dk, dv when ``own`` (the adjoint after the chunk in C,
    D x Dv, and Cz, D, when ``has_c``; the state before it in St, e x D, when ``has_st``; the map ``mp``,
    mapfns.map_state's tuple, its derivative's address ``da``, XB a (2 chunk, D) scratch for it), and when
    ``keep`` phi(q), phi(k) into qf, kf. Leaves QA[:c, :e] = ab and, with gates, QE[:c] = ef qs (else
    QA2[:c, :D] = qs) for the adjoint's update."""
    e, d = KT.shape[0], KT2.shape[0]
    dvd, decayed = e - 1, gates.ndim > 1
    _load_adjoints(g, out, den, i0, c, normalize, QA)
    fm = mp[0]
    load_features(q, i0, c, mp, QA2)
    if own and keep:
        _keep_rows(QA2, c, d, qf, i0)
    _scale_columns(QA2, c, d, s)
    if own:
        _load_values(v, i0, c, V1)
        transpose_padded(V1, KT, sums, c)
        load_features(k, i0, c, mp, KF)
        if keep:
            _keep_rows(KF, c, d, kf, i0)
        transpose_padded(KF, KT2, sums, c)
        adjoint_scores(gates, QA, KT, KF, e, c, G, Rg, F, X)  # M
        gate_scores(gates, QA2, KT2, KF, d, c, G, Rg, F, X)  # A
        M = QA[:c, e:e + c]
        dvc = dv[i0:i0 + c]
        if has_c:  # dv = (wf kf) C[:, :Dv] + A^T a
            kw = KF
            if decayed:
                for t in range(c):
                    _copy_row(KF[t], KW[t])
                gate_key_rows(gates, KW, c, F, sums)  # (sums: a sink)
                kw = KW
            small_gemm(kw[:c], C, dvc, False, -1, -1)
        small_gemm_tn_lower(QA2[:c, d:d + c], QA[:c, :dvd], dvc, has_c)
        if has_c:  # dkf = wf (v1 C^T) + M^T qs (decayed)
            transpose_rows(C, CT, sums, d)  # [C | Cz]^T
            for a in range(d):
                CT[dvd, a] = Cz[a]
            small_gemm(V1[:c], CT, R[:c], False, -1, -1)
            if decayed:
                gate_key_rows(gates, R, c, F, sums)
        intra_keys(gates, M, QA2, d, R, c, G, F, has_c, W)
        _times_derivative(R, KF, c, fm, one, dk, i0, rk, has_r, k, mp, da, XB)
        if has_st:  # dqf = ef (ab S^T) + M kf (decayed)
            small_gemm(QA[:c, :e], St, R[:c], False, -1, -1)
            gate_queries(gates, R, d, c, F)
        intra_queries(gates, M, KF, R, c, G, F, has_st, W)
        _times_derivative(R, QA2, c, fm, s, dq, i0, rq, has_r, q, mp, da, XB)
    if decayed:
        for t in range(c):
            _copy_row(QA2[t, :d], QE[t])
        gate_queries(gates, QE, d, c, F)


def _causal_backward(q, k, v, g, out, den, fm, fp, fa, da, normalize, s, lengths, chunk, frac, states, has_s0, H0, Z0,
                     gates, ld, dq, dk, dv, H_out, Z_out, rq, rk, qf, kf, status, phase, parts, counter):
    """Gradients of causal linear attention for every head (see the module docstring).

    q, k: (G1, G2, N, D); v, g, out: (G1, G2, N, Dv); den: (G1, G2, N), the forward's denominators; all with
    unit stride along their last axis. ``fm``, ``fp``, ``fa``, ``da``: the map (map_grad.kernel_map: its code,
    parameters, the addresses of its C function and of its derivative's; codes 0-2 applied inline; the pair
    and projection maps give D' features of D; for those whose derivative's address is 0, ReBased and the
    projection maps, dq and dk are the gradients of phi(q), phi(k), (G1, G2, N, D')); ``s``: the scale of
    phi(q).
    ``states`` (G1, G2, chunks, Dv + 1, D): the forward's state [S | Z]^T at the start of every chunk of
    ``chunk`` positions (the first one zero unless ``has_s0``). H0, Z0: the final state's gradient dS (heads, D,
    Dv) and dZ (heads, D), or arrays with no rows for zero. ``gates``: the log factor of each position (G1, G2,
    N) or of each position and key dimension (G1, G2, N, D), zero past its head's length, or an empty 1-D array;
    ld: a log decay per head (float64, added to each position's log factor as the forward kernel adds it). Out:
    dq, dk, dv (zero past ``lengths``), H_out, Z_out (heads, D, Dv), (heads, D): the initial state's gradient
    (unless they have no rows), rq, rk (heads, N, 1), or (heads, N, D) per key dimension, in float64 with gates
    (else (1, 0, 1)); qf, kf (G1, G2, N, D'): phi(q), phi(k) as the kernel computes them (rows past ``lengths``
    not written), for a map's vjp after the kernel (unless they have no rows). Run by threaded.ThreadedKernel:
    each thread takes items (head, segment) from ``counter``. Segments start as the forward kernel's do
    (cpu/chunked.py), mirrored: after their prefix (the adjoint updates of the chunks after them; ``parts``
    with no rows, ``phase`` 1), or in two runs with ``parts``
    (heads, nseg, D, Dv + 2): phase 0, the last segment in time runs whole from H0, Z0 and leaves its adjoint
    before it in parts[head, 0], while each other segment but the first in time sums its own chunks' adjoint
    updates from zero; phase 1, each but the last in time starts from the parts after it. Or, with ``phase``
    2 and parts (heads, 2 * nseg + 1, D, Dv + 2) (``frac`` unused), the dynamic split (cpu/dynamic.py) in
    the walk's order: each head an item run from its end, a boundary every fold counted from there, a
    helper's sum the adjoint's updates of one fold (the walk without gradients).
    """
    g2, n, d = q.shape[1], q.shape[2], mapped_dim(fm, fp, q.shape[3])  # (d: D', the features)
    e, dt = v.shape[3] + 1, dq.dtype
    has_r = rq.shape[1] > 0
    decayed = bool(gates.ndim > 1)  # bool()/int(): run-time values, not literals (see _jit)
    one = one_of(dt)
    mapper = map_state(fm, fp, fa, q.shape[3], d, dt)
    mp = unowned(mapper)  # (its parameters are shared by the threads: each view's atomic add contended)
    # views without reference counting (see chunked._causal_forward): the caller owns the arguments,
    # the buffers' owners are kept to the end
    q, k, v, g, out, den, gates = unowned((q, k, v, g, out, den, gates))
    dq, dk, dv, rq, rk, states, parts, qf, kf = unowned((dq, dk, dv, rq, rk, states, parts, qf, kf))
    keep = bool(qf.shape[0] > 0)
    dynamic = bool(phase == 2)
    two_runs = bool(parts.shape[0] > 0 and not dynamic)
    summing = bool(two_runs and phase == 0)  # (phase 0: the segments' own sums)
    total = zeros(d if (summing or dynamic) and decayed else 0, np.float64)  # a segment's log decay
    H0, Z0, H_out, Z_out = unowned((H0, Z0, H_out, Z_out))
    owners = (empty((chunk, e + chunk), dt), empty((chunk, d + chunk), dt), empty((e, chunk), dt),
              empty((d, chunk), dt), empty((chunk, e), dt), empty((chunk, d), dt), empty((chunk, d), dt),
              empty((chunk, d), dt), empty((chunk, d), dt), empty((d, e - 1), dt), empty((e, d), dt),
              empty((2 * chunk if da != 0 else 0, q.shape[3]), dt))
    # [ab | M], [qs | A], v1^T, kf^T, v1, kf, kf times the factors at the chunk's end, qs times those from
    # its start, R, the adjoint's value columns C (its Z: the state helpers' Z) and C transposed, the rows of
    # q or k for a map's derivative and its result
    QA, QA2, KT, KT2, V1, KF, KW, QE, R, C, CT, XB = unowned(owners)
    sums = zeros(max(d, e), dt)
    gbuf = gate_buffers(gates, chunk, dt)
    wbuf = (empty((chunk, d), dt), empty((chunk, d), dt), empty(d, dt))  # per key dimension: scratch
    G, Rg, F, X = unowned(gbuf)
    W = unowned(wbuf)
    nseg = frac.shape[0] - 1
    items = q.shape[0] * g2 * (1 if dynamic else nseg)
    nb = (parts.shape[1] + 1) // 2  # (dynamic: the boundaries' rows, then the segments' sums)
    per = int(FOLD_EVERY)  # (a dynamic split's segment: one fold's chunks, counted from a head's end)
    # a job's state buffers (the adjoint [C | Cz] as a state), made once for all of this thread's jobs
    sbuf = (_state_buffers(d, e - 1, dt), empty(d if decayed else 0, dt))
    (P, B, acc, Pz, Bz, Z, accz, lam), fb = unowned(sbuf)
    ch, ct, cy = int(0), int(0), int(0)  # a helper's split under way: head, claimed boundary, next boundary
    while True:
        # (a helper's sum of a fold is the walk a prefix takes: its cost over a fold's run, runtime's)
        kind, item, y, tb = next_job(take(counter) if ct == 0 else items, items, dynamic, parts, lengths, chunk, per,
                                     BACKWARD_PREFIX_COST, ch, ct, cy)
        ch = ct = cy = 0  # (a new job next, unless a helper's sum sets them)
        if kind == DONE:
            break
        # a head from its end, a sum toward a runner, a run from a claimed boundary, or a fixed segment, in
        # the walk's order (mirrored: a segment's prefix is the chunks after it; whole: from H0)
        h, sg, length, f0, f1, last, whole, sums_only, idle = job_of(kind, item, y, tb, dynamic, lengths, chunk, nseg,
                                                                     frac, two_runs, summing)
        nch = (length + chunk - 1) // chunk
        if (summing and last) or idle or not (summing or f0 < f1 or last):
            continue
        h1, h2 = h // g2, h % g2
        r = h if has_r else 0
        # the segment: chunks [c0, c1) of head h from the adjoint after them, the update alone of the
        # chunks [c1, nch) first, from H0[h], Z0[h] (the final state's gradient; none when H0 has no
        # rows). The adjoint [C | Cz] is kept as the forward keeps its state [S | Z]. The last segment
        # (the one with chunk 0) zeroes the rows past ``length`` and writes the adjoint before chunk 0,
        # the initial state's gradient, to H_out[h], Z_out[h] when they have rows. (Written here, not as
        # a function: that would be compiled alone and again inside this one.)
        c0, c1 = nch - f1, nch - f0
        qh, kh, vh, gh, oh, denh = q[h1, h2], k[h1, h2], v[h1, h2], g[h1, h2], out[h1, h2], den[h1, h2]
        dqh, dkh, dvh, kept = dq[h1, h2], dk[h1, h2], dv[h1, h2], states[h1, h2]
        qfh, kfh = (qf[h1, h2], kf[h1, h2]) if keep else (dqh, dkh)  # (not written unless keep)
        reset_state_buffers(sbuf[0])
        has_acc = _init_state(H0, Z0, h, B, accz, Bz) if whole else bool(False)
        acc_in_b = has_acc  # (acc is filled from B when first read: see _init_state)
        has_p = bool(False)
        if two_runs and not summing:
            has_acc, acc_in_b = segment_parts(sbuf[0], has_acc, acc_in_b, has_p, summing, parts[h], sg, total,
                                              decayed)
        elif dynamic and kind == RUN_SPLIT:
            has_acc, acc_in_b = split_state(sbuf[0], parts, h, y, parts[h, nb + y:nb + tb], H0, Z0, decayed)
            if mark_swap(parts, h, tb, SPLIT, STARTING) != SPLIT:  # (the runner took tb back: other work)
                continue
            publish(parts, h, tb, acc, accz, bool(True))  # (the adjoint at the run's start, for later helpers)
        for a in range(total.shape[0]):  # the segment's log decay (phase 0, or a dynamic split's sum)
            total[a] = 0
        gate_state_factors(gates, lam, fb)
        _current(B, Bz, P, Pz, C, Z, has_acc, has_p, fb, decayed)
        j0 = nch - c1 if parts.shape[0] > 0 else 0
        for j in range(j0, nch - c0):
            ci = nch - 1 - j
            i0 = ci * chunk
            c = min(chunk, length - i0)
            # every TOUCH_CHUNKS steps, the next t chunks (walked down: [ci - t + 1, ci]; counted as
            # rows of one position each) and their kept states into the cache (see chunked.TOUCH_CHUNKS)
            t = _rows_to_touch(j, j0, nch - c0, int(1), nch)
            if t > 0:
                lo = (ci - t + 1) * chunk
                for x in (qh, kh, vh, gh, oh):
                    touch_rows(x, lo, i0 + c - lo)
                touch_gates(gates, h, lo, i0 + c - lo)
                for a in range(ci - t + 1, ci + 1):
                    touch_rows(kept[a], 0, kept.shape[1])
            chunk_gates(gates, h, ld, i0, c, G, Rg, F, status)
            has_st = ci > 0 or has_s0
            has_c = has_acc or has_p
            own = ci < c1 and not sums_only
            _chunk(qh, kh, vh, gh, oh, denh, mp, da, normalize, s, one, i0, c, kept[ci], has_st, C, Z, has_c, own,
                   gates, dqh, dkh, dvh, rq[r], rk[r], has_r, qfh, kfh, keep, QA, QA2, KT, KT2, V1, KF, KW, QE, R, CT,
                   sums, G, Rg, F, X, W, XB)
            if ci == c0 and not (summing or sums_only or (last and H_out.shape[0] > 0)):
                break  # no one reads the adjoint before the segment's first chunk
            beta = gate_pending(gates, P, Pz, lam, c, G, Rg, F, has_p)
            qe = QE if decayed else QA2  # ef qs in qe[:c, :D]
            small_gemm_tn(qe[:c, :d], QA[:c, :e - 1], P, beta if has_p else 0)  # the pending update: (ef qs)^T a
            for t in range(c):  # and (ef qs)^T b
                bt, qt = QA[t, e - 1], qe[t]  # (whole rows: the loop vectorises)
                for a in range(d):
                    Pz[a] += qt[a] * bt
            has_acc, has_p, acc_in_b = pending_added(j, acc, accz, B, Bz, P, Pz, has_acc, acc_in_b, lam,
                                                     decayed)
            if sums_only:
                gate_log_sum(gates, total, c, G, Rg)
                continue
            # a dynamic split's boundary (every fold): the adjoint, just folded, published for helpers
            if dynamic and ci > c0 and (j + 1) % per == 0 and not publish(
                    parts, h, (j + 1) // per, acc, accz, bool(False)):
                last = False  # a helper runs on from here
                break
            gate_state_factors(gates, lam, fb)
            _current(B, Bz, P, Pz, C, Z, has_acc, has_p, fb, decayed)
        if sums_only and dynamic:  # a dynamic split's sum: its row, then the helper's next step
            segment_parts(sbuf[0], has_acc, acc_in_b, has_p, sums_only, parts[h, nb:], sg, total, decayed)
            ch, ct, cy = h, tb, sg  # (the helper's next step: next_job)
            continue
        if summing:
            segment_parts(sbuf[0], has_acc, acc_in_b, has_p, summing, parts[h], sg, total, decayed)
            continue
        if last:
            for x in (dqh, dkh, dvh):
                _zero_rows(x, length, x.shape[0])
            if H_out.shape[0] > 0:
                _write_state(acc, accz, B, P, Pz, h, H_out, Z_out, has_acc, acc_in_b, has_p, lam, decayed)
    keep_alive((owners, gbuf, wbuf, mapper, sbuf))


def _signature(dt, kind):
    seq, i64, f64 = array(dt, 4, "A", readonly=True), types.int64, types.float64
    gate_t = array(dt, {0: 1, 1: 3, 2: 4}[kind], "A" if kind else "C", readonly=True)
    return types.void(seq, seq, seq, seq, seq, array(dt, 3, "A", readonly=True), i64, array(dt, 1, readonly=True), i64,
                      i64, types.boolean, dt,
                      array(i64, 1, readonly=True), i64, array(f64, 1, readonly=True),
                      array(dt, 5, "A", readonly=True), types.boolean, array(dt, 3, readonly=True),
                      array(dt, 2, readonly=True), gate_t, array(f64, 1, readonly=True),
                      array(dt, 4, "A"), array(dt, 4, "A"), array(dt, 4, "A"), array(dt, 3), array(dt, 2),
                      array(f64, 3, "A"), array(f64, 3, "A"), array(dt, 4, "A"), array(dt, 4, "A"), array(i64, 1), i64,
                      array(f64, 4))


#: kind: 0 without gates, 1 with a log factor per position, 2 per position and key dimension (decay and gates
#: folded into it)
causal_backward = ThreadedKernel(_causal_backward, _signature, prepare=prepare_kernel)
