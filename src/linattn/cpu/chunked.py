"""Chunkwise causal and non-causal linear-attention kernels over (G1, G2, N, D) arrays.

The inputs' leading dims are merged into two (G1, G2) so that strided views such as the heads of a
fused QKV projection, (B, H) with the heads D apart, reach the kernels without a copy; head h is
[h // G2, h % G2]. A work item owns one head, or one segment of a head's sequence when there are
fewer heads than threads, and walks it in chunks of ``chunk`` positions. Threads take items one at
a time from a shared counter (schedule.take), so a thread that is slowed down does fewer of them.
Per chunk, with phi(Q), phi(K) (c x D) and V (c x Dv):

    A   = tril(phi(Q) phi(K)^T)              scores inside the chunk (one GEMM)
    out = [phi(Q) | A] @ [S ; V]             state before the chunk + the chunk itself (one GEMM)
    P  += phi(K)^T V                         pending state update (one GEMM)

then each output row is divided by phi(q).Z + (row sum of A) + eps. The pending float32 sums P are
folded into a float64 accumulator every FOLD_EVERY chunks, so float32 results do not drift over
millions of positions while the per-chunk work stays in float32.

A segment's item first sums phi(K)^T V over the chunks before its segment (the "prefix": about
0.36 of a chunk's full cost; walked as the unsplit run walks them, without outputs, so its state is
the unsplit run's bit for bit), so items need no barrier; segment lengths shrink geometrically so
that every item does the same work. Or the kernel runs twice: first the head's first segment runs
whole while each of the others but the last sums its own chunks, then each of the others starts from
the first's final state and the parts between (runtime.plan chooses: two runs from two threads on a
long head). Or, where the plan splits heads and they are long enough, the threads split them as they
run (cpu/dynamic.py: one run; a slowed thread does less). Extra memory is O(chunk * (D + Dv) + D * Dv)
per item.
"""
import numpy as np
from numba import types

from .._jit import array, njit
from .buffers import empty, zeros
from . import gating
from .dynamic import DONE, RUN_SPLIT, SPLIT, STARTING, SUM_COST, job_chunks, mark_swap, next_job, publish
from .elementwise import exp_le0
from .gating import (chunk_gates, gate_buffers, gate_key_columns, gate_log_sum, gate_pending, gate_queries,
                     gate_scores, gate_state_factors, touch_gates)
from .mapfns import load_features, map_state, mapped_dim
from .schedule import take
from .smallgemm import noinline, small_gemm, small_gemm_stacked, small_gemm_tn
from .threaded import ThreadedKernel
from .views import as_contiguous, keep_alive, prefetch_rows_for_writing, touch_rows, unowned
from .vector import store_fence, stream_copy, transpose_padded, transpose_rows

#: Chunks between folds of the pending float32 sums into the float64 state.
FOLD_EVERY = 16

#: Every TOUCH_CHUNKS chunks a segment loads one byte of each cache line of the next TOUCH_CHUNKS
#: chunks' input rows (``touch_rows``: q, k, v and gates per key dimension here; the backward kernels
#: theirs) before using them. Right after a NumPy matmul (the
#: inputs in memory or in the other core's cache) this took B1 H8 N2048 from 1.52-1.65 to 1.32-1.46
#: ms; back to back, with the inputs in this core's cache, it costs 2-5%. 4 to 16 do about as well.
TOUCH_CHUNKS = 8


@njit(helper=True)
def _segment(item, nseg, frac, nchunks):
    """(head, segment, first chunk, end chunk) of work item ``item``."""
    h = item // nseg
    s = item - h * nseg
    return h, s, int(frac[s] * nchunks + 0.5), int(frac[s + 1] * nchunks + 0.5)


@njit(helper=True)
def job_of(kind, item, y, tb, dynamic, lengths, chunk, nseg, frac, two_runs, summing):
    """A thread's job (next_job's kind, item, y, tb) as a causal kernel runs it: (head, segment, length,
    first chunk, end chunk, last, whole, sums_only, idle) in the kernel's walk order (the backward's
    from a head's end): a dynamic split's (dynamic.job_chunks: segments of FOLD_EVERY chunks) or a
    fixed segment's (_segment, segment_role; ``two_runs``, ``summing``: its kernel's run)."""
    if dynamic:
        length = lengths[item]
        c0, c1, last, whole, sums_only = job_chunks(kind, y, tb, length, chunk, int(FOLD_EVERY))
        return item, y, length, c0, c1, last, whole, sums_only, False
    length = lengths[item // nseg]
    h, s, c0, c1 = _segment(item, nseg, frac, (length + chunk - 1) // chunk)
    whole, sums_only, idle = segment_role(s, two_runs, summing)
    return h, s, length, c0, c1, s == nseg - 1, whole, sums_only, idle


@njit(helper=True)
def _load_kt(k, i0, c, mp, Kf, KT, Pz):
    """KT[:, :c] = phi(k[i0:i0+c])^T (one head) and Pz += its row sums (the chunk's part of Z); a short
    chunk's next columns of KT zero (vector.transpose_padded)."""
    load_features(k, i0, c, mp, Kf)
    transpose_padded(Kf, KT, Pz, c)


@njit(helper=True)
def _copy_rows(v, i0, c, V, r0):
    """V[r0:r0+c] = v[i0:i0+c] (one head)."""
    if v.strides[1] == v.itemsize:
        for t in range(c):
            _copy_row(as_contiguous(v[i0 + t]), V[r0 + t])
    else:
        for t in range(c):
            _copy_row(v[i0 + t], V[r0 + t])


@njit(helper=True)
def _adjacent_rows(x):
    """Whether the rows of x (its last two axes) lie one right after another in memory, each of adjacent
    elements (C order within every matrix; a fused projection's head views are not)."""
    return x.strides[-1] == x.itemsize and x.strides[-2] == x.shape[-1] * x.itemsize


@njit(helper=True)
def _add_keys(k, v, i0, c, mp, Kf, V, P, Pz, beta):
    """P = beta P + phi(K)^T V (beta 0: P holds nothing yet) and Pz += phi(K)^T 1 for positions
    [i0, i0 + c) of one head (phi(K) used as it is, not transposed). Rows of v apart in memory (a fused
    projection's head views) are copied first: read in place by the product they cost the non-causal
    call on such views 5% more (B8 H8 N512: 2.44 ms against 2.31)."""
    load_features(k, i0, c, mp, Kf)
    for s in range(c):
        row = Kf[s]
        for a in range(Kf.shape[1]):
            Pz[a] += row[a]
    if _adjacent_rows(v):  # (adjacent rows serve as they are)
        small_gemm_tn(Kf[:c], v[i0:i0 + c], P, beta)
    else:
        _copy_rows(v, i0, c, V, int(0))  # bool()/int(): run-time values, not literals (see _jit)
        small_gemm_tn(Kf[:c], V[:c], P, beta)


@njit(helper=True)
def _rows_to_touch(ci, c0, c1, chunk, length):
    """How many rows from chunk ci's first to load into the cache (touch_rows) before chunk ci of a
    walk over chunks [c0, c1) of a sequence of ``length``: those of the next TOUCH_CHUNKS chunks at
    the first of every TOUCH_CHUNKS, else 0."""
    if (ci - c0) % TOUCH_CHUNKS:
        return 0
    return min(min(c1, ci + TOUCH_CHUNKS) * chunk, length) - ci * chunk


@njit(helper=True)
def _copy_row(src, dst):
    """dst[:len(src)] = src, as a loop: a slice assignment from an array compiles NumPy's shape-error
    message into the kernel (~2.5 s of a cold first call)."""
    for e in range(src.shape[0]):
        dst[e] = src[e]


@njit(helper=True)
def _state_buffers(d_, dv, dt):
    """(P, B, acc, Pz, Bz, Z, accz, lam): pending sums, the accumulator rounded to the compute dtype,
    the float64 accumulator, and the same for Z plus the current Z; lam, the log-decay of each key
    dimension since the last fold (float64). The Z parts and lam start at zero; P, B and acc are not
    initialised (zeroing them cost a tiny call more than its arithmetic): the caller's flags
    ``has_acc`` and ``has_p`` say whether they hold values."""
    return (empty((d_, dv), dt), empty((d_, dv), dt), empty((d_, dv), np.float64),
            zeros(d_, dt), zeros(d_, dt), zeros(d_, dt), zeros(d_, np.float64),
            zeros(d_, np.float64))


@njit(helper=True)
def reset_state_buffers(sbuf):
    """Zero the parts of _state_buffers' tuple ``sbuf`` that start at zero (Pz, Bz, Z, accz, lam), for
    its next job: a thread makes its buffers once (nine allocations a job cost a tiny head ~0.5 us)."""
    P, B, acc, Pz, Bz, Z, accz, lam = sbuf
    for a in range(Pz.shape[0]):
        Pz[a] = 0
        Bz[a] = 0
        Z[a] = 0
        accz[a] = 0
        lam[a] = 0


@njit(helper=True)
def _init_state(S0, Z0, h, B, accz, Bz):
    """B = S0[h] and accz, Bz = Z0[h]; returns has_acc: False when S0 is empty (no initial state, a
    zero accumulator). The float64 accumulator is not written: it equals B exactly until the first
    fold, and the helpers that read it (pending_added, segment_parts, _write_state) are told so by
    their ``acc_in_b`` (True after this where has_acc): a short call from a state (a few chunks, or
    a few positions) skips widening and storing S0[h] (B8 H8 N4 D64: 23% fewer samples in the kernel)."""
    if S0.shape[0] == 0:
        return False
    for a in range(B.shape[0]):
        for e in range(B.shape[1]):
            B[a, e] = S0[h, a, e]
    for a in range(B.shape[0]):
        accz[a] = Z0[h, a]
        Bz[a] = Z0[h, a]
    return True


@njit(helper=True)
def _fill_acc(acc, B, acc_in_b):
    """acc = B (widened, exact) where ``acc_in_b``, before the first read of acc; returns False (acc
    then holds its own value)."""
    if acc_in_b:
        for a in range(acc.shape[0]):
            for e in range(acc.shape[1]):
                acc[a, e] = B[a, e]
    return False


@njit(helper=True)
def fold_sums(acc, accz, P, Pz, has_acc, lam, decayed):
    """acc = exp(lam) acc + P (acc = P where not ``has_acc``; exp(lam) only when ``decayed``), accz =
    exp(lam) accz + Pz: the arithmetic of every fold (_fold's; split_state repeats a runner's folds
    with it)."""
    for a in range(P.shape[0]):
        f = exp_le0(lam[a]) if decayed else 1.0
        if has_acc and decayed:
            for e in range(P.shape[1]):
                acc[a, e] = f * acc[a, e] + P[a, e]
        elif has_acc:
            for e in range(P.shape[1]):
                acc[a, e] += P[a, e]
        else:
            for e in range(P.shape[1]):
                acc[a, e] = P[a, e]
        accz[a] = f * accz[a] + Pz[a]


@njit(helper=True)
def _fold(acc, accz, B, Bz, P, Pz, has_acc, lam, decayed):
    """Move the pending sums P, Pz into the float64 accumulators (P holds values; acc does when
    ``has_acc``), the accumulators decayed by exp(lam) first when ``decayed``; B, Bz = their
    rounded values. P is then free (the caller's has_p is False) and lam zero."""
    fold_sums(acc, accz, P, Pz, has_acc, lam, decayed)
    for a in range(P.shape[0]):
        for e in range(P.shape[1]):
            B[a, e] = acc[a, e]
        Bz[a] = accz[a]
        lam[a] = 0.0
    Pz[:] = 0


@njit(helper=True)
def pending_added(ci, acc, accz, B, Bz, P, Pz, has_acc, acc_in_b, lam, decayed):
    """After chunk ci's terms went into the pending sums P: fold them into the float64 accumulators
    every FOLD_EVERY chunks (acc filled from B first where ``acc_in_b``). Returns the new flags
    (has_acc, has_p, acc_in_b)."""
    if (ci + 1) % FOLD_EVERY == 0:
        acc_in_b = _fill_acc(acc, B, acc_in_b)
        _fold(acc, accz, B, Bz, P, Pz, has_acc, lam, decayed)
        return True, False, acc_in_b
    return has_acc, True, acc_in_b


@njit(helper=True)
def _current(B, Bz, P, Pz, S, Z, has_acc, has_p, fb, decayed):
    """S[:D] = B + P and Z = Bz + Pz (B and P taken as zero where the flags say they hold nothing;
    with gates, B's and Bz's rows times their factors fb since the last fold): the state the next
    chunk reads.

    (Loops touch at most three arrays: LLVM leaves loops over more arrays unvectorised.)
    """
    for a in range(P.shape[0]):
        if has_acc and has_p and decayed:
            f = fb[a]
            for e in range(P.shape[1]):
                S[a, e] = f * B[a, e] + P[a, e]
        elif has_acc and decayed:
            f = fb[a]
            for e in range(P.shape[1]):
                S[a, e] = f * B[a, e]
        elif has_acc and has_p:
            for e in range(P.shape[1]):
                S[a, e] = B[a, e] + P[a, e]
        elif has_acc:
            for e in range(P.shape[1]):
                S[a, e] = B[a, e]
        elif has_p:
            for e in range(P.shape[1]):
                S[a, e] = P[a, e]
        else:
            for e in range(P.shape[1]):
                S[a, e] = 0
        Z[a] = (fb[a] * Bz[a] if decayed else Bz[a]) + Pz[a]


@njit(helper=True)
def _write_state(acc, accz, B, P, Pz, h, S_out, Z_out, has_acc, acc_in_b, has_p, lam, decayed):
    """S_out[h] = exp(lam) acc + P, Z_out[h] = exp(lam) accz + Pz (in float64, then rounded once; acc
    and P taken as zero where the flags say they hold nothing, acc read as B where ``acc_in_b``)."""
    for a in range(P.shape[0]):
        f = exp_le0(lam[a]) if decayed else 1.0
        if acc_in_b:
            for e in range(P.shape[1]):
                x = f * np.float64(B[a, e])
                S_out[h, a, e] = x + P[a, e] if has_p else x
        else:
            for e in range(P.shape[1]):
                x = f * acc[a, e] if has_acc else 0.0
                S_out[h, a, e] = x + P[a, e] if has_p else x
        Z_out[h, a] = f * accz[a] + Pz[a]


@njit(helper=True)
def segment_parts(sbuf, has_acc, acc_in_b, has_p, summing, parts, s, total, decayed):
    """The parts of a kernel run twice (parts: a head's (nseg, D', X + 2), float64). ``summing`` (phase 0):
    parts[s] = [S | Z | log decay], the sums of _state_buffers' tuple ``sbuf`` (a segment's own, from a
    zero start, or the first segment's final state; folded here) and the log of its whole decay per key
    dimension (``total``; 0 without gates). Else (phase 1): sbuf's acc, accz = exp(log decay_j) acc + S_j
    and the same with Z_j for the parts j < s (acc, accz: the initial state when ``has_acc``; acc as B
    where ``acc_in_b``), and B, Bz their rounded values. Returns the new (has_acc, acc_in_b)."""
    P, B, acc, Pz, Bz, Z, accz, lam = sbuf
    x = acc.shape[1]
    if summing:
        acc_in_b = _fill_acc(acc, B, acc_in_b)
        if has_p:
            _fold(acc, accz, B, Bz, P, Pz, has_acc, lam, decayed)
        dst = parts[s]
        for a in range(acc.shape[0]):
            row = dst[a]
            for e in range(x):
                row[e] = acc[a, e] if has_acc or has_p else 0.0
            row[x] = accz[a]  # (zero where nothing was summed)
            row[x + 1] = total[a] if decayed else 0.0
        return has_acc or has_p, acc_in_b
    if s > 0:
        acc_in_b = _fill_acc(acc, B, acc_in_b)
    for j in range(s):
        part = parts[j]
        for a in range(acc.shape[0]):
            row = part[a]
            f = exp_le0(row[x + 1]) if has_acc else 0.0
            for e in range(x):
                acc[a, e] = f * acc[a, e] + row[e] if has_acc else row[e]
            accz[a] = f * accz[a] + row[x] if has_acc else row[x]
        has_acc = True
    if s > 0:
        for a in range(acc.shape[0]):
            for e in range(x):
                B[a, e] = acc[a, e]
            Bz[a] = accz[a]
    return has_acc, acc_in_b


@njit(helper=True)
def split_state(sbuf, parts, h, y, sums, S0, Z0, decayed):
    """The state at a dynamic split's boundary (cpu/dynamic.py) in sbuf's acc, accz (and B, Bz rounded):
    the one published at boundary y of head h (at 0: the initial state S0[h], Z0[h], or none) followed
    by the segments' sums ``sums`` (rows [S | Z | log decay], in order), each folded in with the
    runner's own fold (fold_sums): a segment is one fold's chunks, and its row holds the pending sums
    that a runner folds at its end, exactly (summed with a runner's arithmetic), so the state at a
    boundary is the runner's bit for bit and no output depends on who ran what. Returns (has_acc,
    acc_in_b)."""
    P, B, acc, Pz, Bz, Z, accz, lam = sbuf
    x = acc.shape[1]
    has = y > 0 or S0.shape[0] > 0
    for a in range(acc.shape[0]):
        if y > 0:
            base = parts[h, y, a]
            for e in range(x):
                acc[a, e] = base[e]
            accz[a] = base[x]
        elif has:
            for e in range(x):
                acc[a, e] = S0[h, a, e]
            accz[a] = Z0[h, a]
        else:  # (no state: the first fold copies, as a runner's first does)
            accz[a] = 0.0
    for j in range(sums.shape[0]):
        row = sums[j]
        # the row in P, Pz and lam, as the runner held them (its values are theirs exactly: float32 sums
        # of one fold widened), so that this is the runner's own fold, one compiled fold_sums for both
        for a in range(acc.shape[0]):
            src = row[a]
            for e in range(x):
                P[a, e] = src[e]
            Pz[a] = src[x]
            lam[a] = src[x + 1]
        fold_sums(acc, accz, P, Pz, has, lam, decayed)
        has = True
    for a in range(acc.shape[0]):  # (Pz and lam start at zero: see _state_buffers)
        Pz[a] = 0
        lam[a] = 0.0
    for a in range(acc.shape[0]):
        for e in range(x):
            B[a, e] = acc[a, e]
        Bz[a] = accz[a]
    return has, False


@njit(helper=True)
def segment_role(s, two_runs, summing):
    """(whole, sums_only, idle) for segment s's item of a kernel run once, or twice (``two_runs``;
    ``summing``: the first run): ``whole``, it starts from the initial state (one run, or the first
    segment, which runs whole in the first run); ``sums_only``, it sums its own chunks alone (the first
    run's other segments); ``idle``, it has nothing left to do (the first segment in the second run)."""
    whole = s == 0 or not two_runs
    return whole, summing and not whole, two_runs and s == 0 and not summing


@njit(helper=True)
def keep_state(S, Z, d_, dst, block, scratch):
    """dst (Dv + 1, D') = [S[:D'] | Z]^T: the state a chunk starts from, kept for the backward pass:
    transposed in ``block`` (as dst), then streamed to memory (``scratch``: at least Dv elements)."""
    dv = S.shape[1]
    transpose_rows(S, block, scratch[:dv], d_)
    for a in range(d_):
        block[dv, a] = Z[a]
    stream_copy(block, dst)


@njit(helper=True)
def _row_factors(i0, c, QA, W, n, eps, normalize, scale, keep, F):
    """The factors of a chunk's output rows (small_gemm_stacked scales each row as it stores it): with
    ``normalize``, F[t] = scale / (scale den_t + eps), den_t = QA[t, :n] . W[:n]: phi(q_t).Z with W = Z
    (n = D'), plus the row's scores sum_{s<=t} A[t, s] with W = [Z, 1, ..., 1] (n = D' + c: A is zero
    above the diagonal), one fixed-length dot product per row (phi(q) times ``scale``: scale
    phi(q).S / (scale phi(q).Z + eps)), the denominators scale den_t + eps to keep[i0+t] when ``keep``
    has elements; without, ``scale``. Returns F[:c], or no factors (F[:0]) for a scale of 1 without
    normalisation."""
    if not normalize:
        if scale == 1:
            return F[:0]
        for t in range(c):
            F[t] = scale
        return F[:c]
    for t in range(c):
        qa = QA[t]
        den = W[0] - W[0]  # zero in the compute dtype
        for j in range(n):
            den += qa[j] * W[j]
        F[t] = scale / (scale * den + eps)
        if keep.shape[0] > 0:
            keep[i0 + t] = scale * den + eps
    return F[:c]


def _causal_forward(q, k, v, fm, fp, fa, eps, normalize, scale, lengths, chunk, frac, S0, Z0, out, S_out, Z_out,
                    gates, ld, status, den, states, phase, parts, counter):
    """Causal linear attention of every head; head h stops at lengths[h] (later outputs are 0).

    q, k: (G1, G2, N, D); v, out: (G1, G2, N, Dv), any strides with unit stride along the last
    axis of ``out``; S0, Z0: initial state (G1*G2, D, Dv), (G1*G2, D), or arrays with no rows for a
    zero state; the final state goes to S_out, Z_out (unless they have no rows). ``frac`` (nseg + 1
    increasing fractions from 0 to 1) splits each head's chunks into segments, one work item each.
    Run by threaded.ThreadedKernel: each thread takes work items from ``counter`` until none are left.
    ``gates`` (see cpu/gating.py: empty, (G1, G2, N) or (G1, G2, N, D) log gates) and ``ld`` (a log
    decay per head, float64) decay the state; a bad gate value is reported in ``status``.
    ``scale`` multiplies phi(q). The feature map: code ``fm``, parameters ``fp`` and the address of
    cpu/mapfns.py's map_rows ``fa`` (0 when fm is computed inline); S0, S_out and the gates have D'
    columns where the map changes the dimension. With normalisation, ``den`` (G1, G2, N) receives the
    denominators scale phi(q_i).Z_i + eps (the backward pass needs them) unless its last dim is 0.
    ``states`` (G1, G2, chunks, Dv + 1, D'), unless it has no chunks, receives the state at the start of
    every chunk as [S | Z]^T (in the compute dtype, before the chunk's gates: the backward's dq reads it).

    Segments start in one of two ways. With ``parts`` of no rows (one run, ``phase`` 1), a segment's
    item first sums the chunks before it (the prefix). With parts (heads, nseg, D', Dv + 2) (float64),
    the kernel runs twice: ``phase`` 0, the first segment runs whole from the initial state and leaves
    its final state in parts[head, 0], while each other segment but the last sums its own chunks from a
    zero state into parts[head, segment] ([S | Z | log decay]); phase 1, each segment but the first
    starts from the parts before it, with no prefix (segment_parts). The first costs the later segments
    more as the segments multiply; the second, one extra pass over every segment but the first and the
    last (runtime.plan makes the first segment as long as that pass over one of the others). Or, with
    ``phase`` 2 and parts (heads, 2 * nseg + 1, D', Dv + 2) (``frac`` unused), the dynamic split
    (cpu/dynamic.py): each head is an item; a thread with none left helps one that runs (a sum of one
    fold's chunks backward toward its runner: a walk with no outputs; then a run from its claim).

    A segment's code is written here, not in a function of its own: Numba would compile such a
    function on its own and then again inside this one (+1.7 s at the first call, measured).
    """
    g2, n, d_ = q.shape[1], q.shape[2], mapped_dim(fm, fp, q.shape[3])
    dv, dt = v.shape[3], out.dtype
    mapper = map_state(fm, fp, fa, q.shape[3], d_, dt)
    mp = unowned(mapper)  # (its parameters are shared by the threads: each view's atomic add contended)
    nseg = frac.shape[0] - 1
    dynamic = bool(phase == 2)  # bool()/int(): run-time values, not literals (see _jit)
    two_runs = bool(parts.shape[0] > 0 and not dynamic)
    items = q.shape[0] * g2 * (1 if dynamic else nseg)
    nb = (parts.shape[1] + 1) // 2  # (dynamic: the boundaries' rows, then the segments' sums)
    per = int(FOLD_EVERY)  # (a dynamic split's segment: one fold's chunks)
    decayed = bool(gates.ndim > 1)
    # the arrays' views (rows of a chunk) without reference counting: the caller owns the arguments,
    # the buffers' owners are kept to the end
    q, k, v, out, den, states, gates, parts = unowned((q, k, v, out, den, states, gates, parts))
    summing = bool(two_runs and phase == 0)  # (phase 0: the segments' own sums)
    total = zeros(d_ if (summing or dynamic) and decayed else 0, np.float64)  # a segment's log decay
    S0, Z0, S_out, Z_out = unowned((S0, Z0, S_out, Z_out))
    owners = (empty((chunk, d_ + chunk), dt), empty((d_ + chunk, dv), dt), empty((chunk, d_), dt),
              empty((d_, chunk), dt), empty(max(d_, dv), dt), empty((dv + 1, d_), dt),
              empty(d_ + chunk, dt), empty(chunk, dt))
    # [phi(Q) | A], [S ; V], phi(K), its transpose, sums, a chunk's state transposed on its way to
    # ``states``, [Z, 1, ..., 1] (the denominators' weights), the output rows' factors
    QA, SV, Kf, KT, sums, ST, W, RF = unowned(owners)
    for j in range(W.shape[0]):
        W[j] = 1
    gbuf = gate_buffers(gates, chunk, dt)
    G, R, F, X = unowned(gbuf)
    # output rows far apart (head views of a fused projection) are fetched for writing a chunk ahead:
    # 0.93x the time in a model; adjacent rows gain nothing (the hardware prefetches them). The
    # inputs' rows are loaded TOUCH_CHUNKS at a time (touch_rows), which serves both kinds.
    v_apart = not _adjacent_rows(v)
    spread = v_apart or not _adjacent_rows(q)
    # a job's state buffers, made once for all of this thread's jobs (reset_state_buffers at each)
    sbuf = (_state_buffers(d_, dv, dt), empty(d_ if decayed else 0, dt))
    (P, B, acc, Pz, Bz, Z, accz, lam), fb = unowned(sbuf)  # fb: B's factors (gate_state_factors)
    ch, ct, cy = int(0), int(0), int(0)  # a helper's split under way: head, claimed boundary, next boundary
    while True:
        kind, item, y, tb = next_job(take(counter) if ct == 0 else items, items, dynamic, parts, lengths, chunk, per,
                                     SUM_COST, ch, ct, cy)
        ch = ct = cy = 0  # (a new job next, unless a helper's sum sets them)
        if kind == DONE:
            break
        # a head from its start, a sum toward a runner, a run from a claimed boundary, or a fixed segment
        h, s, length, c0, c1, last, whole, sums_only, idle = job_of(kind, item, y, tb, dynamic, lengths, chunk, nseg,
                                                                    frac, two_runs, summing)
        if (summing and last) or idle or not (summing or c0 < c1 or (last and (S_out.shape[0] > 0 or length < n))):
            continue
        # the segment: outputs of chunks [c0, c1) of head h from the state before chunk c0
        # (recomputed from the head's start); the last segment also zeroes the padding past its
        # length and writes the final state. With gates, a chunk's factors come from its log gates.
        qh, kh, vh, oh = q[h // g2, h % g2], k[h // g2, h % g2], v[h // g2, h % g2], out[h // g2, h % g2]
        keep = den[h // g2, h % g2] if den.shape[2] > 0 else den[0, 0]
        kept = states[h // g2, h % g2] if states.shape[2] > 0 else states[0, 0]
        reset_state_buffers(sbuf[0])
        has_acc = _init_state(S0, Z0, h, B, accz, Bz) if whole else bool(False)
        acc_in_b = has_acc  # (acc is filled from B when first read: see _init_state)
        has_p = bool(False)
        if two_runs and not summing:  # (parts[h, 0]: the first segment's final state)
            has_acc, acc_in_b = segment_parts(sbuf[0], has_acc, acc_in_b, has_p, summing, parts[h], s, total,
                                              decayed)
        elif dynamic and kind == RUN_SPLIT:
            has_acc, acc_in_b = split_state(sbuf[0], parts, h, y, parts[h, nb + y:nb + tb], S0, Z0, decayed)
            if mark_swap(parts, h, tb, SPLIT, STARTING) != SPLIT:  # (the runner took tb back: other work)
                continue
            publish(parts, h, tb, acc, accz, bool(True))  # (the state at the run's start, for later helpers)
        for a in range(total.shape[0]):  # the segment's log decay (phase 0, or a dynamic split's sum)
            total[a] = 0
        # the walk: a segment's sums alone (phase 0's, a dynamic split's: no outputs), or the chunks before
        # the segment without outputs (its prefix, where it runs once from the head's start) and then its
        # own with them; one arithmetic, so a prefix gives the unsplit run's state bit for bit
        outputs = not sums_only
        start = c0 if sums_only or parts.shape[0] > 0 else 0
        if outputs and start == c0:
            gate_state_factors(gates, lam, fb)
            _current(B, Bz, P, Pz, SV, Z, has_acc, has_p, fb, decayed)
        for ci in range(start, c1):
            i0 = ci * chunk
            c = min(chunk, length - i0)
            emit = outputs and ci >= c0
            t = _rows_to_touch(ci, start, c1, chunk, length)
            if t > 0:
                if emit:
                    touch_rows(qh, i0, t)
                touch_rows(kh, i0, t)
                touch_rows(vh, i0, t)
                touch_gates(gates, h, i0, t)
            if spread and emit and ci + 1 < c1:
                cn = min(chunk, length - i0 - chunk)
                prefetch_rows_for_writing(oh, i0 + chunk, cn)
            if kept.shape[0] > 0 and emit:
                keep_state(SV, Z, d_, kept[ci], ST, sums)
            chunk_gates(gates, h, ld, i0, c, G, R, F, status)
            if sums_only:  # (its log decay)
                gate_log_sum(gates, total, c, G, R)
            _load_kt(kh, i0, c, mp, Kf, KT, sums if decayed else Pz)  # gated keys add their sums later
            if v_apart:  # (rows apart are read many times by the products: copied side by side first)
                _copy_rows(vh, i0, c, SV, d_)
            V = SV[d_:d_ + c] if v_apart else vh[i0:i0 + c]
            if emit:
                load_features(qh, i0, c, mp, QA)
                gate_scores(gates, QA, KT, Kf, d_, c, G, R, F, X)  # A, lower triangle, decayed
                gate_queries(gates, QA, d_, c, F)
                if normalize:
                    _copy_row(Z, W)  # W[:d_] = Z
                factors = _row_factors(i0, c, QA, W, d_ + c, eps, normalize, scale, keep, RF)
                if has_acc or has_p:  # [phi(Q) | A] @ [S ; V], each row tile up to its last nonzero score
                    small_gemm_stacked(QA[:c, :d_ + c], SV[:d_], V, oh[i0:i0 + c], factors, d_, -1)
                else:  # a zero state: the chunk's own part only
                    small_gemm_stacked(QA[:c, d_:d_ + c], V, V[:0], oh[i0:i0 + c], factors, 0, -1)
                if ci == c1 - 1 and not ((last and S_out.shape[0] > 0) or summing):
                    break  # no one reads the state after the segment's last chunk (a tiny call: half its products)
            beta = gate_pending(gates, P, Pz, lam, c, G, R, F, has_p)
            gate_key_columns(gates, KT, Kf, c, F, Pz)
            small_gemm(KT[:, :c], V, P, beta if has_p else 0, -1, -1)  # pending state update
            has_p = True
            if ci < c1 - 1:
                has_acc, has_p, acc_in_b = pending_added(ci, acc, accz, B, Bz, P, Pz, has_acc, acc_in_b, lam,
                                                         decayed)
                # a dynamic split's boundary (every fold): the state, just folded, published for helpers
                if dynamic and outputs and (ci + 1) % FOLD_EVERY == 0 and not publish(
                        parts, h, (ci + 1) // FOLD_EVERY, acc, accz, bool(False)):
                    last = False  # a helper runs on from here
                    break
                if outputs and ci + 1 >= c0:  # (the state the next chunk's outputs read)
                    gate_state_factors(gates, lam, fb)
                    _current(B, Bz, P, Pz, SV, Z, has_acc, has_p, fb, decayed)
        if sums_only:  # a segment's sums: its row (then, a dynamic split's, the helper's next step)
            segment_parts(sbuf[0], has_acc, acc_in_b, has_p, sums_only, parts[h, nb:] if dynamic else parts[h], s,
                          total, decayed)
            if dynamic:
                ch, ct, cy = h, tb, s  # (the helper's next step: next_job)
            continue
        if last:
            oh[length:] = 0
            if S_out.shape[0] > 0:
                _write_state(acc, accz, B, P, Pz, h, S_out, Z_out, has_acc, acc_in_b, has_p, lam, decayed)
        elif summing:  # the first segment's final state for the others (its log decay: 0, never read)
            segment_parts(sbuf[0], has_acc, acc_in_b, has_p, summing, parts[h], s, total, decayed)
    store_fence()  # the kept states' streaming stores, before the backward's threads read them
    keep_alive((owners, gbuf, mapper, sbuf))


@njit(helper=True)
def folded_after(ci, c0, c1, sbuf, has_acc):
    """After chunk ci of [c0, c1) went into the pending sums P, Pz of ``sbuf`` (_state_buffers' tuple;
    P = beta P + ..., beta 0 where (ci - c0) % FOLD_EVERY == 0): fold them into its float64
    accumulators acc, accz every FOLD_EVERY chunks and after the last one. Returns whether acc holds
    a sum (``has_acc`` before this chunk; see zero_unless_summed)."""
    if (ci + 1 - c0) % FOLD_EVERY == 0 or ci == c1 - 1:
        P, B, acc, Pz, Bz, Z, accz, lam = sbuf
        _fold(acc, accz, B, Bz, P, Pz, has_acc, lam, bool(False))
        return True
    return has_acc


@njit(helper=True)
def zero_unless_summed(has_acc, sbuf):
    """acc, accz of ``sbuf`` = 0 when no chunk was summed into them (an empty range of chunks)."""
    if not has_acc:
        acc, accz = sbuf[2], sbuf[6]
        for a in range(acc.shape[0]):
            for e in range(acc.shape[1]):
                acc[a, e] = 0
            accz[a] = 0


@njit(helper=True)
def _pending_sums(k, v, mp, chunk, g0, g1, c0, c1, Kf, V, P, Pz):
    """P = phi(K)^T V and Pz += phi(K)^T 1 over chunks [g0, g1) (at most FOLD_EVERY: one fold's) of a walk
    over chunks [c0, c1) of one head's keys (views (N, X)), in the compute dtype."""
    n = k.shape[0]
    for ci in range(g0, g1):
        i0 = ci * chunk
        t = _rows_to_touch(ci, c0, c1, chunk, n)
        if t > 0:
            touch_rows(k, i0, t)
            touch_rows(v, i0, t)
        _add_keys(k, v, i0, min(chunk, n - i0), mp, Kf, V, P, Pz, 1.0 if ci > g0 else 0.0)


@njit(helper=True)
def _noncausal_sum(k, v, mp, chunk, c0, c1, Kf, V, sbuf):
    """The sums phi(K)^T V and phi(K)^T 1 over chunks [c0, c1) of one head (views (N, X)) into the float64
    accumulators of ``sbuf`` (_state_buffers' tuple: acc and accz; zero when there are no chunks)."""
    has_acc = bool(False)  # bool()/int(): run-time values, not literals (see _jit)
    for g0 in range(c0, c1, FOLD_EVERY):
        g1 = min(g0 + FOLD_EVERY, c1)
        _pending_sums(k, v, mp, chunk, g0, g1, c0, c1, Kf, V, sbuf[0], sbuf[3])
        has_acc = folded_after(g1 - 1, c0, c1, sbuf, has_acc)
    zero_unless_summed(has_acc, sbuf)


@njit(helper=True)
def _summed_parts(parts, acc, accz):
    """acc (D', X), accz (D') = the sums over the first axis of ``parts`` (nseg, D', X + 1): a head's
    partial sums, one per segment, in float64 (the last column: Z's)."""
    x = acc.shape[1]
    for a in range(acc.shape[0]):
        for e in range(x):
            acc[a, e] = 0
        accz[a] = 0
    for s in range(parts.shape[0]):
        for a in range(acc.shape[0]):
            row = parts[s, a]
            for e in range(x):
                acc[a, e] += row[e]
            accz[a] += row[x]


@njit(helper=True)
def _write_parts(acc, accz, dst):
    """dst (D', X + 1) = [acc | accz] (a segment's partial sums)."""
    x = acc.shape[1]
    for a in range(acc.shape[0]):
        row = dst[a]
        for e in range(x):
            row[e] = acc[a, e]
        row[x] = accz[a]


@njit(helper=True)
def _noncausal_state(k, v, mp, chunk, Kf, V, S, Z, parts, S0, Z0, h):
    """S, Z (the compute dtype) = the state of every key of head h: the initial state S0[h], Z0[h] (when
    S0 has rows) plus the sum of the head's segments' parts (nseg, D', Dv + 1) when ``parts`` has rows,
    else of its keys k, v (views (Nk, X)), summed here: into S and Z themselves where they are all (the
    keys of one fold: their float64 sum would be theirs exactly; a tiny call's heads 2-3 us each less)."""
    d_, dv = S.shape[0], S.shape[1]
    kc = (k.shape[0] + chunk - 1) // chunk
    if parts.shape[0] == 0 and S0.shape[0] == 0 and 0 < kc <= FOLD_EVERY:
        for a in range(d_):
            Z[a] = 0
        _pending_sums(k, v, mp, chunk, int(0), kc, int(0), kc, Kf, V, S, Z)
        return
    owners = _state_buffers(d_, dv, S.dtype)
    sbuf = unowned(owners)
    acc, accz = sbuf[2], sbuf[6]
    if parts.shape[0] > 0:
        _summed_parts(parts, acc, accz)
    else:
        _noncausal_sum(k, v, mp, chunk, int(0), kc, Kf, V, sbuf)
    if S0.shape[0] > 0:
        for a in range(d_):
            for e in range(dv):
                acc[a, e] += S0[h, a, e]
            accz[a] += Z0[h, a]
    for a in range(d_):  # the state rounded to the compute dtype
        for e in range(dv):
            S[a, e] = acc[a, e]
        Z[a] = accz[a]
    keep_alive(owners)


@njit(helper=True)
def few_positions(n, nk, d_, dv, chunk):
    """Whether a non-causal head of n queries and nk keys (one or more) is better served by its scores
    phi(Q) phi(K)^T (n x nk) than by its state phi(K)^T V (D' x Dv): both fit a chunk, and the products
    with the scores take fewer multiply-adds (n nk (D' + Dv): the forward's two) than those with the state
    ((n + nk) D' Dv): a few queries and keys of many features (B1 H8 N16 D64: a quarter of them). The
    forward (_scores_product) and the backward (noncausal_grad) decide by it."""
    return 0 < nk <= chunk and n <= chunk and n * nk * (d_ + dv) < (n + nk) * d_ * dv


@njit(helper=True)
def _scores_product(q, k, v, out, mp, eps, normalize, scale, QA, Kf, Zb, RF):
    """out[:n] = each query's outputs from the scores A = phi(Q) phi(K)^T (n queries and nk keys, views
    (n, X), (nk, X), each at most a chunk; phi(Q) into QA, phi(K) into Kf) as A V, normalised by
    phi(q_t).Z, Z = the keys' sum (into Zb): _noncausal_segment's form for a head of few positions
    (few_positions). Its own buffers for phi(K)^T and A: made in the kernel's buffers, they cost every
    call 0.1 us (B1 H1 N16 D16: 2%)."""
    noinline()  # (compiled once, not again where it is called: the non-causal kernel's first call +1-2 s)
    n, nk, d_ = q.shape[0], k.shape[0], Kf.shape[1]
    i0 = int(0)  # bool()/int(): run-time values, not literals (see _jit)
    load_features(q, i0, n, mp, QA)
    for a in range(d_):
        Zb[a] = 0
    KT, A = empty((d_, Kf.shape[0]), Kf.dtype), empty((n, nk), Kf.dtype)
    _load_kt(k, i0, nk, mp, Kf, KT, Zb)
    small_gemm(QA[:n], KT[:, :nk], A[:n, :nk], False, -1, -1)
    factors = _row_factors(i0, n, QA, Zb, d_, eps, normalize, scale, QA[0, :0], RF)
    small_gemm_stacked(A[:n, :nk], v[:nk], v[:0], out[:n], factors, -1, -1)


@njit(helper=True)
def _noncausal_segment(q, k, v, out, mp, eps, normalize, scale, chunk, c0, c1, QA, Kf, V, S, Zb, RF, parts, S0, Z0,
                       h, S_out, Z_out, first):
    """Outputs of chunks [c0, c1) of one head's queries (views (N, X); k and v (Nk, X)), from the state of
    the whole head (_noncausal_state; with no keys and no parts, S0[h] and Z0[h] themselves: a decoder
    reading its encoder's state), which the head's ``first`` segment writes to S_out[h], Z_out[h] when
    they have rows; or, for few queries and keys (few_positions; no initial state, no parts), from their
    scores, whether the state is written or not."""
    n, d_ = q.shape[0], Kf.shape[1]
    dv = v.shape[1]
    direct = parts.shape[0] == 0 and k.shape[0] == 0 and S0.shape[0] > 0  # (no buffers: ~25 ns an allocation)
    scores = parts.shape[0] == 0 and S0.shape[0] == 0 and few_positions(n, k.shape[0], d_, dv, chunk)
    if not direct and (first and S_out.shape[0] > 0 or not scores):
        _noncausal_state(k, v, mp, chunk, Kf, V, S, Zb, parts, S0, Z0, h)
    Sh = S0[h] if direct else S
    Z = Z0[h] if direct else Zb
    if first and S_out.shape[0] > 0:
        for a in range(d_):
            for e in range(dv):
                S_out[h, a, e] = Sh[a, e]
            Z_out[h, a] = Z[a]
    if scores:
        if c0 < c1:
            _scores_product(q, k, v, out, mp, eps, normalize, scale, QA, Kf, Zb, RF)
        return
    for ci in range(c0, c1):
        i0 = ci * chunk
        c = min(chunk, n - i0)
        touch_rows(q, i0, _rows_to_touch(ci, c0, c1, chunk, n))
        load_features(q, i0, c, mp, QA)
        factors = _row_factors(i0, c, QA, Z, d_, eps, normalize, scale, QA[0, :0], RF)
        small_gemm_stacked(QA[:c], Sh, Sh[:0], out[i0:i0 + c], factors, -1, -1)


def _noncausal_forward(q, k, v, fm, fp, fa, eps, normalize, scale, lengths, qlengths, chunk, frac, S0, Z0, out,
                       S_out, Z_out, phase, parts, counter):
    """Non-causal linear attention: every query attends to all the keys of its head.

    Arrays and threads as for the causal kernel; k and v (G1, G2, Nk, X) may have another length than q
    and out; only the first lengths[head] keys of a head enter its state (right-padded keys), and only
    its first qlengths[head] queries are read (right-padded queries: their outputs are 0). S0, Z0
    (heads, D', Dv), (heads, D'), C-contiguous: an initial state (the sums of earlier keys) when they
    have rows (only read, though typed writable: S0[h] then has the type of the kernel's own state
    buffer, one compiled product for both); S_out, Z_out: where the state of every key goes,
    when they have rows. With one segment per head (``parts`` has no rows), each item sums its head's
    state itself, then writes its outputs. With several, the kernel runs twice: ``phase`` 0, each
    segment's item sums its own chunks of the keys into parts[head, segment] (float64, (heads, nseg, D',
    Dv + 1)); phase 1, each adds its head's parts up and writes its segment's chunks of the outputs.
    """
    g2, d_ = q.shape[1], mapped_dim(fm, fp, q.shape[3])
    dv, dt = v.shape[3], out.dtype
    mapper = map_state(fm, fp, fa, q.shape[3], d_, dt)
    mp = unowned(mapper)  # (its parameters are shared by the threads: each view's atomic add contended)
    nseg = frac.shape[0] - 1
    n = k.shape[2] if phase == 0 else q.shape[2]  # the rows this run's segments divide
    nchunks = (n + chunk - 1) // chunk
    items = q.shape[0] * g2 * nseg
    # (see _causal_forward)
    q, k, v, out, parts, S0, Z0, S_out, Z_out = unowned((q, k, v, out, parts, S0, Z0, S_out, Z_out))
    owners = (empty((chunk, d_), dt), empty((chunk, d_), dt), empty((chunk, dv), dt),
              empty((d_, dv), dt), empty(d_, dt), empty(chunk, dt))
    QA, Kf, V, S, Zb, RF = unowned(owners)
    no_parts = empty((0, 1, 1), np.float64)  # (a head's parts where there are none: parts[0] is out of bounds)
    item = take(counter)
    while item < items:
        h, s, c0, c1 = _segment(item, nseg, frac, nchunks)
        h1, h2 = h // g2, h % g2
        length, qlength = lengths[h], qlengths[h]
        kh, vh = k[h1, h2][:length], v[h1, h2][:length]  # (the keys past the length are never read)
        if phase == 0:
            kc = (length + chunk - 1) // chunk  # (this head's chunks of keys)
            sums = _state_buffers(d_, dv, dt)
            sbuf = unowned(sums)
            _noncausal_sum(kh, vh, mp, chunk, min(c0, kc), min(c1, kc), Kf, V, sbuf)
            _write_parts(sbuf[2], sbuf[6], parts[h, s])
            keep_alive(sums)
            item = take(counter)
            continue
        qc = (qlength + chunk - 1) // chunk  # (this head's chunks of queries: those past the length are 0)
        c0, c1 = min(c0, qc), min(c1, qc)
        if c0 < c1 or (s == 0 and S_out.shape[0] > 0):
            _noncausal_segment(q[h1, h2][:qlength], kh, vh, out[h1, h2], mp, eps, normalize, scale, chunk, c0, c1,
                               QA, Kf, V, S, Zb, RF, parts[h] if parts.shape[0] > 0 else no_parts, S0, Z0, h, S_out,
                               Z_out, s == 0)
        if s == nseg - 1 and qlength < n:
            out[h1, h2][qlength:] = 0
        item = take(counter)
    keep_alive((owners, mapper))


def _gates_type(dt, kind):
    """The gate array's type by kind (cpu/gating.py): empty, per position, per key dimension, empty 2-D
    (a constant decay alone)."""
    return array(dt, {0: 1, 1: 3, 2: 4, 3: 2}[kind], "A", readonly=True)


def _causal_signature(dt, variant):
    layout, kind = variant
    seq, i64, f64 = array(dt, 4, layout, readonly=True), types.int64, types.float64
    return types.void(seq, seq, seq, i64, array(dt, 1, readonly=True), i64, dt, types.boolean, dt,
                      array(i64, 1, readonly=True), i64,
                      array(f64, 1, readonly=True), array(dt, 3, readonly=True),
                      array(dt, 2, readonly=True), array(dt, 4, layout), array(dt, 3), array(dt, 2),
                      _gates_type(dt, kind), array(f64, 1, readonly=True), array(i64, 1), array(dt, 3), array(dt, 5),
                      i64, array(f64, 4))


def _noncausal_signature(dt, layout):
    seq, i64 = array(dt, 4, layout, readonly=True), types.int64
    return types.void(seq, seq, seq, i64, array(dt, 1, readonly=True), i64, dt, types.boolean, dt,
                      array(i64, 1, readonly=True), array(i64, 1, readonly=True), i64,
                      array(types.float64, 1, readonly=True), array(dt, 3),
                      array(dt, 2), array(dt, 4, layout), array(dt, 3), array(dt, 2), i64, array(types.float64, 4))


causal_forward = ThreadedKernel(_causal_forward, _causal_signature,
                                prepare=lambda dtype, variant: gating.prepare_kernel(dtype, variant[1]))
noncausal_forward = ThreadedKernel(_noncausal_forward, _noncausal_signature)
