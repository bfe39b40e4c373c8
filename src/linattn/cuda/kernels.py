"""@cuda.jit kernels: chunkwise causal forward, non-causal forward and one decoding step.

A block owns one head (or one segment of a head, below) and one tile of TE value columns and walks
its positions in chunks of C with C x TE threads: thread (t, e) computes score row t and output
(t, e); the state tile S (D x TE) and Z stay in shared memory, in float64, from the first chunk to
the last. Where the heads' blocks alone would leave most of the GPU idle, the causal forward splits
each head into P segments of L positions (a multiple of C) in three launches: ``segment_sums``
(each segment's own S and Z, from zero, and its total decay), ``scan_segments`` (each segment's
starting state: the initial state carried through the segments before it) and ``causal`` (each
segment's outputs from its starting state, as one block of the unsplit form would); the non-causal
forward likewise sums its keys by segment, adds the segments' sums up (``scan_segments``' totals)
and computes its queries' outputs by segment. The segments' sums and states are float64 device
arrays of (heads x P, D', Dv), P chosen so that the blocks about fill the GPU (cuda/api.segments).

D is the number of features D' (``fp[1]``): the feature map (code ``fm``, parameters ``fp``:
cuda/maps.py) is computed from the rows of q and k as each chunk is loaded. Shared memory is one
dynamic float64 buffer: phi(Q), phi(K) (C x D each), V (C x TE), A (C x C), S (D x TE), Z (D),
denominators (C), the map's row statistics (4 C), and with gates G, R (C x W each, W = 1 or D).
Kernels compile on first launch; importing this module (done lazily, only for the CUDA path) needs
numba.cuda but no GPU.

Gates as on the CPU (cpu/gating.py): ``gk`` 0 (none), 1 (``gates`` (BH, N, 1): a log gate per
position) or 2 ((BH, N, D): per key dimension), plus ``ld[h]`` (a log decay per head). Per chunk
G[t] is the sum of the log gates since the last reset at or before t (R[t], -1 for none; float64
like everything here); position s's term reaches t >= s with exp(G[t] - G[s]), 0 past a reset;
only exponentials of non-positive numbers. A positive or NaN gate is reported in ``status``.
"""
import math

from numba import cuda, float64

from .maps import feature, has_stats, row_stats


@cuda.jit(device=True)
def load_chunk(q, k, v, h, i0, c, fm, fp, e0, C, TE, d, dv, Qs, Ks, Vs, Ms, tid, nthreads):
    """phi(Q), phi(K) (C x D' each, zero past the chunk's c rows) and the tile of V of the chunk at i0:
    the map's row statistics first (Ms: 2 per row, q's rows then k's), then one feature per thread."""
    din = q.shape[2]
    qh, kh = q[h], k[h]
    stats = has_stats(fm)
    if stats:
        for i in range(tid, 2 * c, nthreads):
            st = row_stats(qh if i < c else kh, i0 + (i if i < c else i - c), fp, fm, din, d)
            Ms[2 * i] = st[0]
            Ms[2 * i + 1] = st[1]
        cuda.syncthreads()
    for i in range(tid, C * d, nthreads):
        t = i // d
        f = i - t * d
        if t < c:  # (Ms is read only where it was written)
            q0, q1 = (Ms[2 * t], Ms[2 * t + 1]) if stats else (0.0, 0.0)
            k0, k1 = (Ms[2 * (c + t)], Ms[2 * (c + t) + 1]) if stats else (0.0, 0.0)
            Qs[i] = feature(qh, i0 + t, fp, fm, f, din, d, q0, q1)
            Ks[i] = feature(kh, i0 + t, fp, fm, f, din, d, k0, k1)
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
    """The views of the dynamic shared buffer: phi(Q), phi(K), V, A, S, Z, denominators, the feature
    map's row statistics (4 C)."""
    o1 = 2 * C * d + C * TE
    o2 = o1 + C * C
    o3 = o2 + d * TE
    o4 = o3 + d + C
    return (sm[0:C * d], sm[C * d:2 * C * d], sm[2 * C * d:o1], sm[o1:o2], sm[o2:o3], sm[o3:o3 + d],
            sm[o3 + d:o4], sm[o4:o4 + 4 * C])


@cuda.jit(device=True)
def carve_gates(sm, C, TE, d, gk):
    """G and R (C x w each) after carve's views, and w: 0 without gates (gk 0), 1 for a gate per position
    (1), D' per key dimension (2)."""
    w = 0 if gk == 0 else (1 if gk == 1 else d)
    o = 2 * C * d + C * TE + C * C + d * TE + d + 5 * C
    return sm[o:o + C * w], sm[o + C * w:o + 2 * C * w], w


@cuda.jit(device=True)
def chunk_gates(gates, gk, ld, h, i0, c, Gs, Rs, w, status, tid, nthreads):
    """Gs, Rs of the chunk (one thread per column of w; nothing without gates: w = 0)."""
    for a in range(tid, w, nthreads):
        total = 0.0
        last = -1.0
        for t in range(c):
            x = float64(gates[h, i0 + t, a])
            if x > 0 or x != x:
                status[0] = 1 if x > 0 else 2
                status[1] = h
                status[2] = i0 + t
            g = x + ld[h]
            if g == -math.inf:
                total = 0.0
                last = float64(t)
            else:
                total += g
            Gs[t * w + a] = total
            Rs[t * w + a] = last


@cuda.jit(device=True)
def factor(Gs, Rs, w, t, s, a):
    """Position s's factor at t (s = -1: the state before the chunk), column a of G and R."""
    if gkw_reset(Rs, w, t, a) > s:
        return 0.0
    return math.exp(Gs[t * w + a] - (Gs[s * w + a] if s >= 0 else 0.0))


@cuda.jit(device=True)
def gkw_reset(Rs, w, t, a):
    return Rs[t * w + a]


@cuda.jit(device=True)
def start_state(S0, Z0, h, e0, Ss, Zs, d, dv, TE, tid, nthreads):
    """The block's tile of S (D' x TE) and all of Z from row h of the initial state (zero when h is not
    one of S0's rows: S0 has none, or h = -1)."""
    has_init = 0 <= h < S0.shape[0]
    for i in range(tid, d * TE, nthreads):
        a = i // TE
        e = i - a * TE
        Ss[i] = S0[h, a, e0 + e] if (has_init and e0 + e < dv) else 0.0
    for a in range(tid, d, nthreads):
        Zs[a] = Z0[h, a] if has_init else 0.0


@cuda.jit(device=True)
def write_state(Ss, Zs, S_out, Z_out, h, e0, d, dv, TE, tid, nthreads):
    """The block's tile of S into S_out, and Z into Z_out from the first tile's block (nothing when
    S_out has no rows)."""
    if S_out.shape[0] > 0:
        for i in range(tid, d * TE, nthreads):
            a = i // TE
            if e0 + i - a * TE < dv:
                S_out[h, a, e0 + i - a * TE] = Ss[i]
        if cuda.blockIdx.y == 0:
            for a in range(tid, d, nthreads):
                Z_out[h, a] = Zs[a]


@cuda.jit(device=True)
def zero_past(out, h, length, e, dv, ty, C, end):
    """Column e of head h's outputs in rows ``length`` to ``end`` = 0 (the padding), rows ty, ty + C, ...
    of them by this thread."""
    if e < dv:
        for i in range(length + ty, end, C):
            out[h, i, e] = 0.0


@cuda.jit(device=True)
def segment_of(P, L, n, length):
    """(head, segment, first position, end of its positions that count, end of its rows) of this block
    (block x = head * P + segment; a head's first ``length`` positions count)."""
    x = cuda.blockIdx.x
    h = x // P
    seg = x - h * P
    lo = seg * L
    return h, seg, lo, min(lo + L, length), min(lo + L, n)


@cuda.jit
def causal(q, k, v, fm, fp, eps, normalize, lengths, S0, Z0, out, S_out, Z_out, C, TE, gates, gk, ld, scale,
           status, P, L):
    """The outputs of segment ``seg`` of head h (P segments of L positions a head; block x = h * P + seg)
    from its starting state, row x of S0, Z0 (zero where they have no rows); the last segment writes
    the final state into S_out, Z_out (where they have rows)."""
    x, e0, tx, ty, tid, nthreads = block_position(C, TE)
    n, d, dv = q.shape[1], int(fp[1]), v.shape[2]  # d: the features' number D'
    h, seg, lo, hi, end = segment_of(P, L, n, lengths[x // P])
    sm = cuda.shared.array(0, float64)
    Qs, Ks, Vs, As, Ss, Zs, dens, Ms = carve(sm, C, TE, d)
    Gs, Rs, w = carve_gates(sm, C, TE, d, gk)
    start_state(S0, Z0, x, e0, Ss, Zs, d, dv, TE, tid, nthreads)
    cuda.syncthreads()
    e = e0 + tx
    for i0 in range(lo, hi, C):
        c = min(C, hi - i0)
        load_chunk(q, k, v, h, i0, c, fm, fp, e0, C, TE, d, dv, Qs, Ks, Vs, Ms, tid, nthreads)
        chunk_gates(gates, gk, ld, h, i0, c, Gs, Rs, w, status, tid, nthreads)
        cuda.syncthreads()
        for s in range(tx, C, TE):  # scores of row ty, masked (and decayed)
            acc = 0.0
            if s <= ty and ty < c:
                for a in range(d):
                    f = 1.0 if gk != 2 else factor(Gs, Rs, w, ty, s, a)
                    acc += Qs[ty * d + a] * Ks[s * d + a] * f
                if gk == 1:
                    acc *= factor(Gs, Rs, w, ty, s, 0)
            As[ty * C + s] = acc
        cuda.syncthreads()
        if tx == 0:
            den = 0.0
            for a in range(d):
                f = 1.0 if (gk == 0 or ty >= c) else factor(Gs, Rs, w, ty, -1, 0 if gk == 1 else a)
                den += Qs[ty * d + a] * f * Zs[a]
            for s in range(ty + 1):
                den += As[ty * C + s]
            dens[ty] = den
        num = 0.0
        for a in range(d):
            f = 1.0 if (gk == 0 or ty >= c) else factor(Gs, Rs, w, ty, -1, 0 if gk == 1 else a)
            num += Qs[ty * d + a] * f * Ss[a * TE + tx]
        for s in range(ty + 1):
            num += As[ty * C + s] * Vs[s * TE + tx]
        cuda.syncthreads()
        if ty < c and e < dv:
            out[h, i0 + ty, e] = scale * num / (scale * dens[ty] + eps) if normalize else scale * num
        add_to_state(Ks, Vs, Ss, Zs, c, C, TE, d, tx, ty, tid, nthreads, Gs, Rs, w, gk)
        cuda.syncthreads()
    zero_past(out, h, max(lo, hi), e, dv, ty, C, end)
    if seg == P - 1:
        write_state(Ss, Zs, S_out, Z_out, h, e0, d, dv, TE, tid, nthreads)


@cuda.jit
def segment_sums(k, v, fm, fp, lengths, Sb, Zb, Fb, C, TE, gates, gk, ld, status, P, L):
    """Segment seg of head h's own state (block x = h * P + seg, as ``causal``): its keys' sums from
    zero, each key decayed to the segment's end, into row x of Sb, Zb; and, with gates, its total
    decay (each column's factor from the segment's start to its end) into row x of Fb."""
    x, e0, tx, ty, tid, nthreads = block_position(C, TE)
    n, d, dv = k.shape[1], int(fp[1]), v.shape[2]
    h, seg, lo, hi, end = segment_of(P, L, n, lengths[x // P])
    sm = cuda.shared.array(0, float64)
    Qs, Ks, Vs, As, Ss, Zs, dens, Ms = carve(sm, C, TE, d)
    Gs, Rs, w = carve_gates(sm, C, TE, d, gk)
    start_state(Sb, Zb, -1, e0, Ss, Zs, d, dv, TE, tid, nthreads)
    first = cuda.blockIdx.y == 0  # (the factors are the same for every tile: one block writes them)
    for a in range(tid, w if first else 0, nthreads):
        Fb[x, a] = 1.0
    cuda.syncthreads()
    for i0 in range(lo, hi, C):
        c = min(C, hi - i0)
        load_chunk(k, k, v, h, i0, c, fm, fp, e0, C, TE, d, dv, Qs, Ks, Vs, Ms, tid, nthreads)
        chunk_gates(gates, gk, ld, h, i0, c, Gs, Rs, w, status, tid, nthreads)
        cuda.syncthreads()
        add_to_state(Ks, Vs, Ss, Zs, c, C, TE, d, tx, ty, tid, nthreads, Gs, Rs, w, gk)
        for a in range(tid, w if first else 0, nthreads):  # (a column by the same thread in every chunk)
            Fb[x, a] *= factor(Gs, Rs, w, c - 1, -1, a)
        cuda.syncthreads()
    write_state(Ss, Zs, Sb, Zb, x, e0, d, dv, TE, tid, nthreads)


@cuda.jit
def scan_segments(S0, Z0, Sb, Zb, Fb, gk, P, TE, S_tot, Z_tot):
    """Each segment's starting state in place of its own sums (rows h * P ... h * P + P - 1 of Sb, Zb):
    head h's initial state (row h of S0, Z0; zero where they have no rows) carried through the segments
    before it, each decaying the state by its factors (Fb) and adding its sums; the state after the
    last into row h of S_tot, Z_tot where they have rows. Block (h, tile of TE value columns); each
    thread walks the segments for its entries of S and Z."""
    h, e0 = cuda.blockIdx.x, cuda.blockIdx.y * TE
    tid = cuda.threadIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    nthreads = cuda.blockDim.x * cuda.blockDim.y
    d, dv = Sb.shape[1], Sb.shape[2]
    has_init = S0.shape[0] > 0
    wide = gk == 2
    for i in range(tid, d * TE + (d if cuda.blockIdx.y == 0 else 0), nthreads):
        is_z = i >= d * TE  # Z's entries after S's tile, by the first tile's block
        a = i - d * TE if is_z else i // TE
        e = e0 + i - a * TE
        if is_z or e < dv:
            s = (Z0[h, a] if is_z else S0[h, a, e]) if has_init else 0.0
            for seg in range(P):
                r = h * P + seg
                own = Zb[r, a] if is_z else Sb[r, a, e]
                if is_z:
                    Zb[r, a] = s
                else:
                    Sb[r, a, e] = s
                f = 1.0 if gk == 0 else Fb[r, a if wide else 0]
                s = f * s + own
            if S_tot.shape[0] > 0:
                if is_z:
                    Z_tot[h, a] = s
                else:
                    S_tot[h, a, e] = s


@cuda.jit(device=True)
def add_to_state(Ks, Vs, Ss, Zs, c, C, TE, d, tx, ty, tid, nthreads, Gs, Rs, w, gk):
    """The chunk's keys and values added to the state, decayed by the chunk's gates where there are
    any (gk != 0)."""
    if gk == 0:
        add_chunk_to_state(Ks, Vs, Ss, Zs, c, C, TE, d, tx, ty, tid, nthreads)
    else:
        add_decayed_chunk(Ks, Vs, Ss, Zs, c, C, TE, d, tx, ty, tid, nthreads, Gs, Rs, w, gk)


@cuda.jit(device=True)
def add_decayed_chunk(Ks, Vs, Ss, Zs, c, C, TE, d, tx, ty, tid, nthreads, Gs, Rs, w, gk):
    """S = decay S + the chunk's keys (each with its factor at the chunk's end) times V; Z likewise."""
    for a in range(ty, d, C):
        col = 0 if gk == 1 else a
        acc = 0.0
        for t in range(c):
            acc += Ks[t * d + a] * factor(Gs, Rs, w, c - 1, t, col) * Vs[t * TE + tx]
        Ss[a * TE + tx] = factor(Gs, Rs, w, c - 1, -1, col) * Ss[a * TE + tx] + acc
    for a in range(tid, d, nthreads):
        col = 0 if gk == 1 else a
        z = 0.0
        for t in range(c):
            z += Ks[t * d + a] * factor(Gs, Rs, w, c - 1, t, col)
        Zs[a] = factor(Gs, Rs, w, c - 1, -1, col) * Zs[a] + z


@cuda.jit
def noncausal(q, k, v, fm, fp, eps, normalize, lengths, qlengths, S0, Z0, out, S_out, Z_out, C, TE, scale, P, L,
              summed):
    """Block x = h * P + seg and a tile of TE value columns: the outputs of segment seg of head h's queries
    (P segments of L; the first qlengths[h] count, 0 past them) from the state of every key: row h of
    S0, Z0 itself where ``summed`` (scan_segments' totals), else S0, Z0 (zero where they have no rows)
    plus the keys' chunks (the first lengths[h]) summed here. The first segment's block writes that
    state to S_out, Z_out where they have rows. (q (BH, N, D), k (BH, Nk, D), v (BH, Nk, Dv).)"""
    x, e0, tx, ty, tid, nthreads = block_position(C, TE)
    h, seg, lo, hi, end = segment_of(P, L, out.shape[1], qlengths[x // P])
    nk, d, dv = lengths[h], int(fp[1]), v.shape[2]
    Qs, Ks, Vs, _, Ss, Zs, dens, Ms = carve(cuda.shared.array(0, float64), C, TE, d)
    start_state(S0, Z0, h, e0, Ss, Zs, d, dv, TE, tid, nthreads)
    cuda.syncthreads()
    for i0 in range(0, 0 if summed else nk, C):  # the keys' state (k and v may be longer or shorter than q)
        c = min(C, nk - i0)
        load_chunk(k, k, v, h, i0, c, fm, fp, e0, C, TE, d, dv, Qs, Ks, Vs, Ms, tid, nthreads)
        cuda.syncthreads()
        add_chunk_to_state(Ks, Vs, Ss, Zs, c, C, TE, d, tx, ty, tid, nthreads)
        cuda.syncthreads()
    if seg == 0:
        write_state(Ss, Zs, S_out, Z_out, h, e0, d, dv, TE, tid, nthreads)
    e = e0 + tx
    for i0 in range(lo, hi, C):
        c = min(C, hi - i0)
        # the queries' features alone (no value columns: dv 0)
        load_chunk(q, q, v, h, i0, c, fm, fp, e0, C, TE, d, 0, Qs, Ks, Vs, Ms, tid, nthreads)
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
            out[h, i0 + ty, e] = scale * num / (scale * dens[ty] + eps) if normalize else scale * num
        cuda.syncthreads()
    zero_past(out, h, max(lo, hi), e, dv, ty, C, end)  # (the padded queries)


@cuda.jit
def step(q, k, v, fm, fp, eps, normalize, S, Z, out, T, gates, gk, ld, scale):
    """One block per head, T threads looping over the value columns; gates and decay as for causal
    (gates (BH, 1) or (BH, D') for this step; the caller checked their values)."""
    h = cuda.blockIdx.x
    tx = cuda.threadIdx.x
    d, dv, din = S.shape[1], S.shape[2], q.shape[1]
    sm = cuda.shared.array(0, float64)
    qf = sm[0:d]
    kf = sm[d:2 * d]
    df = sm[2 * d:3 * d]
    st = sm[3 * d:3 * d + 4]  # the map's row statistics of q and k (zeros for maps without any)
    if tx < 2:
        s0, s1 = row_stats(q if tx == 0 else k, h, fp, fm, din, d)
        st[2 * tx] = s0
        st[2 * tx + 1] = s1
    cuda.syncthreads()
    for a in range(tx, d, T):
        qf[a] = feature(q, h, fp, fm, a, din, d, st[0], st[1])
        kf[a] = feature(k, h, fp, fm, a, din, d, st[2], st[3])
        g = ld[h] if ld.shape[0] > 0 else 0.0
        if gk != 0:
            g += float64(gates[h, a if gk == 2 else 0])
        df[a] = math.exp(g)
    cuda.syncthreads()
    den = 0.0
    for a in range(d):
        den += qf[a] * (df[a] * Z[h, a] + kf[a])
    for e in range(tx, dv, T):
        num = 0.0
        ve = float64(v[h, e])
        for a in range(d):
            s = df[a] * S[h, a, e] + kf[a] * ve
            S[h, a, e] = s
            num += qf[a] * s
        out[h, e] = scale * num / (scale * den + eps) if normalize else scale * num
    cuda.syncthreads()
    for a in range(tx, d, T):
        Z[h, a] = df[a] * Z[h, a] + kf[a]
