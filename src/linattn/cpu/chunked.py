"""Chunkwise causal and non-causal linear-attention kernels over (batch*heads, N, D) arrays.

Each parallel work item owns one head and one block of value columns. Inside a chunk of ``chunk``
positions the kernel forms the masked scores A = tril(phi(Q) phi(K)^T) and the outputs
phi(Q) S + A V with BLAS (np.dot); between chunks it carries the state S (with Z as an extra
column, by appending a column of ones to V) in float64, so float32 results do not drift over
millions of positions. Extra memory is O(D * Dv) per work item.
"""
import numpy as np
from numba import prange

from .._jit import njit
from .elementwise import load_rows


@njit(helper=True)
def _load_kv(k, v, h, i0, c, fm, e0, w, Kf, KT, Va):
    """phi(K) of the chunk, its transpose, and V's columns [e0, e0+w) with a column of ones."""
    chunk = Kf.shape[0]
    if c < chunk:  # zero padding keeps the padded rows out of every product
        Kf[c:] = 0
        Va[c:] = 0
    load_rows(k, h, i0, c, fm, Kf)
    for t in range(chunk):
        for a in range(Kf.shape[1]):
            KT[a, t] = Kf[t, a]
    for t in range(c):
        for e in range(w):
            Va[t, e] = v[h, i0 + t, e0 + e]
        Va[t, w] = 1


@njit(helper=True)
def _store_rows(O, c, w, eps, normalize, out, h, i0, e0, one):
    """out[h, i0+t, e0:e0+w] = numerator / (denominator + eps), the denominator in column w."""
    if normalize:
        for t in range(c):
            one[1] = one[0] / (O[t, w] + eps)
            inv = one[1]
            for e in range(w):
                out[h, i0 + t, e0 + e] = O[t, e] * inv
    else:
        for t in range(c):
            for e in range(w):
                out[h, i0 + t, e0 + e] = O[t, e]


@njit(helper=True)
def _block(item, nsplit, dv):
    h = item // nsplit
    blk = item - h * nsplit
    width = (dv + nsplit - 1) // nsplit
    e0 = blk * width
    return h, blk, e0, min(dv, e0 + width) - e0


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
        Qf = np.zeros((chunk, d_), dt)
        Kf = np.zeros((chunk, d_), dt)
        KT = np.zeros((d_, chunk), dt)
        Va = np.zeros((chunk, w + 1), dt)
        A = np.empty((chunk, chunk), dt)
        O = np.empty((chunk, w + 1), dt)
        T = np.empty((chunk, w + 1), dt)
        dS = np.empty((d_, w + 1), dt)
        S = np.empty((d_, w + 1), dt)
        acc = np.empty((d_, w + 1), np.float64)
        one = np.ones(2, dt)
        for a in range(d_):
            for e in range(w):
                acc[a, e] = S0[h, a, e0 + e]
            acc[a, w] = Z0[h, a]
            for e in range(w + 1):
                S[a, e] = acc[a, e]
        for i0 in range(0, length, chunk):
            c = min(chunk, length - i0)
            if c < chunk:
                Qf[c:] = 0
            load_rows(q, h, i0, c, fm, Qf)
            _load_kv(k, v, h, i0, c, fm, e0, w, Kf, KT, Va)
            np.dot(Qf, KT, A)
            for t in range(chunk):
                for s in range(t + 1, chunk):
                    A[t, s] = 0
            np.dot(Qf, S, O)
            np.dot(A, Va, T)
            for t in range(c):
                for e in range(w + 1):
                    O[t, e] += T[t, e]
            _store_rows(O, c, w, eps, normalize, out, h, i0, e0, one)
            np.dot(KT, Va, dS)
            for a in range(d_):
                for e in range(w + 1):
                    acc[a, e] += dS[a, e]
                    S[a, e] = acc[a, e]
        for i in range(length, n):
            for e in range(w):
                out[h, i, e0 + e] = 0
        for a in range(d_):
            for e in range(w):
                S_out[h, a, e0 + e] = acc[a, e]
            if blk == 0:
                Z_out[h, a] = acc[a, w]


@njit(parallel=True)
def noncausal_forward(q, k, v, fm, eps, normalize, chunk, nsplit, out):
    """Non-causal linear attention: every position attends to all N positions of its head."""
    bh, n, d_ = q.shape
    dv = v.shape[2]
    dt = out.dtype
    for item in prange(bh * nsplit):
        h, blk, e0, w = _block(item, nsplit, dv)
        Qf = np.zeros((chunk, d_), dt)
        Kf = np.zeros((chunk, d_), dt)
        KT = np.zeros((d_, chunk), dt)
        Va = np.zeros((chunk, w + 1), dt)
        O = np.empty((chunk, w + 1), dt)
        dS = np.empty((d_, w + 1), dt)
        S = np.empty((d_, w + 1), dt)
        acc = np.zeros((d_, w + 1), np.float64)
        one = np.ones(2, dt)
        for i0 in range(0, n, chunk):
            c = min(chunk, n - i0)
            _load_kv(k, v, h, i0, c, fm, e0, w, Kf, KT, Va)
            np.dot(KT, Va, dS)
            for a in range(d_):
                for e in range(w + 1):
                    acc[a, e] += dS[a, e]
        for a in range(d_):
            for e in range(w + 1):
                S[a, e] = acc[a, e]
        for i0 in range(0, n, chunk):
            c = min(chunk, n - i0)
            if c < chunk:
                Qf[c:] = 0
            load_rows(q, h, i0, c, fm, Qf)
            np.dot(Qf, S, O)
            _store_rows(O, c, w, eps, normalize, out, h, i0, e0, one)
