"""The options together, drawn at random (hypothesis): feature map x decay and gates (with resets) x
initial state x lengths x scale x normalize x dtype x layout, against the float64 masked reference;
with ``out=``, ``attention_weights``, the non-causal form, split/resume through the state and
prefill + ``step`` on the same draws; and the gradients of every input on such draws."""
import re
from contextlib import contextmanager
from unittest import mock

import numba
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import linattn
from linattn import attention, gradients, reference
from linattn import feature_maps as fm

from conftest import TOL, cancellation


class CoshPair:
    """A user's callable map with its derivative: phi(x) = [exp(x), exp(-x)] / 2 (D' = 2D, > 0), applied
    with NumPy before the kernels."""

    def __call__(self, x):
        return np.concatenate([np.exp(x), np.exp(-x)], -1) / 2

    def vjp(self, x, dphi):
        d = x.shape[-1]
        return (dphi[..., :d] * np.exp(x) - dphi[..., d:] * np.exp(-x)) / 2

    # (as the maps of linattn.feature_maps, for the tests below)
    param_names = ()

    def out_dim(self, d):
        return 2 * d

    def param_values(self):
        return {}

    def with_params(self):
        return self


#: name -> (a map for inputs of D features from rng, whether its features are >= 0: normalisable)
MAPS = {
    "callable": (lambda d, rng: CoshPair(), True),
    "elu": (lambda d, rng: "elu", True),
    "relu": (lambda d, rng: "relu", True),
    "identity": (lambda d, rng: "identity", False),
    "gelu": (lambda d, rng: "gelu", False),
    "softplus": (lambda d, rng: "softplus", True),
    "taylor": (lambda d, rng: fm.Taylor().scaled(0.7), True),
    "dpfp": (lambda d, rng: fm.DPFP(2), True),
    "rebased": (lambda d, rng: fm.ReBased(rng.standard_normal(d) * 0.5 + 1, rng.standard_normal(d) * 0.2), True),
    "performer": (lambda d, rng: fm.Performer(rng.standard_normal((d, 5))).scaled(0.5), True),
    "hedgehog": (lambda d, rng: fm.Hedgehog(rng.standard_normal((d, 3)), rng.standard_normal(3) * 0.1), True),
    "t2r": (lambda d, rng: fm.T2R(rng.standard_normal((d, 4)), rng.standard_normal(4) * 0.1 + 0.5), True),
}
GATINGS = ["none", "decay", "position", "dimension", "decay+position"]


def _layout(x, how):
    """x as a C-contiguous array, a view with its last two axes transposed in memory, every other row, or
    a view of the heads (the last leading dim) of an array with positions before heads, as a fused
    projection's."""
    if how == "heads" and x.ndim >= 3:
        return np.moveaxis(np.moveaxis(x, -2, -3).copy(), -3, -2)
    if how == "transposed":
        return np.swapaxes(x, -1, -2).copy().swapaxes(-1, -2)
    if how == "strided":
        y = np.zeros(x.shape[:-2] + (2 * x.shape[-2], x.shape[-1]), x.dtype)
        y[..., ::2, :] = x
        return y[..., ::2, :]
    return x


def _per_sequence(lengths, lead):
    """lengths (shaped like the leading dims or like their first) broadcast to the leading dims."""
    return np.broadcast_to(np.reshape(lengths, np.shape(lengths) + (1,) * (len(lead) - np.ndim(lengths))), lead)


def _gate_at(gate, gating, positions):
    """The gate at ``positions`` (an index or a slice; the positions' axis is the last but one for a gate
    per key dimension); None without a gate."""
    return None if gate is None else gate[(Ellipsis, positions) + ((slice(None),) if gating == "dimension" else ())]


def _reference(q, k, v, lengths, gate, decay, initial_state, **kw):
    """reference.masked sequence by sequence, each cut at its length (0 past it); and the draw's condition
    number: the largest |phi(q)|.|Z| / |phi(q).Z + eps| over the positions with normalisation (the
    denominator's cancellation amplifies float rounding by as much where features have both signs:
    ReBased's, Taylor's), else 1; at least 1 + 8 eps (of the compute dtype) times the largest output's
    terms (|phi(q)|.(sum |phi(k)| |v|) over its denominator) over TOL x max |out|: an output far
    smaller than its terms carries their rounding (explore mode drew phi(q).S of 5 terms 5800 times
    smaller than their sum of magnitudes)."""
    lead, n, dv = q.shape[:-2], q.shape[-2], v.shape[-1]
    out = np.zeros(lead + (n, dv))
    lens = np.full(lead, n) if lengths is None else _per_sequence(lengths, lead)
    dec = None if decay is None else np.broadcast_to(decay, lead)
    fmap, cond, terms = fm.as_map(kw["feature_map"]), 1.0, 0.0
    magnitudes = dict(kw, feature_map=lambda x: np.abs(fmap(x)), normalize=False)
    for idx in np.ndindex(*lead):
        m = int(lens[idx])
        if m == 0:
            continue
        state = None if initial_state is None else (initial_state.S[idx], initial_state.Z[idx])
        args = dict(gate=None if gate is None else gate[idx][:m], decay=None if dec is None else dec[idx])
        out[idx][:m] = reference.masked(q[idx][:m], k[idx][:m], v[idx][:m], initial_state=state, **args, **kw)
        size = reference.masked(q[idx][:m], k[idx][:m], np.abs(v[idx][:m]), **args, **magnitudes,
                                initial_state=None if state is None else (np.abs(state[0]), np.abs(state[1])))
        if kw["normalize"]:
            ones = np.ones((m, 1))  # (phi(q).Z as the numerator of v = 1 with S0 = Z0)
            dens = [reference.masked(q[idx][:m], k[idx][:m], ones, normalize=False, scale=kw["scale"], **args,
                                     causal=kw.get("causal", True),
                                     feature_map=f, initial_state=None if z is None else (z[:, None], z))
                    for f, z in ((fmap, None if state is None else state[1]),
                                 (lambda x: np.abs(fmap(x)), None if state is None else np.abs(state[1])))]
            cond = max(cond, float(np.max(dens[1] / (np.abs(dens[0]) + 1e-6))))
            size = size / np.abs(dens[0] + 1e-6)
        terms = max(terms, float(np.max(size)))
    return out, max(cond, cancellation(out, terms, q.dtype))


def _close(out, ref, dtype, cond, whole=None):
    """|out - ref| <= TOL x cond relative to max |ref| (or to max |whole|: a part of a result, such as one
    position's outputs, against the largest value of the result it is part of), or to the dtype's smallest
    normal number if larger (float16's 6e-5: results below it lose their digits to the format, not to the
    kernels)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    scale = max(float(np.max(np.abs(ref if whole is None else whole), initial=0.0)), float(np.finfo(dtype).tiny))
    err = float(np.max(np.abs(out - ref), initial=0.0)) / scale
    assert err <= TOL[np.dtype(dtype)] * cond, f"relative error {err:.3e} > {TOL[np.dtype(dtype)]:.1e} x {cond:.3g}"


#: None (the plan as it is: one segment a head at these sizes), or the heads of every causal call cut at
#: the drawn fractions of their chunks (empty segments too), in one run (each segment sums its prefix) or
#: two (runtime.plan's two ways for few heads on many threads)
SEGMENTS = st.one_of(st.none(), st.tuples(st.lists(st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.6, 0.9, 1.0]),
                                                   min_size=1, max_size=3), st.booleans()))


@contextmanager
def _segments(drawn):
    """Every causal call (forward, and the vjp's backward) with its heads in the ``drawn`` segments."""
    if drawn is None:
        yield
        return
    cuts, two_runs = drawn
    frac = np.array([0.0] + sorted(cuts) + [1.0])
    threads = min(2, numba.config.NUMBA_NUM_THREADS)

    def forced(real):
        def plan(*args, **kw):
            found = real(*args, **kw)
            causal = kw.get("causal", args[4] if len(args) > 4 else True)
            return (found[0], frac, threads, two_runs) if causal else found
        return plan

    attention._constants.clear()  # (the short path's plans)
    try:
        with mock.patch.object(attention, "plan", forced(attention.plan)), \
                mock.patch.object(gradients, "plan", forced(gradients.plan)):
            yield
    finally:
        attention._constants.clear()


@settings(max_examples=150, deadline=None)
@given(lead=st.sampled_from([(), (3,), (2, 2)]), n=st.integers(1, 70), d=st.integers(1, 5), dv=st.integers(1, 4),
       dtype=st.sampled_from([np.float32, np.float64, np.float16]), map_name=st.sampled_from(sorted(MAPS)),
       gating=st.sampled_from(GATINGS), reset=st.booleans(), with_state=st.booleans(),
       with_lengths=st.sampled_from([None, "leading", "first"]),
       scale=st.sampled_from([None, 0.5]), layout=st.sampled_from(["c", "transposed", "strided", "heads"]),
       split=st.floats(0, 1), segments=SEGMENTS, seed=st.integers(0, 2**31))
def test_options_together(lead, n, d, dv, dtype, map_name, gating, reset, with_state, with_lengths, scale, layout,
                          split, segments, seed):
    """Every option drawn, and the heads in the drawn segments (``SEGMENTS``)."""
    with _segments(segments):
        _options_together(lead, n, d, dv, dtype, map_name, gating, reset, with_state, with_lengths, scale, layout,
                          split, seed)


def _options_together(lead, n, d, dv, dtype, map_name, gating, reset, with_state, with_lengths, scale, layout, split,
                      seed):
    rng = np.random.default_rng(seed)
    make_map, positive = MAPS[map_name]
    fmap = make_map(d, rng)
    normalize = positive
    q, k = ((rng.standard_normal(lead + (n, d)) * 0.5).astype(dtype) for _ in range(2))
    v = rng.standard_normal(lead + (n, dv)).astype(dtype)
    dk = fm.as_map(fmap).out_dim(d)
    decay = gate = None
    if "decay" in gating:
        decay = rng.uniform(0.8, 1.0, lead[-1:] if lead else ()).astype(dtype)
    if gating in ("position", "decay+position", "dimension"):
        shape = lead + (n,) + ((dk,) if gating == "dimension" else ())
        gate = np.log(rng.uniform(0.7, 1.0, shape)).astype(dtype)
        if reset:  # a position (or one of its dimensions) that forgets everything before it
            at = (rng.integers(n), rng.integers(dk)) if gating == "dimension" else (rng.integers(n),)
            gate[(Ellipsis,) + at] = -np.inf
    state = None
    if with_state:  # (in the computation's dtype: float32 for float16 inputs)
        sdt = np.float32 if dtype == np.float16 else dtype
        state = linattn.State((rng.standard_normal(lead + (dk, dv)) * 0.3).astype(sdt),
                              rng.uniform(0.5, 1.5, lead + (dk,)).astype(sdt))
    lengths = None  # (shaped like the leading dims, or like their first)
    if with_lengths and lead:
        lengths = rng.integers(0, n + 1, lead if with_lengths == "leading" else lead[:1])
    kw = dict(feature_map=fmap, normalize=normalize, scale=scale)
    args = [_layout(x, layout) for x in (q, k, v)]
    out = linattn.causal_linear_attention(*args, initial_state=state, lengths=lengths, decay=decay, gate=gate, **kw)
    assert out.dtype == dtype and out.shape == lead + (n, dv)
    want, cond = _reference(q, k, v, lengths, gate, decay, state, **kw)
    _close(out, want, dtype, cond)
    buf = np.full(lead + (dv, n), np.nan, dtype)  # out= into a view with other strides: the same values
    res, final = linattn.causal_linear_attention(*args, initial_state=state, lengths=lengths, decay=decay, gate=gate,
                                                 out=np.swapaxes(buf, -1, -2), return_state=True, **kw)
    assert np.shares_memory(res, buf)
    np.testing.assert_array_equal(np.swapaxes(buf, -1, -2), out)
    lens = None if lengths is None else _per_sequence(lengths, lead)  # (the state: each sequence's at its length)
    _, (S_ref, Z_ref) = reference.loop(q, k, v, initial_state=state, return_state=True, decay=decay, gate=gate,
                                       lengths=lens, **kw)
    # (its sums cancel where features or v have both signs: the tolerance grows by sum |terms| / max |sum|)
    mag = dict(kw, feature_map=lambda x: np.abs(fm.as_map(fmap)(x)))
    _, (S_abs, Z_abs) = reference.loop(q, k, np.abs(v), return_state=True, decay=decay, gate=gate, lengths=lens,
                                       initial_state=None if state is None else (np.abs(state.S), np.abs(state.Z)),
                                       **mag)
    sdt = np.float32 if dtype == np.float16 else dtype
    assert final.S.dtype == sdt and final.S.shape == S_ref.shape and final.Z.shape == Z_ref.shape
    for got, ref, size in ((final.S, S_ref, S_abs), (final.Z, Z_ref, Z_abs)):
        largest = max(float(np.max(np.abs(ref), initial=0.0)), 1e-300)
        _close(got, ref, sdt, max(1.0, float(np.max(size, initial=0.0)) / largest))
    # the weights it applies implicitly (not float16's: rounded to 2**-11 each, their product with v is
    # as far from out as max |v| / 2000, which can exceed the tolerance relative to max |out|)
    if state is None and lengths is None and normalize and dtype != np.float16:
        w = linattn.attention_weights(q, k, decay=decay, gate=gate, feature_map=fmap, scale=scale)
        _close(w.astype(np.float64) @ v, want, dtype, cond)
    if gate is None and decay is None and state is None and lengths is None:  # non-causal
        nc_want, nc_cond = _reference(q, k, v, None, None, None, None, causal=False, **kw)
        _close(linattn.linear_attention(*args, **kw), nc_want, dtype, nc_cond)
    if lengths is not None:
        return
    # split/resume through the state, then prefill + step for the positions after the split
    m = int(split * n)
    g1, g2 = _gate_at(gate, gating, slice(None, m)), _gate_at(gate, gating, slice(m, None))
    a, mid = linattn.causal_linear_attention(q[..., :m, :], k[..., :m, :], v[..., :m, :], initial_state=state,
                                             return_state=True, decay=decay, gate=g1, **kw)
    b = linattn.causal_linear_attention(q[..., m:, :], k[..., m:, :], v[..., m:, :], initial_state=mid,
                                        decay=decay, gate=g2, **kw)
    _close(np.concatenate([a, b], -2), want, dtype, cond)
    for t in range(m, min(n, m + 3)):  # (each position against the largest output, as the forward's: explore
        # mode drew a position whose output, -1.1e-4, was 1000 times smaller than the largest)
        o = linattn.step(q[..., t, :], k[..., t, :], v[..., t, :], mid, decay=decay, gate=_gate_at(gate, gating, t),
                         **kw)
        _close(o, want[..., t, :], dtype, cond, whole=want)


def _directional(f, x, dx, h):
    """The derivative of f at x along dx (dicts of arrays): central differences at h and h/2, extrapolated
    (Richardson: their h**2 terms cancel, which matters where a denominator phi(q).Z + eps is small)."""
    def central(h):
        return (f({n: x[n] + h * dx[n] for n in x}) - f({n: x[n] - h * dx[n] for n in x})) / (2 * h)

    return (4 * central(h / 2) - central(h)) / 3


def _assert_derivative(have, f, x, dx):
    """have == the derivative of f along dx, to 1e-6 relative, at h = 1e-5 or, where the function curves
    too fast for it (ReBased's norm of two features that nearly agree: 1 / sqrt(var + eps) ~ 300), 1e-6."""
    wants = []
    for h in (1e-5, 1e-6):
        wants.append(_directional(f, x, dx, h))
        if abs(have - wants[-1]) <= 1e-6 * max(1.0, abs(wants[-1])):
            return
    raise AssertionError(f"vjp along dx {have!r}, differences {wants!r}")


@settings(max_examples=100, deadline=None)
@given(lead=st.sampled_from([(), (3,), (2, 2)]), n=st.integers(1, 70), d=st.integers(1, 4), dv=st.integers(1, 3),
       map_name=st.sampled_from(sorted(MAPS)), gating=st.sampled_from(GATINGS), with_state=st.booleans(),
       with_lengths=st.booleans(), scale=st.sampled_from([None, 0.5]), segments=SEGMENTS, seed=st.integers(0, 2**31))
def test_gradients_together(lead, n, d, dv, map_name, gating, with_state, with_lengths, scale, segments, seed):
    """vjp along a random direction of every input (q, k, v, the initial state, gate, decay and the map's
    parameters) equals the forward's central difference, float64, the final state's gradient included;
    the heads in the drawn segments (``SEGMENTS``) forward and backward."""
    with _segments(segments):
        _gradients_together(lead, n, d, dv, map_name, gating, with_state, with_lengths, scale, seed)


def _gradients_together(lead, n, d, dv, map_name, gating, with_state, with_lengths, scale, seed):
    rng = np.random.default_rng(seed)
    make_map, positive = MAPS[map_name]
    fmap = fm.as_map(make_map(d, rng))
    dk = fmap.out_dim(d)
    x = {"q": rng.standard_normal(lead + (n, d)) * 0.5, "k": rng.standard_normal(lead + (n, d)) * 0.5,
         "v": rng.standard_normal(lead + (n, dv))}
    if with_state:
        x["S"], x["Z"] = rng.standard_normal(lead + (dk, dv)) * 0.3, rng.uniform(0.5, 1.5, lead + (dk,))
    if gating in ("position", "decay+position", "dimension"):
        # (at most log 0.98: still < 0 along the difference)
        x["gate"] = np.log(rng.uniform(0.7, 0.98, lead + (n,) + ((dk,) if gating == "dimension" else ())))
    if "decay" in gating:
        x["decay"] = rng.uniform(0.8, 0.95, lead[-1:] if lead else ())
    for name, value in fmap.param_values().items():
        x["map." + name] = value
    lengths = rng.integers(0, n + 1, lead) if with_lengths and lead else None
    if map_name in ("relu", "dpfp", "t2r"):  # (a difference across relu's kink is not its derivative)
        pre = [x["q"], x["k"]] if map_name != "t2r" else [y @ fmap.weight + fmap.bias for y in (x["q"], x["k"])]
        assume(min(np.abs(p).min() for p in pre) > 1e-4)

    def call(x, vjp=False):
        fn = linattn.causal_linear_attention_vjp if vjp else linattn.causal_linear_attention
        params = {name[4:]: value for name, value in x.items() if name.startswith("map.")}
        state = linattn.State(x["S"], x["Z"]) if with_state else None
        return fn(x["q"], x["k"], x["v"], feature_map=fmap.with_params(**params), normalize=positive, scale=scale,
                  initial_state=state, return_state=True, lengths=lengths, gate=x.get("gate"), decay=x.get("decay"))

    out, final, vjp = call(x, vjp=True)
    g_out, g_S, g_Z = (rng.standard_normal(a.shape) for a in (out, final.S, final.Z))

    def loss(x):
        o, s = call(x)
        return (g_out * o).sum() + (g_S * s.S).sum() + (g_Z * s.Z).sum()

    grads = list(vjp(g_out, (g_S, g_Z)))
    got = {"q": grads.pop(0), "k": grads.pop(0), "v": grads.pop(0)}
    if with_state:
        s0 = grads.pop(0)
        got["S"], got["Z"] = s0.S, s0.Z
    for name in ("gate", "decay"):
        if name in x:
            got[name] = grads.pop(0)
    if fmap.param_names:
        got.update({"map." + name: grad for name, grad in grads.pop(0).items()})
    assert not grads and set(got) == set(x)
    dx = {name: rng.standard_normal(np.shape(value)) for name, value in x.items()}
    if "decay" in dx:
        dx["decay"] *= 0.01  # (decay stays within (0, 1] along the difference)
    _assert_derivative(sum(float((got[name] * dx[name]).sum()) for name in x), loss, x, dx)
    if with_state or lengths is not None or "gate" in x or "decay" in x:
        return
    # the non-causal form's gradients the same way

    def noncausal(x, vjp=False):
        params = {name[4:]: value for name, value in x.items() if name.startswith("map.")}
        fn = linattn.linear_attention_vjp if vjp else linattn.linear_attention
        return fn(x["q"], x["k"], x["v"], feature_map=fmap.with_params(**params), normalize=positive, scale=scale)

    out, vjp = noncausal(x, vjp=True)
    grads = list(vjp(g_out))
    got = dict(zip("qkv", grads[:3]))
    if fmap.param_names:
        got.update({"map." + name: grad for name, grad in grads[3].items()})
    assert len(grads) == 3 + bool(fmap.param_names) and set(got) == set(x)
    _assert_derivative(sum(float((got[name] * dx[name]).sum()) for name in x), lambda x: (g_out * noncausal(x)).sum(),
                       x, dx)


ARG_NAMES = ("q", "k", "v", "feature_map", "eps", "normalize", "initial_state", "state", "lengths", "query_lengths",
             "decay", "gate", "scale", "out", "dout", "dstate", "return_state", "causal")


def _maybe_bad(draw, good, name):
    """``good``, or (five times in eleven) something wrong in its place: another shape, dtype or kind, None
    or an odd number."""
    kind = draw(st.sampled_from(["good"] * 6 + ["shape", "dtype", "kind", "none", "scalar"]))
    if kind == "good":
        return good
    if name == "feature_map":  # (names, objects and callables that do not fit)
        return draw(st.sampled_from(["tanh", 3, None, fm.T2R(np.ones((7, 2))), lambda x: x[..., :0],
                                     lambda x: np.zeros(3), lambda x: x.astype(complex)]))
    if kind == "shape" and isinstance(good, np.ndarray):
        return np.zeros(good.shape[:-1] + (good.shape[-1] + 1,) if good.ndim else (2,), good.dtype)
    if kind == "dtype" and isinstance(good, np.ndarray):
        return good.astype(draw(st.sampled_from([np.complex64, object, "U3", bool])))
    if kind == "kind":
        return draw(st.sampled_from(["x", [[1, "a"]], {"a": 1}, object()]))
    if kind == "scalar":
        return draw(st.sampled_from([np.nan, -1.0, 2.5, 0, np.inf]))
    return None


@pytest.mark.filterwarnings("error")  # (a warning, e.g. NumPy's when a complex array is cast to real, fails)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), lead=st.sampled_from([(), (2,), (2, 3)]), n=st.integers(1, 20), d=st.integers(1, 4),
       dv=st.integers(1, 3), f64=st.booleans())
def test_bad_input_is_named(data, lead, n, d, dv, f64):
    """Arguments swapped at random for wrong ones (shapes, dtypes, kinds, None, odd numbers): every call
    either works or raises a ValueError or TypeError that names an argument; never another exception."""
    rng = np.random.default_rng(0)
    dtype = np.float64 if f64 else np.float32
    q, k = ((rng.standard_normal(lead + (n, d)) * 0.5).astype(dtype) for _ in range(2))
    v = rng.standard_normal(lead + (n, dv)).astype(dtype)
    good = dict(q=q, k=k, v=v, gate=np.log(rng.uniform(0.5, 1, lead + (n,))).astype(dtype),
                decay=np.full(lead[-1:], 0.9, dtype), lengths=np.full(lead[:1], n) if lead else None,
                query_lengths=np.full(lead, n - 1) if lead else None,
                initial_state=linattn.State.zeros(lead, d, dv, dtype), scale=0.5, eps=1e-6,
                out=np.zeros(lead + (n, dv), dtype), feature_map="elu", normalize=True)
    draw = data.draw
    args = {name: _maybe_bad(draw, value, name) for name, value in good.items()}
    fn = draw(st.sampled_from(["causal", "noncausal", "step", "weights", "vjp"]))
    try:
        if fn == "causal":
            linattn.causal_linear_attention(**{a: x for a, x in args.items() if a != "query_lengths"})
        elif fn == "noncausal":
            linattn.linear_attention(**{a: args[a] for a in ("q", "k", "v", "scale", "eps", "out", "feature_map",
                                                             "normalize", "initial_state", "lengths",
                                                             "query_lengths")})
        elif fn == "step":
            state = args["initial_state"]
            linattn.step(*(x[..., 0, :] if isinstance(x, np.ndarray) and x.ndim >= 2 else x
                           for x in (args["q"], args["k"], args["v"])), state, scale=args["scale"], eps=args["eps"],
                         decay=args["decay"], feature_map=args["feature_map"], normalize=args["normalize"])
        elif fn == "weights":
            linattn.attention_weights(args["q"], args["k"], gate=args["gate"], decay=args["decay"],
                                      scale=args["scale"], feature_map=args["feature_map"], lengths=args["lengths"])
        else:
            _, vjp = linattn.causal_linear_attention_vjp(*(good[a] for a in "qkv"))
            vjp(args["v"])  # (as dout: v's shape is out's)
    except (ValueError, TypeError) as exc:
        assert re.match(rf"({'|'.join(ARG_NAMES)})(\.\w+|\(\w+\))?: ", str(exc)), str(exc)  # (names it first)


@settings(max_examples=100, deadline=None)
@given(lead=st.sampled_from([(), (1,), (3,), (2, 3), (5, 8)]), n=st.integers(1, 6), d=st.integers(1, 5),
       dv=st.integers(1, 4), dtype=st.sampled_from([np.float32, np.float64, np.float16]),
       map_name=st.sampled_from(sorted(MAPS)), gating=st.sampled_from(GATINGS),
       state_layout=st.sampled_from(["c", "transposed"]), with_out=st.booleans(), seed=st.integers(0, 2**31))
def test_steps_together(lead, n, d, dv, dtype, map_name, gating, state_layout, with_out, seed):
    """Steps from a state in any layout, into ``out=`` or not, equal the causal call on the whole, and
    leave the state it returns."""
    rng = np.random.default_rng(seed)
    make_map, positive = MAPS[map_name]
    fmap = make_map(d, rng)
    dk = fm.as_map(fmap).out_dim(d)
    q, k = ((rng.standard_normal(lead + (n, d)) * 0.5).astype(dtype) for _ in range(2))
    v = rng.standard_normal(lead + (n, dv)).astype(dtype)
    decay = rng.uniform(0.8, 1.0, lead[-1:] if lead else ()) if "decay" in gating else None
    gate = None
    if gating in ("position", "decay+position", "dimension"):
        gate = np.log(rng.uniform(0.7, 1.0, lead + (n,) + ((dk,) if gating == "dimension" else ()))).astype(dtype)
    sdt = np.float32 if dtype == np.float16 else dtype
    S0, Z0 = (rng.standard_normal(lead + (dk, dv)) * 0.3).astype(sdt), rng.uniform(0.5, 1.5, lead + (dk,)).astype(sdt)
    kw = dict(feature_map=fmap, normalize=positive, decay=decay)
    whole, final = linattn.causal_linear_attention(q, k, v, initial_state=linattn.State(S0, Z0), return_state=True,
                                                   gate=gate, **kw)
    S = _layout(S0, "transposed") if state_layout == "transposed" else S0.copy()  # (copies: the steps update them)
    state = linattn.State(S, Z0.copy())
    steps = np.empty(whole.shape, dtype)
    for t in range(n):
        buf = np.full(lead + (dv,), np.nan, dtype) if with_out else None
        o = linattn.step(q[..., t, :], k[..., t, :], v[..., t, :], state, gate=_gate_at(gate, gating, t), out=buf,
                         **kw)
        assert o.dtype == dtype and o.shape == lead + (dv,) and (buf is None or o is buf)
        steps[..., t, :] = o
    want, cond = _reference(q, k, v, None, gate, decay, linattn.State(S0, Z0), feature_map=fmap, normalize=positive,
                            scale=None)
    _close(whole, want, dtype, cond)
    _close(steps, want, dtype, cond)
    _close(state.S, final.S, sdt, 1.0)
    _close(state.Z, final.Z, sdt, 1.0)
