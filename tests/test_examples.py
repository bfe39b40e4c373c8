"""The examples run (with their small/fast flags)."""
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script,args", [("quickstart.py", ["--small"])])
def test_example_runs(script, args, tmp_path):
    res = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                         cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
