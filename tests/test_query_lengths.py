"""linear_attention's ``query_lengths``: right-padded queries (a padded batch's self-attention, a
decoder's padded queries) are never read and their outputs and gradients are 0; every other row is
that of its sequence's own call, checked against the float64 reference and per-sequence calls."""
import numpy as np
import pytest

import linattn
from linattn import reference

from conftest import assert_close


def _padded(rng, lead, n, nk, d, dv, qlens, klens, dtype):
    """q (NaN past each query length), k and v (NaN past each key length), the query mask
    (lead + (n,)) and both lengths broadcast to the leading dims."""
    def full(lens):
        lens = np.asarray(lens)
        return np.broadcast_to(lens.reshape(lens.shape + (1,) * (len(lead) - lens.ndim)), lead)

    q = (rng.standard_normal(lead + (n, d)) * 0.5).astype(dtype)
    k = (rng.standard_normal(lead + (nk, d)) * 0.5).astype(dtype)
    v = rng.standard_normal(lead + (nk, dv)).astype(dtype)
    qvalid, kvalid = np.arange(n) < full(qlens)[..., None], np.arange(nk) < full(klens)[..., None]
    q = np.where(qvalid[..., None], q, np.nan).astype(dtype)
    k, v = (np.where(kvalid[..., None], x, np.nan).astype(dtype) for x in (k, v))
    return q, k, v, qvalid, full(qlens), full(klens)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n, nk, d, dv", [(1, 1, 1, 1), (63, 63, 5, 3), (65, 65, 16, 8), (1000, 1000, 4, 7),
                                          (63, 1000, 5, 3), (1000, 65, 1, 2)])
def test_against_reference(rng, n, nk, d, dv, dtype):
    """Padded queries and keys, lengths per batch row or per sequence (0 and full among them): each
    sequence's rows are its own call's (the float64 reference), the padded rows exactly 0, also through
    out= (a strided view) and with the keys' state in and out."""
    lead = (3, 2)
    for qlens, klens in ((np.array([n, n // 2, 0]), np.array([nk, nk, nk // 3])),
                         (np.array([[n - 1, 1], [0, n], [n // 3, n]]), np.array([[nk, 1], [0, nk - 1], [nk, nk]]))):
        q, k, v, qvalid, ql, kl = _padded(rng, lead, n, nk, d, dv, qlens, klens, dtype)
        out = linattn.linear_attention(q, k, v, lengths=klens, query_lengths=qlens)
        assert out.shape == lead + (n, dv) and out.dtype == dtype
        np.testing.assert_array_equal(out[~qvalid], 0)
        for i in np.ndindex(lead):
            want = reference.masked(q[i][:ql[i]], k[i][:kl[i]], v[i][:kl[i]], causal=False)
            assert_close(out[i][:ql[i]], want if kl[i] else np.zeros_like(want), dtype)
        buf = np.full((lead[0], n, lead[1], dv), np.nan, dtype)  # a (B, N, H, Dv) buffer's head view
        res = linattn.linear_attention(q, k, v, lengths=klens, query_lengths=qlens, out=buf.transpose(0, 2, 1, 3))
        assert res.base is buf
        np.testing.assert_array_equal(buf.transpose(0, 2, 1, 3), out)
        S0 = linattn.State(rng.random(lead + (d, dv)).astype(dtype), (rng.random(lead + (d,)) + 0.5).astype(dtype))
        out2, st = linattn.linear_attention(q, k, v, lengths=klens, query_lengths=qlens, initial_state=S0,
                                            return_state=True)
        np.testing.assert_array_equal(out2[~qvalid], 0)
        over_state = linattn.linear_attention(q, initial_state=st, query_lengths=qlens)  # (no keys)
        assert_close(over_state, out2, dtype)
        np.testing.assert_array_equal(over_state[~qvalid], 0)


def test_padded_self_attention_is_each_sequences_own(rng):
    """The common use: a padded batch of encoder inputs, lengths and query_lengths the same; the rows of
    each sequence equal its unpadded call's, bit for bit on the same kernel path."""
    q, k, v, qvalid, ql, _ = _padded(rng, (4, 2), 300, 300, 16, 16, np.array([300, 17, 299, 1]),
                                     np.array([300, 17, 299, 1]), np.float32)
    k = np.where(qvalid[..., None], q, np.nan).astype(np.float32)  # (self-attention: k from the same rows)
    lens = np.array([300, 17, 299, 1])
    out = linattn.linear_attention(q, k, v, lengths=lens, query_lengths=lens)
    for b, L in enumerate(lens):
        assert_close(out[b, :, :L], linattn.linear_attention(q[b, :, :L], k[b, :, :L], v[b, :, :L]), np.float32)
    np.testing.assert_array_equal(out[~qvalid], 0)


def test_in_segments(rng, monkeypatch):
    """One long head cut into segments (two runs forward, three back): the segments past the length
    compute nothing, the last zeroes the padding, whatever the split."""
    n = 4001
    q, k, v, qvalid, _, _ = _padded(rng, (1,), n, n, 8, 4, np.array([2500]), np.array([n]), np.float32)
    want = reference.masked(q[:, :2500], k, v, causal=False)
    g = rng.standard_normal((1, n, 4)).astype(np.float32)
    _, vjp_ref = linattn.linear_attention_vjp(q[:, :2500], k, v)
    grads_ref = vjp_ref(g[:, :2500])
    real_plan = linattn.attention.plan
    for frac in (None, [0, 0.3, 0.7, 0.9, 1.0], [0, 0.5, 0.6, 1.0]):
        if frac is not None:
            plan = (lambda bh, n, dk, dv, causal=True, two_runs=True, frac=frac: (
                real_plan(bh, n, dk, dv, causal, two_runs)[0], np.array(frac), 2, True))
            monkeypatch.setattr(linattn.attention, "plan", plan)
            monkeypatch.setattr(linattn.gradients, "plan", plan)
        out, vjp = linattn.linear_attention_vjp(q, k, v, query_lengths=[2500])
        assert_close(out[:, :2500], want, np.float32)
        np.testing.assert_array_equal(out[:, 2500:], 0)
        dq, dk, dv = vjp(np.where(qvalid[..., None], g, np.nan))  # (the output's gradient past it: not read)
        np.testing.assert_array_equal(dq[:, 2500:], 0)
        for got, w in zip((dq[:, :2500], dk, dv), grads_ref):
            assert_close(got, w, np.float32)


@pytest.mark.parametrize("fmap", ["elu", "relu", "taylor", "hedgehog"])
def test_vjp(rng, fmap):
    """Gradients with padded queries and keys: each sequence's own call's (its gradients checked against
    finite differences elsewhere), 0 past the lengths; NaN in the padding and in the output's gradient
    there reaches nothing, a map's parameters' gradients and the initial state's included."""
    lead, n, nk, d, dv = (2, 2), 9, 11, 3, 2
    qlens, klens = np.array([[4, 9], [0, 1]]), np.array([11, 5])
    q, k, v, qvalid, ql, kl = _padded(rng, lead, n, nk, d, dv, qlens, klens, np.float64)
    fm = {"taylor": linattn.feature_maps.Taylor(),
          "hedgehog": linattn.feature_maps.Hedgehog(rng.standard_normal((d, 2)), rng.standard_normal(2) * 0.1)}.get(
        fmap, fmap)
    dk_ = linattn.feature_maps.as_map(fm).out_dim(d)
    S0 = linattn.State(rng.random(lead + (dk_, dv)), rng.random(lead + (dk_,)) + 0.5)
    dS = linattn.State(rng.standard_normal(lead + (dk_, dv)), rng.standard_normal(lead + (dk_,)))
    W = np.where(qvalid[..., None], rng.standard_normal(lead + (n, dv)), np.nan)
    out, st, vjp = linattn.linear_attention_vjp(q, k, v, lengths=klens, query_lengths=qlens, feature_map=fm,
                                                initial_state=S0, return_state=True)
    got = vjp(W, dS)
    np.testing.assert_array_equal(got[0][~qvalid], 0)
    assert all(np.isfinite(x).all() for x in got[:3])
    params = {}
    for i in np.ndindex(lead):
        S0_i = linattn.State(S0.S[i], S0.Z[i])
        o_i, st_i, vjp_i = linattn.linear_attention_vjp(q[i][:ql[i]], k[i][:kl[i]], v[i][:kl[i]], feature_map=fm,
                                                        initial_state=S0_i, return_state=True)
        assert_close(out[i][:ql[i]], o_i, np.float64)
        assert_close(st.S[i], st_i.S, np.float64)
        want = vjp_i(W[i][:ql[i]], linattn.State(dS.S[i], dS.Z[i]))
        for g, w in zip(got[:3], want[:3]):
            assert_close(g[i][:w.shape[0]], w, np.float64)
        assert_close(got[3].S[i], want[3].S, np.float64)
        assert_close(got[3].Z[i], want[3].Z, np.float64)
        for name, value in (want[4].items() if len(want) > 4 else ()):
            params[name] = params.get(name, 0) + value
    for name, value in params.items():
        assert_close(got[4][name], value, np.float64)


def test_errors(rng):
    q, k, v = (rng.standard_normal((2, m, 3)).astype(np.float32) for m in (6, 9, 9))
    with pytest.raises(ValueError, match=r"query_lengths: expected values in \[0, N=6\], got 7"):
        linattn.linear_attention(q, k, v, query_lengths=np.array([6, 7]))
    with pytest.raises(ValueError, match=r"query_lengths: expected shape \(2,\)"):
        linattn.linear_attention(q, k, v, query_lengths=np.array([1, 1, 1]))
    with pytest.raises(TypeError, match=r"query_lengths: expected an integer array"):
        linattn.linear_attention(q, k, v, query_lengths=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"query_lengths: expected values in \[0, N=6\], got -1"):
        linattn.linear_attention_vjp(q, k, v, query_lengths=np.array([-1, 0]))
    with pytest.raises(TypeError, match="query_lengths"):  # (only the non-causal call has it)
        linattn.causal_linear_attention(q, q, q, query_lengths=np.array([6, 6]))


@pytest.mark.parametrize("causal", [True, False])
def test_attention_weights(rng, causal):
    """attention_weights with padded queries and keys (NaN there): the padding's rows and columns are
    0, the rest that of each sequence alone, and W @ v the attention call's output."""
    lead, n, nk = (3, 2), 7, 7 if causal else 9
    qlens, klens = (np.array([7, 3, 0]),) * 2 if causal else (np.array([7, 3, 0]), np.array([9, 2, 5]))
    q, k, v, qvalid, ql, kl = _padded(rng, lead, n, nk, 4, 3, qlens, klens, np.float64)
    kw = dict(lengths=klens) if causal else dict(lengths=klens, query_lengths=qlens)
    extra = dict(decay=0.9) if causal else {}
    w = linattn.attention_weights(q, k, causal=causal, **kw, **extra)
    assert w.shape == lead + (n, nk) and np.isfinite(w).all()
    np.testing.assert_array_equal(w[~qvalid], 0)
    for i in np.ndindex(lead):
        np.testing.assert_array_equal(w[i][:, kl[i]:], 0)
        alone = linattn.attention_weights(q[i][:ql[i]], k[i][:kl[i]], causal=causal, **extra)
        assert_close(w[i][:ql[i], :kl[i]], alone, np.float64)
    call = linattn.causal_linear_attention if causal else linattn.linear_attention
    assert_close(w @ np.nan_to_num(v), call(q, k, v, **kw, **extra), np.float64)


def test_attention_weights_errors(rng):
    q, k = (rng.standard_normal((2, m, 3)) for m in (6, 9))
    with pytest.raises(TypeError, match=r"query_lengths: only for causal=False"):
        linattn.attention_weights(q, q, query_lengths=np.array([6, 6]))
    with pytest.raises(ValueError, match=r"lengths: expected values in \[0, Nk=9\], got 10"):
        linattn.attention_weights(q, k, causal=False, lengths=np.array([10, 1]))
    with pytest.raises(ValueError, match=r"lengths: expected values in \[0, N=6\], got 7"):
        linattn.attention_weights(q, q, lengths=np.array([7, 1]))
    with pytest.raises(ValueError, match=r"query_lengths: expected shape \(2,\)"):
        linattn.attention_weights(q, k, causal=False, query_lengths=np.array([1, 1, 1]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lengths_take_the_short_path(rng, monkeypatch, dtype):
    """Lengths (causal; non-causal the keys' and the queries', shaped like the leading dims or their
    first) take the plain call's short path (the checked path, patched to fail, is not reached), NaN
    past them included: the same bits as the checked path (``device="cpu"``), the final state too, with
    a decay and a scale, into ``out=``; lengths the short path cannot take (a list, floats, out of
    range) go to the checked path, which says what is wrong."""
    from linattn import attention

    lead, n, d, dv = (3, 2), 70, 5, 4
    q, k, v, _, _, _ = _padded(rng, lead, n, n, d, dv, [70, 0, 33], [1, 64, 70], dtype)
    q = np.nan_to_num(q)  # (the causal form reads every query up to its length: NaN keys and values past it)
    runs = []
    for lens in (np.array([1, 64, 70]), np.array([[70, 31], [0, 2], [65, 64]], np.int32)):
        for fn, kw in ((linattn.causal_linear_attention, dict(lengths=lens)),
                       (linattn.causal_linear_attention, dict(lengths=lens, decay=0.9, scale=0.5)),
                       (linattn.linear_attention, dict(lengths=lens)),
                       (linattn.linear_attention, dict(lengths=lens, query_lengths=lens[::-1].copy(), scale=0.5))):
            want, want_state = fn(q, k, v, device="cpu", return_state=True, **kw)
            runs.append((fn, kw, want, want_state))
    with monkeypatch.context() as m:
        m.setattr(attention, "_prepare", lambda *a, **kw: pytest.fail("the general path"))
        for fn, kw, want, want_state in runs:
            np.testing.assert_array_equal(fn(q, k, v, **kw), want)
            out, state = fn(q, k, v, return_state=True, **kw)
            np.testing.assert_array_equal(out, want)
            np.testing.assert_array_equal(state.S, want_state.S)
            np.testing.assert_array_equal(state.Z, want_state.Z)
            buf = np.full(want.shape, np.nan, dtype)
            assert fn(q, k, v, out=buf, **kw) is buf
            np.testing.assert_array_equal(buf, want)
    assert np.isfinite(runs[0][2]).all() and not runs[0][2][0, :, 1:].any()  # (0 past the first length)
    want = linattn.causal_linear_attention(q, k, v, lengths=np.array([1, 64, 70]))
    np.testing.assert_array_equal(linattn.causal_linear_attention(q, k, v, lengths=[1, 64, 70]), want)
    for fn in (linattn.causal_linear_attention, linattn.linear_attention):
        with pytest.raises(ValueError, match=r"lengths: expected values in \[0, N(k)?=70\], got 71"):
            fn(q, k, v, lengths=np.array([1, 71, 3]))
        with pytest.raises(TypeError, match="lengths: expected an integer array, got dtype float64"):
            fn(q, k, v, lengths=np.array([1.0, 2.0, 3.0]))
        with pytest.raises(ValueError, match=r"lengths: expected shape \(3, 2\) .* got \(2,\)"):
            fn(q, k, v, lengths=np.array([1, 2]))
    with pytest.raises(ValueError, match=r"query_lengths: expected values in \[0, N=70\], got -1"):
        linattn.linear_attention(q, k, v, query_lengths=np.array([1, -1, 3]))
