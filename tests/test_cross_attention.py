"""Cross-attention: linear_attention (and its vjp, attention_weights) with keys and values of another
length than the queries, against the float64 O(N * Nk) reference; the kernels' segments over the two
lengths; what stays an error (causal calls, v of another length than k)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn
from linattn import reference
from linattn.cpu import chunked, noncausal_grad, runtime
from linattn.cpu.elementwise import ELU
from linattn.cpu.map_grad import kernel_map

from conftest import assert_close, cancellation, random_options
from test_gradients import _noncausal_reference_grads, _numeric

PAIRS = [(1, 1), (1, 1000), (1000, 1), (63, 65), (65, 63), (1000, 63), (63, 1000)]


def _cross(rng, lead, n, nk, d, dv, dtype=np.float32):
    q = (rng.standard_normal(lead + (n, d)) * 0.5).astype(dtype)
    k = (rng.standard_normal(lead + (nk, d)) * 0.5).astype(dtype)
    v = rng.standard_normal(lead + (nk, dv)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d, dv", [(1, 1), (16, 8), (5, 33)])
@pytest.mark.parametrize("n, nk", PAIRS)
def test_against_reference(rng, n, nk, d, dv, dtype):
    for lead in ((), (2, 3)):
        q, k, v = _cross(rng, lead, n, nk, d, dv, dtype)
        out = linattn.linear_attention(q, k, v)
        assert out.shape == lead + (n, dv) and out.dtype == dtype
        assert_close(out, reference.masked(q, k, v, causal=False), dtype)


@pytest.mark.parametrize("kw", [dict(feature_map="relu", normalize=False, scale=0.5),
                                dict(feature_map="identity", eps=0.0, normalize=False),
                                dict(feature_map=linattn.feature_maps.Taylor()),
                                dict(feature_map=linattn.feature_maps.Performer.random(6, 10, seed=1), scale=0.3),
                                dict(feature_map=lambda x: np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], -1),
                                     eps=1e-3)])
def test_feature_maps_and_options(rng, kw):
    """Named maps, maps with parameters (computed inside the kernel) and a callable (its k mapped to
    the keys' length), with scale, eps and normalize."""
    q, k, v = _cross(rng, (2,), 70, 45, 6, 4, np.float64)
    assert_close(linattn.linear_attention(q, k, v, **kw), reference.masked(q, k, v, causal=False, **kw), np.float64)


def test_views_and_out(rng):
    """The heads of a decoder's fused QKV projection as queries, of an encoder's fused KV projection as
    keys and values, the result written into a (B, N, H, Dv) buffer's head view."""
    b, h, n, nk, d = 2, 3, 50, 77, 8
    qp = rng.standard_normal((b, n, 3, h, d)).astype(np.float32)
    kvp = rng.standard_normal((b, nk, 2, h, d)).astype(np.float32)
    q = qp[:, :, 0].transpose(0, 2, 1, 3)
    k, v = (kvp[:, :, i].transpose(0, 2, 1, 3) for i in range(2))
    buf = np.full((b, n, h, d), np.nan, np.float32)
    res = linattn.linear_attention(q, k, v, out=buf.transpose(0, 2, 1, 3))
    want = reference.masked(q, k, v, causal=False)
    assert res.base is buf
    assert_close(buf.transpose(0, 2, 1, 3), want, np.float32)
    assert_close(linattn.linear_attention(q, k[:, :, ::-1], v[:, :, ::-1]), want, np.float32)  # (negative strides)


@pytest.mark.parametrize("frac", [[0, 1], [0, 0.5, 1], [0, 0.2, 0.21, 0.9, 1], [0, 0, 0, 1], [0, 1, 1, 1]])
@pytest.mark.parametrize("n, nk", [(300, 70), (70, 300), (300, 0), (0, 70)])
def test_kernel_segments(rng, frac, n, nk):
    """Every kind of split of a head into segments, on two threads: each segment's part of the state
    over the keys' chunks (first run), then its chunks of the outputs from those parts and the initial
    state, the first segment writing the state of every key, even when it has no outputs (second run);
    the keys and the queries of each head up to their lengths (NaN past them; outputs 0 there); and the
    backward's two runs (from the forward's state)."""
    d, dv = 6, 5
    q, k, v = _cross(rng, (3,), n, nk, d, dv)
    lengths, qlengths = np.array([nk, nk // 2, 0]), np.array([n // 3, n, 0])
    for h, (L, M) in enumerate(zip(lengths, qlengths)):
        k[h, L:], v[h, L:], q[h, M:] = np.nan, np.nan, np.nan
    S0, Z0 = rng.random((3, d, dv)).astype(np.float32), rng.random((3, d)).astype(np.float32) + 0.5
    chunk, frac = runtime.chunk_size(max(n, nk)), np.asarray(frac, np.float64)
    out = np.full((3, n, dv), np.nan, np.float32)
    S, Z = np.full_like(S0, np.nan), np.full_like(Z0, np.nan)
    parts = np.full((3, len(frac) - 1, d, dv + 1), np.nan)
    kernel = chunked.noncausal_forward.get(np.float32, "C")
    for phase in (0, 1) if len(frac) > 2 else (1,):
        kernel(2, q[None], k[None], v[None], 1, np.zeros(0, np.float32), 0, np.float32(1e-6), True, np.float32(1),
               lengths, qlengths, chunk, frac, S0, Z0, out[None], S, Z, phase, parts if len(frac) > 2 else parts[:0])
    valid = (np.arange(nk) < lengths[:, None])[..., None]
    qvalid = (np.arange(n) < qlengths[:, None])[..., None]
    k, v, q = np.where(valid, k, 0.0), np.where(valid, v, 0.0), np.where(qvalid, q, 0.0)
    kf = np.where(valid, np.where(k > 0, k + 1.0, np.exp(np.minimum(k, 0.0))), 0.0)
    S_want, Z_want = S0 + np.swapaxes(kf, -1, -2) @ v, Z0 + kf.sum(-2)
    assert_close(S, S_want, np.float32)
    assert_close(Z, Z_want, np.float32)
    qf = np.where(q > 0, q + 1.0, np.exp(np.minimum(q, 0.0)))
    assert_close(out, np.where(qvalid, (qf @ S_want) / ((qf @ Z_want[..., None]) + 1e-6), 0.0), np.float32)
    if not (n and nk):
        return
    q, k, v = _cross(rng, (3,), n, nk, d, dv)  # (the backward: all keys, the queries up to their lengths)
    out, state = linattn.linear_attention(q, k, v, query_lengths=qlengths, return_state=True)
    known = np.concatenate([state.S, state.Z[..., None]], -1)  # (the forward's [S | Z], which the backward reads)
    g = rng.standard_normal((3, n, dv)).astype(np.float32)
    for h, M in enumerate(qlengths):
        q[h, M:], g[h, M:], out[h, M:] = np.nan, np.nan, np.nan
    grads = [np.full_like(x, np.nan) for x in (q, k, v)]
    noncausal_grad.backward(2, q[None], k[None], v[None], g[None], out[None], kernel_map(ELU, None, q.dtype),
                            np.float32(1), np.float32(1e-6), True, np.full(3, nk), qlengths, chunk, frac, known,
                            *(x[None] for x in grads))
    for h, M in enumerate(qlengths):
        want = _noncausal_reference_grads(q[h, :M], k[h], v[h], g[h, :M], "elu", 1.0, 1e-6, True)
        assert (grads[0][h, M:] == 0).all()
        for got, w in zip((grads[0][h, :M], grads[1][h], grads[2][h]), want):
            assert np.abs(got - w).max(initial=0) <= 2e-5 * np.abs(w).max(initial=0)


@pytest.mark.parametrize("n, nk", [(4001, 300), (300, 4001)])
def test_one_long_head_in_segments(rng, n, nk):
    """One head, long enough that runtime.plan cuts it into segments (two runs forward, two back)."""
    q, k, v = _cross(rng, (), n, nk, 16, 24)
    if runtime.num_threads() > 1:
        assert len(runtime.plan(1, max(n, nk), 16, 24, causal=False)[1]) > 2
    g = rng.standard_normal((n, 24)).astype(np.float32)
    out, vjp = linattn.linear_attention_vjp(q, k, v)
    assert_close(out, reference.masked(q, k, v, causal=False), np.float32)
    for got, want in zip(vjp(g), _noncausal_reference_grads(q, k, v, g, "elu", 1.0, 1e-6, True)):
        assert got.shape == want.shape and np.abs(got - want).max() <= 2e-5 * np.abs(want).max()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", [{}, dict(feature_map="relu", scale=0.3, normalize=False)])
@pytest.mark.parametrize("n, nk", PAIRS)
def test_vjp(rng, n, nk, dtype, kw):
    """The gradients against the formulas in float64, with absolute error scaled by the inputs' (with
    one key, or D = 1 and one query, the outputs barely depend on q or k: their gradients cancel to
    rounding)."""
    q, k, v = _cross(rng, (2,), n, nk, 5, 3, dtype)
    g = rng.standard_normal((2, n, 3)).astype(dtype)
    out, vjp = linattn.linear_attention_vjp(q, k, v, **kw)
    np.testing.assert_array_equal(out, linattn.linear_attention(q, k, v, **kw))
    full = dict(dict(feature_map="elu", scale=1.0, eps=1e-6, normalize=True), **kw)
    want = _noncausal_reference_grads(q, k, v, g, full["feature_map"], full["scale"], full["eps"], full["normalize"])
    tol = 2e-5 if dtype == np.float32 else 1e-11
    for got, w in zip(vjp(g), want):
        assert got.dtype == dtype and got.shape == w.shape
        assert np.abs(got - w).max() <= tol * max(np.abs(w).max(), 1.0)


def test_vjp_against_finite_differences(rng):
    q, k, v = (x.astype(np.float64) for x in _cross(rng, (2,), 7, 11, 3, 2))
    fmap = linattn.feature_maps.Performer.random(3, 4, seed=0)
    out, vjp = linattn.linear_attention_vjp(q, k, v, feature_map=fmap, scale=0.7)
    W = rng.standard_normal(out.shape)
    want = _numeric(lambda q, k, v: (linattn.linear_attention(q, k, v, feature_map=fmap, scale=0.7) * W).sum(),
                    [q, k, v])
    got = vjp(W)
    for g, w in zip(got[:3], want):
        assert g.shape == w.shape and np.max(np.abs(g - w)) <= 1e-6 * np.max(np.abs(w)) + 1e-8


def test_no_keys_or_no_queries(rng):
    """No keys: S = Z = 0, so every output is 0 / eps (NaN with eps 0, as the formula; 0 unnormalised);
    no queries: an empty result, and no gradient reaches k or v."""
    q, k, v = _cross(rng, (2,), 5, 0, 3, 2, np.float64)
    np.testing.assert_array_equal(linattn.linear_attention(q, k, v), np.zeros((2, 5, 2)))
    np.testing.assert_array_equal(linattn.linear_attention(q, k, v, normalize=False, eps=0.0), 0)
    with np.errstate(invalid="ignore"):
        assert np.isnan(reference.masked(q, k, v, causal=False, eps=0.0)).all()
    assert np.isnan(linattn.linear_attention(q, k, v, eps=0.0)).all()
    out, vjp = linattn.linear_attention_vjp(q, k, v)
    dq, dk, dv = vjp(np.ones_like(out))
    assert dk.shape == (2, 0, 3) and dv.shape == (2, 0, 2)
    np.testing.assert_array_equal(dq, 0)
    q, k, v = _cross(rng, (2,), 0, 5, 3, 2, np.float64)
    out, vjp = linattn.linear_attention_vjp(q, k, v)
    assert out.shape == (2, 0, 2)
    dq, dk, dv = vjp(np.ones_like(out))
    assert dq.shape == (2, 0, 3)
    np.testing.assert_array_equal(dk, 0)
    np.testing.assert_array_equal(dv, 0)


def test_attention_weights(rng):
    q, k, v = _cross(rng, (2,), 6, 9, 3, 2, np.float64)
    w = linattn.attention_weights(q, k, causal=False, scale=0.5)
    assert w.shape == (2, 6, 9)
    np.testing.assert_allclose(w.sum(-1), 1, rtol=1e-5)
    assert_close(w @ v, linattn.linear_attention(q, k, v, scale=0.5), np.float64)
    with pytest.raises(ValueError, match=r"k: expected sequence length N=6 like q, got 9 .*causal=False"):
        linattn.attention_weights(q, k)


def test_errors(rng):
    q, k, v = _cross(rng, (2,), 6, 9, 3, 2)
    with pytest.raises(ValueError, match=r"v: expected the keys' length 9 like k .* got 8"):
        linattn.linear_attention(q, k, v[:, :8])
    with pytest.raises(ValueError, match=r"v: expected the keys' length 9 like k"):
        linattn.linear_attention_vjp(q, k, v[:, :8])
    for fn in (linattn.causal_linear_attention, linattn.causal_linear_attention_vjp):
        with pytest.raises(ValueError, match=r"k: expected sequence length N=6 like q, got 9 .*linear_attention"):
            fn(q, k, v)
    with pytest.raises(ValueError, match=r"feature_map: expected the callable to map k to shape \(2, 9, 3\)"):
        linattn.linear_attention(q, k, v, feature_map=lambda x: x[..., :6, :])
    out, vjp = linattn.linear_attention_vjp(q, k, v)
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, 6, 2\)"):
        vjp(np.ones((2, 9, 2), np.float32))


@settings(max_examples=40, deadline=None)
@given(lead=st.sampled_from([(), (1,), (2, 3)]), n=st.integers(1, 200), nk=st.integers(0, 200),
       d=st.integers(1, 9), dv=st.integers(1, 9), f64=st.booleans(),
       fmap=st.sampled_from(["elu", "relu", "taylor", "dpfp", "hedgehog"]), scale=st.sampled_from([None, 0.5]),
       normalize=st.booleans(), with_state=st.booleans(), with_lengths=st.booleans(), with_qlengths=st.booleans(),
       seed=st.integers(0, 2**31))
def test_random_shapes(lead, n, nk, d, dv, f64, fmap, scale, normalize, with_state, with_lengths, with_qlengths, seed):
    """Forward (and the keys' state) and vjp against the reference for drawn lengths, dims, maps,
    initial states, key and query lengths (NaN past them). The output within TOL times the draw's
    condition number, as in test_combinations: explore mode drew Taylor's features (of both signs) over
    a random initial Z with a denominator 0.0029 from terms adding up to 2.85 (float32: 4.9e-5 relative
    to the largest output; NumPy's own float32 2.5e-5), and the state the same way: D = Dv = 1 with 157
    keys drew S = -0.0214 from terms adding up to 139.6 (5.6e-5; NumPy's float32 3.8e-5)."""
    rng = np.random.default_rng(seed)
    dtype = np.float64 if f64 else np.float32
    fmap, dk, _ = random_options(rng, lead, n, d, dv, dtype, fmap, "none", False, False, scale)
    q, k, v = _cross(rng, lead, n, nk, d, dv, dtype)
    kw = dict(feature_map=fmap, scale=scale, normalize=normalize, eps=1e-3)
    lengths = rng.integers(0, nk + 1, lead) if with_lengths else None
    valid = (np.arange(nk) < (nk if lengths is None else lengths[..., None]))[..., None]
    k, v = np.where(valid, k, np.nan), np.where(valid, v, np.nan)
    qlengths = rng.integers(0, n + 1, lead[:1]) if with_qlengths else None
    qvalid = np.arange(n) < (n if qlengths is None else qlengths.reshape(qlengths.shape + (1,) * len(lead)))
    qvalid = qvalid[..., None]
    q = np.where(qvalid, q, np.nan)
    S0 = linattn.State(rng.random(lead + (dk, dv)).astype(dtype), (rng.random(lead + (dk,)) + 0.5).astype(dtype))
    out, state, vjp = linattn.linear_attention_vjp(q, k, v, initial_state=S0 if with_state else None,
                                                   return_state=True, lengths=lengths, query_lengths=qlengths, **kw)
    assert out.shape == lead + (n, dv) and out.dtype == dtype
    phi = linattn.feature_maps.as_map(fmap)
    kf = np.where(valid, phi(np.where(valid, k, 0).astype(np.float64)), 0.0)
    S_want, Z_want = np.swapaxes(kf, -1, -2) @ np.where(valid, v, 0).astype(np.float64), kf.sum(-2)
    S_size, Z_size = np.swapaxes(np.abs(kf), -1, -2) @ np.abs(np.where(valid, v, 0)), np.abs(kf).sum(-2)
    if with_state:
        S_want, Z_want = S_want + S0.S, Z_want + S0.Z
        S_size, Z_size = S_size + np.abs(S0.S), Z_size + np.abs(S0.Z)
    for got, want, size in ((state.S, S_want, S_size), (state.Z, Z_want, Z_size)):
        assert_close(got, want, dtype, cancellation(want, size, dtype))
    qf = phi(np.where(qvalid, q, 0).astype(np.float64)) * (1.0 if scale is None else scale)
    want, size = qf @ S_want, np.abs(qf) @ S_size  # (size: what the output's sums add up)
    cond = 1.0
    if normalize:  # a denominator that cancels (features of both signs: Taylor's) amplifies the rounding
        den = qf @ Z_want[..., None] + 1e-3
        cond = float(np.max(np.where(qvalid, (np.abs(qf) @ Z_size[..., None] + 1e-3) / np.abs(den), 1.0)))
        want, size = want / den, size / np.abs(den)
    want, size = np.where(qvalid, want, 0.0), np.where(qvalid, size, 0.0)
    assert_close(out, want, dtype, max(cond, cancellation(want, size, dtype)))
    np.testing.assert_array_equal(np.where(qvalid, 0, out), 0)
    grads = vjp(np.where(qvalid, 1.0, np.nan).astype(dtype) * np.ones_like(out))
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    assert all(np.isfinite(g).all() for g in grads[:3])
    for g, m in zip(grads[:3], (qvalid, valid, valid)):
        np.testing.assert_array_equal(np.where(m, 0, g), 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n, cuts", [(63, (0, 1, 40, 65)), (1, (0, 1000)), (1000, (0, 500, 999, 1000))])
def test_state_of_keys_in_pieces(rng, dtype, n, cuts):
    """Keys given in pieces through initial_state / return_state: each call's outputs attend to every
    key so far, the state after the last piece is that of one call over all the keys (and its S, Z
    the sums), and queries over the state alone (k, v None) equal the one call."""
    q, k, v = _cross(rng, (2,), n, cuts[-1], 5, 3, dtype)
    whole, st_whole = linattn.linear_attention(q, k, v, return_state=True)
    assert_close(whole, reference.masked(q, k, v, causal=False), dtype)
    kf = np.where(k > 0, k + 1.0, np.exp(np.minimum(k, 0.0)))
    assert_close(st_whole.S, np.swapaxes(kf, -1, -2) @ v.astype(np.float64), dtype)
    assert_close(st_whole.Z, kf.sum(-2), dtype)
    state = None
    for a, b in zip(cuts[:-1], cuts[1:]):
        out, state = linattn.linear_attention(q, k[:, a:b], v[:, a:b], initial_state=state, return_state=True)
        assert_close(out, reference.masked(q, k[:, :b], v[:, :b], causal=False), dtype)
    assert state.S.dtype == dtype and state.Z.dtype == dtype
    assert_close(state.S, st_whole.S, dtype)
    assert_close(state.Z, st_whole.Z, dtype)
    assert_close(linattn.linear_attention(q, initial_state=state), whole, dtype)
    assert_close(linattn.linear_attention(q[:, :1], None, None, initial_state=state), whole[:, :1], dtype)


def test_state_with_options_and_segments(rng, monkeypatch):
    """initial_state with maps, scale, normalize and views; and heads cut into segments (the first run's
    parts added to the initial state) equal to one segment a head."""
    q, k, v = _cross(rng, (2, 2), 300, 500, 6, 4, np.float64)
    S0 = linattn.State(rng.random((2, 2, 28, 4)), rng.random((2, 2, 28)) + 0.5)  # (Taylor: D' = 1 + 6 + 21)
    kw = dict(feature_map=linattn.feature_maps.Taylor(), scale=0.4, normalize=False, initial_state=S0,
              return_state=True)
    k2 = np.concatenate([k, k], -1)[..., ::2]  # (a strided view)
    out, st = linattn.linear_attention(q, k2, v, **kw)
    phi = linattn.feature_maps.Taylor()
    kf = phi(k2.astype(np.float64))
    S_want, Z_want = S0.S + np.swapaxes(kf, -1, -2) @ v, S0.Z + kf.sum(-2)
    assert_close(st.S, S_want, np.float64)
    assert_close(st.Z, Z_want, np.float64)
    assert_close(out, 0.4 * phi(q) @ S_want, np.float64)
    real_plan = linattn.attention.plan
    monkeypatch.setattr(linattn.attention, "plan", lambda bh, n, dk, dv, causal=True, two_runs=True: (
        real_plan(bh, n, dk, dv, causal, two_runs)[0], np.array([0, 0.3, 0.31, 1.0]), 2, True))
    out2, st2 = linattn.linear_attention(q, k2, v, **kw)
    assert_close(out2, out, np.float64)
    assert_close(st2.S, st.S, np.float64)


@pytest.mark.parametrize("with_keys", [True, False])
def test_state_vjp_against_finite_differences(rng, with_keys):
    """Gradients through initial_state and the returned state (vjp(dout, dstate)); with k, v None only
    the queries' and the initial state's (dk, dv None)."""
    q, k, v = (x.astype(np.float64) for x in _cross(rng, (2,), 4, 6, 3, 2))
    S0 = linattn.State(rng.random((2, 3, 2)), rng.random((2, 3)) + 0.5)
    keys = (k, v) if with_keys else (None, None)
    out, st, vjp = linattn.linear_attention_vjp(q, *keys, initial_state=S0, return_state=True, scale=0.8)
    W, WS, WZ = (rng.standard_normal(x.shape) for x in (out, st.S, st.Z))

    def loss(q, S, Z, *kv):
        o, s = linattn.linear_attention(q, *(kv or keys), initial_state=linattn.State(S, Z), return_state=True,
                                        scale=0.8)
        return (o * W).sum() + (s.S * WS).sum() + (s.Z * WZ).sum()

    got = vjp(W, linattn.State(WS, WZ))
    assert isinstance(got[3], linattn.State)
    want = _numeric(loss, [q, S0.S, S0.Z] + ([k, v] if with_keys else []))
    pairs = [(got[0], want[0]), (got[3].S, want[1]), (got[3].Z, want[2])]
    if with_keys:
        pairs += [(got[1], want[3]), (got[2], want[4])]
    else:
        assert got[1] is None and got[2] is None
    for g, w in pairs:
        assert g.shape == w.shape and np.max(np.abs(g - w)) <= 1e-6 * np.max(np.abs(w)) + 1e-8
    _, vjp_plain = linattn.linear_attention_vjp(q, *keys, initial_state=S0)
    got_plain = vjp_plain(W)  # (no state returned: its gradient is zero)

    def loss_plain(q, S, Z):
        return (linattn.linear_attention(q, *keys, initial_state=linattn.State(S, Z), scale=0.8) * W).sum()

    want = _numeric(loss_plain, [q, S0.S, S0.Z])
    for g, w in zip((got_plain[0], got_plain[3].S, got_plain[3].Z), want):
        assert np.max(np.abs(g - w)) <= 1e-6 * np.max(np.abs(w)) + 1e-8


def test_out_over_the_initial_state(rng):
    """out in the memory of the initial state it reads (each head's outputs over the next head's state):
    the result computed aside, as with out over q, k, v."""
    q = rng.standard_normal((4, 2, 8)).astype(np.float64)
    k, v = rng.standard_normal((4, 5, 8)), rng.standard_normal((4, 5, 8))
    _, st = linattn.linear_attention(q, k, v, return_state=True)
    want = linattn.linear_attention(q, initial_state=st)
    flat = st.S.reshape(-1)
    out = flat[2 * 8 * 8 - 16:][:4 * 2 * 8].reshape(4, 2, 8)  # head h's rows end inside head h + 1's S
    res = linattn.linear_attention(q, initial_state=st, out=out)
    assert res is out
    np.testing.assert_array_equal(out, want)


def test_state_errors(rng):
    q, k, v = _cross(rng, (2,), 6, 9, 3, 2)
    st = linattn.linear_attention(q, k, v, return_state=True)[1]
    with pytest.raises(TypeError, match=r"k: expected an array, got None \(k and v may both be None only with an"):
        linattn.linear_attention(q)
    with pytest.raises(TypeError, match=r"v: expected an array, got None"):
        linattn.linear_attention(q, k, initial_state=st)
    with pytest.raises(TypeError, match=r"k: expected an array, got None"):
        linattn.linear_attention(q, None, v)
    with pytest.raises(TypeError, match=r"initial_state: expected a linattn.State"):
        linattn.linear_attention(q, initial_state=3.0)
    for S, Z in ((np.zeros(()), st.Z), (st.S, np.zeros(())), (st.S[0], st.Z), (st.S.astype(complex), st.Z)):
        with pytest.raises((ValueError, TypeError), match=r"initial_state\.[SZ]: expected"):  # (one query: the read)
            linattn.linear_attention(q[:, :1], initial_state=linattn.State(S, Z))
    with pytest.raises(ValueError, match=r"initial_state.S: expected shape \(2, 2, 2\) .* got \(2, 3, 2\)"):
        linattn.linear_attention(q[..., :2], k[..., :2], v, initial_state=st)  # (D' 2 here)
    with pytest.raises(ValueError, match=r"initial_state.S: expected shape \(2, 2, 2\)"):
        linattn.linear_attention(q[..., :2], initial_state=st)
    with pytest.raises(ValueError, match=r"initial_state.S: expected leading dimensions \(1,\) like q"):
        linattn.linear_attention(q[:1], initial_state=st)
    with pytest.raises(TypeError, match=r"initial_state.S: expected dtype float64"):
        linattn.linear_attention(q.astype(np.float64), initial_state=st)
    with pytest.raises(TypeError, match="return_state: expected True or False"):
        linattn.linear_attention(q, k, v, return_state=1)
    _, vjp = linattn.linear_attention_vjp(q, k, v)
    with pytest.raises(TypeError, match=r"dstate: the forward returned no state"):
        vjp(np.ones((2, 6, 2), np.float32), st)
    _, _, vjp = linattn.linear_attention_vjp(q, k, v, return_state=True)
    with pytest.raises(ValueError, match=r"dstate.S: expected shape \(2, 3, 2\)"):
        vjp(np.ones((2, 6, 2), np.float32), linattn.State(st.S[..., :1], st.Z))


def _padded(rng, lead, n, nk, d, dv, lengths, dtype=np.float32):
    """Cross-attention inputs whose keys and values hold NaN past each sequence's length."""
    q, k, v = _cross(rng, lead, n, nk, d, dv, dtype)
    valid = np.arange(nk) < np.broadcast_to(np.asarray(lengths).reshape(np.shape(lengths) + (1,) * (
        len(lead) - np.ndim(lengths))), lead)[..., None]
    return q, np.where(valid[..., None], k, np.nan), np.where(valid[..., None], v, np.nan), valid


def _per_sequence(fn, q, k, v, lengths, lead):
    """fn(q_b, k_b[:L], v_b[:L]) for each sequence b of the leading dims, stacked."""
    lens = np.broadcast_to(np.asarray(lengths).reshape(np.shape(lengths) + (1,) * (len(lead) - np.ndim(lengths))),
                           lead)
    return [fn(q[i], k[i][:lens[i]], v[i][:lens[i]]) for i in np.ndindex(lead)], list(np.ndindex(lead))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n, nk", [(63, 65), (1000, 63), (65, 1000), (70, 70)])
def test_lengths_of_padded_keys(rng, dtype, n, nk):
    """Keys and values right-padded (NaN past each length, lengths per sequence or per batch row):
    every query attends to its sequence's keys alone, the state is theirs, with an initial state too."""
    lead = (3, 2)
    for lengths in (np.array([nk, nk // 2, 0]), np.array([[nk, 1], [0, nk - 1], [nk // 3, nk]])):
        q, k, v, _ = _padded(rng, lead, n, nk, 5, 3, lengths, dtype)
        out, st = linattn.linear_attention(q, k, v, lengths=lengths, return_state=True)
        wants, idx = _per_sequence(lambda a, b, c: reference.masked(a, b, c, causal=False), q, k, v, lengths, lead)
        for i, want in zip(idx, wants):
            assert_close(out[i], want if want.size else np.zeros_like(out[i]), dtype)
        kf = np.where(np.isnan(k), 0.0, np.where(k > 0, k + 1.0, np.exp(np.minimum(k, 0.0))))
        assert_close(st.S, np.swapaxes(kf, -1, -2) @ np.nan_to_num(v.astype(np.float64)), dtype)
        assert_close(st.Z, kf.sum(-2), dtype)
        np.testing.assert_array_equal(linattn.linear_attention(q, k, v, lengths=lengths), out)
        S0 = linattn.State((rng.random(lead + (5, 3)) * 0.5).astype(dtype),
                           (rng.random(lead + (5,)) + 0.5).astype(dtype))
        out2, st2 = linattn.linear_attention(q, k, v, lengths=lengths, initial_state=S0, return_state=True)
        assert_close(st2.S, st.S + S0.S, dtype)
        assert_close(out2, linattn.linear_attention(q, initial_state=st2), dtype)


def test_lengths_in_segments(rng, monkeypatch):
    """One long head cut into segments (two runs), its keys padded: the segments past the length sum
    nothing."""
    q, k, v, _ = _padded(rng, (1,), 300, 4001, 8, 4, np.array([2500]))
    want = reference.masked(q, k[:, :2500], v[:, :2500], causal=False)
    assert_close(linattn.linear_attention(q, k, v, lengths=np.array([2500])), want, np.float32)
    real_plan = linattn.attention.plan
    monkeypatch.setattr(linattn.attention, "plan", lambda bh, n, dk, dv, causal=True, two_runs=True: (
        real_plan(bh, n, dk, dv, causal, two_runs)[0], np.array([0, 0.3, 0.7, 0.9, 1.0]), 2, True))
    assert_close(linattn.linear_attention(q, k, v, lengths=np.array([2500])), want, np.float32)


@pytest.mark.parametrize("fmap", ["elu", "relu", "taylor", "hedgehog"])
def test_lengths_vjp(rng, fmap):
    """Gradients with padded keys: those of each sequence's own call, 0 past its length (NaN there
    reaches nothing, a map's parameters' gradients included)."""
    lead, n, nk, d, dv = (2, 2), 9, 11, 3, 2
    lengths = np.array([11, 4])
    q, k, v, valid = _padded(rng, lead, n, nk, d, dv, lengths, np.float64)
    fm = {"taylor": linattn.feature_maps.Taylor(),
          "hedgehog": linattn.feature_maps.Hedgehog(rng.standard_normal((d, 2)), rng.standard_normal(2) * 0.1)}.get(
        fmap, fmap)
    W = rng.standard_normal(lead + (n, dv))
    out, vjp = linattn.linear_attention_vjp(q, k, v, lengths=lengths, feature_map=fm)
    got = vjp(W)
    assert all(np.isfinite(g).all() for g in got[:3])
    for g in got[1:3]:
        np.testing.assert_array_equal(np.where(valid[..., None], 0, g), 0)
    if fmap == "hedgehog":
        assert all(np.isfinite(x).all() for x in got[3].values())
    for i in np.ndindex(lead):
        L = lengths[i[0]]
        o_i, vjp_i = linattn.linear_attention_vjp(q[i], k[i][:L], v[i][:L], feature_map=fm)
        assert_close(out[i], o_i, np.float64)
        for g, w in zip(got[:3], vjp_i(W[i])[:3]):
            assert_close(g[i][:w.shape[0]], w, np.float64)


def test_lengths_errors(rng):
    q, k, v = _cross(rng, (2,), 6, 9, 3, 2)
    with pytest.raises(ValueError, match=r"lengths: expected values in \[0, Nk=9\], got 10"):
        linattn.linear_attention(q, k, v, lengths=np.array([9, 10]))
    with pytest.raises(ValueError, match=r"lengths: expected shape \(2,\)"):
        linattn.linear_attention(q, k, v, lengths=np.array([9, 9, 9]))
    with pytest.raises(TypeError, match=r"lengths: expected an integer array"):
        linattn.linear_attention(q, k, v, lengths=np.array([9.0, 9.0]))
    with pytest.raises(ValueError, match=r"lengths: expected values in \[0, Nk=9\]"):
        linattn.linear_attention_vjp(q, k, v, lengths=np.array([9, -1]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lead", [(), (3,), (2, 3), (2, 1, 3), (8, 8)])
def test_one_query_over_state(rng, lead, dtype):
    """A decoding step's query over the keys' state (N = 1, k and v None) takes the step kernel's
    read-only variant (in parallel from 2**18 state elements: (8, 8) at D = Dv = 64): the reference's
    result, the general path's, the state unchanged; named maps and map objects (computed in the
    kernel, D' != D), D != Dv, D = 1, a strided q and a read-only state."""
    dims = [(64, 64)] if lead == (8, 8) else [(5, 3), (1, 7), (16, 33)]
    for d, dv in dims:
        maps = [dict(), dict(feature_map="relu", normalize=False), dict(feature_map="identity", eps=0.5),
                dict(feature_map=linattn.feature_maps.Taylor()),
                dict(feature_map=linattn.feature_maps.T2R(rng.standard_normal((d, 4)), rng.standard_normal(4)))]
        for kw in maps:
            dk = linattn.feature_maps.as_map(kw.get("feature_map", "elu")).out_dim(d)
            S = (rng.random(lead + (dk, dv)) * 2 - 0.5).astype(dtype)
            Z = (rng.random(lead + (dk,)) + 0.5).astype(dtype)
            q = rng.standard_normal(lead + (1, 2 * d)).astype(dtype)[..., ::2]  # (a strided view)
            state = linattn.State(S.copy(), Z.copy())
            state.S.flags.writeable = state.Z.flags.writeable = bool(len(kw) % 2)  # (read-only ones too)
            out = linattn.linear_attention(q, initial_state=state, **kw)
            assert out.shape == lead + (1, dv) and out.dtype == dtype
            np.testing.assert_array_equal(state.S, S)
            np.testing.assert_array_equal(state.Z, Z)
            phi = linattn.feature_maps.as_map(kw.get("feature_map", "elu"))
            qf = phi(q.astype(np.float64))
            want = qf @ S.astype(np.float64)
            if kw.get("normalize", True):
                want = want / (qf @ Z.astype(np.float64)[..., None] + kw.get("eps", 1e-6))
            assert_close(out, want, dtype)
            assert_close(out, linattn.linear_attention(q, initial_state=state, scale=1.0, **kw), dtype)  # (general)
    with pytest.raises(ValueError, match=r"initial_state.S: expected shape"):  # (a state that does not fit)
        linattn.linear_attention(np.zeros(lead + (1, 4), dtype), initial_state=linattn.State.zeros(lead, 5, 3, dtype))


def _few_inputs(rng, lead, n, nk, d, dv, dtype, kw):
    """q, k (views: every other column, k's backwards), v of heads of few positions, NaN past the
    lengths in ``kw`` (keys' and queries'), and those lengths (None for none)."""
    q, k, v = _cross(rng, lead, n, nk, 2 * d, dv, dtype)
    q, k = q[..., ::2], k[..., ::-2]
    lengths, qlengths = kw.get("lengths"), kw.get("query_lengths")
    if lengths is not None:
        k, v, q = k.copy(), v.copy(), q.copy()
        for h in range(lead[0]):
            k[h, lengths[h]:], v[h, lengths[h]:], q[h, qlengths[h]:] = np.nan, np.nan, np.nan
    return q, k, v, lengths, qlengths


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lead, n, nk, d, dv, kw", [
    ((2, 4), 16, 16, 64, 64, {}),
    ((), 1, 1, 1, 3, {}),
    ((3,), 7, 13, 24, 40, dict(feature_map="relu", scale=0.3)),
    ((2,), 20, 5, 32, 16, dict(lengths=np.array([5, 2]), query_lengths=np.array([20, 9]))),
    ((2,), 9, 9, 16, 16, dict(normalize=False, eps=0.0, feature_map="identity")),
    ((2,), 8, 6, 8, 8, dict(feature_map=linattn.feature_maps.DPFP())),
])
def test_few_positions_from_their_scores(rng, dtype, lead, n, nk, d, dv, kw):
    """Heads of few queries and keys for their features (N Nk (D' + Dv) < (N + Nk) D' Dv, each within a
    chunk) take their outputs from the scores phi(Q) phi(K)^T times V: the reference's, the same bits
    whether the state is returned (it is then summed too) or not, and close to the state's form (from a
    zero initial state, which takes that form; the state applied to the queries): odd sizes, D = 1,
    another number of keys, padded keys and queries (NaN past their lengths), maps with D' != D, and
    strided views."""
    q, k, v, lengths, qlengths = _few_inputs(rng, lead, n, nk, d, dv, dtype, kw)
    out = linattn.linear_attention(q, k, v, **kw)
    out_s, st = linattn.linear_attention(q, k, v, return_state=True, **kw)
    np.testing.assert_array_equal(out, out_s)
    fmap = linattn.feature_maps.as_map(kw.get("feature_map", "elu"))
    dk = fmap.out_dim(d)
    ref_kw = {key: x for key, x in kw.items() if key not in ("lengths", "query_lengths")}
    want = np.zeros(lead + (n, dv))
    for h in np.ndindex(lead):
        L, M = (nk, n) if lengths is None else (lengths[h], qlengths[h])
        want[h][:M] = reference.masked(q[h][:M], k[h][:L], v[h][:L], causal=False, **ref_kw)
        kf = fmap(k[h][:L].astype(np.float64))
        assert_close(st.S[h], kf.T @ v[h][:L].astype(np.float64), dtype)
    assert out.shape == lead + (n, dv) and out.dtype == dtype
    assert_close(out, want, dtype)
    zero = linattn.State.zeros(lead, dk, dv, dtype)
    assert_close(linattn.linear_attention(q, k, v, initial_state=zero, **kw), want, dtype)  # (the state's form)
    over_state = linattn.linear_attention(q, initial_state=st, **{key: x for key, x in kw.items() if key != "lengths"})
    assert_close(over_state, want, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lead, n, nk, d, dv, kw", [
    ((2, 4), 16, 16, 64, 64, {}),
    ((), 1, 1, 1, 3, dict(eps=1e-2)),
    ((3,), 7, 13, 24, 40, dict(feature_map="relu", scale=0.3)),
    ((2,), 20, 5, 32, 16, dict(lengths=np.array([5, 2]), query_lengths=np.array([20, 9]))),
    ((2,), 9, 9, 16, 16, dict(normalize=False, feature_map="relu")),
])
def test_few_positions_gradients_from_their_scores(rng, dtype, lead, n, nk, d, dv, kw):
    """The vjp of heads of few queries and keys (chunked.few_positions) from their scores: the formulas'
    gradients in float64 (0 past the lengths, NaN there in the inputs), and those of the sums' form (a
    zero initial state takes it), for views and a strided dout."""
    q, k, v, lengths, qlengths = _few_inputs(rng, lead, n, nk, d, dv, dtype, kw)
    g = rng.standard_normal(lead + (n, 2 * dv)).astype(dtype)[..., ::2]
    _, vjp = linattn.linear_attention_vjp(q, k, v, **kw)
    got = vjp(g)
    zero = linattn.State.zeros(lead, d, dv, dtype)
    sums = linattn.linear_attention_vjp(q, k, v, initial_state=zero, **kw)[1](g)[:3]
    full = dict(dict(feature_map="elu", scale=1.0, eps=1e-6, normalize=True), **kw)
    tol = 2e-5 if dtype == np.float32 else 1e-11
    for h in np.ndindex(lead):
        L, M = (nk, n) if lengths is None else (lengths[h], qlengths[h])
        want = _noncausal_reference_grads(q[h][:M], k[h][:L], v[h][:L], g[h][:M], full["feature_map"], full["scale"],
                                          full["eps"], full["normalize"])
        for x, s, w, m in zip(got, sums, want, (M, L, L)):
            assert x.dtype == dtype and x.shape == lead + ((n if x is got[0] else nk), w.shape[-1])
            assert np.abs(x[h][:m] - w).max() <= tol * max(np.abs(w).max(), 1.0)
            assert np.abs(x[h][:m] - s[h][:m]).max() <= tol * max(np.abs(w).max(), 1.0)
            assert not np.any(x[h][m:])


def test_few_positions_vjp_keeps_no_state(rng, monkeypatch):
    """Where the backward takes every head from its scores (gradients._scores_only: B1 H8 N16 D64, no
    lengths, no state returned), the vjp's forward writes no state and the backward reads none: the same bits
    as with the state kept. Where some head would take the state's path, _scores_only says no."""
    from linattn import gradients
    q, k, v, g = (rng.standard_normal((1, 8, 16, 64)).astype(np.float32) for _ in range(4))
    for name in ("elu", "relu"):
        fmap, code = gradients._map_and_code(name)
        assert gradients._scores_only(fmap, code, q, k, v) is not None
        with monkeypatch.context() as patch:
            patch.setattr(gradients, "_state_columns", None)  # (not called)
            got = linattn.linear_attention_vjp(q, k, v, feature_map=name)
            grads = got[1](g)
        with monkeypatch.context() as patch:
            patch.setattr(gradients, "_scores_only", lambda *args: None)
            want = linattn.linear_attention_vjp(q, k, v, feature_map=name)
            np.testing.assert_array_equal(got[0], want[0])
            for x, y in zip(grads, want[1](g)):
                np.testing.assert_array_equal(x, y)
    fmap, code = gradients._map_and_code("elu")
    assert gradients._scores_only(fmap, code, q[..., :16], k[..., :16], v[..., :16]) is None  # (16 x 16 x 32 products
    assert gradients._scores_only(fmap, code, q[..., :1, :], k[..., :0, :], v[..., :0, :]) is None  # as many; no keys)
    assert gradients._scores_only(fmap, code, np.concatenate([q, q, q], -2), k, v) is None  # (48 queries: two chunks)
    assert gradients._scores_only(fmap, None, q, k, v) is None  # (a map the kernel does not apply: no code)
