"""The examples run (with their small/fast flags)."""
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script,args", [("quickstart.py", ["--small"]), ("generate.py", ["--small"]),
                                         ("attention_heatmap.py", ["heat.png"]), ("retnet.py", ["--small"]),
                                         ("dask_zarr.py", ["--small", "--blocks", "4"]),
                                         ("cross_attention.py", ["--small"]), ("padded_batch.py", ["--small"])])
def test_example_runs(script, args, tmp_path):
    res = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                         cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    if script == "attention_heatmap.py":
        assert (tmp_path / "heat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if script == "retnet.py":  # the script exits 1 when the forms disagree
        assert "the three forms agree" in res.stdout
    if script == "dask_zarr.py":  # the script exits 1 when the cluster's result differs from one call
        assert "vs one NumPy call: max relative error" in res.stdout
    if script == "generate.py":
        assert "prefill + steps vs one call" in res.stdout
    if script == "cross_attention.py":  # the script exits 1 when decoding differs from the full form
        assert "prefill + steps vs the full O(N*Nk) form" in res.stdout
    if script == "padded_batch.py":  # the script exits 1 when a sequence's rows differ from its own call
        assert "padding's outputs all 0: True" in res.stdout


def test_machine_check_quick(tmp_path):
    """examples/machine_check.py's five parts run (small sizes) and print their figures."""
    res = subprocess.run([sys.executable, str(EXAMPLES / "machine_check.py"), "--quick"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "threading_layer" in out and out.rstrip().endswith("done"), out
    cases = [line for line in out.splitlines() if line.startswith(("  all threads B", "  8 threads   B"))]
    assert len(cases) == 4 and all(", x GEMM " in line for line in cases), out  # two cases, two thread counts
    assert "issue 10's <= 2.5 in every run: (quick sizes: none)" in out, out
    assert "8x64x64" in out and "64x64x192" in out and "us own: ratios" in out, out
    assert "ms alone:" in out, out
    small = [line for line in out.splitlines() if line.startswith(("  B1 H4 N16 D16 ", "  B1 H1 N64 D16 "))]
    assert len(small) == 2 and all("plan (" in line and "; one " in line and "; all " in line for line in small), out
    assert "the plan more than 10% slower than one or every thread: " in out, out


def test_gpu_check_without_gpu_and_in_simulator(tmp_path):
    script = str(EXAMPLES / "gpu_check.py")
    res = subprocess.run([sys.executable, script, "--tiny"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=600, env={k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no CUDA GPU found" in res.stdout or "not installed" in res.stdout or "OK" in res.stdout
    res = subprocess.run([sys.executable, script, "--tiny"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=600, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"))
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr


@pytest.mark.parametrize("feature_map", ["elu", "hedgehog"])
def test_training_example(tmp_path, feature_map):
    pytest.importorskip("torch")
    res = subprocess.run([sys.executable, str(EXAMPLES / "train_tiny_lm.py"), "--small", "--feature-map", feature_map],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr  # it exits 1 when the losses disagree or do not fall
    assert "the losses agree and fall" in res.stdout
