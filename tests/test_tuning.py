"""linattn's LLVM tuning (_tuning.py): which CPU it tunes for, and that the tuned code is what it should be."""
import os
import platform
import re
import subprocess
import sys

import pytest
from llvmlite import binding, ir

from linattn import _tuning

#: Tests that compile as for a Zen 4 (NUMBA_CPU_NAME=znver4 keeps the host's features: any x86 CPU will do):
#: LLVM knows that name from version 16 (llvmlite 0.44, for Numba 0.61, has LLVM 15).
_ZEN4 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64")
                           or binding.llvm_version_info < (16,), reason="an x86 CPU and LLVM 16 or later")


def _run(code, **env):
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=600, check=False)


def test_choose():
    assert _tuning.choose("znver4") == "znver3"  # (measured 2-4% faster there: docs/performance.md, stop 58)
    for host in ("znver3", "znver5", "skylake-avx512", "haswell", "neoverse-v1", "generic"):
        assert _tuning.choose(host) is None
    assert _tuning.choose("znver4", numba_cpu_name="haswell") is None  # Numba's CPU name set: Numba's choice
    assert _tuning.choose("znver4", override="host") is None
    assert _tuning.choose("znver4", override="  ") == "znver3"  # (empty: as if unset)
    assert _tuning.choose("haswell", override=" Icelake-Server ") == "icelake-server"
    assert _tuning.choose("znver4", numba_cpu_name="haswell", override="znver3") == "znver3"
    for bad in ("znver3; rm", "a b", "\"x\"", "3dnow"):
        with pytest.raises(ValueError, match="LINATTN_TUNE_CPU"):
            _tuning.choose("znver4", override=bad)


def test_a_chosen_tuning_applies_only_where_llvm_inlines_across_it(monkeypatch):
    for inlined, expected in ((True, "znver3"), (False, None), (None, None)):  # (None: could not check)
        monkeypatch.setattr(_tuning, "CHOSEN", "znver3")
        monkeypatch.setattr(_tuning, "_tuned", [])
        monkeypatch.setattr(_tuning, "inlines", lambda name, answer=inlined: answer)
        assert _tuning.tune_cpu() == expected
        assert _tuning.describe().endswith(f"tuned as {expected}") == (expected is not None)
    monkeypatch.setattr(_tuning, "CHOSEN", None)
    monkeypatch.setattr(_tuning, "_tuned", [])
    monkeypatch.setattr(_tuning, "inlines", lambda name: pytest.fail("checked without a choice"))
    assert _tuning.tune_cpu() is None


def test_check_known():
    _tuning.check_known(binding.get_host_cpu_name())  # LLVM knows its own name of this CPU
    with pytest.raises(ValueError, match="LINATTN_TUNE_CPU: LLVM .* does not know the CPU 'zen4'"):
        _tuning.check_known("zen4")  # (LLVM's name is znver4)


def test_an_unknown_cpu_name_fails_the_import_by_name():
    res = _run("import linattn", LINATTN_TUNE_CPU="zen4")
    assert res.returncode != 0
    assert "ValueError: LINATTN_TUNE_CPU: LLVM" in res.stderr and "'zen4'" in res.stderr, res.stderr
    assert "not a recognized processor" not in res.stderr  # (LLVM's own warning, caught)


@_ZEN4
def test_a_tuning_whose_flags_differ_from_the_cpus_is_refused():
    # NUMBA_CPU_NAME=znver4 keeps the host's features: on any x86 CPU Numba then compiles as for a Zen 4
    res = _run("from linattn import _tuning; print(_tuning.inlines('znver4'), _tuning.inlines('znver3'), "
               "_tuning.inlines('icelake-server'), _tuning.tune_cpu())", NUMBA_CPU_NAME="znver4")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "True", "False", "None"]  # (Numba's CPU name set: no tuning of its own)
    res = _run("import linattn", NUMBA_CPU_NAME="znver4", LINATTN_TUNE_CPU="icelake-server")
    assert res.returncode != 0
    assert "ValueError: LINATTN_TUNE_CPU: 'icelake-server' has other tuning flags than this CPU ('znver4')" \
        in res.stderr, res.stderr
    res = _run("from linattn import _tuning; print(_tuning.tune_cpu())", NUMBA_CPU_NAME="znver4",
               LINATTN_TUNE_CPU="znver3")
    assert res.returncode == 0 and res.stdout.split() == ["znver3"], res.stderr


def test_mark_names_the_cpu_on_defined_functions_only():
    module = ir.Module()
    fnty = ir.FunctionType(ir.VoidType(), [])
    declared = ir.Function(module, fnty, "declared")
    defined = ir.Function(module, fnty, "defined")
    ir.IRBuilder(defined.append_basic_block()).ret_void()
    _tuning.mark(module, "znver3")
    text = str(module)
    assert re.search(r'define void @"defined"\(\) "tune-cpu"="znver3"', text), text
    assert "tune-cpu" not in str(declared)
    before = str(module)
    _tuning.mark(module, "")  # (no tuning: nothing added)
    assert str(module) == before


_PROBE = r"""
import re
import numpy as np
from linattn import _tuning
from linattn.cpu import mapfns, symbols
from linattn.feature_maps import Elementwise

y = Elementwise("elu")(np.linspace(-3, 3, 64, dtype=np.float32).reshape(8, 8))
assert np.allclose(y, np.where(np.linspace(-3, 3, 64).reshape(8, 8) > 0, np.linspace(-3, 3, 64).reshape(8, 8) + 1,
                               np.exp(np.linspace(-3, 3, 64).reshape(8, 8))), rtol=1e-6)
worker = mapfns._apply_kernel.get(np.dtype(np.float32), None).worker
text = worker.overloads[worker.signatures[0]].library.get_llvm_str()
calls = sorted({re.sub(r"(?:_[0-9a-f]{10})?_[0-9a-f]{12}(?=B\d|$)|B\d+c8tJT\w*", "", name)  # (cache tag, stamp)
                for name in re.findall(r'call [^@\n]*@"?([\w.$]+)', text)})
cfuncs = [fn.inspect_llvm() for fn in symbols._registered.values()]
print(repr(_tuning.tune_cpu()))
print('"tune-cpu"' in text, all('"tune-cpu"' in t for t in cfuncs), len(cfuncs))
print(" ".join(calls))
"""


@_ZEN4
def test_tuned_kernels_inline_as_the_host_tuned_do(tmp_path):
    # LLVM inlines a function into another only where their tuning flags agree (or the callee's are
    # the caller's, less a list LLVM ignores): Numba's own helpers carry the host's tuning, linattn's
    # functions the chosen one. With another model's flags (icelake-server on a Zen 4) the exp and
    # Numba's min() stayed calls in the kernels (4x slower). Zen 3's and Zen 4's flags are the same, so
    # a kernel tuned for znver3 on a Zen 4 calls exactly what it calls with the host's own tuning.
    # NUMBA_CPU_NAME=znver4 keeps the host's features: this runs on any x86 CPU.
    def probe(tune):
        res = _run(_PROBE, NUMBA_CPU_NAME="znver4", LINATTN_TUNE_CPU=tune,
                   NUMBA_CACHE_DIR=str(tmp_path / tune))  # (compiled, not loaded: the IR is there)
        assert res.returncode == 0, res.stderr
        return res.stdout.splitlines()

    host, tuned = probe("host"), probe("znver3")
    assert host[0] == "None" and host[1].split()[:2] == ["False", "False"]
    assert tuned[0] == "'znver3'" and tuned[1].split()[:2] == ["True", "True"]  # the kernel and C functions
    assert int(tuned[1].split()[2]) >= 1
    assert tuned[2] == host[2]  # the same functions left as calls
    assert "exp" not in tuned[2]
