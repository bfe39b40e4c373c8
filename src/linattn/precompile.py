"""Compile kernels ahead of their first use, into Numba's disk cache (``python -m linattn compile``)."""
import time

import numpy as np

from .attention import causal_linear_attention, linear_attention
from .checks import check_flag
from .decoding import step
from .feature_maps import FeatureMap, as_map
from .gradients import _RECOMPUTED, causal_linear_attention_vjp, linear_attention_vjp
from .state import State

#: What ``precompile`` can compile, in its order.
FUNCTIONS = ("causal", "noncausal", "step")

# Small inputs: (B, H, N) for the sequence calls, H sequences of a step; Dv. A step's batch is made
# large enough for its parallel kernel (decoding.py: from 2**18 state elements).
_SEQ, _HEADS, _DV, _PARALLEL_STEP = (2, 2, 40), 8, 64, 1 << 18


def _inputs(shape, dtype, count=3):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal(shape) * 0.5).astype(dtype) for _ in range(count)]


def _fused_heads(shape, dtype):
    """q, k, v as the heads of one fused projection: strided views (the kernels' "any strides" variant)."""
    b, h, n, d = shape
    qkv, = _inputs((b, n, 3, h, d), dtype, 1)
    return [qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]


def _input_dim(fmap):
    """D for the inputs: 8, or the one a map with weights was made for."""
    for d in (8, *range(1, 4097)):
        try:
            fmap.out_dim(d)
            return d
        except ValueError:
            pass
    raise ValueError(f"feature_map: no input dimension up to 4096 fits {fmap!r}")


def _jobs(dtype, functions, gates, gradients, feature_map):
    """(name, call) pairs for one dtype."""
    fmap = as_map(feature_map)
    d = _input_dim(fmap)
    dk = fmap.out_dim(d)
    q, k, v = _inputs(_SEQ + (d,), dtype)
    lead, n = _SEQ[:2], _SEQ[2]
    fm = dict(feature_map=feature_map)
    gate_pos = -np.full(lead + (n,), 0.1, dtype)
    gate_dim = -np.full(lead + (n, dk), 0.1, dtype)
    jobs = []
    batch = -(-_PARALLEL_STEP // (_HEADS * dk * _DV))  # (sequences whose states take step's parallel kernels)
    if "causal" in functions:
        jobs.append(("causal_linear_attention", lambda: causal_linear_attention(q, k, v, **fm)))
        jobs.append(("causal_linear_attention, strided views",
                     lambda: causal_linear_attention(*_fused_heads(_SEQ + (d,), dtype), **fm)))
        wide = _inputs((batch, _HEADS, 2, d), dtype, 2) + _inputs((batch, _HEADS, 2, _DV), dtype, 1)
        starts = [(tuple(x[..., :2, :] for x in (q, k, v)), State.zeros(lead, dk, v.shape[-1], dtype)),
                  (wide, State.zeros((batch, _HEADS), dk, _DV, dtype))]
        jobs.append(("causal_linear_attention, a few positions from a State",  # (step's kernels, serial and
                     # parallel, into a new state: one position, and several in one call)
                     lambda: [causal_linear_attention(*(x[..., :m, :] for x in xs), initial_state=start,
                                                      return_state=True, **fm)
                              for xs, start in starts for m in (1, 2)]))
        if dtype == np.float32:  # float16 inputs: computed in float32 after a compiled conversion (of
            # arrays of cpu/half.py's MIN_VALUES or more), the output converted back
            q16, k16, v16 = _inputs((2, 2, 256, d), np.float16)
            jobs.append(("causal_linear_attention, float16 inputs",
                         lambda: causal_linear_attention(q16, k16, v16, **fm)))
        if gates:
            jobs.append(("causal_linear_attention, decay", lambda: causal_linear_attention(q, k, v, decay=0.9, **fm)))
            jobs.append(("causal_linear_attention, gate per position",
                         lambda: causal_linear_attention(q, k, v, gate=gate_pos, **fm)))
            jobs.append(("causal_linear_attention, gate per key dimension",
                         lambda: causal_linear_attention(q, k, v, gate=gate_dim, **fm)))
        if gradients:
            jobs.append(("causal_linear_attention_vjp and its vjp",
                         lambda: (lambda o, f: f(o))(*causal_linear_attention_vjp(q, k, v, **fm))))
    if "noncausal" in functions:
        jobs.append(("linear_attention", lambda: linear_attention(q, k, v, **fm)))
        q1, memory = q[..., :1, :], State.zeros(lead, dk, v.shape[-1], dtype)  # (the step kernel, reading)
        jobs.append(("linear_attention, a query over the keys' state",
                     lambda: linear_attention(q1, initial_state=memory, **fm)))
        if gradients:
            jobs.append(("linear_attention_vjp and its vjp",
                         lambda: (lambda o, f: f(o))(*linear_attention_vjp(q, k, v, **fm))))
            if fmap.kernel_code() in _RECOMPUTED:  # (on many values: phi before the kernel, its vjp after)
                jobs.append(("the map and its vjp (linear_attention_vjp's on many values)",
                             lambda: fmap.vjp(q, fmap(q))))
    if "step" in functions:
        qs, ks = _inputs((batch, _HEADS, d), dtype, 2)
        vs, = _inputs((batch, _HEADS, _DV), dtype, 1)
        small = tuple(x[:1] for x in (qs, ks, vs))

        def steps(gate=None, **kw):
            """The step on one sequence (serial kernel) and on a batch (parallel); ``gate(lead)`` gives the
            gate."""
            def run():
                for x, y, z in (small, (qs, ks, vs)):
                    lead = x.shape[:-1]
                    step(x, y, z, State.zeros(lead, dk, _DV, dtype), gate=None if gate is None else gate(lead),
                         **fm, **kw)
            return run

        jobs.append(("step", steps()))
        if gates:
            jobs.append(("step, decay", steps(decay=0.9)))
            jobs.append(("step, gate per sequence", steps(gate=lambda lead: -np.full(lead, 0.1, dtype))))
            jobs.append(("step, gate per key dimension", steps(gate=lambda lead: -np.full(lead + (dk,), 0.1, dtype))))
    return jobs


def _names(x, name):
    """One name (or dtype) or an iterable of them as a list (TypeError otherwise); at least one."""
    if isinstance(x, (str, np.dtype, type)):  # one name, dtype or scalar type (np.float32)
        return [x]
    want = f"{name}: expected a name or a sequence of names"
    if isinstance(x, (bytes, dict, np.ndarray)):
        raise TypeError(f"{want}, got {type(x).__name__}")
    try:
        names = list(x)
    except TypeError:
        raise TypeError(f"{want}, got {type(x).__name__}") from None
    wrong = [n for n in names if not isinstance(n, (str, np.dtype, type))]
    if wrong:
        raise TypeError(f"{want}, got an item {wrong[0]!r}")
    if not names:
        raise ValueError(f"{want}, got none")
    return names


def precompile(dtypes=("float32",), functions=FUNCTIONS, *, gates=False, gradients=False, feature_map="elu",
               progress=None):
    """Compile the kernels of the common calls now, into Numba's disk cache, so that a later process
    loads them (about 0.4 s) instead of compiling on its first call (10-15 s each).

    For a service's image or start-up: the cache is kept per machine (Numba recompiles where the
    CPU differs) in the package's ``__pycache__`` or ``NUMBA_CACHE_DIR``. A process that cannot write
    the package's ``__pycache__`` (the service's own user, a read-only filesystem) still loads what was
    compiled there.

    Parameters
    ----------
    dtypes : sequence of {"float32", "float64"}
        The computation dtypes (float16 inputs compute in float32).
    functions : sequence of {"causal", "noncausal", "step"}
        ``causal_linear_attention`` (C-contiguous inputs, strided views such as the heads of a fused
        projection, a few positions from a State (a decoding loop through it), and with float32 float16
        inputs), ``linear_attention`` (also one query over the keys' state: a decoding step's
        cross-attention) and ``step`` (serial and parallel kernels).
    gates : bool
        Also the variants with ``decay=``, a gate per position and a gate per key dimension.
    gradients : bool
        Also ``causal_linear_attention_vjp`` / ``linear_attention_vjp`` and their backward.
    feature_map : str or FeatureMap
        The map to compile for (a map of cpu/mapfns.py also compiles its family's function).
    progress : callable, optional
        Called as ``progress(name, seconds)`` after each item.

    Returns
    -------
    list of (str, float)
        What was compiled (or loaded from the cache) and the seconds it took.

    Examples
    --------
    >>> import linattn
    >>> done = linattn.precompile(["float64"], ["step"])
    >>> [name for name, _ in done]
    ['step float64']
    """
    dtypes, functions = (_names(x, name) for x, name in ((dtypes, "dtypes"), (functions, "functions")))
    gates, gradients = check_flag(gates, "gates"), check_flag(gradients, "gradients")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress: expected a callable progress(name, seconds) or None, got {type(progress).__name__}")
    kinds = []
    for dt in dtypes:
        try:
            kind = np.dtype(dt)
        except TypeError:
            kind = None
        if kind not in (np.float32, np.float64):
            raise ValueError(f"dtypes: expected float32 or float64, got {dt!r}")
        kinds.append(kind)
    unknown = [f for f in functions if f not in FUNCTIONS]
    if unknown:
        raise ValueError(f"functions: expected some of {', '.join(map(repr, FUNCTIONS))}, got {list(functions)!r}")
    fmap = as_map(feature_map)  # (a clear error for a bad one)
    if not isinstance(fmap, FeatureMap):
        raise TypeError("feature_map: expected a name or a linattn.feature_maps map (a callable maps the inputs "
                        "first: its calls use the identity map's kernels, feature_map='identity')")
    _input_dim(fmap)
    done = []
    for kind in kinds:
        for name, job in _jobs(kind.type, tuple(functions), gates, gradients, feature_map):
            t = time.perf_counter()
            job()
            item = (f"{name} {kind.name}", time.perf_counter() - t)
            done.append(item)
            if progress is not None:
                progress(*item)
    return done
