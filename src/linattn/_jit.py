"""One place that decides how linattn's kernels are compiled: fast-math flags and on-disk caching."""
import numba

# Reassociation and contraction let LLVM vectorise reductions and use FMA; "nnan"/"ninf" are left out
# on purpose so that NaN and inf propagate exactly as in NumPy.
FASTMATH = frozenset({"contract", "reassoc", "nsz", "arcp"})

#: Set to the reason when compiled code cannot be cached on disk (e.g. nothing writable), else None.
cache_problem = None


def njit(*, parallel=False, helper=False):
    """``numba.njit`` with linattn's flags, caching on disk where a cache directory is writable.

    ``helper=True`` marks a function only called from other kernels (LLVM inlines it there).

    Numba raises ``RuntimeError: cannot cache function`` at decoration time when neither the package
    directory nor ``NUMBA_CACHE_DIR``/``~/.cache`` is writable; the kernel then compiles per process.
    """

    def decorate(fn):
        global cache_problem
        opts = dict(parallel=parallel, fastmath=set(FASTMATH), nogil=True,
                    error_model="numpy")  # x / 0 gives inf/nan as in NumPy, never raises
        if helper:  # helpers are compiled into, and cached with, the kernels that call them
            return numba.njit(**opts)(fn)
        try:
            return numba.njit(cache=True, **opts)(fn)
        except RuntimeError as exc:
            cache_problem = str(exc)  # reported by `python -m linattn info`
            return numba.njit(cache=False, **opts)(fn)

    return decorate
