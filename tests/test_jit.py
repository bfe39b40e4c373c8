"""Compilation: kernels still work when no cache directory is writable, a precompiled cache is read where
it cannot be written, the disk cache never serves a kernel compiled from other sources nor another
signature's (processes compiling at once), helpers are compiled only into the kernels that call them, and
a Numba older than linattn runs on is refused by name."""
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

import linattn
from linattn import _cache, _jit, _tuning


def test_uncacheable_falls_back(monkeypatch):
    def no_place(py_func):
        raise RuntimeError("cannot cache function 'f': no locator available for file '/ro/f.py'")

    monkeypatch.setattr(_cache, "Cache", no_place)
    monkeypatch.setattr(_jit, "cache_problem", None)

    def f(x):
        return x.sum() * 2

    g = _jit.njit()(f)
    assert g(np.arange(4.0)) == 12.0
    assert "cannot cache" in _jit.cache_problem

    def twice(x):
        return 2.0 * x

    c = _cache.cfunc(twice, "float64(float64)")  # a C function too: compiled in this process
    assert c.ctypes(1.5) == 3.0


def test_other_errors_are_not_swallowed(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("something else")

    monkeypatch.setattr(numba, "njit", broken)
    try:
        _jit.njit()(lambda x: x)
    except RuntimeError as exc:
        assert "something else" in str(exc)
    else:
        raise AssertionError("expected RuntimeError")


_CACHE_PROBE = """
import numpy as np, linattn
from linattn.cpu import step
linattn.step(np.ones((2, 3), np.float32), np.ones((2, 3), np.float32), np.ones((2, 4), np.float32),
             linattn.State.zeros((2,), 3, 4))
stats = step.step_nd_serial.get(np.dtype(np.float32), (1, 0, False, False, False, False)).stats
print("hits", sum(stats.cache_hits.values()), "misses", sum(stats.cache_misses.values()))
"""


def test_editing_a_helper_module_invalidates_the_cache(tmp_path):
    # Numba's cache checks only the kernel's own file; the kernels' cache names carry a hash of all
    # of linattn's sources, so a change to a helper in another module (here vector.py, compiled
    # into the step kernel) is not served from a stale cache.
    pkg = tmp_path / "linattn"
    shutil.copytree(Path(linattn.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("NUMBA_CACHE_DIR", None)

    def run():
        res = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True,
                             cwd=tmp_path, timeout=600, check=False)
        assert res.returncode == 0, res.stderr
        return res.stdout.split()

    assert run() == ["hits", "0", "misses", "1"]  # compiled, and cached
    assert run() == ["hits", "1", "misses", "0"]  # loaded from the cache
    with open(pkg / "cpu" / "vector.py", "a") as f:
        f.write("\n# an edit\n")
    assert run() == ["hits", "0", "misses", "1"]  # compiled again


def _stamps(directory):
    """The source stamps in the names of the cache files in ``directory``."""
    return {m.group(1) for m in map(_jit._STAMPED.search, os.listdir(directory)) if m}


# A process that cannot write the package's __pycache__ (a service's user over an image built as root, a
# read-only filesystem) and has no cache directory of its own: simulated for any user (root writes anyway).
_NOT_WRITABLE = """
from numba.core import caching

for name in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator"):
    locator = getattr(caching, name, None) or getattr(caching, "_" + name)
    locator.from_function = classmethod(lambda cls, py_func, py_file: None)
"""
_READ_ONLY_PROBE = _NOT_WRITABLE + _CACHE_PROBE + """
from linattn import _jit, cli
print(_jit.cache_problem is None, cli.info()["cache_dir"].endswith("__pycache__ (precompiled, read only)"))
"""
# (the call `python -m linattn info` makes: its kernel precompiled too)
_INFO_CALL = "\nq = np.ones((2, 2, 8, 2), np.float32); linattn.causal_linear_attention(q, q, q)\n"


def test_a_precompiled_cache_is_read_where_it_cannot_be_written(tmp_path):
    # Numba reads a cache only where it can write: a precompiled package run by another user compiled
    # every kernel again in every process (0.6 s -> 11 s for a first call). linattn's cache also reads the
    # package's __pycache__ where it holds a kernel's index, and writes nothing there.
    pkg = tmp_path / "linattn"
    shutil.copytree(Path(linattn.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    env.pop("NUMBA_CACHE_DIR", None)
    assert _run(_CACHE_PROBE + _INFO_CALL, env, cwd=tmp_path) == ["hits", "0", "misses", "1"]  # precompiled
    files = sorted(p.name for p in pkg.rglob("__pycache__/*"))
    assert _run(_READ_ONLY_PROBE, env, cwd=tmp_path) == ["hits", "1", "misses", "0", "True", "True"]
    assert sorted(p.name for p in pkg.rglob("__pycache__/*")) == files  # nothing written


def test_a_precompiled_numba_cache_dir_is_read_where_it_cannot_be_written(tmp_path):
    # The same for a cache precompiled into NUMBA_CACHE_DIR (a directory of the image, read-only when it runs).
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    assert _run(_CACHE_PROBE, env) == ["hits", "0", "misses", "1"]
    files = sorted(p.name for p in (tmp_path / "cache").rglob("*"))
    assert _run(_NOT_WRITABLE + _CACHE_PROBE, env) == ["hits", "1", "misses", "0"]
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*")) == files


def test_a_read_only_cache_serves_only_an_index_of_this_numba_and_these_sources(tmp_path):
    # An index another Numba wrote, or for other sources, is one Numba would find empty: a read-only place
    # holding it would make every process compile again, where a writable place further down caches once.
    def index(name, version, stamp):
        path = tmp_path / name
        with open(path, "wb") as f:
            pickle.dump(version, f, protocol=-1)
            f.write(pickle.dumps((stamp, {"a signature": "a data file"})))
        return str(path)

    assert _cache._serves(index("ok.nbi", numba.__version__, ("stamp", 1)), ("stamp", 1))
    assert not _cache._serves(index("sources.nbi", numba.__version__, ("stamp", 1)), ("stamp", 2))
    assert not _cache._serves(index("numba.nbi", "0.0.1", ("stamp", 1)), ("stamp", 1))
    (tmp_path / "garbled.nbi").write_bytes(b"not a pickle")
    assert not _cache._serves(str(tmp_path / "garbled.nbi"), ("stamp", 1))
    assert not _cache._serves(str(tmp_path / "missing.nbi"), ("stamp", 1))
    # the read-only __pycache__ is taken for a function only where its index serves
    source = tmp_path / "kernels.py"
    source.write_text("def kernel(x):\n    return x\n")
    (tmp_path / "__pycache__").mkdir()
    namespace = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    kernel, locator = namespace["kernel"], _cache._read_only(_cache._IN_TREE)
    stamp = locator(kernel, str(source)).get_source_stamp()
    name = "__pycache__/" + _cache._index_name(kernel, str(source))
    assert locator.from_function(kernel, str(source)) is None  # (no index)
    index(name, "0.0.1", stamp)
    assert locator.from_function(kernel, str(source)) is None
    index(name, numba.__version__, stamp)
    assert locator.from_function(kernel, str(source)).read_only


def test_a_new_version_deletes_the_cache_files_of_the_previous_one(tmp_path):
    # Each version of the sources compiles its kernels under names of its own (above); the files of
    # the versions before are deleted when the new one first compiles, not left to pile up.
    pkg = tmp_path / "linattn"
    shutil.copytree(Path(linattn.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("NUMBA_CACHE_DIR", None)
    cache = pkg / "cpu" / "__pycache__"

    def run():
        res = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True,
                             cwd=tmp_path, timeout=600, check=False)
        assert res.returncode == 0, res.stderr
        return res.stdout.split()

    assert run() == ["hits", "0", "misses", "1"]
    (first,) = _stamps(cache)
    unrelated = cache / "notes_0123456789ab.txt"
    unrelated.write_text("not a cache file")
    with open(pkg / "cpu" / "vector.py", "a") as f:
        f.write("\n# an edit\n")
    assert run() == ["hits", "0", "misses", "1"]
    (second,) = _stamps(cache)
    assert second != first
    assert unrelated.exists()
    assert run() == ["hits", "1", "misses", "0"]  # the new version's files stay


def test_pruning_deletes_only_other_stamps(tmp_path):
    other = "0123456789ab" if _jit.SOURCE_STAMP != "0123456789ab" else "ba9876543210"
    keep = [f"chunked._causal_forward_{_jit.SOURCE_STAMP}-237.py311.nbi",
            f"chunked._causal_forward_{_jit.SOURCE_STAMP}-237.py312.2.nbc",
            f"chunked._causal_forward_0a1b2c3d4e_{_jit.SOURCE_STAMP}-237.py311.1.nbc",  # (a signature's tag)
            "blas_pool._run_jobs-88.py311.nbi", "chunked.cpython-311.pyc", f"x_{other}.txt",
            f"step_{other}-12.py311.nbi.tmp"]
    stale = [f"chunked._causal_forward_{other}-237.py311.nbi", f"chunked._causal_forward_{other}-237.py311.1.nbc",
             f"threaded._trampoline_serial_0a1b2c3d4e_{other}-152.py311.nbi",
             f"gating.linattn_vector_gate_scores_float32_{other}-338.py310.12.nbc"]
    for name in keep + stale:
        (tmp_path / name).write_text("")
    assert _jit.prune_stale_cache(str(tmp_path)) == len(stale)
    assert sorted(os.listdir(tmp_path)) == sorted(keep)
    (tmp_path / stale[0]).write_text("")
    assert _jit.prune_stale_cache(str(tmp_path)) == 0  # once per directory and process
    assert _jit.prune_stale_cache(str(tmp_path / "missing")) == 0


# Two processes compile two signatures of one kernel at once, each stopped in Numba's cache save, after it
# read the cache index, until the other has read it too (then the first process's data file written last):
# the way two service workers on a fresh machine can meet there.
_SAVE_RACE = """
import os, sys, time
import numpy as np
from numba.core import caching

me, other, barrier, dtype = sys.argv[1:]
index_file = caching.IndexDataCacheFile
save, load_index, save_data = index_file.save, index_file._load_index, index_file._save_data


def saving(self, *args):
    self.saving = True
    try:
        return save(self, *args)
    finally:
        self.saving = False


def loading_index(self):
    index = load_index(self)
    if getattr(self, "saving", False) and "reverse_sums" in self._index_name:
        open(os.path.join(barrier, me), "w").close()
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(barrier, other)) and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3 if me == "b" else 0)  # b writes its index after a's ...
    return index


def saving_data(self, name, data):
    time.sleep(0.6 if me == "a" and "reverse_sums" in name else 0)  # ... a its data after b's
    return save_data(self, name, data)


index_file.save, index_file._load_index, index_file._save_data = saving, loading_index, saving_data
from linattn.cpu.gate_sums import reverse_sums

reverse_sums.get(np.dtype(dtype), "C")
"""

_LOAD_BOTH = """
import numpy as np
from linattn.cpu.gate_sums import reverse_sums

rng = np.random.default_rng(0)
rq, rk, rows = rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 3))
lengths = np.array([5, 3])
want = np.zeros((2, 5, 3))
for h in range(2):
    for t in range(lengths[h]):
        want[h, t] = rows[h] + (rq[h, t:lengths[h]] - rk[h, t:lengths[h]]).sum(0)
for dtype in (np.float32, np.float64):
    kernel = reverse_sums.get(np.dtype(dtype), "C")
    dlam, totals = np.zeros((2, 5, 3), dtype), np.zeros(2)
    kernel(rq, rk, rows, lengths, dlam, totals)  # (a kernel of another signature: a TypeError here)
    np.testing.assert_allclose(dlam, want, rtol=1e-6)
    print(np.dtype(dtype).name, "hits", sum(kernel.stats.cache_hits.values()),
          "misses", sum(kernel.stats.cache_misses.values()))
"""


def _run(code, env, *args, cwd=None):
    res = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                         timeout=600, check=False, cwd=cwd)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_processes_compiling_at_once_keep_each_others_kernels(tmp_path):
    # Numba's cache index lists a function's signatures and is read, extended and written back without
    # a lock: with one index for both signatures, both processes took data file 1, the index named the
    # float32 kernel's file last and the float64 kernel's code was in it (or the other way round), so
    # every later process loaded the wrong kernel for one dtype. Each signature has an index of its own.
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    racers = [subprocess.Popen([sys.executable, "-c", _SAVE_RACE, me, other, str(barrier), dtype], env=env,
                               stderr=subprocess.PIPE, text=True)
              for me, other, dtype in (("a", "b", "float32"), ("b", "a", "float64"))]
    for racer in racers:
        _, err = racer.communicate(timeout=600)
        assert racer.returncode == 0, err
    assert sorted(os.listdir(barrier)) == ["a", "b"]  # both stopped in the save: they met there
    assert _run(_LOAD_BOTH, env) == ["float32", "hits", "1", "misses", "0", "float64", "hits", "1", "misses", "0"]


_STAMP_PROBE = "from linattn import _jit; print(_jit.SOURCE_STAMP, _jit.cache_tag('a signature'))"


def test_other_tunings_share_the_source_stamp_not_the_tag():
    # Code of the same sources compiled for another tuning (or machine) is not stale: the cache tag keeps
    # it apart, and the pruning of other sources' files leaves it (a cache directory machines share, or
    # LINATTN_TUNE_CPU set for one process, would otherwise delete each other's kernels in turn). The tuning
    # named is that of the CPU Numba compiles for, which every CPU accepts (it has its own tuning flags: "znver2"
    # failed the import on a Xeon).
    (host_stamp, host_tag), (tuned_stamp, tuned_tag) = (
        _run(_STAMP_PROBE, dict(os.environ, LINATTN_TUNE_CPU=cpu)) for cpu in ("host", _tuning._cpu()))
    assert host_stamp == tuned_stamp == _jit.SOURCE_STAMP
    assert host_tag != tuned_tag


def test_numbas_code_settings_have_tags_of_their_own():
    # Numba's cache keys leave out its settings that change the code: kernels compiled under NUMBA_OPT=0 (a
    # debugging run) were loaded by every later process of that version (B1 H8 N2048 6.5 ms instead of 2.8),
    # and NUMBA_BOUNDSCHECK=1 would leave its checks in them. Each setting has tags of its own; the same
    # settings, the same tag.
    base = {key: value for key, value in os.environ.items()  # (Numba's defaults, whatever this run sets)
            if key not in {"NUMBA_" + name for name in _jit._CODEGEN_SETTINGS} | {"NUMBA_DEBUGINFO"}}
    tags = {name: _run(_STAMP_PROBE, dict(base, **env))[1]
            for name, env in (("default", {}), ("again", {}), ("O0", {"NUMBA_OPT": "0"}),
                              ("checked", {"NUMBA_BOUNDSCHECK": "1"}), ("no slp", {"NUMBA_SLP_VECTORIZE": "0"}))}
    assert tags["default"] == tags["again"]
    assert len({tags[name] for name in ("default", "O0", "checked")}) == 3
    assert tags["no slp"] == tags["default"]  # (Numba's default: a setting set to its default value)


_CHECKED = """
import numpy as np, linattn
from linattn import reference
q, k, v = (np.random.default_rng(seed).standard_normal((2, 70, 3)) for seed in range(3))
print(float(np.max(np.abs(linattn.linear_attention(q, k, v) - reference.masked(q, k, v, causal=False)))))
"""


def test_calls_run_under_numbas_bounds_checks():
    # NUMBA_BOUNDSCHECK=1 (a user debugging their own Numba code) compiles linattn's kernels with bounds checks
    # too: the non-causal forward raised IndexError (a view of a head's segment parts where a call has none, at
    # an index past the end of an array with no rows, read by no one). The whole suite passes under it.
    assert float(_run(_CHECKED, dict(os.environ, NUMBA_BOUNDSCHECK="1"))[0]) < 1e-12


_NO_COMPILER = """
import numpy as np, linattn
q = np.ones((1, 2, 8, 4))
state = linattn.State.zeros((1, 2), 4, 4)
calls = (lambda: linattn.causal_linear_attention(q, q, q), lambda: linattn.linear_attention(q, q, q),
         lambda: linattn.step(q[:, :, 0], q[:, :, 0], q[:, :, 0], state),
         lambda: linattn.causal_linear_attention_vjp(q, q, q))
for call in calls:
    try:
        call()
        print("ran")
    except RuntimeError as exc:
        print("NUMBA_DISABLE_JIT" in str(exc) and "unset it" in str(exc))
print(np.allclose(linattn.reference.masked(q, q, q), 1))
"""


def test_calls_without_numbas_compiler_say_why():
    # NUMBA_DISABLE_JIT=1 (set to debug one's own Numba code as Python) leaves linattn's kernels, built of compiled
    # pieces, unable to run: each call failed with an AttributeError from inside the cache's setup. It raises a
    # RuntimeError that names the setting; the NumPy references still run.
    assert _run(_NO_COMPILER, dict(os.environ, NUMBA_DISABLE_JIT="1")) == ["True"] * 5


_INDEX_PROBE = """
import numpy as np, linattn
from linattn.feature_maps import as_map

for dtype in (np.float32, np.float64):
    x = np.linspace(-1, 1, 12, dtype=dtype).reshape(3, 4)
    linattn.step(x[:2, :3], x[:2, :3], x[:2], linattn.State.zeros((2,), 3, 4, dtype))
    linattn.step(x[:2, :3], x[:2, :3], x[:2], linattn.State.zeros((2,), 3, 4, dtype), decay=0.5)
    as_map("silu").vjp(x, x)  # (a threaded kernel: its worker, trampoline and launcher)
from linattn.cpu import blas_pool
print(blas_pool._compiled is not None)  # (the BLAS pool's callback and loop: where NumPy's OpenBLAS calls back)
"""


def _index_entries(path):
    """The entries (signature and machine keys) of a Numba cache index file."""
    import pickle

    with open(path, "rb") as f:
        pickle.load(f)  # (Numba's version)
        _, entries = pickle.loads(f.read())
    return entries


def test_every_cache_index_holds_one_signature(tmp_path):
    # What keeps processes that compile at once apart (above), for every kind of compiled function:
    # kernels of two dtypes and two variants, a threaded kernel's parts, the C functions, the thread pool.
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    pool = _run(_INDEX_PROBE, env) == ["True"]
    indexes = list(tmp_path.rglob("*.nbi"))
    names = " ".join(p.name for p in indexes)
    for part in ("_step_nd_serial_", "_elementwise_vjp_", "_trampoline_serial_", "_launch_serial_",
                 "_run_generic_", "linattn_small_gemm_") + (("_jobs_share_", "_callback_serial_") if pool else ()):
        assert part in names
    assert len([p for p in indexes if "_step_nd_serial_" in p.name]) >= 4  # two dtypes, with and without decay
    assert {p.name: len(_index_entries(p)) for p in indexes} == {p.name: 1 for p in indexes}


def _scaled_sum(x, s):
    acc = 0.0
    for i in range(x.shape[0]):
        acc += x[i]
    return acc * s


def test_helpers_are_linked_only_into_their_kernels():
    # A helper's code is optimised and emitted inside the kernels that call it, never alone (most of
    # a cold first call's LLVM time was helpers' code thrown away); kernels that call it work, a
    # call from Python is refused with a TypeError.
    from linattn._linkonly import PIPELINE

    assert PIPELINE is not None, "this Numba lacks the internals the link-only helpers use"
    helper = _jit.njit(helper=True)(_scaled_sum)

    @numba.njit
    def kernel(x):
        return helper(x, 2.0) + helper(x[1:], 1.0)

    x = np.arange(5.0)
    assert kernel(x) == 2 * 10 + 10
    library = helper.overloads[helper.signatures[0]].library
    assert type(library).__name__ == "_LinkOnlyLibrary"
    assert library.get_pointer_to_function(helper.overloads[helper.signatures[0]].fndesc.llvm_func_name) == 0
    try:
        helper(x, 2.0)
    except TypeError as exc:
        assert "jitted" in str(exc)
    else:
        raise AssertionError("expected TypeError")


def test_helpers_compile_the_usual_way_without_the_pipeline(monkeypatch):
    monkeypatch.setattr(_jit, "PIPELINE", None)
    helper = _jit.njit(helper=True)(_scaled_sum)

    @numba.njit
    def kernel(x):
        return helper(x, 3.0)

    assert kernel(np.arange(4.0)) == 18.0
    assert type(helper.overloads[helper.signatures[0]].library).__name__ != "_LinkOnlyLibrary"


_LITERAL_PROBE = """
import importlib, pkgutil
import numpy as np, linattn, linattn.cpu
from numba.core import types
from numba.core.registry import CPUDispatcher
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 3, 50, 16)).astype(np.float32) for _ in range(3))
out, vjp = linattn.causal_linear_attention_vjp(q, k, v)
vjp(out)
linattn.linear_attention(q, k, v)
helpers, extra = set(), []
for m in pkgutil.iter_modules(linattn.cpu.__path__):
    for name, obj in vars(importlib.import_module("linattn.cpu." + m.name)).items():
        if isinstance(obj, CPUDispatcher) and obj.targetoptions.get("no_cpython_wrapper") and obj.signatures:
            helpers.add(name)
            plain = [tuple(types.unliteral(a) for a in sig) for sig in obj.signatures]
            extra += [name] * (len(plain) - len(set(plain)))
print(len(helpers), sorted(set(extra)))
"""


def test_no_helper_compiles_again_for_a_constant_argument(tmp_path):
    # Numba types a constant argument (False, 0) as a literal and compiles the helper once more for
    # it (0.3-0.6 s each on a cold first call): kernels pass bool(False), int(0) (see _jit.njit). In a
    # new process with an empty cache, so that the kernels compile rather than load.
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", _LITERAL_PROBE], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert res.returncode == 0, res.stderr
    count, extra = res.stdout.split(maxsplit=1)
    assert int(count) > 20  # the helpers were compiled (not loaded with their kernels from a cache)
    assert extra.strip() == "[]"


_MAP_PROBE = """
import numba, numpy as np
from linattn.cpu import mapfns
print(mapfns.address(np.float32, mapfns.T2R) != 0)
print(numba.njit(lambda x: x + 1)(1))  # (LLVM links what is pending when the next code is finalised)
"""


def test_a_cached_map_function_finds_the_products_it_calls(tmp_path):
    # The learned maps' C function calls small_gemm's products by symbol. Compiled, it registers
    # them in its typing; loaded from the disk cache it only names them: the first call of a new
    # process that took its address before any kernel (the forward or step with a T2R, Hedgehog or
    # Performer map) aborted the process ("LLVM ERROR: Symbol not found").
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    for _ in range(2):  # compiled and cached, then loaded from the cache
        res = subprocess.run([sys.executable, "-c", _MAP_PROBE], env=env, capture_output=True, text=True,
                             timeout=600, check=False)
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == ["True", "2"]


def test_an_older_numba_is_refused_by_name():
    """Numba 0.60 failed calls on several threads with a TypeError from its dispatcher: importing linattn
    with it (or older) says which version it needs and found instead."""
    for version in ("0.60.0", "0.60.1+dev", "0.59.1", "0.9.0"):
        with pytest.raises(ImportError, match=rf"linattn needs Numba 0\.61 or later, found {re.escape(version)}"):
            _jit._check_numba(version)
    for version in ("0.61.0rc1", "0.61.2", "0.68.1", "0.100.0", "1.0.0"):
        _jit._check_numba(version)
