"""Chunkwise causal and non-causal linear-attention kernels over (batch*heads, N, D) arrays.

Each parallel work item owns one head and one block of value columns and walks its sequence in
chunks of ``chunk`` positions. Per chunk, with phi(Q), phi(K) (c x D) and V (c x w):

    A   = tril(phi(Q) phi(K)^T)              scores inside the chunk (one GEMM)
    out = [phi(Q) | A] @ [S ; V]             state before the chunk + the chunk itself (one GEMM)
    P  += phi(K)^T V                         pending state update (one GEMM)

and the denominators from Z and the row sums of A. The pending sums P are folded into a float64
accumulator every few chunks, so float32 results do not drift over millions of positions while the
per-chunk work stays in float32. Extra memory is O(chunk * (D + Dv) + D * Dv) per work item.
"""
import numpy as np
from numba import prange

from .._jit import njit
from .blas import gemm
from .elementwise import load_rows

# Chunks between folds of the pending float32 sums into the float64 state.
FOLD_EVERY = 16


@njit(helper=True)
def _block(item, nsplit, dv):
    """(head, block, first column, width) of work item ``item``."""
    h = item // nsplit
    blk = item - h * nsplit
    width = (dv + nsplit - 1) // nsplit
    e0 = blk * width
    return h, blk, e0, min(dv, e0 + width) - e0


@njit(helper=True)
def _load_chunk_kv(k, v, h, i0, c, fm, e0, w, Kf, KT, Pz, SV, r0):
    """KT[:, :c] = phi(k[h, i0:i0+c])^T, Pz += its row sums, SV[r0:r0+c] = v[h, i0:i0+c, e0:e0+w]."""
    load_rows(k, h, i0, c, fm, Kf)
    for t in range(c):
        for a in range(KT.shape[0]):
            KT[a, t] = Kf[t, a]
    for t in range(c):
        for a in range(KT.shape[0]):
            Pz[a] += Kf[t, a]
        for e in range(w):
            SV[r0 + t, e] = v[h, i0 + t, e0 + e]


@njit(helper=True)
def _refresh(acc, accz, B, Bz, P, Pz, S, Z, fold):
    """S[:D] = B + P, Z = Bz + Pz; with ``fold`` first move P into the float64 accumulator."""
    d_, w = P.shape
    if fold:
        for a in range(d_):
            for e in range(w):
                acc[a, e] += P[a, e]
                P[a, e] = 0
                B[a, e] = acc[a, e]
                S[a, e] = B[a, e]
            accz[a] += Pz[a]
            Pz[a] = 0
            Bz[a] = accz[a]
            Z[a] = Bz[a]
    else:
        for a in range(d_):
            for e in range(w):
                S[a, e] = B[a, e] + P[a, e]
            Z[a] = Bz[a] + Pz[a]


@njit(helper=True)
def _store(O, QA, Z, c, d_, causal, w, eps, normalize, out, h, i0, e0, one):
    """out[h, i0+t, e0:e0+w] = O[t] / (phi(q_t).Z + sum_{s<=t} A[t, s] + eps)."""
    for t in range(c):
        if normalize:
            den = Z[0] * 0
            for a in range(d_):
                den += QA[t, a] * Z[a]
            if causal:
                for s in range(t + 1):
                    den += QA[t, d_ + s]
            one[1] = one[0] / (den + eps)  # the reciprocal, in the compute dtype
            inv = one[1]
            for e in range(w):
                out[h, i0 + t, e0 + e] = O[t, e] * inv
        else:
            for e in range(w):
                out[h, i0 + t, e0 + e] = O[t, e]


@njit(parallel=True)
def causal_forward(q, k, v, fm, eps, normalize, lengths, chunk, nsplit, S0, Z0, out, S_out, Z_out):
    """Causal linear attention of every head; head h stops at lengths[h] (later outputs are 0).

    q, k: (BH, N, D); v: (BH, N, Dv); S0, Z0: initial state (BH, D, Dv), (BH, D); results go to
    out (BH, N, Dv) and the final state to S_out, Z_out. ``nsplit`` blocks of value columns per head.
    """
    bh, n, d_ = q.shape
    dv = v.shape[2]
    dt = out.dtype
    for item in prange(bh * nsplit):
        h, blk, e0, w = _block(item, nsplit, dv)
        length = lengths[h]
        QA = np.empty((chunk, d_ + chunk), dt)  # [phi(Q) | A]
        SV = np.empty((d_ + chunk, w), dt)  # [S ; V]
        Kf = np.empty((chunk, d_), dt)
        KT = np.empty((d_, chunk), dt)
        O = np.empty((chunk, w), dt)
        P = np.zeros((d_, w), dt)
        B = np.empty((d_, w), dt)
        acc = np.empty((d_, w), np.float64)
        Pz = np.zeros(d_, dt)
        Bz = np.empty(d_, dt)
        Z = np.empty(d_, dt)
        accz = np.empty(d_, np.float64)
        one = np.ones(2, dt)
        coef = np.empty(2, dt)
        for a in range(d_):
            for e in range(w):
                acc[a, e] = S0[h, a, e0 + e]
            accz[a] = Z0[h, a]
        _refresh(acc, accz, B, Bz, P, Pz, SV, Z, True)
        nchunks = (length + chunk - 1) // chunk
        for ci in range(nchunks):
            i0 = ci * chunk
            c = min(chunk, length - i0)
            load_rows(q, h, i0, c, fm, QA)
            _load_chunk_kv(k, v, h, i0, c, fm, e0, w, Kf, KT, Pz, SV, d_)
            gemm(False, False, QA[:c, :d_], KT[:, :c], 0.0, QA[:c, d_:d_ + c], coef)
            for t in range(c):
                for s in range(t + 1, c):
                    QA[t, d_ + s] = 0
            gemm(False, False, QA[:c, :d_ + c], SV[:d_ + c], 0.0, O[:c], coef)
            _store(O, QA, Z, c, d_, True, w, eps, normalize, out, h, i0, e0, one)
            gemm(False, False, KT[:, :c], SV[d_:d_ + c], 1.0, P, coef)  # pending state update
            _refresh(acc, accz, B, Bz, P, Pz, SV, Z, (ci + 1) % FOLD_EVERY == 0 or ci == nchunks - 1)
        for i in range(length, n):
            for e in range(w):
                out[h, i, e0 + e] = 0
        for a in range(d_):
            for e in range(w):
                S_out[h, a, e0 + e] = acc[a, e]
            if blk == 0:
                Z_out[h, a] = accz[a]


@njit(parallel=True)
def noncausal_forward(q, k, v, fm, eps, normalize, chunk, nsplit, out):
    """Non-causal linear attention: every position attends to all N positions of its head."""
    bh, n, d_ = q.shape
    dv = v.shape[2]
    dt = out.dtype
    for item in prange(bh * nsplit):
        h, blk, e0, w = _block(item, nsplit, dv)
        QA = np.empty((chunk, d_), dt)
        Kf = np.empty((chunk, d_), dt)
        KT = np.empty((d_, chunk), dt)
        V = np.empty((chunk, w), dt)
        O = np.empty((chunk, w), dt)
        P = np.zeros((d_, w), dt)
        B = np.empty((d_, w), dt)
        S = np.empty((d_, w), dt)
        acc = np.zeros((d_, w), np.float64)
        Pz = np.zeros(d_, dt)
        Bz = np.empty(d_, dt)
        Z = np.empty(d_, dt)
        accz = np.zeros(d_, np.float64)
        one = np.ones(2, dt)
        coef = np.empty(2, dt)
        nchunks = (n + chunk - 1) // chunk
        for ci in range(nchunks):
            i0 = ci * chunk
            c = min(chunk, n - i0)
            _load_chunk_kv(k, v, h, i0, c, fm, e0, w, Kf, KT, Pz, V, 0)
            gemm(False, False, KT[:, :c], V[:c], 1.0, P, coef)
            if (ci + 1) % FOLD_EVERY == 0 or ci == nchunks - 1:
                _refresh(acc, accz, B, Bz, P, Pz, S, Z, True)
        for ci in range(nchunks):
            i0 = ci * chunk
            c = min(chunk, n - i0)
            load_rows(q, h, i0, c, fm, QA)
            gemm(False, False, QA[:c], S, 0.0, O[:c], coef)
            _store(O, QA, Z, c, d_, False, w, eps, normalize, out, h, i0, e0, one)
