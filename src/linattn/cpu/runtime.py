"""How the CPU kernels are run: the work split, the thread pool's start-up (and the BLAS libraries
that share it), the number of threads per call, and a lock for Numba's non-thread-safe
``workqueue`` layer."""
import os
import threading
from contextlib import contextmanager, nullcontext

import numba
import numpy as np

from . import blas_pool, cpu_quota

#: Multiply-adds of chunk products (about N * (D' + chunk) * Dv per head) below which one more thread
#: does not pay for waking it (tens of microseconds): the work per thread is at least this much, beyond
#: the second thread (SECOND_THREAD_WORK).
MIN_WORK_PER_THREAD = 1 << 21

#: The same for the second thread, measured on the 2-core Zen 4 VM at stop 54 (MIN_WORK_PER_THREAD came
#: with the work-item kernels, when waking the pool took 50-90 us there): with two heads or more, from
#: 2**17 a second thread pays (B1 H8 N16 D64 24 -> 19-21 us, B1 H8 N64 D64 112 -> 63, B4 H8 N16 D16 40 ->
#: 28, the backward kernels alike; two heads of N16 D64 took 12 us against 10.5 at 2**16); one head cut
#: into segments from 2**18 (N256 D64 72 -> 51; at 2**17 one of N64 took 22.5 against 19 whole). The
#: threads beyond the second keep MIN_WORK_PER_THREAD (not measured again: no many-core machine); so does
#: the choice of the chunkwise kernel over step's for a few positions from a state (attention).
SECOND_THREAD_WORK = 1 << 17
SECOND_THREAD_WORK_ONE_HEAD = 1 << 18

#: Fixed cost of a kernel's second run, in multiply-adds as MIN_WORK_PER_THREAD (the threads woken
#: again, and each waiting for the slowest at the end of the first): measured 10-15 us, one head of
#: N1024-2048, D = Dv = 64, float32, against the same head in one run.
RUN_COST = 1 << 18

#: Cost of the prefix of one chunk (phi(K), phi(K)^T V) relative to a chunk's full work at D = Dv <= 64
#: (measured 0.33-0.41 at D = Dv = 64 on a Zen 5; 0.32, 0.33, 0.36 at D = 16, 32, 64 on a Zen 4, float32,
#: with the register products). It grows with the head dimension, the prefix's D x Dv product against the
#: chunk's scores: see prefix_cost.
PREFIX_COST = 0.36

#: What the prefix's cost adds from D = 64 to D = 128 (measured 0.41 at D = Dv = 128 on a Zen 4; one
#: head of N8192 in two runs was 1.5-2% faster planned with 0.41 than with 0.36).
PREFIX_COST_WIDE = 0.05

#: The same for the backward kernel (the adjoint's update alone against a chunk's gradients: measured
#: 0.20-0.34 at D = Dv = 64, float32, one head of N16384 in two and four segments on one thread, on a
#: Zen 5; 0.27-0.29 at D = 64 and 0.29-0.30 at 128 on a Zen 4, one head cut in halves).
BACKWARD_PREFIX_COST = 0.29

#: The backward kernel's time over the forward's for the same head (one thread, N16384 float32: 2.4 at
#: D = Dv = 64, 2.2 at 128, Zen 4): a second run's fixed cost is that much smaller a part of its work.
BACKWARD_WORK = 2.3

# GNU OpenMP workers spin after every parallel region before they sleep: by default 300,000 times
# (a fraction of a millisecond), keeping a core busy. Where a BLAS keeps threads of its own (MKL, or
# an OpenBLAS that cannot share Numba's pool: see blas_pool), a model that alternates NumPy matrix
# products with attention had those spinning workers starve the BLAS threads: measured 2.4-4x the
# time of a projection and causal attention run apart, 8x for a projection and a parallel step.
# Then 1,000 spins keep back-to-back kernel calls as fast and end the starvation. Set only when the
# user set neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY; where every threaded BLAS shares the pool,
# the pool keeps GNU OpenMP's default, as OpenBLAS's own threads spun before.
_GOMP_SPINCOUNT = "1000"

_state_lock = threading.Lock()
_layer = None
_layer_lock = threading.Lock()
_plans = {}  # plan() results by arguments
_get_num_threads = numba.get_num_threads  # replaced by start_threads
_cap = None  # LINATTN_NUM_THREADS, else the CPU quota's threads (see num_threads)
cap_source = None  # what set _cap: "LINATTN_NUM_THREADS" or "CPU quota"
_blas_sharing = {}


def chunk_size(n):
    """Positions per chunk: 32 (measured best for D in 16..128), fewer for short sequences."""
    return min(32, max(8, -(-n // 8) * 8))


def prefix_cost(dk, dv):
    """The forward kernel's prefix cost (see PREFIX_COST) for heads of dk by dv: PREFIX_COST up to
    sqrt(dk dv) = 64, then PREFIX_COST_WIDE more, linearly in log2, up to 128 and beyond."""
    wide = np.log2(max(1.0, np.sqrt(float(dk) * float(dv))) / 64.0)
    return PREFIX_COST + PREFIX_COST_WIDE * float(min(1.0, max(0.0, wide)))


def _segment_fractions(nseg, prefix, cost=PREFIX_COST, whole_first=False):
    """Cumulative fractions of a head's chunks where its segments start (nseg + 1 values).

    With a prefix (causal, one run) segment i also sums the chunks before it, so lengths shrink by
    (1 - cost) each to give every item the same work (``cost``: the prefix's, see prefix_cost).
    Otherwise equal segments (non-causal, and causal in two runs: each segment sums its own part of the
    state first; see cpu/chunked.py), after a first segment ``cost`` times as long where ``whole_first``
    (that segment runs whole while the next ones sum their parts: its item costs what a sum does).
    """
    if prefix:
        w = (1 - cost) ** np.arange(nseg)
    elif whole_first:
        w = np.concatenate([[cost], np.ones(nseg - 1)])
    else:
        w = np.ones(nseg)
    return np.concatenate([[0.0], np.cumsum(w) / w.sum()])


def chunk_work(bh, n, dk, dv):
    """Multiply-adds of chunk products of bh heads of n positions (about bh N (D' + chunk) Dv), the unit of
    the thresholds above."""
    return bh * n * (dk + chunk_size(n)) * dv


def plan(bh, n, dk, dv, causal=True, two_runs=True, prefix=None, work=1.0):
    """(chunk, frac, nthreads, two_runs): chunk size, segment fractions, number of threads and whether
    the kernel runs twice, minimising the estimated time (heads are split into segments only when there
    are too few to keep the threads busy; small calls run on fewer threads, down to the calling thread
    alone, which wakes none).

    A causal head in segments either has each segment sum its prefix (one run; the later segments
    shorter) or, where ``two_runs`` allows it, runs twice: the first segment (the last in time for the
    backward kernel, mirrored) runs whole in the first run while each of the k equal segments after it
    but the last sums its own part, and is as long as one such sum takes; then those k run from the
    parts before them. k items a run, each (1 + a) / (k + a) of the head (a: the prefix's cost), which
    beats the prefix from two items a head (two threads on one head: 0.58 of it each, against 0.61)
    where the head is long enough to pay for the second run (RUN_COST). ``prefix``: a chunk's prefix
    over its full work (None: the forward's, ``prefix_cost(dk, dv)``), and ``work`` the kernel's time
    over the forward's (the backward's: BACKWARD_PREFIX_COST, BACKWARD_WORK). Non-causal segments
    always take two runs (each sums its own part)."""
    threads = num_threads()
    key = (bh, n, dk, dv, causal, two_runs, prefix, work, threads)
    found = _plans.get(key)
    if found is not None:
        return found
    chunk = chunk_size(n)
    total = chunk_work(bh, n, dk, dv)
    second = total // (SECOND_THREAD_WORK if bh > 1 else SECOND_THREAD_WORK_ONE_HEAD)
    threads = max(1, min(threads, max(min(2, second), total // MIN_WORK_PER_THREAD)))
    nchunks = -(-n // chunk)
    a = prefix_cost(dk, dv) if prefix is None else prefix
    again = RUN_COST / max(1, work * chunk_work(1, n, dk, dv))  # (a second run, in units of one head's work)
    best, best_nseg, with_prefix = None, 1, causal
    for nseg in range(1, min(8 * threads, nchunks - int(causal)) + 1):  # (nseg: items a head and run)
        rounds = -(-bh * nseg // threads)
        if causal:  # (the prefix first; a tie keeps it: one run)
            runs = (1 + a) / (nseg + a) if two_runs and nseg > 1 else None
            costs = [(a / (1 - (1 - a) ** nseg), True)] + ([(runs, False)] if runs is not None else [])
        else:
            costs = [(1 / nseg, False)]
        for per_item, pre in costs:
            t = rounds * per_item + (again if nseg > 1 and not pre else 0)
            if best is None or t < best * 0.97:
                best, best_nseg, with_prefix = t, nseg, pre
    split = best_nseg > 1 and not with_prefix
    whole = split and causal  # (the first segment runs whole: one more)
    found = (chunk, _segment_fractions(best_nseg + int(whole), with_prefix, a, whole), threads, split)
    if len(_plans) > 1024:
        _plans.clear()
    _plans[key] = found
    return found


def _pool_threads():
    """numba.get_num_threads() without its per-call checks once the pool runs (a third of a
    microsecond instead of two thirds: it is asked on every call)."""
    if _layer is None:
        start_threads()
    return _get_num_threads()


def _gnu_openmp_pool():
    """Whether Numba's thread pool runs, on GNU OpenMP."""
    from numba.np.ufunc import parallel

    if not getattr(parallel, "_is_initialized", False) or getattr(parallel, "_threading_layer", None) != "omp":
        return False
    try:
        from numba.np.ufunc import omppool
    except ImportError:
        return False
    return getattr(omppool, "openmp_vendor", "GNU") == "GNU"


#: True in a process forked (multiprocessing's "fork" start method, a pre-forking server) from one whose
#: thread pool ran on GNU OpenMP: GNU OpenMP does not survive fork(), and Numba terminates a forked
#: child that enters a parallel region ("Terminating: fork() called from a process already using GNU
#: OpenMP"). There every kernel runs on the calling thread: num_threads() is 1, and callers that
#: have a parallel kernel take its serial twin when it is.
forked_from_openmp = False


def _after_fork_in_child():
    global forked_from_openmp
    if _gnu_openmp_pool():
        forked_from_openmp = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def num_threads():
    """Threads a kernel may use: Numba's number for this thread, at most LINATTN_NUM_THREADS, or without
    it at most the CPUs of this process's CPU quota, rounded up (cpu/cpu_quota.py: a container's
    ``--cpus``, which Numba's pool does not see); 1 in a child forked from a process whose GNU OpenMP pool
    ran (``forked_from_openmp``).

    LINATTN_NUM_THREADS (read when the pool starts) caps linattn's threads without touching Numba's
    pool: where NUMBA_NUM_THREADS cannot be set before Numba is imported (a Dask worker's environment
    is set after its process imported the user's modules), it keeps several workers on one machine
    from running a thread per core each. A quota caps the same way: under a quota of 1 CPU on two cores,
    two threads ran B1 H8 N2048 at 159-182 calls/s, 55 ms at the 99th percentile (the process stopped for
    the rest of each 100 ms period), one thread 194-199 calls/s, 6.0 ms (docs/performance.md, stop 63).
    """
    if forked_from_openmp:
        return 1
    n = _pool_threads()
    return n if _cap is None or n <= _cap else _cap


def threads_for(work, per_thread, second=None):
    """Threads for a kernel of ``work`` units: one per ``per_thread`` of them (rounded up; waking a
    thread costs more than less work), at least 1, at most num_threads(); at least two from ``second``
    units when given (the second thread wakes sooner than the others pay: see SECOND_THREAD_WORK)."""
    wanted = -(-work // per_thread)
    if second is not None and work >= second:
        wanted = max(wanted, 2)
    return max(1, min(num_threads(), wanted))


def _read_cap():
    value = os.environ.get("LINATTN_NUM_THREADS", "").strip()
    if not value:
        return None
    try:
        cap = int(value)
    except ValueError:
        cap = 0
    if cap < 1:
        raise ValueError(f"LINATTN_NUM_THREADS: expected an integer >= 1, got {value!r}")
    return cap


def concurrent_calls_safe():
    """True once the threading layer is known to allow parallel kernels from several threads."""
    return _layer in ("omp", "tbb")


def start_threads():
    """Launch Numba's thread pool (once), with a GNU OpenMP spin count that suits the BLAS libraries
    (see _GOMP_SPINCOUNT), let OpenBLAS run its threaded work on it (blas_pool), and note the
    threading layer. Called before a parallel kernel is compiled or loaded, which would launch the
    pool: libgomp reads its environment when the pool loads it, so the variable is set only for that
    moment. A pool that user code already started is left as it is."""
    global _layer, _get_num_threads, _blas_sharing, _cap, cap_source
    if _layer is not None:
        return
    with _layer_lock:
        if _layer is not None:
            return
        libraries = _threaded_blas()
        sharable = blas_pool.sharable([path for path, api in libraries if api == "openblas"])
        all_shared = all(sharable.get(path, False) for path, _ in libraries)
        ours = "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ
        if ours and not all_shared:
            os.environ["GOMP_SPINCOUNT"] = _GOMP_SPINCOUNT
        try:
            numba.get_num_threads()  # launches the pool
        finally:
            if ours and not all_shared:
                del os.environ["GOMP_SPINCOUNT"]
        _cap, cap_source = _read_cap(), "LINATTN_NUM_THREADS"
        if _cap is None:
            _cap = cpu_quota.threads()
            cap_source = None if _cap is None else "CPU quota"
        layer = numba.threading_layer()
        if layer in ("omp", "tbb"):  # layers that take parallel work from several threads at once
            blas_pool.share([path for path, ok in sharable.items() if ok], layer)
            # and again: loading the compiled callback loads SciPy's OpenBLAS where SciPy is installed
            # (Numba's BLAS bindings), which would otherwise keep threads of its own
            now = blas_pool.sharable([path for path, api in _threaded_blas() if api == "openblas"])
            _blas_sharing = blas_pool.share([path for path, ok in now.items() if ok], layer)
        from numba.np.ufunc import parallel

        fast = getattr(parallel, "_get_num_threads", None)  # Numba's own ctypes call, set by the launch
        _get_num_threads = fast if callable(fast) else numba.get_num_threads
        _layer = layer


def _threaded_blas():
    """(path, internal API) of the BLAS libraries loaded that may run threads."""
    from threadpoolctl import threadpool_info

    return [(lib["filepath"], lib.get("internal_api")) for lib in threadpool_info()
            if lib.get("user_api") == "blas" and lib.get("num_threads", 1) > 1]


def blas_sharing():
    """{library path: whether its threaded work runs on Numba's pool}, for ``python -m linattn info``."""
    start_threads()
    return dict(_blas_sharing)


@contextmanager
def _threading_layer_guard():
    """Serialise parallel kernels unless the threading layer allows concurrent calls (workqueue
    does not)."""
    start_threads()
    if concurrent_calls_safe():
        yield
        return
    with _layer_lock:
        yield


_NO_SECTION = nullcontext()


def kernel_section(nthreads=None):
    """Context for running a kernel on ``nthreads`` threads (default: all of Numba's): Numba's number of
    threads for this Python thread is ``nthreads`` for the call, and the workqueue layer (which
    cannot run two parallel kernels at once) is locked. A kernel run by the calling thread alone
    (``nthreads == 1``) launches no parallel region: it needs no section at all (a shared no-op)."""
    current = _pool_threads()
    nthreads = num_threads() if nthreads is None else nthreads
    if nthreads == 1 or (nthreads == current and concurrent_calls_safe()):
        return _NO_SECTION
    return _section(nthreads, current)


@contextmanager
def _section(nthreads, current):
    with _threading_layer_guard():
        if nthreads != current:
            numba.set_num_threads(nthreads)
        try:
            yield
        finally:
            if nthreads != current:
                numba.set_num_threads(current)
