"""Parallel kernels built from a worker compiled once on its own and a small parallel loop that calls
it by address, so that the worker's code is optimised and emitted once, not again at every level.

A chunk kernel's parallel loop used to call its worker (one thread's share: work items taken from a
shared counter) directly. Numba links a callee's code into its caller and optimises and emits it again
there; a ``prange`` adds four such levels (the loop's gufunc, two wrappers, the kernel), so the worker's
code, the largest part of a kernel, was compiled six times: about 1.4 s each, measured (issue 11).
Called by address, it is compiled once, as a kernel of its own (cached on disk like the others).

The parallel loop itself is one compiled function for every kernel (``_run_generic``: three integers,
compiled once and then loaded from the disk cache): a ``prange`` over a kernel's own tuple of
arguments cost 1.1-1.5 s of compilation per kernel, most of it in passing the tuple through the
loop's gufunc. Per kernel there are two small functions instead (~0.5 s together): ``_launch``, which
takes the arguments from Python and leaves them in its frame, and ``_trampoline``, which each thread
runs to read them from there and call the worker.
"""
import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from .._jit import Kernel, array, njit, renamed_for
from .buffers import empty

_COUNTER = array(types.int64, 1)


def _emit_call(context, builder, address, argtys, values):
    """Call the compiled function at ``address`` (Numba's calling convention, no result) with ``values``
    of types ``argtys``; an exception it raises propagates to the caller."""
    fnty = context.call_conv.get_function_type(types.void, argtys)
    callee = builder.inttoptr(address, fnty.as_pointer())
    status, _ = context.call_conv.call_function(builder, callee, types.void, argtys, values)
    with cgutils.if_unlikely(builder, status.is_error):
        context.call_conv.return_status_propagate(builder, status)
    return context.get_dummy_value()


@intrinsic
def _call(typingctx, address, args, counter):
    """Call the compiled worker at ``address`` (an int64) with the elements of the tuple ``args`` and
    ``counter``; an exception it raises propagates as from a direct call."""
    argtys = tuple(args.types) + (counter,)

    def codegen(context, builder, sig, llargs):
        addr, tup, cnt = llargs
        values = [builder.extract_value(tup, i) for i in range(len(args.types))] + [cnt]
        return _emit_call(context, builder, addr, argtys, values)

    return types.void(address, args, counter), codegen


@intrinsic
def _call_recorded(typingctx, address, args, counter):
    """``_call``, and where the worker fails, its return code and exception recorded in counter[1],
    counter[2] (the first failure's): a failure on any thread but the calling one would be lost, as
    Numba's parallel loop propagates only the calling thread's (see ``_raise_recorded``)."""
    argtys = tuple(args.types) + (counter,)

    def codegen(context, builder, sig, llargs):
        addr, tup, cnt = llargs
        values = [builder.extract_value(tup, i) for i in range(len(args.types))] + [cnt]
        fnty = context.call_conv.get_function_type(types.void, argtys)
        callee = builder.inttoptr(addr, fnty.as_pointer())
        status, _ = context.call_conv.call_function(builder, callee, types.void, argtys, values)
        with cgutils.if_unlikely(builder, status.is_error):
            arr = context.make_array(counter)(context, builder, cnt)
            i64 = ir.IntType(64)
            slot = cgutils.get_item_pointer(context, builder, counter, arr, [context.get_constant(types.intp, 1)])
            first = builder.cmpxchg(slot, ir.Constant(i64, 0), builder.sext(status.code, i64), "monotonic",
                                    "monotonic")
            with builder.if_then(builder.extract_value(first, 1)):
                where = cgutils.get_item_pointer(context, builder, counter, arr, [context.get_constant(types.intp, 2)])
                builder.store(builder.ptrtoint(status.excinfoptr, i64), where)
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return types.void(address, args, counter), codegen


@intrinsic
def _raise_recorded(typingctx, counter):
    """Return with the failure recorded in counter[1], counter[2] by ``_call_recorded``, if any."""

    def codegen(context, builder, sig, llargs):
        arr = context.make_array(counter)(context, builder, llargs[0])
        code = builder.load(cgutils.get_item_pointer(context, builder, counter, arr,
                                                     [context.get_constant(types.intp, 1)]))
        with cgutils.if_unlikely(builder, builder.icmp_signed("!=", code, ir.Constant(code.type, 0))):
            exc = builder.load(cgutils.get_item_pointer(context, builder, counter, arr,
                                                        [context.get_constant(types.intp, 2)]))
            cc = context.call_conv
            builder.store(builder.inttoptr(exc, cc._get_excinfo_argument(builder.function).type.pointee),
                          cc._get_excinfo_argument(builder.function))
            cc._return_errcode_raw(builder, builder.trunc(code, ir.IntType(32)))
        return context.get_dummy_value()

    return types.void(counter), codegen


@intrinsic
def _call_loop(typingctx, address, tramp, payload, nthreads):
    """Call the compiled parallel loop ``_run_generic`` at ``address``."""
    argtys = (types.int64,) * 3

    def codegen(context, builder, sig, llargs):
        return _emit_call(context, builder, llargs[0], argtys, list(llargs[1:]))

    return types.void(address, tramp, payload, nthreads), codegen


@intrinsic
def _address_of(typingctx, value):
    """The address (int64) of a copy of ``value`` in the calling function's stack frame: valid until
    that function returns (it waits for the threads that read it)."""

    def codegen(context, builder, sig, llargs):
        slot = cgutils.alloca_once_value(builder, llargs[0])
        return builder.ptrtoint(slot, context.get_value_type(types.int64))

    return types.int64(value), codegen


@intrinsic
def _load(typingctx, pointer):
    """The value at ``pointer`` (a CPointer), as ``_address_of`` stored it: a new reference (the caller
    releases its arrays at its end, as for any value it makes)."""

    def codegen(context, builder, sig, llargs):
        ptr = builder.bitcast(llargs[0], context.get_value_type(pointer.dtype).as_pointer())
        value = builder.load(ptr)
        context.nrt.incref(builder, pointer.dtype, value)
        return value

    return pointer.dtype(pointer), codegen


def _run_generic(tramp, payload, nthreads):
    """Run ``tramp(payload, counter)`` (a compiled trampoline's address) on ``nthreads`` threads (the
    caller sets Numba's number of threads to it: one prange iteration per thread), all taking items
    from one counter. One compiled loop for every kernel: parallel loops over a kernel's own argument
    types cost 1.1-1.5 s to compile per kernel (most of it in passing the tuple through the loop's
    gufunc), this one is compiled once and loaded from the disk cache after."""
    counter = empty(3, np.int64)  # np.zeros would become a parallel loop (a parfor) of its own
    counter[0] = counter[1] = counter[2] = 0  # the next item; a failed worker's code and exception
    for _ in prange(nthreads):
        _call(tramp, (payload,), counter)
    _raise_recorded(counter)  # (a failure on another thread than this one)


def _trampoline(payload, counter):
    """One thread's share: the worker's address and arguments from ``payload`` (a pointer to them,
    stored by ``_launch``), then the worker."""
    address, args = _load(payload)
    _call_recorded(address, args, counter)


def _launch(address, nthreads, args, loop, tramp):
    """Run the worker at ``address`` with ``args`` on ``nthreads`` threads: the arguments stay in this
    frame, the generic loop (at ``loop``) runs the trampoline (at ``tramp``) on each thread."""
    _call_loop(loop, tramp, _address_of((address, args)), nthreads)


_generic = []  # the generic loop's compiled dispatcher and address, once compiled or loaded


def _address(dispatcher):
    """(compiled result, address) of the one compiled function of ``dispatcher`` (given a signature)."""
    compiled = dispatcher.overloads[dispatcher.signatures[0]]
    return compiled, compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)


def _generic_loop():
    """(dispatcher, address) of ``_run_generic``."""
    if not _generic:
        sig = types.void(types.int64, types.int64, types.int64)
        loop = njit(parallel=True, signature=sig)(renamed_for(_run_generic, True, sig))
        _generic.append((loop, _address(loop)[1]))
    return _generic[0]


class ThreadedKernel(Kernel):
    """A kernel run as ``kernel.get(dtype, variant)(nthreads, *args)``: ``worker(*args, counter)`` is one
    thread's share (it takes work items from ``counter``, an int64 array of one element, until none are
    left); ``signature(numba_dtype, variant)`` gives the types of ``args``. See Kernel."""

    def _build(self, sig):
        worker_sig = types.void(*sig.args, _COUNTER)
        worker = njit(signature=worker_sig)(self.named(worker_sig))
        compiled, address = _address(worker)
        args = types.Tuple(sig.args)
        loop, loop_address = _generic_loop()
        tramp_sig = types.void(types.CPointer(types.Tuple((types.int64, args))), _COUNTER)
        tramp = njit(signature=tramp_sig, wrappers=False)(renamed_for(_trampoline, False, tramp_sig))
        tramp_address = _address(tramp)[1]
        launch_sig = types.void(types.int64, types.int64, args, types.int64, types.int64)
        launch = njit(signature=launch_sig)(renamed_for(_launch, False, launch_sig))

        def run(nthreads, *args):
            if nthreads <= 1:  # the worker itself: the launcher's tuple of arguments is typed in Python (~1 us)
                worker(*args, np.zeros(1, np.int64))
            else:
                try:
                    launch(address, nthreads, args, loop_address, tramp_address)
                except SystemError as exc:  # a worker's exception in the parallel region: Numba returns
                    if exc.__cause__ is None:  # with it set, and Python wraps it
                        raise
                    raise exc.__cause__ from None

        run.worker, run.launch, run.trampoline = worker, launch, tramp  # (they keep their code alive)
        # the worker's compiled entry point: a call with no type dispatch (~1 us less); the caller must
        # pass exactly the signature's types (arrays of its dtypes and dimensions), unchecked
        run.unchecked = compiled.entry_point
        return run
