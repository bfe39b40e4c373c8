"""NumPy's and SciPy's OpenBLAS run their threaded work on Numba's thread pool, the pool of linattn's
kernels: one pool instead of two that fight for the cores.

Why: after each threaded call (a model's projection right before attention) OpenBLAS's worker
threads keep spinning for about 0.1 s, one per core, on the cores the attention kernel needs next:
measured 1.9-2.1x the kernel's time alone on two cores. OpenBLAS (0.3.27 and later) lets a program
supply its own threads (``openblas_set_threads_callback_function``); linattn passes a compiled
callback that runs OpenBLAS's jobs on Numba's OpenMP pool. NumPy's results do not change (the same
jobs, the same buffers) and its speed neither (measured; the pool then keeps GNU OpenMP's usual
idle spin, as OpenBLAS's own threads did). A BLAS without the callback (MKL, BLIS, Accelerate,
older OpenBLAS) is left as it is; ``LINATTN_SHARE_BLAS_THREADS=0`` leaves every BLAS as it is, and so
do platforms other than Linux and macOS (the callback compiles in their pthreads constants);
``python -m linattn info`` says which libraries share the pool.

The callback holds a mutex while it runs (OpenBLAS's per-thread buffers are indexed by job, so two
threaded calls at once would share them), and a forked child gets OpenBLAS's own threads back (GNU
OpenMP does not survive fork()).

OpenBLAS's jobs wait for each other (a threaded GEMM's jobs exchange packed panels): they must all
run at once, or the call never returns. Numba's pool runs them only where it has a thread for each:
the calling thread's number of Numba threads (``numba.set_num_threads``, ``NUMBA_NUM_THREADS``) may be
smaller than OpenBLAS's (``OPENBLAS_NUM_THREADS``, threadpoolctl), and a parallel region entered from
one of Numba's threads (a BLAS call inside a user's ``prange``) may get a single thread. So the
jobs beyond the calling thread's number of threads start on threads of their own (``pthread_create``,
joined before the callback returns). On Numba's pool, a job runs at once where the team running it
has a thread per job (OpenMP's ``omp_get_num_threads``; the OpenMP loop gives each thread one
iteration); otherwise (a smaller team, or the tbb layer, whose teams are not known) a job first waits
until every job has been taken, and one that waits ``_ARRIVAL_TIMEOUT_NS`` starts the jobs not yet
taken on threads of their own (each job is taken once: a compare-and-swap per job).
"""
import ctypes
import os
import sys

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import _cache
from .._jit import array, njit, renamed_for
from . import threaded
from .buffers import empty, zeros
from .schedule import take

#: Symbol-name variants of the callback setter: plain, SciPy's wheels' prefix, 64-bit-integer suffixes.
_SETTERS = [f"{p}openblas_set_threads_callback_function{s}" for p in ("", "scipy_") for s in ("", "64_", "_64")]

_installed = {}  # library path -> the ctypes setter (to undo it in forked children)
_fork_hook = False


#: What the callback compiles in for each platform it shares the pool on (elsewhere BLAS keeps its own
#: threads): a static mutex's initial bytes, PTHREAD_MUTEX_INITIALIZER (all zero on Linux; macOS's
#: starts with the signature _PTHREAD_MUTEX_SIG_init, and a zeroed one makes pthread_mutex_lock fail
#: with EINVAL without locking), and clock_gettime's id of the monotonic clock.
_PLATFORMS = {"linux": {"mutex": b"", "monotonic": 1},
              "darwin": {"mutex": (0x32AAABA7).to_bytes(8, "little"), "monotonic": 6}}
_MUTEX_BYTES = 64  # room for every platform's pthread_mutex_t (macOS's is the largest: 64 bytes)


def _platform(name=None):
    """The key of ``_PLATFORMS`` for ``name`` (sys.platform's value), or None where the pool is not shared."""
    name = sys.platform if name is None else name
    name = "linux" if name.startswith("linux") else name
    return name if name in _PLATFORMS else None


def _mutex_bytes(name=None):
    """A static pthread mutex's initial bytes on platform ``name`` (sys.platform's value)."""
    return _PLATFORMS[_platform(name)]["mutex"].ljust(_MUTEX_BYTES, b"\0")


def _mutex(builder):
    """Pointer to a process-wide pthread mutex: a global of the compiled module holding the platform's
    PTHREAD_MUTEX_INITIALIZER, so the compiled callback can be cached on disk (its cache tag names the
    target, hence the platform)."""
    mod = builder.module
    name = "linattn_blas_pool_mutex"
    try:
        gv = mod.get_global(name)
    except KeyError:
        gv = ir.GlobalVariable(mod, ir.ArrayType(ir.IntType(8), _MUTEX_BYTES), name)
        gv.linkage = "internal"
        gv.initializer = ir.Constant(gv.type.pointee, bytearray(_mutex_bytes()))
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


#: Nanoseconds a pool thread that took a job waits for the other jobs to be taken before it starts
#: them on threads of its own (the pool's threads wake in microseconds; a job never taken would wait
#: forever).
_ARRIVAL_TIMEOUT_NS = 500_000

#: clock_gettime's id of the monotonic clock (Linux's where the pool is not shared: the tests' own calls).
_CLOCK_MONOTONIC = _PLATFORMS[_platform() or "linux"]["monotonic"]

_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_JOB = ir.FunctionType(ir.VoidType(), [_I32, _I8P, _I32])  # OpenBLAS's dojob(thread_num, jobdata, dojob_data)


@intrinsic
def _dojob(typingctx, fn, job, data, dojob_data):
    """Call OpenBLAS's ``void dojob(int thread_num, void *jobdata, int dojob_data)`` at address fn."""
    sig = types.void(types.intp, types.int32, types.intp, types.int32)

    def codegen(context, builder, sig, args):
        builder.call(builder.inttoptr(args[0], _JOB.as_pointer()), [args[1], builder.inttoptr(args[2], _I8P), args[3]])
        return context.get_dummy_value()

    return sig, codegen


def _slot(context, builder, arrty, arr, index):
    return cgutils.get_item_pointer(context, builder, arrty, context.make_array(arrty)(context, builder, arr), [index])


def _int64_array(arr):
    return isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.int64


@intrinsic
def _take_job(typingctx, claims, index, how):
    """Atomically claims[index] = how where it is 0; True when this call did it (the job is its caller's)."""
    if not _int64_array(claims):
        return None

    def codegen(context, builder, sig, args):
        ptr = _slot(context, builder, claims, args[0], args[1])
        swapped = builder.cmpxchg(ptr, ir.Constant(_I64, 0), args[2], "acq_rel", "acquire")
        return builder.extract_value(swapped, 1)

    return types.boolean(claims, types.intp, types.int64), codegen


@intrinsic
def _arrive(typingctx, claims, index):
    """Atomically claims[index] += 1."""
    if not _int64_array(claims):
        return None

    def codegen(context, builder, sig, args):
        builder.atomic_rmw("add", _slot(context, builder, claims, args[0], args[1]), ir.Constant(_I64, 1), "acq_rel")
        return context.get_dummy_value()

    return types.void(claims, types.intp), codegen


@intrinsic
def _arrived(typingctx, claims, index):
    """claims[index], read atomically."""
    if not _int64_array(claims):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_slot(context, builder, claims, args[0], args[1]), "acquire", 8)

    return types.int64(claims, types.intp), codegen


@intrinsic
def _now_ns(typingctx):
    """The monotonic clock, in nanoseconds."""

    def codegen(context, builder, sig, args):
        spec = cgutils.alloca_once(builder, ir.ArrayType(_I64, 2))
        _libc_call(builder, "clock_gettime", ir.Constant(_I32, _CLOCK_MONOTONIC), builder.bitcast(spec, _I8P))
        sec = builder.load(builder.gep(spec, [ir.Constant(_I32, 0), ir.Constant(_I32, 0)]))
        nsec = builder.load(builder.gep(spec, [ir.Constant(_I32, 0), ir.Constant(_I32, 1)]))
        return builder.add(builder.mul(sec, ir.Constant(_I64, 1_000_000_000)), nsec)

    return types.int64(), codegen


def _thread_main(module):
    """``void *linattn_blas_job(void *p)``: a thread of our own that runs one job, p pointing to int64
    (dojob, job number, job data, dojob_data)."""
    name = "linattn_blas_job"
    try:
        return module.get_global(name)
    except KeyError:
        pass
    fn = ir.Function(module, ir.FunctionType(_I8P, [_I8P]), name)
    fn.linkage = "internal"
    builder = ir.IRBuilder(fn.append_basic_block())
    p = builder.bitcast(fn.args[0], _I64.as_pointer())
    dojob, job, data, dojob_data = (builder.load(builder.gep(p, [ir.Constant(_I64, i)])) for i in range(4))
    builder.call(builder.inttoptr(dojob, _JOB.as_pointer()),
                 [builder.trunc(job, _I32), builder.inttoptr(data, _I8P), builder.trunc(dojob_data, _I32)])
    builder.ret(ir.Constant(_I8P, None))
    return fn


@intrinsic
def _start_thread(typingctx, tids, params, job):
    """Start a thread of our own for the job whose (dojob, job, data, dojob_data) are params[4 job:];
    its id goes to tids[job]. True when it started."""
    if not (_int64_array(tids) and _int64_array(params)):
        return None

    def codegen(context, builder, sig, args):
        tid = builder.bitcast(_slot(context, builder, tids, args[0], args[2]), _I8P)
        four = builder.mul(args[2], ir.Constant(args[2].type, 4))
        p = builder.bitcast(_slot(context, builder, params, args[1], four), _I8P)
        main = builder.bitcast(_thread_main(builder.module), _I8P)
        rc = _libc_call(builder, "pthread_create", tid, ir.Constant(_I8P, None), main, p)
        return builder.icmp_signed("==", rc, ir.Constant(_I32, 0))

    return types.boolean(tids, params, types.intp), codegen


@intrinsic
def _join_thread(typingctx, tids, job):
    """Wait for the thread of tids[job] to end."""
    if not _int64_array(tids):
        return None

    def codegen(context, builder, sig, args):
        tid = builder.load(_slot(context, builder, tids, args[0], args[1]))
        _libc_call(builder, "pthread_join", tid, ir.Constant(_I8P, None))
        return context.get_dummy_value()

    return types.void(tids, types.intp), codegen


_OWN = 2  # claims[job]: 0 not taken, 1 taken by a pool thread, _OWN run on a thread of our own


@njit(helper=True)
def _start_the_rest(claims, tids, params, numjobs):
    """Start every job not taken yet on a thread of its own (pthread_create fails only while the
    system is out of threads for a moment: it is tried again)."""
    for job in range(numjobs):
        if _take_job(claims, job, _OWN):
            while not _start_thread(tids, params, job):
                pass


#: Symbol of the function that gives the size of the team running the calling thread (see
#: _resolve_team_size).
_TEAM_SIZE = "linattn_blas_pool_team_size"


@intrinsic
def _team_size(typingctx):
    """Threads in the team running this code (0 where the threading layer does not say)."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, []), _TEAM_SIZE)
        return builder.sext(builder.call(fn, []), _I64)

    return types.int64(), codegen


def _unknown_team():
    return np.int32(0)


def _resolve_team_size(layer):
    """Point _TEAM_SIZE at the OpenMP runtime's omp_get_num_threads under Numba's omp layer, else at a
    function that returns 0 (before the callback is compiled or loaded from the cache)."""
    address = None
    if layer == "omp":
        try:
            from numba.np.ufunc import omppool

            address = ctypes.cast(ctypes.CDLL(omppool.__file__).omp_get_num_threads, ctypes.c_void_p).value
        except (ImportError, OSError, AttributeError):
            address = None
    if address is None:
        address = _cfunc(types.int32(), _unknown_team).address
    llvm.add_symbol(_TEAM_SIZE, address)


@njit(helper=True)
def _join_own(claims, tids, numjobs):
    """Wait for the jobs that run on threads of their own."""
    for job in range(numjobs):
        if claims[job] == _OWN:
            _join_thread(tids, job)


@njit(helper=True)
def _await_the_others(claims, tids, params, numjobs):
    """Count this thread's job as taken and wait until every job is, at most _ARRIVAL_TIMEOUT_NS; then
    start the jobs not taken yet on threads of their own."""
    _arrive(claims, numjobs)
    start, spins = 0, 0
    while _arrived(claims, numjobs) < numjobs:
        spins += 1
        if spins % 64 == 1:  # the clock every 64 looks (the others arrive in microseconds)
            if start == 0:
                start = _now_ns()
            elif _now_ns() - start > _ARRIVAL_TIMEOUT_NS:
                _start_the_rest(claims, tids, params, numjobs)
                return


#: Symbols of the generic parallel loop (cpu/threaded.py's ``_run_generic``, which the kernels run on) and
#: of ``_jobs_share`` compiled: the callback calls them through these (see ``_resolve_jobs``).
_LOOP, _JOBS = "linattn_blas_pool_loop", "linattn_blas_pool_jobs"


def _symbol_address(name):
    """An intrinsic that gives the address (int64) of the function at symbol ``name``."""

    @intrinsic
    def address(typingctx):
        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), name)
            return builder.ptrtoint(fn, _I64)

        return types.int64(), codegen

    return address


_loop_address, _jobs_address = _symbol_address(_LOOP), _symbol_address(_JOBS)

_JOBS_ARGS = types.Tuple((types.int64,) + (array(types.int64, 1),) * 3)  # numjobs, params, claims, tids


def _jobs_share(payload, counter):
    """One pool thread's part of ``_on_pool``'s loop: the next job of those at ``payload`` (a pointer to
    numjobs, params, claims, tids) taken from ``counter``; where the team running it is smaller than
    numjobs (or not known), run once every job has been taken (see the module's docstring)."""
    numjobs, params, claims, tids = threaded._load(payload)
    job = take(counter)
    mine = _team_size() >= numjobs  # a thread per job: run at once
    if not mine and _take_job(claims, job, 1):
        _await_the_others(claims, tids, params, numjobs)
        mine = True
    if mine:
        _dojob(params[4 * job], np.int32(job), params[4 * job + 2], np.int32(params[4 * job + 3]))


_jobs = []  # _jobs_share compiled (or loaded from the cache), kept alive while its symbol points at it


def _resolve_jobs():
    """Point _LOOP at the generic parallel loop and _JOBS at ``_jobs_share`` (compiled, or loaded from the
    cache), before the callback is compiled or loaded. The kernels run on that loop too, so a process
    compiles one parallel loop, not two (a parallel loop of its own cost the callback ~0.5 s cold)."""
    if not _jobs:
        sig = types.void(types.CPointer(_JOBS_ARGS), array(types.int64, 1))
        jobs = njit(signature=sig, wrappers=False)(renamed_for(_jobs_share, False, sig))
        _jobs.append(jobs)
        llvm.add_symbol(_JOBS, threaded._address(jobs)[1])
        llvm.add_symbol(_LOOP, threaded._generic_loop()[1])


@njit(helper=True)
def _on_pool(numjobs, params, claims, tids):
    """Run the jobs 0..numjobs-1 of params (int64: dojob, job, job data, dojob_data for each) on Numba's
    threads, one prange iteration each (the generic loop, running ``_jobs_share``); then wait for those
    started on threads of their own. claims, tids: numjobs + 1 and numjobs zeros (int64); claims[numjobs]
    counts the jobs taken by pool threads."""
    n = np.int64(numjobs)
    threaded._call_loop(_loop_address(), _jobs_address(), threaded._address_of((n, params, claims, tids)), n)
    _join_own(claims, tids, numjobs)


@njit(helper=True)
def _run_all(dojob, numjobs, elsize, jobdata, dojob_data, pool_threads):
    """Run OpenBLAS's jobs 0..numjobs-1 all at once: on Numba's pool where the calling thread has
    ``pool_threads >= numjobs`` of its threads, else job 0 here and the others on threads of their own."""
    params = empty(4 * numjobs, np.int64)  # (cpu/buffers.py: no NumPy overloads compiled)
    for job in range(numjobs):
        params[4 * job] = dojob
        params[4 * job + 1] = job
        params[4 * job + 2] = jobdata + job * elsize
        params[4 * job + 3] = dojob_data
    claims = zeros(numjobs + 1, np.int64)
    tids = zeros(numjobs, np.int64)
    if numjobs <= pool_threads:
        _on_pool(numjobs, params, claims, tids)
    else:  # the calling thread runs job 0, threads of our own the others
        claims[0] = 1
        _start_the_rest(claims, tids, params, numjobs)
        _dojob(dojob, np.int32(0), jobdata, dojob_data)
        _join_own(claims, tids, numjobs)


@intrinsic
def _pool_threads(typingctx):
    """Numba's number of threads for the calling thread, from its C function (declared as Numba's
    parallel loops do): ``numba.get_num_threads()`` calls it through ctypes, which keeps the callback
    from the disk cache."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I64, []), "get_num_threads")
        return builder.call(fn, [])

    return types.int64(), codegen


# void callback(int sync, dojob, int numjobs, size_t jobdata_elsize, void *jobdata, int dojob_data)
_SIGNATURE = types.void(types.int32, types.intp, types.int32, types.intp, types.intp, types.int32)


def _callback(sync, dojob, numjobs, elsize, jobdata, dojob_data):
    _lock()
    if numjobs == 1:
        _dojob(dojob, np.int32(0), jobdata, dojob_data)
    else:
        _run_all(dojob, numjobs, elsize, jobdata, dojob_data, _pool_threads())
    _unlock()


_compiled = None


def _cfunc(signature, fn):
    """fn compiled as a C function (loaded from Numba's cache where it has one, under a name of its own:
    _jit.cache_tag)."""
    return _cache.cfunc(renamed_for(fn, False, signature), signature, nogil=True)


def _address(layer):
    """Address of the compiled callback (compiled on first use, then loaded from Numba's cache)."""
    global _compiled
    if _compiled is None:
        _resolve_team_size(layer)
        _resolve_jobs()
        _compiled = _cfunc(_SIGNATURE, _callback)
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
    when ``LINATTN_SHARE_BLAS_THREADS=0``, and on platforms other than Linux and macOS: the callback
    calls pthreads with constants of those two, see ``_PLATFORMS``)."""
    enabled = not turned_off() and _platform() is not None
    return {path: enabled and _setter(path) is not None for path in libraries}


_ON, _OFF = ("1", "true", "yes", "on", ""), ("0", "false", "no", "off")


def turned_off():
    """Whether ``LINATTN_SHARE_BLAS_THREADS`` says not to share the pool (0, false, no or off; 1, true, yes, on,
    empty or unset share it, in any case); a ValueError naming it for another value (it was read as "share")."""
    value = os.environ.get("LINATTN_SHARE_BLAS_THREADS", "1")
    if value.strip().lower() not in _ON + _OFF:
        raise ValueError(f"LINATTN_SHARE_BLAS_THREADS: expected 0 or 1 (or false/true, no/yes, off/on), got {value!r}")
    return value.strip().lower() in _OFF


def share(libraries, layer):
    """Run the threaded work of these OpenBLAS libraries (paths from ``sharable``) on Numba's pool,
    which must be running on threading layer ``layer``; returns {path: True} for those that now share it."""
    global _fork_hook
    for path in libraries:
        setter = _setter(path)
        if setter is not None and path not in _installed:
            setter(_address(layer))
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
