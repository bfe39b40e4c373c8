"""Every asv benchmark runs: each one's setup, one quick run (asv's ``--quick``) and teardown for every
combination of its parameters, through asv's own runner classes (asv_runner), at the small sizes of
``LINATTN_ASV_SMOKE=1``, in this process (asv's own smoke run spends about 3 s starting a process for
each benchmark). A benchmark whose setup raises NotImplementedError is skipped, as asv skips it (the
PyTorch one without torch). CI also runs ``asv check`` and three benchmarks through ``asv run``."""
import itertools
import math
import pathlib

import pytest
from asv_runner.discovery import disc_benchmarks, get_benchmark_from_name

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUITE = ROOT / "asv_benchmarks"
MODULES = sorted(p.stem for p in SUITE.glob("bench_*.py"))
QUICK = {"number": 1, "repeat": 1, "warmup_time": 0, "rounds": 1}  # (asv run --quick's)


def _combinations(benchmark):
    return len(list(itertools.product(*benchmark.params))) if benchmark.params else 0


def _check_result(benchmark, result):
    """What asv keeps of a run: a number (track_, mem_, peakmem_), or time_'s samples."""
    if benchmark.type == "time":
        samples = result["samples"]
        assert samples and all(math.isfinite(s) and s >= 0 for s in samples), (benchmark.name, samples)
    else:
        assert isinstance(result, (int, float)) and math.isfinite(result), (benchmark.name, result)


def test_the_suite_is_found():
    assert len(MODULES) >= 10, MODULES


@pytest.mark.parametrize("module", MODULES)
def test_benchmarks_run(module, monkeypatch):
    monkeypatch.setenv("LINATTN_ASV_SMOKE", "1")
    monkeypatch.syspath_prepend(str(ROOT))
    found = [(b.name, _combinations(b)) for b in disc_benchmarks(str(SUITE)) if b.name.startswith(module + ".")]
    from asv_benchmarks import common
    assert common.SMOKE, "asv_benchmarks was imported before LINATTN_ASV_SMOKE was set"
    assert found, f"no benchmark in {module}"
    ran, skipped = 0, []
    for name, count in found:
        for idx in range(count) if count else [None]:
            benchmark = get_benchmark_from_name(str(SUITE), name if idx is None else f"{name}-{idx}", QUICK)
            assert benchmark.setup_cache_key is None, f"{name}: setup_cache is not run here; add it"
            if benchmark.do_setup():  # (True: skipped by NotImplementedError)
                skipped.append((name, idx))
                continue
            try:
                _check_result(benchmark, benchmark.do_run())
                ran += 1
            finally:
                benchmark.do_teardown()
    assert ran, f"every benchmark of {module} skipped: {skipped}"
