r"""Gradients: vector-Jacobian products of the forward functions.

For causal attention with :math:`Q_f = \phi(q)`, :math:`K_f = \phi(k)`, scale s and, per position i,
:math:`num_i = s Q_{f,i}^T S_i`, :math:`den_i = s Q_{f,i}^T Z_i + eps`, :math:`out_i = num_i / den_i`,
and a gradient g of the outputs, let :math:`a_i = g_i / den_i` and :math:`b_i = -(g_i \cdot out_i) / den_i`
(without normalisation :math:`a_i = g_i`, :math:`b_i = 0`). Then, with :math:`G_j = dS + \sum_{i \ge j}
s Q_{f,i} a_i^T` and :math:`H_j = dZ + \sum_{i \ge j} s Q_{f,i} b_i` (dS, dZ: the final state's gradient):

- :math:`dQ_{f,i} = s (S_i a_i + Z_i b_i)`: causal attention of queries [a, b], keys [v, 1] and values
  K_f from the initial state [S_0; Z_0]^T;
- :math:`dK_{f,j} = G_j v_j + H_j`: the same backwards in time, queries [v, 1], keys [a, b], values
  s Q_f, from [dS; dZ]^T; its final state is the initial state's gradient;
- :math:`dv_j = G_j^T K_{f,j}`: backwards, queries K_f, keys s Q_f, values a, from dS;

Causal: the forward (run by the vjp's forward call, which keeps the denominators and the state at
the start of every chunk) and the cpu/backward.py kernel, which does all three in one scan per head
backwards in time, chunk by chunk, from those states (no O(N^2) memory; the adjoint in float64
accumulators), applying phi' as it writes: dq = dQ_f phi'(q), dk = dK_f phi'(k). Non-causal: the
same sums over all positions, G and H then constant: the cpu/noncausal_grad.py kernel takes [S | Z]
from the forward (its state), sums [G | H] over each head, then writes the three gradients row by row.
Both kernels apply phi and phi' of the elementwise maps themselves (cpu/map_grad.py) and the pair maps'
phi and vjp (cpu/pair_grad.py: Taylor, DPFP, ReBased, whose norm's vjp follows the kernel: the gradients of
gamma and beta need every row), the causal one the projection maps' phi too (their vjps after it, from the
phi it writes out); other maps' features are their inputs, the maps' ``vjp`` applied after.

With decay and gates (log factor lam_t of the state before t, per position or per position and key
dimension), the kernel decays the adjoint as the forward decays the state, and d lam_t = sum_{i >= t}
(Q_f,i . dQ_f,i - K_f,i . dK_f,i) + <dS, S_final> + <dZ, Z_final> (the identity flash-linear-attention's
gated kernels use; Z counts as one more value column), per key dimension the same with the
elementwise products and row j of the final state.
"""
import math

import numpy as np

from . import checks
from . import gates as gates_mod
from . import workspace
from .attention import (_causal_parts, _fast, _full_lengths, _gates_as_prepared, _keys_from_state, _no_state, _run,
                        _seq4, causal_with_denominators, linear_attention)
from .cpu import backward, gate_sums, half, mapfns, noncausal_grad
from .cpu.chunked import few_positions
from .cpu.elementwise import IDENTITY
from .cpu.map_grad import kernel_map
from .cpu.runtime import BACKWARD_PREFIX_COST, BACKWARD_WORK, chunk_size, plan
from .cpu.views import unit_rows
from .feature_maps import Elementwise, FeatureMap, as_map
from .state import State


_NO_R = np.empty((1, 0, 1))  # no gates: the backward kernel's per-position terms, none (it writes nothing there)
# phi(q), phi(k) not written by the causal backward kernel (but for the projection maps), per dtype
_NO_PHI = {np.dtype(dt): (np.empty((0, 0, 0, 0), dt),) * 2 for dt in (np.float32, np.float64)}
_BY_NAME = {}  # a map's name -> _map_and_code's result (a tiny vjp's forward: 1 us less)


def _map_and_code(feature_map):
    """(the map, its code in the backward kernels, or None: then phi is applied before the kernel and
    the map's ``vjp`` after it). The kernels differentiate the elementwise maps (with any input scale);
    they compute the pair maps' features and vjp too (Taylor, DPFP, ReBased but its norm's vjp), the
    causal one the projection maps' features, whose vjps are applied after it (see _vjp_after). A callable
    needs a ``vjp(x, dphi)`` of its own."""
    if type(feature_map) is str:
        found = _BY_NAME.get(feature_map)
        if found is None:
            fmap = as_map(feature_map)  # (a ValueError for an unknown name)
            found = _BY_NAME[feature_map] = fmap, fmap.kernel_code()  # (every name is an Elementwise map)
        return found
    fmap = as_map(feature_map)
    if isinstance(fmap, FeatureMap):
        code = fmap.kernel_code()
        return fmap, (code if isinstance(fmap, Elementwise) or code in _PAIRS or code in _PROJECTIONS else None)
    if not callable(getattr(fmap, "vjp", None)):
        raise TypeError(f"feature_map: a callable is differentiated only with its own derivative, a method or "
                        f"attribute vjp(x, dphi) returning the gradient of x from that of phi(x); got {feature_map!r}")
    return fmap, None


#: The pair maps' codes: the backward kernels compute their features (phi(q), phi(k) not made and
#: read again: Taylor's backward at B1 H8 N2048 D16 17.1-17.3 -> 15.6 ms) and their vjp (pair_grad's C
#: function: dphi not written and read again; D16: 10.1-10.8 -> 7.9-8.0 ms, DPFP(2) at D64 24.9-25.9 ->
#: 21.3-21.4); for ReBased the gradient of its u = gamma LN(s x) + beta, its norm's vjp (and the
#: parameters' gradients, sums over every row) following the kernel (ReBased._vjps_of_u).
_PAIRS = (mapfns.TAYLOR, mapfns.REBASED, mapfns.DPFP)
#: The projection maps' codes: the causal backward kernel computes their features and writes them out for
#: their vjps, which read them (not made before it by two calls of their own: the tiny backward, B1 H1 N16
#: D16, Hedgehog, T2R, Performer 66-68, 66-67, 72-74 -> 50-55, 51-54, 56-61 us; larger calls unchanged).
_PROJECTIONS = (mapfns.PERFORMER, mapfns.HEDGEHOG, mapfns.T2R)


def _vjp_after(code):
    """Whether the map's vjp follows the backward kernel (which then gives the gradients of phi(q), phi(k))."""
    return code is None or code in _PROJECTIONS


def _norm_after(code):
    """Whether a vjp follows the non-causal backward kernel (for the code it runs with, _noncausal_code's): a
    map's, or ReBased's norm's (the kernel then gives the gradients of its u)."""
    return code is None or code == mapfns.REBASED


def _kernel_map(fmap, code, d, comp):
    """The backward kernels' map arguments (map_grad.kernel_map) for the map of ``_map_and_code`` on inputs of
    ``d`` features: its own, or IDENTITY over features computed before the kernel."""
    if code is None or code < mapfns.FIRST:
        return kernel_map(IDENTITY if code is None else code, None, comp)
    return kernel_map(code, fmap.params(d, comp), comp)


def _lazy_kernel_map(fmap, code, d, comp):
    """_kernel_map's result, made at the first call of the returned function: a vjp's first ``vjp(dout)``,
    which compiles the backward kernel, also compiles the map's derivative, not its forward call (a
    ReBased vjp's cold forward 14.0-14.6 s with it, about 12 s without). (A list, not functools.cache: making
    that cost 1.4 us of a tiny vjp's forward.)"""
    made = []

    def kernel_map_args():
        if not made:  # (two threads calling the first vjps at once may both make it: the same arguments)
            made.append(_kernel_map(fmap, code, d, comp))
        return made[0]

    return kernel_map_args


#: The elementwise maps whose phi costs more than a pass over memory (an exp or erf per value), and the
#: values of q and k from which the non-causal vjp computes them before its kernel: the kernel computes
#: phi twice (for the sums, then for the rows), which at B1 H8 N2048 D64 cost 5% more than the passes
#: before and after it (gelu, silu); in tiny calls the passes' Python costs more (40 against 75 us).
_RECOMPUTED, _RECOMPUTE_ABOVE = (mapfns.GELU, mapfns.SILU, mapfns.SIGMOID, mapfns.SOFTPLUS), 1 << 17


def _noncausal_code(code, q, k):
    """The map's code in the non-causal backward kernel for these queries and keys (_map_and_code's, or None
    for a costly map on many values, see _RECOMPUTED, and for the projection maps: their vjps follow the
    kernel)."""
    if code in _PROJECTIONS:
        return None
    return None if code in _RECOMPUTED and q.size + k.size > _RECOMPUTE_ABOVE else code


def _mapped(fmap, x, comp):
    """phi(x) in the computation's dtype with unit stride along its rows."""
    return unit_rows(np.asarray(fmap(x)).astype(comp, copy=False))


def _map_vjp(fmap, x, dphi, y):
    """dx from dphi = the gradient of y = phi(x)."""
    dx = fmap.vjp(x, dphi, y) if isinstance(fmap, FeatureMap) else fmap.vjp(x, dphi)
    dx = np.asarray(dx)
    if dx.shape != x.shape:
        raise ValueError(f"feature_map: its vjp returned shape {dx.shape}, expected that of x, {x.shape}")
    return dx


def _map_grads(fmap, xs, dphis, ys, of_u=False):
    """([dx for each application (x, dphi, y = phi(x)) of the map], the gradients of its parameters
    summed over them as a dict by name (FeatureMap.param_vjp), or None for a map without parameters);
    a map's vjp and param_vjp share their work (FeatureMap._vjps). ``of_u``: ReBased's, from the gradients
    of its u in place of dphi (ReBased._vjps_of_u)."""
    if not (isinstance(fmap, FeatureMap) and fmap.param_names):
        return [_map_vjp(fmap, x, dphi, y) for x, dphi, y in zip(xs, dphis, ys)], None
    dxs, total = [], {}
    for x, dphi, y in zip(xs, dphis, ys):
        dx, grads = fmap._vjps_of_u(x, dphi) if of_u else fmap._vjps(x, dphi, y)
        dxs.append(dx)
        for name, grad in grads.items():
            total[name] = total[name] + grad if name in total else grad
    return dxs, total


def _check_grad(value, name, shape, dtype):
    arr = checks.as_array(value, name, 0)
    if arr.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} (that of the forward's result), got {arr.shape}")
    return half.astype(arr, dtype)


def _gate_gradients(rq, rk, lens_all, dS, dZ, final, gate, vector, decay, log_decay, lead, comp):
    """[dgate] and/or [ddecay] from the backward kernel's per-position terms rq - rk = qf_t . dqf_t -
    kf_t . dkf_t (BH, N, 1), or per key dimension qf_t[j] dqf_t[j] - kf_t[j] dkf_t[j] (BH, N, D') with a
    gate per key dimension (float64; not written past a length).

    With lam_t the log factor of position t (of dimension j) and R_end = <dS_end, S_end> + <dZ_end,
    Z_end> (of row j; 0 where dS is None: no final state's gradient), d lam_t = sum_{i >= t} terms_i +
    R_end (the identity flash-linear-attention uses for its gates' gradients, with Z as one more value
    column): cpu/gate_sums.py's running sums."""
    bh, n, width = rq.shape
    if dS is None:  # no final state's gradient: R = 0
        rows = np.zeros((bh, width))
    else:
        rows = (dS.astype(np.float64) * final.S).sum(-1) + dZ.astype(np.float64) * final.Z  # (..., D')
        rows = np.ascontiguousarray(rows if vector else rows.sum(-1, keepdims=True)).reshape(bh, width)
    shape = lead + (n,) + ((width,) if vector else ())
    dlam = np.empty(shape, comp) if gate is None else workspace.empty(shape, comp)  # (a decay alone: scratch)
    totals = np.zeros(bh)
    if bh and n:
        gate_sums.reverse_sums.get(comp, "C")(rq, rk, rows, lens_all, dlam.reshape(bh, n, width), totals)
    out = [] if gate is None else [dlam]
    if decay is not None:  # d log decay / decay
        out.append(_decay_gradient(totals / np.exp(log_decay), decay, lead))
    return out


def _final_state_gradient(dstate, return_state, lead, d, dv, comp):
    """(dS, dZ) checked, from a vjp's ``dstate`` argument; (None, None) for none."""
    if dstate is None:
        return None, None
    if not return_state:
        raise TypeError("dstate: the forward returned no state (return_state=False)")
    dS, dZ = checks.state_parts(dstate)
    return _check_grad(dS, "dstate.S", lead + (d, dv), comp), _check_grad(dZ, "dstate.Z", lead + (d,), comp)


def _decay_gradient(per_seq, decay, lead):
    """The gradient of a decay of decay's shape, broadcast to the leading dims ``lead``, from the gradient
    of each sequence's decay (``per_seq``, flat)."""
    if decay.ndim == 0:  # (one decay for every sequence)
        return np.asarray(per_seq.sum())
    per_seq = per_seq.reshape(lead)
    extra = per_seq.ndim - decay.ndim
    per_seq = per_seq.sum(tuple(range(extra))) if extra > 0 else per_seq
    axes = tuple(i for i, s in enumerate(decay.shape) if s == 1 and per_seq.shape[i] != 1)
    return per_seq.sum(axes, keepdims=True).reshape(decay.shape)


def causal_linear_attention_vjp(q, k, v, *, feature_map="elu", eps=1e-6, normalize=True, initial_state=None,
                                return_state=False, lengths=None, scale=None, decay=None, gate=None):
    """:func:`linattn.causal_linear_attention` and its vector-Jacobian product.

    Returns ``(out, vjp)``, or ``(out, state, vjp)`` with ``return_state=True``. ``vjp(dout)``
    (``vjp(dout, dstate)`` where the final state has a gradient: a :class:`State` or (dS, dZ)) returns
    ``(dq, dk, dv)``, then ``dstate0`` when ``initial_state`` was given (so that a long sequence split
    into pieces is differentiated piece by piece through the state: truncated backpropagation, or
    exactly), then ``dgate`` (the gate's shape) when ``gate`` was given and ``ddecay`` (the decay's
    shape, float64) when ``decay`` was given. Positions at or past ``lengths`` get zero gradients.
    The backward takes 2.2-3x the forward (with a gate per key dimension 2.3-5.7x, depending on the
    machine), see the README's performance section. ``vjp`` reads q, k, v and the gate when it is
    called, not copies made by the forward: do not overwrite their arrays in between.

    Every feature map of :mod:`linattn.feature_maps` is differentiated: the elementwise ones (by name or
    as ``Elementwise`` objects), Taylor and DPFP inside the backward kernel, the others through their
    ``vjp`` after it (from the features the kernel computes; a callable's are computed in full before
    it, (..., N, D') each); a map with parameters (the learned and random-feature maps) adds,
    last, a dict of their gradients by name (``FeatureMap.param_names``: "weight" and "bias", "gamma"
    and "beta", "omega"). A callable map needs a ``vjp(x, dphi)`` attribute returning the gradient of x
    (a TypeError otherwise).

    Examples
    --------
    >>> import numpy as np, linattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 50, 8)) for _ in range(3))
    >>> out, vjp = linattn.causal_linear_attention_vjp(q, k, v)
    >>> dq, dk, dv = vjp(np.ones_like(out))  # the gradient of out.sum()
    >>> dq.shape, dk.shape, dv.shape
    ((2, 50, 8), (2, 50, 8), (2, 50, 8))
    """
    if type(q) is np.ndarray and (return_state is False or return_state is True):
        # (None unless the common call: attention._fast, which takes every built-in map; the gates' gradients
        # read the final state only with the final state's gradient, which needs return_state)
        fast = _fast(True, q, k, v, feature_map, eps, normalize, True, return_state, initial_state, None, scale, decay,
                     gate, lengths)
        if fast is not None:  # float arrays of one dtype (C-contiguous, or 4-D head views): out in their dtype
            (out, final), kept = fast
            fmap, code = _map_and_code(feature_map)  # (code None: phi and its vjp in the closure, D' = dk)
            lead, n, dk = q.shape[:-2], q.shape[-2], fmap.out_dim(q.shape[-1])
            kind, gates, log_decay = _gates_as_prepared(q.dtype, q.shape, dk, decay, gate)
            lens = None if lengths is None else checks.check_lengths(lengths, lead, n).reshape(lead)  # (as _fast's)
            vjp = _backward(q, k, v, fmap, code, lead, dk, q.dtype, normalize, 1.0 if scale is None else scale,
                            initial_state, return_state, lens, decay, gate, kind, gates, log_decay, out, final, kept)
            workspace.release_with(vjp, kept[1])
            return (out, final, vjp) if return_state else (out, vjp)
    fmap, code = _map_and_code(feature_map)
    q, k, v, lead, n, _, dv, comp, out_dt = checks.check_qkv(q, k, v)
    eps = checks.check_eps(eps)
    normalize = checks.check_flag(normalize, "normalize")
    return_state = checks.check_flag(return_state, "return_state")
    s = gates_mod.check_scale(scale)
    q, k, v = (half.astype(x, comp) for x in (q, k, v))
    lens = None if lengths is None else checks.check_lengths(lengths, lead, n).reshape(lead)
    (out, final), kept = causal_with_denominators(
        q, k, v, fmap, eps, normalize, initial_state, True, lens, decay, gate, s, keep=True)
    d = final.Z.shape[-1]  # D', the features' number
    kind, gates, log_decay = gates_mod.prepare(decay, gate, lead, n, d, comp)
    vjp = _backward(q, k, v, fmap, code, lead, d, out_dt, normalize, s, initial_state, return_state, lens, decay,
                    gate, kind, gates, log_decay, out, final, kept)
    if kept[1] is not None:  # the chunk states go back to the pool with the closure
        workspace.release_with(vjp, kept[1])
    result = half.astype(out, out_dt)  # (vjp reads ``out`` itself, in the computation's dtype)
    return (result, final, vjp) if return_state else (result, vjp)


def _backward(q, k, v, fmap, code, lead, d, out_dt, normalize, s, initial_state, return_state, lens, decay, gate, kind,
              gates, log_decay, out, final, kept):
    """The vjp closure of causal attention from its forward (out, final state, and ``kept``: the
    denominators, the states at the chunk boundaries and the chunk size; ``out`` and the denominators
    are not read without normalisation) through the backward kernel: decay and a gate per position or
    per key dimension (``kind``, ``gates``, ``log_decay``: gates.prepare's)."""
    n, dv, comp = v.shape[-2], v.shape[-1], q.dtype
    den, states, chunk = kept
    decay_arr = None if decay is None else np.asarray(decay, np.float64)
    has_state = initial_state is not None  # (the forward checked it; it is in states[..., 0, :, :])
    if den is None:  # (not read without normalisation)
        den = np.zeros(lead + (n,), comp)
    valid = None if lens is None else (np.arange(n) < lens[..., None])[..., None]
    # the kernel's log factors as the forward kernel takes them: the gates (per position, or per position and
    # key dimension; with a decay alone, zeros: a view of one value) and the decay's log per sequence (float64,
    # added to them in the kernel)
    vector = kind == gates_mod.VECTOR
    width = d if vector else 1
    lam = None
    if gate is not None:
        lam = gates.reshape(lead + (n, width))  # (checked by the forward kernel, which read them)
        if valid is not None:  # (past a length: anything, the forward did not read it)
            lam = np.where(valid, lam, comp.type(0))
    elif kind != gates_mod.NONE:
        lam = np.ndarray(lead + (n, 1), comp, np.zeros(1, comp), 0, (0,) * (len(lead) + 2))  # (np.broadcast_to: 3 us)
    bh = math.prod(lead)
    lens_all = _full_lengths(bh, n) if lens is None else np.ascontiguousarray(lens.reshape(bh), np.int64)
    gated = kind != gates_mod.NONE
    # what every call shares, made once (B1 H1 N16: vjp(dout) 24 -> 18.5 us)
    no_grad = _no_state(comp, d, dv)[:2]  # no final state's gradient (read-only arrays with no rows)
    ld = np.zeros(bh) if log_decay is None else np.ascontiguousarray(log_decay, np.float64).reshape(bh)
    kmap = _lazy_kernel_map(fmap, code, q.shape[-1], comp)
    dx = d if _vjp_after(code) else q.shape[-1]  # (the kernel's dq, dk: the gradients of phi(q), phi(k) or of q, k)
    # the inputs as the kernel reads them, when they and every dout are C-contiguous (else per call);
    # (B, H, N, X) as they are (the kernel's (G1, G2, N, X), as the forward's short path passes them)
    c_inputs = None
    if code is not None and q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous \
            and out.flags.c_contiguous:
        c_inputs = (q, k, v, out) if q.ndim == 4 else tuple(x.reshape((1, bh, n, x.shape[-1])) for x in (q, k, v, out))

    def vjp(dout, dstate=None):
        g = unit_rows(_check_grad(dout, "dout", lead + (n, dv), comp))
        dS, dZ = _final_state_gradient(dstate, return_state, lead, d, dv, comp)
        if dS is None:
            H0, Z0 = no_grad
        else:
            H0, Z0 = np.ascontiguousarray(dS).reshape(bh, d, dv), np.ascontiguousarray(dZ).reshape(bh, d)
        qf = kf = None
        if code is None:  # phi applied here, its vjp after the kernel
            qf, kf = _mapped(fmap, q, comp), _mapped(fmap, k, comp)
        if code in _PROJECTIONS:  # phi written by the kernel, for the vjp after it
            qf, kf = workspace.take_views([lead + (n, d)] * 2, comp)
        dq, dk, dvv = workspace.take_views([lead + (n, x) for x in (dx, dx, dv)], comp)  # (no page faults)
        rows = bh if has_state else 0
        H_out, Z_out = np.empty((rows, d, dv), comp), np.empty((rows, d), comp)
        # (pooled: float64, (BH, N, D') each with a gate per key dimension)
        rq, rk = workspace.take_views([(bh, n, width)] * 2, np.float64) if gated else (_NO_R, _NO_R)
        status = np.zeros(3, np.int64)
        if bh and n:
            if c_inputs is not None and g.flags.c_contiguous:
                q4, k4, v4, o4 = c_inputs
                g4 = g if g.shape == o4.shape else g.reshape(o4.shape)
            else:
                arrays = (q, k) if code is not None else (qf, kf)
                (q4, k4, v4, g4, o4), _, _ = _seq4(arrays + (v, g, out), lead)  # (rows made unit-stride there)
            g12 = q4.shape[:2]
            _, frac, nthreads, two_runs = plan(bh, n, d, dv, prefix=BACKWARD_PREFIX_COST, work=BACKWARD_WORK)
            nthreads = min(nthreads, bh * (len(frac) - 1))
            kernel = backward.causal_backward.get(comp, 2 if vector else int(gated))
            lam4 = (lam.reshape(g12 + (n,) + ((d,) if vector else ())) if gated else np.empty(0, comp))
            _run(kernel, nthreads, (q4, k4, v4, g4, o4, den.reshape(g12 + (n,)), *kmap(), normalize, comp.type(s),
                                    lens_all, chunk, frac, states.reshape(g12 + states.shape[-3:]), has_state, H0, Z0,
                                    lam4, ld, dq.reshape(g12 + (n, dx)), dk.reshape(g12 + (n, dx)),
                                    dvv.reshape(g12 + (n, dv)), H_out, Z_out, rq, rk,
                                    *(_NO_PHI[comp] if code not in _PROJECTIONS else
                                      (qf.reshape(g12 + (n, d)), kf.reshape(g12 + (n, d)))), status),
                 _causal_parts(two_runs, bh, n, chunk, frac, d, dv, nthreads))
        elif has_state:
            H_out[...], Z_out[...] = (H0, Z0) if len(H0) else (0, 0)
        extra = []
        if gated:
            extra = _gate_gradients(rq, rk, lens_all, dS, dZ, final, gate, vector, decay_arr, ld, lead, comp)
        dmap = None
        if _vjp_after(code) or code == mapfns.REBASED:  # dq, dk: the gradients of phi(q), phi(k) (ReBased's u)
            # (padding past a length may hold NaN, which a map's vjp would spread: into the parameters'
            # gradients too, through phi there; the kernel's dphi is 0 past a length)
            xs, ys = (q, k), (qf, kf)
            if valid is not None:
                xs = tuple(np.where(valid, x, 0) for x in xs)
                ys = ys if qf is None else tuple(np.where(valid, y, 0) for y in ys)
            (dq, dk), dmap = _map_grads(fmap, xs, (dq, dk), ys, of_u=code == mapfns.REBASED)
            if valid is not None:
                dq, dk = np.where(valid, dq, 0), np.where(valid, dk, 0)
        grads = [half.astype(x, out_dt) for x in (dq, dk, dvv)]
        if has_state:
            grads.append(State(H_out.reshape(lead + (d, dv)), Z_out.reshape(lead + (d,))))
        return tuple(grads + extra + ([dmap] if dmap is not None else []))

    return vjp


def _scores_only(fmap, code, q, k, v):
    """(chunk, frac), the non-causal backward's plan, where it takes every head of these inputs (all of
    their positions: no lengths) from its scores (noncausal_grad's few_positions, one segment a head), so
    that it reads no state and the forward need not write one (B1 H8 N16 D64: the vjp's forward took 32 us
    writing it, 23-28 without); else None. The inputs are not checked yet: anything unusual gives None (the
    state then)."""
    if (type(k) is not np.ndarray or type(v) is not np.ndarray or q.ndim < 2 or k.ndim < 2 or v.ndim < 2
            or q.size == 0 or code is None or k.shape[-1] != q.shape[-1]):  # (q.size: no heads, or no queries,
        return None  # whose heads the backward takes from the state)
    (n, dq), nk, dv = q.shape[-2:], k.shape[-2], v.shape[-1]
    try:
        d = fmap.out_dim(dq)
    except (ValueError, TypeError):  # (a map and D that do not fit: the forward says so)
        return None
    if not few_positions.py_func(n, nk, d, dv, chunk_size(max(n, nk))) or _noncausal_code(code, q, k) is None:
        return None  # (chunk_size: the plan's chunk; the plan itself, ~1 us, only where heads are few)
    chunk, frac, _, _ = plan(math.prod(q.shape[:-2]), max(n, nk), d, dv, causal=False)
    return (chunk, frac) if len(frac) == 2 and few_positions.py_func(n, nk, d, dv, chunk) else None


def _state_columns(state, heads, dtype):
    """[S | Z] of a non-causal forward's state, (heads, D', Dv + 1) in ``dtype``, C-contiguous (a new array):
    the backward kernel's sums (cpu/noncausal_grad.py)."""
    d, dv = state.S.shape[-2:]
    sz = np.empty((heads, d, dv + 1), dtype)
    sz[..., :dv] = state.S.reshape(heads, d, dv)
    sz[..., dv] = state.Z.reshape(heads, d)
    return sz


def linear_attention_vjp(q, k=None, v=None, *, feature_map="elu", eps=1e-6, normalize=True, initial_state=None,
                         return_state=False, lengths=None, query_lengths=None, scale=None):
    """:func:`linattn.linear_attention` and its vector-Jacobian product: ``(out, vjp)`` (``(out, state,
    vjp)`` with ``return_state=True``); ``vjp(dout)`` (``vjp(dout, dstate)`` where the returned state
    has a gradient) returns ``(dq, dk, dv)`` (dk, dv None when k, v were None), then ``dstate0`` (a
    :class:`State`) when ``initial_state`` was given, and a dict of the map's parameters' gradients for
    a map with parameters. Feature maps, and the inputs read when ``vjp`` is called, as for
    :func:`causal_linear_attention_vjp`; dk and dv are 0 past ``lengths``, dq past ``query_lengths``
    (the output's gradient there is not read).

    Examples
    --------
    >>> import numpy as np, linattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((30, 4)) for _ in range(3))
    >>> out, vjp = linattn.linear_attention_vjp(q, k, v)
    >>> [x.shape for x in vjp(np.ones_like(out))]
    [(30, 4), (30, 4), (30, 4)]
    """
    fmap, code = _map_and_code(feature_map)
    out = final = few = None  # (the forward's state, [S | Z]: the backward's sums, not made again)
    keyless = k is None and v is None
    if type(q) is np.ndarray and initial_state is None and (return_state is False or return_state is True):
        # (None unless the common call: attention._fast, which takes every built-in map)
        if not return_state and lengths is None and query_lengths is None:
            few = _scores_only(fmap, code, q, k, v)
        res = _fast(False, q, k, v, feature_map, eps, normalize, False, few is None, None, None, scale,
                    lengths=lengths, query_lengths=query_lengths)
        if res is not None:
            out, final = (res, None) if few is not None else res
    if out is not None:  # float arrays of one dtype (C-contiguous or 4-D head views), keys as long as the queries
        lead, n, dv, comp, out_dt = q.shape[:-2], q.shape[-2], v.shape[-1], q.dtype, q.dtype
        s = 1.0 if scale is None else scale
        lens, qlens = (None if ls is None else checks.check_lengths(ls, lead, n, what, name)  # (as _fast's)
                       for ls, what, name in ((lengths, "Nk", "lengths"), (query_lengths, "N", "query_lengths")))
        code = _noncausal_code(code, q, k)
        valid, qvalid = (None if ls is None or not _norm_after(code) else
                         (np.arange(n) < ls.reshape(lead + (1,)))[..., None]
                         for ls in (lens, qlens))  # (read where a map's vjp or ReBased's norm's follows the kernel)
    else:
        few = None
        k, v = _keys_from_state(q, k, v, initial_state, "cpu")
        q, k, v, lead, n, _, dv, comp, out_dt = checks.check_qkv(q, k, v, cross=True)
        code = _noncausal_code(code, q, k)
        eps = checks.check_eps(eps)
        normalize = checks.check_flag(normalize, "normalize")
        return_state = checks.check_flag(return_state, "return_state")
        s = gates_mod.check_scale(scale)
        lens = None if lengths is None else checks.check_lengths(lengths, lead, k.shape[-2], "Nk")
        qlens = None if query_lengths is None else checks.check_lengths(query_lengths, lead, n, "N", "query_lengths")
        q, k, v = (half.astype(x, comp) for x in (q, k, v))
        out, final = linear_attention(q, k, v, feature_map=fmap, eps=eps, normalize=normalize, scale=s,
                                      initial_state=initial_state, return_state=True, lengths=lengths,
                                      query_lengths=query_lengths)
        # the keys and the queries past a length (padding: it may hold NaN), as masks (..., Nk or N, 1)
        valid, qvalid = (None if ls is None else (np.arange(m) < ls.reshape(lead + (1,)))[..., None]
                         for ls, m in ((lens, k.shape[-2]), (qlens, n)))
    kmap = _lazy_kernel_map(fmap, code, q.shape[-1], comp)  # (the identity over phi computed before, for code None)
    bh = math.prod(lead)
    known = _state_columns(final, bh, comp) if return_state else None  # (now: the state returned may change)

    def vjp(dout, dstate=None):
        g = _check_grad(dout, "dout", lead + (n, dv), comp)
        # the kernel computes phi and phi' of the maps it knows (code); other maps' features are its inputs
        # and their vjp is applied after it
        if _norm_after(code):  # (a map's vjp reads the queries and keys: padding as 0)
            qq, kk = (x if m is None else np.where(m, x, 0).astype(comp, copy=False)
                      for x, m in ((q, qvalid), (k, valid)))
        if code is not None:
            src = (q, k)
        else:
            src = (_mapped(fmap, qq, comp), _mapped(fmap, kk, comp))
        # (D', the features; the kernel's dq, dk: of q, k, or of phi(q), phi(k) computed here)
        dk_, nk = src[0].shape[-1] if code is None else fmap.out_dim(q.shape[-1]), k.shape[-2]
        dx = dk_ if code is None else q.shape[-1]
        dS, dZ = _final_state_gradient(dstate, return_state, lead, dk_, dv, comp)
        dqf, dkf = workspace.take_views([lead + (n, dx), lead + (nk, dx)], comp)  # (pooled: no fresh pages)
        dvv = workspace.empty(lead + (nk, dv), comp)
        base = None  # the rows added to G's sums: the returned state's gradient (zeros: G for the initial state's)
        if initial_state is not None or dS is not None:
            base = np.zeros((bh, dk_, dv + 1))
            if dS is not None:
                base[:, :, :dv] = np.asarray(dS).reshape(bh, dk_, dv)
                base[:, :, dv] = np.asarray(dZ).reshape(bh, dk_)
        G = base  # (+ the queries' part: the state's whole gradient)
        if bh and (n or nk):  # (cpu/noncausal_grad.py)
            arrays, _, _ = _seq4(src + (v, g, out, dqf, dkf, dvv), lead)
            chunk, frac, nthreads, _ = plan(bh, max(n, nk), dk_, dv, causal=False)
            if few is not None:  # (every head from its scores: the forward's plan, which decided so, and no state)
                (chunk, frac), sums = few, noncausal_grad.NO_SUMS[comp]
            else:
                sums = _state_columns(final, bh, comp) if known is None else known
            G = noncausal_grad.backward(nthreads, *arrays[:5], kmap(), comp.type(s), comp.type(eps), normalize,
                                        _full_lengths(bh, nk) if lens is None else lens,
                                        _full_lengths(bh, n) if qlens is None else qlens, chunk, frac, sums,
                                        *arrays[5:], base=base)
        dmap = None
        if not _norm_after(code):
            grads = [dqf, dkf, dvv]
        else:  # (ReBased: the kernel's dq, dk are those of its u)
            (dq, dk), dmap = _map_grads(fmap, (qq, kk), (dqf, dkf), src, of_u=code is not None)
            grads = [dq if qvalid is None else np.where(qvalid, dq, 0), dk if valid is None else np.where(valid, dk, 0),
                     dvv]
        grads = [half.astype(x, out_dt) for x in grads]
        if keyless:
            grads[1:] = [None, None]
        if initial_state is not None:
            grads.append(State(G[..., :dv].astype(comp).reshape(lead + (dk_, dv)),
                               G[..., dv].astype(comp).reshape(lead + (dk_,))))
        return tuple(grads) + ((dmap,) if dmap is not None else ())

    if return_state:
        return half.astype(out, out_dt), final, vjp
    return half.astype(out, out_dt), vjp
