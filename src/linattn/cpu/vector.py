"""Inner loops written with explicit LLVM vector types, where LLVM's loop vectoriser does poorly.

- ``state_pass`` (a decoding step of one head): the vectorised loops load and store the output row
  once per row of S; here a panel of columns is kept in vector registers across all rows of S, so
  each element of S is loaded and stored once, with independent accumulator chains so FMA latency
  does not serialise; the Z update and the normalisation are folded in.
- ``transpose_blocks`` (a chunk's phi(K) into phi(K)^T): scalar loops, one element at a time; here
  square blocks of one vector width go through registers and a shuffle network.
  ``transpose_padded`` pads a short chunk's rows with zeros to whole blocks first.
- ``masked_access``: loads and stores of the last columns of a row (fewer than a vector) as one
  masked vector, for ``state_pass`` and cpu/smallgemm.py.
- ``wide_vectors``: asks LLVM to vectorise a function's own loops with 512-bit vectors.
"""
import math

from llvmlite import ir
from llvmlite.binding import llvm_version_info
from numba.core import cgutils, types
from numba.extending import intrinsic

from .._jit import njit

#: Bytes per vector of the state pass: 512 bits (LLVM splits the vectors where the CPU has narrower ones).
VECTOR_BYTES = 64
#: Vectors per panel of the state pass: independent accumulator chains (hides the FMA latency).
PANEL = 4
#: Bytes per vector of the transpose (256 bits: the shuffles stay within what AVX2 does well).
TRANSPOSE_BYTES = 32
_FLAGS = ("contract", "reassoc", "nsz", "arcp")


def lane_mask(builder, left, width):
    """The mask of a vector of ``width`` lanes whose first ``left`` (an integer value, 0 < left < width)
    are on."""
    lane = ir.VectorType(left.type, width)
    undef = ir.Constant(lane, ir.Undefined)
    splat = builder.shuffle_vector(builder.insert_element(undef, left, ir.Constant(ir.IntType(32), 0)), undef,
                                   ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width))
    return builder.icmp_signed("<", ir.Constant(lane, list(range(width))), splat)


def _masked(module, op, vec):
    """The declaration of llvm.masked.load or llvm.masked.store (``op``) for vectors of type ``vec``: its
    name carries the pointer's type, ``p0`` where LLVM's pointers are opaque (LLVM 17 on; llvmlite
    0.45 on), ``p0v16f32`` and the like where they are typed (llvmlite 0.43-0.44: LLVM 14-15)."""
    elem = "v%d%s" % (vec.count, "f32" if isinstance(vec.element, ir.FloatType) else "f64")
    pointer = "p0" if llvm_version_info[0] >= 17 else "p0" + elem
    i32, mask = ir.IntType(32), ir.VectorType(ir.IntType(1), vec.count)
    if op == "load":
        fnty = ir.FunctionType(vec, [vec.as_pointer(), i32, mask, vec])
    else:
        fnty = ir.FunctionType(ir.VoidType(), [vec, vec.as_pointer(), i32, mask])
    return cgutils.get_or_insert_function(module, fnty, f"llvm.masked.{op}.{elem}.{pointer}")


def masked_access(builder, vec, mask, align):
    """(load(p), store(x, p)) of ``vec`` values at pointers p: plain where ``mask`` is None, else only the
    lanes the mask has on, through llvm.masked.load (the others 0) and llvm.masked.store: the last
    columns of a row, fewer than a vector, in one vector (masked-off lanes are neither read nor
    written, so a row may end at the end of readable memory)."""
    if mask is None:
        return (lambda p: builder.load(p, align=align)), (lambda x, p: builder.store(x, p, align=align))
    size = ir.Constant(ir.IntType(32), align)

    def load(p):
        return builder.call(_masked(builder.module, "load", vec), [p, size, mask, ir.Constant(vec, None)])

    def store(x, p):
        builder.call(_masked(builder.module, "store", vec), [x, p, size, mask])

    return load, store


def _at(builder, base, idx, ty):
    """Pointer to a ``ty`` value at element ``idx`` of ``base``."""
    return builder.bitcast(builder.gep(base, [idx]), ty.as_pointer())


@intrinsic
def wide_vectors(typingctx):
    """Let LLVM vectorise the loops of the calling function with 512-bit vectors where the CPU has
    them (LLVM prefers 256 bits on AVX-512 CPUs; the BLAS the kernels call uses 512 already).
    Call it first in a helper whose loops should use them: the setting is per LLVM function."""

    def codegen(context, builder, sig, args):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')  # llvmlite lists no valued attributes
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def state_pass(typingctx, S, Z, v, q, k, out, row_stride, eps, normalize, decay, qscale, S0, Z0, src_stride):
    """One decoding step of one head: for every row a and column e of S (D' x Dv, rows
    ``row_stride`` elements apart, unit column stride), S[a, e] = decay[a] S0[a, e] + k[a] v[e] and
    Z[a] = decay[a] Z0[a] + k[a] (``decay`` None: 1; a float: the same factor for every row); then
    out[e] = qscale sum_a q[a] S[a, e], divided by qscale sum_a q[a] Z[a] + eps when ``normalize``.
    S0 and Z0 are S and Z themselves (updated in place) when None, else the state before the step,
    read only (S0's rows ``src_stride`` elements apart, unit column stride; Z0 unit stride): the new
    state is written to S and Z with no copy of the old one first. With k, v, decay, S0 and Z0 None,
    S and Z are only read (a query over the state).

    Z, v, q, k, out and decay must have unit stride. Columns go in panels of PANEL vectors, then
    single vectors, then the last ones (fewer than a vector) as one masked vector (they went one at a
    time: Dv 63 took 2.5x the time of 64); the division is applied to the panels' registers before
    they are stored. Only callable from Numba code.
    """
    if not (isinstance(S, types.Array) and S.ndim == 2 and S.dtype in (types.float32, types.float64)):
        return None
    one_factor = isinstance(decay, types.Float)
    if one_factor and decay != S.dtype:
        return None
    reading = isinstance(k, types.NoneType)  # (S and Z read, not written)
    sourced = not isinstance(S0, types.NoneType)  # (the old state read from S0 and Z0)
    if reading and not (isinstance(v, types.NoneType) and isinstance(decay, types.NoneType) and not sourced):
        return None
    if sourced and not (isinstance(S0, types.Array) and S0.ndim == 2 and S0.dtype == S.dtype
                        and isinstance(Z0, types.Array) and Z0.ndim == 1 and Z0.dtype == S.dtype):
        return None
    arrays = ((Z, q, out) + (() if reading else (v, k))
              + (() if isinstance(decay, (types.NoneType, types.Float)) else (decay,)))
    if not all(isinstance(x, types.Array) and x.ndim == 1 and x.dtype == S.dtype for x in arrays):
        return None
    decayed = not isinstance(decay, types.NoneType)
    sig = types.void(S, Z, v, q, k, out, row_stride, eps, normalize, decay, qscale, S0, Z0, src_stride)

    def codegen(context, builder, sig, args):
        s_arr, z_arr, v_arr, q_arr, k_arr, o_arr = (
            None if isinstance(t, types.NoneType) else context.make_array(t)(context, builder, a)
            for t, a in zip(sig.args[:6], args[:6]))
        if sourced:
            s_src, z_src = (context.make_array(t)(context, builder, a).data
                            for t, a in zip(sig.args[11:13], args[11:13]))
            src_stride_v = args[13]
        else:
            s_src, z_src, src_stride_v = s_arr.data, z_arr.data, args[6]
        d_arr = context.make_array(sig.args[9])(context, builder, args[9]) if decayed and not one_factor else None
        stride_v = args[6]
        eps_v = context.cast(builder, args[7], sig.args[7], types.float64)
        norm_v = context.cast(builder, args[8], sig.args[8], types.boolean)
        qs_v = context.cast(builder, args[10], sig.args[10], types.float64)
        fty = context.get_data_type(sig.args[0].dtype)
        width = VECTOR_BYTES // context.get_abi_sizeof(fty)
        vec = ir.VectorType(fty, width)
        i32, i64 = ir.IntType(32), context.get_value_type(types.intp)
        align = context.get_abi_sizeof(fty)
        rows = builder.extract_value(s_arr.shape, 0)
        ncols = builder.extract_value(s_arr.shape, 1)
        undef = ir.Constant(vec, ir.Undefined)
        zero_mask = ir.Constant(ir.VectorType(i32, width), [0] * width)

        def broadcast(x, ty):
            """x (a scalar) as ty: itself, or splat to a vector."""
            if ty is fty:
                return x
            return builder.shuffle_vector(builder.insert_element(undef, x, ir.Constant(i32, 0)), undef, zero_mask)

        def splat(base, idx, ty):
            return broadcast(builder.load(builder.gep(base, [idx])), ty)

        def factor(idx, ty):
            """Row idx's decay factor as ty (one factor for all rows: ``decay`` itself)."""
            return broadcast(args[9], ty) if one_factor else splat(d_arr.data, idx, ty)

        def fma(x, y, z):
            return builder.fadd(builder.fmul(x, y, flags=_FLAGS), z, flags=_FLAGS)

        # Z = decay Z + k, then den = q.Z (Z after the update), then scale = qscale / (qscale den + eps)
        # in float64, rounded to the compute dtype (as NumPy would do it with a float eps), or qscale
        # without normalisation. The sum is a loop of its own that only reads: a loop that also stores
        # may be vectorised or not by a runtime check of how far apart its arrays are (Z0 just before
        # Z: not), and the two sum in different orders (results that hung on where malloc put them).
        if not reading:
            with cgutils.for_range(builder, rows) as loop:
                zold = builder.load(builder.gep(z_src, [loop.index]))
                if decayed:
                    zold = builder.fmul(factor(loop.index, fty), zold, flags=_FLAGS)
                z = builder.fadd(zold, builder.load(builder.gep(k_arr.data, [loop.index])))
                builder.store(z, builder.gep(z_arr.data, [loop.index]))
        den = cgutils.alloca_once_value(builder, ir.Constant(fty, 0.0))
        with cgutils.for_range(builder, rows) as loop:
            z = builder.load(builder.gep(z_arr.data, [loop.index]))
            qz = builder.fmul(builder.load(builder.gep(q_arr.data, [loop.index])), z, flags=_FLAGS)
            builder.store(builder.fadd(builder.load(den), qz, flags=_FLAGS), den)
        f64 = ir.DoubleType()
        den64 = builder.fpext(builder.load(den), f64) if fty != f64 else builder.load(den)
        inv = builder.fdiv(qs_v, builder.fadd(builder.fmul(qs_v, den64), eps_v))
        scale = builder.select(norm_v, inv, qs_v)
        scale = builder.fptrunc(scale, fty) if fty != f64 else scale

        def panel(e0, nvec, left=None):
            """Columns [e0, e0 + nvec vectors): accumulators live in registers over all rows. With ``left``
            (one vector, fewer columns than a vector left): only those columns (masked_access)."""
            ty = vec
            load, store = masked_access(builder, ty, None if left is None else lane_mask(builder, left, width), align)
            cols = [builder.add(e0, ir.Constant(i64, j * width)) for j in range(nvec)]
            vv = [None if reading else load(_at(builder, v_arr.data, c, ty)) for c in cols]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(ty, None)) for _ in cols]
            d_one = factor(None, ty) if one_factor else None
            with cgutils.for_range(builder, rows) as loop:
                qa = splat(q_arr.data, loop.index, ty)
                ka = None if reading else splat(k_arr.data, loop.index, ty)
                da = d_one if one_factor else splat(d_arr.data, loop.index, ty) if decayed else None
                row = builder.mul(loop.index, stride_v)
                src_row = builder.mul(loop.index, src_stride_v)
                for c, x, acc in zip(cols, vv, accs):
                    p = _at(builder, s_arr.data, builder.add(row, c), ty)
                    s = load(_at(builder, s_src, builder.add(src_row, c), ty) if sourced else p)
                    if not reading:
                        s = fma(ka, x, builder.fmul(da, s, flags=_FLAGS) if decayed else s)
                        store(s, p)
                    builder.store(fma(qa, s, builder.load(acc)), acc)
            sc = broadcast(scale, ty)
            for c, acc in zip(cols, accs):
                store(builder.fmul(builder.load(acc), sc), _at(builder, o_arr.data, c, ty))

        def columns(start, stop, nvec):
            """Panels over [start, the last multiple of their width below stop); returns that end."""
            step = ir.Constant(i64, nvec * width)
            end = builder.add(start, builder.mul(builder.udiv(builder.sub(stop, start), step), step))
            with cgutils.for_range_slice(builder, start, end, step) as (e0, _):
                panel(e0, nvec)
            return end

        end = columns(ir.Constant(i64, 0), ncols, PANEL)
        end = columns(end, ncols, 1)
        left = builder.sub(ncols, end)  # fewer columns than a vector: one masked vector
        with builder.if_then(builder.icmp_signed(">", left, ir.Constant(i64, 0))):
            panel(end, 1, left)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def transpose_blocks(typingctx, src, dst, colsum, nrows):
    """dst[a, t] = src[t, a] and colsum[a] += src[t, a] for t < nrows and a < src.shape[1], both
    rounded down to a multiple of w = TRANSPOSE_BYTES / itemsize (the caller does the rest).

    src (R x D) and dst (D x R') need unit column stride, colsum unit stride. Each w x w block is
    loaded as w row vectors, summed into column sums, and transposed by log2(w) rounds of
    interleaving rows i and i + w/2 (a perfect shuffle). Only callable from Numba code.
    """
    if not (isinstance(src, types.Array) and src.ndim == 2 and src.dtype in (types.float32, types.float64)):
        return None
    if not (isinstance(dst, types.Array) and dst.ndim == 2 and dst.dtype == src.dtype
            and isinstance(colsum, types.Array) and colsum.ndim == 1 and colsum.dtype == src.dtype):
        return None
    sig = types.void(src, dst, colsum, nrows)

    def codegen(context, builder, sig, args):
        s_arr, d_arr, c_arr = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:3], args[:3]))
        fty = context.get_data_type(sig.args[0].dtype)
        size = context.get_abi_sizeof(fty)
        w = TRANSPOSE_BYTES // size
        vec = ir.VectorType(fty, w)
        i64 = context.get_value_type(types.intp)

        def const(x):
            return ir.Constant(i64, x)

        def element(arr, stride, r, c):  # pointer to a vector at arr[r, c]
            return _at(builder, arr.data, builder.add(builder.mul(r, stride), c), vec)

        def down(x):  # x rounded down to a multiple of w
            return builder.mul(builder.udiv(x, const(w)), const(w))

        s_stride = builder.sdiv(builder.extract_value(s_arr.strides, 0), const(size))
        d_stride = builder.sdiv(builder.extract_value(d_arr.strides, 0), const(size))
        t_end, a_end = down(args[3]), down(builder.extract_value(s_arr.shape, 1))
        half = w // 2
        mask_ty = ir.VectorType(ir.IntType(32), w)
        lo = ir.Constant(mask_ty, [j for i in range(half) for j in (i, w + i)])  # interleave the low halves
        hi = ir.Constant(mask_ty, [j for i in range(half, w) for j in (i, w + i)])  # and the high halves
        acc = cgutils.alloca_once(builder, vec)
        with cgutils.for_range_slice(builder, const(0), a_end, const(w)) as (a0, _):
            builder.store(ir.Constant(vec, None), acc)
            with cgutils.for_range_slice(builder, const(0), t_end, const(w)) as (t0, _):
                rows = [builder.load(element(s_arr, s_stride, builder.add(t0, const(i)), a0), align=size)
                        for i in range(w)]
                total = rows
                while len(total) > 1:  # a sum tree: short dependency chains
                    total = [builder.fadd(x, y) for x, y in zip(total[0::2], total[1::2])]
                builder.store(builder.fadd(builder.load(acc), total[0]), acc)
                for _ in range(int(math.log2(w))):
                    rows = [builder.shuffle_vector(rows[i], rows[i + half], m) for i in range(half) for m in (lo, hi)]
                for i, row in enumerate(rows):
                    builder.store(row, element(d_arr, d_stride, builder.add(a0, const(i)), t0), align=size)
            p = _at(builder, c_arr.data, a0, vec)
            builder.store(builder.fadd(builder.load(p, align=size), builder.load(acc)), p, align=size)
        return context.get_dummy_value()

    return sig, codegen


@njit(helper=True)
def transpose_rows(src, dst, colsum, nrows):
    """dst[:, :nrows] = src[:nrows]^T and colsum += the column sums of src[:nrows]: transpose_blocks for
    the whole blocks, plain loops for the edges."""
    transpose_blocks(src, dst, colsum, nrows)
    w = TRANSPOSE_BYTES // src.itemsize
    c_end, d_end = nrows - nrows % w, src.shape[1] - src.shape[1] % w
    for t in range(nrows):  # the last columns of whole-block rows, then every column of the last rows
        for a in range(d_end if t < c_end else 0, src.shape[1]):
            dst[a, t] = src[t, a]
            colsum[a] += src[t, a]


#: A short chunk's rows are padded with zeros up to a multiple of this, where the buffers have room, before
#: they are transposed and multiplied (transpose_padded, gating.masked_product): whole blocks and whole
#: vectors (8 float32: half an AVX-512 vector, a whole AVX2 one) instead of a loop per element. B8 H8 D64,
#: a causal call of 7 positions took 1.8x the time of 8.
PAD_ROWS = 8


@njit(helper=True)
def padded(nrows, cap):
    """nrows rounded up to a multiple of PAD_ROWS, at most ``cap``."""
    return min(-(-nrows // PAD_ROWS) * PAD_ROWS, cap)


@njit(helper=True)
def transpose_padded(src, dst, colsum, nrows):
    """transpose_rows(src, dst, colsum, nrows) with src's rows from nrows to padded(nrows, ...) (at most
    src's rows and dst's columns) set to zero first and transposed too: dst's columns there are zero
    (colsum gains nothing from them)."""
    end = padded(nrows, min(src.shape[0], dst.shape[1]))
    for t in range(nrows, end):
        row = src[t]
        for a in range(row.shape[0]):
            row[a] = 0
    transpose_rows(src, dst, colsum, end)


@intrinsic
def stream_copy(typingctx, src, dst):
    """dst[:] = src[:] for C-contiguous arrays of as many elements, with non-temporal (streaming) 64-byte
    stores where dst is 64-byte aligned: the lines are written without being read first and without
    filling the caches (for large results read much later: the backward pass's chunk states). Plain
    stores where dst is not aligned. Streaming stores are not ordered with later stores: the caller
    calls ``store_fence`` once before another thread may read dst (a fence here, after every chunk's
    state, waited for each to reach memory: 5% of the vjp's forward, seen with perf). Only callable
    from Numba code."""
    if not (isinstance(src, types.Array) and isinstance(dst, types.Array) and src.dtype == dst.dtype
            and src.dtype in (types.float32, types.float64) and src.layout == "C" and dst.layout == "C"):
        return None
    sig = types.void(src, dst)

    def codegen(context, builder, sig, args):
        s_arr, d_arr = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args))
        fty = context.get_data_type(sig.args[0].dtype)
        size = context.get_abi_sizeof(fty)
        w = 64 // size
        vec = ir.VectorType(fty, w)
        i64 = context.get_value_type(types.intp)
        n = s_arr.nitems
        addr = builder.ptrtoint(d_arr.data, i64)
        aligned = builder.icmp_unsigned("==", builder.and_(addr, ir.Constant(i64, 63)), ir.Constant(i64, 0))
        nvec = builder.select(aligned, builder.udiv(n, ir.Constant(i64, w)), ir.Constant(i64, 0))
        md = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range(builder, nvec) as loop:
            idx = builder.mul(loop.index, ir.Constant(i64, w))
            x = builder.load(_at(builder, s_arr.data, idx, vec), align=size)
            st = builder.store(x, _at(builder, d_arr.data, idx, vec), align=64)
            st.set_metadata("nontemporal", md)
        with cgutils.for_range_slice(builder, builder.mul(nvec, ir.Constant(i64, w)), n, ir.Constant(i64, 1)) as (i, _):
            builder.store(builder.load(builder.gep(s_arr.data, [i])), builder.gep(d_arr.data, [i]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_fence(typingctx):
    """A full memory fence: every earlier store, streaming ones included, is visible to other threads
    before any later memory access. Only callable from Numba code."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen
