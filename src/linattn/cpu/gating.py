"""What decay and gates change in a chunk of cpu/chunked.py: the chunk's decay factors from its log
gates, and their effect on the scores, the query rows, the key columns and the pending state.

The gate array's type says the kind, at compile time (each helper is an overload on it):

- a 1-D array (empty): no decay (every helper does nothing, or what the ungated kernel does);
- (G1, G2, N): a log-decay per position (a constant decay arrives as a view with stride 0);
- (G1, G2, N, D'): a log-decay per position and key dimension (GLA);
- a 2-D array (empty): a constant decay per head only (RetNet): the factors are powers of it, and
  the chunk's score factors gamma^(t - s) are read from its w (gamma^(c - 1 - s)) without an exp.

``ld[h]`` (float64, <= 0) is added to every log gate of head h (the ``decay=`` argument). The factor
of position s's term at position t >= s is the product of the factors a_u = exp(log gate_u) of the
positions in (s, t]; a reset (-inf) makes a_u exactly 0. Each chunk computes its factors F =
(e, w, whole, scratch): e, the factor of the state before the chunk at each position; w, each
position's factor at the chunk's end; whole, the chunk's factor; laid out as the loops that use them
run, so that they vectorise. Only exponentials of non-positive numbers are taken, so gates down to -1e4
and -inf resets neither overflow nor give NaN.

- Per position, G[t] is the sum of the chunk's log gates up to t since the last reset at or before
  t (R[t], -1 when none), in float64, and a factor is exp(G[t] - G[s]) (0 past a reset); the
  scores are one product, then decayed.
- Per key dimension the factor of (s, t] is e_t / e_s (e: the running products from the chunk's
  start), so the scores are one product of q_t e_t and k_s / e_s where no e is near underflow (every
  dimension's product over the chunk at least tiny ** (1/4): 1/e_s then stays far from overflow). Where
  one is (strong gates, a reset), the chunk is cut into blocks of SUB positions,
  as flash-linear-attention's chunk_gla does: a block i's scores with an earlier block j go
  through the blocks' boundaries (s <= b <= p < t, b the last position of block j, p of block i-1):
  (q_t times the factors of (p, t]) times (the factors of (b, p]) times (k_s times the factors of
  (s, b]), a product of scaled rows; within a block each score is its own sum of D' terms. Here the
  factors are running products of the per-position a_u (computed once per chunk: one exp per
  position and dimension), flushed to 0 below the smallest normal number so that no denormal
  slows them down.
"""
import numpy as np
import numba
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic, overload
from numba.np.numpy_support import as_dtype

from .._jit import OVERLOAD_OPTIONS, njit
from .buffers import empty
from .elementwise import exp_le0
from . import symbols
from .smallgemm import small_gemm
from .vector import padded, transpose_rows, wide_vectors
from .views import as_contiguous, touch_rows


#: status[0] after a kernel: 0, or the first bad gate's kind (1: positive, 2: NaN); status[1]: its
#: head, status[2]: its position
POSITIVE, NAN = 1, 2


#: Kinds, from the gate array's number of dimensions
NONE, SCALAR, VECTOR, CONSTANT = 0, 1, 2, 3


def _kind(gates):
    """NONE, SCALAR (per position), VECTOR (per key dimension) or CONSTANT (a decay per head) from the
    gate array's type."""
    if not isinstance(gates, types.Array):
        return None
    return {1: NONE, 2: CONSTANT, 3: SCALAR, 4: VECTOR}.get(gates.ndim)


def _stub(name):
    def fn(*args):
        raise NotImplementedError(f"{name} runs inside Numba kernels only")

    fn.__name__ = name
    return fn


chunk_gates = _stub("chunk_gates")
gate_scores = _stub("gate_scores")
gate_queries = _stub("gate_queries")
gate_key_columns = _stub("gate_key_columns")
gate_key_rows = _stub("gate_key_rows")
gate_pending = _stub("gate_pending")
touch_gates = _stub("touch_gates")


#: Positions per block of the per-dimension scores.
SUB = 8


@overload(touch_gates, jit_options=OVERLOAD_OPTIONS)
def _touch_gates(gates, h, i0, t):
    """Rows [i0, i0 + t) of head h's gates per key dimension into the cache (views.touch_rows: they are
    as large as k and read chunk by chunk, as k is); nothing for the other kinds (a row per head)."""
    if _kind(gates) != VECTOR:
        return lambda gates, h, i0, t: None

    def impl(gates, h, i0, t):
        g2 = gates.shape[1]
        touch_rows(gates[h // g2, h % g2], i0, t)
    return impl


@overload(chunk_gates, jit_options=OVERLOAD_OPTIONS)
def _chunk_gates(gates, h, ld, i0, c, G, R, F, status):
    """The chunk [i0, i0 + c) of head h: per position G, R (see the module docstring), per dimension
    G = a (the per-position factors, compute dtype) and R[0] = the chunk's sum of log gates per
    dimension (float64, -inf after a reset); then the factors F. A positive or NaN gate is reported
    in ``status``."""
    kind = _kind(gates)
    if kind == 0:
        return lambda gates, h, ld, i0, c, G, R, F, status: None
    dt = as_dtype(F[0].dtype).type
    tiny = dt(np.finfo(as_dtype(F[0].dtype)).tiny)

    if kind == CONSTANT:
        def impl(gates, h, ld, i0, c, G, R, F, status):
            e, w, lg = F[0], F[1], ld[h]
            for t in range(c):
                G[t], R[t] = lg * (t + 1), -1
            for t in range(c):
                e[t] = exp_le0(dt(G[t]))
                w[t] = exp_le0(dt(lg * (c - 1 - t)))
            F[2][0] = e[c - 1]
        return impl

    def impl(gates, h, ld, i0, c, G, R, F, status):
        g2 = gates.shape[1]
        row = gates[h // g2, h % g2]
        extra = ld[h]
        e, w, whole = F[0], F[1], F[2]
        if kind == SCALAR:
            total = 0.0
            last = -1
            for t in range(c):
                x = row[i0 + t]
                if x > 0 or x != x:
                    status[0], status[1], status[2] = (POSITIVE if x > 0 else NAN), h, i0 + t
                g = np.float64(x) + extra
                if g == -np.inf:
                    total, last = 0.0, t
                else:
                    total += g
                G[t], R[t] = total, last
            end, reset = G[c - 1], R[c - 1]
            for t in range(c):
                e[t] = exp_le0(dt(G[t]) if R[t] < 0 else dt(-np.inf))
                w[t] = exp_le0(dt(end - G[t]) if reset <= t else dt(-np.inf))
            whole[0] = e[c - 1]
            return
        # per dimension: a C function (cpu/symbols.py)
        _call_vector_factors(gates, h // g2, h % g2, i0, c, extra, G, R[0], e, w, whole, F[3], tiny, status, h)
    return impl


@njit(helper=True)
def _vector_factors(gp, sp, sd, i0, c, d, extra, a, sums, e, w, whole, run, tiny, status, h):
    """chunk_gates per key dimension, from the gates at gp (a CPointer: position t, dimension j at
    gp[t * sp + j * sd]): a = the per-position factors, sums = the chunk's sums of log gates (float64),
    e, w, whole: the factors F (run: scratch); the first bad gate is reported in status."""
    wide_vectors()
    one, zero = tiny / tiny, tiny - tiny  # in the compute dtype
    # the sum of each dimension's positive gates, for now: > 0 where there is one. (A running
    # maximum, read and written in place, became a store under a mask: slow on AMD.)
    positive = whole
    for j in range(d):
        sums[j] = 0.0
        positive[j] = zero
    for t in range(c):  # the logs, then their exps: loops over the dimensions that vectorise
        at, base = a[t], (i0 + t) * sp
        for j in range(d):  # (in the compute dtype: all lanes; the float64 sums in a loop of their own)
            x = gp[base + j * sd]
            positive[j] += x if x > 0 else zero
            at[j] = x
        if extra != 0:
            for j in range(d):
                at[j] = np.float64(gp[base + j * sd]) + extra
        for j in range(d):
            sums[j] += np.float64(gp[base + j * sd]) + extra  # NaN stays NaN
        for j in range(d):
            at[j] = exp_le0(at[j])
    bad = False
    for j in range(d):
        bad = bad or positive[j] > 0 or sums[j] != sums[j]
    if bad:  # find the first bad gate
        for t in range(c):
            for j in range(d):
                x = gp[(i0 + t) * sp + j * sd]
                if (x > 0 or x != x) and status[0] == 0:
                    status[0], status[1], status[2] = (POSITIVE if x > 0 else NAN), h, i0 + t
    # e: running products from the chunk's start, w: from its end, each in a vector of its own
    # (rows of one array read and written in one loop would keep LLVM from vectorising it)
    for j in range(d):
        run[j] = one
    for t in range(c):
        et, at = e[t], a[t]
        for j in range(d):
            x = run[j] * at[j]
            x = x if x >= tiny else zero
            run[j] = x
            et[j] = x
    for j in range(d):
        whole[j] = run[j]
        run[j] = one
    for t in range(c - 1, -1, -1):
        wt = w[t]
        for j in range(d):
            wt[j] = run[j]
        if t > 0:
            at = a[t]
            for j in range(d):
                x = run[j] * at[j]
                run[j] = x if x >= tiny else zero


def _vector_factors_c(gp, sp, sd, i0, c, d, extra, af, sums, ef, wf, whole, run, tiny, status, h):
    """_vector_factors on raw pointers (a, e, w: C-contiguous (c, d); sums, whole, run: (d,))."""
    _vector_factors(gp, sp, sd, i0, c, d, extra, carray(af, (c, d)), carray(sums, (d,)), carray(ef, (c, d)),
                    carray(wf, (c, d)), carray(whole, (d,)), carray(run, (d,)), tiny, carray(status, (3,)), h)


def _vector_factors_signature(dt):
    ptr, i = types.CPointer(dt), types.intp
    return types.void(ptr, i, i, i, i, i, types.float64, ptr, types.CPointer(types.float64), ptr, ptr, ptr, ptr, dt,
                      types.CPointer(types.int64), i)


_VECTOR_FACTORS = {dt: symbols.define(f"vector_gate_factors_{dt}", _vector_factors_c, _vector_factors_signature(dt))
                   for dt in (types.float32, types.float64)}


@intrinsic
def _call_vector_factors(typingctx, gates, h1, h2, i0, c, extra, a, sums, e, w, whole, run, tiny, status, h):
    """Call the registered _vector_factors_c for gates[h1, h2] (strides multiples of the itemsize)."""
    sig = types.void(gates, h1, h2, i0, c, extra, a, sums, e, w, whole, run, tiny, status, h)

    def codegen(context, builder, sig, args):
        dtype = sig.args[0].dtype
        size = context.get_abi_sizeof(context.get_data_type(dtype))
        i64 = context.get_value_type(types.intp)
        g = context.make_array(sig.args[0])(context, builder, args[0])
        h1v, h2v = (context.cast(builder, args[k], sig.args[k], types.intp) for k in (1, 2))
        offset = builder.add(builder.mul(h1v, builder.extract_value(g.strides, 0)),
                             builder.mul(h2v, builder.extract_value(g.strides, 1)))
        raw = builder.gep(builder.bitcast(g.data, ir.IntType(8).as_pointer()), [offset])
        row = builder.bitcast(raw, g.data.type)
        sp, sd = (builder.sdiv(builder.extract_value(g.strides, k), ir.Constant(i64, size)) for k in (2, 3))
        d = builder.extract_value(g.shape, 3)
        values = [row, sp, sd, context.cast(builder, args[3], sig.args[3], types.intp),
                  context.cast(builder, args[4], sig.args[4], types.intp), d,
                  context.cast(builder, args[5], sig.args[5], types.float64)]
        values += [context.make_array(t)(context, builder, v).data for t, v in zip(sig.args[6:12], args[6:12])]
        values += [args[12], context.make_array(sig.args[13])(context, builder, args[13]).data,
                   context.cast(builder, args[14], sig.args[14], types.intp)]
        symbols.emit_call(builder, _VECTOR_FACTORS[dtype], values)
        return context.get_dummy_value()

    return sig, codegen


@njit(helper=True)
def masked_product(QA, KT, d_, c):
    """QA[:c, d_:d_+c] = phi(Q) phi(K)^T (QA[:c, :d_] and KT), zero above the diagonal. The product runs
    over KT's columns up to vector.padded(c) where KT and QA have room (whole vectors: a few percent
    faster than small_gemm's masked last vector, B8 H8 N31): the columns past c it writes are read by
    no one (the callers' KT, from transpose_padded, has zeros there)."""
    cw = padded(c, min(KT.shape[1], QA.shape[1] - d_))
    small_gemm(QA[:c, :d_], KT[:, :cw], QA[:c, d_:d_ + cw], False, -1, 0)  # to the diagonal's tile
    zero_above_diagonal(QA, d_, c)


@njit(helper=True)
def zero_above_diagonal(QA, d_, c):
    """QA[t, d_ + u] = 0 for t < u < c, as a unit-stride view of each row's part indexed from 0: indexed
    as QA[t, d_ + u] (or from t + 1), LLVM cannot rule out a negative index (Numba's wraparound) and
    stores element by element or by scatter (a quarter of the plain causal worker's own samples)."""
    for t in range(c):
        row = as_contiguous(QA[t, d_ + t + 1:d_ + c])
        for u in range(row.shape[0]):
            row[u] = 0


@overload(gate_scores, jit_options=OVERLOAD_OPTIONS)
def _gate_scores(gates, QA, KT, Kf, d_, c, G, R, F, X):
    """QA[:c, d_:d_+c] = the chunk's decayed scores, lower triangle (zero above); X: scratch (a row
    of exponents; per dimension, a factor row and a block's scaled queries and keys)."""
    kind = _kind(gates)
    dt = as_dtype(QA.dtype).type
    if kind == NONE:
        def impl(gates, QA, KT, Kf, d_, c, G, R, F, X):
            masked_product(QA, KT, d_, c)
        return impl
    if kind == CONSTANT:
        def impl(gates, QA, KT, Kf, d_, c, G, R, F, X):
            masked_product(QA, KT, d_, c)
            w = F[1]
            for t in range(c):  # gamma^(t - s) = w[c - 1 - t + s]
                row, f = QA[t, d_:d_ + t + 1], w[c - 1 - t:]
                for s in range(t + 1):
                    row[s] *= f[s]
        return impl
    if kind == SCALAR:
        def impl(gates, QA, KT, Kf, d_, c, G, R, F, X):
            masked_product(QA, KT, d_, c)
            x = X[0]
            for t in range(c):
                gt, rt = G[t], R[t]
                for s in range(c):  # exponents first, the mask as a select, then exp: both loops vectorise
                    x[s] = dt(gt - G[s]) if (rt <= s) & (s <= t) else dt(-np.inf)
                row = QA[t, d_:d_ + c]
                for s in range(c):
                    row[s] *= exp_le0(x[s])
        return impl

    tiny = dt(np.finfo(as_dtype(QA.dtype)).tiny)

    def impl(gates, QA, KT, Kf, d_, c, G, R, F, X):  # per dimension: a C function (cpu/symbols.py)
        fac, qb, kh, kt, qs, ks, kst = X
        _call_vector_scores(QA, Kf, G, F[0], fac, qb, kh, kt, qs, ks, kst, d_, c, tiny)
    return impl


@njit(helper=True)
def one_product(e, c, tiny):
    """Whether a chunk's decayed products per key dimension can take the factor of (s, t] as e_t / e_s
    (e: the running products from the chunk's start, F's e): every dimension's product over the chunk
    is at least tiny ** (1/4) (e_t only shrinks with t), so 1 / e_s stays far from overflow."""
    floor = np.sqrt(np.sqrt(tiny))
    last, ok = e[c - 1], True
    for j in range(last.shape[0]):
        ok = ok and last[j] >= floor
    return ok


@njit(helper=True)
def _vector_scores(QA, Kf, a, e, fac, qb, kh, kt, qs, ks, kst, d_, c, tiny):
    """gate_scores per key dimension. a, e: the per-position factors and their running products from
    the chunk's start (F's e); fac (D'), qb, kh (SUB, D'), kt (D', SUB), qs, ks (chunk, D') and kst
    (D', chunk): scratch.

    Where every dimension's product over the whole chunk is at least tiny ** (1/4) (no reset, no
    factor near underflow), the factor of (s, t] is e_t / e_s and the scores are one product,
    (q_t e_t) . (k_s / e_s), as without gates. Otherwise blocks of SUB positions (see the module
    docstring), with running products that only shrink."""
    wide_vectors()
    one, zero = tiny / tiny, tiny - tiny  # in the compute dtype
    if one_product(e, c, tiny):
        for t in range(c):
            et, qt, qrow, krow, kt_ = e[t], QA[t, :d_], qs[t], ks[t], Kf[t]
            for j in range(d_):
                qrow[j] = qt[j] * et[j]
            for j in range(d_):
                krow[j] = kt_[j] / et[j]
        transpose_rows(ks, kst, fac, c)  # (fac: a column sum nobody reads)
        small_gemm(qs[:c], kst[:, :c], QA[:c, d_:d_ + c], False, -1, 0)  # to the diagonal's tile
        zero_above_diagonal(QA, d_, c)
        return
    zero_above_diagonal(QA, d_, c)  # (the blocks below write every score at or below it)
    for i0 in range(0, c, SUB):
        i1 = min(i0 + SUB, c)
        for t in range(i0, i1):  # within the block: every score its own sum of D' decayed terms
            for j in range(d_):
                fac[j] = one
            qt, scores = QA[t, :d_], as_contiguous(QA[t, d_:d_ + c])
            for s in range(t, i0 - 1, -1):
                ks, as_ = Kf[s], a[s]
                acc = zero
                for j in range(d_):
                    acc += qt[j] * ks[j] * fac[j]
                scores[s] = acc
                for j in range(d_):
                    x = fac[j] * as_[j]
                    fac[j] = x if x >= tiny else zero
        if i0 == 0:
            continue
        for j in range(d_):  # earlier blocks: q_t times the factors of (i0 - 1, t] ...
            fac[j] = one
        for t in range(i0, i1):
            at, qt, qrow = a[t], QA[t, :d_], qb[t - i0]
            for j in range(d_):
                x = fac[j] * at[j]
                fac[j] = x if x >= tiny else zero
            for j in range(d_):
                qrow[j] = qt[j] * fac[j]
        for j in range(d_):
            fac[j] = one
        for j0 in range(i0 - SUB, -1, -SUB):  # ... times k_s and the factors of (s, i0 - 1], block by block
            for s in range(j0 + SUB - 1, j0 - 1, -1):
                ks, krow, as_ = Kf[s], kh[s - j0], a[s]
                for j in range(d_):
                    krow[j] = ks[j] * fac[j]
                for j in range(d_):
                    x = fac[j] * as_[j]
                    fac[j] = x if x >= tiny else zero
            for j in range(d_):
                for s in range(SUB):
                    kt[j, s] = kh[s, j]
            small_gemm(qb[:i1 - i0], kt, QA[i0:i1, d_ + j0:d_ + j0 + SUB], False, -1, -1)


def _vector_scores_c(qa, qa_stride, kf, af, ef, fac, qb, kh, kt, qs, ks, kst, d_, c, tiny):
    """_vector_scores on raw pointers: QA's rows ``qa_stride`` elements apart, the others
    C-contiguous with rows of D' (Kf, a, e, qs, ks: (c, D'); qb, kh: (SUB, D'); kt: (D', SUB); kst:
    (D', c))."""
    _vector_scores(carray(qa, (c, qa_stride)), carray(kf, (c, d_)), carray(af, (c, d_)), carray(ef, (c, d_)),
                   carray(fac, (d_,)), carray(qb, (SUB, d_)), carray(kh, (SUB, d_)), carray(kt, (d_, SUB)),
                   carray(qs, (c, d_)), carray(ks, (c, d_)), carray(kst, (d_, c)), d_, c, tiny)


def _vector_scores_signature(dt):
    ptr, i = types.CPointer(dt), types.intp
    return types.void(ptr, i, *([ptr] * 10), i, i, dt)


_VECTOR_SCORES = {dt: symbols.define(f"vector_gate_scores_{dt}", _vector_scores_c, _vector_scores_signature(dt))
                  for dt in (types.float32, types.float64)}


@intrinsic
def _call_vector_scores(typingctx, QA, Kf, a, e, fac, qb, kh, kt, qs, ks, kst, d_, c, tiny):
    """Call the registered _vector_scores_c for QA's dtype (the arrays as it says; unchecked)."""
    sig = types.void(QA, Kf, a, e, fac, qb, kh, kt, qs, ks, kst, d_, c, tiny)

    def codegen(context, builder, sig, args):
        size = context.get_abi_sizeof(context.get_data_type(sig.args[0].dtype))
        i64 = context.get_value_type(types.intp)
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(sig.args[:11], args[:11])]
        values = []
        for k, arr in enumerate(arrays):
            values.append(arr.data)
            if k == 0:  # QA's row stride in elements
                values.append(builder.sdiv(builder.extract_value(arr.strides, 0), ir.Constant(i64, size)))
        values += [context.cast(builder, args[11], sig.args[11], types.intp),
                   context.cast(builder, args[12], sig.args[12], types.intp), args[13]]
        symbols.emit_call(builder, _VECTOR_SCORES[sig.args[0].dtype], values)
        return context.get_dummy_value()

    return sig, codegen


def prepare_kernel(dtype, kind):
    """Register what a kernel of this gate kind calls by symbol (before it compiles or loads)."""
    if kind == VECTOR:
        dt = numba.from_dtype(np.dtype(dtype))
        symbols.register(_VECTOR_FACTORS[dt])
        symbols.register(_VECTOR_SCORES[dt])


@overload(gate_queries, jit_options=OVERLOAD_OPTIONS)
def _gate_queries(gates, QA, d_, c, F):
    """phi(q_t) times the factor of the state before the chunk at t (its part of the output)."""
    kind = _kind(gates)
    if kind == 0:
        return lambda gates, QA, d_, c, F: None

    def impl(gates, QA, d_, c, F):
        e = F[0]
        for t in range(c):
            row = QA[t, :d_]
            if kind != VECTOR:
                f = e[t]
                for a in range(d_):
                    row[a] *= f
            else:
                et = e[t]
                for a in range(d_):
                    row[a] *= et[a]
    return impl


@overload(gate_key_columns, jit_options=OVERLOAD_OPTIONS)
def _gate_key_columns(gates, KT, Kf, c, F, Pz):
    """phi(K)^T's column s times position s's factor at the chunk's end; Pz += its row sums (without
    gates the transpose added them). Per dimension the rows of phi(K) are scaled and transposed
    again: both loops then run along rows."""
    kind = _kind(gates)
    if kind == 0:
        return lambda gates, KT, Kf, c, F, Pz: None
    dt = as_dtype(KT.dtype).type
    if kind != VECTOR:
        def impl(gates, KT, Kf, c, F, Pz):
            w = F[1]
            for a in range(KT.shape[0]):
                row = KT[a, :c]
                for s in range(c):
                    row[s] *= w[s]
                z = dt(0.0)
                for s in range(c):  # (a loop that only reads: one order of the sum wherever the arrays lie)
                    z += row[s]
                Pz[a] += z
        return impl

    def impl(gates, KT, Kf, c, F, Pz):
        w = F[1]
        for s in range(c):
            row, ws = Kf[s], w[s]
            for a in range(Kf.shape[1]):
                row[a] *= ws[a]
        transpose_rows(Kf, KT, Pz, c)
    return impl


@overload(gate_key_rows, jit_options=OVERLOAD_OPTIONS)
def _gate_key_rows(gates, Kf, c, F, Pz):
    """The same for phi(K) as rows (the backward's keys): row s times its factor; Pz += column sums."""
    kind = _kind(gates)

    def impl(gates, Kf, c, F, Pz):
        w = F[1]
        for s in range(c):
            row = Kf[s]
            if kind == SCALAR or kind == CONSTANT:
                f = w[s]
                for a in range(Kf.shape[1]):
                    row[a] *= f
            elif kind == VECTOR:
                ws = w[s]
                for a in range(Kf.shape[1]):
                    row[a] *= ws[a]
            for a in range(Kf.shape[1]):
                Pz[a] += row[a]
    return impl


gate_log_sum = _stub("gate_log_sum")


@overload(gate_log_sum, jit_options=OVERLOAD_OPTIONS)
def _gate_log_sum(gates, lam, c, G, R):
    """lam += the log of the chunk's whole factor, per key dimension (float64, -inf after a reset)."""
    kind = _kind(gates)
    if kind == NONE:
        return lambda gates, lam, c, G, R: None

    def impl(gates, lam, c, G, R):
        for a in range(lam.shape[0]):
            if kind != VECTOR:
                lam[a] = -np.inf if R[c - 1] >= 0 else lam[a] + G[c - 1]
            else:  # R[0]: the chunk's sums of log gates (-inf after a reset)
                lam[a] += R[0, a]
    return impl


@overload(gate_pending, jit_options=OVERLOAD_OPTIONS)
def _gate_pending(gates, P, Pz, lam, c, G, R, F, has_p):
    """Decay the pending sums by the chunk's whole factor: Pz here, P (if it holds values) here per
    key dimension, else by the product that adds the chunk (the returned factor: 1 without gates);
    lam += the factor's log (lam: the log-decay of each key dimension since the last fold, float64,
    -inf after a reset: the accumulator's decay, see gate_state_factors)."""
    kind = _kind(gates)
    dt = as_dtype(P.dtype).type
    if kind == NONE:
        return lambda gates, P, Pz, lam, c, G, R, F, has_p: dt(1.0)

    def impl(gates, P, Pz, lam, c, G, R, F, has_p):
        whole = F[2]
        gate_log_sum(gates, lam, c, G, R)
        for a in range(P.shape[0]):
            if kind != VECTOR:
                f = whole[0]
            else:
                f = whole[a]
                if has_p:
                    row = P[a]
                    for e in range(P.shape[1]):
                        row[e] *= f
            Pz[a] *= f
        return dt(1.0) if kind == VECTOR else whole[0]
    return impl


gate_state_factors = _stub("gate_state_factors")


@overload(gate_state_factors, jit_options=OVERLOAD_OPTIONS)
def _gate_state_factors(gates, lam, fb):
    """fb = exp(lam) in the compute dtype: the factor of each row of the rounded accumulator B (which
    stays as the last fold left it) in the current state. Nothing without gates."""
    kind = _kind(gates)
    if kind == NONE:
        return lambda gates, lam, fb: None
    dt = as_dtype(fb.dtype).type

    def impl(gates, lam, fb):
        if kind == VECTOR:
            for a in range(fb.shape[0]):
                fb[a] = dt(exp_le0(lam[a]))
        else:
            f = dt(exp_le0(lam[0]))
            for a in range(fb.shape[0]):
                fb[a] = f
    return impl


gate_buffers = _stub("gate_buffers")


@overload(gate_buffers, jit_options=OVERLOAD_OPTIONS)
def _gate_buffers(gates, chunk, dtype):
    """(G, R, F, X) for a chunk of ``chunk`` positions: see chunk_gates (G, R, F) and gate_scores (X)."""
    kind = _kind(gates)
    if kind == 0:
        return lambda gates, chunk, dtype: (empty(0, np.float64), empty(0, np.int64),
                                            (empty(0, dtype), empty(0, dtype), empty(0, dtype),
                                             empty(0, dtype)),
                                            (empty(0, dtype),))
    if kind != VECTOR:
        return lambda gates, chunk, dtype: (empty(chunk, np.float64), empty(chunk, np.int64),
                                            (empty(chunk, dtype), empty(chunk, dtype), empty(1, dtype),
                                             empty(0, dtype)),
                                            (empty(chunk, dtype),))

    def impl(gates, chunk, dtype):
        d = gates.shape[3]
        return (empty((chunk, d), dtype), empty((1, d), np.float64),
                (empty((chunk, d), dtype), empty((chunk, d), dtype), empty(d, dtype), empty(d, dtype)),
                (empty(d, dtype), empty((SUB, d), dtype), empty((SUB, d), dtype), empty((d, SUB), dtype),
                 empty((chunk, d), dtype), empty((chunk, d), dtype), empty((d, chunk), dtype)))
    return impl


like = _stub("like")


@overload(like, jit_options=OVERLOAD_OPTIONS)
def _like(x, arr):
    """x converted to arr's element type."""
    dt = as_dtype(arr.dtype).type
    return lambda x, arr: dt(x)
