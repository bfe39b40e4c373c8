"""NumPy's and SciPy's OpenBLAS run their threaded work on Numba's pool once linattn has started it
(cpu/blas_pool.py): same results, OpenBLAS's own threads idle, safe across threads and fork()."""
import ctypes
import errno
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import pytest
from llvmlite import ir
from numba import carray, cfunc, types

import linattn
from linattn.cpu import blas_pool, runtime

_PROBE = r"""
import os, sys, threading, time
import numpy as np
from threadpoolctl import threadpool_info
numpy_blas = {x["filepath"] for x in threadpool_info() if x.get("internal_api") == "openblas"}  # (before SciPy's)
try:
    import scipy.linalg  # its own OpenBLAS, when installed: shared too
except ImportError:
    scipy = None
rng = np.random.default_rng(0)
a = rng.standard_normal((700, 600)); b = rng.standard_normal((600, 800))
a32, b32 = a.astype(np.float32), b.astype(np.float32)
m = a @ a.T + 600 * np.eye(700)
def ops():
    extra = [scipy.linalg.blas.sgemm(1.0, a32, b32)] if scipy else []
    return [a @ b, a32 @ b32, np.linalg.solve(m, a[:, :5]), a.T @ a[:, 0]] + extra
before = ops()
def cpu(tid):
    f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])
blas_threads = [int(t) for t in os.listdir("/proc/self/task") if int(t) != threading.get_native_id()]
import linattn
linattn.causal_linear_attention(*(np.ones((1, 2, 64, 8), np.float32),) * 3)  # starts Numba's pool
from linattn.cpu import runtime
shared = runtime.blas_sharing()
after = ops()
print("identical", all(np.array_equal(x, y) for x, y in zip(before, after)))
print("shared", sorted(os.path.basename(p).split("-")[0] for p, ok in shared.items() if ok))
print("numpy_shared", any(ok and p in numpy_blas for p, ok in shared.items()))  # (the BLAS of the timed a32 @ b32)
time.sleep(0.3)  # until OpenBLAS's threads, busy with `before`, have stopped spinning
t0 = {t: cpu(t) for t in blas_threads}
for _ in range(40):
    a32 @ b32
time.sleep(0.2)  # OpenBLAS's own threads would still spin here
print("own_thread_ticks", sum(cpu(t) - t0[t] for t in blas_threads))
"""


def _probe(**env):
    full = dict(os.environ, **env)
    res = subprocess.run([sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr
    return dict(line.split(" ", 1) for line in res.stdout.strip().splitlines())


def test_blas_runs_on_numbas_pool_with_the_same_results():
    if not sys.platform.startswith("linux"):
        pytest.skip("reads per-thread CPU time from /proc")
    out = _probe()
    if out["numpy_shared"] != "True":  # (SciPy's may share: NumPy 1.24's OpenBLAS 0.3.21 beside SciPy 1.15's)
        pytest.skip("this NumPy's BLAS does not share Numba's pool (an OpenBLAS before 0.3.27, or the workqueue layer)")
    assert out["identical"] == "True"
    assert int(out["own_thread_ticks"]) <= 2  # OpenBLAS's own threads did (next to) nothing
    own = _probe(LINATTN_SHARE_BLAS_THREADS="0")
    assert own["shared"] == "[]" and own["identical"] == "True"
    assert int(own["own_thread_ticks"]) > 5  # without sharing they work, then spin


def test_every_openblas_loaded_by_the_start_shares_the_pool():
    """SciPy's OpenBLAS, which Numba loads with linattn's compiled callback where SciPy is installed
    (after NumPy's was shared), shares the pool too: otherwise its threads were its own, and
    ``python -m linattn info`` told the user to set OPENBLAS_THREAD_TIMEOUT. On Numba's workqueue layer
    (what Numba runs without OpenMP or TBB), which takes parallel work from one thread at a time, none
    shares it."""
    code = ("import numpy as np\n"
            "from threadpoolctl import threadpool_info\n"
            "numpy_blas = {x['filepath'] for x in threadpool_info() if x.get('internal_api') == 'openblas'}\n"
            "import linattn, numba\n"
            "from linattn.cpu import blas_pool, runtime\n"
            "runtime.start_threads()\n"
            "libs = [x['filepath'] for x in threadpool_info() if x.get('internal_api') == 'openblas'\n"
            "        and x.get('num_threads', 1) > 1 and blas_pool._setter(x['filepath']) is not None]\n"
            "shared = [p for p, ok in runtime.blas_sharing().items() if ok]\n"
            "print(len(libs), sorted(libs) == sorted(shared), any(p in numpy_blas for p in shared), len(shared),\n"
            "      numba.threading_layer())\n"
            "import scipy\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    if "No module named 'scipy'" in res.stderr:
        pytest.skip("SciPy is not installed")
    assert res.returncode == 0, res.stderr
    count, same, numpy_shares, nshared, layer = res.stdout.split()
    if layer not in ("omp", "tbb"):
        assert nshared == "0", res.stdout
        return
    if runtime.num_threads() > 1 and numpy_shares == "True":  # (NumPy's OpenBLAS 0.3.27 or later: NumPy 2)
        assert int(count) == 2, res.stdout  # NumPy's and SciPy's
    assert same == "True", res.stdout


_WHERE_SHARED = pytest.mark.skipif(blas_pool._platform() is None,
                                   reason="the callback runs jobs on pthreads (shared on Linux and macOS only)")


def _sharable_openblas():
    """Paths of the loaded OpenBLAS libraries that have the threads callback's setter."""
    return [path for path, api in runtime._threaded_blas() if api == "openblas" and blas_pool._setter(path)]


def test_blas_is_shared_on_linux_and_macos_only(monkeypatch):
    """The callback compiles in pthreads constants of Linux and macOS (a static mutex's initializer, the
    monotonic clock's id): elsewhere every BLAS keeps its own threads."""
    libs = _sharable_openblas()
    if not libs:
        pytest.skip("no loaded OpenBLAS has the threads callback (OpenBLAS 0.3.27 or later)")
    for name, shared in [("linux", True), ("darwin", True), ("freebsd14", False), ("win32", False),
                         ("cygwin", False)]:
        monkeypatch.setattr(sys, "platform", name)
        assert blas_pool.sharable(libs) == {path: shared for path in libs}, name


def test_the_callbacks_mutex_starts_as_each_platforms_static_initializer():
    """PTHREAD_MUTEX_INITIALIZER: all zero on Linux; on macOS the signature _PTHREAD_MUTEX_SIG_init
    (0x32AAABA7) in its first word, without which pthread_mutex_lock fails (EINVAL) and locks nothing.
    The compiled callback's global holds this platform's."""
    assert blas_pool._mutex_bytes("linux") == bytes(64)
    darwin = blas_pool._mutex_bytes("darwin")
    assert int.from_bytes(darwin[:8], "little") == 0x32AAABA7 and darwin[8:] == bytes(56)
    if blas_pool._platform() is None:
        pytest.skip("the pool is not shared on this platform")
    module = ir.Module()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), []), "f")
    blas_pool._mutex(ir.IRBuilder(fn.append_basic_block()))
    assert bytes(module.get_global("linattn_blas_pool_mutex").initializer.constant) == blas_pool._mutex_bytes()


@_WHERE_SHARED
def test_the_callbacks_mutex_locks():
    """This platform's pthreads locks a mutex of those initial bytes and refuses it to a second try."""
    libc = ctypes.CDLL(None, use_errno=True)
    mutex = ctypes.create_string_buffer(blas_pool._mutex_bytes(), 64)
    assert libc.pthread_mutex_trylock(mutex) == 0
    assert libc.pthread_mutex_trylock(mutex) == errno.EBUSY
    assert libc.pthread_mutex_unlock(mutex) == 0
    assert libc.pthread_mutex_trylock(mutex) == 0
    assert libc.pthread_mutex_unlock(mutex) == 0


def _child_matmul(seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((500, 500))
    return float((a @ a).sum())


def test_fork_after_sharing():
    # GNU OpenMP does not survive fork(): a forked child gets OpenBLAS's own threads back.
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork() here")
    linattn.causal_linear_attention(*(np.ones((1, 2, 64, 8), np.float32),) * 3)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        got = pool.map(_child_matmul, [1, 2, 3])
    assert got == [_child_matmul(s) for s in (1, 2, 3)]


def test_threads_calling_blas_and_kernels_at_once():
    rng = np.random.default_rng(0)
    mats = [rng.standard_normal((400, 400)).astype(np.float32) for _ in range(6)]
    expected = [m @ m for m in mats]
    q = rng.standard_normal((2, 4, 300, 16)).astype(np.float32)
    att = linattn.causal_linear_attention(q, q, q)

    def work(i):
        return mats[i] @ mats[i], linattn.causal_linear_attention(q, q, q)

    with ThreadPoolExecutor(max_workers=4) as ex:
        for _ in range(3):
            for (mm, a), e in zip(ex.map(work, range(6)), expected):
                np.testing.assert_array_equal(mm, e)
                np.testing.assert_array_equal(a, att)


@cfunc(types.void(types.int32, types.CPointer(types.int64), types.int32))
def _waiting_job(job, data, numjobs):
    """A job as OpenBLAS's threaded GEMM's: it waits for every other job to run (here at most 5 s, then
    it fails). data: [jobs arrived, jobs failed, ran job 0, ran job 1, ...]."""
    state = carray(data, 2 + numjobs)
    blas_pool._arrive(state, 0)
    start = blas_pool._now_ns()
    while blas_pool._arrived(state, 0) < numjobs:
        if blas_pool._now_ns() - start > 5_000_000_000:
            blas_pool._arrive(state, 1)
            return
    blas_pool._arrive(state, 2 + job)


def _callback(numjobs, state):
    """OpenBLAS's call of linattn's callback: void (int sync, dojob, int numjobs, size_t elsize, void
    *jobdata, int dojob_data), here every job with the same data (elsize 0)."""
    runtime.start_threads()
    fn = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p,
                          ctypes.c_int)(blas_pool._address(numba.threading_layer()))
    fn(1, _waiting_job.address, numjobs, 0, state.ctypes.data, numjobs)


@_WHERE_SHARED
@pytest.mark.parametrize("numjobs, numba_threads", [
    (2, 2),  # Numba's pool has a thread for each job
    (4, 1),  # it has fewer: jobs 1..3 on threads of their own
])
def test_jobs_that_wait_for_each_other_all_run_at_once(numjobs, numba_threads):
    state = np.zeros(2 + numjobs, np.int64)
    before = numba.get_num_threads()
    numba.set_num_threads(min(numba_threads, numba.config.NUMBA_NUM_THREADS))
    try:
        _callback(numjobs, state)
    finally:
        numba.set_num_threads(before)
    assert state[0] == numjobs and state[1] == 0
    assert list(state[2:]) == [1] * numjobs


@numba.njit
def _on_pool(numjobs, params, claims, tids):
    blas_pool._on_pool(numjobs, params, claims, tids)


@_WHERE_SHARED
def test_jobs_on_a_team_smaller_than_them_all_run_at_once():
    # the pool's loop on a team of one thread (as a nested region's), asked to run three jobs: the
    # first waits for the others to be taken, then starts them on threads of their own
    runtime.start_threads()
    blas_pool._resolve_team_size(numba.threading_layer())  # as sharing a BLAS does
    blas_pool._resolve_jobs()
    numjobs = 3
    state = np.zeros(2 + numjobs, np.int64)
    params = np.array([[_waiting_job.address, job, state.ctypes.data, numjobs] for job in range(numjobs)], np.int64)
    claims, tids = np.zeros(numjobs + 1, np.int64), np.zeros(numjobs, np.int64)
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        _on_pool(np.int32(numjobs), params.ravel(), claims, tids)
    finally:
        numba.set_num_threads(before)
    assert state[0] == numjobs and state[1] == 0
    assert list(state[2:]) == [1] * numjobs
    assert list(claims[:numjobs]) == [1, 2, 2]  # job 0 on the pool, the others on threads of their own


_FEWER_THREADS = r"""
import sys
import numba, numpy as np
from threadpoolctl import threadpool_limits
import linattn
linattn.causal_linear_attention(*(np.ones((1, 2, 64, 8), np.float32),) * 3)  # starts Numba's pool
rng = np.random.default_rng(0)
a, b = rng.standard_normal((600, 500)).astype(np.float32), rng.standard_normal((500, 700)).astype(np.float32)
expected = a.astype(np.float64) @ b.astype(np.float64)
numba.set_num_threads(1)  # fewer Numba threads than OpenBLAS's
np.testing.assert_allclose(a @ b, expected, rtol=1e-4, atol=1e-3)
numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
with threadpool_limits(numba.config.NUMBA_NUM_THREADS + 2):  # more OpenBLAS threads than Numba's pool
    np.testing.assert_allclose(a @ b, expected, rtol=1e-4, atol=1e-3)
print("shared", any(linattn.cpu.runtime.blas_sharing().values()))
"""


def test_blas_with_fewer_numba_threads_than_its_own():
    # OpenBLAS's jobs wait for each other: run one after another on too few of Numba's threads, a
    # matmul never returned (numba.set_num_threads(1), then `a @ b`).
    res = subprocess.run([sys.executable, "-c", _FEWER_THREADS], capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr
    if res.stdout.split()[-1] != "True":
        pytest.skip("this NumPy's BLAS does not share Numba's pool (an OpenBLAS before 0.3.27, or the workqueue layer)")


@pytest.mark.parametrize("value, off", [("0", True), (" OFF ", True), ("no", True), ("False", True), ("1", False),
                                        ("on", False), ("YES", False), ("", False), (None, False)])
def test_the_switch_reads_its_values(monkeypatch, value, off):
    if value is None:
        monkeypatch.delenv("LINATTN_SHARE_BLAS_THREADS", raising=False)
    else:
        monkeypatch.setenv("LINATTN_SHARE_BLAS_THREADS", value)
    assert blas_pool.turned_off() is off


@pytest.mark.parametrize("value", ["maybe", "2", "-"])
def test_the_switch_names_itself_for_another_value(monkeypatch, value):
    # (read as "share" before: a typo like LINATTN_SHARE_BLAS_THREADS=of kept sharing without a word)
    monkeypatch.setenv("LINATTN_SHARE_BLAS_THREADS", value)
    with pytest.raises(ValueError, match=f"LINATTN_SHARE_BLAS_THREADS: expected 0 or 1 .*got '{value}'"):
        blas_pool.turned_off()
