"""``empty`` and ``zeros`` for the kernels' scratch arrays, allocated by code written into the kernel
itself (and ``one_of``, a dtype's 1, for the same reason).

``np.empty`` in a kernel goes through NumPy's overload, which Numba compiles as a library of its own
(typed, optimised, emitted) for every pattern of arguments it meets: 11 of them in a gated forward,
0.6 s of its cold first call, and ``np.zeros`` 0.2 s more. These intrinsics emit the allocation
(Numba's own ``_empty_nd_impl``, as ``np.empty`` ends up doing) at the call site instead. Sizes must
not be negative (unchecked: the kernels compute them). The BLAS pool's callback allocates the same way
(cpu/blas_pool.py: three overloads, ~0.3 s of a process's first call).
"""
from numba.core import cgutils, types
from numba.core.imputils import impl_ret_new_ref
from numba.extending import intrinsic
from numba.np.arrayobj import _empty_nd_impl


def _array_type(shape, dtype):
    """The C-contiguous array type for a shape (an integer or a tuple of integers) and a dtype (a
    NumPy scalar type or an array's dtype), or None."""
    if isinstance(shape, types.Integer):
        ndim = 1
    elif isinstance(shape, types.BaseTuple) and all(isinstance(x, types.Integer) for x in shape):
        ndim = len(shape)
    else:
        return None
    if not isinstance(dtype, (types.NumberClass, types.DType)):
        return None
    return types.Array(dtype.dtype, ndim, "C")


def _allocate(context, builder, sig, args, zero):
    shape_type, arrty = sig.args[0], sig.return_type
    if isinstance(shape_type, types.Integer):
        values, value_types = [args[0]], [shape_type]
    else:
        values, value_types = cgutils.unpack_tuple(builder, args[0]), list(shape_type)
    shapes = [context.cast(builder, v, t, types.intp) for v, t in zip(values, value_types)]
    ary = _empty_nd_impl(context, builder, arrty, shapes)
    if zero:
        size = ary.itemsize
        for n in shapes:
            size = builder.mul(size, n)
        cgutils.memset(builder, ary.data, size, 0)
    return impl_ret_new_ref(context, builder, arrty, ary._getvalue())


def _allocator(name, zero, doc):
    """The intrinsic ``name(shape, dtype)``: a new array, zeroed when ``zero``."""

    def typer(typingctx, shape, dtype):
        arrty = _array_type(shape, dtype)
        if arrty is None:
            return None
        return arrty(shape, dtype), lambda context, builder, sig, args: _allocate(context, builder, sig, args, zero)

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


empty = _allocator("empty", False, "np.empty(shape, dtype) in a kernel (see the module). Only from Numba code.")
zeros = _allocator("zeros", True, "np.zeros(shape, dtype) in a kernel (see the module). Only from Numba code.")


@intrinsic
def one_of(typingctx, dtype):
    """1 in ``dtype`` (a NumPy dtype or scalar type): ``np.ones(1, dtype)[0]`` without NumPy's overloads
    compiled (see the module). Only from Numba code."""
    if not isinstance(dtype, (types.NumberClass, types.DType)):
        return None
    return dtype.dtype(dtype), lambda context, builder, sig, args: context.get_constant(sig.return_type, 1)
