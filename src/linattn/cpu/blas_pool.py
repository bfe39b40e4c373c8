"""NumPy's and SciPy's OpenBLAS run their threaded work on Numba's thread pool, the pool of linattn's
kernels: one pool instead of two that fight for the cores.

Why: after each threaded call (a model's projection right before attention) OpenBLAS's worker
threads keep spinning for about 0.1 s, one per core, on the cores the attention kernel needs next:
measured 1.9-2.1x the kernel's time alone on two cores. OpenBLAS (0.3.27 and later) lets a program
supply its own threads (``openblas_set_threads_callback_function``); linattn passes a compiled
callback that runs OpenBLAS's jobs on Numba's OpenMP pool. NumPy's results do not change (the same
jobs, the same buffers) and its speed neither (measured; the pool then keeps GNU OpenMP's usual
idle spin, as OpenBLAS's own threads did). A BLAS without the callback (MKL, BLIS, Accelerate,
older OpenBLAS) is left as it is; ``LINATTN_SHARE_BLAS_THREADS=0`` leaves every BLAS as it is;
``python -m linattn info`` says which libraries share the pool.

The callback holds a mutex while it runs (OpenBLAS's per-thread buffers are indexed by job, so two
threaded calls at once would share them), and a forked child gets OpenBLAS's own threads back (GNU
OpenMP does not survive fork()).
"""
import ctypes
import os

import numpy as np
from llvmlite import ir
from numba import cfunc, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .._jit import njit

#: Symbol-name variants of the callback setter: plain, SciPy's wheels' prefix, 64-bit-integer suffixes.
_SETTERS = [f"{p}openblas_set_threads_callback_function{s}" for p in ("", "scipy_") for s in ("", "64_", "_64")]

_installed = {}  # library path -> the ctypes setter (to undo it in forked children)
_fork_hook = False


def _mutex(builder):
    """Pointer to a process-wide pthread mutex: a zeroed global of the compiled module (zero is
    PTHREAD_MUTEX_INITIALIZER on Linux), so the compiled callback can be cached on disk."""
    mod = builder.module
    name = "linattn_blas_pool_mutex"
    try:
        gv = mod.get_global(name)
    except KeyError:
        gv = ir.GlobalVariable(mod, ir.ArrayType(ir.IntType(8), 64), name)
        gv.linkage = "internal"
        gv.initializer = ir.Constant(gv.type.pointee, None)
        gv.align = 64
    return builder.bitcast(gv, ir.IntType(8).as_pointer())


def _libc_call(builder, name, *args):
    fnty = ir.FunctionType(ir.IntType(32), [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


@intrinsic
def _lock(typingctx):
    def codegen(context, builder, sig, args):
        _libc_call(builder, "pthread_mutex_lock", _mutex(builder))
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _unlock(typingctx):
    def codegen(context, builder, sig, args):
        _libc_call(builder, "pthread_mutex_unlock", _mutex(builder))
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _dojob(typingctx, fn, job, data, dojob_data):
    """Call OpenBLAS's ``void dojob(int thread_num, void *jobdata, int dojob_data)`` at address fn."""
    sig = types.void(types.intp, types.int32, types.intp, types.int32)

    def codegen(context, builder, sig, args):
        i32, i8p = ir.IntType(32), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i32, i8p, i32])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [args[1], builder.inttoptr(args[2], i8p), args[3]])
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True)
def _run_jobs(dojob, numjobs, elsize, jobdata, dojob_data):
    """Run OpenBLAS's jobs 0..numjobs-1 on Numba's threads (the calling thread's number of them)."""
    for i in prange(numjobs):
        _dojob(dojob, np.int32(i), jobdata + i * elsize, dojob_data)


# void callback(int sync, dojob, int numjobs, size_t jobdata_elsize, void *jobdata, int dojob_data)
_SIGNATURE = types.void(types.int32, types.intp, types.int32, types.intp, types.intp, types.int32)


def _callback(sync, dojob, numjobs, elsize, jobdata, dojob_data):
    _lock()
    if numjobs == 1:
        _dojob(dojob, np.int32(0), jobdata, dojob_data)
    else:
        _run_jobs(dojob, numjobs, elsize, jobdata, dojob_data)
    _unlock()


_compiled = None


def _address():
    """Address of the compiled callback (compiled on first use, then loaded from Numba's cache)."""
    global _compiled
    if _compiled is None:
        try:
            _compiled = cfunc(_SIGNATURE, cache=True, nogil=True)(_callback)
        except RuntimeError as exc:  # no writable cache directory: compile in this process
            if "cannot cache" not in str(exc):
                raise
            _compiled = cfunc(_SIGNATURE, nogil=True)(_callback)
    return _compiled.address


def _setter(path):
    """The callback setter of the OpenBLAS at ``path``, or None (another BLAS, an older OpenBLAS)."""
    try:
        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    for name in _SETTERS:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_void_p], None
            return fn
    return None


def sharable(libraries):
    """{path: True when that OpenBLAS has the callback setter} for the given library paths (all False
    when ``LINATTN_SHARE_BLAS_THREADS=0``)."""
    enabled = os.environ.get("LINATTN_SHARE_BLAS_THREADS", "1").strip().lower() not in ("0", "false", "no", "off")
    return {path: enabled and _setter(path) is not None for path in libraries}


def share(libraries):
    """Run the threaded work of these OpenBLAS libraries (paths from ``sharable``) on Numba's pool,
    which must be running; returns {path: True} for those that now share it."""
    global _fork_hook
    for path in libraries:
        setter = _setter(path)
        if setter is not None and path not in _installed:
            setter(_address())
            _installed[path] = setter
    if _installed and not _fork_hook:
        os.register_at_fork(after_in_child=_unshare)
        _fork_hook = True
    return shared()


def _unshare():
    """Give every library its own threads back (in a forked child: GNU OpenMP does not survive fork)."""
    for setter in _installed.values():
        setter(None)
    _installed.clear()


def shared():
    """{path: True} for each OpenBLAS library whose threaded work runs on Numba's pool."""
    return {path: True for path in _installed}
