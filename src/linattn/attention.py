"""The public attention functions: check the inputs, apply a callable feature map, run one kernel,
reshape back."""
import math

import numpy as np

from . import checks
from . import gates as gates_mod
from . import workspace
from ._reshape import view_as
from .cpu import chunked, dynamic, half
from .cpu.runtime import kernel_section, num_threads, plan
from .cpu.views import unit_rows
from .cpu import mapfns
from .cpu.elementwise import IDENTITY
from .decoding import read_state, step_fast
from .feature_maps import NAMED, FeatureMap, as_map
from .state import State

_ndarray, _INF = np.ndarray, math.inf
_CODES = {name: code for name, (_, code) in NAMED.items()}
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_F16, _SINGLE = np.dtype(np.float16), np.dtype(np.float32)
_NO_GATES = {dt: np.zeros(0, dt) for dt in _FLOATS}  # the kernels' "no gates" (and "no map parameters")
_CONSTANT_ONLY = {dt: np.zeros((0, 0), dt) for dt in _FLOATS}  # their "a constant decay alone"
_ZERO_DECAY = np.zeros(0)
_NO_STATUS = np.zeros(3, np.int64)  # a kernel with no gates writes no status: one array for every call
_NO_DEN = {dt: np.zeros((1, 1, 0), dt) for dt in _FLOATS}  # the causal kernel keeps no denominators
_NO_STATES = {dt: np.zeros((1, 1, 0, 1, 1), dt) for dt in _FLOATS}  # ... and no chunk states
_PLAIN = {dt: (_NO_GATES[dt], dt.type(1.0)) for dt in _FLOATS}  # the plain call's "no gates" and scale 1
for _x in list(_NO_GATES.values()) + list(_CONSTANT_ONLY.values()) + [_ZERO_DECAY]:
    _x.setflags(write=False)
# (bh, n) -> lengths all n; (dtype, D', Dv) -> state arrays with no rows; (causal, dtype, D, Dv) -> a plain call's
# constants
_constants = {}


def _full_lengths(bh, n):
    """Read-only int64 lengths all equal to n (the kernels' "no padding")."""
    lens = _constants.get((bh, n))
    if lens is None:
        if len(_constants) > 256:
            _constants.clear()
        lens = _constants[bh, n] = np.full(bh, n, np.int64)
        lens.setflags(write=False)
    return lens


#: A returned state of at least this many bytes starts at a multiple of 64 bytes (the pool's are too), so that
#: the steps that update it in place never load or store a vector across two cache lines (B1 H8 D64, 128 KB:
#: 4.45 us a step against 4.7-4.8); below it the ~2 us of an aligned block outweighs what it saves.
ALIGNED_STATE_BYTES = 64 << 10


def _final_state_arrays(rows, dk, dv, dt):
    """(S, Z) of shapes (rows, dk, dv), (rows, dk) for a kernel to write the final state into: from the
    workspace pool when large (``take_views``). A model keeps each layer's state until its next prompt
    and then drops it; fresh arrays from malloc moved the model's own temporaries onto new pages (1024
    more page faults a prefill at B8 H8 D64, outside the calls), pooled ones are reused in place. From
    ALIGNED_STATE_BYTES on, both start at multiples of 64 bytes."""
    nbytes = rows * dk * (dv + 1) * dt.itemsize
    if nbytes < ALIGNED_STATE_BYTES:
        return np.empty((rows, dk, dv), dt), np.empty((rows, dk), dt)
    if nbytes < workspace.POOL_MIN_BYTES:  # (take_views' own test: ~1.5 us)
        return workspace.aligned_views([(rows, dk, dv), (rows, dk)], dt)
    return workspace.take_views([(rows, dk, dv), (rows, dk)], dt)


def _no_state(dt, dk, dv):
    """(S0, Z0, S_out, Z_out) with no rows: no initial state, and no state to write."""
    found = _constants.get((dt, dk, dv))
    if found is None:
        found = (np.zeros((0, dk, dv), dt), np.zeros((0, dk), dt), np.empty((0, dk, dv), dt), np.empty((0, dk), dt))
        for x in found[:2]:
            x.setflags(write=False)
        _constants[dt, dk, dv] = found
    return found


_NO_PARTS = np.zeros((0, 1, 1, 1))  # the kernels' segments' partial sums, none
# the non-causal kernel's "no initial state" (typed writable there: see cpu/chunked.py's _noncausal_forward)
_NO_INITIAL = {dt: (np.zeros((0, 1, 1), dt), np.zeros((0, 1), dt)) for dt in _FLOATS}


def _initial_for_noncausal(S0, Z0, bh):
    """A checked initial state as the non-causal kernel takes it: C-contiguous (BH, D', Dv), (BH, D'),
    writable (copied where not)."""
    S0, Z0 = (np.ascontiguousarray(_flat(np.asarray(x), bh, t)) for x, t in ((S0, 2), (Z0, 1)))
    return tuple(x if x.flags.writeable else x.copy() for x in (S0, Z0))


def _run(kernel, nthreads, args, parts):
    """Run a kernel (the forward kernels, the causal backward's) with ``args`` (its arguments before
    ``phase``) on ``nthreads`` threads: once (phase 1) when ``parts`` is None, else twice with it: phase
    0, the segments' partial sums of the state, (heads, nseg, D', X) in float64; phase 1, the results
    from them (see cpu/chunked.py). Or once, phase 2, with ``parts`` a tuple (the causal kernels'
    dynamic split: cpu/dynamic.py)."""
    with kernel_section(nthreads):
        if parts is None:
            kernel(nthreads, *args, 1, _NO_PARTS)
        elif isinstance(parts, tuple):
            kernel(nthreads, *args, 2, parts[0])
        else:
            kernel(nthreads, *args, 0, parts)
            kernel(nthreads, *args, 1, parts)


def _parts(two_runs, bh, frac, dk, dv, causal):
    """The segments' partial sums for a kernel that runs twice (causal: [S | Z | log decay], non-causal
    [S | Z] per key dimension), else None."""
    return np.empty((bh, len(frac) - 1, dk, dv + (2 if causal else 1))) if two_runs else None


def _causal_parts(two_runs, bh, n, chunk, frac, dk, dv, nthreads):
    """The causal kernels' parts (the forward's, the backward's) where their plan splits heads: the
    dynamic split's (a tuple: the boundaries' states and marks, the segments' sums; see cpu/dynamic.py)
    where a head has enough segments for it and ``nthreads`` suit it, else the two runs' (``_parts``)."""
    if not two_runs:
        return None
    nseg = dynamic.segments(bh, -(-n // chunk), dk, dv, chunked.FOLD_EVERY, nthreads)
    if nseg < dynamic.MIN_SPLIT:
        return _parts(two_runs, bh, frac, dk, dv, True)
    parts = workspace.empty((bh, 2 * nseg + 1, dk, dv + 2), np.float64)  # (pooled: no page faults a call)
    parts[:, :nseg + 1, 0, -1] = 0  # every boundary's mark: UNTOUCHED (an int64 0 is float 0.0's bits)
    return (parts,)


def _fast_plan(causal, dt, shape, dv, threads, layout, dk, kind=0):
    """Everything a plain call of ``shape`` (q's) passes besides its own arrays, one lookup per call
    (each part was a lookup of its own: ~1.5 us of a tiny call): ``plan``'s (chunk, frac, nthreads) for
    ``threads``, whether the result comes from the workspace pool, the kernel (for arrays of ``layout``:
    "C" or "A"), no gates, scale 1 and, the full lengths (non-causal: the keys', the queries'), (S0, Z0,
    S_out, Z_out) with no rows and, causal, the "keep no denominators / chunk states" arrays; ``dk``: D',
    ``kind``: the gates' (the causal kernel's variant: a gated call's first use compiles no other)."""
    key = (causal, dt, shape, dv, threads, layout, dk, kind)
    found = _constants.get(key)
    if found is None:
        n, d = shape[-2], dk
        bh = math.prod(shape[:-2])
        chunk, frac, nthreads, two_runs = plan(bh, n, d, dv, causal)
        pooled = bh * n * dv * dt.itemsize >= workspace.POOL_MIN_BYTES  # (workspace.empty's own test: ~1 us)
        no_gates, one = _PLAIN[dt]
        if causal:
            kernel = chunked.causal_forward.get(dt, (layout, kind))
            extra = (_full_lengths(bh, n),) + _no_state(dt, d, dv) + (_NO_DEN[dt], _NO_STATES[dt])
        else:
            kernel = chunked.noncausal_forward.get(dt, layout)
            extra = (_full_lengths(bh, n),) * 2 + _NO_INITIAL[dt] + _no_state(dt, d, dv)[2:]
        found = (chunk, frac, nthreads, pooled, kernel, no_gates, one, two_runs) + extra
        if len(_constants) > 256:
            _constants.clear()
        _constants[key] = found
    return found


def _overlaps(out, arrays):
    """Whether ``out`` may share memory with any of ``arrays`` (what a kernel reads while it writes out:
    the result is then computed aside)."""
    for x in arrays:
        if np.may_share_memory(out, x):
            return True
    return False


def _fast_state(state, dt, lead, d, dv, causal):
    """An initial State as the short path passes it to the kernel, (S0, Z0) flat (BH, D, Dv), (BH, D):
    NumPy arrays of ``dt``, C-contiguous, shaped for q's leading dims ``lead`` (non-causal: writable,
    as that kernel types them); None for anything else (the checked path then takes the call)."""
    if type(state) is not State:
        return None
    S0, Z0 = state
    if (type(S0) is not _ndarray or type(Z0) is not _ndarray or S0.dtype != dt or Z0.dtype != dt
            or S0.shape != lead + (d, dv) or Z0.shape != lead + (d,)
            or not (S0.flags.c_contiguous and Z0.flags.c_contiguous)
            or not (causal or (S0.flags.writeable and Z0.flags.writeable))):
        return None
    bh = math.prod(lead)
    return S0.reshape(bh, d, dv), Z0.reshape(bh, d)


def _fast_map(feature_map, dt, d, q, k):
    """(kernel code, parameters, address, D') of a built-in map (by name or as a map object) for inputs of
    ``d`` features in ``dt`` (as ``_features`` gives them); None for a callable, a map that does not fit
    ``d``, or q or k with strides that are not whole elements where the map reads rows by element strides
    (the checked path then copies them, or says what is wrong)."""
    code = _CODES.get(feature_map) if type(feature_map) is str else None  # (elu, relu, identity: D' = D)
    if code is not None:
        return code, _NO_GATES[dt], 0, d
    try:
        fmap = as_map(feature_map)
        if not isinstance(fmap, FeatureMap):
            return None
        found = _map_args(fmap, d, dt)
    except (TypeError, ValueError):
        return None
    if found[0] >= mapfns.FIRST and any(st % dt.itemsize for st in q.strides + k.strides):
        return None
    return found


def _fast_log_decay(decay, lead):
    """A decay's log per sequence (float64, (BH,), read-only) for the short path: a float in (0, 1] or a
    float array of values in (0, 1] shaped like the last of the leading dims ``lead`` (RetNet's one per
    head, ``(H,)``); None for anything else (the checked path then takes it). Kept by value for the
    next call (a model passes the same decay every time: checking an array's values and taking their
    log cost 6 us of a 13.5 us tiny call)."""
    if isinstance(decay, float):
        key = ("decay", float(decay), lead)
    elif (type(decay) is _ndarray and decay.dtype in _FLOATS and decay.ndim <= len(lead)
          and decay.shape == lead[len(lead) - decay.ndim:]):
        key = ("decay", decay.dtype, decay.shape, decay.tobytes(), lead)
    else:
        return None
    found = _constants.get(key)
    if found is None:
        values = np.asarray(decay, np.float64)
        if not ((values > 0) & (values <= 1)).all():
            return None
        found = np.empty(math.prod(lead))
        found.reshape(-1, values.size)[...] = np.log(values.reshape(-1))
        found.setflags(write=False)
        if len(_constants) > 256:
            _constants.clear()
        _constants[key] = found
    return found


def _fast_gates(dt, shape, dk, decay, gate):
    """(kind, gates, log decay) as the causal kernel takes them (gates_mod.prepare's, the gates not yet
    in the kernels' 4-D split) for the short path with q of ``shape`` and dtype ``dt`` and D' = ``dk``
    features: a decay as ``_fast_log_decay`` takes it, a gate of dtype ``dt`` shaped (..., N) or (..., N,
    D') with strides of whole elements; None for anything else (the checked path then takes the call or
    says why)."""
    lead = shape[:-2]
    kind, gates, log_decay = gates_mod.NONE, _NO_GATES[dt], _ZERO_DECAY
    if decay is not None:
        log_decay = _fast_log_decay(decay, lead)
        if log_decay is None:
            return None
        kind, gates = gates_mod.CONSTANT, _CONSTANT_ONLY[dt]
    if gate is not None:
        if type(gate) is not _ndarray or gate.dtype != dt or any(st % dt.itemsize for st in gate.strides):
            return None
        if gate.shape == shape[:-1]:
            kind = gates_mod.SCALAR
        elif gate.shape == shape[:-1] + (dk,):
            kind = gates_mod.VECTOR
        else:
            return None
        gates = gate
        if decay is None:
            log_decay = np.zeros(math.prod(lead))
    return kind, gates, log_decay


def _gates_as_prepared(dt, shape, dk, decay, gate):
    """(kind, gates, log decay) as gates_mod.prepare gives them to the vjp's backward, for a decay and a
    gate that the short path took; gates None for a decay alone (the backward reads them with a gate only)."""
    if decay is None and gate is None:
        return gates_mod.NONE, None, None
    kind, _, log_decay = _fast_gates(dt, shape, dk, decay, gate)
    return kind, gate, None if decay is None else log_decay


def _fast(causal, q, k, v, feature_map, eps, normalize, keep=False, return_state=False, initial_state=None,
          into=None, scale=None, decay=None, gate=None, lengths=None, query_lengths=None):
    """The common call with a minimum of Python around the kernel: NumPy arrays of one float dtype,
    C-contiguous or views of up to 4 dims with unit-stride rows (a fused projection's heads), a built-in
    feature map (by name or as a map object: ``_fast_map``) and, each optional, a State of C-contiguous
    arrays to start from, the final state to return, an ``out=`` array ``into`` of the same kinds apart
    from every input, a float ``scale``, integer ``lengths`` (non-causal: the keys', and
    ``query_lengths``) and, causal, a decay and a gate as ``_fast_gates`` takes them. None for anything
    else, which then takes the checked path (the same kernels; it says what is wrong). Returns ``out`` (``into``
    when given), or ``(out, State)`` with ``return_state``; with ``keep`` (causal only): ``((out, state),
    kept)`` as causal_with_denominators returns them for the backward pass (state None unless
    ``return_state``)."""
    dt = q.dtype
    if (type(k) is not _ndarray or type(v) is not _ndarray or dt not in _FLOATS or k.dtype != dt
            or v.dtype != dt or type(eps) is not float
            or not (normalize is True or normalize is False) or not 0.0 <= eps < _INF
            or not (scale is None or (type(scale) is float and 0.0 < scale < _INF))):
        return None
    shape = q.shape
    if len(shape) < 2 or k.shape != shape or v.shape[:-1] != shape[:-1] or q.size == 0 or v.shape[-1] == 0:
        return None
    n, d, dv = shape[-2], shape[-1], v.shape[-1]
    found = _fast_map(feature_map, dt, d, q, k)
    if found is None:
        return None
    code, fp, address, dk = found
    if initial_state is not None:
        initial = _fast_state(initial_state, dt, shape[:-2], dk, dv, causal)
        if initial is None:
            return None
    gates = lens = qlens = None
    if decay is not None or gate is not None or lengths is not None or query_lengths is not None:
        if decay is not None or gate is not None:
            if not causal:
                return None
            gates = _fast_gates(dt, shape, dk, decay, gate)
            if gates is None:
                return None
        try:  # (lengths: new arrays, in no one's memory)
            if lengths is not None:
                lens = checks.check_lengths(lengths, shape[:-2], n, "N" if causal else "Nk")
            if query_lengths is not None:
                qlens = checks.check_lengths(query_lengths, shape[:-2], n, "N", "query_lengths")
        except (TypeError, ValueError):  # (the checked path says why, after what it checks first)
            return None
    if into is not None and (type(into) is not _ndarray or into.dtype != dt or into.shape != shape[:-1] + (dv,)
                             or not into.flags.writeable or into.strides[-1] != dt.itemsize
                             or _overlaps(into, (q, k, v) + (() if initial_state is None else initial_state)
                                          + (() if gate is None else (gate,)))):
        return None
    if (q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous
            and (into is None or into.flags.c_contiguous)):
        layout = "C"
    elif (len(shape) <= 4 and q.strides[-1] == q.itemsize and k.strides[-1] == q.itemsize
          and v.strides[-1] == q.itemsize):
        # views with unit-stride rows (a fused projection's heads, (B, H, N, D) or (H, N, D)), read in place
        # (fewer than 4 dims: leading dims of 1 added below, a view)
        layout = "A"
    else:
        return None
    kind = 0 if gates is None else gates[0]
    found = _constants.get((causal, dt, shape, dv, num_threads(), layout, dk, kind))
    if found is None:
        found = _fast_plan(causal, dt, shape, dv, num_threads(), layout, dk, kind)
    chunk, frac, nthreads, pooled, kernel, no_gates, one, two_runs = found[:8]
    if into is not None:
        out = into
    elif pooled:  # a large result the caller will drop: from the pool, reused without page faults
        out = workspace.empty(shape[:-1] + (dv,), dt)
    else:
        out = np.empty(shape[:-1] + (dv,), dt)
    bh = q.size // (n * d)
    if len(shape) == 4:  # (B, H, N, D) as the kernels' (G1, G2, N, D): no reshapes (~1 us of a tiny call)
        q4, k4, v4, o4 = q, k, v, out
    else:
        q4, k4, v4, o4 = (x.reshape(1, bh, n, x.shape[-1]) for x in (q, k, v, out))
    if causal:
        full, S0, Z0, S, Z, den4, states4 = found[8:]
    else:
        full, qfull, S0, Z0, S, Z = found[8:]
        qlens = qfull if qlens is None else qlens
    lens = full if lens is None else lens
    if initial_state is not None:
        S0, Z0 = initial
    if return_state:
        S, Z = _final_state_arrays(bh, dk, dv, dt)
    if causal:
        status = _NO_STATUS
        den = states = None
        if keep:  # the denominators and the chunk states for the backward (as causal_with_denominators')
            if normalize:
                den = np.zeros(shape[:-1], dt)
                den4 = den.reshape(q4.shape[:3])
            states = workspace.take(shape[:-2] + (-(-n // chunk), dv + 1, dk), dt)  # (the caller releases it)
            states4 = states.reshape(q4.shape[:2] + states.shape[-3:])
        g4, ld = no_gates, _ZERO_DECAY
        if gates is not None:  # (the gated kernel:) the gates, a status for a bad gate value
            _, g4, ld = gates
            status = np.zeros(3, np.int64)
            if len(shape) != 4 and kind != gates_mod.CONSTANT:  # the inputs' (1, BH) split
                g4 = g4.reshape((1, bh) + g4.shape[len(shape) - 2:])
        args = (q4, k4, v4, code, fp, address, dt.type(eps), normalize, one if scale is None else dt.type(scale),
                lens, chunk, frac, S0, Z0, o4, S, Z, g4, ld, status, den4, states4)
    else:
        args = (q4, k4, v4, code, fp, address, dt.type(eps), normalize, one if scale is None else dt.type(scale),
                lens, qlens, chunk, frac, S0, Z0, o4, S, Z)
    parts = None if not two_runs else (_causal_parts(True, bh, n, chunk, frac, dk, dv, nthreads) if causal
                                       else _parts(True, bh, frac, dk, dv, False))
    _launch(kernel, nthreads, args, parts)
    if gates is not None:
        gates_mod.raise_bad_gate(status, shape[:-2])
    state = State(S.reshape(shape[:-2] + (dk, dv)), Z.reshape(shape[:-2] + (dk,))) if return_state else None
    if keep:
        return (out, state), (den, states, chunk)
    return (out, state) if return_state else out


def _fast_half(causal, q, k, v, feature_map, eps, normalize, keep=False, return_state=False, initial_state=None,
               into=None, scale=None, decay=None, gate=None, lengths=None, query_lengths=None):
    """_fast (its arguments; ``keep`` False) for float16 q, k and v (and a float16 gate): computed in float32 as the
    checked path computes them, the result rounded to float16 once and copied into ``into`` (checked) when given;
    a returned state stays float32, as an initial one must be. None where _fast does not take the converted
    arguments: the checked path then runs, or says why. (B1 H1 N16 D16: 30 us through the checked path.)"""
    if keep or type(k) is not _ndarray or type(v) is not _ndarray or k.dtype is not _F16 or v.dtype is not _F16:
        return None
    q, k, v, gate = _in_single(q, k, v, gate)
    res = _fast(causal, q, k, v, feature_map, eps, normalize, False, return_state, initial_state, None, scale, decay,
                gate, lengths, query_lengths)
    if res is None:
        return None
    out, state = res if return_state else (res, None)
    out = _finished(out, True, into)
    return (out, state) if return_state else out


def _in_single(q, k, v, gate):
    """float16 q, k and v (and a float16 gate) in float32, as the checked path computes them (cpu/half.py's
    conversions)."""
    if type(gate) is _ndarray and gate.dtype is _F16:
        gate = gate.astype(_SINGLE)
    return half.astype(q, _SINGLE), half.astype(k, _SINGLE), half.astype(v, _SINGLE), gate


def _finished(res, halves, out):
    """A short path's result: rounded to float16 once where the inputs were (``halves``), and copied into ``out``
    (checked) when given."""
    if halves:
        res = half.astype(res, _F16)
    if out is None:
        return res
    out = _check_out(out, res.shape, res.dtype, "cpu")
    out[...] = res
    return out


def _launch(kernel, nthreads, args, parts):
    """Run a forward kernel for a short path: twice with ``parts`` (heads in segments, each summing its own
    part first; runs on one thread have one segment a head), else once: on ``nthreads`` threads, or on
    this thread alone through its unchecked entry point (no parallel region, no section: ``args`` must
    have the signature's types)."""
    if parts is not None:
        _run(kernel, nthreads, args, parts)
    elif nthreads > 1:
        with kernel_section(nthreads):
            kernel(nthreads, *args, 1, _NO_PARTS)
    else:
        kernel.unchecked(*args, 1, _NO_PARTS, np.zeros(1, np.int64))


#: A causal call from a State with at most this many positions a sequence runs step's kernel over them into a
#: new state, each head's positions one after the other with its state in the cache (a decode loop calling
#: the sequence function token by token, a check of a few drafted tokens), where the chunkwise kernel's fixed
#: cost per head is the larger. Stop 71's Xeon, H8 D64, 6 positions, with the state returned / without (us,
#: steps against chunkwise): one thread B1 28/26 against 49/31, B8 222/221 against 366/170, B64 1695/1411
#: against 2309/1368; two threads B8 102/100 against 196/107, B64 736/743 against 1224/813; at 8 positions
#: and more the chunkwise kernel wins without the state (docs/performance.md).
FEW_POSITIONS = 6


#: A new State of at least this many bytes comes from the workspace pool (reused pages), a smaller one from
#: malloc: glibc maps 32 MB and more afresh at every call, so each page faulted (B256 H8 D64 N2, two threads:
#: 5090-6286 us against 2177-2313), and below 16 MB the pool's arrays were as fast or slower (B8 48-52 against
#: 67-75 us, B32 281-285 against 301-310; docs/performance.md stop 71).
POOLED_STATE_BYTES = 16 << 20


def _new_state(S0, Z0):
    """A State of new arrays shaped like S0 and Z0, to write the state after a call into."""
    if S0.nbytes + Z0.nbytes < POOLED_STATE_BYTES or S0.dtype != Z0.dtype:
        return State(np.empty(S0.shape, S0.dtype), np.empty(Z0.shape, Z0.dtype))
    return State(*workspace.take_views([S0.shape, Z0.shape], S0.dtype))


#: A causal call with no initial state, at most this many positions a sequence and a state of at most
#: FRESH_STATE_BYTES runs like one from a zero State (_few_positions, from a broadcast row of zeros: nothing the
#: size of the state is read), where the chunkwise kernel's fixed cost per head is the larger: with the state
#: returned it writes it through a product and a copy. Stop 72's Xeon, two threads, one / two positions (us,
#: steps against chunkwise; state returned, then not): B1 H8 D64 11/31, 14/32, then 12/13, 14/14; B8 H8 D64
#: 29/115, 38/124, then 29/44, 37/52; B1 H8 D128 19/69, 29/67, then 19/27, 29/27. From three positions the
#: chunkwise kernel wins without the state (B8 H8 D64 N4 53 against 72), and a call must take the same path with
#: or without it (the results are identical).
FRESH_POSITIONS = 2
#: ... and larger states (S's bytes) take the chunkwise kernel: the steps write the new state whether it is
#: returned or not (without it, B32 H8 D64, 4 MB: 171 against 129 us; B8 H8 D128, 2 MB: 136 against 92).
FRESH_STATE_BYTES = 1 << 20


def _zero_state(q, dv, feature_map):
    """A State of zeros for a causal call on q (..., N, D) with values of ``dv`` and no initial state, in the dtype
    it computes in (float32 for float16): read-only broadcast views of a zero row of Dv and one of D' (D' from
    the map), for _few_positions to start from; None for a callable map, one that does not fit D, or a state of
    more than FRESH_STATE_BYTES (the general path then runs, or says why). Kept for the next call of the same
    shapes and map name."""
    dt = _SINGLE if q.dtype is _F16 else q.dtype
    key = ("zero state", dt, q.shape, dv, feature_map) if type(feature_map) is str else None
    found = None if key is None else _constants.get(key)
    if found is None:
        found = False
        if dt in _FLOATS:
            row = np.zeros(1, dt)  # (only D' is wanted: the strides _fast_map checks are row's)
            mapped = _fast_map(feature_map, dt, q.shape[-1], row, row)
            lead = q.shape[:-2]
            if mapped is not None and math.prod(lead) * mapped[3] * dv * dt.itemsize <= FRESH_STATE_BYTES:
                dk = mapped[3]
                found = State(np.broadcast_to(np.zeros(dv, dt), lead + (dk, dv)),
                              np.broadcast_to(np.zeros(dk, dt), lead + (dk,)))
        if key is not None:
            if len(_constants) > 256:
                _constants.clear()
            _constants[key] = found
    return found or None


def _few_positions(q, k, v, state, feature_map, eps, normalize, return_state, decay, gate, scale, out):
    """causal_linear_attention's short path for a few positions a sequence (1 to FEW_POSITIONS) from a State of
    NumPy arrays: step's kernel (decoding.step_fast), each head's positions in one call, the first reading the
    given state and writing a new one, which the call leaves as it is (a copy first: B8 H8 D64, one position,
    took 83-104 us on one thread against 58-74, 89 on two against 32); the result (..., N, Dv) (copied into
    ``out``, checked, when given: the same values with or without it), with the new state when
    ``return_state``. None when step's fast path does not take the arguments (the general path then runs from
    the given state, or says why)."""
    halves = q.dtype == _F16  # (float16 q, k and v: computed in float32 from a float32 state, as elsewhere)
    if (type(state) is not State or type(k) is not _ndarray or type(v) is not _ndarray
            or not (q.dtype in _FLOATS or halves and k.dtype == _F16 and v.dtype == _F16)
            or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]
            or not (return_state is True or return_state is False)):
        return None
    per_dim = False
    if gate is not None:  # a gate per position (..., N) or per key dimension (..., N, D'): each step's (..., [D'])
        if (type(gate) is not _ndarray or gate.ndim not in (q.ndim - 1, q.ndim)
                or gate.shape[:q.ndim - 1] != q.shape[:-1]):
            return None
        per_dim = gate.ndim == q.ndim
    S0, Z0 = state
    if type(S0) is not _ndarray or type(Z0) is not _ndarray:
        return None
    n = q.shape[-2]
    if halves:  # (H8 D64, one position: B1 60 us through the general path against 16, B8 188 against 43)
        q, k, v, gate = _in_single(q, k, v, gate)
    new = _new_state(S0, Z0)
    if n == 1:  # (the step's own result: no views of one, ~0.3 us of a 6 us call)
        g = None if gate is None else gate[..., 0, :] if per_dim else gate[..., 0]
        res = step_fast(q[..., 0, :], k[..., 0, :], v[..., 0, :], new, feature_map, eps, normalize, decay, g, scale,
                        None, state)
        if res is None:
            return None
        res = res[..., None, :]
    else:  # (the positions of each head one after the other, its state in the cache: read and written once)
        res = step_fast(q, k, v, new, feature_map, eps, normalize, decay, gate, scale, None, state, True)
        if res is None:
            return None
    res = _finished(res, halves, out)
    return (res, new) if return_state else res


def _fast_over_state(q, state, feature_map, eps, normalize):
    """linear_attention's short path for queries over a state alone (k and v None: a decoder reading its
    encoder's keys): NumPy q and state of one float dtype, nothing else; one query a sequence (a decoding
    step), a built-in map, through the step kernel reading the state (decoding.read_state); more, a built-in
    map (by name or as an object: _fast_map), C-contiguous arrays (the state writable), through the
    non-causal kernel. None for anything else (the checked path)."""
    dt = q.dtype
    if (type(state) is not State or dt not in _FLOATS or type(eps) is not float
            or not (normalize is True or normalize is False) or not 0.0 <= eps < _INF):
        return None
    S0, Z0 = state
    shape = q.shape
    if (type(S0) is not _ndarray or type(Z0) is not _ndarray or S0.dtype != dt or Z0.dtype != dt
            or len(shape) < 2 or q.size == 0 or S0.ndim < 2 or S0.shape[-1] == 0):
        return None
    if shape[-2] == 1:
        out = read_state(q[..., 0, :], S0, Z0, feature_map, eps, normalize)
        return None if out is None else out.reshape(shape[:-1] + (S0.shape[-1],))
    if not (q.flags.c_contiguous and S0.flags.c_contiguous and Z0.flags.c_contiguous and S0.flags.writeable
            and Z0.flags.writeable):
        return None
    n, d = shape[-2], shape[-1]
    found = _fast_map(feature_map, dt, d, q, q)
    if found is None:
        return None
    code, fp, address, dk = found
    if S0.shape[:-1] != shape[:-2] + (dk,) or Z0.shape != S0.shape[:-1]:
        return None
    dv = S0.shape[-1]
    found = _constants.get((False, dt, shape, dv, num_threads(), "C", dk, 0))
    if found is None:
        found = _fast_plan(False, dt, shape, dv, num_threads(), "C", dk)
    chunk, frac, nthreads, pooled, kernel, no_gates, one = found[:7]
    out = workspace.empty(shape[:-1] + (dv,), dt) if pooled else np.empty(shape[:-1] + (dv,), dt)
    bh = q.size // (n * d)
    q4, o4 = (q, out) if len(shape) == 4 else (q.reshape(1, bh, n, d), out.reshape(1, bh, n, dv))
    args = (q4, q4[:, :, :0], o4[:, :, :0], code, fp, address, dt.type(eps), normalize, one, _full_lengths(bh, 0),
            found[9], chunk, frac, S0.reshape(bh, dk, dv), Z0.reshape(bh, dk), o4) + found[12:]
    _launch(kernel, nthreads, args, None)  # (no keys: each segment reads the state itself)
    return out


def _features(q, k, feature_map, lead, n, comp):
    """(q', k', (kernel code, parameters, address), D'): inputs in the compute dtype, mapped already if
    the map is a user's callable; the kernels compute every FeatureMap themselves."""
    fmap = as_map(feature_map)
    q, k = half.astype(q, comp), half.astype(k, comp)
    if not isinstance(fmap, FeatureMap):
        q = checks.check_mapped(fmap(q), "q", lead, n).astype(comp, copy=False)
        k = checks.check_mapped(fmap(k), "k", lead, k.shape[-2], q.shape[-1]).astype(comp, copy=False)
        return q, k, (IDENTITY, _NO_GATES[comp], 0), q.shape[-1]
    code, fp, address, dk = _map_args(fmap, q.shape[-1], comp)
    if code >= mapfns.FIRST:  # map_rows reads rows by element strides
        q, k = (x if all(s % x.itemsize == 0 for s in x.strides) else np.ascontiguousarray(x) for x in (q, k))
    return q, k, (code, fp, address), dk


def _map_args(fmap, d, dt):
    """(kernel code, parameters, address, D') of a FeatureMap for inputs of ``d`` features in ``dt``: the
    elementwise maps the kernels apply inline have no parameters and no C function."""
    code, dk = fmap.kernel_code(), fmap.out_dim(d)
    if code < mapfns.FIRST:
        return code, _NO_GATES[dt], 0, dk
    return code, fmap.params(d, dt), mapfns.address(dt, code), dk


def _flat(x, bh, tail):
    """(*lead, *tail_dims) -> (bh, *tail_dims) for the last ``tail`` dims, a view when possible."""
    return x.reshape((bh,) + x.shape[x.ndim - tail:])


def _seq4(arrays, lead, layout_of=4):
    """The (..., N, X) arrays as 4-D (G1, G2, N, X) arrays with their leading dims merged into two
    groups, the kernel layout ("C" when the first ``layout_of`` are C-contiguous, else "A"), and
    which were copied.

    The split of the leading dims is chosen so that as many arrays as possible are views (the
    heads of a fused QKV projection, (B, H) with heads D apart, merge into no single dim but fit
    two); an array that fits none is copied once, and so is one whose rows are not unit-stride.
    """
    if all(x.flags.c_contiguous for x in arrays):  # ((1, BH), not (1, -1): arrays with no positions too)
        return tuple(x.reshape((1, math.prod(lead)) + x.shape[-2:]) for x in arrays), "C", (False,) * len(arrays)
    rows = tuple(unit_rows(x) for x in arrays)
    if any(r is not x for r, x in zip(rows, arrays)):
        out, layout, copied = _seq4(rows, lead, layout_of)
        return out, layout, tuple(c or r is not x for c, r, x in zip(copied, rows, arrays))
    best = None
    for split in range(len(lead) + 1):
        g = (math.prod(lead[:split]), math.prod(lead[split:]))
        views = [view_as(x, g + x.shape[-2:]) for x in arrays]
        if best is None or sum(v is not None for v in views) > sum(v is not None for v in best[1]):
            best = (g, views)
            if all(v is not None for v in views):
                break
    g, views = best
    out = tuple(v if v is not None else np.ascontiguousarray(x).reshape(g + x.shape[-2:])
                for x, v in zip(arrays, views))
    layout = "C" if all(x.flags.c_contiguous for x in out[:layout_of]) else "A"
    return out, layout, tuple(v is None for v in views)


def _dask(*arrays):
    """Whether any of the arrays is a Dask collection (then linattn.dask builds the task graph)."""
    return any(hasattr(type(x), "__dask_graph__") for x in arrays if x is not None)


def _placement(device, *arrays, names):
    """Where to run (see checks.check_placement), decided at once for NumPy arrays and no device."""
    if device is None and all(type(x) is np.ndarray or x is None for x in arrays):
        return "cpu"
    return checks.check_placement(dict(zip(names, arrays)), device)


def _check_out(out, shape, out_dt, where):
    if where == "device":
        raise TypeError("out: expected None with CUDA device arrays (the result is a new device array)")
    return checks.check_out(out, shape, out_dt)


def _result_array(out, lead, n, dv, comp, inputs):
    """Where the kernel writes: ``out`` when it has the compute dtype, unit stride along its last
    axis and no memory in common with the inputs, else a new array (a large one from the pool:
    workspace.empty)."""
    if (out is not None and out.dtype == comp and (out.strides[-1] == out.itemsize or dv == 1)
            and not _overlaps(out, inputs)):
        return out
    return workspace.empty(lead + (n, dv), comp)


def _deliver(res, out, out_dt, where):
    """The result in the output dtype, or ``out`` with the result written into it."""
    if out is not None:
        if res is not out:
            out[...] = res
        return out
    return res if where == "device" else half.astype(res, out_dt)


def _prepare(q, k, v, feature_map, eps, normalize, where="cpu", cross=False):
    """Checked inputs (with ``cross``, k and v may have another length than q). On a CUDA device
    ("device") nothing is copied; on CUDA ("device", "cuda-host") the code is cuda/maps.device_map's
    (code, parameters, D')."""
    if where == "device":
        from .cuda.api import as_device

        q, k, v = as_device(q), as_device(k), as_device(v)
    q, k, v, lead, n, d, dv, comp, out_dt = checks.check_qkv(q, k, v, host=where != "device", cross=cross)
    eps = checks.check_eps(eps)
    normalize = checks.check_flag(normalize, "normalize")
    if where != "cpu":  # the CUDA kernels compute every FeatureMap themselves, a callable maps host arrays
        from .cuda.maps import device_map

        if where == "device":
            checks.check_device_inputs({"q": q, "k": k, "v": v}, comp, out_dt)
        else:
            q, k, v = (x.astype(comp, copy=False) for x in (q, k, v))
            if not isinstance(as_map(feature_map), FeatureMap):
                q, k, _, _ = _features(q, k, feature_map, lead, n, comp)
                feature_map = "identity"
        code = device_map(feature_map, d if where == "device" else q.shape[-1])
        return q, k, v, lead, n, code[2], dv, comp, out_dt, eps, normalize, code
    q, k, code, dk = _features(q, k, feature_map, lead, n, comp)
    v = half.astype(v, comp)
    return q, k, v, lead, n, dk, dv, comp, out_dt, eps, normalize, code


def causal_linear_attention(q, k, v, *, feature_map="elu", eps=1e-6, normalize=True,
                            initial_state=None, return_state=False, lengths=None, decay=None, gate=None,
                            scale=None, out=None, device=None):
    r"""Causal linear attention: position i attends to positions j <= i.

    .. math:: out_i = \frac{\phi(q_i)^T S_i}{\phi(q_i)^T Z_i + eps},\quad
              S_i = S_0 + \sum_{j\le i} \phi(k_j) v_j^T,\quad Z_i = Z_0 + \sum_{j\le i} \phi(k_j)

    With ``decay`` or ``gate`` the state forgets: :math:`S_i = a_i \odot S_{i-1} + \phi(k_i) v_i^T`
    (and Z likewise), where :math:`a_i` (decay times exp(gate_i)) applies to the state before i.

    Parameters
    ----------
    q, k : array_like, shape (..., N, D)
        Queries and keys. Any number of leading dimensions (batch, heads, ...), equal for q, k, v.
    v : array_like, shape (..., N, Dv)
        Values.
    feature_map : {"elu", "relu", "identity"} or callable, default "elu"
        phi. "elu" is elu(x) + 1. A callable maps an array (..., N, D) to (..., N, D'), in the
        computation's dtype.
    eps : float, default 1e-6
        Added to the denominator; finite and >= 0.
    normalize : bool, default True
        False returns the numerator :math:`\phi(q_i)^T S_i` only.
    initial_state : State, optional
        State ``(S, Z)`` to continue from (``S`` of shape (..., D', Dv), ``Z`` of (..., D')), as
        returned by ``return_state=True``; its dtype must be the computation's dtype.
    return_state : bool, default False
        Also return the :class:`State` after the last position.
    lengths : array_like of int, optional
        True lengths of right-padded sequences, of the shape of the leading dims or of their first
        dims (``(B,)`` for ``(B, H, N, D)`` inputs). Positions at or past a sequence's length do not
        enter its state, their outputs are 0, and the returned state is the one at its length.
    decay : array_like, optional
        A constant decay in (0, 1] per sequence, broadcastable to the leading dims (shape ``(H,)``
        for ``(B, H, N, D)`` inputs: one per head, RetNet's and Lightning Attention's gamma).
    gate : array_like, optional
        Log gates (<= 0, natural log, as flash-linear-attention's ``g`` and Mamba-2's dt*A), of shape
        ``(..., N)`` (one per position: the state before position i is multiplied by exp(gate_i))
        or ``(..., N, D')`` (one per key dimension, GLA: row d of S and Z[d] by exp(gate_i,d)).
        ``-inf`` resets the state. With ``decay`` as well the factors multiply. A positive or NaN
        gate is a ValueError (found while computing: ``out``'s contents are then unspecified).
    scale : float, optional
        Multiplies phi(q) (default 1; flash-linear-attention's ops default to D**-0.5).
    out : ndarray, shape (..., N, Dv), optional
        Where to write the result (a writable array of the result's dtype, any strides): a view
        such as ``buf.transpose(0, 2, 1, 3)`` of a (B, N, H, Dv) buffer puts the heads side by side
        for the next projection without a copy. Host results only. It may share memory with the
        inputs, the gate or the initial state: the result is then computed aside and copied in.
    device : {None, "cpu", "cuda"}, optional
        Where to compute. By default CUDA device arrays (anything with ``__cuda_array_interface__``)
        run on their GPU and return device arrays (the state too), host arrays on the CPU.
        ``"cuda"`` runs host arrays on the GPU and returns host arrays.

    Returns
    -------
    out : ndarray, shape (..., N, Dv)
        In the inputs' float dtype (float16 is computed in float32; integers become float64).
    state : State
        Only with ``return_state=True``.

    Examples
    --------
    >>> import numpy as np, linattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 100, 16), dtype=np.float32) for _ in range(3))
    >>> out, state = linattn.causal_linear_attention(q, k, v, return_state=True)
    >>> out.shape, state.S.shape, state.Z.shape
    ((2, 4, 100, 16), (2, 4, 16, 16), (2, 4, 16))

    Two calls through the state equal one call on the whole sequence:

    >>> a, st = linattn.causal_linear_attention(q[..., :60, :], k[..., :60, :], v[..., :60, :],
    ...                                         return_state=True)
    >>> b = linattn.causal_linear_attention(q[..., 60:, :], k[..., 60:, :], v[..., 60:, :],
    ...                                     initial_state=st)
    >>> bool(np.allclose(np.concatenate([a, b], axis=-2), out, rtol=1e-5, atol=1e-6))
    True
    """
    if type(q) is _ndarray and device is None:
        res = None
        if lengths is None and q.ndim >= 2 and 0 < q.shape[-2] <= FEW_POSITIONS:
            if initial_state is not None:
                res = _few_positions(q, k, v, initial_state, feature_map, eps, normalize, return_state, decay, gate,
                                     scale, out)
            elif q.shape[-2] <= FRESH_POSITIONS and type(v) is _ndarray and v.ndim == q.ndim:
                zero = _zero_state(q, v.shape[-1], feature_map)
                if zero is not None:
                    res = _few_positions(q, k, v, zero, feature_map, eps, normalize, return_state, decay, gate,
                                         scale, out)
        if res is None and (return_state is False or return_state is True):
            res = (_fast_half if q.dtype is _F16 else _fast)(True, q, k, v, feature_map, eps, normalize, False,
                                                             return_state, initial_state, out, scale, decay, gate,
                                                             lengths)
        if res is not None:
            return res
    S_in, Z_in = checks.state_parts(initial_state)
    if _dask(q, k, v, S_in, Z_in, gate):
        from . import dask as dask_mod

        return dask_mod.causal_linear_attention(
            q, k, v, feature_map=feature_map, eps=eps, normalize=normalize, initial_state=initial_state,
            return_state=return_state, lengths=lengths, decay=decay, gate=gate, scale=scale, out=out, device=device)
    return causal_with_denominators(q, k, v, feature_map, eps, normalize, initial_state, return_state, lengths, decay,
                                    gate, scale, out, device)[0]


def causal_with_denominators(q, k, v, feature_map="elu", eps=1e-6, normalize=True, initial_state=None,
                             return_state=False, lengths=None, decay=None, gate=None, scale=None, out=None, device=None,
                             keep=False):
    """causal_linear_attention's work for arrays (not Dask's): ``(result, kept)``; with ``keep`` (on the CPU),
    ``kept = (den, states, chunk)`` for the backward pass: ``den`` (..., N) the denominators scale phi(q_i).Z_i +
    eps (None without normalisation) and ``states`` (..., chunks, Dv + 1, D') the state [S | Z]^T at the start
    of each chunk of ``chunk`` positions; else ``kept`` is None."""
    S_in, Z_in = checks.state_parts(initial_state)
    where = _placement(device, q, k, v, S_in, Z_in, names=("q", "k", "v", "initial_state.S", "initial_state.Z"))
    q, k, v, lead, n, dk, dv, comp, out_dt, eps, normalize, code = _prepare(
        q, k, v, feature_map, eps, normalize, where)
    return_state = checks.check_flag(return_state, "return_state")
    kind, gates, log_decay = gates_mod.prepare(decay, gate, lead, n, dk, comp)
    scale = gates_mod.check_scale(scale)
    if out is not None:
        out = _check_out(out, lead + (n, dv), out_dt, where)
    if where == "device" and initial_state is not None and Z_in is not None:
        from .cuda.api import as_device

        initial_state = (as_device(S_in), as_device(Z_in))
    bh = math.prod(lead)
    lens = _full_lengths(bh, n) if lengths is None else checks.check_lengths(lengths, lead, n)
    kept = den = states = None
    if initial_state is None:  # no rows: the kernels start from zero
        S0, Z0 = _no_state(comp, dk, dv)[:2]
    else:
        S0, Z0 = checks.check_state(initial_state, "initial_state", lead, dk, dv, comp)
        if where == "cpu":
            S0 = np.ascontiguousarray(_flat(np.asarray(S0), bh, 2))
            Z0 = np.ascontiguousarray(_flat(np.asarray(Z0), bh, 1))
    if where != "cpu":
        from .cuda import api as cuda_api

        if initial_state is not None:
            S0, Z0 = cuda_api.flat_state(S0, Z0, bh, dk, dv, where)
        g = None if gates is None or kind == gates_mod.CONSTANT else np.ascontiguousarray(
            gates if kind == gates_mod.VECTOR else gates[..., None])
        cuda_kind = gates_mod.SCALAR if kind == gates_mod.CONSTANT else kind  # (zero gates, made on the device)
        res, S, Z, status = cuda_api.causal(
            _flat(q, bh, 2), _flat(k, bh, 2), _flat(v, bh, 2), code, eps, normalize,
            lens, S0, Z0, return_state, comp,
            None if g is None else g.reshape((bh,) + g.shape[-2:]), cuda_kind, log_decay, scale)
        gates_mod.raise_bad_gate(status, lead)
        res = res.reshape(lead + (n, dv))
    else:
        rows = bh if return_state else 0  # no rows: the kernel skips writing the state
        den = np.zeros(lead + (n,), comp) if keep and normalize else None
        S, Z = _final_state_arrays(rows, dk, dv, comp)
        # what the kernel reads while it writes the result (a gate or an initial state in out's memory
        # would be overwritten before it is read); the arrays of options not given are linattn's own
        reads = ((q, k, v) + tuple(x for x in (gates, log_decay) if x is not None)
                 + ((S0, Z0) if initial_state is not None else ()) + ((lens,) if lengths is not None else ()))
        res = _result_array(out, lead, n, dv, comp, reads)
        if bh and n:
            chunk, frac, nthreads, two_runs = plan(bh, n, dk, dv, causal=True)
            own = kind in (gates_mod.SCALAR, gates_mod.VECTOR)  # a gate array of their own
            arrays = (q, k, v, res) + ((gates if kind == gates_mod.VECTOR else gates[..., None],) if own else ())
            arrays, layout, copied = _seq4(arrays, lead)
            q4, k4, v4, o4 = arrays[:4]
            g4 = ((arrays[4] if kind == gates_mod.VECTOR else arrays[4][..., 0]) if own else
                  _CONSTANT_ONLY[comp] if kind == gates_mod.CONSTANT else _NO_GATES[comp])
            ld = log_decay if log_decay is not None else (np.zeros(bh) if kind else _ZERO_DECAY)
            status = np.zeros(3, np.int64)
            kernel = chunked.causal_forward.get(comp, (layout, kind))
            if den is not None:
                den4 = den.reshape(q4.shape[:3])
            if keep:
                states = workspace.take(lead + (-(-n // chunk), dv + 1, dk), comp)  # (the caller releases it)
            _run(kernel, nthreads, (q4, k4, v4, *code, comp.type(eps), normalize, comp.type(scale), lens, chunk, frac,
                                    S0, Z0, o4, S, Z, g4, ld, status, _NO_DEN[comp] if den is None else den4,
                                    _NO_STATES[comp] if states is None else
                                    states.reshape(q4.shape[:2] + states.shape[-3:])),
                 _causal_parts(two_runs, bh, n, chunk, frac, dk, dv, nthreads))
            gates_mod.raise_bad_gate(status, lead)
            if copied[3]:  # res allowed no 4-D view with the inputs' split
                res[...] = o4.reshape(res.shape)
        elif return_state:
            S[...] = S0 if len(S0) else 0
            Z[...] = Z0 if len(Z0) else 0
        if keep:
            kept = (den, states, chunk if bh and n else 1)
    res = _deliver(res, out, out_dt, where)
    if return_state:
        return (res, State(S.reshape(lead + (dk, dv)), Z.reshape(lead + (dk,)))), kept
    return res, kept


def _keys_from_state(q, k, v, initial_state, where):
    """k and v for a call that reads its keys from ``initial_state`` alone (k and v None): arrays of no
    positions (of q's dtype, D and leading dims; the state's Dv). Other k, v are returned as given."""
    if k is not None and v is not None:
        return k, v
    if k is not None or v is not None or initial_state is None:
        name = "k" if k is None else "v"
        raise TypeError(f"{name}: expected an array, got None (k and v may both be None only with an initial_state, "
                        f"the sums of the keys the queries attend to)")
    if not (isinstance(initial_state, tuple) and len(initial_state) == 2):
        raise TypeError(f"initial_state: expected a linattn.State (S, Z), got {type(initial_state).__name__}")
    S = initial_state[0]
    ss = tuple(getattr(S, "shape", ()))  # (plain tuples, also for device arrays)
    if len(ss) < 2:
        got = f"shape {ss}" if hasattr(S, "shape") else type(S).__name__
        raise ValueError(f"initial_state.S: expected an array of shape (..., D', Dv), got {got}")
    q = q if hasattr(q, "shape") and hasattr(q, "dtype") else np.asarray(q)
    qs = tuple(q.shape)
    if len(qs) < 2:
        raise ValueError(f"q: expected at least 2 dimensions (..., N, D), got shape {qs}")
    if ss[:-2] != qs[:-2]:
        raise ValueError(f"initial_state.S: expected leading dimensions {qs[:-2]} like q, got shape {ss}")
    k, v = np.zeros(qs[:-2] + (0, qs[-1]), q.dtype), np.zeros(qs[:-2] + (0, ss[-1]), q.dtype)
    if where == "device":  # (device arrays of no elements: Numba's device arrays take no ``...`` index)
        from .cuda.api import to_device

        return to_device(k), to_device(v)
    return k, v


def linear_attention(q, k=None, v=None, *, feature_map="elu", eps=1e-6, normalize=True, initial_state=None,
                     return_state=False, lengths=None, query_lengths=None, scale=None, out=None, device=None,
                     **unsupported):
    r"""Non-causal linear attention: every query attends to all the keys.

    .. math:: out_i = \frac{\phi(q_i)^T S}{\phi(q_i)^T Z + eps},\quad
              S = S_0 + \sum_j \phi(k_j) v_j^T,\quad Z = Z_0 + \sum_j \phi(k_j)

    Parameters and returns are as for :func:`causal_linear_attention`, without ``decay`` and ``gate``
    (only causal attention forgets); ``scale``, ``out`` and ``device`` as there; ``lengths`` and
    ``query_lengths`` below.
    k and v may have another length than q (cross-attention: shapes (..., Nk, D) and (..., Nk, Dv) with
    q (..., N, D), the result (..., N, Dv)), as an encoder-decoder's queries read the encoder's keys.

    ``initial_state`` (S0, Z0), a :class:`State` returned by ``return_state=True``, holds the sums of
    keys seen before: the queries attend to those and to k, v. ``return_state=True`` also returns the
    state of all of them, so keys given in pieces sum to the state of one call, and a decoder reads
    an encoder's keys once: each later call passes only its queries, ``k`` and ``v`` None, and the
    state (O(D' Dv) a head, whatever the keys' number).

    ``lengths`` (of the shape of the leading dims or of their first dims, as for the causal call) are
    the true lengths of right-padded keys and values: keys at or past a sequence's length do not
    enter its state (padding may hold anything, NaN included). ``query_lengths`` (same shapes) are
    the true lengths of right-padded queries: queries at or past a sequence's length are not read
    and their outputs are 0, as the causal call's past its lengths. Without it every query, a padded
    one too, attends to its sequence's keys. A padded batch's self-attention passes both:
    ``linear_attention(q, k, v, lengths=n, query_lengths=n)``.

    Examples
    --------
    >>> import numpy as np, linattn
    >>> q = k = np.zeros((4, 2), np.float32); v = np.arange(8, dtype=np.float32).reshape(4, 2)
    >>> linattn.linear_attention(q, k, v, eps=0.0)  # phi(0) = 1: every row is the mean of v
    array([[3., 4.],
           [3., 4.],
           [3., 4.],
           [3., 4.]], dtype=float32)

    Cross-attention, two queries over the four keys; then a query over the keys' state alone:

    >>> out, memory = linattn.linear_attention(q[:2], k, v, eps=0.0, return_state=True)
    >>> out
    array([[3., 4.],
           [3., 4.]], dtype=float32)
    >>> linattn.linear_attention(q[:1], initial_state=memory, eps=0.0)
    array([[3., 4.]], dtype=float32)
    """
    if unsupported:
        name = next(iter(unsupported))
        why = (" (decay and gates make the state forget the past: only causal attention has one; use "
               "causal_linear_attention)" if name in ("decay", "gate") else "")
        raise TypeError(f"linear_attention() got an unexpected keyword argument {name!r}{why}")
    if type(q) is _ndarray and device is None and (return_state is False or return_state is True):
        if k is not None or v is not None:
            res = (_fast_half if q.dtype is _F16 else _fast)(False, q, k, v, feature_map, eps, normalize, False,
                                                             return_state, initial_state, out, scale,
                                                             lengths=lengths, query_lengths=query_lengths)
        elif (return_state is False and out is None and scale is None and lengths is None
              and query_lengths is None):
            res = _fast_over_state(q, initial_state, feature_map, eps, normalize)
        else:
            res = None
        if res is not None:
            return res
    S_in, Z_in = checks.state_parts(initial_state)
    if _dask(q, k, v, S_in, Z_in):
        from . import dask as dask_mod

        return dask_mod.linear_attention(q, k, v, feature_map=feature_map, eps=eps, normalize=normalize,
                                         initial_state=initial_state, return_state=return_state, lengths=lengths,
                                         query_lengths=query_lengths, scale=scale, out=out, device=device)
    where = _placement(device, q, k, v, S_in, Z_in, names=("q", "k", "v", "initial_state.S", "initial_state.Z"))
    k, v = _keys_from_state(q, k, v, initial_state, where)
    q, k, v, lead, n, dk, dv, comp, out_dt, eps, normalize, code = _prepare(
        q, k, v, feature_map, eps, normalize, where, cross=True)
    return_state = checks.check_flag(return_state, "return_state")
    scale = gates_mod.check_scale(scale)
    if out is not None:
        out = _check_out(out, lead + (n, dv), out_dt, where)
    S0 = Z0 = None
    if initial_state is not None:
        S0, Z0 = checks.check_state(initial_state, "initial_state", lead, dk, dv, comp)
    bh, nk = math.prod(lead), tuple(k.shape)[-2]  # (device arrays' shapes take no negative index)
    lens = _full_lengths(bh, nk) if lengths is None else checks.check_lengths(lengths, lead, nk, "Nk")
    qlens = (_full_lengths(bh, n) if query_lengths is None
             else checks.check_lengths(query_lengths, lead, n, "N", "query_lengths"))
    if where != "cpu":
        from .cuda import api as cuda_api

        if S0 is not None:
            S0, Z0 = cuda_api.flat_state(S0, Z0, bh, dk, dv, where)
        res, S, Z = cuda_api.noncausal(_flat(q, bh, 2), _flat(k, bh, 2), _flat(v, bh, 2),
                                       code, eps, normalize, comp, scale, S0, Z0, return_state, lens, qlens)
        res = res.reshape(lead + (n, dv))
    else:
        # (an initial state in out's memory would be overwritten before a later head reads it)
        res = _result_array(out, lead, n, dv, comp, (q, k, v) + ((S0, Z0) if S0 is not None else ()))
        rows = bh if return_state else 0  # no rows: the kernel writes no state
        S, Z = _final_state_arrays(rows, dk, dv, comp)
        S0, Z0 = _NO_INITIAL[comp] if S0 is None else _initial_for_noncausal(S0, Z0, bh)
        if bh and (n or return_state):
            chunk, frac, nthreads, two_runs = plan(bh, max(n, nk, 1), dk, dv, causal=False)
            (q4, k4, v4, o4), layout, copied = _seq4((q, k, v, res), lead)
            kernel = chunked.noncausal_forward.get(comp, layout)
            _run(kernel, nthreads, (q4, k4, v4, *code, comp.type(eps), normalize, comp.type(scale), lens, qlens, chunk,
                                    frac, S0, Z0, o4, S, Z), _parts(two_runs and nk > 0, bh, frac, dk, dv, False))
            if copied[3]:
                res[...] = o4.reshape(res.shape)
    res = _deliver(res, out, out_dt, where)
    if return_state:
        return res, State(S.reshape(lead + (dk, dv)), Z.reshape(lead + (dk,)))
    return res
