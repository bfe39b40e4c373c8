"""Work distribution inside the parallel kernels: a shared counter that threads take work items from.

Numba's ``prange`` under the OpenMP layer splits the iterations between threads in advance (a static
schedule, whatever ``numba.set_parallel_chunksize`` says), so one thread that starts late or runs
on a core shared with another program holds up the whole call with its fixed share. The kernels
instead run one ``prange`` iteration per thread, and each thread takes the next work item from an
atomic counter until none are left: a slowed thread simply does fewer items.
"""
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic


@intrinsic
def take(typingctx, counter):
    """Atomically ``counter[0] += 1`` and return the value before (an int64 array of one element).
    Only callable from Numba code."""
    if not (isinstance(counter, types.Array) and counter.ndim == 1 and counter.dtype == types.int64):
        return None
    sig = types.int64(counter)

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], arr, [context.get_constant(types.intp, 0)])
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "monotonic")

    return sig, codegen
