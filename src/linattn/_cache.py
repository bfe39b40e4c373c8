"""linattn's disk cache: Numba's, also read where this process cannot write it.

Numba caches compiled code next to the source (``__pycache__``), else in ``NUMBA_CACHE_DIR`` or the user's
cache directory, and chooses only among the places it can write. So a cache precompiled into a package
(``python -m linattn compile`` while building a service's image, as root) is never read by a process that
cannot write there (the service running as its own user; a read-only filesystem): each one compiled
everything again (measured: a first call 0.6 s as root, 11 s as another user over the same files).

linattn's functions use :class:`Cache`: Numba's order of places, with after ``NUMBA_CACHE_DIR`` and after
the package's own ``__pycache__`` (each where writable) that same directory read-only, for a function
whose cache index is there; nothing is saved to it, and a function not precompiled there falls through
to the next place as before. Each compiled signature of linattn's has an index of its own (``_jit.cache_tag``),
so "its index is there" means "this signature, for this machine, was precompiled".
"""
import os
import pickle
import sys

import numba
from numba.core import caching, config, sigutils


def _index_name(py_func, py_file):
    """The name of Numba's cache index file of ``py_func`` (CacheImpl.get_filename_base, ".nbi")."""
    fullname = f"{os.path.splitext(os.path.basename(py_file))[0]}.{py_func.__qualname__}"
    return "%s-%s.py%d%d%s.nbi" % (fullname.replace("<", "").replace(">", ""), py_func.__code__.co_firstlineno,
                                   sys.version_info[0], sys.version_info[1], getattr(sys, "abiflags", ""))


def _serves(index, stamp):
    """Whether the cache index file ``index`` was written by this Numba for these sources (``stamp``, the
    locator's): else Numba finds it empty (IndexDataCacheFile._load_index), and a read-only place would
    have every process compile again where a writable one further down caches once."""
    try:
        with open(index, "rb") as f:
            if pickle.load(f) != numba.__version__:
                return False
            found, _ = pickle.loads(f.read())
    except Exception:  # (missing, unreadable, or not an index of this Numba's)
        return False
    return found == stamp


def _locator(name):
    """Numba's locator class ``name`` (public names in recent Numbas, private ones before)."""
    return getattr(caching, name, None) or getattr(caching, "_" + name)


_USER_PROVIDED, _IN_TREE = _locator("UserProvidedCacheLocator"), _locator("InTreeCacheLocator")


def _read_only(base):
    """``base``'s place (NUMBA_CACHE_DIR, the source's ``__pycache__``) where it holds this function's cache
    index: read, never written (no check that it can be written, as ``base`` makes)."""

    class ReadOnly(base):
        read_only = True

        @classmethod
        def from_function(cls, py_func, py_file):
            if not os.path.exists(py_file) or (base is _USER_PROVIDED and not config.CACHE_DIR):
                return None
            self = cls(py_func, py_file)
            index = os.path.join(self.get_cache_path(), _index_name(py_func, py_file))
            return self if _serves(index, self.get_source_stamp()) else None

    ReadOnly.__name__ = ReadOnly.__qualname__ = f"ReadOnly{base.__name__.lstrip('_')}"
    return ReadOnly


def _locators():
    """Numba's locator classes, each of NUMBA_CACHE_DIR's and the ``__pycache__``'s followed by its
    read-only twin."""
    found = []
    for cls in caching.CompileResultCacheImpl._locator_classes:
        found.append(cls)
        if cls in (_USER_PROVIDED, _IN_TREE):
            found.append(_read_only(cls))
    return found


class _Impl(caching.CompileResultCacheImpl):
    _locator_classes = _locators()


class Cache(caching.FunctionCache):
    """Numba's FunctionCache with the read-only precompiled cache as a fallback (nothing saved there).
    Raises RuntimeError("cannot cache function ...") where there is no place, as Numba's does."""

    _impl_class = _Impl

    @property
    def read_only(self):
        return getattr(self._impl.locator, "read_only", False)

    def save_overload(self, sig, data):
        if not self.read_only:
            super().save_overload(sig, data)


def njit(fn, signature=None, **options):
    """``numba.njit(signature, cache=True, **options)(fn)`` with :class:`Cache`."""
    compiled = numba.njit(**options)(fn)  # (lazy: compiled below, once the cache is set)
    compiled._cache = Cache(compiled.py_func)
    if signature is not None:
        compiled.compile(signature)
        compiled.disable_compile()
    return compiled


def cfunc(fn, signature, pipeline_class=None, **options):
    """``numba.cfunc(signature, cache=True, **options)(fn)`` with :class:`Cache`; where there is no place to
    cache it (nothing writable, nothing precompiled), compiled in this process."""
    from numba.core.ccallback import CFunc

    from ._jit import require_compiler  # (_jit imports this module)

    require_compiler()
    extra = {} if pipeline_class is None else {"pipeline_class": pipeline_class}
    compiled = CFunc(fn, sigutils.normalize_signature(signature), locals={}, options=options, **extra)
    try:
        compiled._cache = Cache(fn)
    except RuntimeError as exc:
        if "cannot cache" not in str(exc):
            raise
    compiled.compile()
    return compiled
