"""``small_gemm``: the chunk's small matrix products (32-128 rows and columns) in vector registers.

OpenBLAS is fast on such sizes only where it has "small matrix" kernels (SkylakeX builds); elsewhere
(AVX2, Haswell kernels) every call packs its operands first, and a chunk costs 1.8x more (measured:
17.1 instead of 9.3 us per 32 positions at D = Dv = 64). This is a register-blocked product written
with explicit LLVM vector types: a tile of R rows by a panel of two vectors of columns accumulates
in registers over the whole inner dimension (each loaded row of B serves R rows of A, each broadcast
element of A a whole panel), then columns one vector at a time, and the last columns (fewer than a
vector) as one vector through masked loads and stores (they went one at a time: a width of 63 took
2.6x the time of 64 per multiply-add). R is 8 with AVX-512's 32 registers, 4 with AVX2's 16, then
fewer for the rows left (``row_tiles`` says which rows share a tile). With AVX-512, tiles of 8 rows
by two vectors load a row of B half as often per multiply-add as the 4 by 4 they replace: as fast
where B fits in L1, 1.3x faster where it does not (D = 128), and 1.2x faster on products two vectors
wide (a chunk's scores, D = 32). Two optional bands skip the zero part of causal products: for the
rows of a tile starting at r0, the inner dimension stops at ``kband + r0 + R`` (the chunk's masked
scores times V) and the columns at ``nband + r0 + R``, rounded up to whole vectors (the scores
themselves; the caller zeroes the rest of the triangle). The product with A transposed has one
(``small_gemm_tn_lower``): for a lower triangular A the inner dimension of a tile starts at its first
row. ``small_gemm_stacked`` reads B from two arrays, its rows from the second's first once the
first's run out (the state, then the chunk's values where they lie: no copy), and scales each row of
the product as it stores it (the normalisation: no second pass over the output).
"""
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic
from numba.np.numpy_support import as_dtype

from .._jit import before_kernels, target_features
from . import symbols
from .vector import lane_mask, masked_access

#: Rows of A (and of C) per register tile of two vectors of columns: with AVX2's 16 registers (8
#: accumulators), and with AVX-512's 32 (16 accumulators; each loaded row of B serves twice the rows,
#: which matters where B outgrows L1: D = 128).
ROWS = 4
WIDE_ROWS = 8
_FLAGS = ("contract", "reassoc", "nsz", "arcp")


def _vector_bytes(context):
    """64 (512-bit vectors) where the target has AVX-512, else 32: LLVM splits wider vectors into
    halves, which would double the tile's registers past the 16 that AVX2 has."""
    return 64 if "+avx512f" in target_features(context) else 32


def _stages(wide):
    """Rows per tile of each stage, in order: each covers the rows the ones before left, in whole
    tiles (the last, single rows, all that is left)."""
    return [WIDE_ROWS, ROWS, 1] if wide else [ROWS, 1]


def row_tiles(m):
    """(first row, rows) of the register tile of each of the m rows of a product, as compiled for this
    process's target (the bands depend on them)."""
    from numba.core.registry import cpu_target
    tiles, start = [], 0
    for rows in _stages(_vector_bytes(cpu_target.target_context) == 64):
        end = start + (m - start) // rows * rows
        tiles += [(start + (i - start) // rows * rows, rows) for i in range(start, end)]
        start = end
    return tiles


def _typed(a, b, c):
    arrays = (a, b, c)
    return (all(isinstance(x, types.Array) and x.ndim == 2 and x.dtype in (types.float32, types.float64)
                for x in arrays) and len({x.dtype for x in arrays}) == 1)


# The products are compiled once per dtype and form as C functions called by symbol (cpu/symbols.py).


def _c_signature(dtype):
    """(a, m, kdim, sa, b, sb, c, n, sc, beta, kband, nband, b2, sb2, ksplit, rs, scaled): pointers, dims
    and row strides in elements; beta (c's factor, 0: c is not read) in the dtype; B's rows from
    ``ksplit`` on are those of b2 (rows sb2 apart) from its first: B stacked from two arrays without a
    copy; where ``scaled`` is nonzero, row i of the product is multiplied by rs[i] before c is added."""
    ptr, i = types.CPointer(dtype), types.intp
    return types.void(ptr, i, i, i, ptr, i, ptr, i, i, dtype, i, i, ptr, i, i, ptr, i)


@intrinsic
def _raw_nn(typingctx, a, m, kdim, sa, b, sb, c, n, sc, accumulate, kband, nband, b2, sb2, ksplit, rs, scaled):
    return _c_signature(a.dtype), _codegen(False)


@intrinsic
def _raw_tn(typingctx, a, m, kdim, sa, b, sb, c, n, sc, accumulate, kband, nband, b2, sb2, ksplit, rs, scaled):
    return _c_signature(a.dtype), _codegen(True)


def _product_nn(a, m, kdim, sa, b, sb, c, n, sc, accumulate, kband, nband, b2, sb2, ksplit, rs, scaled):
    _raw_nn(a, m, kdim, sa, b, sb, c, n, sc, accumulate, kband, nband, b2, sb2, ksplit, rs, scaled)


def _product_tn(a, m, kdim, sa, b, sb, c, n, sc, accumulate, kband, nband, b2, sb2, ksplit, rs, scaled):
    _raw_tn(a, m, kdim, sa, b, sb, c, n, sc, accumulate, kband, nband, b2, sb2, ksplit, rs, scaled)


_SYMBOLS = {(dtype, trans_a): symbols.define(f"small_gemm_{'tn' if trans_a else 'nn'}_{dtype}", fn, _c_signature(dtype))
            for dtype in (types.float32, types.float64) for trans_a, fn in ((False, _product_nn), (True, _product_tn))}


def register(dtype):
    """Compile (or load) the two products of ``dtype`` (a NumPy dtype) and register their symbols, once
    per process; called before a kernel of that dtype is compiled or loaded from the cache. (A float32
    user compiles no float64 products: ~0.6 s of a cold first call.)"""
    for (dt, _), symbol in _SYMBOLS.items():
        if as_dtype(dt) == dtype:
            symbols.register(symbol)


before_kernels.append(register)


def _call(trans_a, lower=False, stacked=False):
    """Intrinsic body: unpack the arrays and call the registered product by its symbol (``lower``: a
    transposed, lower triangular; ``stacked``: the arguments are (a, b1, b2, c, rs, kband, nband), B =
    [b1 ; b2], c not read, its rows scaled by rs when rs has elements)."""

    def codegen(context, builder, sig, args):
        if stacked:
            arr_b2 = context.make_array(sig.args[2])(context, builder, args[2])
            arr_rs = context.make_array(sig.args[4])(context, builder, args[4])
            dtype = sig.args[0].dtype
            sig = types.void(sig.args[0], sig.args[1], sig.args[3], dtype, types.intp, types.intp)
            args = (args[0], args[1], args[3], context.get_constant(dtype, 0.0)) + tuple(args[5:])
        arr_a, arr_b, arr_c = (context.make_array(t)(context, builder, v) for t, v in zip(sig.args[:3], args[:3]))
        dtype = sig.args[0].dtype
        size = context.get_abi_sizeof(context.get_data_type(dtype))
        i64 = context.get_value_type(types.intp)

        def rstride(arr):
            return builder.sdiv(builder.extract_value(arr.strides, 0), ir.Constant(i64, size))

        beta = context.cast(builder, args[3], sig.args[3], dtype)
        if trans_a:
            kband, nband = ir.Constant(i64, 0 if lower else -1), ir.Constant(i64, -1)
        else:
            kband, nband = args[4], args[5]
        values = [arr_a.data, builder.extract_value(arr_c.shape, 0),
                  builder.extract_value(arr_a.shape, 0 if trans_a else 1), rstride(arr_a),
                  arr_b.data, rstride(arr_b), arr_c.data, builder.extract_value(arr_c.shape, 1), rstride(arr_c),
                  beta, kband, nband]
        if stacked:  # B's rows from b1's count on: b2's
            values += [arr_b2.data, rstride(arr_b2), builder.extract_value(arr_b.shape, 0),
                       arr_rs.data, builder.extract_value(arr_rs.shape, 0)]
        else:  # (the split past every row: b1 alone; no scales)
            values += [arr_b.data, rstride(arr_b), builder.extract_value(arr_b.shape, 0),
                       arr_a.data, ir.Constant(i64, 0)]
        symbols.emit_call(builder, _SYMBOLS[dtype, trans_a], values)
        return context.get_dummy_value()

    return codegen


@intrinsic
def small_gemm(typingctx, a, b, c, beta, kband, nband):
    """c[i, j] = sum_k a[i, k] b[k, j] + beta c[i, j] (c not read when ``beta`` is 0 or False; True
    is 1: accumulate), for i < rows of c, j < columns
    of c, k < columns of a; rows of each array are ``strides[0]`` apart, columns adjacent (unchecked).
    ``kband``/``nband`` >= 0 limit the inner dimension / the columns of each tile as the module says
    (columns past the band are left as they were); -1 for none. Only callable from Numba code."""
    if not _typed(a, b, c) or not isinstance(beta, (types.Boolean, types.Number)):
        return None
    register(as_dtype(a.dtype))  # (when compiling; a kernel loaded from the cache: Kernel.get)
    return types.void(a, b, c, beta, types.intp, types.intp), _call(False)


def _tn(a, b, c, beta, lower):
    if not _typed(a, b, c) or not isinstance(beta, (types.Boolean, types.Number)):
        return None
    register(as_dtype(a.dtype))  # (when compiling; a kernel loaded from the cache: Kernel.get)
    return types.void(a, b, c, beta), _call(True, lower)


@intrinsic
def small_gemm_stacked(typingctx, a, b1, b2, c, rs, kband, nband):
    """c[i, j] = rs[i] sum_k a[i, k] b[k, j] with b = [b1 ; b2] (b1's rows, then b2's: as many in all
    as a has columns), read where they are (a chunk's [phi(Q) | A] times the state stacked on the
    chunk's values, with no copy of the values), and the rows scaled as they are stored (the
    outputs' normalisation, with no second pass over them); without the factor where ``rs`` has no
    elements. Bands as small_gemm's. Only callable from Numba code."""
    if (not _typed(a, b1, c) or not _typed(a, b2, c) or not isinstance(rs, types.Array) or rs.ndim != 1
            or rs.dtype != a.dtype):
        return None
    register(as_dtype(a.dtype))  # (when compiling; a kernel loaded from the cache: Kernel.get)
    return types.void(a, b1, b2, c, rs, types.intp, types.intp), _call(False, stacked=True)


@intrinsic
def small_gemm_tn(typingctx, a, b, c, beta):
    """c[i, j] = sum_k a[k, i] b[k, j] + beta c[i, j]: the product with a transposed (k < rows of a),
    as small_gemm without bands. Only callable from Numba code."""
    return _tn(a, b, c, beta, False)


@intrinsic
def small_gemm_tn_lower(typingctx, a, b, c, beta):
    """small_gemm_tn for a lower triangular ``a`` (a[k, i] = 0 for k < i, unchecked): each tile of
    rows of c skips the zero part of its sum. Only callable from Numba code."""
    return _tn(a, b, c, beta, True)


@intrinsic
def noinline(typingctx):
    """Keep the calling function out of its callers: LLVM would copy large code into each, and compile
    it as many times. Only callable from Numba code."""

    def codegen(context, builder, sig, args):
        builder.function.attributes.add("noinline")
        return context.get_dummy_value()

    return types.none(), codegen


def _codegen(trans_a):
    """Code of the product on raw pointers, dims and row strides (``trans_a``: a stored transposed,
    (K, M)), the arguments of ``_c_signature``."""

    def codegen(context, builder, sig, args):
        (a_data, m, kdim, sa, b_data, sb, c_data, n, sc, beta_v, kband_v, nband_v, b2_data, sb2, ksplit, rs_data,
         scaled_v) = args
        fty = context.get_data_type(sig.args[0].dtype)
        size = context.get_abi_sizeof(fty)
        lanes = _vector_bytes(context) // size
        wide = lanes * size == 64  # AVX-512: 32 vector registers (AVX2: 16)
        vec = ir.VectorType(fty, lanes)
        i64, i32 = context.get_value_type(types.intp), ir.IntType(32)
        accumulate_v = builder.fcmp_unordered("!=", beta_v, ir.Constant(fty, 0.0))
        scaled = builder.icmp_signed("!=", scaled_v, ir.Constant(scaled_v.type, 0))

        def const(x):
            return ir.Constant(i64, x)

        def ptr(base, stride, row, col, ty):
            return builder.bitcast(builder.gep(base, [builder.add(builder.mul(row, stride), col)]), ty.as_pointer())

        def a_ptr(i, kk):
            return ptr(a_data, sa, kk, i, fty) if trans_a else ptr(a_data, sa, i, kk, fty)

        def splat(x, ty):
            undef = ir.Constant(ty, ir.Undefined)
            return builder.shuffle_vector(builder.insert_element(undef, x, ir.Constant(i32, 0)), undef,
                                          ir.Constant(ir.VectorType(i32, ty.count), [0] * ty.count))

        def smaller(x, y):
            return builder.select(builder.icmp_signed("<", x, y), x, y)

        def larger(x, y):
            return builder.select(builder.icmp_signed(">", x, y), x, y)

        def band(limit, base, r0, rows, align=1):
            """min(limit, base + r0 + rows rounded up to a multiple of align) when base >= 0, else limit."""
            end = builder.add(builder.add(base, r0), const(rows + align - 1))
            end = builder.mul(builder.sdiv(end, const(align)), const(align))
            clipped = builder.select(builder.icmp_signed("<", end, limit), end, limit)
            return builder.select(builder.icmp_signed(">=", base, const(0)), clipped, limit)

        def tile(r0, rows, j0, nvec, kstart, kend, left=None):
            """c[r0:r0+rows, j0:j0+nvec*lanes]: accumulators in registers over kstart <= k < kend. With
            ``left`` (one vector, fewer columns than a vector left): only those columns, through masked
            loads and stores."""
            ty, width = vec, lanes
            load, store = masked_access(builder, ty, None if left is None else lane_mask(builder, left, width), size)

            accs = [[cgutils.alloca_once_value(builder, ir.Constant(ty, None)) for _ in range(nvec)]
                    for _ in range(rows)]
            # B's rows below ksplit are b's, the others b2's (from its first): a loop over each part (the
            # product with A transposed is never stacked nor scaled: one loop, no factors, less to compile)
            parts = [(b_data, sb, kstart, kend, const(0))]
            if not trans_a:
                parts = [(b_data, sb, kstart, smaller(kend, ksplit), const(0)),
                         (b2_data, sb2, larger(kstart, ksplit), kend, ksplit)]
            for base, stride, k0, k1, shift in parts:
                with cgutils.for_range_slice(builder, k0, k1, const(1)) as (kk, _):
                    row = builder.sub(kk, shift)
                    bv = [load(ptr(base, stride, row, builder.add(j0, const(j * width)), ty)) for j in range(nvec)]
                    for i in range(rows):
                        ai = splat(builder.load(a_ptr(builder.add(r0, const(i)), kk), align=size), ty)
                        for j in range(nvec):
                            acc = accs[i][j]
                            prod = builder.fmul(ai, bv[j], flags=_FLAGS)
                            builder.store(builder.fadd(builder.load(acc), prod, flags=_FLAGS), acc)
            if not trans_a:
                with builder.if_then(scaled):  # rows times their factors
                    for i in range(rows):
                        f = splat(builder.load(builder.gep(rs_data, [builder.add(r0, const(i))])), ty)
                        for j in range(nvec):
                            builder.store(builder.fmul(builder.load(accs[i][j]), f, flags=_FLAGS), accs[i][j])
            for i in range(rows):
                for j in range(nvec):
                    p = ptr(c_data, sc, builder.add(r0, const(i)), builder.add(j0, const(j * width)), ty)
                    total = builder.load(accs[i][j])
                    with builder.if_then(accumulate_v):
                        old = builder.fmul(splat(beta_v, ty), load(p), flags=_FLAGS)
                        builder.store(builder.fadd(old, total, flags=_FLAGS), accs[i][j])
                    store(builder.load(accs[i][j]), p)

        def row_blocks(start, stop, rows):
            """Tiles of ``rows`` rows over [start, the last multiple of rows below stop), each row's
            columns in panels of two vectors, then one, then one masked vector; returns that end."""
            step = const(rows)
            end = builder.add(start, builder.mul(builder.sdiv(builder.sub(stop, start), step), step))
            with cgutils.for_range_slice(builder, start, end, step) as (r0, _):
                if trans_a:  # a band: a lower triangular, each tile's inner dimension starts at its first row
                    kstart = builder.select(builder.icmp_signed(">=", kband_v, const(0)), r0, const(0))
                    kend = kdim
                else:
                    kstart, kend = const(0), band(kdim, kband_v, r0, rows)
                nend = band(n, nband_v, r0, rows, lanes)  # whole vectors: the caller zeroes the triangle
                col = const(0)
                for nvec in (2, 1):
                    cstep = const(nvec * lanes)
                    cend = builder.add(col, builder.mul(builder.sdiv(builder.sub(nend, col), cstep), cstep))
                    with cgutils.for_range_slice(builder, col, cend, cstep) as (j0, _):
                        tile(r0, rows, j0, nvec, kstart, kend)
                    col = cend
                left = builder.sub(nend, col)  # fewer columns than a vector: one masked vector
                with builder.if_then(builder.icmp_signed(">", left, const(0))):
                    tile(r0, rows, col, 1, kstart, kend, left)
            return end

        end = const(0)
        for rows in _stages(wide):
            end = row_blocks(end, m, rows)
        return context.get_dummy_value()

    return codegen
