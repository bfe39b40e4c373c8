"""One decoding step for every sequence of a batch: S = a S + phi(k) v^T, Z = a Z + phi(k), then read
out (a = 1, or the decay and gate of the step: see cpu/gating.py and linattn.gates).

Per head it is one pass over S (vector.state_pass: each element updated once, the output kept in
registers, the decay, Z and the normalisation folded in; plain loops for states without unit-stride
rows), so the work is O(D * Dv) and the memory traffic is reading and writing the state once.

Gates and decay are compile-time variants (``None`` when absent): a gate per sequence, shaped like
the leading dims, or per key dimension, leading dims + (D',) with rows of adjacent elements; a decay
of the leading dims' ndim (broadcast views allowed), float64. Their values are checked here: a bad
one returns 2.
"""
import numpy as np
from numba import prange, types
from numba.extending import overload
from numba.np.numpy_support import as_dtype

from .._jit import OVERLOAD_OPTIONS, Kernel, array, njit
from .buffers import empty
from .elementwise import exp_le0, map_flat, map_row
from .mapfns import load_features, map_state, mapped_dim
from .vector import state_pass
from .views import as_contiguous, head_matrix, head_row, head_scalar, keep_alive, span, unowned

#: Batches with at least this many state elements (B*H*D'*Dv) are stepped (or read) in parallel. Measured:
#: from 8 heads of 64 x 64 threads win when steps come back to back, but in a decode loop the threads
#: sleep between steps and waking them costs more than a few heads' work.
PARALLEL_MIN = 1 << 18


def _head_ok(gates, decay, h, q):
    """Whether head h's gate and decay values are good (gates <= 0, not NaN; a decay in (0, 1]).
    ``q`` (leading dims + (D,)) tells a gate per key dimension (of q's ndim) from one per sequence.
    Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_head_ok, jit_options=OVERLOAD_OPTIONS)
def _ol_head_ok(gates, decay, h, q):
    no_gate = isinstance(gates, types.NoneType)
    no_decay = isinstance(decay, types.NoneType)
    per_dim = not no_gate and gates.ndim == q.ndim

    def impl(gates, decay, h, q):
        ok = True
        if not no_decay:
            d = head_scalar(decay, h)
            ok = d > 0 and d <= 1
        if not no_gate and not per_dim:
            g = head_scalar(gates, h)
            ok = ok and not (g > 0 or g != g)
        elif per_dim:
            row = as_contiguous(head_row(gates, h))
            bad = False
            for a in range(row.shape[0]):  # no early exit
                g = row[a]
                bad |= (g > 0) | (g != g)
            ok = ok and not bad
        return ok

    return impl


def head_factors(gates, decay, q, bh, decs):
    """Check every head's gate and decay values (before any state is touched) and, unless the gate
    is per key dimension, write each head's factor for this step, exp(gate) times the decay, to
    decs[h, 0]. False when a value is bad. Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(head_factors, jit_options=OVERLOAD_OPTIONS)
def _ol_head_factors(gates, decay, q, bh, decs):
    no_gate = isinstance(gates, types.NoneType)
    no_decay = isinstance(decay, types.NoneType)
    if no_gate and no_decay:
        return lambda gates, decay, q, bh, decs: True
    per_dim = not no_gate and gates.ndim == q.ndim
    dt = as_dtype(decs.dtype).type

    def impl(gates, decay, q, bh, decs):
        ok = True
        for h in range(bh):
            ok = _head_ok(gates, decay, h, q) and ok
            if not per_dim:
                d = 1.0 if no_decay else head_scalar(decay, h)
                if no_gate:  # the decay itself: exp(log d) would round it
                    decs[h, 0] = dt(d)
                else:
                    decs[h, 0] = dt(d * exp_le0(np.float64(head_scalar(gates, h))))
        return ok

    return impl


def fill_decay(gates, decay, h, dec, q):
    """For a gate per key dimension, dec[:] = head h's factors for this step, exp(gate) times the
    decay (values checked by head_factors); nothing otherwise. Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(fill_decay, jit_options=OVERLOAD_OPTIONS)
def _fill_decay(gates, decay, h, dec, q):
    if isinstance(gates, types.NoneType) or gates.ndim != q.ndim:
        return lambda gates, decay, h, dec, q: None
    no_decay = isinstance(decay, types.NoneType)
    dt = as_dtype(dec.dtype).type

    def impl(gates, decay, h, dec, q):
        row = as_contiguous(head_row(gates, h))
        f = dt(1.0 if no_decay else head_scalar(decay, h))
        for a in range(dec.shape[0]):
            dec[a] = f * exp_le0(row[a])

    return impl


def head_decay(gates, decay, decs, h, q):
    """What multiplies head h's state this step: None (neither gates nor a decay: the passes skip
    the multiply), the head's factor decs[h, 0], or its row decs[h] for a gate per key dimension.
    Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(head_decay, jit_options=OVERLOAD_OPTIONS)
def _ol_head_decay(gates, decay, decs, h, q):
    if isinstance(gates, types.NoneType) and isinstance(decay, types.NoneType):
        return lambda gates, decay, decs, h, q: None
    if not isinstance(gates, types.NoneType) and gates.ndim == q.ndim:
        return lambda gates, decay, decs, h, q: decs[h]
    return lambda gates, decay, decs, h, q: decs[h, 0]


def _decayed(x, dec, a):
    """x times row a's factor (dec: None for none, one factor, or a factor per row)."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_decayed, jit_options=OVERLOAD_OPTIONS)
def _ol_decayed(x, dec, a):
    if isinstance(dec, types.NoneType):
        return lambda x, dec, a: x
    if isinstance(dec, types.Float):
        return lambda x, dec, a: dec * x
    return lambda x, dec, a: dec[a] * x


@njit(helper=True)
def _head_loops(Sh, Zh, vrow, qf, kf, orow, eps, normalize, qscale, dec, scratch):
    """What ``state_pass`` does, with plain loops for any strides: two rows of S per pass, then
    Zh = dec Zh + phi(k) and the division of orow by phi(q).Zh + eps (dec: see _decayed)."""
    d_, dv = Sh.shape
    for e in range(dv):
        orow[e] = 0
    for a in range(0, d_ - 1, 2):  # two rows per pass: half the stores to the output row
        k0, k1, q0, q1 = kf[a], kf[a + 1], qf[a], qf[a + 1]
        r0, r1 = Sh[a], Sh[a + 1]
        for e in range(dv):
            s0 = _decayed(r0[e], dec, a) + k0 * vrow[e]
            s1 = _decayed(r1[e], dec, a + 1) + k1 * vrow[e]
            r0[e] = s0
            r1[e] = s1
            orow[e] += q0 * s0 + q1 * s1
    if d_ % 2:
        a = d_ - 1
        r0 = Sh[a]
        for e in range(dv):
            s0 = _decayed(r0[e], dec, a) + kf[a] * vrow[e]
            r0[e] = s0
            orow[e] += qf[a] * s0
    for a in range(d_):
        Zh[a] = _decayed(Zh[a], dec, a) + kf[a]
    den = qf[0] - qf[0]  # zero in the compute dtype
    for a in range(d_):  # (a loop that only reads: one order of the sum wherever the arrays lie, see state_pass)
        den += qf[a] * Zh[a]
    scratch[0] = qscale / (qscale * den + eps) if normalize else qscale  # rounded to the compute dtype
    r = scratch[0]
    for e in range(dv):
        orow[e] *= r


def _step(q, k, v, fm, eps, normalize, S, Z, out, gates, decay, qscale):
    """q, k: (BH, D) (already mapped when fm is IDENTITY); v: (BH, Dv); S: (BH, D, Dv) and
    Z: (BH, D) updated in place; out: (BH, Dv); gates: None, (BH,) or (BH, D) with rows of adjacent
    elements; decay: None or (BH,). Any strides; the caller checked the shapes and values (a bad
    value returns 2, touching nothing)."""
    bh, d_ = S.shape[0], S.shape[1]
    q, k, v, S, Z, out = unowned((q, k, v, S, Z, out))  # (see _step_nd)
    owners = (empty((bh, d_), out.dtype), empty((bh, 2, d_), out.dtype), empty(bh, out.dtype))
    decs, maps, scratch = unowned(owners)
    if not head_factors(gates, decay, q, bh, decs):
        return 2
    for h in range(bh):
        for a in range(d_):
            maps[h, 0, a] = q[h, a]
            maps[h, 1, a] = k[h, a]
    map_flat(maps.reshape(bh * 2 * d_), fm, maps.reshape(bh * 2 * d_))
    unit = S.itemsize
    vector = S.strides[2] == unit and Z.strides[1] == unit and v.strides[1] == unit and out.strides[1] == unit
    for h in prange(bh):
        fill_decay(gates, decay, h, decs[h], q)
        if vector:
            state_pass(S[h], Z[h], v[h], maps[h, 0], maps[h, 1], out[h], S.strides[1] // unit, eps, normalize,
                       head_decay(gates, decay, decs, h, q), qscale, None, None, 0)
        else:
            _head_loops(S[h], Z[h], v[h], maps[h, 0], maps[h, 1], out[h], eps, normalize, qscale,
                        head_decay(gates, decay, decs, h, q), scratch[h:h + 1])
    keep_alive(owners)
    return 0


def _step_nd(q, k, v, fm, fp, fa, eps, normalize, S, Z, out, gates, decay, qscale, S0, Z0):
    """The same on arrays with any number of leading dims and any strides along them (the heads of
    a fused QKV projection, say), each row of adjacent elements; heads are indexed in place. The
    feature map is any of the kernels' (cpu/mapfns.py: code ``fm``, parameters ``fp``, map_rows's
    address ``fa``, 0 for the codes applied inline), so S and Z have D' rows.

    S0 and Z0 None: S and Z are updated in place. Else they are the state before the step, shaped like S
    and Z and only read, and the new state is written to S and Z (a sequence call from a State, which
    it leaves as it is: no copy of the state first).

    With q of S's ndim (the positions variant: q, k (..., N, D), v and out (..., N, Dv), a gate (..., N)
    or (..., N, D'), a decay (..., N), S (..., D', Dv)) it takes the N positions of each head one after
    the other while the head's state is in the core's cache (the first reading S0 and Z0 when given):
    the state is read and written once for all N (N calls of one step: N times, from memory once it
    outgrows the caches).

    With k, v (and gates, decay) None it only reads the state: out = phi(q)^T S / (phi(q)^T Z + eps),
    S and Z unchanged (a decoder's query over its encoder's keys' state).

    Checks the shapes, strides and gate or decay values itself and returns 1 (shapes, strides, or
    arrays it writes sharing memory with each other or with v, gates or decay: see
    ``_written_apart``) or 2 (a bad value), touching nothing, when they do not fit (the caller then
    takes the validating path, which raises the error or copies); 0 on success.
    """
    lead = q.shape[:-1]  # (the rows': with positions, the heads' leading dims and N)
    heads_lead, n, per_head = _positions(q, S)
    d_in = q.shape[-1]
    d_ = _features_dim(fm, fp, d_in)  # D'
    isz = S.itemsize
    if (not _pair_fits(k, v, q, out, isz) or S.shape[:-2] != heads_lead or S.shape[-2] != d_
            or S.shape[-1] != out.shape[-1] or Z.shape[:-1] != heads_lead or Z.shape[-1] != d_
            or out.shape[:-1] != lead):
        return 1
    if not _gates_fit(gates, lead, d_) or not _decay_fits(decay, lead):
        return 1
    if d_in == 0 or q.strides[-1] != isz or S.strides[-1] != isz:
        return 1
    if out.strides[-1] != isz or Z.strides[-1] != isz or not _pair_fits(S0, Z0, S, Z, isz):
        return 1
    if n == 0:  # (no position: nothing would write the new state)
        return 1
    bh = q.size // d_in  # rows: heads times positions
    heads = bh // n
    # views without reference counting (see cpu/views.unowned): the caller owns the arguments, the
    # buffers' owners are kept to the end
    q, k, v, S, Z, out = unowned((q, k, v, S, Z, out))
    S0, Z0 = _source(S0, Z0)
    # (the spans after unowned: each owned array passed costs two atomics)
    if not _written_apart(S, Z, out, v, gates, decay, S0, Z0):
        return 1
    # the factors of each row (a column, or D' for a gate per key dimension); phi(q) and phi(k) of every row, or
    # none for the positions variant, which maps each head's rows as it takes the head (a small buffer, hot in
    # the cache: B8 H8 N24 D64's 786 KB for all rows came from mmap at each call, half the call in page faults)
    owners = (empty((bh, _factors_width(gates, q, d_)), out.dtype), empty(0 if per_head else 2 * bh * d_, out.dtype))
    decs, feats = unowned(owners)
    if not head_factors(gates, decay, q, bh, decs):
        return 2
    if not per_head:
        _map_heads(q, k, fm, fp, fa, 0, bh, d_, feats)
    for j in prange(heads):
        h, i = _head_and_row(j, n)  # the head and its first row (see _head_and_row)
        fill_decay(gates, decay, i, decs[i], q)
        Sh, Zh = head_matrix(S, h), head_row(Z, h)
        hf, base, rows = _head_features(q, S, k, fm, fp, fa, i, n, bh, d_, feats)
        qf, kf = hf[:rows * d_], hf[rows * d_:]
        kh = _if_keys(k, kf[base * d_:(base + 1) * d_], None)  # (None: the state only read)
        S0h, Z0h, src_stride = _head_source(S0, Z0, h, isz)
        state_pass(Sh, Zh, head_row(v, i), qf[base * d_:(base + 1) * d_], kh, head_row(out, i),
                   Sh.strides[0] // isz, eps, normalize, head_decay(gates, decay, decs, i, q), qscale,
                   S0h, Z0h, src_stride)
        _later_positions(S, Sh, Zh, v, qf, kf, out, eps, normalize, gates, decay, decs, qscale, q, i, n, d_)
    keep_alive(owners)
    return 0


def _factors_width(gates, q, d_):
    """Columns of the rows' factors table: D' for a gate per key dimension (q's ndim), else 1. Numba code only."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_factors_width, jit_options=OVERLOAD_OPTIONS)
def _ol_factors_width(gates, q, d_):
    if not isinstance(gates, types.NoneType) and gates.ndim == q.ndim:
        return lambda gates, q, d_: d_
    return lambda gates, q, d_: 1


def _head_features(q, S, k, fm, fp, fa, i, n, bh, d_, feats):
    """(features, the place of row i in them, their rows), the first half of the features phi(q) and the second
    phi(k): for the positions variant (q of S's ndim) a new array of head rows i to i + n - 1, mapped here;
    else ``feats``, every row's, mapped before. Chosen at compile time. Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_head_features, jit_options=OVERLOAD_OPTIONS)
def _ol_head_features(q, S, k, fm, fp, fa, i, n, bh, d_, feats):
    if q.ndim != S.ndim:
        return lambda q, S, k, fm, fp, fa, i, n, bh, d_, feats: (feats, i, bh)

    def impl(q, S, k, fm, fp, fa, i, n, bh, d_, feats):
        hf = empty(2 * n * d_, feats.dtype)
        _map_heads(q, k, fm, fp, fa, i, n, d_, hf)
        return hf, 0, n

    return impl


@njit(helper=True)
def _head_and_row(j, n):
    """(j, j n): head j and its first row, of n a head. (From a call, not copies of the prange index: views'
    head_row and head_matrix, inlined in Numba's IR, take heads and rows under one argument name, and the
    parfor pass stops at a copy of the loop index whose name is later given another value.)"""
    return j, j * n


def _positions(q, S):
    """(S's leading dims as q's shape says them, the positions a head takes, whether q has S's ndim): for the
    positions variant (q (..., N, D), S (..., D', Dv)) (q.shape[:-2], N, True), else (q.shape[:-1], 1, False).
    Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_positions, jit_options=OVERLOAD_OPTIONS)
def _ol_positions(q, S):
    if q.ndim == S.ndim:
        return lambda q, S: (q.shape[:-2], q.shape[-2], True)
    return lambda q, S: (q.shape[:-1], 1, False)


def _later_positions(S, Sh, Zh, v, qf, kf, out, eps, normalize, gates, decay, decs, qscale, q, i, n, d_):
    """The positions variant's (q of S's ndim) rows i + 1 to i + n - 1 of one head (after its first, which read the old
    state), in place in Sh and Zh while they are in the cache, their features at qf's and kf's rows 1 to n - 1;
    nothing in the other variants (compiled out). Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_later_positions, jit_options=OVERLOAD_OPTIONS)
def _ol_later_positions(S, Sh, Zh, v, qf, kf, out, eps, normalize, gates, decay, decs, qscale, q, i, n, d_):
    if isinstance(v, types.NoneType) or q.ndim != S.ndim:
        return lambda S, Sh, Zh, v, qf, kf, out, eps, normalize, gates, decay, decs, qscale, q, i, n, d_: None

    def impl(S, Sh, Zh, v, qf, kf, out, eps, normalize, gates, decay, decs, qscale, q, i, n, d_):
        stride = Sh.strides[0] // Sh.itemsize
        for t in range(1, n):
            r = i + t
            fill_decay(gates, decay, r, decs[r], q)
            state_pass(Sh, Zh, head_row(v, r), qf[t * d_:(t + 1) * d_], kf[t * d_:(t + 1) * d_], head_row(out, r),
                       stride, eps, normalize, head_decay(gates, decay, decs, r, q), qscale, None, None, 0)

    return impl


def _source(S0, Z0):
    """(S0, Z0) as views without reference counting (views.unowned), or (None, None). Numba code only."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_source, jit_options=OVERLOAD_OPTIONS)
def _ol_source(S0, Z0):
    if isinstance(S0, types.NoneType):
        return lambda S0, Z0: (None, None)
    return lambda S0, Z0: unowned((S0, Z0))


def _head_source(S0, Z0, h, isz):
    """Head h of the state before the step: (head_matrix(S0, h), head_row(Z0, h), elements between the
    matrix's rows), or (None, None, 0). Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_head_source, jit_options=OVERLOAD_OPTIONS)
def _ol_head_source(S0, Z0, h, isz):
    if isinstance(S0, types.NoneType):
        return lambda S0, Z0, h, isz: (None, None, 0)

    def impl(S0, Z0, h, isz):
        S0h = head_matrix(S0, h)
        return S0h, head_row(Z0, h), S0h.strides[0] // isz

    return impl


def _pair_fits(a, b, like_a, like_b, isz):
    """Whether a is shaped like like_a and b like like_b, each with rows of adjacent elements (True when both
    are None: k and v for a query over the state; S0 and Z0 for a step in place). Only callable from Numba
    code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_pair_fits, jit_options=OVERLOAD_OPTIONS)
def _ol_pair_fits(a, b, like_a, like_b, isz):
    if isinstance(a, types.NoneType) and isinstance(b, types.NoneType):
        return lambda a, b, like_a, like_b, isz: True
    return lambda a, b, like_a, like_b, isz: (a.shape == like_a.shape and b.shape == like_b.shape
                                              and a.strides[-1] == isz and b.strides[-1] == isz)


def _if_keys(k, a, b):
    """a when k is an array, b when k is None (the state only read), chosen at compile time. Only
    callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_if_keys, jit_options=OVERLOAD_OPTIONS)
def _ol_if_keys(k, a, b):
    if isinstance(k, types.NoneType):
        return lambda k, a, b: b
    return lambda k, a, b: a


@njit(helper=True)
def _disjoint(a, b):
    """Whether two spans (views.span) have no byte in common."""
    return a[1] <= b[0] or b[1] <= a[0]


@njit(helper=True)
def _written_apart(S, Z, out, v, gates, decay, S0, Z0):
    """Whether S, Z and out (written) have memory apart from each other and from v, gates, decay and the old
    state S0 and Z0 (read while they are written; q and k are mapped before anything is written; None
    arrays are apart from everything), by the arrays' spans: a few integer operations (np.may_share_memory
    takes ~0.2 us a pair from Python: twelve would double a small step). Arrays that interleave without
    overlapping take the caller's exact test."""
    s, z, o = span(S), span(Z), span(out)
    if not (_disjoint(s, z) and _disjoint(s, o) and _disjoint(z, o)):
        return False
    for r in (span(v), span(gates), span(decay), span(S0), span(Z0)):
        if not (_disjoint(r, s) and _disjoint(r, z) and _disjoint(r, o)):
            return False
    return True


def _features_dim(fm, fp, d):
    """D' for map code ``fm`` (fp None: a map the kernels apply inline, D' = D). Numba code only."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_features_dim, jit_options=OVERLOAD_OPTIONS)
def _ol_features_dim(fm, fp, d):
    if isinstance(fp, types.NoneType):
        return lambda fm, fp, d: d
    return lambda fm, fp, d: mapped_dim(fm, fp, d)


def _map_heads(q, k, fm, fp, fa, first, bh, d_, feats):
    """feats[:bh D'] = phi(q) and feats[bh D':] = phi(k) of the bh rows from row ``first``, row after row: the
    inline maps (fp None) row by row, the others (cpu/mapfns.py) gathered as rows and mapped by one call.
    Numba code only."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_map_heads, jit_options=OVERLOAD_OPTIONS)
def _ol_map_heads(q, k, fm, fp, fa, first, bh, d_, feats):
    sources = 1 if isinstance(k, types.NoneType) else 2  # (k None: q alone, into the first half)
    if isinstance(fp, types.NoneType):
        def inline(q, k, fm, fp, fa, first, bh, d_, feats):
            for h in range(bh):
                map_row(as_contiguous(head_row(q, first + h)), fm, feats[h * d_:(h + 1) * d_])
                if sources == 2:
                    map_row(as_contiguous(head_row(_if_keys(k, k, q), first + h)), fm,
                            feats[(bh + h) * d_:(bh + h + 1) * d_])
        return inline

    def mapped(q, k, fm, fp, fa, first, bh, d_, feats):
        d_in = q.shape[-1]
        owner = empty(sources * bh * d_in, feats.dtype)
        rows = unowned(owner)
        for h in range(bh):
            qh, kh = as_contiguous(head_row(q, first + h)), as_contiguous(head_row(_if_keys(k, k, q), first + h))
            for a in range(d_in):
                rows[h * d_in + a] = qh[a]
                if sources == 2:
                    rows[(bh + h) * d_in + a] = kh[a]
        mp = map_state(fm, fp, fa, d_in, d_, feats.dtype)
        load_features(rows.reshape((sources * bh, d_in)), 0, sources * bh, mp, feats[:sources * bh * d_].reshape(
            (sources * bh, d_)))
        keep_alive(owner)
    return mapped


def _gates_fit(gates, lead, d_):
    raise NotImplementedError


@overload(_gates_fit, jit_options=OVERLOAD_OPTIONS)
def _ol_gates_fit(gates, lead, d_):
    if isinstance(gates, types.NoneType):
        return lambda gates, lead, d_: True
    if gates.ndim == len(lead):
        return lambda gates, lead, d_: gates.shape == lead
    # a gate per key dimension: rows of adjacent elements, read as such (cpu/views.as_contiguous)
    return lambda gates, lead, d_: (gates.shape[:-1] == lead and gates.shape[-1] == d_
                                    and gates.strides[-1] == gates.itemsize)


def _decay_fits(decay, lead):
    raise NotImplementedError


@overload(_decay_fits, jit_options=OVERLOAD_OPTIONS)
def _ol_decay_fits(decay, lead):
    if isinstance(decay, types.NoneType):
        return lambda decay, lead: True
    return lambda decay, lead: decay.shape == lead


def _optional(t):
    return types.none if t is None else t


def _strided_signature(dt, variant):
    gate_kind, has_decay = variant
    vec, i64 = array(dt, 2, "A", readonly=True), types.int64
    gates = {0: None, 1: array(dt, 1, "A", readonly=True), 2: array(dt, 2, "A", readonly=True)}[gate_kind]
    decay = array(types.float64, 1, "A", readonly=True) if has_decay else None
    return types.int64(vec, vec, vec, i64, types.float64, types.boolean, array(dt, 3, "A"),
                       array(dt, 2, "A"), array(dt, 2, "A"), _optional(gates), _optional(decay), types.float64)


def _nd_signature(dt, variant):
    lead_ndim, gate_kind, has_decay, mapped, sourced, positions = variant
    rows = lead_ndim + positions  # (the leading dims of q, k, v, out, a gate and the decay: with N for positions)
    vec, i64 = array(dt, rows + 1, "A", readonly=True), types.int64
    gates = {0: None, 1: array(dt, rows, "A", readonly=True), 2: array(dt, rows + 1, "A", readonly=True)}[gate_kind]
    decay = array(types.float64, rows, "A", readonly=True) if has_decay else None
    fp = array(dt, 1, readonly=True) if mapped else types.none
    S0, Z0 = ((array(dt, lead_ndim + 2, "A", readonly=True), array(dt, lead_ndim + 1, "A", readonly=True)) if sourced
              else (types.none, types.none))
    return types.int64(vec, vec, vec, i64, fp, i64, types.float64, types.boolean,
                       array(dt, lead_ndim + 2, "A"), array(dt, lead_ndim + 1, "A"), array(dt, rows + 1, "A"),
                       _optional(gates), _optional(decay), types.float64, S0, Z0)


def _read_signature(dt, variant):
    lead_ndim, mapped = variant
    vec, none = array(dt, lead_ndim + 1, "A", readonly=True), types.none
    fp = array(dt, 1, readonly=True) if mapped else none
    return types.int64(vec, none, none, types.int64, fp, types.int64, types.float64, types.boolean,
                       array(dt, lead_ndim + 2, "A", readonly=True), array(dt, lead_ndim + 1, "A", readonly=True),
                       array(dt, lead_ndim + 1, "A"), none, none, types.float64, none, none)


#: variant: (number of the state's leading dims, gate kind, has decay, whether the map is one of cpu/mapfns.py's
#: (its parameters an array; None for the maps applied inline), whether the old state comes from S0 and Z0
#: (else None: in place), whether q, k, v, out, a gate and the decay have N positions before their last
#: dim (else one step)); any strides along the leading dims
step_nd_serial = Kernel(_step_nd, _nd_signature, parallel=False)
step_nd_parallel = Kernel(_step_nd, _nd_signature, parallel=True)
#: a query over the state (k, v, gates and decay None: S and Z only read); variant: (number of leading
#: dims, whether the map is one of cpu/mapfns.py's)
read_nd_serial = Kernel(_step_nd, _read_signature, parallel=False)
read_nd_parallel = Kernel(_step_nd, _read_signature, parallel=True)
#: any strides, already flattened to (BH, ...); variant: (gate kind, has decay)
step_strided_serial = Kernel(_step, _strided_signature, parallel=False)
step_strided_parallel = Kernel(_step, _strided_signature, parallel=True)
