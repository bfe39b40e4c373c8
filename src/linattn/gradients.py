r"""Gradients: vector-Jacobian products of the forward functions, computed with the forward kernels.

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

so a backward pass is three calls of the chunkwise kernels (no O(N^2) and no O(N D' Dv) memory; the
states in float64 accumulators), parallel as the forward is. Non-causal: the same with
``linear_attention``. Then dq = dQ_f phi'(q), dk = dK_f phi'(k).

With decay and a gate per position (log factor lam_t of the state before t), the three calls take
the same gates, the backwards ones shifted by a position (the adjoint after t decays by t+1's
factor), and d lam_t = sum_{i >= t} (Q_f,i . dQ_f,i - K_f,i . dK_f,i) + <dS, S_final> + <dZ, Z_final>
(the identity flash-linear-attention's gated kernels use; Z counts as one more value column). A gate
per key dimension would need the decay along the values' dimension in the first two calls, which the
kernels do not have: not differentiated yet.
"""
import numpy as np

from . import checks
from .attention import causal_linear_attention, linear_attention
from .feature_maps import FeatureMap, as_map
from .state import State


def _times_derivative(name, grad, x, y):
    """grad * phi'(x) in place (y = phi(x)): elu(x) + 1 has derivative min(y, 1) (y = e^x below 0,
    x + 1 above), relu 1 above 0, identity 1."""
    if name == "elu":
        grad *= np.minimum(y, y.dtype.type(1), out=y)  # (y is not needed after)
    elif name == "relu":
        grad *= x > 0
    return grad


#: Feature maps differentiated.
_DERIVATIVES = ("elu", "relu", "identity")


def _map_and_derivative(feature_map):
    fmap = as_map(feature_map)
    name = getattr(fmap, "name", None)
    if not (isinstance(fmap, FeatureMap) and name in _DERIVATIVES and fmap.input_scale == 1.0):
        raise TypeError(f"feature_map: gradients are computed for {', '.join(map(repr, _DERIVATIVES))} "
                        f"(unscaled); got {feature_map!r}")
    return fmap, name


def _ones_column(x):
    return np.concatenate([x, np.ones(x.shape[:-1] + (1,), x.dtype)], -1)


def _reverse(x):
    """x backwards in time: a view (the kernels read negative strides in place)."""
    return x[..., ::-1, :]


def _check_grad(value, name, shape, dtype):
    arr = checks.as_array(value, name, 0)
    if arr.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} (that of the forward's result), got {arr.shape}")
    return arr.astype(dtype, copy=False)


def _output_adjoints(g, out, den, normalize):
    """[a, b] (..., N, Dv + 1): the gradients of the numerators (a = g / den) and of the denominators
    (b = -(g . out) / den); without normalisation a = g, b = 0."""
    dv = g.shape[-1]
    ab = np.empty(g.shape[:-1] + (dv + 1,), g.dtype)
    if normalize:
        np.divide(g, den[..., None], out=ab[..., :dv])
        np.divide(np.einsum("...i,...i->...", g, out), den, out=ab[..., dv])
        np.negative(ab[..., dv], out=ab[..., dv])
    else:
        ab[..., :dv] = g
        ab[..., dv] = 0
    return ab


def _gate_gradients(qf, dqf, kf, dkf, dS, dZ, final, valid, kind, gate, decay, log_decay, lead):
    """[dgate] and/or [ddecay] from the features and their gradients (dqf, dkf before phi').

    With lam_t the log factor of position t and R_end = rowdot(dS_final, S_final) (over [S, Z]),
    d lam_t = sum_{i >= t} (qf_i * dqf_i - kf_i * dkf_i) + R_end, per key dimension (the identity
    flash-linear-attention uses for its gates' gradients, with Z as one more value column)."""
    from . import gates as gates_mod

    terms = (qf.astype(np.float64) * dqf - kf.astype(np.float64) * dkf)
    if valid is not None:  # (dkf past a length is not the gradient yet: it is masked later)
        terms = np.where(valid, terms, 0.0)
    dlam = np.flip(np.cumsum(np.flip(terms, -2), -2), -2)
    dlam += (dS.astype(np.float64) * final.S).sum(-1)[..., None, :] + (dZ.astype(np.float64) * final.Z)[..., None, :]
    if valid is not None:
        dlam = np.where(valid, dlam, 0.0)
    out = []
    comp = qf.dtype
    if gate is not None:
        out.append((dlam if kind == gates_mod.VECTOR else dlam.sum(-1)).astype(comp))
    if decay is not None:
        per_seq = dlam.sum((-1, -2)) / np.exp(log_decay.reshape(lead))  # d decay = d log decay / decay
        extra = per_seq.ndim - decay.ndim
        per_seq = per_seq.sum(tuple(range(extra))) if extra > 0 else per_seq
        axes = tuple(i for i, s in enumerate(decay.shape) if s == 1 and per_seq.shape[i] != 1)
        out.append(per_seq.sum(axes, keepdims=True).reshape(decay.shape))
    return out


def causal_linear_attention_vjp(q, k, v, *, feature_map="elu", eps=1e-6, normalize=True, initial_state=None,
                                return_state=False, lengths=None, scale=None, decay=None, gate=None):
    """:func:`linattn.causal_linear_attention` and its vector-Jacobian product.

    Returns ``(out, vjp)``, or ``(out, state, vjp)`` with ``return_state=True``. ``vjp(dout)``
    (``vjp(dout, dstate)`` where the final state has a gradient: a :class:`State` or (dS, dZ)) returns
    ``(dq, dk, dv)``, then ``dstate0`` when ``initial_state`` was given (so that a long sequence split
    into pieces is differentiated piece by piece through the state: truncated backpropagation, or
    exactly), then ``dgate`` (the gate's shape) when ``gate`` was given and ``ddecay`` (the decay's
    shape, float64) when ``decay`` was given. Positions at or past ``lengths`` get zero gradients.
    Feature maps: "elu", "relu", "identity".

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
    fmap, name = _map_and_derivative(feature_map)
    q, k, v, lead, n, d, dv, comp, out_dt = checks.check_qkv(q, k, v)
    eps = checks.check_eps(eps)
    normalize = checks.check_flag(normalize, "normalize")
    return_state = checks.check_flag(return_state, "return_state")
    from .gates import check_scale

    s = check_scale(scale)
    q, k, v = (x.astype(comp, copy=False) for x in (q, k, v))
    lens = None if lengths is None else checks.check_lengths(lengths, lead, n).reshape(lead)
    from . import gates as gates_mod

    kind, gates, log_decay = gates_mod.prepare(decay, gate, lead, n, d, comp)
    if kind == gates_mod.VECTOR:
        raise TypeError("gate: gradients with a gate per key dimension are not available yet (a gate per "
                        "position and decay are)")
    if gates is not None:
        gates_mod.check_gate_values(gates)  # (the kernels would find them too, later)
    decay_arr = None if decay is None else np.asarray(decay, np.float64)
    has_state = initial_state is not None
    if has_state:
        S0, Z0 = checks.check_state(initial_state, "initial_state", lead, d, dv, comp)
        S0, Z0 = np.asarray(S0), np.asarray(Z0)
    else:
        S0, Z0 = np.zeros(lead + (d, dv), comp), np.zeros(lead + (d,), comp)
    v1 = _ones_column(v)
    # num and den in one call: v with a column of ones, the state with Z as its last column
    aug, st = causal_linear_attention(q, k, v1, feature_map=fmap, normalize=False, scale=s, decay=decay, gate=gate,
                                      initial_state=State(np.concatenate([S0, Z0[..., None]], -1),
                                                          np.zeros(lead + (d,), comp)),
                                      return_state=True, lengths=lens)
    num, den = aug[..., :dv], aug[..., dv] + comp.type(eps)
    out = num / den[..., None] if normalize else num
    valid = None if lens is None else (np.arange(n) < lens[..., None])[..., None]
    final = State(st.S[..., :dv].copy(), st.S[..., dv].copy())
    # the log factor of every position, (..., N, D') or (..., N, 1), decay folded in, 0 past a length; and
    # the same backwards in time, shifted by one (the state after position t decays by position t+1's)
    lam = lam_rev = None
    if kind != gates_mod.NONE:
        lam = np.zeros(lead + (n, 1)) if gate is None else (
            gates.astype(np.float64) if kind == gates_mod.VECTOR else gates.astype(np.float64)[..., None])
        if log_decay is not None:
            lam = lam + log_decay.reshape(lead + (1, 1))
        if valid is not None:
            lam = np.where(valid, lam, 0.0)
        lam_rev = np.concatenate([np.zeros_like(lam[..., :1, :]), lam[..., ::-1, :][..., :-1, :]], -2)
        lam, lam_rev = (x.astype(comp) if x.shape[-1] > 1 else x[..., 0].astype(comp) for x in (lam, lam_rev))

    def vjp(dout, dstate=None):
        g = _check_grad(dout, "dout", lead + (n, dv), comp)
        if valid is not None:
            g = np.where(valid, g, 0)
        if dstate is None:
            dS, dZ = np.zeros(lead + (d, dv), comp), np.zeros(lead + (d,), comp)
        else:
            if not return_state:
                raise TypeError("dstate: the forward returned no state (return_state=False)")
            dS, dZ = checks.state_parts(dstate)
            dS = _check_grad(dS, "dstate.S", lead + (d, dv), comp)
            dZ = _check_grad(dZ, "dstate.Z", lead + (d,), comp)
        ab = _output_adjoints(g, out, den, normalize)
        a = ab[..., :dv]
        qf, kf = fmap(q), fmap(k)
        sq = qf * comp.type(s) if s != 1.0 else qf
        zeros = np.zeros(lead + (dv + 1,), comp)
        dk = np.empty(lead + (n, d), comp)  # the backwards calls write into reversed views of these
        dvv = np.empty(lead + (n, dv), comp)
        # dQf = s (S_i a_i + Z_i b_i)
        dqf = causal_linear_attention(ab, v1, kf, feature_map="identity", normalize=False, scale=s, gate=lam,
                                      initial_state=State(np.swapaxes(np.concatenate([S0, Z0[..., None]], -1), -1, -2),
                                                          zeros))
        # dKf = G_j v_j + H_j and the initial state's gradient, backwards in time
        _, back = causal_linear_attention(
            _reverse(v1), _reverse(ab), _reverse(sq), feature_map="identity", normalize=False, gate=lam_rev,
            initial_state=State(np.swapaxes(np.concatenate([dS, dZ[..., None]], -1), -1, -2), zeros),
            return_state=True, out=_reverse(dk))
        # dv = G_j^T Kf_j, backwards in time
        causal_linear_attention(_reverse(kf), _reverse(sq), _reverse(a), feature_map="identity", normalize=False,
                                gate=lam_rev, initial_state=State(dS, np.zeros(lead + (d,), comp)), out=_reverse(dvv))
        extra = []
        if kind != gates_mod.NONE:
            extra = _gate_gradients(qf, dqf, kf, dk, dS, dZ, final, valid, kind, gate, decay_arr, log_decay, lead)
        dq = _times_derivative(name, dqf, q, qf)
        dk = _times_derivative(name, dk, k, kf)
        if valid is not None:  # past its length a sequence's inputs do not matter
            dq, dk, dvv = (np.where(valid, x, 0) for x in (dq, dk, dvv))
        dq, dk, dvv = (x.astype(out_dt, copy=False) for x in (dq, dk, dvv))
        grads = [dq, dk, dvv]
        if has_state:
            G0 = np.swapaxes(back.S, -1, -2)  # (D', Dv + 1): the gradient of [S, Z] before position 0's factor
            if lam is not None:
                f0 = np.exp(lam[..., 0, :] if lam.ndim == len(lead) + 2 else lam[..., 0:1])
                G0 = G0 * f0[..., :, None]
            grads.append(State(G0[..., :dv].astype(comp), G0[..., dv].astype(comp)))
        return tuple(grads + extra)

    out = out.astype(out_dt, copy=False)
    if return_state:
        return out, final, vjp
    return out, vjp


def linear_attention_vjp(q, k, v, *, feature_map="elu", eps=1e-6, normalize=True, scale=None):
    """:func:`linattn.linear_attention` and its vector-Jacobian product: ``(out, vjp)``, ``vjp(dout)``
    returns ``(dq, dk, dv)``. Feature maps: "elu", "relu", "identity".

    Examples
    --------
    >>> import numpy as np, linattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((30, 4)) for _ in range(3))
    >>> out, vjp = linattn.linear_attention_vjp(q, k, v)
    >>> [x.shape for x in vjp(np.ones_like(out))]
    [(30, 4), (30, 4), (30, 4)]
    """
    fmap, name = _map_and_derivative(feature_map)
    q, k, v, lead, n, d, dv, comp, out_dt = checks.check_qkv(q, k, v)
    eps = checks.check_eps(eps)
    normalize = checks.check_flag(normalize, "normalize")
    from .gates import check_scale

    s = check_scale(scale)
    q, k, v = (x.astype(comp, copy=False) for x in (q, k, v))
    v1 = _ones_column(v)
    aug = linear_attention(q, k, v1, feature_map=fmap, normalize=False, scale=s)
    num, den = aug[..., :dv], aug[..., dv] + comp.type(eps)
    out = num / den[..., None] if normalize else num

    def vjp(dout):
        g = _check_grad(dout, "dout", lead + (n, dv), comp)
        ab = _output_adjoints(g, out, den, normalize)
        a = ab[..., :dv]
        qf, kf = fmap(q), fmap(k)
        sq = qf * comp.type(s) if s != 1.0 else qf
        dqf = linear_attention(ab, v1, kf, feature_map="identity", normalize=False, scale=s)
        dkf = linear_attention(v1, ab, sq, feature_map="identity", normalize=False)
        dvv = linear_attention(kf, sq, a, feature_map="identity", normalize=False)
        return (_times_derivative(name, dqf, q, qf).astype(out_dt, copy=False),
                _times_derivative(name, dkf, k, kf).astype(out_dt, copy=False), dvv.astype(out_dt, copy=False))

    return out.astype(out_dt, copy=False), vjp
