"""Which CPU LLVM tunes linattn's compiled code for, and the code libraries that say so to LLVM.

Numba compiles for the host's CPU: its features (AVX-512, FMA, ...) and LLVM's tuning for that CPU model
(instruction scheduling, unrolling, costs). On an AMD Zen 4 (LLVM's ``znver4``) that tuning makes linattn's
kernels 2-4% slower than Zen 3's tuning with the same features (docs/performance.md, stops 57-58).
So on a Zen 4 linattn's own functions carry LLVM's ``"tune-cpu"`` attribute for Zen 3 (``znver3``): the same
instructions are allowed (the features stay the host's), only their choice and order change. Nothing
else changes: not Numba's CPU name, not the user's own compiled code. Elsewhere the tuning stays the
host's and nothing here takes part.

The tuning must have the host's tuning flags (LLVM's X86 "Tuning*" features; Zen 3's and Zen 4's agree:
the kernels keep the same calls either way): LLVM inlines a function into another only where their flags
agree, and Numba's own helpers, linked into linattn's kernels, keep the host's. With Ice Lake's flags on a
Zen 4 the exp and Numba's ``min()`` stayed calls in the kernels, 4x slower. So the choice is checked
before the first kernel compiles (:func:`inlines`, a few ms): where LLVM would not inline, the host's
tuning stays (``tests/test_tuning.py`` checks that check, and the calls a tuned kernel leaves).

``LINATTN_TUNE_CPU`` overrides the choice (read at import): an LLVM CPU name to tune for (``znver2``,
``znver3``, ...; one LLVM does not know, or whose flags differ, fails the import with a ValueError), or
``host`` for the host's own tuning. Where ``NUMBA_CPU_NAME`` is set, Numba's choice stands and linattn adds nothing.

This uses Numba's ``pipeline_class`` option and its code library class (``JITCodeLibrary``); where a
Numba version lacks what it needs, :data:`PIPELINE` is None and nothing is tuned.
"""
import os
import re

from llvmlite import binding as llvm_binding
from numba.core import config

#: The tuning used on hosts whose own LLVM tuning was measured slower, by LLVM's name for the host.
TUNINGS = {"znver4": "znver3"}

_NAME = re.compile(r"[a-z][a-z0-9_.-]*")


def choose(host, numba_cpu_name=None, override=None):
    """The CPU name to tune for on ``host`` (LLVM's name of the host CPU), or None for the host's own
    tuning: ``override`` (``LINATTN_TUNE_CPU``) where given, none where Numba's CPU name is set, else
    :data:`TUNINGS`. Raises ValueError for an override that is not a CPU name."""
    if override is not None and override.strip():
        name = override.strip().lower()
        if name == "host":
            return None
        if not _NAME.fullmatch(name):
            raise ValueError(f"LINATTN_TUNE_CPU must be an LLVM CPU name (such as 'znver3') or 'host', "
                             f"got {override!r}")
        return name
    if numba_cpu_name:
        return None
    return TUNINGS.get(host)


def _cpu():
    """LLVM's name of the CPU Numba compiles for (``NUMBA_CPU_NAME`` or the host's)."""
    return config.CPU_NAME or llvm_binding.get_host_cpu_name()


def _machine(opt=2):
    """An LLVM target machine for the CPU and features Numba compiles for."""
    llvm_binding.initialize_native_target()
    llvm_binding.initialize_native_asmprinter()
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else \
        llvm_binding.get_host_cpu_features().flatten()
    return llvm_binding.Target.from_default_triple().create_target_machine(cpu=_cpu(), features=features, opt=opt)


def check_known(name):
    """Raise ValueError naming ``LINATTN_TUNE_CPU`` where LLVM does not know the CPU ``name`` (it would only
    print a warning for every function it compiles, and tune for nothing)."""
    module = llvm_binding.parse_assembly(f'define void @f() "tune-cpu"="{name}" {{\n  ret void\n}}')
    machine = _machine()
    read, write = os.pipe()  # (LLVM warns on the process's stderr)
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to read LLVM's warning from (nor to print it on): unchecked
        os.close(read)
        os.close(write)
        return
    os.dup2(write, 2)
    try:
        machine.emit_object(module)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write)
    warned = os.read(read, 1 << 16)
    os.close(read)
    if f"'{name}' is not a recognized processor".encode() in warned:
        raise ValueError(f"LINATTN_TUNE_CPU: LLVM {'.'.join(map(str, llvm_binding.llvm_version_info))} does not "
                         f"know the CPU {name!r}; expected one of its CPU names (this CPU is {_cpu()!r}) or 'host'")


def inlines(name):
    """Whether LLVM inlines a function with the host's tuning into one tuned for ``name`` (their tuning flags
    agree), as the kernels need: Numba's own helpers keep the host's. None where this llvmlite cannot
    run LLVM's optimisation passes the way this check does."""
    module = llvm_binding.parse_assembly(  # (no pointers: LLVM 15 spells them otherwise)
        "define linkonce_odr i64 @callee(i64 %x) {\n  %y = mul i64 %x, 3\n  ret i64 %y\n}\n"
        f'define i64 @caller(i64 %x) "tune-cpu"="{name}" {{\n  %y = call i64 @callee(i64 %x)\n  ret i64 %y\n}}')
    try:
        options = llvm_binding.create_pipeline_tuning_options(speed_level=3)
        builder = llvm_binding.create_pass_builder(_machine(opt=3), options)
        builder.getModulePassManager().run(module, builder)
    except (AttributeError, TypeError):  # pragma: no cover - an llvmlite with another interface
        return None
    return "@callee" not in str(module.get_function("caller"))


_tuned = []  # [the tuning in effect], once known (tune_cpu)


def _chosen():
    """:data:`CHOSEN` for this process; an override (``LINATTN_TUNE_CPU``) checked at once."""
    override = os.environ.get("LINATTN_TUNE_CPU")
    name = choose(llvm_binding.get_host_cpu_name(), config.CPU_NAME, override)
    if name is not None and override is not None and override.strip():
        check_known(name)
        if inlines(name) is False:
            raise ValueError(f"LINATTN_TUNE_CPU: {name!r} has other tuning flags than this CPU ({_cpu()!r}), so "
                             "LLVM would not inline Numba's helpers into linattn's kernels (several times "
                             "slower); expected a CPU of the same family or 'host'")
        _tuned.append(name)
    return name


#: The tuning chosen for this process (None: the host's); in effect once :func:`tune_cpu` finds LLVM inlines
#: across it (an override is checked at import).
CHOSEN = _chosen()


def tune_cpu():
    """The CPU linattn's code is tuned for in this process, or None: :data:`CHOSEN`, where LLVM inlines
    functions with the host's tuning into it (:func:`inlines`, checked once, when first needed: the first
    kernel compiled, not one loaded from the disk cache; nothing at import)."""
    if not _tuned:
        _tuned.append(CHOSEN if CHOSEN and inlines(CHOSEN) else None)  # (LLVM's flags differ: the host's)
    return _tuned[0]


def describe():
    """The CPU Numba compiles for (LLVM's name) and the tuning linattn's code takes, in words."""
    return f"{_cpu()}, linattn's code tuned as {tune_cpu()}" if tune_cpu() else _cpu()


def mark(ir_module, cpu=None):
    """Give every function defined in ``ir_module`` (an llvmlite.ir Module) the ``"tune-cpu"`` attribute
    for ``cpu`` (default :func:`tune_cpu`; None: nothing)."""
    cpu = tune_cpu() if cpu is None else cpu
    if cpu:
        for fn in ir_module.functions:
            if not fn.is_declaration:
                set.add(fn.attributes, f'"tune-cpu"="{cpu}"')  # llvmlite lists no valued attributes


try:
    from numba.core.codegen import JITCodeLibrary
    from numba.core.compiler import CompilerBase, DefaultPassBuilder
    from numba.core.compiler_machinery import LoweringPass, register_pass
    from numba.core import typed_passes
except ImportError:  # pragma: no cover - a Numba without these internals
    JITCodeLibrary = None


if JITCodeLibrary is not None:
    class TunedLibrary(JITCodeLibrary):
        """A code library whose functions carry linattn's tuning (see :func:`mark`)."""

        def add_ir_module(self, ir_module):
            mark(ir_module)
            super().add_ir_module(ir_module)

    @register_pass(mutates_CFG=False, analysis_only=False)
    class _TunedStart(LoweringPass):
        """Before lowering: the function's code goes to a tuned library (cached like Numba's own)."""
        _name = "linattn_tuned_start"

        def __init__(self):
            LoweringPass.__init__(self)

        def run_pass(self, state):
            if state.library is None:
                state.library = TunedLibrary(state.targetctx.codegen(), state.func_id.func_qualname)
                state.library.enable_object_caching()
            return True

    class TunedCompiler(CompilerBase):
        """Numba's nopython pipeline, its code in a :class:`TunedLibrary`."""

        def define_pipelines(self):
            pm = DefaultPassBuilder.define_nopython_pipeline(self.state)
            pm.add_pass_after(_TunedStart, typed_passes.AnnotateTypes)
            pm.finalize()
            return [pm]
else:  # pragma: no cover
    TunedLibrary = TunedCompiler = None

#: The pipeline of linattn's kernels and C functions (``pipeline_class``), or None: the host's tuning.
PIPELINE = TunedCompiler if CHOSEN else None
