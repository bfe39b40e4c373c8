"""How linattn's kernels are compiled: fast-math flags, on-disk caching, and explicit signatures so
that each kernel compiles once per (dtype, memory layout) and never once per call pattern, cached on
disk under a name that carries a hash of all of linattn's sources and one of the signature and machine
(one signature a cache index; the cache itself: _cache.py)."""
import functools
import hashlib
import os
import re
import threading
import types as pytypes
from pathlib import Path

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from numba.core import types

from . import _cache, _tuning
from ._linkonly import PIPELINE

#: The oldest Numba linattn runs on (pyproject.toml's numba>=0.61): with 0.60 a kernel's call on several threads
#: failed with a TypeError (its arguments, read-only arrays among them, passed as one tuple did not convert).
OLDEST_NUMBA = (0, 61)


def _check_numba(version):
    """An ImportError naming the version found where Numba is older than OLDEST_NUMBA."""
    found = tuple(int(re.match(r"\d*", part).group() or 0) for part in version.split(".")[:2])
    if found < OLDEST_NUMBA:
        raise ImportError(f"linattn needs Numba {OLDEST_NUMBA[0]}.{OLDEST_NUMBA[1]} or later, found {version}: "
                          f"pip install 'numba>={OLDEST_NUMBA[0]}.{OLDEST_NUMBA[1]}'")


_check_numba(numba.__version__)

# Reassociation and contraction let LLVM vectorise reductions and use FMA; "nnan"/"ninf" are left out
# on purpose so that NaN and inf propagate exactly as in NumPy. error_model="numpy": x / 0 gives
# inf or nan as in NumPy instead of raising.
OPTIONS = dict(fastmath={"contract", "reassoc", "nsz", "arcp"}, error_model="numpy", nogil=True)
FASTMATH = OPTIONS["fastmath"]
_NO_WRAPPERS = dict(no_cpython_wrapper=True, no_cfunc_wrapper=True)
#: Options of the functions compiled and emitted on their own (kernels, C functions): the pipeline that
#: tunes them where linattn tunes for another CPU than the host's (_tuning.py).
TUNED = {} if _tuning.PIPELINE is None else dict(pipeline_class=_tuning.PIPELINE)


def _link_only():
    """A helper's options: no wrappers, and the link-only pipeline where this Numba allows it."""
    return _NO_WRAPPERS if PIPELINE is None else dict(_NO_WRAPPERS, pipeline_class=PIPELINE)


#: ``jit_options`` of linattn's ``@overload`` implementations: its options, and compiled as helpers are
#: (``njit(helper=True)``): only into the kernels that call them, no wrappers for Python or C. (Numba
#: compiled each one as a library of its own, optimised and emitted: ~0.6 s of a gated first call.)
OVERLOAD_OPTIONS = dict(fastmath=set(FASTMATH), error_model="numpy", **_link_only())

#: Set to the reason when compiled code cannot be cached on disk (nothing writable), else None.
cache_problem = None

#: Callables run with a NumPy dtype once before the first kernel of that dtype is compiled or loaded
#: (modules whose compiled code kernels call by symbol name register that dtype's symbols there).
before_kernels = []
_before_done = set()


def require_compiler():
    """A RuntimeError where Numba's compiler is turned off (``NUMBA_DISABLE_JIT=1``, set to debug one's own Numba
    code: ``numba.njit`` then returns the Python function, and linattn's kernels, built of compiled pieces,
    cannot run as Python; they failed with an AttributeError)."""
    if numba.config.DISABLE_JIT:
        raise RuntimeError("linattn's kernels need Numba's compiler, and NUMBA_DISABLE_JIT is set (Numba then runs "
                           "functions as Python, which cannot run them): unset it for this process. "
                           "linattn.reference has slow NumPy versions of the calls.")


def njit(*, parallel=False, helper=False, signature=None, wrappers=True):
    """``numba.njit`` with linattn's options, caching on disk where a cache directory is writable.

    ``helper=True`` marks a function only called from other kernels (compiled into them, and cached
    with them; no wrappers for calls from Python). Numba compiles a helper once per argument types,
    and a constant argument (``False``, ``0``) is a type of its own (a literal): callers pass
    ``bool(False)`` / ``int(0)`` so that one compiled helper serves every call (~0.3-0.6 s of a cold
    first call each). Numba raises ``RuntimeError: cannot cache function`` at decoration time when neither
    the package directory nor ``NUMBA_CACHE_DIR``/``~/.cache`` is writable; the kernel then compiles
    in every process instead. ``wrappers=False``: a function only called by its address from compiled
    code (compiled and cached as a kernel, without the wrappers for calls from Python or C).
    """

    def decorate(fn):
        global cache_problem
        args = () if signature is None else (signature,)
        if helper:
            return numba.njit(*args, **_link_only(), **OPTIONS)(fn)
        require_compiler()
        bare = dict(TUNED) if wrappers else dict(_NO_WRAPPERS, **TUNED)
        try:
            compiled = _cache.njit(fn, signature, parallel=parallel, **bare, **OPTIONS)
        except RuntimeError as exc:
            if "cannot cache" not in str(exc):
                raise
            cache_problem = str(exc)  # reported by `python -m linattn info`
            return numba.njit(*args, cache=False, parallel=parallel, **bare, **OPTIONS)(fn)
        stats = compiled.stats
        if sum(stats.cache_misses.values()):  # compiled now (a signature compiles at once), not loaded
            prune_stale_cache(stats.cache_path)
        return compiled

    return decorate


def _source_stamp():
    """A short hash of linattn's Python sources (see Kernel). (The CPU linattn tunes for is in
    :func:`cache_tag`'s hash: code of the same sources compiled for other machines or tunings, in a
    cache directory they share, is not stale.)"""
    root = Path(__file__).parent
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


SOURCE_STAMP = _source_stamp()

# A cache file of a kernel or C function: its name ends in the stamp of the sources it was compiled from
# (``renamed``, cpu/symbols.py), then Numba's "-<line>.py<version>.nbi" (index) or ".<n>.nbc" (code).
_STAMPED = re.compile(r"_([0-9a-f]{12})-[0-9]+\.py[0-9]+\.(?:nbi|[0-9]+\.nbc)$")
_pruned = set()


def prune_stale_cache(path):
    """Delete the cache files in ``path`` (a directory of linattn's disk cache) that other versions of
    its sources left there: no process of this version can load them, and each version's compiled
    kernels take up to ~25 MB, so upgrades (and edits of an editable install) would otherwise pile them up.
    Called once per directory and process, when a kernel was compiled rather than loaded (a new
    version compiles at least once). Files of this version (whatever Python or Numba wrote them) and
    files of any other name are left alone; a file another process is loading may go (Numba then
    compiles instead). Returns the number of files deleted."""
    if not path or path in _pruned:
        return 0
    _pruned.add(path)
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    deleted = 0
    for name in names:
        found = _STAMPED.search(name)
        if found and found.group(1) != SOURCE_STAMP:
            try:
                os.remove(os.path.join(path, name))
                deleted += 1
            except OSError:  # (gone already, or not ours to delete)
                pass
    return deleted


def target_features(context):
    """The features of the CPU a Numba target context compiles for, as LLVM's "+name,-name,..." string
    (the host's where the context does not say)."""
    try:
        return context.codegen()._tm_features
    except AttributeError:
        return ",".join(f"+{k}" for k, v in llvm_binding.get_host_cpu_features().items() if v)


def array(dtype, ndim, layout="C", readonly=False):
    """Numba array type; ``readonly=True`` accepts writable and read-only arrays alike."""
    return types.Array(dtype, ndim, layout, readonly=readonly)


def run_before_kernels(dtype):
    """Run the ``before_kernels`` hooks for ``dtype`` (a NumPy dtype), once per process: before a kernel
    of that dtype, or a C function that calls registered symbols, is compiled or loaded from the cache
    (compiling meets the symbols in typing; a cached one only names them, and LLVM aborts the
    process on a symbol it does not know)."""
    if dtype not in _before_done:
        for hook in before_kernels:
            hook(dtype)
        _before_done.add(dtype)


#: Numba's settings that change the code it generates (NUMBA_OPT, NUMBA_BOUNDSCHECK, ...), which its cache
#: keys leave out: kernels compiled once under NUMBA_OPT=0 were loaded by every later process (B1 H8 N2048
#: 6.5 ms instead of 2.8), and under NUMBA_BOUNDSCHECK=1 they would keep their checks. Part of the cache tag.
_CODEGEN_SETTINGS = ("OPT", "LOOP_VECTORIZE", "SLP_VECTORIZE", "ENABLE_AVX", "BOUNDSCHECK", "DEBUGINFO_DEFAULT",
                     "EXTEND_VARIABLE_LIFETIMES")


@functools.cache
def _machine():
    """What Numba's cache keys tell machines apart by (its code generator's "magic tuple": the target
    triple, the CPU name and its features), read as Numba reads them, at least as fine as Numba's; the
    CPU linattn tunes for (_tuning.py) and Numba's settings that change the code (_CODEGEN_SETTINGS),
    which Numba's keys do not tell apart."""
    from numba.core import config

    cpu = config.CPU_NAME or llvm_binding.get_host_cpu_name()
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else \
        llvm_binding.get_host_cpu_features().flatten()
    settings = tuple((name, repr(getattr(config, name, None))) for name in _CODEGEN_SETTINGS)
    return llvm_binding.get_process_triple(), cpu, features, f"tune-cpu {_tuning.CHOSEN}", settings


def cache_tag(*parts):
    """A short hash of ``parts`` (a signature, ...) and of the machine (:func:`_machine`): the part of a
    cache name that gives each compiled signature a cache index of its own.

    Numba keeps one index file per function name, listing its compiled signatures (and machines), and
    updates it without a lock: two processes that compile two signatures of one function at once (a
    fresh machine's service workers, dask workers, pytest-xdist) can both take the index as they found it
    and the same data file name, so that the index ends up naming the other signature's code (measured:
    a float64 call then loaded the float32 kernel). With one signature per name, processes that write
    at once write the same entry."""
    return hashlib.sha1(repr((parts, _machine())).encode()).hexdigest()[:10]


def renamed(py_func, parallel, tag=None):
    """``py_func`` under a name of its own that carries a hash of linattn's sources (see Kernel), and
    ``tag`` where given (:func:`cache_tag`)."""
    name = f"{py_func.__name__}{'' if parallel else '_serial'}{'' if tag is None else '_' + tag}_{SOURCE_STAMP}"
    named = pytypes.FunctionType(py_func.__code__, py_func.__globals__, name, py_func.__defaults__,
                                 py_func.__closure__)
    named.__qualname__ = py_func.__qualname__[:-len(py_func.__name__)] + name
    return named


def renamed_for(py_func, parallel, sig):
    """``py_func`` under its cache name for the signature ``sig``: :func:`renamed` with the tag of the
    signature and the machine (one signature a cache index: :func:`cache_tag`)."""
    return renamed(py_func, parallel, cache_tag(str(sig)))


class Kernel:
    """A Python kernel function compiled on first use for one explicit signature per
    (dtype, variant). ``signature(numba_dtype, variant)`` builds the signature; for the sequence
    kernels the variant is the layout: "C" when all inputs are C-contiguous (the fast path), "A" for
    any strides (views, negative strides). ``prepare(dtype, variant)``, when given, runs before a
    variant is compiled or loaded (it registers the C functions that variant calls by symbol).
    """

    def __init__(self, py_func, signature, parallel=True, prepare=None):
        # Numba's disk cache keys entries by function name and signature, and checks only the
        # kernel's own source file: not compile flags (a serial twin of a parallel kernel would load
        # the parallel binary) and not the helpers in other modules it compiles in (an edited helper
        # would go unnoticed). So each kernel is cached under a name of its own that carries a hash
        # of linattn's sources, and one of its signature and machine (one signature a cache index:
        # see cache_tag).
        self._base = py_func
        self._signature = signature
        self._parallel = parallel
        self._prepare = prepare
        self._compiled = {}
        self._lock = threading.Lock()
        self.__doc__ = py_func.__doc__
        self.__name__ = py_func.__name__

    def get(self, dtype, variant):
        """The compiled dispatcher for ``dtype`` (a NumPy dtype) and ``variant``."""
        try:
            return self._compiled[dtype, variant]
        except KeyError:
            pass
        with self._lock:
            key = (np.dtype(dtype), variant)
            fn = self._compiled.get(key)
            if fn is None:
                run_before_kernels(key[0])
                if self._prepare is not None:
                    self._prepare(key[0], variant)
                if self._parallel:
                    from .cpu.runtime import start_threads

                    start_threads()  # before compiling or loading, which would launch the pool itself
                fn = self._build(self._signature(numba.from_dtype(key[0]), variant))
                self._compiled[key] = fn
                self._compiled[dtype, variant] = fn
        return fn

    def named(self, sig):
        """The kernel's function under its cache name for the signature ``sig``."""
        return renamed_for(self._base, self._parallel, sig)

    def _build(self, sig):
        """The compiled kernel for the signature ``sig``."""
        return njit(parallel=self._parallel, signature=sig)(self.named(sig))
