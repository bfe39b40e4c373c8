"""@cuda.jit kernels: chunkwise causal forward, non-causal forward and one decoding step.

A block owns one head and one tile of TE value columns and walks the sequence in chunks of C
positions with C x TE threads: thread (t, e) computes score row t and output (t, e); the state tile
S (D x TE) and Z stay in shared memory, in float64, for the whole sequence. Shared memory is one
dynamic float64 buffer: phi(Q), phi(K) (C x D each), V (C x TE), A (C x C), S (D x TE), Z (D),
denominators (C). Kernels compile on first launch; importing this module (done lazily, only for
the CUDA path) needs numba.cuda but no GPU.
"""
import math

from numba import cuda, float64


@cuda.jit(device=True)
def phi(x, fm):
    if fm == 1:  # elu + 1
        return x + 1.0 if x > 0 else math.exp(x)
    if fm == 2:  # relu, keeping NaN
        return x if (x > 0 or x != x) else 0.0 * x
    return x


@cuda.jit(device=True)
def load_chunk(q, k, v, h, i0, c, fm, e0, C, TE, d, dv, Qs, Ks, Vs, tid, nthreads):
    for i in range(tid, C * d, nthreads):
        t = i // d
        a = i - t * d
        if t < c:
            Qs[i] = phi(float64(q[h, i0 + t, a]), fm)
            Ks[i] = phi(float64(k[h, i0 + t, a]), fm)
        else:
            Qs[i] = 0.0
            Ks[i] = 0.0
    for i in range(tid, C * TE, nthreads):
        t = i // TE
        e = i - t * TE
        Vs[i] = v[h, i0 + t, e0 + e] if (t < c and e0 + e < dv) else 0.0


@cuda.jit(device=True)
def add_chunk_to_state(Ks, Vs, Ss, Zs, c, C, TE, d, tx, ty, tid, nthreads):
    for a in range(ty, d, C):
        acc = 0.0
        for t in range(c):
            acc += Ks[t * d + a] * Vs[t * TE + tx]
        Ss[a * TE + tx] += acc
    for a in range(tid, d, nthreads):
        z = 0.0
        for t in range(c):
            z += Ks[t * d + a]
        Zs[a] += z


@cuda.jit(device=True)
def block_position(C, TE):
    """(head, first value column, thread column, thread row, thread index, threads per block)."""
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    return cuda.blockIdx.x, cuda.blockIdx.y * TE, tx, ty, ty * TE + tx, C * TE


@cuda.jit(device=True)
def carve(sm, C, TE, d):
    """The views of the dynamic shared buffer: phi(Q), phi(K), V, A, S, Z, denominators."""
    o1 = 2 * C * d + C * TE
    o2 = o1 + C * C
    o3 = o2 + d * TE
    return (sm[0:C * d], sm[C * d:2 * C * d], sm[2 * C * d:o1], sm[o1:o2], sm[o2:o3], sm[o3:o3 + d],
            sm[o3 + d:o3 + d + C])


@cuda.jit
def causal(q, k, v, fm, eps, normalize, lengths, S0, Z0, out, S_out, Z_out, C, TE):
    h, e0, tx, ty, tid, nthreads = block_position(C, TE)
    n, d, dv = q.shape[1], q.shape[2], v.shape[2]
    Qs, Ks, Vs, As, Ss, Zs, dens = carve(cuda.shared.array(0, float64), C, TE, d)
    has_init = S0.shape[0] > 0
    for i in range(tid, d * TE, nthreads):
        a = i // TE
        e = i - a * TE
        Ss[i] = S0[h, a, e0 + e] if (has_init and e0 + e < dv) else 0.0
    for a in range(tid, d, nthreads):
        Zs[a] = Z0[h, a] if has_init else 0.0
    cuda.syncthreads()
    length = lengths[h]
    e = e0 + tx
    for i0 in range(0, length, C):
        c = min(C, length - i0)
        load_chunk(q, k, v, h, i0, c, fm, e0, C, TE, d, dv, Qs, Ks, Vs, tid, nthreads)
        cuda.syncthreads()
        for s in range(tx, C, TE):  # scores of row ty, masked
            acc = 0.0
            if s <= ty:
                for a in range(d):
                    acc += Qs[ty * d + a] * Ks[s * d + a]
            As[ty * C + s] = acc
        cuda.syncthreads()
        if tx == 0:
            den = 0.0
            for a in range(d):
                den += Qs[ty * d + a] * Zs[a]
            for s in range(ty + 1):
                den += As[ty * C + s]
            dens[ty] = den
        num = 0.0
        for a in range(d):
            num += Qs[ty * d + a] * Ss[a * TE + tx]
        for s in range(ty + 1):
            num += As[ty * C + s] * Vs[s * TE + tx]
        cuda.syncthreads()
        if ty < c and e < dv:
            out[h, i0 + ty, e] = num / (dens[ty] + eps) if normalize else num
        add_chunk_to_state(Ks, Vs, Ss, Zs, c, C, TE, d, tx, ty, tid, nthreads)
        cuda.syncthreads()
    if e < dv:
        for i in range(length + ty, n, C):
            out[h, i, e] = 0.0
    if S_out.shape[0] > 0:
        for i in range(tid, d * TE, nthreads):
            a = i // TE
            if e0 + i - a * TE < dv:
                S_out[h, a, e0 + i - a * TE] = Ss[i]
        if cuda.blockIdx.y == 0:
            for a in range(tid, d, nthreads):
                Z_out[h, a] = Zs[a]


@cuda.jit
def noncausal(q, k, v, fm, eps, normalize, out, C, TE):
    h, e0, tx, ty, tid, nthreads = block_position(C, TE)
    n, d, dv = q.shape[1], q.shape[2], v.shape[2]
    Qs, Ks, Vs, _, Ss, Zs, dens = carve(cuda.shared.array(0, float64), C, TE, d)
    for i in range(tid, d * TE, nthreads):
        Ss[i] = 0.0
    for a in range(tid, d, nthreads):
        Zs[a] = 0.0
    cuda.syncthreads()
    for i0 in range(0, n, C):  # the state over the whole sequence
        c = min(C, n - i0)
        load_chunk(q, k, v, h, i0, c, fm, e0, C, TE, d, dv, Qs, Ks, Vs, tid, nthreads)
        cuda.syncthreads()
        add_chunk_to_state(Ks, Vs, Ss, Zs, c, C, TE, d, tx, ty, tid, nthreads)
        cuda.syncthreads()
    e = e0 + tx
    for i0 in range(0, n, C):
        c = min(C, n - i0)
        load_chunk(q, k, v, h, i0, c, fm, e0, C, TE, d, dv, Qs, Ks, Vs, tid, nthreads)
        cuda.syncthreads()
        if tx == 0:
            den = 0.0
            for a in range(d):
                den += Qs[ty * d + a] * Zs[a]
            dens[ty] = den
        num = 0.0
        for a in range(d):
            num += Qs[ty * d + a] * Ss[a * TE + tx]
        cuda.syncthreads()
        if ty < c and e < dv:
            out[h, i0 + ty, e] = num / (dens[ty] + eps) if normalize else num
        cuda.syncthreads()


@cuda.jit
def step(q, k, v, fm, eps, normalize, S, Z, out, T):
    """One block per head, T threads looping over the value columns."""
    h = cuda.blockIdx.x
    tx = cuda.threadIdx.x
    d, dv = S.shape[1], S.shape[2]
    sm = cuda.shared.array(0, float64)
    qf = sm[0:d]
    kf = sm[d:2 * d]
    for a in range(tx, d, T):
        qf[a] = phi(float64(q[h, a]), fm)
        kf[a] = phi(float64(k[h, a]), fm)
    cuda.syncthreads()
    den = 0.0
    for a in range(d):
        den += qf[a] * (Z[h, a] + kf[a])
    for e in range(tx, dv, T):
        num = 0.0
        ve = float64(v[h, e])
        for a in range(d):
            s = S[h, a, e] + kf[a] * ve
            S[h, a, e] = s
            num += qf[a] * s
        out[h, e] = num / (den + eps) if normalize else num
    cuda.syncthreads()
    for a in range(tx, d, T):
        Z[h, a] += kf[a]

