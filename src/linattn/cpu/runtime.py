"""How the CPU kernels are run: the work split, the thread pool's start-up and schedule,
single-threaded BLAS inside them, and a lock for Numba's non-thread-safe ``workqueue`` layer."""
import os
import threading
from contextlib import contextmanager

import numba
import numpy as np

# Below this many multiply-adds per chunk product BLAS does not thread (OpenBLAS: 64**3), and the
# ~20 us threadpoolctl needs to switch thread counts (and the wake-ups it causes) are not worth it.
_BLAS_THREADING_MIN = 64 ** 3

#: Cost of the prefix of one chunk (phi(K), phi(K)^T V) relative to a chunk's full work (measured
#: 0.27-0.34 at D = Dv = 64, float32).
PREFIX_COST = 0.30

# GNU OpenMP workers spin after every parallel region before they sleep: by default 300,000 times
# (milliseconds), keeping a core busy. When a model alternates NumPy matrix products (OpenBLAS
# threads) with attention, those spinning workers starve OpenBLAS's threads: measured 2.4-4x the
# time of a projection and causal attention run apart, 8x for a projection and a parallel step.
# 1,000 spins keep back-to-back kernel calls as fast and end the starvation. Used only when the
# user set neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY.
_GOMP_SPINCOUNT = "1000"

_state_lock = threading.Lock()
_blas_depth = 0
_blas_limiter = None
_controller = None
_layer = None
_layer_lock = threading.Lock()


def chunk_size(n):
    """Positions per chunk: 32 (measured best for D in 16..128), fewer for short sequences."""
    return min(32, max(8, -(-n // 8) * 8))


def _segment_fractions(nseg, causal):
    """Cumulative fractions of a head's chunks where its segments start (nseg + 1 values).

    Causal: segment i also sums the prefix before it, so lengths shrink by (1 - PREFIX_COST) each
    to give every item the same work. Non-causal: every item sums the whole head; equal segments.
    """
    w = (1 - PREFIX_COST) ** np.arange(nseg) if causal else np.ones(nseg)
    return np.concatenate([[0.0], np.cumsum(w) / w.sum()])


def plan(bh, n, causal=True):
    """(chunk, frac): chunk size and segment fractions minimising the estimated time on this many
    threads (heads are split into segments only when there are too few to keep threads busy)."""
    chunk = chunk_size(n)
    start_threads()
    threads = numba.get_num_threads()
    nchunks = -(-n // chunk)
    best, best_nseg = None, 1
    for nseg in range(1, min(8 * threads, nchunks) + 1):
        if causal:
            a = PREFIX_COST
            per_item = a / (1 - (1 - a) ** nseg)
        else:
            per_item = 0.25 + 0.75 / nseg
        t = -(-bh * nseg // threads) * per_item
        if best is None or t < best * 0.97:
            best, best_nseg = t, nseg
    return chunk, _segment_fractions(best_nseg, causal)


def _get_controller():
    global _controller
    if _controller is None:
        import scipy.linalg.cython_blas  # noqa: F401  (the BLAS that the kernels call)
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    return _controller


@contextmanager
def _blas_single_thread():
    """Limit BLAS to one thread while any kernel runs (reference-counted across Python threads)."""
    global _blas_depth, _blas_limiter
    with _state_lock:
        if _blas_depth == 0:
            _blas_limiter = _get_controller().limit(limits=1, user_api="blas")
        _blas_depth += 1
    try:
        yield
    finally:
        with _state_lock:
            _blas_depth -= 1
            if _blas_depth == 0:
                _blas_limiter.restore_original_limits()
                _blas_limiter = None


def concurrent_calls_safe():
    """True once the threading layer is known to allow parallel kernels from several threads."""
    return _layer in ("omp", "tbb")


def start_threads():
    """Launch Numba's thread pool (once), with a bounded GNU OpenMP spin count (see _GOMP_SPINCOUNT),
    and note its threading layer. Called before a parallel kernel is compiled or loaded, which would
    launch the pool: libgomp reads its environment when the pool loads it, so the variable is set
    only for that moment. A pool that user code already started is left as it is."""
    global _layer
    if _layer is not None:
        return
    with _layer_lock:
        if _layer is not None:
            return
        ours = "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ
        if ours:
            os.environ["GOMP_SPINCOUNT"] = _GOMP_SPINCOUNT
        try:
            numba.get_num_threads()  # launches the pool
        finally:
            if ours:
                del os.environ["GOMP_SPINCOUNT"]
        _layer = numba.threading_layer()


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


@contextmanager
def kernel_section(largest_product, dynamic=True):
    """Context for running a parallel kernel whose largest BLAS product does ``largest_product``
    multiply-adds: BLAS is kept to one thread only when it could otherwise start threading.

    ``dynamic``: threads take work items one at a time as they finish (Numba's parallel chunk size
    1) instead of equal blocks fixed in advance, so a core that another process is also using does
    not hold up the whole call (one busy process beside, B=1, H=8, N=2048: 4.9 ms instead of 6.4).
    """
    with _threading_layer_guard():
        previous = numba.set_parallel_chunksize(1) if dynamic else None
        try:
            if largest_product > _BLAS_THREADING_MIN:
                with _blas_single_thread():
                    yield
            else:
                yield
        finally:
            if dynamic:
                numba.set_parallel_chunksize(previous)
