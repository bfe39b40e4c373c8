"""Chunkwise causal and non-causal linear-attention kernels over (batch*heads, N, D) arrays.

A work item owns one head, or one segment of a head's sequence when there are fewer heads than
threads, and walks it in chunks of ``chunk`` positions. Per chunk, with phi(Q), phi(K) (c x D) and
V (c x Dv):

    A   = tril(phi(Q) phi(K)^T)              scores inside the chunk (one GEMM)
    out = [phi(Q) | A] @ [S ; V]             state before the chunk + the chunk itself (one GEMM)
    P  += phi(K)^T V                         pending state update (one GEMM)

then each output row is divided by phi(q).Z + (row sum of A) + eps. The pending float32 sums P are
folded into a float64 accumulator every FOLD_EVERY chunks, so float32 results do not drift over
millions of positions while the per-chunk work stays in float32.

A segment's item first sums phi(K)^T V over the chunks before its segment (the "prefix": about
0.3 of a chunk's full cost), so items need no barrier; segment lengths shrink geometrically so
that every item does the same work. Extra memory is O(chunk * (D + Dv) + D * Dv) per item.
"""
import numpy as np
from numba import prange, types

from .._jit import Kernel, array, njit
from .blas import gemm
from .elementwise import load_rows
from .vector import TRANSPOSE_BYTES, transpose_blocks

#: Chunks between folds of the pending float32 sums into the float64 state.
FOLD_EVERY = 16


@njit(helper=True)
def _segment(item, nseg, frac, nchunks):
    """(head, segment, first chunk, end chunk) of work item ``item``."""
    h = item // nseg
    s = item - h * nseg
    return h, s, int(frac[s] * nchunks + 0.5), int(frac[s + 1] * nchunks + 0.5)


@njit(helper=True)
def _load_k(k, h, i0, c, fm, Kf, Pz):
    """Kf[:c] = phi(k[h, i0:i0+c]) and Pz += its column sums (the chunk's part of Z)."""
    load_rows(k, h, i0, c, fm, Kf)
    for t in range(c):
        for a in range(Kf.shape[1]):
            Pz[a] += Kf[t, a]


@njit(helper=True)
def _add_prefix(k, v, h, i0, c, fm, Kf, V, P, Pz, coef):
    """P += phi(K)^T V and Pz += phi(K)^T 1 for positions [i0, i0 + c) (no outputs)."""
    _load_k(k, h, i0, c, fm, Kf, Pz)
    if v.strides[2] == v.itemsize:  # rows of v can go to BLAS as they are
        gemm(True, False, Kf[:c], v[h, i0:i0 + c], 1.0, P, coef)
    else:
        for t in range(c):
            for e in range(v.shape[2]):
                V[t, e] = v[h, i0 + t, e]
        gemm(True, False, Kf[:c], V[:c], 1.0, P, coef)


@njit(helper=True)
def _load_chunk_kv(k, v, h, i0, c, fm, Kf, KT, Pz, SV, r0):
    """KT[:, :c] = phi(k[h, i0:i0+c])^T, Pz += its row sums, SV[r0:r0+c] = v[h, i0:i0+c]."""
    load_rows(k, h, i0, c, fm, Kf)
    transpose_blocks(Kf, KT, Pz, c)  # whole blocks of w x w; the loops below do the edges
    w = TRANSPOSE_BYTES // Kf.itemsize
    c_end, d_end = c - c % w, Kf.shape[1] - Kf.shape[1] % w
    for t in range(c):  # the last columns of whole-block rows, then every column of the last rows
        for a in range(d_end if t < c_end else 0, Kf.shape[1]):
            KT[a, t] = Kf[t, a]
            Pz[a] += Kf[t, a]
    for t in range(c):
        for e in range(v.shape[2]):
            SV[r0 + t, e] = v[h, i0 + t, e]


@njit(helper=True)
def _state_buffers(d_, dv, dt):
    """(P, B, acc, Pz, Bz, Z, accz): pending sums, the accumulator rounded to the compute dtype, the
    float64 accumulator, and the same for Z plus the current Z; all zero."""
    return (np.zeros((d_, dv), dt), np.zeros((d_, dv), dt), np.zeros((d_, dv), np.float64),
            np.zeros(d_, dt), np.zeros(d_, dt), np.zeros(d_, dt), np.zeros(d_, np.float64))


@njit(helper=True)
def _init_state(S0, Z0, h, acc, accz, B, Bz):
    """acc, B = S0[h] (or 0 when S0 is empty: no initial state); likewise accz, Bz from Z0."""
    if S0.shape[0] == 0:  # the buffers start at zero
        return
    for a in range(acc.shape[0]):
        for e in range(acc.shape[1]):
            acc[a, e] = S0[h, a, e]
        for e in range(acc.shape[1]):
            B[a, e] = S0[h, a, e]
    for a in range(acc.shape[0]):
        accz[a] = Z0[h, a]
        Bz[a] = Z0[h, a]


@njit(helper=True)
def _fold(acc, accz, B, Bz, P, Pz):
    """Move the pending sums P, Pz into the float64 accumulators; B, Bz = their rounded values."""
    for a in range(P.shape[0]):
        for e in range(P.shape[1]):
            acc[a, e] += P[a, e]
        for e in range(P.shape[1]):
            B[a, e] = acc[a, e]
    P[:] = 0
    for a in range(P.shape[0]):
        accz[a] += Pz[a]
        Bz[a] = accz[a]
    Pz[:] = 0


@njit(helper=True)
def _current(B, Bz, P, Pz, S, Z):
    """S[:D] = B + P and Z = Bz + Pz: the state the next chunk reads.

    (Loops touch at most three arrays: LLVM leaves loops over more arrays unvectorised.)
    """
    for a in range(P.shape[0]):
        for e in range(P.shape[1]):
            S[a, e] = B[a, e] + P[a, e]
    for a in range(P.shape[0]):
        Z[a] = Bz[a] + Pz[a]


@njit(helper=True)
def _write_state(acc, accz, P, Pz, h, S_out, Z_out):
    """S_out[h] = acc + P, Z_out[h] = accz + Pz (in float64, then rounded once)."""
    for a in range(P.shape[0]):
        for e in range(P.shape[1]):
            S_out[h, a, e] = acc[a, e] + P[a, e]
    for a in range(P.shape[0]):
        Z_out[h, a] = accz[a] + Pz[a]


@njit(helper=True)
def _normalize_rows(out, h, i0, c, QA, Z, d_, causal, eps):
    """Divide out[h, i0+t] by phi(q_t).Z (+ sum_{s<=t} A[t, s] when causal) + eps."""
    for t in range(c):
        den = Z[0] - Z[0]  # zero in the compute dtype
        for a in range(d_):
            den += QA[t, a] * Z[a]
        if causal:
            for s in range(t + 1):
                den += QA[t, d_ + s]
        inv = np.float32(1.0) / (den + eps)  # a float32 one keeps the compute dtype
        for e in range(out.shape[2]):
            out[h, i0 + t, e] *= inv


def _causal_forward(q, k, v, fm, eps, normalize, lengths, chunk, frac, S0, Z0, out, S_out, Z_out):
    """Causal linear attention of every head; head h stops at lengths[h] (later outputs are 0).

    q, k: (BH, N, D); v: (BH, N, Dv); S0, Z0: initial state (BH, D, Dv), (BH, D), or arrays with
    no rows for a zero state; outputs go to out (BH, N, Dv), the final state to S_out, Z_out (unless
    they have no rows). ``frac`` (nseg + 1 increasing fractions from 0 to 1) splits each head's
    chunks into segments, one work item each.
    """
    bh, n, d_ = q.shape
    dv = v.shape[2]
    dt = out.dtype
    nseg = frac.shape[0] - 1
    for item in prange(bh * nseg):
        length = lengths[item // nseg]
        h, s, c0, c1 = _segment(item, nseg, frac, (length + chunk - 1) // chunk)
        last = s == nseg - 1
        if c0 == c1 and not (last and (S_out.shape[0] > 0 or length < n)):
            continue  # nothing to compute (the last item also writes the state and zero padding)
        QA = np.empty((chunk, d_ + chunk), dt)  # [phi(Q) | A]
        SV = np.empty((d_ + chunk, dv), dt)  # [S ; V]
        Kf = np.empty((chunk, d_), dt)
        KT = np.empty((d_, chunk), dt)
        P, B, acc, Pz, Bz, Z, accz = _state_buffers(d_, dv, dt)
        coef = np.empty(2, dt)
        _init_state(S0, Z0, h, acc, accz, B, Bz)
        for ci in range(c0):  # the state at the start of this segment
            i0 = ci * chunk
            _add_prefix(k, v, h, i0, min(chunk, length - i0), fm, Kf, SV, P, Pz, coef)
            if (ci + 1) % FOLD_EVERY == 0:
                _fold(acc, accz, B, Bz, P, Pz)
        _current(B, Bz, P, Pz, SV, Z)
        for ci in range(c0, c1):
            i0 = ci * chunk
            c = min(chunk, length - i0)
            load_rows(q, h, i0, c, fm, QA)
            _load_chunk_kv(k, v, h, i0, c, fm, Kf, KT, Pz, SV, d_)
            gemm(False, False, QA[:c, :d_], KT[:, :c], 0.0, QA[:c, d_:d_ + c], coef)  # scores
            for t in range(c):
                for u in range(t + 1, c):
                    QA[t, d_ + u] = 0
            gemm(False, False, QA[:c, :d_ + c], SV[:d_ + c], 0.0, out[h, i0:i0 + c], coef)
            if normalize:
                _normalize_rows(out, h, i0, c, QA, Z, d_, True, eps)
            gemm(False, False, KT[:, :c], SV[d_:d_ + c], 1.0, P, coef)  # pending state update
            if ci < c1 - 1:
                if (ci + 1) % FOLD_EVERY == 0:
                    _fold(acc, accz, B, Bz, P, Pz)
                _current(B, Bz, P, Pz, SV, Z)
        if last:
            for i in range(length, n):
                for e in range(dv):
                    out[h, i, e] = 0
            if S_out.shape[0] > 0:
                _write_state(acc, accz, P, Pz, h, S_out, Z_out)


def _noncausal_forward(q, k, v, fm, eps, normalize, chunk, frac, out):
    """Non-causal linear attention: every position attends to all N positions of its head.

    Each segment's item sums the whole head's state itself, then writes its segment's outputs.
    """
    bh, n, d_ = q.shape
    dv = v.shape[2]
    dt = out.dtype
    nseg = frac.shape[0] - 1
    nchunks = (n + chunk - 1) // chunk
    for item in prange(bh * nseg):
        h, s, c0, c1 = _segment(item, nseg, frac, nchunks)
        if c0 == c1:
            continue
        QA = np.empty((chunk, d_), dt)
        Kf = np.empty((chunk, d_), dt)
        V = np.empty((chunk, dv), dt)
        S = np.empty((d_, dv), dt)
        P, B, acc, Pz, Bz, Z, accz = _state_buffers(d_, dv, dt)
        coef = np.empty(2, dt)
        for ci in range(nchunks):
            i0 = ci * chunk
            _add_prefix(k, v, h, i0, min(chunk, n - i0), fm, Kf, V, P, Pz, coef)
            if (ci + 1) % FOLD_EVERY == 0:
                _fold(acc, accz, B, Bz, P, Pz)
        _fold(acc, accz, B, Bz, P, Pz)
        _current(B, Bz, P, Pz, S, Z)
        for ci in range(c0, c1):
            i0 = ci * chunk
            c = min(chunk, n - i0)
            load_rows(q, h, i0, c, fm, QA)
            gemm(False, False, QA[:c], S, 0.0, out[h, i0:i0 + c], coef)
            if normalize:
                _normalize_rows(out, h, i0, c, QA, Z, d_, False, eps)


def _causal_signature(dt, layout):
    seq, i64, f64 = array(dt, 3, layout, readonly=True), types.int64, types.float64
    return types.void(seq, seq, seq, i64, dt, types.boolean, array(i64, 1, readonly=True), i64,
                      array(f64, 1, readonly=True), array(dt, 3, readonly=True),
                      array(dt, 2, readonly=True), array(dt, 3), array(dt, 3), array(dt, 2))


def _noncausal_signature(dt, layout):
    seq, i64 = array(dt, 3, layout, readonly=True), types.int64
    return types.void(seq, seq, seq, i64, dt, types.boolean, i64,
                      array(types.float64, 1, readonly=True), array(dt, 3))


causal_forward = Kernel(_causal_forward, _causal_signature)
noncausal_forward = Kernel(_noncausal_forward, _noncausal_signature)
