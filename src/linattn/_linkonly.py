"""A Numba pipeline for helpers that only kernels call: their code is optimised and emitted inside
each kernel that links it, never on its own.

Numba compiles every jitted function it meets into a library of its own, runs LLVM's full module
optimisation on it and emits its machine code, then links its IR into each caller, where it is
optimised and emitted again. For a helper no one calls from Python, the first optimisation and the
machine code are thrown away: a fifth to a quarter of a cold first causal call (measured: 17.1-18.7
s before, 13.5-13.9 s after, docs/performance.md). Helpers compiled with :data:`PIPELINE` stop after
lowering to IR (function passes only); the kernel's own optimisation inlines and optimises them as
before, so the kernels' code is what it was.

This uses Numba's documented ``pipeline_class`` option, and three private methods of its code
library (``_optimize_final_module``, ``_finalize_final_module``, ``_finalize_dynamic_globals``).
Where a Numba version lacks them, :data:`PIPELINE` is None and helpers compile the usual way.
"""
from functools import cache

try:
    import numba
    from numba import _dynfunc
    from numba.core import typed_passes
    from numba.core.codegen import JITCodeLibrary
    from numba.core.compiler import CompilerBase, DefaultPassBuilder
    from numba.core.compiler_machinery import LoweringPass, register_pass

    _usable = all(hasattr(JITCodeLibrary, name) for name in
                  ("_optimize_final_module", "_finalize_final_module", "_finalize_dynamic_globals"))
except ImportError:  # pragma: no cover - a Numba without these internals
    _usable = False

PIPELINE = None

if _usable:
    from ._tuning import TunedLibrary

    class _LinkOnlyLibrary(TunedLibrary):
        """A helper's code, linked into its callers: not optimised as a module, not emitted."""

        def _optimize_final_module(self):
            pass  # the caller optimises it with its own code

        def _finalize_final_module(self):
            self._finalize_dynamic_globals()
            self._finalized = True  # (no machine code: nothing is added to the execution engine)

    @cache
    def _refusing_code():
        """(address, library): the CPython wrapper of a function raising TypeError, compiled once."""
        def refuse():
            raise TypeError("this linattn helper is compiled only for its kernels: call it from a "
                            "jitted function")

        # (the name Python's argument check reports when the call has arguments)
        refuse.__name__ = refuse.__qualname__ = "linattn_helper_callable_only_from_jitted_code"
        refuse = numba.njit(no_cfunc_wrapper=True)(refuse)
        refuse.compile(())
        compiled = refuse.overloads[()]
        return compiled.library.get_pointer_to_function(compiled.fndesc.llvm_cpython_wrapper_name), compiled.library

    def _refused(lowered):
        """A new entry point for a helper's signature (Numba keys the helper's code by it) that raises
        TypeError when Python calls it."""
        address, library = _refusing_code()
        fndesc = lowered.fndesc
        return _dynfunc.make_function(fndesc.lookup_module(), fndesc.qualname.split(".")[-1],
                                      "linattn helper (kernels only)", address, lowered.env, (library,))

    @register_pass(mutates_CFG=False, analysis_only=False)
    class _LinkOnlyStart(LoweringPass):
        """Before lowering: the helper's library is a link-only one, and lowering emits no code."""
        _name = "linattn_link_only_start"

        def __init__(self):
            LoweringPass.__init__(self)

        def run_pass(self, state):
            state.library = _LinkOnlyLibrary(state.targetctx.codegen(), state.func_id.func_qualname)
            state.flags.no_compile = True
            return True

    @register_pass(mutates_CFG=False, analysis_only=False)
    class _LinkOnlyRegister(LoweringPass):
        """After lowering: callers find the helper (and link its library) through a stand-in entry point
        that refuses calls from Python."""
        _name = "linattn_link_only_register"

        def __init__(self):
            LoweringPass.__init__(self)

        def run_pass(self, state):
            lowered = state["cr"]
            entry = _refused(lowered)
            state.targetctx.insert_user_function(entry, lowered.fndesc, [state.library])
            state["cr"] = lowered._replace(cfunc=entry)
            return True

    class LinkOnlyCompiler(CompilerBase):
        """Numba's nopython pipeline with the two passes above around its lowering."""

        def define_pipelines(self):
            pm = DefaultPassBuilder.define_nopython_pipeline(self.state)
            pm.add_pass_after(_LinkOnlyStart, typed_passes.AnnotateTypes)
            pm.add_pass_after(_LinkOnlyRegister, typed_passes.NativeLowering)
            pm.finalize()
            return [pm]

    PIPELINE = LinkOnlyCompiler
