"""Gradients: every option against central finite differences in float64 on small odd shapes, float32
against float64, split/resume of gradients through the state, zero gradients past lengths, bad input."""
import copy
import math

import numpy as np
import pytest

import linattn
from linattn.cpu import noncausal_grad, runtime
from linattn.cpu.elementwise import ELU
from linattn.cpu.map_grad import kernel_map

from conftest import assert_close, rel_err

CAUSAL_OPTIONS = {
    "default": {},
    "no normaliser": dict(normalize=False),
    "relu, scale": dict(feature_map="relu", scale=0.7),
    "identity, eps": dict(feature_map="identity", normalize=False, eps=0.0),
    "lengths": dict(lengths="L"),
    "initial state": dict(initial_state="S"),
    "lengths and state": dict(lengths="L", initial_state="S", eps=1e-3),
}


def _inputs(rng, lead, n, d, dv):
    q, k, v = (rng.standard_normal(lead + (n, x)) * 0.5 for x in (d, d, dv))
    state = linattn.State(rng.random(lead + (d, dv)), rng.random(lead + (d,)) + 0.5)
    return q, k, v, state


def _resolve(kw, state, lead, n):
    kw = dict(kw)
    if isinstance(kw.get("lengths"), str):
        kw["lengths"] = np.linspace(n, 0, lead[0]).astype(int) if lead else n
    if isinstance(kw.get("initial_state"), str):
        kw["initial_state"] = state
    return kw


def _numeric(loss, arrays, h=1e-6):
    """Central differences of loss(*arrays) with respect to each array."""
    grads = []
    for idx, x in enumerate(arrays):
        g = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            plus, minus = list(arrays), list(arrays)
            plus[idx], minus[idx] = x.copy(), x.copy()
            plus[idx][i] += h
            minus[idx][i] -= h
            g[i] = (loss(*plus) - loss(*minus)) / (2 * h)
        grads.append(g)
    return grads


@pytest.mark.parametrize("option", list(CAUSAL_OPTIONS))
@pytest.mark.parametrize("lead, n, d, dv", [((2,), 13, 3, 2), ((), 1, 1, 1), ((1, 2), 9, 2, 3)])
def test_causal_against_finite_differences(rng, option, lead, n, d, dv):
    q, k, v, state = _inputs(rng, lead, n, d, dv)
    kw = _resolve(CAUSAL_OPTIONS[option], state, lead, n)
    out, st, vjp = linattn.causal_linear_attention_vjp(q, k, v, return_state=True, **kw)
    assert_close(out, linattn.causal_linear_attention(q, k, v, **kw), np.float64)
    W, WS, WZ = rng.standard_normal(out.shape), rng.standard_normal(st.S.shape), rng.standard_normal(st.Z.shape)
    with_state = "initial_state" in kw

    def loss(q, k, v, S0=state.S, Z0=state.Z):
        extra = dict(kw, initial_state=linattn.State(S0, Z0)) if with_state else kw
        o, s = linattn.causal_linear_attention(q, k, v, return_state=True, **extra)
        return (o * W).sum() + (s.S * WS).sum() + (s.Z * WZ).sum()

    grads = vjp(W, linattn.State(WS, WZ))
    arrays = [q, k, v] + ([state.S, state.Z] if with_state else [])
    want = _numeric(loss, arrays)
    got = list(grads[:3]) + ([grads[3].S, grads[3].Z] if with_state else [])
    assert len(grads) == (4 if with_state else 3)
    for name, g, w in zip(["dq", "dk", "dv", "dS0", "dZ0"], got, want):
        # central differences with h = 1e-6 carry ~1e-10 of rounding (a gradient can be ~1e-7: with one
        # normalised position, out = v up to eps)
        assert np.max(np.abs(g - w)) <= 1e-6 * np.max(np.abs(w)) + 1e-8, (name, rel_err(g, w))
    if "lengths" in kw:  # past its length a sequence's inputs do not matter
        lengths = np.broadcast_to(np.asarray(kw["lengths"]), lead)
        for idx in np.ndindex(lead):
            for g in grads[:3]:
                assert np.all(g[idx][lengths[idx]:] == 0)


@pytest.mark.parametrize("kw", [{}, dict(normalize=False, feature_map="identity"), dict(feature_map="relu", scale=0.5)])
def test_noncausal_against_finite_differences(rng, kw):
    q, k, v, _ = _inputs(rng, (2,), 11, 3, 2)
    out, vjp = linattn.linear_attention_vjp(q, k, v, **kw)
    assert_close(out, linattn.linear_attention(q, k, v, **kw), np.float64)
    W = rng.standard_normal(out.shape)
    want = _numeric(lambda q, k, v: (linattn.linear_attention(q, k, v, **kw) * W).sum(), [q, k, v])
    for g, w in zip(vjp(W), want):
        assert np.max(np.abs(g - w)) <= 1e-6 * np.max(np.abs(w)) + 1e-8


def test_noncausal_vjp_keeps_its_forwards_state(rng):
    """The backward reads [S | Z] as the forward made it (its state: not summed from k and v again), from a
    copy of its own: the state returned and the initial state given, changed in place before ``vjp`` is
    called (``step`` updates a state in place), change no gradient."""
    q, k, v, _ = _inputs(rng, (2,), 70, 3, 2)
    S0, Z0 = rng.random((2, 3, 2)), rng.random((2, 3)) + 0.5
    W, dS, dZ = rng.standard_normal((2, 70, 2)), rng.standard_normal((2, 3, 2)), rng.standard_normal((2, 3))
    kw = dict(initial_state=linattn.State(S0.copy(), Z0.copy()), return_state=True)
    _, _, vjp = linattn.linear_attention_vjp(q, k, v, **kw)
    want = vjp(W, (dS, dZ))
    init = linattn.State(S0.copy(), Z0.copy())
    _, state, vjp = linattn.linear_attention_vjp(q, k, v, **dict(kw, initial_state=init))
    for x in (state.S, state.Z, init.S, init.Z):
        x[...] = 1e3
    got = vjp(W, (dS, dZ))
    for a, b in zip(_flat(got), _flat(want)):
        np.testing.assert_array_equal(a, b)
    # (and with an initial state, now part of the forward's state, against central differences)
    want = _numeric(lambda q, k, v: (linattn.linear_attention(q, k, v, initial_state=linattn.State(S0, Z0)) * W).sum(),
                    [q, k, v])
    for g, w in zip(linattn.linear_attention_vjp(q, k, v, initial_state=linattn.State(S0, Z0))[1](W), want):
        assert np.max(np.abs(g - w)) <= 1e-6 * np.max(np.abs(w)) + 1e-8


GATED = {
    "gate": lambda rng, lead, n: dict(gate=-rng.random(lead + (n,))),
    "decay per sequence": lambda rng, lead, n: dict(decay=np.linspace(0.7, 0.95, lead[-1])),
    "gate, decay, lengths, state": lambda rng, lead, n: dict(gate=-rng.random(lead + (n,)), decay=0.9,
                                                             lengths=np.array([n, n // 2]), initial_state="S"),
    "reset": lambda rng, lead, n: dict(gate=np.where(np.arange(n) == n // 3, -np.inf, -0.1 * np.ones(lead + (n,))),
                                       normalize=False),
    "gate per key dimension": lambda rng, lead, n: dict(gate=-rng.random(lead + (n, 3))),
    "per-dimension gate, decay, lengths, state, relu, scale": lambda rng, lead, n: dict(
        gate=-rng.random(lead + (n, 3)), decay=np.array([0.8, 0.95]), lengths=np.array([n, n // 2]),
        initial_state="S", feature_map="relu", scale=0.6),
    "per-dimension reset": lambda rng, lead, n: dict(
        gate=np.where((np.arange(n)[:, None] == n // 3) & (np.arange(3) == 1), -np.inf, -0.2 * np.ones(lead + (n, 3))),
        normalize=False),
}


@pytest.mark.parametrize("option", list(GATED))
def test_gates_and_decay_against_finite_differences(rng, option):
    """The inputs' gradients with decay and a gate per position, and the gradients of the gate and decay
    values themselves (the last results of vjp, in that order)."""
    lead, n, d, dv = (2,), 11, 3, 2
    q, k, v, state = _inputs(rng, lead, n, d, dv)
    kw = _resolve(GATED[option](rng, lead, n), state, lead, n)
    out, st, vjp = linattn.causal_linear_attention_vjp(q, k, v, return_state=True, **kw)
    assert_close(out, linattn.causal_linear_attention(q, k, v, **kw), np.float64)
    W, WS, WZ = rng.standard_normal(out.shape), rng.standard_normal(st.S.shape), rng.standard_normal(st.Z.shape)
    names = ["q", "k", "v"] + (["S0"] if "initial_state" in kw else []) + [x for x in ("gate", "decay") if x in kw]

    def loss(**changed):
        args, extra = dict(q=q, k=k, v=v), dict(kw)
        for key, value in changed.items():
            if key in args:
                args[key] = value
            elif key == "S0":
                extra["initial_state"] = linattn.State(value, state.Z)
            else:
                extra[key] = value
        o, s = linattn.causal_linear_attention(args["q"], args["k"], args["v"], return_state=True, **extra)
        return (o * W).sum() + (s.S * WS).sum() + (s.Z * WZ).sum()

    grads = vjp(W, linattn.State(WS, WZ))
    assert len(grads) == len(names)
    for key, got in zip(names, grads):
        x = dict(q=q, k=k, v=v, S0=state.S).get(key)
        x = np.asarray(kw[key], np.float64) if x is None else x
        got = got.S if key == "S0" else np.broadcast_to(got, x.shape)
        assert got.shape == x.shape
        finite = np.isfinite(x)  # a -inf gate has no neighbourhood to differentiate in
        h = 1e-6
        want = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            if not finite[i]:
                continue
            plus, minus = x.copy(), x.copy()
            plus[i] += h
            minus[i] -= h
            if key == "gate" and plus[i] > 0:  # one-sided at a gate of 0
                want[i] = (loss(**{key: x}) - loss(**{key: minus})) / h
            else:
                want[i] = (loss(**{key: plus}) - loss(**{key: minus})) / (2 * h)
        got = np.where(finite, got, 0)
        assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want)) + 1e-8, (key, rel_err(got, want))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("option", ["decay", "decay per head", "gate, decay, lengths, state",
                                    "per-dimension gate, decay, lengths, state, relu, scale", "reset"])
def test_gate_gradients_without_a_final_state_gradient(rng, dtype, option):
    """With no final state's gradient (return_state=False; the forward then keeps no final state), the
    gates' and the decay's gradients are those of a zero one, bit for bit, on the short path (C arrays, a
    map by name) and the checked one (the map as an object); the decay's gradient has the decay's shape."""
    lead, n, d, dv = (2,), 37, 3, 2
    q, k, v, state = _inputs(rng, lead, n, d, dv)
    opts = dict(GATED, decay=lambda rng, lead, n: dict(decay=0.9),
                **{"decay per head": lambda rng, lead, n: dict(decay=np.array([0.5, 0.99]))})
    kw = _resolve(opts[option](rng, lead, n), state, lead, n)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    kw = {key: (x.astype(dtype) if key == "gate" else x) for key, x in kw.items()}
    if "initial_state" in kw:
        kw["initial_state"] = linattn.State(*(x.astype(dtype) for x in kw["initial_state"]))
    W = rng.standard_normal(lead + (n, dv)).astype(dtype)
    fm = kw.pop("feature_map", "elu")
    for fmap in (fm, linattn.feature_maps.as_map(fm)):
        _, vjp = linattn.causal_linear_attention_vjp(q, k, v, feature_map=fmap, **kw)
        _, st, vjp_s = linattn.causal_linear_attention_vjp(q, k, v, feature_map=fmap, return_state=True, **kw)
        got, want = vjp(W), vjp_s(W, linattn.State(np.zeros_like(st.S), np.zeros_like(st.Z)))
        assert len(got) == len(want) == 3 + ("initial_state" in kw) + ("gate" in kw) + ("decay" in kw)
        for a, b in zip(got, want):
            for x, y in zip(*((z.S, z.Z) if isinstance(z, linattn.State) else (z,) for z in (a, b))):
                np.testing.assert_array_equal(x, y)
        if "decay" in kw:
            assert got[-1].shape == np.shape(kw["decay"]) and got[-1].dtype == np.float64
            assert np.all(got[-1] != 0)


def test_map_gradients_ignore_padding_past_lengths(rng):
    """NaN in q, k, v past a sequence's length changes no gradient, the maps' parameters' included (they
    were NaN for Hedgehog and Performer: phi of the padding entered their sums)."""
    fm = linattn.feature_maps
    q, k, v, _ = _inputs(rng, (2,), 20, 4, 3)
    lengths = np.array([20, 12])
    padded = [x.copy() for x in (q, k, v)]
    for x in padded:
        x[1, 12:] = np.nan
    W = rng.standard_normal((2, 20, 3))
    W[1, 12:] = 0
    for fmap in _maps(rng, 4):
        clean = linattn.causal_linear_attention_vjp(q, k, v, feature_map=fmap, lengths=lengths)[1](W)
        got = linattn.causal_linear_attention_vjp(*padded, feature_map=fmap, lengths=lengths)[1](W)
        for a, b in zip(got[:3], clean[:3]):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=repr(fmap))
        for name in getattr(fmap, "param_names", ()):
            np.testing.assert_allclose(got[3][name], clean[3][name], rtol=1e-12, atol=1e-14, err_msg=repr(fmap))


@pytest.mark.parametrize("per_dim", [False, True])
def test_gate_padding_past_lengths_is_not_read(rng, per_dim):
    """Gate values past a sequence's length are padding: the forward does not read them, nor does the
    vjp (it raised for a positive or NaN value there); a bad value before the length still raises."""
    q, k, v, _ = _inputs(rng, (2,), 13, 3, 2)
    lengths = np.array([13, 6])
    gate = -rng.random((2, 13) + ((3,) if per_dim else ()))
    padded = gate.copy()
    padded[1, 8], padded[1, 11] = 2.0, np.nan
    W = rng.standard_normal((2, 13, 2))
    clean = linattn.causal_linear_attention_vjp(q, k, v, gate=gate, lengths=lengths)
    got = linattn.causal_linear_attention_vjp(q, k, v, gate=padded, lengths=lengths)
    np.testing.assert_array_equal(got[0], clean[0])
    for a, b in zip(got[1](W), clean[1](W)):
        np.testing.assert_array_equal(a, b)
    padded[1, 4] = 2.0
    with pytest.raises(ValueError, match="gate: expected log gates <= 0.*sequence \\(1,\\), position 4"):
        linattn.causal_linear_attention_vjp(q, k, v, gate=padded, lengths=lengths)


@pytest.mark.parametrize("dv", [1, 3, 4, 7])
@pytest.mark.parametrize("gated", [False, True])
def test_float32_follows_float64_for_every_dv(rng, dv, gated):
    """Every Dv (the denominators' adjoints are the column past the values: a view of stride Dv + 1,
    where NumPy 2.4's in-place negative of float32 went wrong at 4), non-causal and, with a gate per key
    dimension, causal (both compute those adjoints in NumPy)."""
    q, k, v, _ = _inputs(rng, (2,), 37, 4, dv)
    W = rng.standard_normal((2, 37, dv))
    kw = dict(gate=-rng.random((2, 37, 4))) if gated else {}
    fn = linattn.causal_linear_attention_vjp if gated else linattn.linear_attention_vjp
    grads = [fn(*(x.astype(dt) for x in (q, k, v)), **{key: x.astype(dt) for key, x in kw.items()})[1](W.astype(dt))
             for dt in (np.float64, np.float32)]
    for g64, g32 in zip(*grads):
        assert g32.dtype == np.float32
        assert np.abs(g32 - g64).max() <= 1e-4 * np.abs(g64).max()


def _noncausal_reference_grads(q, k, v, g, fm, scale, eps, normalize):
    """The non-causal gradients written out in float64 NumPy (elu + 1 or relu)."""
    q, k, v, g = (x.astype(np.float64) for x in (q, k, v, g))
    phi = (lambda x: np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))) if fm == "elu" else (lambda x: np.maximum(x, 0))
    dphi = (lambda x: np.where(x > 0, 1.0, np.exp(np.minimum(x, 0)))) if fm == "elu" else (lambda x: 1.0 * (x > 0))
    qf, kf = phi(q), phi(k)
    S, Z = np.swapaxes(kf, -1, -2) @ v, kf.sum(-2)
    num = scale * qf @ S
    if normalize:
        den = scale * (qf @ Z[..., None])[..., 0] + eps
        out = num / den[..., None]
        a, b = g / den[..., None], -(g * out).sum(-1) / den
    else:
        a, b = g, np.zeros(g.shape[:-1])
    dqf = scale * (a @ np.swapaxes(S, -1, -2) + b[..., None] * Z[..., None, :])
    G, H = scale * np.swapaxes(qf, -1, -2) @ a, scale * (qf * b[..., None]).sum(-2)
    dkf = v @ np.swapaxes(G, -1, -2) + H[..., None, :]
    return dqf * dphi(q), dkf * dphi(k), kf @ G


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", [{}, dict(feature_map="relu", scale=0.3, normalize=False),
                                dict(scale=0.125, eps=1e-3)])
def test_noncausal_vjp_on_real_sizes(rng, dtype, kw):
    """Non-causal gradients at N = 1000 (D != Dv, and N = 1, 63, 65), of heads read as views of a fused
    projection and a strided dout, against the formulas in float64."""
    for n, d, dv in ((1000, 16, 24), (1, 1, 1), (63, 5, 3), (65, 8, 8)):
        qkv = (rng.standard_normal((2, n, 3, 2, max(d, dv))) * 0.5).astype(dtype)
        q, k, v = (qkv[:, :, i, :, :w].transpose(0, 2, 1, 3) for i, w in ((0, d), (1, d), (2, dv)))
        g = rng.standard_normal((2, 2, n, 2 * dv)).astype(dtype)[..., ::2]  # (a strided dout too)
        out, vjp = linattn.linear_attention_vjp(q, k, v, **kw)
        assert_close(out, linattn.linear_attention(q, k, v, **kw), dtype)
        full = dict(dict(feature_map="elu", scale=1.0, eps=1e-6, normalize=True), **kw)
        want = _noncausal_reference_grads(q, k, v, g, full["feature_map"], full["scale"], full["eps"],
                                          full["normalize"])
        for got, w in zip(vjp(g), want):
            assert got.dtype == dtype and got.shape == w.shape
            tol = 2e-5 if dtype == np.float32 else 1e-11
            assert np.abs(got - w).max() <= tol * np.abs(w).max() + tol


@pytest.mark.parametrize("kw", [{}, dict(feature_map="relu", scale=0.5, normalize=False)])
def test_noncausal_vjp_of_one_long_head(rng, kw):
    """One head long enough to be cut into segments (each sums the whole head, then writes its rows),
    the last one shorter than a chunk."""
    n, d, dv = 4001, 16, 24
    q, k, v = ((rng.standard_normal((n, w)) * 0.5).astype(np.float32) for w in (d, d, dv))
    g = rng.standard_normal((n, dv)).astype(np.float32)
    if runtime.num_threads() > 1:
        assert len(runtime.plan(1, n, d, dv, causal=False)[1]) > 2  # (more than one segment)
    out, vjp = linattn.linear_attention_vjp(q, k, v, **kw)
    full = dict(dict(feature_map="elu", scale=1.0, eps=1e-6, normalize=True), **kw)
    want = _noncausal_reference_grads(q, k, v, g, full["feature_map"], full["scale"], full["eps"], full["normalize"])
    for got, w in zip(vjp(g), want):
        assert got.dtype == np.float32 and got.shape == w.shape
        assert np.abs(got - w).max() <= 2e-5 * np.abs(w).max()


@pytest.mark.parametrize("frac", [[0, 1], [0, 0.5, 1], [0, 0.2, 0.21, 0.9, 1], [0, 0, 0, 1], [0, 1, 1, 1]])
def test_noncausal_backward_kernel_segments(rng, frac):
    """Every kind of split of the heads into segments (empty ones too), on two threads: the segments'
    parts of G's sum, then the rows (from the forward's state)."""
    n, d, dv = 300, 6, 5
    q, k, v, g = ((rng.standard_normal((1, 3, n, w)) * 0.5).astype(np.float32) for w in (d, d, dv, dv))
    out, state = linattn.linear_attention(q, k, v, return_state=True)
    known = np.concatenate([state.S, state.Z[..., None]], -1).reshape(3, d, dv + 1)
    dq, dk, dv_ = np.full_like(q, np.nan), np.full_like(k, np.nan), np.full_like(v, np.nan)
    noncausal_grad.backward(min(2, runtime.num_threads()), q, k, v, g, out, kernel_map(ELU, None, q.dtype),
                            np.float32(1), np.float32(1e-6), True, np.full(3, n), np.full(3, n), runtime.chunk_size(n),
                            np.asarray(frac, np.float64), known, dq, dk, dv_)
    want = _noncausal_reference_grads(q, k, v, g, "elu", 1.0, 1e-6, True)
    for got, w in zip((dq, dk, dv_), want):
        assert np.abs(got - w).max() <= 2e-5 * np.abs(w).max()


def test_float32_follows_float64(rng):
    q, k, v, state = _inputs(rng, (2, 3), 300, 16, 8)
    W = rng.standard_normal((2, 3, 300, 8))
    _, vjp64 = linattn.causal_linear_attention_vjp(q, k, v)
    _, vjp32 = linattn.causal_linear_attention_vjp(*(x.astype(np.float32) for x in (q, k, v)))
    for g32, g64 in zip(vjp32(W.astype(np.float32)), vjp64(W)):
        assert g32.dtype == np.float32
        assert rel_err(g32, g64) < 2e-5


def test_split_resume_of_gradients(rng):
    """Gradients of one call equal those of two calls chained through the state (backpropagated
    piece by piece, last piece first)."""
    q, k, v, _ = _inputs(rng, (2,), 100, 4, 3)
    W = rng.standard_normal((2, 100, 3))
    _, vjp = linattn.causal_linear_attention_vjp(q, k, v)
    whole = vjp(W)
    a = slice(None, 37)
    b = slice(37, None)
    _, st, vjp_a = linattn.causal_linear_attention_vjp(q[:, a], k[:, a], v[:, a], return_state=True)
    _, vjp_b = linattn.causal_linear_attention_vjp(q[:, b], k[:, b], v[:, b], initial_state=st)
    dq_b, dk_b, dv_b, dstate = vjp_b(W[:, b])
    dq_a, dk_a, dv_a = vjp_a(W[:, a], dstate)
    for g, parts in zip(whole, ((dq_a, dq_b), (dk_a, dk_b), (dv_a, dv_b))):
        assert_close(np.concatenate(parts, 1), g, np.float64)


def test_bad_input(rng):
    q, k, v, _ = _inputs(rng, (2,), 10, 3, 2)
    out, vjp = linattn.causal_linear_attention_vjp(q, k, v)
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, 10, 2\)"):
        vjp(np.zeros((2, 10, 3)))
    with pytest.raises(TypeError, match="dstate: the forward returned no state"):
        vjp(np.zeros_like(out), linattn.State(np.zeros((2, 3, 2)), np.zeros((2, 3))))
    _, _, vjp_s = linattn.causal_linear_attention_vjp(q, k, v, return_state=True)
    with pytest.raises(ValueError, match=r"dstate.S: expected shape \(2, 3, 2\)"):
        vjp_s(np.zeros_like(out), linattn.State(np.zeros((2, 3, 3)), np.zeros((2, 3))))
    per_dim = np.full((2, 10, 3), -0.1)  # a gate per key dimension: its vjp checks the same
    _, vjp_g = linattn.causal_linear_attention_vjp(q, k, v, gate=per_dim)
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, 10, 2\)"):
        vjp_g(np.zeros((2, 10, 3)))
    with pytest.raises(TypeError, match="dstate: the forward returned no state"):
        vjp_g(np.zeros_like(out), linattn.State(np.zeros((2, 3, 2)), np.zeros((2, 3))))
    _, _, vjp_gs = linattn.causal_linear_attention_vjp(q, k, v, gate=per_dim, return_state=True)
    with pytest.raises(ValueError, match=r"dstate.Z: expected shape \(2, 3\)"):
        vjp_gs(np.zeros_like(out), linattn.State(np.zeros((2, 3, 2)), np.zeros((2, 4))))
    with pytest.raises(ValueError, match="gate: expected log gates <= 0"):
        linattn.causal_linear_attention_vjp(q, k, v, gate=np.full((2, 10, 3), 0.1))
    with pytest.raises(TypeError, match="feature_map: a callable is differentiated only with its own derivative"):
        linattn.causal_linear_attention_vjp(q, k, v, feature_map=np.tanh)
    with pytest.raises(TypeError, match="feature_map: a callable is differentiated only"):
        linattn.linear_attention_vjp(q, k, v, feature_map=lambda x: x * x)

    class Bad:
        def __call__(self, x):
            return np.tanh(x)

        def vjp(self, x, dphi):
            return dphi[..., :1]

    _, vjp_bad = linattn.causal_linear_attention_vjp(q, k, v, feature_map=Bad())
    with pytest.raises(ValueError, match=r"feature_map: its vjp returned shape \(2, 10, 1\), expected"):
        vjp_bad(np.zeros_like(out))
    with pytest.raises(ValueError, match="gate: expected log gates <= 0"):
        linattn.causal_linear_attention_vjp(q, k, v, gate=np.full((2, 10), 0.1))
    with pytest.raises(ValueError, match="k: expected sequence length"):
        linattn.causal_linear_attention_vjp(q, k[:, :5], v)


def _directional(loss, x, delta, h):
    """(loss(x + h delta) - loss(x - h delta)) / 2h: the derivative along delta."""
    return (loss(x + h * delta) - loss(x - h * delta)) / (2 * h)


KERNEL_CASES = {  # (lead, n, d, dv, options): multi-chunk sizes through the backward kernel's every path
    "N1000, folds": ((2,), 1000, 5, 3, {}),
    "N63 D1": ((3,), 63, 1, 4, dict(scale=0.8, normalize=False)),  # (normalised, D = 1 makes dq cancel out)
    "N65 Dv1": ((1, 2), 65, 4, 1, {}),
    "N1": ((2,), 1, 3, 2, {}),
    "lengths, state": ((3,), 530, 4, 6, dict(lengths=np.array([530, 97, 0]), initial_state="S")),
    "gates, resets, decay": ((2,), 700, 3, 5, dict(gate="G", decay=np.array([0.97, 0.999]), initial_state="S")),
    "gate, lengths": ((2,), 200, 6, 2, dict(gate="G", lengths=np.array([33, 200]), feature_map="identity",
                                            normalize=False)),
    "per-dimension gates, resets, decay, lengths": ((2,), 300, 4, 3, dict(
        gate="GV", decay=np.array([0.99, 0.97]), initial_state="S", lengths=np.array([300, 151]))),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_along_random_directions(rng, case):
    """Every gradient against the derivative of the forward along random directions (float64), on
    sizes of many chunks (N = 1000 folds the state into float64 every 16 chunks), D != Dv, D = 1,
    and with a final-state gradient; then the same in float32 against float64."""
    lead, n, d, dv, kw = KERNEL_CASES[case]
    q, k, v, state = _inputs(rng, lead, n, d, dv)
    kw = dict(kw)
    if kw.get("initial_state") == "S":
        kw["initial_state"] = state
    if kw.get("gate") == "G":
        gate = -0.01 - rng.random(lead + (n,)) * 0.3
        gate[..., n // 3] = -np.inf  # a reset
        gate[..., n // 2] = -1e4
        kw["gate"] = gate
    elif kw.get("gate") == "GV":  # a gate per key dimension: resets in some dimensions only
        gate = -0.01 - rng.random(lead + (n, d)) * 0.3
        gate[..., n // 3, 1] = -np.inf
        gate[..., n // 2, 2:] = -1e4
        kw["gate"] = gate
    out, st, vjp = linattn.causal_linear_attention_vjp(q, k, v, return_state=True, **kw)
    W, WS, WZ = rng.standard_normal(out.shape), rng.standard_normal(st.S.shape), rng.standard_normal(st.Z.shape)
    grads = vjp(W, linattn.State(WS, WZ))
    inputs = dict(q=q, k=k, v=v)
    if "initial_state" in kw:
        inputs["S0"] = state.S
    inputs.update((key, kw[key]) for key in ("gate", "decay") if key in kw)
    assert len(grads) == len(inputs)
    for name, grad in zip(inputs, grads):
        x = inputs[name]

        def loss(value, name=name):
            args, extra = dict(q=q, k=k, v=v), dict(kw)
            if name == "S0":
                extra["initial_state"] = linattn.State(value, state.Z)
            elif name in args:
                args[name] = value
            else:
                extra[name] = value
            o, s = linattn.causal_linear_attention(args["q"], args["k"], args["v"], return_state=True, **extra)
            return (o * W).sum() + (s.S * WS).sum() + (s.Z * WZ).sum()

        grad = grad.S if name == "S0" else grad
        for _ in range(2):
            delta = np.where(np.isfinite(x), rng.standard_normal(x.shape), 0)
            want = _directional(loss, x, delta, 1e-5)
            assert abs((grad * delta).sum() - want) <= 1e-7 * (np.abs(grad * delta).sum() + 1e-3), (name, want)
    if "lengths" in kw:  # past its length a sequence's inputs do not matter
        valid = np.arange(n) < np.asarray(kw["lengths"])[..., None]
        for grad in grads[:3]:
            assert np.all(grad[~valid] == 0)
    kw32 = dict(kw)
    if "initial_state" in kw:
        kw32["initial_state"] = linattn.State(*(x.astype(np.float32) for x in state))
    _, _, vjp32 = linattn.causal_linear_attention_vjp(*(x.astype(np.float32) for x in (q, k, v)), return_state=True,
                                                      **kw32)
    grads32 = vjp32(W.astype(np.float32), linattn.State(WS.astype(np.float32), WZ.astype(np.float32)))
    for g32, g64 in zip(grads32, grads):
        g32, g64 = (g.S if isinstance(g, linattn.State) else g for g in (g32, g64))
        assert g32.dtype == (np.float64 if g64 is grads[-1] and "decay" in kw else np.float32)
        # relative to the gradients' own scale, or dv's where dq and dk cancel out to nearly nothing
        # (normalised with N = 1: out = v whatever q and k)
        scale = max(np.abs(g64).max(initial=0), np.abs(grads[2]).max(initial=0))
        assert np.abs(g32 - g64).max(initial=0) <= 1e-4 * scale


def test_views_and_layouts(rng):
    """Heads of a fused QKV projection, time-reversed views, a strided dout: the same gradients as from
    contiguous copies."""
    b, n, h, d = 2, 150, 3, 4
    qkv = rng.standard_normal((b, n, 3, h, d)).astype(np.float32)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    k = k[:, :, ::-1]
    dout = rng.standard_normal((b, h, n, 2 * d)).astype(np.float32)[..., ::2]
    _, vjp = linattn.causal_linear_attention_vjp(q, k, v)
    _, vjp_c = linattn.causal_linear_attention_vjp(*(np.ascontiguousarray(x) for x in (q, k, v)))
    for got, want in zip(vjp(dout), vjp_c(np.ascontiguousarray(dout))):
        np.testing.assert_array_equal(got, want)


def _short_and_checked(monkeypatch, vjp_fn, q, k, v, kw):
    """vjp_fn's results on its short path (which checks nothing more: check_qkv, patched out, is not
    reached) and on its checked path (the short one patched out)."""
    from linattn import checks, gradients
    with monkeypatch.context() as m:
        m.setattr(checks, "check_qkv", None)
        first = vjp_fn(q, k, v, **kw)
    with monkeypatch.context() as m:
        m.setattr(gradients, "_fast", lambda *a, **kw: None)
        first_c = vjp_fn(q, k, v, **kw)
    return first, first_c


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fast_and_checked_paths_agree(rng, monkeypatch, dtype):
    """The common call (C-contiguous arrays, a built-in map by name or as an object; a scale, lengths, a
    decay, gates, an initial state) takes a short path that skips the checks; the same call with that
    path patched out takes the checked one: the same kernels, the same bits, for a C-contiguous dout
    (prepared once per vjp) and a strided one (laid out per call); maps the backward kernel does not
    differentiate (phi and its vjp in NumPy) too."""
    fm = linattn.feature_maps
    cases = [((), 1, 1, 1, {}), ((3,), 65, 7, 5, {}), ((2, 2), 200, 4, 6, dict(feature_map="relu")),
             ((2,), 30, 4, 3, dict(feature_map=fm.as_map("elu"), scale=0.5)),
             ((2,), 30, 4, 3, dict(feature_map="squared_relu", decay=0.9, lengths=np.array([30, 11]))),
             ((2, 2), 33, 3, 4, dict(feature_map=fm.Taylor(), gate="position", initial_state=True)),
             ((2,), 20, 4, 2, dict(feature_map=fm.DPFP(), gate="dimension")),
             ((2,), 63, 5, 3, dict(feature_map="identity", normalize=False, eps=0.0)),
             ((2, 3), 100, 3, 4, dict(return_state=True)),
             ((2, 3), 70, 5, 4, dict(scale=0.5, lengths=np.array([70, 33]), decay=np.array([0.5, 0.9, 0.99]))),
             ((3,), 65, 4, 4, dict(gate="position", decay=0.9, return_state=True, initial_state=True)),
             ((2, 2), 40, 3, 5, dict(gate="dimension", lengths=np.array([[40, 1], [0, 39]]), initial_state=True))]
    for lead, n, d, dv, kw in cases:
        q, k, v = (rng.standard_normal(lead + (n, x)).astype(dtype) * 0.5 for x in (d, d, dv))
        dout = rng.standard_normal(lead + (n, 2 * dv)).astype(dtype)[..., ::2]
        dk = fm.as_map(kw.get("feature_map", "elu")).out_dim(d)
        if "gate" in kw:
            kw["gate"] = -rng.random(lead + (n,) + ((dk,) if kw["gate"] == "dimension" else ())).astype(dtype)
        if "initial_state" in kw:
            kw["initial_state"] = linattn.State(rng.random(lead + (dk, dv)).astype(dtype),
                                                rng.random(lead + (dk,)).astype(dtype))
        first, first_c = _short_and_checked(monkeypatch, linattn.causal_linear_attention_vjp, q, k, v, kw)
        assert len(first) == len(first_c) == (3 if kw.get("return_state") else 2)
        vjp, vjp_c = first[-1], first_c[-1]
        assert first[0].dtype == dtype
        np.testing.assert_array_equal(first[0], first_c[0])
        dstate = ()
        if len(first) == 3:  # the final state, and a gradient for it
            for x, y in zip(first[1], first_c[1]):
                assert x.dtype == dtype
                np.testing.assert_array_equal(x, y)
            dstate = (linattn.State(*(rng.standard_normal(x.shape).astype(dtype) for x in first[1])),)
        extra = ("initial_state" in kw) + ("gate" in kw) + ("decay" in kw)  # (dstate0, dgate, ddecay)
        for g in (dout, np.ascontiguousarray(dout)):
            got, want = vjp(g, *dstate), vjp_c(g, *dstate)
            assert len(got) == len(want) == 3 + extra
            for x, y in zip(got, want):
                for a, b in zip(*((z.S, z.Z) if isinstance(z, linattn.State) else (z,) for z in (x, y))):
                    assert a.dtype == b.dtype == (np.float64 if x is got[-1] and "decay" in kw else dtype)
                    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="dout"):  # the vjp of the short path checks its argument
        vjp(np.ones(lead + (n + 1, dv), dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_noncausal_fast_and_checked_paths_agree(rng, monkeypatch, dtype):
    """linear_attention_vjp's common call (a built-in map by name or as an object; a scale, the keys' and
    the queries' lengths, the returned state and its gradient) takes the short path (check_qkv not
    reached); with that path patched out, the checked one: the same bits, maps the kernel does not
    differentiate (phi and its vjp in NumPy, NaN past the lengths) and their parameters' gradients too."""
    fm = linattn.feature_maps
    for lead, n, d, dv, kw in (((2, 3), 70, 5, 4, dict(scale=0.5, lengths=np.array([70, 33]))),
                               ((3,), 65, 4, 4, dict(query_lengths=np.array([1, 0, 65]), return_state=True)),
                               ((2,), 40, 3, 5, dict(feature_map="relu", lengths=np.array([40, 2]),
                                                     query_lengths=np.array([3, 40]), return_state=True)),
                               ((2,), 30, 4, 3, dict(feature_map=fm.as_map("relu"), scale=0.5)),
                               ((2,), 30, 4, 3, dict(feature_map=fm.Taylor(), lengths=np.array([30, 7]),
                                                     query_lengths=np.array([12, 30]))),
                               ((2, 2), 20, 4, 3, dict(feature_map=fm.Hedgehog(rng.standard_normal((4, 3)),
                                                                               rng.standard_normal(3)),
                                                       return_state=True))):
        q, k, v = (rng.standard_normal(lead + (n, x)).astype(dtype) * 0.5 for x in (d, d, dv))
        for name, ls in (("lengths", k), ("query_lengths", q)):  # (padding: never read)
            for h, length in enumerate(kw.get(name, ())):
                ls[h, length:] = np.nan
        dout = rng.standard_normal(lead + (n, dv)).astype(dtype)
        first, first_c = _short_and_checked(monkeypatch, linattn.linear_attention_vjp, q, k, v, kw)
        assert len(first) == len(first_c) == (3 if kw.get("return_state") else 2)
        np.testing.assert_array_equal(first[0], first_c[0])
        dstate = ()
        if len(first) == 3:
            for x, y in zip(first[1], first_c[1]):
                np.testing.assert_array_equal(x, y)
            dstate = (linattn.State(*(rng.standard_normal(x.shape).astype(dtype) for x in first[1])),)
        got, want = first[-1](dout, *dstate), first_c[-1](dout, *dstate)
        params = getattr(kw.get("feature_map"), "param_names", ())
        assert len(got) == len(want) == 3 + bool(params)
        for x, y in zip(got[:3], want[:3]):
            assert x.dtype == dtype and not np.isnan(x).any()
            np.testing.assert_array_equal(x, y)
        for name in params:
            np.testing.assert_array_equal(got[3][name], want[3][name])


def _maps(rng, d):
    fm = linattn.feature_maps
    return ([fm.Elementwise(name) for name in fm.NAMES] + [fm.Elementwise("elu").scaled(0.5),
            fm.Elementwise("gelu").scaled(0.7), fm.Taylor(), fm.Taylor().scaled(d ** -0.25),
            fm.ReBased(rng.random(d) + 0.5, rng.standard_normal(d)), fm.DPFP(2),
            fm.Performer.random(d, 7, seed=1).scaled(0.6),
            fm.Hedgehog(rng.standard_normal((d, 4)), rng.standard_normal(4)),
            fm.T2R(rng.standard_normal((d, 6)), rng.standard_normal(6))])


def _flat(grads):
    """The arrays of a vjp's result, a state's gradient (S, Z) as two."""
    return [x for g in grads for x in (g if isinstance(g, tuple) else (g,))]


class _Outside:
    """A built-in map as a plain callable with its own vjp: the vjps apply it before the kernels and its
    vjp after them (the path the elementwise maps took before the kernels differentiated them)."""

    def __init__(self, fmap):
        self.fmap = fmap

    def __call__(self, x):
        return self.fmap(x)

    def vjp(self, x, dphi):
        return self.fmap.vjp(x, dphi)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_maps_in_the_backward_kernels(rng, dtype, monkeypatch):
    """The backward kernels apply the elementwise maps and their derivatives themselves (mapfns's and
    map_grad's C functions) and the pair maps' with their vjp (pair_grad's C function, in the scratch of
    mapfns.work_size; ReBased's but its norm's, which follows the kernel), the causal one the projection
    maps' features too (written out for their vjps, which follow it): the same bits as the map applied
    before the kernel and its vjp after,
    causal (lengths with NaN padding, gates per position and per key dimension, a decay, an initial state,
    a head long enough to be cut into segments) and non-causal (heads of few positions from their scores,
    longer ones from the sums, right-padded queries and keys, an initial state, heads cut into segments)."""
    from linattn import gradients
    fm = linattn.feature_maps
    maps = [fm.Elementwise(name) for name in ("squared_relu", "gelu", "silu", "sigmoid", "softplus")] + \
        [fm.Elementwise("elu").scaled(0.5), fm.Elementwise("relu").scaled(2.0), fm.Elementwise("identity").scaled(0.3),
         fm.Elementwise("gelu").scaled(0.7)]
    pairs = [fm.Taylor(), fm.Taylor().scaled(0.4), fm.DPFP(2).scaled(1.5),
             fm.ReBased(rng.random(5) + 0.5, rng.standard_normal(5)),
             fm.ReBased(rng.random(5) + 0.5, rng.standard_normal(5)).scaled(0.6)]

    def learned(i, d):  # (the projection maps for inputs of d features)
        return [lambda: fm.Hedgehog(rng.standard_normal((d, 3))),
                lambda: fm.T2R(rng.standard_normal((d, 4)), rng.standard_normal(4)).scaled(0.7),
                lambda: fm.Performer.random(d, 6, seed=1)][i]()

    projections = [learned(i, 5) for i in range(3)]
    for fmap in maps + pairs + projections:
        assert gradients._map_and_code(fmap)[1] == fmap.kernel_code()
    assert gradients._map_and_code(_Outside(maps[0]))[1] is None
    from linattn.cpu import mapfns, pair_grad
    for fmap in pairs:  # (the kernel's dq, dk: D wide; ReBased's the gradients of its u, its norm's vjp after)
        code = fmap.kernel_code()
        assert not gradients._vjp_after(code)
        assert gradients._kernel_map(fmap, code, 5, dtype)[3] != 0
    for d in range(1, 40):  # pair_grad's C function: its scratch within the kernel's map work buffer
        for nu, dk in [(d + 1, fm.Taylor().out_dim(d)), (d, d * (d + 1) // 2)] + \
                [(2 * d, fm.DPFP(n).out_dim(d)) for n in (1, 2, 3, 8)]:
            assert (2 * nu + dk) * mapfns.PAIR_ROWS + max(nu, dk, mapfns.PAIR_ROWS) <= mapfns.work_size.py_func(d, dk)
    assert pair_grad.PAIR_ROWS == mapfns.PAIR_ROWS
    for fmap in projections:  # (the kernel writes phi out: their vjps read it)
        code = fmap.kernel_code()
        assert gradients._vjp_after(code) and gradients._kernel_map(fmap, code, 5, dtype)[3] == 0
    # the non-causal kernel computes phi twice: maps with an exp or erf on many values are computed outside it
    few, many = np.ones((1, 2, 16, 8)), np.ones((1, 8, 2048, 8))
    for fmap in maps:
        code = fmap.kernel_code()
        assert gradients._noncausal_code(code, few, few) == code
        costly = fmap.name in ("gelu", "silu", "sigmoid", "softplus")
        assert gradients._noncausal_code(code, many, many) == (None if costly else code)
    for fmap in pairs + projections:  # (there the projections' phi before the kernel, their vjps after)
        code = fmap.kernel_code()
        assert gradients._noncausal_code(code, many, many) == (None if fmap in projections else code)
    causal_cases = [((2,), 70, 3, 2, dict(lengths=np.array([70, 33]))),
                    ((2, 2), 40, 4, 3, dict(gate="position", decay=0.9, initial_state=True)),
                    ((2,), 50, 5, 1, dict(gate="dimension", lengths=np.array([17, 50]))),
                    ((1,), 3000, 2, 2, dict(scale=0.5)), ((1,), 1, 1, 1, {})]
    for i, (lead, n, d, dv, case) in enumerate(causal_cases):
        q, k, v, _ = _inputs(rng, lead, n, d, dv)
        if "lengths" in case:
            for x in (q, k, v):
                x[-1 if case["lengths"][-1] < n else 0, case["lengths"].min():] = np.nan
        args = [x.astype(dtype) for x in (q, k, v)]
        W = rng.standard_normal(lead + (n, dv)).astype(dtype)
        chosen = [maps[i % len(maps)], pairs[i % len(pairs)], learned(i % 3, d)] if n > 1000 else \
            maps + pairs + [learned(j, d) for j in range(3)]  # (long: three)
        for fmap in chosen:
            if isinstance(fmap, fm.ReBased) and fmap.gamma.shape[0] != d:
                fmap = fm.ReBased(rng.random(d) + 0.5, rng.standard_normal(d)).scaled(fmap.input_scale)
            kw, dk = dict(case), fmap.out_dim(d)  # (the state and a gate per key dimension: D' wide)
            if kw.pop("initial_state", False):
                kw["initial_state"] = linattn.State(rng.random(lead + (dk, dv)).astype(dtype),
                                                    (rng.random(lead + (dk,)) + 0.5).astype(dtype))
            if "gate" in kw:
                kw["gate"] = -rng.random(lead + (n,) + ((dk,) if kw["gate"] == "dimension" else ()))
            got = linattn.causal_linear_attention_vjp(*args, feature_map=fmap, **kw)
            want = linattn.causal_linear_attention_vjp(*args, feature_map=_Outside(fmap), **kw)
            np.testing.assert_array_equal(got[0], want[0])
            for a, b in zip(*(_flat(vjp(W)) for vjp in (got[1], want[1]))):
                np.testing.assert_array_equal(a, b, err_msg=f"{fmap!r} {kw}")
            if fmap.param_names:  # (their parameters' gradients: against the vjp after a kernel given phi)
                with monkeypatch.context() as patch:
                    patch.setattr(gradients, "_map_and_code", lambda f: (f, None))
                    outside = linattn.causal_linear_attention_vjp(*args, feature_map=fmap, **kw)[1](W)[-1]
                inside = got[1](W)[-1]
                assert sorted(inside) == sorted(outside) == sorted(fmap.param_names)
                for name in inside:
                    np.testing.assert_array_equal(inside[name], outside[name], err_msg=f"{fmap!r} {kw} {name}")
    padded = dict(lengths=np.array([150, 40]), query_lengths=np.array([200, 7]))
    noncausal_cases = [((2, 3), 9, 9, 4, 3, {}), ((2,), 200, 150, 3, 2, padded), ((1,), 5, 5, 2, 2, dict(scale=0.5)),
                       ((2,), 70, 60, 3, 2, dict(initial_state=True)), ((1, 2), 3000, 3000, 2, 2, {})]
    for i, (lead, n, nk, d, dv, case) in enumerate(noncausal_cases):
        q = (rng.standard_normal(lead + (n, d)) * 0.5).astype(dtype)
        k, v = ((rng.standard_normal(lead + (nk, x)) * 0.5).astype(dtype) for x in (d, dv))
        W = rng.standard_normal(lead + (n, dv)).astype(dtype)
        for fmap in ([maps[i], pairs[i % len(pairs)]] if n > 1000 else maps + pairs):  # (the pairs: in the kernel)
            if isinstance(fmap, fm.ReBased) and fmap.gamma.shape[0] != d:
                fmap = fm.ReBased(rng.random(d) + 0.5, rng.standard_normal(d)).scaled(fmap.input_scale)
            kw, dk = dict(case), fmap.out_dim(d)
            if kw.pop("initial_state", False):
                kw["initial_state"] = linattn.State(rng.random(lead + (dk, dv)).astype(dtype),
                                                    (rng.random(lead + (dk,)) + 0.5).astype(dtype))
            got = linattn.linear_attention_vjp(q, k, v, feature_map=fmap, **kw)
            want = linattn.linear_attention_vjp(q, k, v, feature_map=_Outside(fmap), **kw)
            np.testing.assert_array_equal(got[0], want[0])
            for a, b in zip(*(_flat(vjp(W)) for vjp in (got[1], want[1]))):
                np.testing.assert_array_equal(a, b, err_msg=f"{fmap!r} {kw}")
            if fmap.param_names:  # (ReBased's gamma and beta: against its vjp after a kernel given phi)
                with monkeypatch.context() as patch:
                    patch.setattr(gradients, "_map_and_code", lambda f: (f, None))
                    outside = linattn.linear_attention_vjp(q, k, v, feature_map=fmap, **kw)[1](W)[-1]
                inside = got[1](W)[-1]
                assert sorted(inside) == sorted(outside) == sorted(fmap.param_names)
                for name in inside:
                    np.testing.assert_array_equal(inside[name], outside[name], err_msg=f"{fmap!r} {kw} {name}")


def test_feature_map_vjps(rng):
    """Each map's vjp against central differences of the map itself (float64), and in float32."""
    d = 5
    x = rng.standard_normal((3, 2, d))
    for fmap in _maps(rng, d):
        dphi = rng.standard_normal((3, 2, fmap.out_dim(d)))
        got = fmap.vjp(x, dphi)
        assert got.shape == x.shape and got.dtype == np.float64
        want = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[i] += 1e-6
            minus[i] -= 1e-6
            want[i] = ((fmap(plus) - fmap(minus)) * dphi).sum() / 2e-6
        assert rel_err(got, want) < 1e-7, fmap
        got32 = fmap.vjp(x.astype(np.float32), dphi.astype(np.float32))
        assert got32.dtype == np.float32 and rel_err(got32, got) < 1e-5, fmap
        # float16 is computed in float32, as the kernels compute it (it was a Numba error)
        x16, dphi16 = x.astype(np.float16), dphi.astype(np.float16)
        got16 = fmap.vjp(x16, dphi16)
        assert got16.dtype == np.float32, fmap
        np.testing.assert_array_equal(got16, fmap.vjp(x16.astype(np.float32), dphi16.astype(np.float32)))
        for name, grad in fmap.param_vjp(x16, dphi16).items():
            want16 = fmap.param_vjp(x16.astype(np.float32), dphi16.astype(np.float32))[name]
            assert grad.dtype == np.float32 and grad.shape == want16.shape, (fmap, name)
            np.testing.assert_array_equal(grad, want16)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rebased_vjp_of_many_rows_on_threads(rng, dtype):
    """ReBased's gradients (x, gamma, beta) on enough rows for its vjp's pass (cpu/norm_grad.rebased_vjp) to
    share them out between threads, each summing gamma's and beta's gradients into a slot of its own, against
    the norm's backward written out in float64 NumPy around the pair map's vjp; and its norm's vjp alone
    (norm_grad.norm_vjp, what follows the backward kernels) from that du."""
    from linattn.cpu import norm_grad, pair_grad
    d, s = 16, 0.7
    gamma, beta = rng.random(d) + 0.5, rng.standard_normal(d)
    fmap = linattn.feature_maps.ReBased(gamma, beta, eps=1e-3).scaled(s)
    x = rng.standard_normal((4, 3001, d))
    dphi = rng.standard_normal((4, 3001, fmap.out_dim(d)))
    if runtime.num_threads() > 1:
        assert runtime.threads_for(4 * 3001 * fmap.out_dim(d), pair_grad.WORK_PER_THREAD) > 1
        assert runtime.threads_for(4 * 3001 * d, norm_grad.WORK_PER_THREAD) > 1
    xs = s * x
    centred = xs - xs.mean(-1, keepdims=True)
    r = 1 / np.sqrt((centred ** 2).mean(-1, keepdims=True) + 1e-3)
    n = centred * r
    du = pair_grad.pairs_vjp(gamma * n + beta, dphi, fmap._family_params(d)[1 + 2 * d:])
    dn = du * gamma
    want_dx = s * r * (dn - dn.mean(-1, keepdims=True) - n * (dn * n).mean(-1, keepdims=True))
    want = {"gamma": (du * n).reshape(-1, d).sum(0), "beta": du.reshape(-1, d).sum(0)}
    dx, grads = fmap._vjps(x.astype(dtype), dphi.astype(dtype))
    assert dx.dtype == dtype and grads["gamma"].dtype == dtype and grads["beta"].dtype == dtype
    tol = 2e-5 if dtype == np.float32 else 1e-12
    assert rel_err(dx, want_dx) < tol
    for name in ("gamma", "beta"):
        assert rel_err(grads[name], want[name]) < tol, name
    np.testing.assert_array_equal(fmap.vjp(x.astype(dtype), dphi.astype(dtype)), dx)
    dx, grads = fmap._vjps_of_u(x.astype(dtype), du.astype(dtype))
    assert dx.dtype == dtype and rel_err(dx, want_dx) < tol
    for name in ("gamma", "beta"):
        assert grads[name].dtype == dtype and rel_err(grads[name], want[name]) < tol, name


def _pairs_vjp_numpy(u, g, table):
    """du for features u[I] u[J] C, written out in float64 NumPy: gathers and one-hot products."""
    i, j, c = table.reshape(3, -1)
    i, j = i.astype(np.intp), j.astype(np.intp)
    u, gc = u.astype(np.float64), g.astype(np.float64) * c
    onehot_i, onehot_j = (np.eye(u.shape[-1])[idx] for idx in (i, j))
    return (gc * u[..., j]) @ onehot_i + (gc * u[..., i]) @ onehot_j


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pair_map_vjp_against_numpy(rng, dtype):
    """cpu/pair_grad's compiled vjp of the pair maps (transposed blocks of 32 rows, threads taking 256)
    against the gathers written out: every table (Taylor, ReBased, DPFP with nu = 3; diagonal pairs
    included), rows around the block sizes, strided and reversed gradients; DPFP's and Taylor's u formed
    from x in the kernel."""
    from linattn.cpu import pair_grad
    pairs_vjp = pair_grad.pairs_vjp
    fm = linattn.feature_maps
    cases = [(fm.Taylor(), 5, 6), (fm.Taylor(), 1, 2), (fm.ReBased(np.ones(4), np.zeros(4)), 4, 4), (fm.DPFP(3), 3, 6)]
    for fmap, d, nu in cases:
        table = fmap._family_params(d)[(1 + 2 * d) if isinstance(fmap, fm.ReBased) else 0:]
        dk = fmap.out_dim(d)
        for rows in (1, 31, 33, 257, 700):
            u = rng.standard_normal((rows, nu)).astype(dtype)
            wide = rng.standard_normal((rows, 2 * dk)).astype(dtype)
            for g in (wide[:, :dk], wide[::-1, ::2]):
                got = pairs_vjp(u, g, table)
                assert got.dtype == dtype and got.shape == u.shape
                want = _pairs_vjp_numpy(u, g, table)
                assert rel_err(got, want) < (1e-6 if dtype == np.float32 else 1e-14), (fmap, rows)
    assert pairs_vjp(np.ones((0, 3), dtype), np.ones((0, 6), dtype), fm.Taylor()._family_params(2)).shape == (0, 3)
    # DPFP's: [relu(x), relu(-x)] formed in the kernel, dx = s (du[:D] [x > 0] - du[D:] [x < 0])
    for d, nu in ((3, 2), (5, 1)):
        table = fm.DPFP(nu)._family_params(d)
        x = rng.standard_normal((70, d)).astype(dtype)
        x[0, 0] = 0.0
        g = rng.standard_normal((70, 2 * d * nu)).astype(dtype)
        du = _pairs_vjp_numpy(np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], -1), g, table)
        want = (du[:, :d] * (x > 0) - du[:, d:] * (x < 0)) * 0.7
        got = pairs_vjp(x, g, table, pair_grad.DPFP, 0.7)
        assert got.dtype == dtype and rel_err(got, want) < (1e-6 if dtype == np.float32 else 1e-14)
    # Taylor's: u = [s x, 1] formed in the kernel, dx = s du[:D]
    for d, rows in ((1, 5), (4, 33), (7, 300)):
        table = fm.Taylor()._family_params(d)
        x = rng.standard_normal((rows, d)).astype(dtype)
        g = rng.standard_normal((rows, fm.Taylor().out_dim(d))).astype(dtype)
        du = _pairs_vjp_numpy(np.concatenate([0.7 * x.astype(np.float64), np.ones((rows, 1))], -1), g, table)
        got = pairs_vjp(x, g, table, pair_grad.TAYLOR, 0.7)
        assert got.dtype == dtype and got.shape == x.shape
        assert rel_err(got, 0.7 * du[:, :d]) < (1e-6 if dtype == np.float32 else 1e-14)
    empty = (np.ones((0, 3), dtype), np.ones((0, 10), dtype), fm.Taylor()._family_params(3), pair_grad.TAYLOR)
    assert pairs_vjp(*empty).shape == (0, 3)
    # inf in a block's first value spreads to its own row only
    fmap, d, nu = cases[0]
    table = fmap._family_params(d)
    u, g = rng.standard_normal((40, nu)).astype(dtype), rng.standard_normal((40, fmap.out_dim(d))).astype(dtype)
    u[32, 0] = np.inf
    got = pairs_vjp(u, g, table)
    assert not np.isfinite(got[32]).all() and np.isfinite(np.delete(got, 32, 0)).all()
    with np.errstate(invalid="ignore"):  # (the reference's own inf * 0)
        want = _pairs_vjp_numpy(u, g, table)
    assert rel_err(np.delete(got, 32, 0), np.delete(want, 32, 0)) < 1e-6


def _projection_grads_numpy(fmap, x, g):
    """(dx, {name: gradient}) of Performer, Hedgehog, T2R written out in float64 NumPy."""
    fm = linattn.feature_maps
    x, g = x.astype(np.float64), g.astype(np.float64)
    s, w, y = fmap.input_scale, fmap.weight, fmap(x.astype(np.float64))
    u = s * x
    if isinstance(fmap, fm.Performer):
        t = g * y
        dw = u.reshape(-1, u.shape[-1]).T @ t.reshape(-1, t.shape[-1])
        return (t @ w.T - u * t.sum(-1, keepdims=True)) * s, {"omega": dw}
    if isinstance(fmap, fm.T2R):
        dz = g * (y > 0)
    else:
        p = y * (g - (y * g).sum(-1, keepdims=True))
        dz = 2 * (p[..., :w.shape[1]] - p[..., w.shape[1]:])
    dz2 = dz.reshape(-1, dz.shape[-1])
    return (dz @ w.T) * s, {"weight": u.reshape(-1, u.shape[-1]).T @ dz2, "bias": dz2.sum(0)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_projection_map_grads_against_numpy(rng, dtype):
    """cpu/projection_grad's compiled gradients of the maps through a matrix (blocks of 64 rows, each
    thread's parameter gradients in a slot of its own) against them written out: rows around the
    block size and enough for two threads, reversed and strided views, a scale, phi given or not."""
    fm = linattn.feature_maps
    d = 6
    maps = [fm.Performer.random(d, 7, seed=1).scaled(0.6),
            fm.Hedgehog(rng.standard_normal((d, 4)), rng.standard_normal(4)),
            fm.T2R(rng.standard_normal((d, 5)), rng.standard_normal(5)).scaled(0.8)]
    tol = 1e-5 if dtype == np.float32 else 1e-13
    for fmap in maps:
        dk = fmap.out_dim(d)
        for rows in (1, 63, 65, 200, 120000):  # (the last: two threads)
            x = rng.standard_normal((rows, 2 * d)).astype(dtype)
            g = rng.standard_normal((rows, dk)).astype(dtype)
            for xv, gv in ((x[:, :d], g), (x[::-1, ::2], g[::-1])):
                want_dx, want = _projection_grads_numpy(fmap, xv, gv)
                for y in (None, fmap(xv)):
                    dx, grads = fmap._vjps(xv, gv, y)
                    assert dx.dtype == dtype and rel_err(dx, want_dx) < tol, (fmap, rows)
                    assert set(grads) == set(fmap.param_names)
                    for name, grad in grads.items():
                        assert grad.dtype == dtype and rel_err(grad, want[name]) < tol, (fmap, rows, name)
        np.testing.assert_array_equal(fmap.vjp(x[:, :d], g), fmap._vjps(x[:, :d], g)[0])
        with pytest.raises(ValueError, match=r"y: expected phi\(x\), of shape"):
            fmap.vjp(x[:, :d], g, g[:, :1])


def _elementwise_derivative(name, u):
    """phi'(u) of the elementwise maps, written out in float64 NumPy (math.erf for gelu's Phi)."""
    sig = 1 / (1 + np.exp(-u))
    cdf = 0.5 * (1 + np.vectorize(math.erf)(u / math.sqrt(2)))
    return {"elu": np.where(u > 0, 1.0, np.exp(np.minimum(u, 0))), "relu": (u > 0) * 1.0,
            "identity": np.ones_like(u), "squared_relu": 2 * np.maximum(u, 0),
            "gelu": cdf + u * np.exp(-0.5 * u * u) / math.sqrt(2 * math.pi), "silu": sig * (1 + u * (1 - sig)),
            "swish": sig * (1 + u * (1 - sig)), "sigmoid": sig * (1 - sig), "softplus": sig}[name]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_elementwise_vjps_against_their_formulas(rng, dtype):
    """The compiled vjps of the elementwise maps (cpu/map_grad.py) against their derivatives written
    out, on wide and edge values, with a scale, on views (strided, reversed rows, D = 1); NaN stays NaN
    (relu's derivative [u > 0] is 0 there, identity's 1)."""
    fm = linattn.feature_maps
    edges = [0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 100.0, -100.0, 700.0, -700.0]
    x = np.concatenate([rng.standard_normal(300) * 4, edges])
    x = np.concatenate([x, np.zeros(6 - len(x) % 6)]).reshape(-1, 6)
    g = rng.standard_normal(x.shape)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for name in fm.NAMES:
        for scale in (1.0, 0.6):
            fmap = fm.Elementwise(name).scaled(scale) if scale != 1.0 else fm.Elementwise(name)
            want = g * _elementwise_derivative(name, scale * x) * scale
            for sl in (np.s_[:], np.s_[:, ::-2], np.s_[:, 2:3]):
                got = fmap.vjp(x[sl].astype(dtype), g[sl].astype(dtype))
                assert got.dtype == dtype and got.shape == x[sl].shape
                np.testing.assert_allclose(got, want[sl], rtol=tol, atol=tol * np.abs(want).max(),
                                           err_msg=f"{name} {scale}")
        nan = fm.Elementwise(name).vjp(np.array([[np.nan, 1.0]], dtype), np.ones((1, 2), dtype))
        assert nan[0, 0] == 0 if name == "relu" else nan[0, 0] == 1 if name == "identity" else np.isnan(nan[0, 0]), name


def test_feature_map_vjp_bad_input(rng):
    fm = linattn.feature_maps
    x = rng.standard_normal((4, 3))
    with pytest.raises(ValueError, match=r"dphi: expected shape \(4, 10\) \(that of phi\(x\)\), got \(4, 3\)"):
        fm.Taylor().vjp(x, np.ones((4, 3)))
    with pytest.raises(ValueError, match=r"x: expected an array \(..., D\) with D >= 1"):
        fm.Elementwise("gelu").vjp(np.float64(1.0), np.ones(1))
    with pytest.raises(TypeError, match="dphi: expected real numbers, got dtype complex128"):
        fm.Elementwise("elu").vjp(x, np.ones((4, 3), complex))
    with pytest.raises(ValueError, match="feature_map: Performer has a weight of shape"):
        fm.Performer.random(5, 4, seed=0).vjp(x, np.ones((4, 4)))
    assert fm.Elementwise("relu").vjp(x, np.ones((4, 3), np.int64)).dtype == np.float64
    # the parameters' gradients: the same checks; none for a map without parameters
    t2r = fm.T2R(rng.standard_normal((3, 5)), rng.standard_normal(5))
    with pytest.raises(ValueError, match=r"dphi: expected shape \(4, 5\) \(that of phi\(x\)\), got \(4, 3\)"):
        t2r.param_vjp(x, np.ones((4, 3)))
    with pytest.raises(TypeError, match="x: expected real numbers, got dtype complex128"):
        fm.ReBased(np.ones(3), np.zeros(3)).param_vjp(x.astype(complex), np.ones((4, 6)))
    with pytest.raises(ValueError, match="feature_map: Hedgehog has a weight of shape"):
        fm.Hedgehog(np.ones((5, 2))).param_vjp(x, np.ones((4, 4)))
    assert fm.Taylor().param_vjp(x, np.ones((4, 10))) == {} and fm.Taylor().param_names == ()


@pytest.mark.parametrize("causal", [True, False])
def test_every_map_through_attention(rng, causal):
    """Gradients with each feature map (the elementwise ones in the backward kernels, the others through
    phi applied before the kernel and their vjp after) along random directions, causal over several chunks with
    lengths, and non-causal; a callable with its own vjp too; the parameters of the maps that have
    them."""
    lead, n, d, dv = (2,), 70 if causal else 9, 3, 2
    q, k, v, _ = _inputs(rng, lead, n, d, dv)

    class Cube:  # a callable with its derivative
        def __call__(self, x):
            return np.asarray(x) ** 3 + 2

        def vjp(self, x, dphi):
            return 3 * np.asarray(x) ** 2 * dphi

    kw = dict(lengths=np.array([n, n // 2])) if causal else {}
    forward = linattn.causal_linear_attention if causal else linattn.linear_attention
    for fmap in _maps(rng, d) + [Cube()]:
        make = linattn.causal_linear_attention_vjp if causal else linattn.linear_attention_vjp
        out, vjp = make(q, k, v, feature_map=fmap, **kw)
        W = rng.standard_normal(out.shape)
        for name, grad in zip("qkv", vjp(W)):
            args = dict(q=q, k=k, v=v)

            def loss(value, name=name):
                return (forward(**{**args, name: value}, feature_map=fmap, **kw) * W).sum()

            delta = rng.standard_normal(args[name].shape)
            want = _directional(loss, args[name], delta, 1e-6)
            assert abs((grad * delta).sum() - want) <= 1e-6 * (np.abs(grad * delta).sum() + 1e-6), (fmap, name)
        names = getattr(fmap, "param_names", ())
        grads = vjp(W)
        assert len(grads) == 3 + bool(names)
        if not names:
            continue
        assert set(grads[3]) == set(names)
        for name in names:  # the map's parameters, through attention (positions past a length: no part)
            attr = "weight" if name == "omega" else name
            value = getattr(fmap, attr)
            grad = grads[3][name]
            assert grad.shape == value.shape

            def loss(p, attr=attr):
                other = copy.copy(fmap)
                other.__dict__ = dict(fmap.__dict__, _params={}, **{attr: p})
                return (forward(q, k, v, feature_map=other, **kw) * W).sum()

            delta = rng.standard_normal(value.shape)
            want = _directional(loss, value, delta, 1e-6)
            assert abs((grad * delta).sum() - want) <= 1e-6 * (np.abs(grad * delta).sum() + 1e-6), (fmap, name)


@pytest.mark.parametrize("two_runs", [False, True])
@pytest.mark.parametrize("per_dimension", [False, True])
@pytest.mark.parametrize("frac", [[0, 0.3, 0.7, 1.0], [0, 0, 1.0], [0, 1.0, 1.0], [0, 0.5, 0.5, 0.9, 1.0]])
def test_segments_of_a_head(rng, monkeypatch, frac, per_dimension, two_runs):
    """The scan cut into segments (as when heads are fewer than threads), empty segments included,
    each after its prefix or in two runs (each segment's own sum first): the gradients of one
    unsegmented pass, with lengths, gates (per position or per key dimension), a state and its gradient."""
    lead, n, d, dv = (3,), 900, 4, 3
    q, k, v, state = _inputs(rng, lead, n, d, dv)
    gate = -rng.random(lead + (n,) + ((d,) if per_dimension else ())) * 0.05
    kw = dict(lengths=np.array([900, 417, 0]), gate=gate, initial_state=state)
    W = rng.standard_normal(lead + (n, dv))
    WS, WZ = rng.standard_normal(state.S.shape), rng.standard_normal(state.Z.shape)

    def grads():
        _, _, vjp = linattn.causal_linear_attention_vjp(q, k, v, return_state=True, **kw)
        return vjp(W, linattn.State(WS, WZ))

    whole = grads()
    real_plan = linattn.gradients.plan
    monkeypatch.setattr(linattn.gradients, "plan",
                        lambda *a, **kw: (real_plan(*a, **kw)[0], np.array(frac, float), 2, two_runs))
    for got, want in zip(grads(), whole):
        got, want = (x.S if isinstance(x, linattn.State) else x for x in (got, want))
        assert_close(got, want, np.float64)


def test_empty_and_float16(rng):
    """No positions, no heads, every length 0: gradients of the right shapes (zeros; the state's
    gradient passes through); float16 inputs give float16 gradients equal to float32's, rounded."""
    S0 = linattn.State(rng.random((2, 3, 2)), rng.random((2, 3)))
    dS = linattn.State(rng.standard_normal((2, 3, 2)), rng.standard_normal((2, 3)))
    for shape, kw in (((2, 0, 3), {}), ((2, 5, 3), dict(lengths=np.array([0, 0]))),
                      ((2, 0, 3), dict(gate=np.zeros((2, 0))))):
        q, k = rng.standard_normal(shape), rng.standard_normal(shape)
        v = rng.standard_normal(shape[:-1] + (2,))
        out, st, vjp = linattn.causal_linear_attention_vjp(q, k, v, initial_state=S0, return_state=True, **kw)
        dq, dk, dv, dS0, *rest = vjp(np.ones_like(out), dS)
        assert dq.shape == q.shape and dv.shape == v.shape and not dq.any() and not dk.any() and not dv.any()
        np.testing.assert_array_equal(dS0.S, dS.S)
        np.testing.assert_array_equal(dS0.Z, dS.Z)
    q = rng.standard_normal((0, 5, 3))
    _, vjp = linattn.causal_linear_attention_vjp(q, q, q)
    assert [g.shape for g in vjp(np.zeros((0, 5, 3)))] == [(0, 5, 3)] * 3
    q, k, v = (rng.standard_normal((2, 40, 4)).astype(np.float16) for _ in range(3))
    W = rng.standard_normal((2, 40, 4))
    for make in (linattn.causal_linear_attention_vjp, linattn.linear_attention_vjp):
        out16, vjp16 = make(q, k, v)
        out32, vjp32 = make(*(x.astype(np.float32) for x in (q, k, v)))
        assert out16.dtype == np.float16
        for g16, g32 in zip(vjp16(W.astype(np.float16)), vjp32(W.astype(np.float16).astype(np.float32))):
            assert g16.dtype == np.float16
            np.testing.assert_array_equal(g16, g32.astype(np.float16))


@pytest.mark.parametrize("gate_kind", ["none", "per position", "per key dimension"])
def test_kept_chunk_states(rng, gate_kind):
    """The vjp's forward keeps [S | Z]^T at the start of every chunk (what the backward kernel's dq
    reads): the final state of the same call on the positions before the chunk, with lengths, gates,
    resets and an initial state; float32 as float64 rounded."""
    from linattn.attention import causal_with_denominators

    lead, n, d, dv = (2,), 150, 3, 2
    q, k, v, state = _inputs(rng, lead, n, d, dv)
    lengths = np.array([150, 70])
    gate = None
    if gate_kind != "none":
        gate = -rng.random(lead + (n,) + ((d,) if gate_kind == "per key dimension" else ())) * 0.2
        gate[:, 40] = -np.inf
    for dt in (np.float64, np.float32):
        args = [x.astype(dt) for x in (q, k, v)]
        st0 = linattn.State(*(x.astype(dt) for x in state))
        (_, _), (den, states, chunk) = causal_with_denominators(*args, initial_state=st0, return_state=True,
                                                                lengths=lengths, gate=gate, keep=True)
        assert states.shape == lead + (-(-n // chunk), dv + 1, d) and states.dtype == dt and den.shape == lead + (n,)
        for b in range(2):
            for ci in range(-(-lengths[b] // chunk)):
                i0 = ci * chunk
                if i0 == 0:
                    S, Z = state.S[b], state.Z[b]
                else:
                    _, S_Z = linattn.causal_linear_attention(
                        q[b, :i0], k[b, :i0], v[b, :i0], initial_state=linattn.State(state.S[b], state.Z[b]),
                        return_state=True, gate=None if gate is None else gate[b, :i0])
                    S, Z = S_Z
                assert_close(states[b, ci, :dv].T, S, dt)
                assert_close(states[b, ci, dv], Z, dt)
