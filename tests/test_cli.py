"""`python -m linattn info | bench | compile` work and print what they promise."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from linattn import cli


def test_info_subprocess():
    res = subprocess.run([sys.executable, "-m", "linattn", "info", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    facts = json.loads(res.stdout)
    for key in ("linattn", "numpy", "numba", "cpu", "threads", "threading_layer", "cache_dir", "cuda", "cpu_quota",
                "linattn_threads", "threads_cap_by"):
        assert key in facts
    assert facts["threads"] >= 1 and 1 <= facts["linattn_threads"] <= facts["threads"]
    assert facts["threading_layer"] in ("omp", "tbb", "workqueue")


@pytest.mark.parametrize("env, why", [
    ({"NUMBA_THREADING_LAYER": "workqueue"}, "on Numba's omp or tbb threading layer; this process runs workqueue"),
    ({"LINATTN_SHARE_BLAS_THREADS": "0"}, "(LINATTN_SHARE_BLAS_THREADS=0 is set)"),
    ({"NUMBA_THREADING_LAYER": "workqueue", "LINATTN_SHARE_BLAS_THREADS": "1"}, "this process runs workqueue"),
])
def test_info_says_why_an_openblas_keeps_its_threads(env, why):
    """An OpenBLAS that could share linattn's pool but does not: `info` advises OPENBLAS_THREAD_TIMEOUT and
    says why, not "use OpenBLAS 0.3.27 or later" to a user who has it."""
    from linattn.cpu import blas_pool, runtime

    sharable = [path for path, api in runtime._threaded_blas() if api == "openblas" and blas_pool._setter(path)]
    if not sharable or blas_pool._platform() is None:
        pytest.skip("no threaded OpenBLAS 0.3.27 or later here")
    full = {name: value for name, value in os.environ.items() if name != "LINATTN_SHARE_BLAS_THREADS"}
    res = subprocess.run([sys.executable, "-m", "linattn", "info", "--json"], capture_output=True, text=True,
                         timeout=300, env=dict(full, **env))
    assert res.returncode == 0, res.stderr
    facts = json.loads(res.stdout)
    advice = [line for line in facts["advice"] or () if os.path.basename(sharable[0]) in line]
    assert len(advice) == 1 and "OPENBLAS_THREAD_TIMEOUT=4" in advice[0] and why in advice[0], facts
    assert "0.3.27" not in advice[0]


def test_info_text(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "threading_layer" in out and "numba" in out


def test_bench_quick():
    buf = io.StringIO()
    rows = cli.bench(quick=True, progress=False, stream=buf)
    assert len(rows) == len(cli.QUICK_CASES)
    for row in rows:
        assert row["max_rel_err"] < 1e-5
        assert row["linattn_ms"] > 0 and row["gemm_ms"] > 0
    text = buf.getvalue()
    assert "x GEMM" in text and "speed-up" in text
    from linattn import _tuning
    from linattn.cpu import cpu_quota, runtime
    from linattn.cpu.runtime import num_threads

    quota = f", a CPU quota of {cpu_quota.cpus():g}" if runtime.cap_source == "CPU quota" else ""
    threads = f"{num_threads()} thread{'' if num_threads() == 1 else 's'}"
    assert f"This machine: {os.cpu_count()} CPUs ({_tuning.describe()}{quota}); linattn on {threads} (" in text, text


def test_bench_times_after_its_warm_up_calls(monkeypatch):
    """The timed calls come after the warm-up calls (the first calls on many threads fault in memory), and
    last at least ``min_seconds`` (and ``repeat`` calls), at most ``most`` calls or ``budget`` seconds."""
    clock = []
    monkeypatch.setattr(cli.time, "perf_counter", lambda: clock.pop(0))
    calls = []

    def timed(times, **kwargs):
        clock[:], calls[:] = times, []
        best = cli._time(lambda: calls.append(1), **kwargs)
        assert not clock  # every reading of the clock used
        return best, len(calls)

    # the warm-up's start (read without a warm-up too) and the clock after each of its calls; then the
    # timing's start and (before, after) each timed call
    assert timed([0.0, 0.0, 0.0, 0.0, 10.0, 10.0, 15.0, 20.0, 22.0], repeat=2, warmup=3) == (2.0, 5)
    # the warm-up stops at WARMUP_SECONDS
    assert timed([0.0, 1.0, 10.0, 10.0, 11.0], repeat=1, warmup=50) == (1.0, 2)
    # min_seconds: calls go on (past repeat) until 3 s have passed
    four = [0.0, 0.0, 0.0, 1.0, 1.0, 1.5, 1.5, 1.75, 2.0, 3.5]
    assert timed(four, repeat=2, min_seconds=3.0, budget=1e9) == (0.25, 4)
    # ... at most ``most`` of them
    assert timed([0.0, 0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0], repeat=2, min_seconds=1e9, most=3, budget=1e9) == (1.0, 3)
    # ... and none after ``budget`` seconds once two calls are in
    assert timed([0.0, 0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0], repeat=5, budget=2.5) == (1.0, 3)


@pytest.mark.parametrize("advice", [None, ["a BLAS keeps threads of its own"]])
def test_bench_times_linattn_and_the_gemm_in_turn_where_no_blas_keeps_threads(monkeypatch, advice):
    """With every BLAS on linattn's pool (no advice) each case's linattn call and GEMM are timed in turn;
    otherwise linattn for every case first, then the GEMMs."""
    monkeypatch.setattr(cli, "_blas_report", lambda: ([], advice))
    seen = []
    inner = cli._best_times

    def spy(fns, **kwargs):
        seen.append(len(fns))
        return inner(fns, **kwargs)

    monkeypatch.setattr(cli, "_best_times", spy)
    buf = io.StringIO()
    rows = cli.bench(cases=[(1, 2, 64, 8), (1, 1, 32, 4)], progress=False, stream=buf)
    timing = seen[:2] if advice is None else seen[:4]  # (then the references, one at a time)
    assert timing == ([2, 2] if advice is None else [1, 1, 1, 1]) and set(seen[len(timing):]) == {1}
    for row in rows:
        assert row["timed"] == ("in turn" if advice is None else "apart")
        assert row["linattn_ms"] > 0 and row["gemm_ms"] > 0 and row["max_rel_err"] < 1e-5
    assert ("in turn with linattn" if advice is None else "after linattn") in buf.getvalue()


def test_bench_cli_case(capsys):
    assert cli.main(["bench", "--case", "1,2,64,8", "--no-progress", "--json"]) == 0
    out = capsys.readouterr().out
    assert "B=1 H=2 N=64 D=8" in out
    assert json.loads(out.strip().splitlines()[-1])[0]["case"] == "B=1 H=2 N=64 D=8"


@pytest.mark.parametrize("bad", ["1,2,3", "a,b,c,d", "1,2,0,4"])
def test_bench_bad_case(bad):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--case", bad])
    assert exc.value.code == 2


@pytest.mark.parametrize("rounds", [None, 3])
def test_bench_model_quick(rounds):
    from linattn.benchmarks import model

    buf = io.StringIO()
    extra = {} if rounds is None else {"rounds": rounds}
    rows, results = model.run(quick=True, stream=buf, with_torch=False, **extra)
    assert [r["case"] for r in rows] == [name for name, _, _ in model.QUICK_PREFILLS]
    for r in rows:
        assert r["numpy_prefill_tok_s"] > 0 and r["numpy_decode_tok_s"] > 0
        assert r["in_model_over_alone_calls"] > 0 and 0 < r["attention_share"] < 1
        timed = results["numpy"]["rows"][f"linattn {r['case']}"]  # the calls' own time, not with minus without
        assert r["attention_share"] == pytest.approx(timed["attention_in_model_s"] / timed["prefill_s"])
        low, high = r["in_model_over_alone_model_interval"]
        assert low <= r["in_model_over_alone_model"] <= high and r["rounds"] == (rounds or 9)
    for row in results["numpy"]["rows"].values():  # every model timed that many times
        assert len(row["prefill_all_s"]) == (rounds or 9)
    assert "prefill tokens/s" in buf.getvalue() and "torch not installed" in buf.getvalue()
    assert f"over {rounds or 9} rounds" in buf.getvalue() and "95% interval" in buf.getvalue()


def test_bench_model_rounds_option(monkeypatch, capsys):
    from linattn.benchmarks import model

    seen = []
    monkeypatch.setattr(model, "run", lambda **kwargs: seen.append(kwargs) or ([], {}))
    assert cli.main(["bench", "--model", "--rounds", "40"]) == 0
    assert cli.main(["bench", "--model"]) == 0
    assert seen == [{"quick": False, "rounds": 40}, {"quick": False}]
    for bad in (["--model", "--rounds", "1"], ["--rounds", "5"], ["--model", "--rounds", "x"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench"] + bad)
        assert exc.value.code == 2
        assert "--rounds" in capsys.readouterr().err


def test_median_interval():
    from linattn.benchmarks.model import median_interval

    assert median_interval([3.0] * 7, scale=2.0) == (1.5, 1.5, 1.5)  # no spread: no width
    values = np.random.default_rng(3).normal(10.0, 1.0, 400)
    med, low, high = median_interval(values)
    assert med == np.median(values) and low < med < high
    assert 9.7 < low and high < 10.3  # the median of 400 draws of N(10, 1): within ~0.15 of 10
    wide = median_interval(values[:9])
    assert wide[2] - wide[1] > high - low  # fewer rounds, a wider interval
    assert median_interval(values) == (med, low, high)  # seeded
    with pytest.raises(ValueError, match="values"):
        median_interval([])


def test_summarize_pairs_each_round_with_its_own_alone_time():
    """Attention's cost inside the model is each round's (with - without) over that round's calls alone:
    a machine that drifts slows all three alike and moves no ratio."""
    from linattn.benchmarks.model import summarize

    alone = [0.010, 0.020, 0.013, 0.030, 0.011]  # the machine's speed drifts from round to round
    skip = [0.5 + 10 * a for a in alone]
    with_attention = [s + 1.1 * a for s, a in zip(skip, alone)]
    rows = {"linattn c": {"batch": 2, "n": 8, "prefill_s": float(np.median(with_attention)),
                          "prefill_all_s": with_attention, "decode_s": 0.001, "attention_in_model_s": 0.012,
                          "attention_alone_s": float(np.median(alone)), "attention_alone_all_s": alone},
            "skip c": {"batch": 2, "n": 8, "prefill_s": float(np.median(skip)), "prefill_all_s": skip,
                       "decode_s": 0.001}}
    (row,) = summarize({"numpy": {"rows": rows}})
    assert row["in_model_over_alone_model"] == pytest.approx(1.1)
    assert row["in_model_over_alone_model_interval"] == pytest.approx([1.1, 1.1])
    assert row["rounds"] == 5 and row["in_model_over_alone_calls"] == pytest.approx(0.012 / 0.013)


def test_bench_model_logits_agree_with_pytorch():
    pytest.importorskip("torch")
    from linattn.benchmarks import model

    rows, _ = model.run(quick=True, stream=io.StringIO(), with_torch=True)
    for r in rows:  # the PyTorch chunked model computes the same function
        assert r["logits_max_rel_diff"] < 1e-5
        assert r["torch_chunked_prefill_tok_s"] > 0 and r["torch_sdpa_decode_tok_s"] > 0


@pytest.mark.parametrize("piece", [None, 1000])
@pytest.mark.parametrize("layout", ["flat", "rows", "strided"])
def test_model_gelu_is_the_tanh_form(monkeypatch, piece, layout):
    import warnings

    import numpy as np

    from linattn.benchmarks import transformer
    from linattn.benchmarks.transformer import gelu_

    if piece is not None:  # pieces of 1000 elements: several, the last one partial
        monkeypatch.setattr(transformer, "GELU_PIECE", piece)
    x = np.concatenate([np.linspace(-12, 12, 4801), [-200.0, -60.0, 0.0, 60.0, 200.0], np.zeros(34)])
    ref = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    whole = x.astype(np.float32)
    u = {"flat": whole, "rows": whole.reshape(40, 121),
         "strided": np.repeat(whole.reshape(40, 121), 2, axis=1)[:, ::2]}[layout]
    with warnings.catch_warnings():  # no warning (exp overflows for u < -10), in place
        warnings.simplefilter("error")
        got = gelu_(u)
    assert got is u and got.dtype == np.float32
    np.testing.assert_allclose(got.reshape(-1), ref, rtol=2e-6, atol=1e-6 * np.abs(ref).max())


def test_compile_lists_what_it_compiled(capsys):
    assert cli.main(["compile", "--dtype", "float64", "--function", "step", "--gates"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" s  ")[1] for line in out[:-1]] == [
        "step float64", "step, decay float64", "step, gate per sequence float64",
        "step, gate per key dimension float64"]
    assert out[-1].startswith("4 items in ")


@pytest.mark.parametrize("args, message", [(["--dtype", "float16"], "invalid choice"),
                                           (["--function", "all"], "invalid choice"),
                                           (["--feature-map", "tanh"], "unknown name 'tanh'")])
def test_compile_bad_arguments(capsys, args, message):
    with pytest.raises(SystemExit):
        cli.main(["compile", *args])
    assert message in capsys.readouterr().err


def test_precompile_bad_arguments():
    import linattn

    with pytest.raises(ValueError, match="dtypes: expected float32 or float64"):
        linattn.precompile(["int8"])
    with pytest.raises(ValueError, match="functions: expected some of"):
        linattn.precompile(["float32"], ["backward"])
    with pytest.raises(TypeError, match="dtypes: expected a name or a sequence of names, got NoneType"):
        linattn.precompile(None)
    with pytest.raises(TypeError, match="feature_map: expected a name or a linattn.feature_maps map"):
        linattn.precompile(feature_map=lambda x: x)
    with pytest.raises(ValueError, match="feature_map: unknown name"):
        linattn.precompile(feature_map="tanh")
    # all checked before anything compiles: no list of names to iterate, no item taken for a name
    for bad, message in (({}, "dtypes: expected a name or a sequence of names, got dict"),
                         (np.ones(2), "dtypes: expected a name or a sequence of names, got ndarray"),
                         ([1.0], "dtypes: expected a name or a sequence of names, got an item 1.0"),
                         ([], "dtypes: expected a name or a sequence of names, got none")):
        with pytest.raises(TypeError if "none" not in message else ValueError, match=message):
            linattn.precompile(bad)
    with pytest.raises(TypeError, match=r"functions: expected a name or a sequence of names, got an item \('step',\)"):
        linattn.precompile(["float32"], [("step",)])
    with pytest.raises(ValueError, match="functions: expected a name or a sequence of names, got none"):
        linattn.precompile(["float32"], ())
    for option in ("gates", "gradients"):
        for bad in ("yes", 1, np.ones(2)):
            with pytest.raises(TypeError, match=f"{option}: expected True or False, got {type(bad).__name__}"):
                linattn.precompile(["float32"], ["step"], **{option: bad})
    with pytest.raises(TypeError, match=r"progress: expected a callable progress\(name, seconds\) or None, got str"):
        linattn.precompile(["float32"], ["step"], progress="print")


_LOAD_PROBE = """
import numpy as np, linattn
from linattn.cpu import chunked
x = np.random.default_rng(0).standard_normal((1, 4, 300, 16))  # another shape than precompile's
linattn.linear_attention(x, x, x)
stats = chunked.noncausal_forward.get(np.dtype(np.float64), "C").worker.stats
print("hits", sum(stats.cache_hits.values()), "misses", sum(stats.cache_misses.values()))
"""


def test_compile_fills_the_cache_a_new_process_loads(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-m", "linattn", "compile", "--dtype", "float64", "--function",
                          "noncausal"], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr
    assert "linear_attention float64" in res.stdout and "in Numba's disk cache" in res.stdout
    res = subprocess.run([sys.executable, "-c", _LOAD_PROBE], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["hits", "1", "misses", "0"]


def test_precompile_a_map_with_weights():
    # the inputs take the D the map's weights were made for (here 5, not precompile's usual 8)
    import linattn
    from linattn import feature_maps as fm

    done = linattn.precompile(["float64"], ["step", "noncausal"], feature_map=fm.T2R(np.ones((5, 3))))
    assert [name for name, _ in done] == ["linear_attention float64",
                                          "linear_attention, a query over the keys' state float64", "step float64"]


def test_precompile_covers_a_decoding_loop_through_the_sequence_function():
    # a causal call of a few positions from a State runs step's kernel that writes a new state (a variant of its
    # own): precompile's "causal" compiles it, so the decoding loop's first call loads it from the cache
    import linattn
    from linattn.cpu import step as step_kernels

    done = linattn.precompile(["float64"], ["causal"])
    assert "causal_linear_attention, a few positions from a State float64" in [name for name, _ in done]
    for positions in (False, True):  # (one position, and several in one call)
        assert (np.dtype(np.float64), (2, 0, False, False, True, positions)) in step_kernels.step_nd_serial._compiled


def test_commands_without_numbas_compiler_say_why():
    # NUMBA_DISABLE_JIT=1: info gives the versions and says why nothing else (it ended in a traceback), bench and
    # compile stop with that line.
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    res = subprocess.run([sys.executable, "-m", "linattn", "info", "--json"], capture_output=True, text=True,
                         env=env, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    facts = json.loads(res.stdout)
    assert facts["numba"] and len(facts["advice"]) == 1 and "NUMBA_DISABLE_JIT is set" in facts["advice"][0]
    for command in ("bench", "compile"):
        res = subprocess.run([sys.executable, "-m", "linattn", command], capture_output=True, text=True, env=env,
                             timeout=300, check=False)
        assert res.returncode == 1 and "Traceback" not in res.stderr
        assert res.stderr.startswith(f"python -m linattn {command}: ") and "NUMBA_DISABLE_JIT is set" in res.stderr


def test_info_says_when_numba_compiles_for_another_cpu():
    # NUMBA_CPU_NAME=generic (set for a cache that machines share) compiles linattn's kernels without this CPU's
    # vector instructions: 3.1x slower on a Zen 4. info says so, and only then.
    for name, told in (("generic", True), ("host", False), (None, False)):
        env = {key: value for key, value in os.environ.items() if key != "NUMBA_CPU_NAME"}
        env.update({} if name is None else {"NUMBA_CPU_NAME": name})
        res = subprocess.run([sys.executable, "-m", "linattn", "info", "--json"], capture_output=True, text=True,
                             env=env, timeout=600, check=False)
        assert res.returncode == 0, res.stderr
        advice = json.loads(res.stdout)["advice"] or []
        assert any(line.startswith("NUMBA_CPU_NAME=generic: ") for line in advice) == told, (name, advice)


@pytest.mark.parametrize("command", ["info", "bench"])
@pytest.mark.parametrize("variable, value", [("LINATTN_SHARE_BLAS_THREADS", "maybe"), ("LINATTN_NUM_THREADS", "0")])
def test_commands_name_a_bad_variable_in_one_line(command, variable, value):
    # (they ended in a traceback from the thread pool's start)
    res = subprocess.run([sys.executable, "-m", "linattn", command], capture_output=True, text=True,
                         env=dict(os.environ, **{variable: value}), timeout=300, check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith(f"python -m linattn {command}: {variable}: expected ") and repr(value) in res.stderr
