"""linattn on Dask arrays: the same functions, keywords and results, lazily, on Dask's schedulers and
``dask.distributed`` clusters (``pip install "linattn[dask]"``; dask is imported only here).

Blocks along the leading dims are independent: one task each, through the NumPy functions (with
``return_state``, the state comes from the passes below). Along N
(one long sequence over many workers) causal attention is exact in two parallel passes and a scan:

1. each block's *local item*: the state its positions alone would leave, S_b = sum_s w_s phi(k_s) v_s^T
   and Z_b = sum_s w_s phi(k_s), with w_s the decay from s to the block's end, and the block's total
   log decay A_b (0 without decay or gates), in float64 (NumPy);
2. an inclusive scan over [initial state, block 0, block 1, ...] with Dask's own
   ``cumreduction`` and the associative operator (A1, S1) o (A2, S2) = (A1 + A2, e^A2 S1 + S2):
   its b-th value is the state entering block b, its last the final state;
3. each block's outputs: the NumPy function from its entering state (``initial_state``), with the
   block's part of ``lengths``, ``gate`` and ``decay``.

The second pass reads k and v (and the gates) again, from a copy of their graph: were the blocks
of the first pass kept for it, every block would stay in memory until the scan reached it (O(N)
per worker, not O(N / P)); inputs that are expensive to compute are computed twice (persist them
first if they fit in the cluster's memory). Non-causal attention sums the blocks' states (one
reduction), then maps each block's queries. The task graph grows linearly with the number of
blocks; the items and states exchanged are O(D' * Dv) each. D and Dv must each be one chunk: split ones are rechunked (each block then holds
whole rows; that costs a copy of the array, in memory or over the network).
"""
import math
import string

import numpy as np

from . import checks
from . import gates as gates_mod
from .feature_maps import FeatureMap, as_map
from .state import State


def _dask_array():
    try:
        import dask.array as da
    except ImportError:  # pragma: no cover - the extra is installed in the tests
        raise ImportError('linattn.dask needs dask: pip install "linattn[dask]"') from None
    return da


def is_dask(x):
    """Whether ``x`` is a Dask collection (without importing dask)."""
    return hasattr(type(x), "__dask_graph__") and hasattr(x, "chunks")


def _meta(x):
    """A zero-memory NumPy stand-in with x's shape and dtype, for the NumPy checks."""
    return np.broadcast_to(np.zeros((), np.dtype(x.dtype)), tuple(x.shape))


def _as_meta(x):
    return _meta(x) if is_dask(x) else x


def _mapped_dim(fmap, d, comp):
    """D' of a map (calling a user's callable once on a tiny array)."""
    if isinstance(fmap, FeatureMap):
        return fmap.out_dim(d)
    return checks.check_mapped(fmap(np.zeros((1, d), comp)), "q", (), 1).shape[-1]


def _phi(fmap, x, comp):
    """phi(x) in the compute dtype, as the kernels compute it."""
    return np.asarray(fmap(x.astype(comp, copy=False))).astype(comp, copy=False)


def _packed(A, Z, S):
    """One item: [A (D'), Z (D'), S (D' Dv)] along the last axis, float64."""
    return np.concatenate([A, Z, S.reshape(S.shape[:-2] + (-1,))], -1)


def _unpack(item, dk, dv):
    return item[..., :dk], item[..., dk:2 * dk], item[..., 2 * dk:].reshape(item.shape[:-1] + (dk, dv))


def _make_scan(dk, dv):
    """The scan's operator and its in-block cumulative form (closures: they know D' and Dv)."""

    def combine(p, q):
        """(A1, Z1, S1) o (A2, Z2, S2) = (A1 + A2, e^A2 Z1 + Z2, e^A2 S1 + S2) (rows of S by A's entries)."""
        a1, z1, s1 = _unpack(p, dk, dv)
        a2, z2, s2 = _unpack(q, dk, dv)
        f = np.exp(a2)  # a2 <= 0 (-inf: a reset, factor 0)
        return _packed(a1 + a2, f * z1 + z2, f[..., None] * s1 + s2)

    def cumulative(x, axis):
        """Inclusive scan of the items along ``axis`` (in one block of the items)."""
        x = np.moveaxis(x, axis, -2)
        out = x.copy()
        for i in range(1, x.shape[-2]):
            out[..., i, :] = combine(out[..., i - 1, :], x[..., i, :])
        return np.moveaxis(out, -2, axis)

    return combine, cumulative


def _local_item(k, v, g, lens, ld, p0, *, fmap, comp, dk, kind):
    """The local item of one block (see the module's docstring): k (..., n, D), v (..., n, Dv), g the
    block's gates or None, lens and ld the block's sequences' lengths and log decays, p0 its start."""
    n = k.shape[-2]
    kf = _phi(fmap, k, comp).astype(np.float64)
    v64 = v.astype(np.float64)
    valid = np.arange(n) < (lens[..., None] - p0[0])  # (..., n): positions before each length
    kf = np.where(valid[..., None], kf, 0.0)
    lead = k.shape[:-2]
    if kind == gates_mod.NONE:
        A = np.zeros(lead + (dk,))
    else:
        vector = kind == gates_mod.VECTOR
        loga = np.zeros(lead + (n,)) if g is None else g.astype(np.float64)
        if ld is not None:
            loga = loga + (ld[..., None, None] if vector else ld[..., None])
        loga = np.where(valid[..., None] if vector else valid, loga, 0.0)  # past a length: no decay
        axis = -2 if vector else -1
        suffix = np.flip(np.cumsum(np.flip(loga, axis), axis), axis)  # sums over u >= s (no inf - inf)
        after = np.concatenate([np.take(suffix, np.arange(1, n), axis), np.zeros_like(np.take(suffix, [0], axis))],
                               axis)  # sums over u > s
        w = np.exp(after)
        kf = kf * (w if vector else w[..., None])
        total = np.take(suffix, 0, axis)
        A = total if vector else np.broadcast_to(total[..., None], lead + (dk,))
    S = np.swapaxes(kf, -1, -2) @ v64
    return _packed(A, kf.sum(-2), S)[..., None, :]


def _block_out(q, k, v, item, g, lens, gamma, p0, *, fn, kwargs, dk, dv, comp):
    """One block's outputs through the NumPy function from the state entering it."""
    _, Z, S = _unpack(item[..., 0, :], dk, dv)
    n = q.shape[-2]
    local = np.clip(lens - p0[0], 0, n)
    extra = {}
    if g is not None:
        extra["gate"] = g
    if gamma is not None:
        extra["decay"] = gamma
    return fn(q, k, v, initial_state=State(S.astype(comp), Z.astype(comp)), lengths=local, **extra, **kwargs)


def _unify(arrays, lead_nd, groups=None):
    """Dask arrays for q, k, v (and a gate): the first dask input's chunks along the leading dims and
    N (one chunk each where none is), one chunk along a last axis past N (NumPy inputs wrapped). With
    ``groups`` (a group number per array: arrays of one length), N's chunks are the first dask input's
    of the array's group (one chunk where the group has none)."""
    da = _dask_array()
    ref = next((x for x in arrays if is_dask(x)), None)  # (none: only the state is a dask array)
    lead_chunks = ref.chunks[:lead_nd] if ref is not None else tuple((s,) for s in arrays[0].shape[:lead_nd])
    groups = groups or (0,) * len(arrays)
    out = []
    for x, group in zip(arrays, groups):
        same = [y for y, g in zip(arrays, groups) if g == group]
        along_n = next((y.chunks[lead_nd] for y in same if is_dask(y)), (x.shape[lead_nd],))
        chunks = lead_chunks + (along_n,) + (((x.shape[-1],),) if len(x.shape) > lead_nd + 1 else ())
        out.append(da.from_array(np.asarray(x), chunks=chunks) if not is_dask(x) else x.rechunk(chunks))
    return out


def _reread(x):
    """x with every task of its graph under a new key: computed again (read again from storage) where
    it is used, instead of sharing x's blocks. (``dask.graph_manipulation.clone`` does this too, but
    its graphs fail in the local schedulers' task fusion for sliced arrays in dask 2026.8.)"""
    from dask._task_spec import convert_legacy_graph
    from dask.base import clone_key
    from dask.highlevelgraph import HighLevelGraph

    da = _dask_array()
    graph = convert_legacy_graph(dict(x.__dask_graph__()))
    seed = "linattn-second-pass"
    renamed = {key: clone_key(key, seed) for key in graph}
    tasks = {renamed[key]: task.substitute(renamed, key=renamed[key]) for key, task in graph.items()}
    name = clone_key(x.name, seed)
    return da.Array(HighLevelGraph.from_collections(name, tasks, dependencies=()), name, x.chunks, meta=x._meta)


def _lead_array(values, lead, chunks, dtype):
    """A small lead-shaped dask array with the inputs' chunks along the leading dims."""
    da = _dask_array()
    return da.from_array(np.array(np.broadcast_to(values, lead), dtype=dtype), chunks=chunks)


def _starts(nchunks):
    """Each N block's first position, one per block (a dask array aligned with the N blocks)."""
    da = _dask_array()
    starts = np.concatenate([[0], np.cumsum(nchunks)[:-1]]).astype(np.int64)
    return da.from_array(starts, chunks=((1,) * len(nchunks),))


def _check(q, k, v, feature_map, eps, normalize, scale, cross=False):
    """The NumPy functions' checks on shapes, dtypes and options, at graph construction."""
    *_, lead, n, d, dv, comp, out_dt = checks.check_qkv(_as_meta(q), _as_meta(k), _as_meta(v), cross=cross)
    fmap = as_map(feature_map)  # (a FeatureMap, or the user's callable)
    eps = checks.check_eps(eps)
    normalize = checks.check_flag(normalize, "normalize")
    scale = gates_mod.check_scale(scale)
    dk = _mapped_dim(fmap, d, comp)
    return lead, n, d, dv, comp, out_dt, fmap, eps, normalize, scale, dk


def causal_linear_attention(q, k, v, *, feature_map="elu", eps=1e-6, normalize=True, initial_state=None,
                            return_state=False, lengths=None, decay=None, gate=None, scale=None, out=None,
                            device=None):
    """:func:`linattn.causal_linear_attention` on Dask arrays (any of q, k, v; NumPy ones are wrapped):
    returns a dask array (and a :class:`~linattn.State` of dask arrays with ``return_state=True``),
    lazily. Chunks along the leading dims and along N are both exact (see the module's docstring);
    ``initial_state`` (NumPy or dask), ``lengths``, ``decay`` and ``gate`` (NumPy or dask) work across
    blocks. ``out`` and ``device`` are not available here (a TypeError).

    Examples
    --------
    >>> import numpy as np, dask.array as da, linattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 1000, 8)) for _ in range(3))
    >>> lazy = linattn.causal_linear_attention(*(da.from_array(x, chunks=(1, 300, 8)) for x in (q, k, v)))
    >>> bool(np.allclose(lazy.compute(), linattn.causal_linear_attention(q, k, v)))
    True
    """
    from .attention import causal_linear_attention as numpy_fn

    da = _dask_array()
    if out is not None or device is not None:
        raise TypeError("out, device: not available with dask arrays (the result is a new dask array, on the CPU)")
    lead, n, d, dv, comp, out_dt, fmap, eps, normalize, scale, dk = _check(q, k, v, feature_map, eps, normalize,
                                                                           scale)
    return_state = checks.check_flag(return_state, "return_state")
    nl = len(lead)
    meta_gate = _as_meta(gate) if gate is not None else None
    kind, _gates, log_decay = gates_mod.prepare(decay, meta_gate, lead, n, dk, comp)
    lens = np.full(lead, n, np.int64) if lengths is None else checks.check_lengths(lengths, lead, n).reshape(lead)
    if initial_state is not None:
        S_in, Z_in = checks.check_state(initial_state, "initial_state", lead, dk, dv, comp)
    if n == 0 or math.prod(lead) == 0:  # nothing to distribute: the NumPy call (on empty arrays), as dask arrays
        state = None if initial_state is None else State(np.asarray(S_in), np.asarray(Z_in))
        res = numpy_fn(*(np.zeros(x.shape, x.dtype) for x in (q, k, v)), feature_map=fmap, eps=eps,
                       normalize=normalize, return_state=return_state, scale=scale, initial_state=state)
        if not return_state:
            return da.from_array(res)
        return da.from_array(res[0]), State(da.from_array(res[1].S), da.from_array(res[1].Z))
    arrays = _unify([q, k, v] + ([gate] if gate is not None else []), nl)
    q, k, v = arrays[:3]
    g = None if gate is None else arrays[3]
    lead_chunks, nchunks = q.chunks[:nl], q.chunks[nl]
    P = len(nchunks)
    L = string.ascii_lowercase[:nl]  # leading dims' indices; n: the sequence; x, y, g, w: last axes
    lens_d = _lead_array(lens, lead, lead_chunks, np.int64)
    ld = None if log_decay is None else log_decay.reshape(lead)
    ld_d = None if ld is None else _lead_array(ld, lead, lead_chunks, np.float64)
    gamma_d = None if decay is None else _lead_array(np.exp(ld), lead, lead_chunks, np.float64)
    starts = _starts(nchunks)
    W = 2 * dk + dk * dv
    g_args = (None, None) if g is None else (g, L + ("ng" if kind == gates_mod.VECTOR else "n"))
    kwargs = dict(feature_map=fmap, eps=eps, normalize=normalize, scale=scale)
    gamma_args = (None, None) if gamma_d is None else (gamma_d, L)
    if P == 1 and not return_state:  # chunks along the leading dims only: one task per block
        state_args = (None, None, None, None)
        if initial_state is not None:
            state_args = (da.asarray(S_in).rechunk(lead_chunks + ((dk,), (dv,))), L + "uy",
                          da.asarray(Z_in).rechunk(lead_chunks + ((dk,),)), L + "u")

        def whole(q_b, k_b, v_b, S_b, Z_b, g_b, lens_b, gamma_b):
            extra = {} if g_b is None else {"gate": g_b}
            if gamma_b is not None:
                extra["decay"] = gamma_b
            state = None if S_b is None else State(S_b, Z_b)
            return numpy_fn(q_b, k_b, v_b, initial_state=state, lengths=lens_b, **extra, **kwargs)

        return da.blockwise(whole, L + "ny", q, L + "nx", k, L + "nx", v, L + "ny", *state_args, *g_args, lens_d, L,
                            *gamma_args, concatenate=True, align_arrays=False, dtype=out_dt,
                            meta=np.empty((0,) * (nl + 2), out_dt))
    ld_args = (None, None) if ld_d is None else (ld_d, L)

    def local(k_b, v_b, g_b, lens_b, ld_b, p0):
        return _local_item(k_b, v_b, g_b, lens_b, ld_b, p0, fmap=fmap, comp=comp, dk=dk, kind=kind)

    items = da.blockwise(local, L + "nw", k, L + "nx", v, L + "ny", *g_args, lens_d, L, *ld_args, starts, "n",
                         new_axes={"w": W}, adjust_chunks={"n": 1}, concatenate=True, align_arrays=False,
                         dtype=np.float64, meta=np.empty((0,) * (nl + 2), np.float64))
    if initial_state is not None:  # S0, Z0 into the first item (no log decay: A = 0)
        init = da.concatenate([da.zeros(lead + (1, dk), chunks=lead_chunks + ((1,), (dk,))),
                               _state_item(S_in, Z_in, lead, lead_chunks, dk, dv)], axis=-1).rechunk(
                                   lead_chunks + ((1,), (W,)))  # one chunk along W, as the items
    else:
        init = da.from_array(np.zeros(lead + (1, W)), chunks=lead_chunks + ((1,), (W,)))
    combine, cumulative = _make_scan(dk, dv)
    scanned = da.reductions.cumreduction(cumulative, combine, 0, da.concatenate([init, items], axis=-2),
                                         axis=nl, dtype=np.float64)
    entering = scanned[..., :P, :]

    def block(q_b, k_b, v_b, item_b, g_b, lens_b, gamma_b, p0):
        return _block_out(q_b, k_b, v_b, item_b, g_b, lens_b, gamma_b, p0, fn=numpy_fn, kwargs=kwargs, dk=dk, dv=dv,
                          comp=comp)

    # the second pass reads k, v (and the gates) anew: sharing the first pass's blocks would keep them in
    # memory until the scan reaches them (measured: O(N), not O(N / P), per worker)
    k, v = _reread(k), _reread(v)
    g_args = (None, None) if g is None else (_reread(g), g_args[1])
    res = da.blockwise(block, L + "ny", q, L + "nx", k, L + "nx", v, L + "ny", entering, L + "nw", *g_args,
                       lens_d, L, *gamma_args, starts, "n", concatenate=True, align_arrays=False, dtype=out_dt,
                       meta=np.empty((0,) * (nl + 2), out_dt))
    if not return_state:
        return res
    _, Z, S = _unpack(scanned[..., P, :], dk, dv)
    return res, State(S.astype(comp), Z.astype(comp))


def _state_item(S, Z, lead, lead_chunks, dk, dv):
    """A state (NumPy or dask S, Z) as a dask item [Z | S] (lead + (1, D' + D' Dv), float64), chunked
    along the leading dims as ``lead_chunks`` and in one chunk along the last two axes."""
    da = _dask_array()
    S = da.asarray(S if is_dask(S) else np.asarray(S)).astype(np.float64).reshape(lead + (dk * dv,))
    Z = da.asarray(Z if is_dask(Z) else np.asarray(Z)).astype(np.float64)
    return da.concatenate([Z, S], axis=-1)[..., None, :].rechunk(lead_chunks + ((1,), (dk + dk * dv,)))


def _rows_before(lens, p0, rows):
    """(..., rows, 1): which of a block's rows come before each sequence's length (the block starts at
    position p0[0]); None when all do (no pass over the block to mask it)."""
    valid = (np.arange(rows) < (lens[..., None] - p0[0]))[..., None]
    return None if valid.all() else valid


def _masked(x, valid):
    """x, 0 where ``valid`` (from _rows_before) is False (padding may hold NaN)."""
    return x if valid is None else np.where(valid, x, 0)


def _global_item(k, v, lens, p0, *, fmap, comp):
    """A block's part [Z | S] of the non-causal state: its keys before each sequence's length (``lens``;
    the block starts at position p0[0]), in float64."""
    valid = _rows_before(lens, p0, k.shape[-2])
    kf = _masked(_phi(fmap, _masked(k, valid), comp).astype(np.float64), valid)  # (phi(0) may not be 0)
    v64 = _masked(v.astype(np.float64), valid)
    return np.concatenate([kf.sum(-2), (np.swapaxes(kf, -1, -2) @ v64).reshape(k.shape[:-2] + (-1,))],
                          -1)[..., None, :]


def _noncausal_out(q, item, qlens, p0, *, fmap, comp, out_dt, dk, dv, eps, normalize, scale):
    """A block's outputs from the state's item [Z | S]: 0 for its queries at or past each sequence's
    length (``qlens``; the block starts at position p0[0])."""
    valid = _rows_before(qlens, p0, q.shape[-2])
    Z, S = item[..., 0, :dk], item[..., 0, dk:].reshape(item.shape[:-2] + (dk, dv))
    qf = _phi(fmap, _masked(q, valid), comp).astype(np.float64) * scale
    num = qf @ S
    if normalize:
        num = num / ((qf @ Z[..., None]) + eps)
    return _masked(num, valid).astype(comp).astype(out_dt, copy=False)


def linear_attention(q, k=None, v=None, *, feature_map="elu", eps=1e-6, normalize=True, initial_state=None,
                     return_state=False, lengths=None, query_lengths=None, scale=None, out=None, device=None,
                     **unsupported):
    """:func:`linattn.linear_attention` on Dask arrays: the blocks' states summed (one reduction, with
    ``initial_state``, NumPy or dask), then each block's outputs from the sum, lazily; a dask array
    (and a :class:`~linattn.State` of dask arrays with ``return_state=True``). k and v may have
    another length than q (and other chunks along it), or be None with ``initial_state``; ``lengths``
    and ``query_lengths`` work across blocks.

    Examples
    --------
    >>> import numpy as np, dask.array as da, linattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1000, 8)) for _ in range(3))
    >>> lazy = linattn.linear_attention(*(da.from_array(x, chunks=(250, 8)) for x in (q, k, v)))
    >>> bool(np.allclose(lazy.compute(), linattn.linear_attention(q, k, v)))
    True
    """
    da = _dask_array()
    if unsupported:
        from .attention import linear_attention as numpy_fn

        return numpy_fn(_meta(q) if is_dask(q) else q, k, v, **unsupported)  # the NumPy function's TypeError
    from .attention import _keys_from_state

    if out is not None or device is not None:
        raise TypeError("out, device: not available with dask arrays (the result is a new dask array, on the CPU)")
    k, v = _keys_from_state(_as_meta(q), k, v, initial_state, "cpu")  # (None, None: keys of no positions)
    lead, n, d, dv, comp, out_dt, fmap, eps, normalize, scale, dk = _check(q, k, v, feature_map, eps, normalize,
                                                                           scale, cross=True)
    return_state = checks.check_flag(return_state, "return_state")
    if initial_state is not None:
        S_in, Z_in = checks.check_state(initial_state, "initial_state", lead, dk, dv, comp)
    nl, nk = len(lead), k.shape[-2]
    lens = (np.full(lead, nk, np.int64) if lengths is None
            else checks.check_lengths(lengths, lead, nk, "Nk").reshape(lead))
    qlens = (np.full(lead, n, np.int64) if query_lengths is None
             else checks.check_lengths(query_lengths, lead, n, "N", "query_lengths").reshape(lead))
    q, k, v = _unify([q, k, v], nl, groups=(0, 1, 1))  # (k and v may have another length than q)
    L = string.ascii_lowercase[:nl]
    lens_d = _lead_array(lens, lead, k.chunks[:nl], np.int64)
    items = da.blockwise(lambda k_b, v_b, lens_b, p0: _global_item(k_b, v_b, lens_b, p0, fmap=fmap, comp=comp),
                         L + "nw", k, L + "nx", v, L + "ny", lens_d, L, _starts(k.chunks[nl]), "n",
                         new_axes={"w": dk + dk * dv}, adjust_chunks={"n": 1}, concatenate=True,
                         align_arrays=False, dtype=np.float64, meta=np.empty((0,) * (nl + 2), np.float64))
    total = items.sum(axis=nl, keepdims=True).rechunk({nl: 1})
    if initial_state is not None:
        total = total + _state_item(S_in, Z_in, lead, q.chunks[:nl], dk, dv)

    def block(q_b, item, qlens_b, p0):
        return _noncausal_out(q_b, item, qlens_b, p0, fmap=fmap, comp=comp, out_dt=out_dt, dk=dk, dv=dv, eps=eps,
                              normalize=normalize, scale=scale)

    res = da.blockwise(block, L + "ny", q, L + "nx", total, L + "mw", _lead_array(qlens, lead, q.chunks[:nl], np.int64),
                       L, _starts(q.chunks[nl]), "n", concatenate=True, align_arrays=False, new_axes={"y": dv},
                       dtype=out_dt, meta=np.empty((0,) * (nl + 2), out_dt))
    if not return_state:
        return res
    return res, State(total[..., 0, dk:].reshape(lead + (dk, dv)).astype(comp), total[..., 0, :dk].astype(comp))


def worker_settings(threads=1):
    """``dask.config`` values for ``dask.distributed`` workers that run linattn: the nanny starts each
    worker process with ``LINATTN_NUM_THREADS=threads`` (``distributed.nanny.environ``, Dask's own
    entries kept), which caps the threads linattn's kernels use in it.

    Without it every worker process runs its kernels on a thread per core: with several workers
    on a machine, oversubscription. ``NUMBA_NUM_THREADS`` cannot do this job: Numba reads it once,
    when it is imported, and a worker process imports the user's modules (linattn, so Numba) before
    the nanny's environment is applied; Numba then refuses the changed value. Use it as
    ``with dask.config.set(linattn.dask.worker_settings(threads)): cluster = LocalCluster(...)``,
    with ``threads`` the cores each worker process may use (1 with ``threads_per_worker=1`` and as
    many workers as cores). On an existing cluster, set ``LINATTN_NUM_THREADS`` in the workers'
    environment.
    """
    import dask

    if isinstance(threads, (bool, np.bool_)) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise ValueError(f"threads: expected an integer >= 1, got {threads!r}")
    environ = dict(dask.config.get("distributed.nanny.environ", {}) or {})
    environ["LINATTN_NUM_THREADS"] = str(int(threads))
    return {"distributed.nanny.environ": environ}
