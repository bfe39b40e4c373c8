"""How the kernels read strided inputs: ``as_contiguous`` (a 1-D view with unit stride, typed as such
so that loops over it vectorise), ``unowned`` (an array whose views are not reference counted) with
``keep_alive`` (for its owner), ``flat_rows`` (adjacent rows as one such view),
``head_row``/``head_matrix`` (the row or matrix of one head of an array with any number of leading
dims, by its flat index), ``touch_rows`` and ``prefetch_rows_for_writing`` (rows into the cache ahead of use),
``span`` (the bytes from an array's first element to its last); on the
Python side ``unit_rows``, which gives the kernels arrays whose rows are unit-stride.

Kernels on strided inputs (the heads of a fused QKV projection) get arrays of Numba's "A" layout,
whose every stride is known only at run time: LLVM then reads them an element at a time. A row
whose elements are adjacent (the caller checks ``strides[-1] == itemsize``) can be typed as a
C-contiguous array: the same pointer, shape and strides, only the compile-time type changes.
"""
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic, overload
from numba.np.unsafe.ndarray import to_fixed_tuple

from .. import workspace
from .._jit import OVERLOAD_OPTIONS


def unit_rows(x):
    """x, or a copy of it (pooled) where its rows are not unit-stride: the kernels read a row of such
    an array element by element, each from a cache line (a page, for a Fortran-ordered array) of its
    own: B1 H8 N2048 D64 float32 took 54 ms with rows N elements apart, 200 ms Fortran-ordered,
    against 9.5 and 7.4 ms copied first (the plain call: 5 ms); every other element, 6.8 against 5.3."""
    if x.strides[-1] == x.itemsize or x.shape[-1] <= 1 or x.size == 0:  # (NumPy gives empty arrays any strides)
        return x
    copy = workspace.empty(x.shape, x.dtype)
    np.copyto(copy, x)
    return copy


@intrinsic
def as_contiguous(typingctx, x):
    """x (1-D, any layout) typed as C-contiguous; x's stride must be its itemsize (unchecked).
    Only callable from Numba code."""
    if not (isinstance(x, types.Array) and x.ndim == 1):
        return None
    ret = x.copy(layout="C")
    sig = ret(x)

    def codegen(context, builder, sig, args):
        return impl_ret_borrowed(context, builder, sig.return_type, args[0])

    return sig, codegen


def _unowned_ok(t, inner=False):
    return (isinstance(t, types.Array) or (inner and isinstance(t, (types.Number, types.NoneType)))
            or (isinstance(t, types.BaseTuple) and all(_unowned_ok(x, True) for x in t)))


@intrinsic
def unowned(typingctx, x):
    """x (an array, or a tuple of arrays, numbers, None and such tuples) without its memory's owner (a null meminfo):
    the same data, shape and strides, and views of it are not reference counted. Every view Numba
    makes of an owned array adds and drops a reference with an atomic add (~20 cycles; the kernels'
    per-row views made that ~20% of a chunk's time, seen with perf). The caller keeps the owner alive
    for as long as the result is used (the kernel's arguments; ``keep_alive`` for its buffers). Only
    callable from Numba code."""
    if not _unowned_ok(x):
        return None

    def strip(context, builder, ty, value):
        if isinstance(ty, types.Array):
            arr = context.make_array(ty)(context, builder, value)
            out = context.make_array(ty)(context, builder)
            context.populate_array(out, data=arr.data, shape=arr.shape, strides=arr.strides, itemsize=arr.itemsize,
                                   meminfo=None)
            return out._getvalue()
        if isinstance(ty, (types.Number, types.NoneType)):
            return value
        items = [strip(context, builder, t, builder.extract_value(value, i)) for i, t in enumerate(ty)]
        return context.make_tuple(builder, ty, items)

    return x(x), lambda context, builder, sig, args: strip(context, builder, sig.args[0], args[0])


@intrinsic
def keep_alive(typingctx, x):
    """Nothing; a use of x (an array or a tuple of them) here, so that Numba drops its reference after
    this point and not earlier (for the owners of ``unowned`` views). Only callable from Numba code."""
    return types.none(x), lambda context, builder, sig, args: context.get_dummy_value()


@intrinsic
def flat_rows(typingctx, x, i0, c):
    """Rows [i0, i0 + c) of the 2-D array x as one 1-D C-contiguous view of c * x.shape[1] elements
    starting at row i0; the rows must be adjacent in memory, each right after the previous one
    (strides (D * itemsize, itemsize); unchecked). Only callable from Numba code."""
    if not (isinstance(x, types.Array) and x.ndim == 2):
        return None
    ret = types.Array(x.dtype, 1, "C", readonly=not x.mutable)
    sig = ret(x, types.intp, types.intp)

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        out = context.make_array(sig.return_type)(context, builder)
        base = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
        start = builder.gep(base, [builder.mul(args[1], builder.extract_value(arr.strides, 0))])
        size = builder.mul(args[2], builder.extract_value(arr.shape, 1))
        context.populate_array(out, data=builder.bitcast(start, arr.data.type), shape=[size],
                               strides=[arr.itemsize], itemsize=arr.itemsize, meminfo=arr.meminfo, parent=arr.parent)
        return impl_ret_borrowed(context, builder, sig.return_type, out._getvalue())

    return sig, codegen


def _each_line(builder, arr, i0, c, visit):
    """Emit ``visit(pointer)`` for a byte in every 64-byte line of rows [i0, i0 + c) of the 2-D array
    ``arr`` (a Numba array struct): rows adjacent in memory as one run of bytes, rows apart (a head
    view of a fused projection) one run each; in a run every 64th byte from its first and its last
    byte. Nothing before a row's first element or after its last is visited."""
    i8p = ir.IntType(8).as_pointer()
    base = builder.bitcast(arr.data, i8p)
    row_stride, step = builder.extract_value(arr.strides, 0), builder.extract_value(arr.strides, 1)
    width, size = builder.extract_value(arr.shape, 1), arr.itemsize
    # a row's bytes from its first element's first byte to its last element's last one
    span = builder.add(builder.mul(builder.sub(width, ir.Constant(width.type, 1)), step), size)
    adjacent = builder.and_(builder.icmp_signed("==", step, size),
                            builder.icmp_signed("==", row_stride, builder.mul(width, size)))
    runs = builder.select(adjacent, ir.Constant(c.type, 1), c)
    adjacent_bytes = builder.add(builder.mul(builder.sub(c, ir.Constant(c.type, 1)), row_stride), span)
    run_bytes = builder.select(adjacent, adjacent_bytes, span)
    with cgutils.for_range(builder, runs) as run:
        start = builder.gep(base, [builder.mul(builder.add(i0, run.index), row_stride)])
        with cgutils.for_range_slice(builder, ir.Constant(run_bytes.type, 0), run_bytes,
                                     ir.Constant(run_bytes.type, 64)) as (off, _):
            visit(builder.gep(start, [off]))
        # the last byte: its line is skipped by the steps from an unaligned start
        with builder.if_then(builder.icmp_signed(">", run_bytes, ir.Constant(run_bytes.type, 0))):
            visit(builder.gep(start, [builder.sub(run_bytes, ir.Constant(run_bytes.type, 1))]))


def _rows_intrinsic(name, doc, emit):
    """An intrinsic ``name(x, i0, c)`` over rows [i0, i0 + c) of a 2-D array x: ``emit(context, builder,
    arr, i0, c)`` generates its code (it returns nothing)."""

    def typer(typingctx, x, i0, c):
        if not (isinstance(x, types.Array) and x.ndim == 2):
            return None

        def codegen(context, builder, sig, args):
            emit(context, builder, context.make_array(sig.args[0])(context, builder, args[0]), args[1], args[2])
            return context.get_dummy_value()

        return types.void(x, types.intp, types.intp), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


def _prefetch_for_writing(context, builder, arr, i0, c):
    """Code for llvm.prefetch of every line of the rows, for writing."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
    flags = [ir.Constant(i32, 1), ir.Constant(i32, 2), ir.Constant(i32, 1)]  # write, L2, data
    _each_line(builder, arr, i0, c, lambda p: builder.call(fn, [p] + flags))


def _touch(context, builder, arr, i0, c):
    """Code loading one byte of every line of the rows, the bytes or-ed together (an integer or: no
    chain of floating-point additions paces the loads) and the result handed to an empty inline
    assembly statement, a use the optimiser keeps, so that the loads stay."""
    i8 = ir.IntType(8)
    acc = cgutils.alloca_once_value(builder, ir.Constant(i8, 0))
    _each_line(builder, arr, i0, c, lambda p: builder.store(builder.or_(builder.load(acc), builder.load(p)), acc))
    builder.asm(ir.FunctionType(ir.VoidType(), [i8]), "", "r", [builder.load(acc)], True)


prefetch_rows_for_writing = _rows_intrinsic("prefetch_rows_for_writing", """Ask the CPU to fetch rows [i0, i0 + c)
    of the 2-D array x for writing (one prefetch per 64-byte line, the lines fetched for ownership; a hint:
    nothing is read or checked). Rows far apart, as in the head views of a fused QKV projection, are each
    on a page of their own, which the hardware's own prefetchers do not cross. Only callable from Numba
    code.""", _prefetch_for_writing)

touch_rows = _rows_intrinsic("touch_rows", """Load one byte of every 64-byte line of rows [i0, i0 + c) of the 2-D
    array x (unchecked: the rows must exist), so that they are in this core's caches before a chunk's
    products read them: real loads, issued back to back by a short loop, so that many are in flight at
    once. Where the rows are in memory or in the other core's cache (a call right after a NumPy
    matmul) this made the causal forward ~1.1x faster; llvm.prefetch hints at the same places, and
    one load per 128 or per 4096 bytes instead of per 64, did not help (docs/performance.md).
    Only callable from Numba code.""", _touch)


def head_row(x, h):
    """x[i, j, ..., :] for the flat index h over x's leading dims (C order), a 1-D view (None for
    None). Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


def head_matrix(x, h):
    """x[i, j, ..., :, :] for the flat index h over x's leading dims (C order), a 2-D view.
    Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


def _head_impl(lead):
    """The view of head h of an array with ``lead`` leading dims (a compile-time constant)."""
    if lead == 0:
        return lambda x, h: x
    if lead == 1:
        return lambda x, h: x[h]
    if lead == 2:
        return lambda x, h: x[h // x.shape[1], h % x.shape[1]]
    if lead == 3:
        return lambda x, h: x[h // (x.shape[1] * x.shape[2]), (h // x.shape[2]) % x.shape[1], h % x.shape[2]]

    def impl(x, h):
        idx = np.empty(lead, np.intp)
        idx[lead - 1] = h
        for i in range(lead - 1, 0, -1):  # (h itself is not rebound: inlined, that made Numba warn)
            idx[i - 1] = idx[i] // x.shape[i]
            idx[i] = idx[i] % x.shape[i]
        return x[to_fixed_tuple(idx, lead)]

    return impl


# Inlined in Numba's IR: left to LLVM, these were calls in the gated steps' per-head loop (its inliner
# gives up on a caller that size), ~55 ns per head each step (seen with perf on the JIT code): a B1 H8
# step with a decay took 4.8 instead of 4.0 us.
@overload(head_row, inline="always")
def _head_row(x, h):
    if isinstance(x, types.Array) and x.ndim >= 1:
        return _head_impl(x.ndim - 1)
    if isinstance(x, types.NoneType):
        return lambda x, h: None
    return None


@overload(head_matrix, inline="always")
def _head_matrix(x, h):
    if isinstance(x, types.Array) and x.ndim >= 2:
        return _head_impl(x.ndim - 2)
    return None


def head_scalar(x, h):
    """x[i, j, ...] for the flat index h over all of x's dims (C order): an element.
    Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(head_scalar, inline="always")
def _head_scalar(x, h):
    if not isinstance(x, types.Array):
        return None
    if x.ndim == 0:
        return lambda x, h: x[()]
    return _head_impl(x.ndim)


def span(x):
    """(first, end) byte addresses of array ``x``'s elements, from its data pointer, shape and strides;
    (0, 0) for None or an empty array (apart from everything). Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@intrinsic
def _address(typingctx, x):
    """x's data pointer as an int64 (``x.ctypes.data`` builds an object first)."""
    if not isinstance(x, types.Array):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))

    return types.int64(x), codegen


@overload(span, jit_options=OVERLOAD_OPTIONS)
def _span(x):
    if isinstance(x, types.NoneType):
        return lambda x: (np.int64(0), np.int64(0))
    if not isinstance(x, types.Array):
        return None

    def impl(x):
        if x.size == 0:
            return np.int64(0), np.int64(0)
        lo = _address(x)
        hi = lo + x.itemsize
        for i in range(x.ndim):
            ext = (x.shape[i] - 1) * x.strides[i]
            if ext < 0:
                lo += ext
            else:
                hi += ext
        return lo, hi
    return impl
