"""C functions that kernels call by symbol name: each compiled once per process (and cached on disk),
so that its code is neither copied into every kernel that calls it nor optimised again with each.

Numba optimises and emits the code of a helper again at every level of the kernel that inlines it
(the helper, the segment, the worker, the parallel loop, the kernel): a large helper costs its
compile time several times over, and once more for each kernel variant. small_gemm's products cost a
kernel +7 s that way, the per-dimension gate's scores +3.6 s. As C functions they compile once, in a
second or so, and load from the disk cache after.

``define`` names a Python function (nopython code, its arguments raw pointers and integers) and a
C signature; ``register`` compiles or loads it and makes its symbol known to LLVM. Kernels that call
it must have it registered before they are compiled or loaded from the cache (see _jit.Kernel's
``needs``). ``emit_call`` is the code an intrinsic emits to call it.
"""
import types as pytypes

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba.core import cgutils

from .. import _cache
from .._jit import OPTIONS, SOURCE_STAMP, TUNED, cache_tag

_defined = {}  # symbol -> (name, Python function, signature)
_registered = {}  # symbol -> its compiled cfunc (kept alive: LLVM holds its address)


def define(name, fn, signature):
    """The symbol of ``fn`` compiled for ``signature`` (a Numba function type): ``name`` with a hash of
    linattn's sources, so that a kernel in the disk cache never calls a stale version."""
    symbol = f"linattn_{name}_{SOURCE_STAMP}"
    _defined[symbol] = (name, fn, signature)
    return symbol


def register(symbol):
    """Compile (or load from the disk cache) the function behind ``symbol`` and make the symbol known
    to LLVM; once per process."""
    if symbol in _registered:
        return
    name, fn, signature = _defined[symbol]
    # cached under a name of its own, as the kernels are (_jit.Kernel): Numba's cache checks only
    # the function's own source file, not the helpers it compiles in; the machine's tag keeps one
    # entry a cache index where machines share a cache directory (_jit.cache_tag)
    cache_name = f"linattn_{name}_{cache_tag(str(signature))}_{SOURCE_STAMP}"
    named = pytypes.FunctionType(fn.__code__, fn.__globals__, cache_name, fn.__defaults__, fn.__closure__)
    named.__qualname__ = cache_name
    compiled = _cache.cfunc(named, signature, **OPTIONS, **TUNED)
    llvm_binding.add_symbol(symbol, compiled.address)
    _registered[symbol] = compiled


def address(symbol):
    """The address of the function behind ``symbol`` (compiled or loaded first): for kernels that take
    it as an argument and so need nothing registered before they compile or load."""
    register(symbol)
    return _registered[symbol].address


def emit_call_address(builder, address, values):
    """Emit a call of the function at ``address`` (an LLVM integer) with ``values`` (void result)."""
    fnty = ir.FunctionType(ir.VoidType(), [v.type for v in values])
    builder.call(builder.inttoptr(address, fnty.as_pointer()), values)


def emit_call(builder, symbol, values):
    """Emit a call of the registered function ``symbol`` with LLVM values ``values`` (void result)."""
    fnty = ir.FunctionType(ir.VoidType(), [v.type for v in values])
    builder.call(cgutils.get_or_insert_function(builder.module, fnty, symbol), values)
