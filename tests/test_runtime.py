"""How the CPU kernels are run: the thread pool's start-up and the work schedule."""
import os
import subprocess
import sys

import numba
import numpy as np
import pytest

import linattn

_PROBE = """
import os, numpy as np, numba, linattn
linattn.causal_linear_attention(*(np.ones((2, 2, 40, 4), np.float32) for _ in range(3)))
print("layer", numba.threading_layer())
print("left", os.environ.get("GOMP_SPINCOUNT"))
from linattn.cpu import runtime
print("shared" if any(runtime.blas_sharing().values()) else "own threads")
"""


def _probe(**env):
    full = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    full.update(env, OMP_DISPLAY_ENV="VERBOSE")  # libgomp prints its settings when it starts
    res = subprocess.run([sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr
    if "layer omp" not in res.stdout:
        pytest.skip("the threading layer is not GNU OpenMP")
    return res.stdout, res.stderr


def test_openmp_workers_spin_briefly():
    # Idle workers spinning for GNU OpenMP's default 300,000 turns starve the threads of a BLAS that
    # keeps threads of its own (here: OpenBLAS told not to share Numba's pool).
    out, err = _probe(LINATTN_SHARE_BLAS_THREADS="0")
    assert "GOMP_SPINCOUNT = '1000'" in err
    assert "left None" in out  # the variable was set only while the pool started


def test_openmp_workers_keep_the_default_spin_when_blas_shares_the_pool():
    # NumPy's OpenBLAS runs on the same pool: nothing to starve, and its calls start as fast as
    # they did on OpenBLAS's own spinning threads.
    out, err = _probe()
    if "shared" not in out:
        pytest.skip("this NumPy's BLAS cannot share Numba's pool (not OpenBLAS 0.3.27 or later)")
    assert "GOMP_SPINCOUNT = '300000'" in err
    assert "left None" in out


@pytest.mark.parametrize("var, value, shown", [("GOMP_SPINCOUNT", "123", "GOMP_SPINCOUNT = '123'"),
                                               ("OMP_WAIT_POLICY", "ACTIVE", "OMP_WAIT_POLICY = 'ACTIVE'")])
def test_user_openmp_settings_are_kept(var, value, shown):
    _, err = _probe(**{var: value})
    assert shown in err
    assert "GOMP_SPINCOUNT = '1000'" not in err


def test_dynamic_schedule_is_restored(rng):
    q = rng.standard_normal((3, 4, 70, 8)).astype(np.float32)
    previous = numba.set_parallel_chunksize(5)  # the caller's own setting
    try:
        linattn.causal_linear_attention(q, q, q)
        linattn.linear_attention(q, q, q)
        assert numba.get_parallel_chunksize() == 5
    finally:
        numba.set_parallel_chunksize(previous)


@pytest.mark.parametrize("value, shown", [("1", "threads 1"), ("0", "LINATTN_NUM_THREADS: expected an integer >= 1"),
                                          ("two", "LINATTN_NUM_THREADS: expected an integer >= 1, got 'two'")])
def test_linattn_num_threads_caps_the_kernels(value, shown):
    code = ("import numpy as np, linattn\n"
            "from linattn.cpu import runtime\n"
            "try:\n"
            "    linattn.causal_linear_attention(*np.ones((3, 2, 64, 4)))\n"
            "    print('threads', runtime.num_threads())\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, LINATTN_NUM_THREADS=value))
    assert shown in res.stdout, res.stdout + res.stderr


_FORK_PROBE = """
import multiprocessing as mp, numpy as np, numba, linattn
from linattn.cpu import runtime

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, 1024, 32)).astype(np.float32) for _ in range(3))
qs, ks, vs = (rng.standard_normal((8, 8, 64)).astype(np.float32) for _ in range(3))


def work(_=None):
    out = [linattn.causal_linear_attention(q, k, v)]
    o, f = linattn.causal_linear_attention_vjp(q, k, v)
    out += [o, *f(o)]
    o, f = linattn.linear_attention_vjp(q, k, v)
    out += [o, *f(o)]
    st = linattn.State.zeros((8, 8), 64, 64)  # large enough for the parallel step
    out += [linattn.step(qs, ks, vs, st), st.S]
    return out, runtime.forked_from_openmp, runtime.num_threads()


if __name__ == "__main__":
    ref, forked, threads = work()
    print("layer", numba.threading_layer(), "threads", threads, "forked", forked)
    with mp.get_context("fork").Pool(1) as pool:
        got, forked, threads = pool.map_async(work, [0]).get(timeout=300)[0]
    print("child threads", threads, "forked", forked)
    print("max rel diff", max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got, ref)))
"""


def _gnu_openmp():
    try:
        from numba.np.ufunc import omppool
    except ImportError:
        return False
    return omppool.openmp_vendor == "GNU"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_kernels_run_in_a_child_forked_after_the_pool_started(tmp_path):
    # GNU OpenMP does not survive fork(): Numba terminates a forked child that enters a parallel region,
    # so a multiprocessing pool (fork start method) or a pre-forking server whose parent had run linattn
    # lost its workers (the pool then waited forever). Such a child runs every kernel on its calling
    # thread; the results equal the parent's.
    script = tmp_path / "fork_probe.py"
    script.write_text(_FORK_PROBE)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr
    assert "Terminating" not in res.stderr
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    if lines["layer"].startswith("omp") and _gnu_openmp():
        assert lines["child"] == "threads 1 forked True"
    else:  # fork-safe layers keep their threads
        assert lines["child"].endswith("forked False")
    assert float(lines["max"].split()[-1]) < 1e-5


@pytest.mark.parametrize("threads", [2, 3, 16])
def test_plan_splits_few_heads(monkeypatch, threads):
    """runtime.plan's split of heads into segments: none when the heads fill the threads; one long head
    in two runs with its first segment run whole while the next ones sum their parts (that segment as
    long as prefix_cost of one of theirs), forward and backward; short heads in one run (a second run
    would cost more than it saves)."""
    from linattn.cpu import runtime

    monkeypatch.setattr(runtime, "num_threads", lambda: threads)
    monkeypatch.setattr(runtime, "_plans", {})
    chunk, frac, nthreads, two_runs = runtime.plan(threads * 4, 2048, 64, 64)
    assert (chunk, nthreads, two_runs) == (32, threads, False) and list(frac) == [0, 1]
    backward = dict(prefix=runtime.BACKWARD_PREFIX_COST, work=runtime.BACKWARD_WORK)
    for d, kw in ((64, {}), (128, {}), (64, backward), (128, backward)):
        cost = kw.get("prefix", runtime.prefix_cost(d, d))
        chunk, frac, nthreads, two_runs = runtime.plan(1, 16384, d, d, **kw)
        widths = np.diff(frac)
        assert frac[0] == 0 and frac[-1] == 1 and nthreads == threads and two_runs, kw
        assert len(widths) - 1 == threads  # (segments after the first: the items of each run)
        np.testing.assert_allclose(widths[1:], widths[1])
        np.testing.assert_allclose(widths[0], cost * widths[1])
    if threads == 2:
        _, frac, _, two_runs = runtime.plan(1, 1024, 64, 64)
        assert not two_runs and len(frac) == 3
        np.testing.assert_allclose(frac[1], 1 / (2 - runtime.PREFIX_COST))


def test_prefix_cost_by_head_width(monkeypatch):
    """The forward's prefix cost: PREFIX_COST up to heads of 64 x 64, PREFIX_COST_WIDE more at 128 x 128
    and beyond, in between linearly in log2 of sqrt(dk dv); plan() takes it unless given one."""
    from linattn.cpu import runtime

    monkeypatch.setattr(runtime, "num_threads", lambda: 2)
    monkeypatch.setattr(runtime, "_plans", {})

    base, wide = runtime.PREFIX_COST, runtime.PREFIX_COST + runtime.PREFIX_COST_WIDE
    for dk, dv, want in ((1, 1, base), (16, 16, base), (64, 64, base), (32, 128, base), (128, 128, wide),
                         (64, 256, wide), (512, 512, wide), (96, 96, base + runtime.PREFIX_COST_WIDE * np.log2(1.5))):
        assert runtime.prefix_cost(dk, dv) == pytest.approx(want), (dk, dv)
    one_head = runtime.plan(1, 16384, 128, 128)
    assert one_head[1][1] / (one_head[1][2] - one_head[1][1]) == pytest.approx(wide)
    np.testing.assert_allclose(runtime.plan(1, 16384, 128, 128, prefix=base)[1],
                               runtime._segment_fractions(len(one_head[1]) - 1, False, base, True))


_SIXTEEN = """
import numpy as np, numba, linattn
from linattn.cpu import runtime
rng = np.random.default_rng(0)
for b, h, n, d in ((1, 1, 16384, 32), (1, 2, 4096, 64)):
    q, k, v = ((rng.standard_normal((b, h, n, d)) * 0.5).astype(np.float32) for _ in range(3))
    gate = -np.abs(rng.standard_normal((b, h, n, d))).astype(np.float32) * 0.01
    dout = rng.standard_normal((b, h, n, d)).astype(np.float32)
    got = {}
    for threads, dt in ((16, np.float32), (1, np.float64)):
        numba.set_num_threads(threads)
        x = [a.astype(dt) for a in (q, k, v, gate, dout)]
        start = linattn.causal_linear_attention(*(a[..., :40, :] for a in x[:3]), return_state=True)[1]
        for name, kw in (("plain", {}), ("gated", dict(gate=x[3], initial_state=start))):
            out, vjp = linattn.causal_linear_attention_vjp(*x[:3], **kw)
            got[threads, name] = [out] + [g for g in vjp(x[4]) if isinstance(g, np.ndarray)]
        if threads == 16:
            _, frac, nthreads, two_runs = runtime.plan(b * h, n, d, d)
            print("plan", b * h, nthreads, len(frac) - 1, two_runs)
    for name in ("plain", "gated"):
        for a, want in zip(got[16, name], got[1, name]):
            print("err", name, float(np.max(np.abs(a - want)) / np.max(np.abs(want))))
"""


def test_sixteen_threads_split_heads_as_planned():
    """With 16 threads (more than this machine may have: the split does not depend on the cores), few
    heads are cut into many segments by runtime.plan itself, not a forced plan: the forward and the vjp
    (with a gate per key dimension and an initial state too) match the same calls in float64 on one
    thread, unsplit."""
    env = dict(os.environ, NUMBA_NUM_THREADS="16")
    res = subprocess.run([sys.executable, "-c", _SIXTEEN], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0, res.stderr
    plans = [line.split()[1:] for line in res.stdout.splitlines() if line.startswith("plan")]
    assert plans == [["1", "16", "17", "True"], ["2", "16", "9", "True"]], res.stdout  # (segments a head)
    errors = [float(line.split()[2]) for line in res.stdout.splitlines() if line.startswith("err")]
    assert len(errors) == 2 * (4 + 5) and max(errors) < 2e-5, res.stdout  # (out, dq, dk, dv; and dgate)


@pytest.mark.parametrize("threads", [1, 2, 16])
def test_threads_for_a_second_thread_sooner(monkeypatch, threads):
    """threads_for: one thread per ``per_thread`` units of work, at least one, at most num_threads(); with
    ``second``, two from that much work."""
    from linattn.cpu import projection_grad, runtime

    monkeypatch.setattr(runtime, "num_threads", lambda: threads)
    per, second = 1 << 21, 1 << 17
    assert runtime.threads_for(0, per) == runtime.threads_for(1, per) == runtime.threads_for(per, per) == 1
    assert runtime.threads_for(per + 1, per) == min(threads, 2)
    assert runtime.threads_for(10 * per, per) == min(threads, 10)
    assert runtime.threads_for(second - 1, per, second) == 1
    assert runtime.threads_for(second, per, second) == runtime.threads_for(per, per, second) == min(threads, 2)
    assert runtime.threads_for(5 * per, per, second) == min(threads, 5)
    # the maps through a matrix: Hedgehog D16 m8 on 4096 rows (a training step's q of B8 H4 N128) on two
    assert projection_grad.SECOND_THREAD_WORK <= 4096 * 16 * 8 < projection_grad.WORK_PER_THREAD


@pytest.mark.parametrize("threads", [2, 16])
def test_plan_threads_for_small_calls(monkeypatch, threads):
    """runtime.plan's threads for small calls: a second thread from SECOND_THREAD_WORK multiply-adds of
    chunk products with two heads or more (SECOND_THREAD_WORK_ONE_HEAD for one head cut into segments),
    every thread beyond it from MIN_WORK_PER_THREAD each; the calling thread alone below."""
    from linattn.cpu import runtime

    monkeypatch.setattr(runtime, "num_threads", lambda: threads)
    monkeypatch.setattr(runtime, "_plans", {})

    def work(bh, n, d):
        return bh * n * (d + runtime.chunk_size(n)) * d

    assert work(8, 16, 64) >= runtime.SECOND_THREAD_WORK * 2 and work(8, 16, 64) < runtime.MIN_WORK_PER_THREAD
    assert runtime.plan(8, 16, 64, 64)[2] == 2  # (B1 H8 N16 D64: 24 -> 19-21 us on two threads)
    assert runtime.plan(2, 16, 64, 64)[2] == 1  # (two heads of N16 D64: 12 us on two, 10.5 on one)
    assert work(1, 64, 64) < 2 * runtime.SECOND_THREAD_WORK_ONE_HEAD <= work(1, 256, 64)
    assert runtime.plan(1, 64, 64, 64)[2] == 1  # (one head of N64: 22.5 us in two segments, 19 whole)
    assert runtime.plan(1, 256, 64, 64)[2] == 2
    big = runtime.plan(8, 2048, 64, 64)[2]
    assert big == min(threads, work(8, 2048, 64) // runtime.MIN_WORK_PER_THREAD)
    mid = runtime.plan(8, 128, 64, 64)  # (more than two threads only from MIN_WORK_PER_THREAD each)
    assert mid[2] == max(2, min(threads, work(8, 128, 64) // runtime.MIN_WORK_PER_THREAD))
