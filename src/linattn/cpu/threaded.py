"""Parallel kernels built from a worker compiled once on its own and a small parallel loop that calls
it by address, so that the worker's code is optimised and emitted once, not again at every level.

A chunk kernel's parallel loop used to call its worker (one thread's share: work items taken from a
shared counter) directly. Numba links a callee's code into its caller and optimises and emits it again
there; a ``prange`` adds four such levels (the loop's gufunc, two wrappers, the kernel), so the worker's
code, the largest part of a kernel, was compiled six times: about 1.4 s each, measured (issue 11).
Called by address, it is compiled once, as a kernel of its own (cached on disk like the others), and
the loop around it compiles in a fraction of a second.
"""
import numpy as np
from numba import prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from .._jit import Kernel, array, njit, renamed

_COUNTER = array(types.int64, 1)


@intrinsic
def _call(typingctx, address, args, counter):
    """Call the compiled worker at ``address`` (an int64) with the elements of the tuple ``args`` and
    ``counter``; an exception it raises propagates as from a direct call."""
    argtys = tuple(args.types) + (counter,)

    def codegen(context, builder, sig, llargs):
        addr, tup, cnt = llargs
        values = [builder.extract_value(tup, i) for i in range(len(args.types))] + [cnt]
        fnty = context.call_conv.get_function_type(types.void, argtys)
        callee = builder.inttoptr(addr, fnty.as_pointer())
        status, _ = context.call_conv.call_function(builder, callee, types.void, argtys, values)
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return types.void(address, args, counter), codegen


def _run_threads(address, nthreads, args):
    """Run the worker at ``address`` on ``nthreads`` threads (the caller sets Numba's number of threads
    to it: one prange iteration per thread), all taking items from one counter; with one thread, the
    calling thread runs it and wakes no other."""
    counter = np.empty(1, np.int64)  # np.zeros would become a parallel loop (a parfor) of its own
    counter[0] = 0
    if nthreads <= 1:
        _call(address, args, counter)
    else:
        for _ in prange(nthreads):
            _call(address, args, counter)


_RUN_THREADS = renamed(_run_threads, parallel=True)


class ThreadedKernel(Kernel):
    """A kernel run as ``kernel.get(dtype, variant)(nthreads, *args)``: ``worker(*args, counter)`` is one
    thread's share (it takes work items from ``counter``, an int64 array of one element, until none are
    left); ``signature(numba_dtype, variant)`` gives the types of ``args``. See Kernel."""

    def _build(self, sig):
        worker = njit(signature=types.void(*sig.args, _COUNTER))(self.py_func)
        compiled = worker.overloads[worker.signatures[0]]
        address = compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)
        loop = njit(parallel=True, signature=types.void(types.int64, types.int64, types.Tuple(sig.args)))(
            _RUN_THREADS)

        def run(nthreads, *args):
            if nthreads <= 1:  # the worker itself: the loop's tuple of arguments is typed in Python (~1 us)
                worker(*args, np.zeros(1, np.int64))
            else:
                loop(address, nthreads, args)

        run.worker, run.loop = worker, loop  # (the worker keeps its code alive)
        # the worker's compiled entry point: a call with no type dispatch (~1 us less); the caller must
        # pass exactly the signature's types (arrays of its dtypes and dimensions), unchecked
        run.unchecked = compiled.entry_point
        return run
