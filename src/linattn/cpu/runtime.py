"""How the CPU kernels are run: the work split, single-threaded BLAS inside them, and a lock for
Numba's non-thread-safe ``workqueue`` threading layer."""
import threading
from contextlib import contextmanager

import numba

# Below this many multiply-adds a call is too small for BLAS to thread, and the ~20 us that
# threadpoolctl needs to switch thread counts would dominate.
_BLAS_GUARD_MIN_WORK = 1 << 60

_state_lock = threading.Lock()
_blas_depth = 0
_blas_limiter = None
_controller = None
_layer = None
_layer_lock = threading.Lock()


def plan(bh, n, dv):
    """(chunk, nsplit): positions per chunk and blocks of value columns per head.

    Value columns are split when there are fewer heads than threads (B=H=1 with a long sequence), or
    when the heads do not spread evenly over the threads, as long as a block keeps >= 16 columns.
    """
    chunk = min(64, max(8, -(-n // 8) * 8))
    threads = numba.get_num_threads()
    s = 1
    while dv // (2 * s) >= 16 and (bh * s < threads or ((bh * s) % threads and bh * s < 4 * threads)):
        s *= 2
    return chunk, s


def _get_controller():
    global _controller
    if _controller is None:
        import scipy.linalg.cython_blas  # noqa: F401  (the BLAS that np.dot in Numba calls)
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


@contextmanager
def _threading_layer_guard():
    """Serialise parallel kernels unless the threading layer is known to allow concurrent calls."""
    global _layer
    if _layer in ("omp", "tbb"):
        yield
        return
    with _layer_lock:
        yield
        try:
            _layer = numba.threading_layer()
        except ValueError:  # no parallel region ran yet
            pass


@contextmanager
def kernel_section(work):
    """Context for running a parallel kernel doing ``work`` multiply-adds."""
    with _threading_layer_guard():
        if work >= _BLAS_GUARD_MIN_WORK:
            with _blas_single_thread():
                yield
        else:
            yield
