"""Incremental decoding: one position at a time through the state, and the explicit attention
weights for inspection."""
import math
from contextlib import nullcontext

import numpy as np

from . import checks, reference
from . import gates as gates_mod
from ._reshape import view_as
from .cpu import half, mapfns, step as step_kernels
from .cpu.runtime import kernel_section, num_threads
from .feature_maps import FeatureMap, as_map, resolve
from .state import State

# (feature map: a name or a map object, dtype, q's shape, gate kind, has decay)
#   -> (map code, parameters, map_rows's address, serial kernel, variant)
_FAST = {}
_READ = {}  # (feature map, dtype, q's shape) -> read_state's (map code, parameters, address, mapped)
_DECAYS = {}  # (float decay or id of a float64 array, leading dims) -> (the decay, its shape, its broadcast view)
_LAST_DECAY = [None, None, None, None]  # the last step's decay, leading dims, the decay's shape, its view
_ndarray, _empty, _INF, _F16 = np.ndarray, np.empty, math.inf, np.dtype(np.float16)  # (globals: cheaper per step)
_PARALLEL_MIN = step_kernels.PARALLEL_MIN  # (a global: cheaper per step)


def _map_entry(feature_map, dtype, d):
    """(map code, parameters, map_rows's address, whether cpu/mapfns.py maps it) of a built-in map (a
    name or a FeatureMap) for inputs of D = d; None for a callable or a map that does not fit d (the
    checked paths say why)."""
    if type(feature_map) is not str and not isinstance(feature_map, FeatureMap):
        return None  # a callable: mapped in NumPy by the checked path
    try:
        fmap = as_map(feature_map)
        fmap.out_dim(d)
    except (ValueError, TypeError):
        return None
    code = fmap.kernel_code()
    mapped = code >= mapfns.FIRST
    fp, addr = (fmap.params(d, dtype), mapfns.address(dtype, code)) if mapped else (None, 0)
    return code, fp, addr, mapped


def _fast_entry(feature_map, dtype, shape, gate_kind, has_decay, sourced, positions):
    """The fast-path entry for a built-in map (a name or a FeatureMap) and a float32/float64 dtype
    (compiled once), else None; ``sourced``: the kernel that reads the old state from other arrays;
    ``positions``: the one that takes q's (..., N, D) N positions a head (see cpu/step._step_nd)."""
    if dtype not in (np.float32, np.float64) or len(shape) <= positions or not shape[-1]:
        return None
    found = _map_entry(feature_map, dtype, shape[-1])
    if found is None:
        return None
    code, fp, addr, mapped = found
    variant = (len(shape) - 1 - positions, gate_kind, has_decay, mapped, sourced, positions)
    if len(_FAST) > 256:
        _FAST.clear()
    entry = _FAST[feature_map, dtype, shape, gate_kind, has_decay, sourced, positions] = (
        code, fp, addr, step_kernels.step_nd_serial.get(dtype, variant), variant)
    return entry


def read_state(q, S, Z, feature_map, eps, normalize):
    """out (..., Dv) = phi(q)^T S / (phi(q)^T Z + eps) per sequence, S and Z only read: the step kernel
    without k and v, for a query (..., D) over a state (a decoding step's cross-attention). q, S, Z:
    NumPy arrays of one float dtype with rows of adjacent elements, a built-in map, a float eps and a
    bool normalize (the caller's checks); None when they do not fit (shapes, layouts, a callable map:
    the caller's checked path then says why)."""
    dt, shape = q.dtype, q.shape
    key = (feature_map, dt, shape)
    try:
        found = _READ.get(key)
    except TypeError:  # an unhashable callable
        return None
    if found is None:
        found = _map_entry(feature_map, dt, shape[-1]) if shape and shape[-1] else None
        if found is None:
            return None
        if len(_READ) > 256:
            _READ.clear()
        _READ[key] = found
    code, fp, addr, mapped = found
    out = _empty(shape[:-1] + (S.shape[-1],), dt)
    try:
        if S.size < _PARALLEL_MIN or num_threads() == 1:
            status = step_kernels.read_nd_serial.get(dt, (len(shape) - 1, mapped))(
                q, None, None, code, fp, addr, eps, normalize, S, Z, out, None, None, 1.0, None, None)
        else:
            with kernel_section():
                status = step_kernels.read_nd_parallel.get(dt, (len(shape) - 1, mapped))(
                    q, None, None, code, fp, addr, eps, normalize, S, Z, out, None, None, 1.0, None, None)
    except TypeError:  # no compiled signature fits (a dtype or layout): the checked path
        return None
    return out if status == 0 else None


def _decay_view(decay, lead):
    """The decay as a float64 array of the leading dims (a broadcast view), for the fast path; None
    when it cannot be one (the checked path then says why). Views of floats and of float64 arrays
    are kept (a view of an array sees its values as they change; the array is kept with it, so its
    id is not reused): a decoding loop passes the same decay at every step, found first in a one-entry
    cache (the dictionary's path took 0.38 µs of a 4.6 µs step at one sequence of 8 heads)."""
    last = _LAST_DECAY
    if decay is last[0] and lead == last[1] and getattr(decay, "shape", None) == last[2]:
        return last[3]
    if type(decay) is _ndarray and decay.dtype != np.float64:
        if decay.dtype.kind not in "fiu":  # (complex, bool, ...: the checked path's TypeError)
            return None
        try:
            return np.broadcast_to(decay.astype(np.float64), lead)
        except ValueError:
            return None
    key = (decay if type(decay) is float else id(decay), lead)
    found = _DECAYS.get(key)
    if found is not None and (found[0] is decay or type(decay) is float) and found[1] == getattr(decay, "shape", None):
        last[:] = decay, lead, found[1], found[2]
        return found[2]
    if type(decay) is float:
        view = np.broadcast_to(np.float64(decay), lead)
    elif type(decay) is _ndarray:
        try:
            view = np.broadcast_to(decay, lead)
        except ValueError:
            return None
    else:
        return None
    if len(_DECAYS) > 64:
        _DECAYS.clear()
    _DECAYS[key] = (decay, getattr(decay, "shape", None), view)
    last[:] = decay, lead, _DECAYS[key][1], view
    return view


def step(q, k, v, state, *, feature_map="elu", eps=1e-6, normalize=True, decay=None, gate=None, scale=None,
         out=None, device=None):
    r"""Advance causal linear attention by one position for every sequence of a batch.

    Updates ``state`` **in place** (:math:`S = a S + \phi(k) v^T`, :math:`Z = a Z + \phi(k)`, with
    a = 1 unless ``decay`` or ``gate`` is given) and returns
    :math:`\phi(q)^T S / (\phi(q)^T Z + eps)`. The work is O(D'·Dv) per sequence; nothing the size of
    the state is allocated (only the output, unless ``out`` is given, and phi(q), phi(k)). The
    built-in maps are computed inside the kernel; a callable maps q and k first.

    Parameters
    ----------
    q, k : array_like, shape (..., D)
        Query and key of the new position, any leading (batch) dimensions.
    v : array_like, shape (..., Dv)
        Its value.
    state : State
        ``S`` of shape (..., D', Dv) and ``Z`` of (..., D'), writable, of the computation's dtype
        (float32 for float16/float32 inputs, float64 otherwise): from :meth:`State.zeros` or from
        ``causal_linear_attention(..., return_state=True)`` (prefill).
    feature_map, eps, normalize, decay, scale
        As for :func:`causal_linear_attention`; a callable maps (..., D) to (..., D').
    gate : array_like, optional
        The new position's log gate (<= 0; -inf resets the state): shaped like the leading dims
        (one per sequence), or leading dims + (D',) (one per key dimension).
    out : ndarray, shape (..., Dv), optional
        Where to write the result (the inputs' float dtype); its memory must be apart from the
        state's (ValueError otherwise). Inputs that share memory with the state or ``out`` (``out=v``,
        say) are read as they were before the step wrote anything (on CUDA device arrays, v that
        does is a ValueError).
    device : {None, "cpu", "cuda"}, optional
        As for :func:`causal_linear_attention`: device arrays (q, k, v, the state, ``out``) step on
        their GPU; ``"cuda"`` steps host arrays on the GPU and writes the state back.

    Returns
    -------
    ndarray, shape (..., Dv)

    Examples
    --------
    Prefill a prompt, then generate: the steps continue the sequence exactly.

    >>> import numpy as np, linattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 10, 8), dtype=np.float32) for _ in range(3))
    >>> full = linattn.causal_linear_attention(q, k, v)
    >>> _, state = linattn.causal_linear_attention(q[..., :7, :], k[..., :7, :], v[..., :7, :],
    ...                                            return_state=True)
    >>> steps = [linattn.step(q[..., i, :], k[..., i, :], v[..., i, :], state) for i in range(7, 10)]
    >>> bool(np.allclose(np.stack(steps, axis=-2), full[..., 7:, :], rtol=1e-5, atol=1e-6))
    True
    """
    res = step_fast(q, k, v, state, feature_map, eps, normalize, decay, gate, scale, out) if device is None else None
    if res is not None:
        return res
    return _step_checked(q, k, v, state, feature_map, eps, normalize, decay, gate, scale, out, device)


def step_fast(q, k, v, state, feature_map, eps, normalize, decay, gate, scale, out, source=None, positions=False):
    """step's fast path, for the common call (float32/float64 NumPy arrays with rows of adjacent elements,
    a built-in feature map, by name or as a map object): the compiled kernel checks dtypes and layouts
    by its signature and shapes and values itself, so a decoding step costs little more than the
    arithmetic. None (the state untouched) for anything else: the checked path then runs or says why.

    ``source`` (a State of NumPy arrays shaped like ``state``'s, apart from them): the state before the
    step, only read; the new one is written into ``state`` (the sequence function's few positions from a
    State, which it leaves as it is). None: ``state`` is updated in place. Not for float16.

    ``positions``: q and k (..., N, D), v (..., N, Dv), a gate (..., N[, D]) and the result (..., N, Dv) hold
    N steps of each sequence, taken one after the other with the sequence's state in the cache (the
    sequence function's few positions: the state read and written once, not N times)."""
    if not (type(state) is State and type(q) is _ndarray and type(v) is _ndarray and type(eps) is float):
        return None
    dt = q.dtype
    if dt is _F16:
        if source is not None or positions:
            return None
        return _step_half(q, k, v, state, feature_map, eps, normalize, decay, gate, scale, out)
    kind = 0 if gate is None else (1 if gate.ndim == q.ndim - 1 else 2) if type(gate) is _ndarray else -1
    decay_arr = None if decay is None else _decay_view(decay, q.shape[:-1 - positions])
    if positions and decay_arr is not None:  # (one factor a sequence, the same at each of its positions)
        decay_arr = np.broadcast_to(decay_arr[..., None], q.shape[:-1])
    sourced = source is not None
    key = (feature_map, dt, q.shape, kind, decay is not None, sourced, positions)
    try:
        fast = _FAST.get(key)
    except TypeError:  # an unhashable callable
        fast = None
    if fast is None and kind >= 0:
        fast = _fast_entry(feature_map, *key[1:])
    if not (fast and (normalize is True or normalize is False) and 0.0 <= eps < _INF
            and (out is None or (type(out) is _ndarray and out.dtype is dt))
            and (decay is None or decay_arr is not None) and (gate is None or gate.dtype is dt)
            and (scale is None or (type(scale) is float and 0.0 < scale < _INF))):
        return None
    S, Z = state
    S0, Z0 = (None, None) if source is None else source
    qscale = 1.0 if scale is None else scale
    # the kernel checks out's shape and layout (rows of adjacent elements, writable) like the others'
    res = _empty(v.shape, dt) if out is None else out
    try:
        if type(S) is not _ndarray or S.size * (q.shape[-2] if positions else 1) < _PARALLEL_MIN or num_threads() == 1:
            status = fast[3](q, k, v, fast[0], fast[1], fast[2], eps, normalize, S, Z, res, gate, decay_arr, qscale,
                             S0, Z0)
        else:
            kernel = step_kernels.step_nd_parallel.get(dt, fast[4])
            with kernel_section():
                status = kernel(q, k, v, fast[0], fast[1], fast[2], eps, normalize, S, Z, res, gate, decay_arr,
                                qscale, S0, Z0)
    except TypeError:  # no compiled signature fits: the checks say why
        return None
    return res if status == 0 else None


def _step_half(q, k, v, state, feature_map, eps, normalize, decay, gate, scale, out):
    """step for float16 q, k and v, computed in float32 as the checked path does but through the fast
    one (the checked path took 3-4x as long): the inputs (and a float16 gate) converted, the result
    converted back (into ``out``). None when the arguments do not fit (the checked path then says why)."""
    if type(k) is not _ndarray or k.dtype is not _F16 or v.dtype is not _F16:
        return None
    if out is not None and (type(out) is not _ndarray or out.dtype is not _F16 or out.shape != v.shape
                            or not out.flags.writeable or checks.overlap(out, state.S) or checks.overlap(out, state.Z)):
        return None
    if type(gate) is _ndarray and gate.dtype is _F16:
        gate = gate.astype(np.float32)
    single = np.float32
    res = step(half.astype(q, single), half.astype(k, single), half.astype(v, single), state, feature_map=feature_map,
               eps=eps, normalize=normalize, decay=decay, gate=gate, scale=scale)
    if out is None:
        return half.astype(res, _F16)
    out[...] = res
    return out


def _step_checked(q, k, v, state, feature_map, eps, normalize, decay, gate, scale, out, device):
    S_in, Z_in = checks.state_parts(state)
    where = checks.check_placement({"q": q, "k": k, "v": v, "state.S": S_in, "state.Z": Z_in, "out": out},
                                   device)
    if where == "device":
        return _step_device(q, k, v, state, feature_map, eps, normalize, decay, gate, scale, out)
    q, k, v, lead, _, _, dv, comp, out_dt = checks.check_qkv(q, k, v, seq_axis=False)
    eps = checks.check_eps(eps)
    normalize = checks.check_flag(normalize, "normalize")
    fn, code, is_callable = resolve(feature_map)
    q, k, v = q.astype(comp, copy=False), k.astype(comp, copy=False), v.astype(comp, copy=False)
    if is_callable:
        q = checks.check_mapped(fn(q), "q", lead, None).astype(comp, copy=False)
        k = checks.check_mapped(fn(k), "k", lead, None, q.shape[-1]).astype(comp, copy=False)
    dk = q.shape[-1]
    S, Z = checks.check_state(state, "state", lead, dk, dv, comp)
    qscale = gates_mod.check_scale(scale)
    decay_flat = None if decay is None else gates_mod.check_decay(decay, lead)
    gate_kind, gate_flat = 0, None
    if gate is not None:
        gate_kind, gate_arr = gates_mod.check_gate(gate, lead, None, dk, comp, per_position=False)
        gates_mod.check_gate_values(gate_arr)
        gate_flat = np.ascontiguousarray(gate_arr.reshape((-1,) + gate_arr.shape[len(lead):]))
    for name, arr in (("state.S", S), ("state.Z", Z)):
        if not isinstance(arr, np.ndarray) or not arr.flags.writeable:
            raise ValueError(f"{name}: expected a writable NumPy array (step updates the state in place)")
    bh = math.prod(lead)
    # The kernel updates (BH, D', Dv) views in place; a state whose strides allow no such view is
    # stepped in a contiguous copy and written back.
    S3, Z2 = view_as(S, (bh, dk, dv)), view_as(Z, (bh, dk))
    S3c = S3 if S3 is not None else np.ascontiguousarray(S).reshape(bh, dk, dv)
    Z2c = Z2 if Z2 is not None else np.ascontiguousarray(Z).reshape(bh, dk)
    if out is not None:
        checks.check_out(out, lead + (dv,), out_dt)
    res = out if (out is not None and out_dt == comp) else np.empty(lead + (dv,), comp)
    res2 = view_as(res, (bh, dv))
    if res2 is None:  # an `out` with strides that allow no view
        res = np.empty(lead + (dv,), comp)
        res2 = res.reshape(bh, dv)
    checks.check_written_apart(S, Z, out)
    # what the kernel reads while it writes S, Z and the result (q and k are mapped first) is copied
    # where it shares memory with them
    v, gate_flat, decay_flat = (x if not any(checks.overlap(x, w) for w in (S, Z, res)) else x.copy()
                                for x in (v, gate_flat, decay_flat))
    if bh and where == "cuda-host":
        from .cuda import api as cuda_api

        S_dev, Z_dev = cuda_api.to_device(np.ascontiguousarray(S3c)), cuda_api.to_device(np.ascontiguousarray(Z2c))
        from .cuda.maps import device_map

        fmap = device_map("identity" if is_callable else feature_map, dk)  # (mapped on the host, or inline)
        res2[...] = cuda_api.step(q.reshape(bh, dk), k.reshape(bh, dk), v.reshape(bh, dv), fmap, eps,
                                  normalize, S_dev, Z_dev, None, comp, gate_flat, gate_kind, decay_flat, qscale)
        S3c[...] = S_dev.copy_to_host()
        Z2c[...] = Z_dev.copy_to_host()
    elif bh:
        parallel = bh * dk * dv >= _PARALLEL_MIN and num_threads() > 1
        kernels = step_kernels.step_strided_parallel if parallel else step_kernels.step_strided_serial
        with kernel_section() if parallel else nullcontext():
            kernels.get(comp, (gate_kind, decay is not None))(
                q.reshape(bh, dk), k.reshape(bh, dk), v.reshape(bh, dv), code, eps, normalize, S3c, Z2c, res2,
                gate_flat, decay_flat, qscale)
    if S3 is None:  # write the contiguous copy back
        S[...] = S3c.reshape(S.shape)
    if Z2 is None:
        Z[...] = Z2c.reshape(Z.shape)
    if out is not None and res is not out:
        out[...] = res
        return out
    return res.astype(out_dt, copy=False)


def _step_device(q, k, v, state, feature_map, eps, normalize, decay, gate, scale, out):
    """step on CUDA device arrays: validated like the host path, computed on the GPU in place."""
    from .cuda import api as cuda_api

    q, k, v = cuda_api.as_device(q), cuda_api.as_device(k), cuda_api.as_device(v)
    q, k, v, lead, _, d, dv, comp, out_dt = checks.check_qkv(q, k, v, seq_axis=False, host=False)
    checks.check_device_inputs({"q": q, "k": k, "v": v}, comp, out_dt)
    eps = checks.check_eps(eps)
    normalize = checks.check_flag(normalize, "normalize")
    from .cuda.maps import device_map

    fmap = device_map(feature_map, d)  # (computed inside the kernel)
    din, d = d, fmap[2]  # D, D'

    S_in, Z_in = checks.state_parts(state)
    if Z_in is not None:
        state = (cuda_api.as_device(S_in), cuda_api.as_device(Z_in))
    S, Z = checks.check_state(state, "state", lead, d, dv, comp)
    checks.check_device_inputs({"state.S": S, "state.Z": Z}, comp, comp)
    bh = math.prod(lead)
    if out is not None:
        out = cuda_api.as_device(out)
        if tuple(out.shape) != lead + (dv,) or np.dtype(out.dtype) != comp:
            raise ValueError(f"out: expected a device array of shape {lead + (dv,)} and dtype {comp}, "
                             f"got shape {tuple(out.shape)}, dtype {out.dtype}")
        checks.check_device_inputs({"out": out}, comp, comp)
    checks.check_written_apart(S, Z, out)
    if any(checks.overlap(v, w) for w in (S, Z, out)):
        raise ValueError("v: expected memory apart from the state and out (a step on device arrays writes them in "
                         "place), got an array that overlaps them")
    if out is not None:
        out = out.reshape(bh, dv)
    qscale = gates_mod.check_scale(scale)
    decay_flat = None if decay is None else gates_mod.check_decay(decay, lead)
    gate_kind, gate_flat = 0, None
    if gate is not None:  # a step's gates are small: checked (and copied) on the host
        gate_kind, gate_arr = gates_mod.check_gate(gate, lead, None, d, comp, per_position=False)
        gates_mod.check_gate_values(gate_arr)
        gate_flat = np.ascontiguousarray(gate_arr).reshape(bh, -1)
    res = cuda_api.step(q.reshape(bh, din), k.reshape(bh, din), v.reshape(bh, dv), fmap, eps, normalize,
                        S.reshape(bh, d, dv), Z.reshape(bh, d), out, comp, gate_flat, gate_kind, decay_flat, qscale)
    return res.reshape(lead + (dv,))


def _positions(lengths, lead, m, what, name):
    """lead + (m,) booleans, True before each sequence's length (checked: see checks.check_lengths),
    or None for no lengths."""
    if lengths is None:
        return None
    return np.arange(m) < checks.check_lengths(lengths, lead, m, what, name).reshape(lead + (1,))


def attention_weights(q, k, *, causal=True, feature_map="elu", eps=1e-6, decay=None, gate=None, scale=None,
                      lengths=None, query_lengths=None):
    r"""The (..., N, N) matrix of normalised weights that linear attention applies implicitly.

    ``W[i, j] = phi(q_i).phi(k_j) / (sum_j' phi(q_i).phi(k_j') + eps)`` over j <= i when causal (the
    upper triangle is 0), over all j otherwise, so row i sums to ~1 and ``W @ v`` equals the
    attention output. Not causal, k may have another length Nk than q (cross-attention: W is
    (..., N, Nk)). With ``decay``/``gate`` (causal only; as for :func:`causal_linear_attention`)
    each term is decayed, ``phi(q_i)_d phi(k_j)_d prod_{j<u<=i} a_u,d`` (RetNet's parallel form: the
    scores times its D matrix), and ``W @ v`` equals that call's output; ``scale`` multiplies
    phi(q). ``lengths`` and ``query_lengths`` as for the attention calls (right padding, never read):
    causal, the rows and columns at or past a sequence's length are 0; not causal, ``lengths`` zeroes
    the keys' columns past them and ``query_lengths`` the queries' rows (``W @ v`` then equals the
    call's output where v's padding is finite). O(N²) memory (O(N²·D') with a gate per key
    dimension): for inspection and teaching on small N.

    Examples
    --------
    >>> import numpy as np, linattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 3)) for _ in range(3))
    >>> w = linattn.attention_weights(q, k)
    >>> bool(np.allclose(w.sum(-1), 1)), bool(np.all(np.triu(w, 1) == 0))
    (True, True)
    >>> bool(np.allclose(w @ v, linattn.causal_linear_attention(q, k, v)))
    True
    >>> w = linattn.attention_weights(q, k, decay=0.5)  # RetNet-style: older positions weigh less
    >>> bool(np.allclose(w @ v, linattn.causal_linear_attention(q, k, v, decay=0.5)))
    True
    """
    q = checks.as_array(q, "q", 2)
    k = checks.as_array(k, "k", 2)
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected leading dimensions and D like q {q.shape[:-2]}, D={q.shape[-1]}; "
                         f"got shape {k.shape}")
    eps = checks.check_eps(eps)
    causal = checks.check_flag(causal, "causal")
    if causal and k.shape[-2] != q.shape[-2]:
        raise ValueError(f"k: expected sequence length N={q.shape[-2]} like q, got {k.shape[-2]} (keys of another "
                         f"length than the queries: causal=False)")
    scale = gates_mod.check_scale(scale)
    comp, out_dt = checks.compute_dtypes(q.dtype, k.dtype)
    fn, _, is_callable = resolve(feature_map)
    lead, n, nk = q.shape[:-2], q.shape[-2], k.shape[-2]
    if (decay is not None or gate is not None) and not causal:
        raise TypeError("decay, gate: only causal attention decays (the state forgets the past); use causal=True")
    if query_lengths is not None and causal:
        raise TypeError("query_lengths: only for causal=False (causal, lengths zero the queries' rows too)")
    kvalid = _positions(lengths, lead, nk, "N" if causal else "Nk", "lengths")
    qvalid = kvalid if causal else _positions(query_lengths, lead, n, "N", "query_lengths")
    q, k = (x.astype(comp, copy=False) if m is None else np.where(m[..., None], x, 0).astype(comp, copy=False)
            for x, m in ((q, qvalid), (k, kvalid)))
    qf = np.asarray(fn(q))
    kf = np.asarray(fn(k))
    if is_callable:
        qf = checks.check_mapped(qf, "q", lead, n)
        kf = checks.check_mapped(kf, "k", lead, nk, qf.shape[-1])
    if kvalid is not None:
        kf = np.where(kvalid[..., None], kf, 0).astype(comp, copy=False)
    if scale != 1.0:
        qf = qf * comp.type(scale)
    if decay is None and gate is None:
        a = (qf @ np.swapaxes(kf, -1, -2)).astype(comp, copy=False)
        if causal:
            a = np.tril(a)
    else:
        kind, gates, log_decay = gates_mod.prepare(decay, gate, lead, n, qf.shape[-1], comp)
        gates_mod.check_gate_values(gates)
        log_a = gates.astype(np.float64)
        log_a = (log_a if kind == gates_mod.VECTOR else log_a[..., None]) + (
            0.0 if log_decay is None else log_decay.reshape(lead + (1, 1)))
        factors = reference.decay_matrix(np.broadcast_to(log_a, lead + (n, qf.shape[-1])))
        a = np.einsum("...td,...sd,...tsd->...ts", qf, kf, factors).astype(comp, copy=False)
    w = a / (a.sum(-1, keepdims=True) + comp.type(eps))
    if qvalid is not None:
        w = np.where(qvalid[..., None], w, 0).astype(comp, copy=False)
    return w.astype(out_dt, copy=False)
