"""The state pass of a decoding step written with explicit LLVM vector types.

LLVM's loop vectoriser turns the pass into loops that load and store the output row once per row of
S (the row loop is outside the column loop); here the column loop is outside, a panel of columns is
kept in vector registers across all rows of S, and each element of S is loaded and stored once:
half the memory operations, and independent accumulator chains so FMA latency does not serialise.
"""
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

#: Vectors per panel: independent accumulator chains (hides the FMA latency).
PANEL = 4
_FLAGS = ("contract", "reassoc", "nsz", "arcp")


#: Bytes per vector: 512 bits (LLVM splits the vectors where the CPU has narrower ones).
VECTOR_BYTES = 64


@intrinsic
def state_pass(typingctx, S, v, q, k, out, row_stride):
    """For every row a and column e of S (D' x Dv, rows ``row_stride`` elements apart, unit column
    stride): S[a, e] += k[a] v[e], then out[e] = sum_a q[a] S[a, e].

    v, q, k and out must have unit stride. Columns go in panels of PANEL vectors, then single vectors,
    then one at a time. Only callable from Numba code.
    """
    if not (isinstance(S, types.Array) and S.ndim == 2 and S.dtype in (types.float32, types.float64)):
        return None
    if not all(isinstance(x, types.Array) and x.ndim == 1 and x.dtype == S.dtype for x in (v, q, k, out)):
        return None
    sig = types.void(S, v, q, k, out, row_stride)

    def codegen(context, builder, sig, args):
        s_arr, v_arr, q_arr, k_arr, o_arr = (context.make_array(t)(context, builder, a)
                                             for t, a in zip(sig.args[:5], args[:5]))
        stride_v = args[5]
        fty = context.get_data_type(sig.args[0].dtype)
        width = VECTOR_BYTES // context.get_abi_sizeof(fty)
        vec = ir.VectorType(fty, width)
        i32, i64 = ir.IntType(32), ir.IntType(64)
        align = context.get_abi_sizeof(fty)
        rows = builder.extract_value(s_arr.shape, 0)
        ncols = builder.extract_value(s_arr.shape, 1)
        undef = ir.Constant(vec, ir.Undefined)
        zero_mask = ir.Constant(ir.VectorType(i32, width), [0] * width)

        def at(base, idx, ty):
            return builder.bitcast(builder.gep(base, [idx]), ty.as_pointer())

        def splat(base, idx, ty):
            x = builder.load(builder.gep(base, [idx]))
            if ty is fty:
                return x
            return builder.shuffle_vector(builder.insert_element(undef, x, ir.Constant(i32, 0)), undef, zero_mask)

        def fma(x, y, z):
            return builder.fadd(builder.fmul(x, y, flags=_FLAGS), z, flags=_FLAGS)

        def panel(e0, nvec, ty):
            """Columns [e0, e0 + nvec * lanes of ty): accumulators live in registers over all rows."""
            lanes = ty.count if ty is vec else 1
            cols = [builder.add(e0, ir.Constant(i64, j * lanes)) for j in range(nvec)]
            vv = [builder.load(at(v_arr.data, c, ty), align=align) for c in cols]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(ty, None)) for _ in cols]
            with cgutils.for_range(builder, rows) as loop:
                ka, qa = splat(k_arr.data, loop.index, ty), splat(q_arr.data, loop.index, ty)
                row = builder.mul(loop.index, stride_v)
                for c, x, acc in zip(cols, vv, accs):
                    p = at(s_arr.data, builder.add(row, c), ty)
                    s = fma(ka, x, builder.load(p, align=align))
                    builder.store(s, p, align=align)
                    builder.store(fma(qa, s, builder.load(acc)), acc)
            for c, acc in zip(cols, accs):
                builder.store(builder.load(acc), at(o_arr.data, c, ty), align=align)

        def columns(start, stop, nvec, ty):
            """Panels over [start, the last multiple of their width below stop); returns that end."""
            step = ir.Constant(i64, nvec * (ty.count if ty is vec else 1))
            end = builder.add(start, builder.mul(builder.udiv(builder.sub(stop, start), step), step))
            with cgutils.for_range_slice(builder, start, end, step) as (e0, _):
                panel(e0, nvec, ty)
            return end

        end = columns(ir.Constant(i64, 0), ncols, PANEL, vec)
        end = columns(end, ncols, 1, vec)
        columns(end, ncols, 1, fty)
        return context.get_dummy_value()

    return sig, codegen
