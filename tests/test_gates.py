"""Decay, gates and scale: against the float64 references, through the state and lengths, at the
extremes (-1e4, -inf resets, a million positions), with bad input, and against the published forms
of RetNet and Mamba-2 (SSD)."""
import numpy as np
import pytest

import linattn
from linattn import reference

from conftest import assert_close, make_qkv, rel_err


def _gates(rng, shape, dtype, resets=0.0, low=1.0):
    """Log gates in [-low, 0], -inf with probability ``resets``."""
    g = -rng.random(shape) * low
    if resets:
        g = np.where(rng.random(shape) < resets, -np.inf, g)
    return g.astype(dtype)


OPTIONS = ["decay", "decay per head", "gate", "gate per dim", "decay + gate", "decay + gate per dim", "resets",
           "resets per dim"]


def _options(rng, name, lead, n, d, dtype):
    per_head = np.linspace(0.5, 0.99, lead[-1]) if lead else 0.9
    return {"decay": dict(decay=0.9), "decay per head": dict(decay=per_head),
            "gate": dict(gate=_gates(rng, lead + (n,), dtype)),
            "gate per dim": dict(gate=_gates(rng, lead + (n, d), dtype)),
            "decay + gate": dict(decay=per_head, gate=_gates(rng, lead + (n,), dtype)),
            "decay + gate per dim": dict(decay=0.95, gate=_gates(rng, lead + (n, d), dtype, low=0.3)),
            "resets": dict(gate=_gates(rng, lead + (n,), dtype, resets=0.05)),
            "resets per dim": dict(gate=_gates(rng, lead + (n, d), dtype, resets=0.05))}[name]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("lead, n, d, dv", [((2, 3), 70, 5, 4), ((), 1, 1, 1), ((3,), 65, 16, 8), ((1, 2), 200, 3, 7)])
def test_against_reference(rng, option, lead, n, d, dv, dtype):
    q, k, v = make_qkv(rng, lead, n, d, dv, dtype)
    kw = _options(rng, option, lead, n, d, dtype)
    for normalize in (True, False):
        out = linattn.causal_linear_attention(q, k, v, normalize=normalize, **kw)
        assert out.dtype == dtype and np.isfinite(out).all()
        assert_close(out, reference.masked(q, k, v, normalize=normalize, **kw), dtype)
    out = linattn.causal_linear_attention(q, k, v, scale=0.3, feature_map="relu", **kw)
    assert_close(out, reference.loop(q, k, v, scale=0.3, feature_map="relu", **kw), dtype)


@pytest.mark.parametrize("option", OPTIONS)
def test_split_resume_and_state(rng, option):
    lead, n, d, dv = (2, 3), 150, 6, 5
    q, k, v = make_qkv(rng, lead, n, d, dv, np.float64)
    kw = _options(rng, option, lead, n, d, np.float64)
    full, st = linattn.causal_linear_attention(q, k, v, return_state=True, **kw)
    _, (S_ref, Z_ref) = reference.loop(q, k, v, return_state=True, **kw)
    assert_close(st.S, S_ref, np.float64)
    assert_close(st.Z, Z_ref, np.float64)
    gate = kw.get("gate")
    for cuts in ([1], [31, 32, 33], [64, 100], [149]):
        pieces, state = [], None
        for a, b in zip([0] + cuts, cuts + [n]):
            part = dict(kw, gate=None if gate is None else gate[..., a:b, :] if gate.ndim == 4 else gate[..., a:b])
            o, state = linattn.causal_linear_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :],
                                                       initial_state=state, return_state=True, **part)
            pieces.append(o)
        assert_close(np.concatenate(pieces, axis=-2), full, np.float64)
        assert_close(state.S, S_ref, np.float64)


@pytest.mark.parametrize("per_dim", [False, True])
def test_lengths_stop_the_decay(rng, per_dim):
    lead, n, d, dv = (3, 2), 90, 4, 3
    q, k, v = make_qkv(rng, lead, n, d, dv, np.float64)
    gate = _gates(rng, lead + ((n, d) if per_dim else (n,)), np.float64)
    lengths = np.array([90, 33, 0])
    out, st = linattn.causal_linear_attention(q, k, v, gate=gate, decay=0.97, lengths=lengths, return_state=True)
    for b, length in enumerate(lengths):
        ref, (S, Z) = reference.loop(q[b, :, :length], k[b, :, :length], v[b, :, :length], decay=0.97,
                                     gate=gate[b, :, :length], return_state=True)
        assert_close(out[b, :, :length], ref, np.float64)
        assert np.all(out[b, :, length:] == 0)
        assert_close(st.S[b], S, np.float64)
        assert_close(st.Z[b], Z, np.float64)


def test_zero_gates_equal_no_gates(rng):
    q, k, v = make_qkv(rng, (2, 3), 130, 8, 8, np.float32)
    plain = linattn.causal_linear_attention(q, k, v)
    for kw in (dict(gate=np.zeros((2, 3, 130), np.float32)), dict(gate=np.zeros((2, 3, 130, 8), np.float32)),
               dict(decay=1.0)):
        np.testing.assert_allclose(linattn.causal_linear_attention(q, k, v, **kw), plain, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("per_dim", [False, True])
def test_extreme_gates(rng, per_dim):
    # -1e4 (a factor exp(-1e4) = 0 in any float), -inf resets, and small gates mixed in one chunk
    lead, n, d = (2,), 300, 4
    q, k, v = make_qkv(rng, lead, n, d, 3, np.float32)
    shape = lead + ((n, d) if per_dim else (n,))
    gate = -rng.random(shape) * 0.1
    pick = rng.random(shape)
    gate = np.where(pick < 0.05, -1e4, np.where(pick < 0.08, -np.inf, gate)).astype(np.float32)
    out = linattn.causal_linear_attention(q, k, v, gate=gate)
    assert np.isfinite(out).all()
    assert_close(out, reference.loop(q, k, v, gate=gate), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gates_per_dim_either_side_of_one_product(rng, dtype):
    # a chunk's scores per key dimension are one product where every dimension's factor over the chunk
    # is at least tiny ** (1/4), else blocks of running products: chunks of gates about that strong
    # (-0.68 a position in float32 over 32 positions, -5.5 in float64), some above, some below
    lead, n, d = (2,), 320, 8
    q, k, v = make_qkv(rng, lead, n, d, 5, dtype)
    per_position = -np.log(np.finfo(dtype).tiny) / 4 / 32
    chunks = rng.choice([0.7, 1.3], lead + (n // 32, 1, 1))  # 1.3: past the limit (both paths run)
    strength = per_position * chunks * rng.uniform(0.9, 1.0, lead + (n // 32, 1, d))
    gate = (-2 * rng.random(lead + (n // 32, 32, d)) * strength).reshape(lead + (n, d)).astype(dtype)
    out = linattn.causal_linear_attention(q, k, v, gate=gate)
    assert np.isfinite(out).all()
    assert_close(out, reference.masked(q, k, v, gate=gate), dtype)
    # the gradients (the backward has the same two paths) along a random direction each, against the
    # float64 reference's central difference
    out, vjp = linattn.causal_linear_attention_vjp(q, k, v, gate=gate)
    w = rng.standard_normal(out.shape)
    inputs = dict(q=q, k=k, v=v, gate=gate)
    grads = vjp(w.astype(dtype))
    for (name, x), grad in zip(inputs.items(), grads):
        delta = rng.standard_normal(x.shape)
        h = 1e-6 * np.abs(x).max()

        def loss(eps, name=name, x=x, delta=delta):
            args = dict(inputs, **{name: x.astype(np.float64) + eps * delta})
            return float((w * reference.masked(args["q"], args["k"], args["v"], gate=args["gate"])).sum())

        numeric = (loss(h) - loss(-h)) / (2 * h)
        analytic = float((grad.astype(np.float64) * delta).sum())
        tol = 2e-3 if dtype == np.float32 else 1e-6
        assert abs(analytic - numeric) <= tol * (abs(numeric) + 1e-3 * np.abs(grad).sum()), name


def test_a_million_positions_in_float32(rng):
    n = 10 ** 6
    q, k, v = make_qkv(rng, (), n, 4, 3, np.float32)
    v = v + 0.5
    gate = np.where(rng.random(n) < 1e-4, -1e4, -rng.random(n) * 1e-3)
    gate[rng.integers(0, n, 5)] = -np.inf
    gate = gate.astype(np.float32)
    out32, st32 = linattn.causal_linear_attention(q, k, v, gate=gate, return_state=True)
    out64, st64 = linattn.causal_linear_attention(*(x.astype(np.float64) for x in (q, k, v)), gate=gate,
                                                  return_state=True)
    assert np.isfinite(out32).all()
    row_err = np.linalg.norm(out32 - out64, axis=-1) / np.linalg.norm(out64, axis=-1)
    assert row_err.max() < 2e-4
    assert rel_err(st32.S, st64.S) < 2e-5


def test_bad_decay_gate_and_scale(rng):
    q, k, v = make_qkv(rng, (2, 3), 10, 4, 4)
    f = linattn.causal_linear_attention
    for bad in (0.0, 1.5, -0.1, np.nan, [0.9, 0.9, 2.0]):
        with pytest.raises(ValueError, match=r"decay: expected values in \(0, 1\]"):
            f(q, k, v, decay=bad)
    with pytest.raises(ValueError, match=r"decay: expected a shape that broadcasts to the leading dims \(2, 3\)"):
        f(q, k, v, decay=np.full(4, 0.9))
    with pytest.raises(TypeError, match="decay: expected a real number"):
        f(q, k, v, decay="0.9")
    with pytest.raises(ValueError, match=r"gate: expected shape \(2, 3, 10\) .* or \(2, 3, 10, 4\)"):
        f(q, k, v, gate=np.zeros((2, 3, 9)))
    with pytest.raises(TypeError, match="gate: expected a real floating or integer array"):
        f(q, k, v, gate=np.zeros((2, 3, 10), complex))
    for value, what in ((0.5, "a positive value"), (np.nan, "NaN")):
        for shape in ((2, 3, 10), (2, 3, 10, 4)):
            gate = np.zeros(shape, np.float32)
            gate[1, 2, 7] = value
            with pytest.raises(ValueError, match=rf"gate: expected log gates <= 0 .* got {what} at sequence "
                                                 r"\(1, 2\), position 7"):
                f(q, k, v, gate=gate)
    for bad, err in ((0.0, ValueError), (-1.0, ValueError), (np.inf, ValueError), ("2", TypeError), (True, TypeError)):
        with pytest.raises(err, match="scale: expected"):
            f(q, k, v, scale=bad)
    for name in ("decay", "gate"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}' .* only causal attention"):
            linattn.linear_attention(q, k, v, **{name: 0.5})


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("option", OPTIONS + ["scale"])
def test_options_take_the_short_path(rng, monkeypatch, option, dtype):
    """A decay (a float, or one per head), a gate of the inputs' dtype and a float scale take the plain
    call's short path (the checked path, patched to fail, is not reached): the same bits as the checked
    path (reached with ``device="cpu"``), with the final state, from an initial state, into ``out=``,
    on a fused projection's head views and on (N, D) and (H, N, D) inputs."""
    from linattn import attention

    for lead, n, d, dv in (((2, 3), 70, 5, 4), ((), 33, 3, 2), ((3,), 1, 1, 1), ((1, 2), 200, 8, 8)):
        q, k, v = make_qkv(rng, lead, n, d, dv, dtype)
        kw = dict(scale=0.3) if option == "scale" else dict(_options(rng, option, lead, n, d, dtype), scale=0.7)
        st = linattn.State(*(rng.random(lead + shape).astype(dtype) for shape in ((d, dv), (d,))))
        want, want_state = linattn.causal_linear_attention(q, k, v, device="cpu", return_state=True, **kw)
        assert_close(want, reference.loop(q, k, v, **kw), dtype)
        from_state = linattn.causal_linear_attention(q, k, v, device="cpu", initial_state=st, **kw)
        with monkeypatch.context() as m:
            m.setattr(attention, "_prepare", lambda *a, **kw: pytest.fail("the general path"))
            np.testing.assert_array_equal(linattn.causal_linear_attention(q, k, v, **kw), want)
            out, state = linattn.causal_linear_attention(q, k, v, return_state=True, **kw)
            np.testing.assert_array_equal(out, want)
            np.testing.assert_array_equal(state.S, want_state.S)
            np.testing.assert_array_equal(state.Z, want_state.Z)
            if n > 6:  # (fewer positions from a state run step's kernel)
                np.testing.assert_array_equal(linattn.causal_linear_attention(q, k, v, initial_state=st, **kw),
                                              from_state)
            buf = np.full(want.shape, np.nan, dtype)
            assert linattn.causal_linear_attention(q, k, v, out=buf, **kw) is buf
            np.testing.assert_array_equal(buf, want)
    # the heads of a fused (B, N, 3, H, D) projection, read in place, with a gate per key dimension
    qkv = (rng.standard_normal((2, 90, 3, 4, 8)) * 0.5).astype(dtype)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    kw = dict(scale=0.3) if option == "scale" else dict(_options(rng, option, (2, 4), 90, 8, dtype), scale=0.7)
    want = linattn.causal_linear_attention(q, k, v, device="cpu", **kw)
    with monkeypatch.context() as m:
        m.setattr(attention, "_prepare", lambda *a, **kw: pytest.fail("the general path"))
        np.testing.assert_array_equal(linattn.causal_linear_attention(q, k, v, **kw), want)


def test_options_the_short_path_leaves_to_the_checked_one(rng, monkeypatch):
    """What the short path does not take, the checked path runs (each call below reaches it), with its
    results: a gate of another dtype or not whole-element strides, a decay that broadcasts (a list,
    shape (1, H)), an int scale, an ``out=`` in the gate's memory; bad values raise its errors."""
    from linattn import attention

    lead, n, d, dv = (2, 3), 40, 4, 4
    q, k, v = make_qkv(rng, lead, n, d, dv)
    checked, prepare = [], attention._prepare
    monkeypatch.setattr(attention, "_prepare", lambda *a, **kw: checked.append(1) or prepare(*a, **kw))

    def f(*args, **kw):
        before = len(checked)
        res = linattn.causal_linear_attention(*args, **kw)
        assert len(checked) == before + 1
        return res

    g32 = _gates(rng, lead + (n, d), np.float32)
    want = reference.loop(q, k, v, gate=g32, decay=np.array([0.5, 0.8, 0.9]), scale=2.0)
    for kw in (dict(gate=g32.astype(np.float64)), dict(decay=[0.5, 0.8, 0.9]), dict(decay=np.array([[0.5, 0.8, 0.9]])),
               dict(scale=2)):
        full = dict(dict(gate=g32, decay=np.array([0.5, 0.8, 0.9]), scale=2.0), **kw)
        assert_close(f(q, k, v, **full), want, np.float32)
    packed = np.zeros(g32.shape, [("gate", np.float32), ("pad", np.uint8)])  # (strides of 5 bytes)
    packed["gate"] = g32
    np.testing.assert_array_equal(f(q, k, v, gate=packed["gate"]), f(q, k, v, gate=g32, device="cpu"))
    gate = g32.copy()
    res = f(q, k, v, gate=gate, out=gate)  # (D = Dv: the gate's own memory for the result)
    assert res is gate
    assert_close(gate, reference.loop(q, k, v, gate=g32), np.float32)
    for bad in (0.0, 1.5, -0.1, np.nan, np.inf, np.array([0.9, 0.9, 2.0]), np.array([0.9, np.nan, 0.5], np.float32)):
        with pytest.raises(ValueError, match=r"decay: expected values in \(0, 1\]"):
            f(q, k, v, decay=bad)
    for bad in (0.0, -1.0, np.inf, np.nan):
        with pytest.raises(ValueError, match="scale: expected"):
            f(q, k, v, scale=bad)


def test_retnet_three_forms(rng):
    """RetNet's retention (identity map, no normalisation, decay gamma per head) in its parallel form
    (Q K^T * D) V with D[n, m] = gamma^(n - m), its recurrent form, and the chunkwise kernel."""
    b, h, n, d = 2, 4, 100, 8
    q, k, v = (rng.standard_normal((b, h, n, d)) for _ in range(3))
    gamma = 1 - 2.0 ** (-5 - np.arange(h))
    idx = np.arange(n)
    D = np.where(idx[:, None] >= idx[None, :], gamma[:, None, None] ** (idx[:, None] - idx[None, :]), 0.0)
    parallel = (q @ np.swapaxes(k, -1, -2) * D) @ v
    recurrent = np.zeros_like(parallel)
    S = np.zeros((b, h, d, d))
    for t in range(n):
        S = gamma[:, None, None] * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        recurrent[:, :, t] = np.einsum("bhd,bhde->bhe", q[:, :, t], S)
    chunkwise = linattn.causal_linear_attention(q, k, v, feature_map="identity", normalize=False, decay=gamma)
    np.testing.assert_allclose(recurrent, parallel, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(chunkwise, parallel, rtol=1e-10, atol=1e-10)
    # decoding with step continues the chunkwise prefill
    _, st = linattn.causal_linear_attention(q[:, :, :60], k[:, :, :60], v[:, :, :60], feature_map="identity",
                                            normalize=False, decay=gamma, return_state=True)
    steps = [linattn.step(q[:, :, t], k[:, :, t], v[:, :, t], st, feature_map="identity", normalize=False,
                          decay=gamma) for t in range(60, n)]
    np.testing.assert_allclose(np.stack(steps, axis=2), parallel[:, :, 60:], rtol=1e-10, atol=1e-10)


def test_mamba2_ssd(rng):
    """Mamba-2's SSD with a scalar A per head: h_t = exp(dt_t A) h_{t-1} + B_t (x_t dt_t)^T,
    y_t = C_t^T h_t, is linear attention with gate = dt A, q = C, k = B, v = x dt (identity map,
    no normalisation)."""
    b, h, n, dstate, dhead = 2, 3, 90, 16, 8
    x = rng.standard_normal((b, h, n, dhead))
    B, C = rng.standard_normal((b, h, n, dstate)), rng.standard_normal((b, h, n, dstate))
    dt = np.log1p(np.exp(rng.standard_normal((b, h, n))))  # softplus
    A = -np.exp(rng.standard_normal(h))
    hstate = np.zeros((b, h, dstate, dhead))
    y = np.zeros((b, h, n, dhead))
    for t in range(n):
        hstate = (np.exp(dt[:, :, t] * A)[:, :, None, None] * hstate
                  + B[:, :, t, :, None] * (x[:, :, t] * dt[:, :, t, None])[:, :, None, :])
        y[:, :, t] = np.einsum("bhs,bhsd->bhd", C[:, :, t], hstate)
    out = linattn.causal_linear_attention(C, B, x * dt[..., None], gate=dt * A[:, None], feature_map="identity",
                                          normalize=False)
    np.testing.assert_allclose(out, y, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("option", OPTIONS)
def test_prefill_then_steps(rng, option, dtype):
    lead, n, d, dv, split = (2, 3), 60, 8, 5, 37
    q, k, v = make_qkv(rng, lead, n, d, dv, dtype)
    kw = _options(rng, option, lead, n, d, dtype)
    gate = kw.pop("gate", None)

    def at(a, b):
        return None if gate is None else gate[..., a:b, :] if gate.ndim == 4 else gate[..., a:b]

    full = linattn.causal_linear_attention(q, k, v, gate=gate, **kw)
    _, st = linattn.causal_linear_attention(q[..., :split, :], k[..., :split, :], v[..., :split, :],
                                            gate=at(0, split), return_state=True, **kw)
    steps = []
    for t in range(split, n):
        g = None if gate is None else gate[..., t, :] if gate.ndim == 4 else gate[..., t]
        steps.append(linattn.step(q[..., t, :], k[..., t, :], v[..., t, :], st, gate=g, **kw))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert rel_err(np.stack(steps, axis=-2), full[..., split:, :]) < tol


def test_step_gate_and_decay_layouts(rng):
    """A per-dimension gate with strided rows (read in place by the fast kernel only when its rows
    are adjacent), and a decay array changed in place between steps (the fast path keeps a view of
    it), give the same state and outputs as plain arrays."""
    q, k, v = (x[..., 0, :] for x in make_qkv(rng, (2, 3), 1, 6, 5))
    wide = -rng.random((2, 3, 12), np.float32)
    strided, plain = wide[..., ::2], np.ascontiguousarray(wide[..., ::2])
    a, b = linattn.State.zeros((2, 3), 6, 5), linattn.State.zeros((2, 3), 6, 5)
    for _ in range(3):
        np.testing.assert_array_equal(linattn.step(q, k, v, a, gate=strided), linattn.step(q, k, v, b, gate=plain))
    np.testing.assert_array_equal(a.S, b.S)
    decay = np.array([0.9, 0.8, 0.7])
    for value in (0.5, 0.25):
        linattn.step(q, k, v, a, decay=decay)
        decay[:] = value
        out = linattn.step(q, k, v, a, decay=decay)
        linattn.step(q, k, v, b, decay=np.array([0.9, 0.8, 0.7]))
        ref = linattn.step(q, k, v, b, decay=value)
        np.testing.assert_array_equal(out, ref)
        decay[:] = [0.9, 0.8, 0.7]
    np.testing.assert_array_equal(a.S, b.S)


def test_step_bad_gates_leave_the_state_alone(rng):
    q, k, v = (x[..., 0, :] for x in make_qkv(rng, (2, 3), 1, 4, 4))
    for state in (linattn.State.zeros((2, 3), 4, 4),  # the fast path
                  linattn.State(np.zeros((3, 2, 4, 4), np.float32).transpose(1, 0, 2, 3),  # the checked path
                                np.zeros((2, 3, 4), np.float32))):
        for gate in (np.full((2, 3), 0.5, np.float32), np.full((2, 3, 4), np.nan, np.float32)):
            with pytest.raises(ValueError, match="gate: expected log gates <= 0"):
                linattn.step(q, k, v, state, gate=gate)
        for decay in (1.5, np.array([0.5, 0.0, 0.9])):
            with pytest.raises(ValueError, match=r"decay: expected values in \(0, 1\]"):
                linattn.step(q, k, v, state, decay=decay)
        for decay in (np.array([0.9 + 0.5j] * 3), np.ones(3, bool)):  # (the fast path took their real part, 1.0)
            with pytest.raises(TypeError, match=f"decay: expected a real number or an array of them, got an array "
                                                f"of dtype {decay.dtype}"):
                linattn.step(q, k, v, state, decay=decay)
        with pytest.raises(ValueError, match=r"gate: expected shape \(2, 3\) .* or \(2, 3, 4\)"):
            linattn.step(q, k, v, state, gate=np.zeros((2, 3, 5), np.float32))
        np.testing.assert_array_equal(state.S, 0)
        np.testing.assert_array_equal(state.Z, 0)


@pytest.mark.parametrize("option", OPTIONS + ["scale"])
def test_attention_weights_with_decay(rng, option):
    q, k, v = make_qkv(rng, (2, 3), 14, 4, 3, np.float64)
    kw = dict(scale=0.7) if option == "scale" else _options(rng, option, (2, 3), 14, 4, np.float64)
    w = linattn.attention_weights(q, k, eps=0.0, **kw)
    assert w.shape == (2, 3, 14, 14) and np.all(np.triu(w, 1) == 0)
    np.testing.assert_allclose(w @ v, linattn.causal_linear_attention(q, k, v, eps=0.0, **kw), rtol=1e-10,
                               atol=1e-12)
    with pytest.raises(TypeError, match="only causal attention decays"):
        linattn.attention_weights(q, k, causal=False, decay=0.9)
