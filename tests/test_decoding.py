"""step, State.zeros, lengths and attention_weights."""
import numpy as np
import pytest

import linattn
from linattn import attention, decoding, reference

from conftest import assert_close, make_qkv, rel_err


def _doubled(x):
    return np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], axis=-1) + 0.1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("feature_map", ["elu", "relu", "identity", _doubled])
@pytest.mark.parametrize("split", [0, 1, 33, 59])
def test_prefill_then_steps_equals_whole_call(rng, dtype, feature_map, split):
    n = 60
    q, k, v = make_qkv(rng, (2, 3), n, 8, 5, dtype)
    if feature_map in ("relu", "identity"):
        q, k = np.abs(q) + 0.1, np.abs(k) + 0.1
    kw = dict(feature_map=feature_map)
    full, st_full = linattn.causal_linear_attention(q, k, v, return_state=True, **kw)
    _, st = linattn.causal_linear_attention(q[..., :split, :], k[..., :split, :], v[..., :split, :],
                                            return_state=True, **kw)
    outs = [linattn.step(q[..., i, :], k[..., i, :], v[..., i, :], st, **kw) for i in range(split, n)]
    got = np.stack(outs, axis=-2)
    assert got.dtype == dtype
    assert rel_err(got, full[..., split:, :]) < (1e-5 if dtype == np.float32 else 1e-12)
    assert rel_err(st.S, st_full.S) < (1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("lead", [(), (3,), (2, 2, 2)])
def test_steps_from_zeros_equal_whole_call(rng, lead):
    q, k, v = make_qkv(rng, lead, 40, 6, 7, np.float32)
    st = linattn.State.zeros(lead, 6, 7)
    outs = [linattn.step(q[..., i, :], k[..., i, :], v[..., i, :], st) for i in range(40)]
    assert_close(np.stack(outs, axis=-2), reference.masked(q, k, v), np.float32)
    assert_close(st.S, reference.loop(q, k, v, return_state=True)[1][0], np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dv", [1, 7, 8, 15, 16, 17, 45, 64, 65, 80, 130])
@pytest.mark.parametrize("layout", ["contiguous", "unit rows", "strided rows"])
@pytest.mark.parametrize("normalize, eps", [(True, 1e-6), (True, 0.5), (False, 1e-6)])
def test_step_every_column_split(rng, dtype, dv, layout, normalize, eps):
    # The state pass takes panels of 4 vectors (64 float32 / 32 float64 columns), then single
    # vectors, then the last columns as one masked vector (the columns past the view, "unit rows",
    # stay unwritten); a state view without unit-stride rows takes plain loops.
    d = 5
    q, k, v = make_qkv(rng, (2, 3), 6, d, dv, dtype)
    big = np.zeros((2, 3, d, 2 * dv), dtype)
    S = {"contiguous": big[..., :dv].copy(), "unit rows": big[..., :dv], "strided rows": big[..., ::2]}[layout]
    st = linattn.State(S, np.zeros((2, 3, d), dtype))
    kw = dict(eps=eps, normalize=normalize)
    outs = [linattn.step(q[..., i, :], k[..., i, :], v[..., i, :], st, **kw) for i in range(6)]
    assert_close(np.stack(outs, axis=-2), reference.masked(q, k, v, **kw), dtype)
    _, (S, Z) = reference.loop(q, k, v, return_state=True)
    assert_close(st.S, S, dtype)
    assert_close(st.Z, Z, dtype)
    if layout == "unit rows":
        assert np.all(big[..., dv:] == 0)  # only the view was written


@pytest.mark.parametrize("lead", [(32, 8), (4, 8, 8), (2, 2, 8, 8)])  # (2 to 4 leading dims: each a head's view)
def test_step_parallel_batch_and_out(rng, lead):
    q, k, v = make_qkv(rng, lead, 3, 64, 64, np.float32)  # 256 heads of 64*64 elements: the parallel kernel
    st = linattn.State.zeros(lead, 64, 64)
    out = np.empty(lead + (64,), np.float32)
    for i in range(3):
        r = linattn.step(q[..., i, :], k[..., i, :], v[..., i, :], st, out=out)
        assert r is out
    assert_close(out, linattn.causal_linear_attention(q, k, v)[..., 2, :], np.float32)


def test_step_strided_inputs_and_state(rng):
    q, k, v = make_qkv(rng, (4, 3), 20, 5, 6, np.float32)
    ref = linattn.causal_linear_attention(q, k, v)
    big = np.zeros((4, 3, 8, 6), np.float32)  # S as a strided view into a bigger array
    st = linattn.State(big[:, :, 1:6, :], np.zeros((3, 4, 5), np.float32).transpose(1, 0, 2))
    for i in range(20):
        o = linattn.step(q[:, :, i, :], k[:, :, i, :], v[:, :, i, ::-1][..., ::-1], st)
    assert_close(o, ref[..., 19, :], np.float32)
    assert np.all(big[:, :, 0] == 0) and np.all(big[:, :, 6:] == 0)  # only the view was written


def _doubled_plus(x):  # a callable map: the checked path
    return np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], -1) + 0.1


@pytest.mark.parametrize("lead, d, dv", [((2, 3), 4, 8), ((2, 3), 64, 256), ((32, 8), 64, 64)])  # last: parallel
@pytest.mark.parametrize("feature_map", ["elu", _doubled_plus])
def test_step_inputs_sharing_memory_with_what_it_writes(rng, lead, d, dv, feature_map):
    """v or a gate in the memory of the state or of out (the same array or a shifted one: head h's
    out is head h + 1's v) steps as it would from a copy, taken before anything is written; out in
    the state's memory, or Z in S's, is a ValueError that leaves the state as it was."""
    q, k, v = (x[..., 0, :] for x in make_qkv(rng, lead, 1, d, dv, np.float32))
    d_ = 2 * d if feature_map is _doubled_plus else d

    def fresh():  # a state after one step, with negative Z (usable as log gates)
        st = linattn.State.zeros(lead, d_, dv)
        linattn.step(q, k, v * 0.5, st, feature_map=feature_map)
        st.Z[...] = -np.abs(st.Z) * 0.1
        return st

    def check(make_v, make_out=None, gate_of=None):
        st, st_ref = fresh(), fresh()
        vv = make_v(st)
        out = make_out(vv) if make_out else None
        gate = gate_of(st) if gate_of else None
        want = linattn.step(q, k, vv.copy(), st_ref, feature_map=feature_map,
                            gate=None if gate is None else gate.copy())
        got = linattn.step(q, k, vv, st, feature_map=feature_map, out=out, gate=gate)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(st.S, st_ref.S)
        np.testing.assert_array_equal(st.Z, st_ref.Z)
        assert out is None or got is out

    check(lambda st: v.copy(), lambda vv: vv)  # out is v
    flat = np.zeros((v.size // dv + 1, dv), np.float32)
    flat[:-1] = v.reshape(-1, dv)
    check(lambda st: flat[:-1].reshape(v.shape), lambda vv: flat[1:].reshape(v.shape))  # shifted by a head
    check(lambda st: st.S[..., 0, :])  # v is a row of S
    check(lambda st: v, gate_of=lambda st: st.Z[..., 0])  # a gate per sequence in Z
    if dv == d_:
        check(lambda st: st.Z)  # v is Z
    # head h's gates (one per key dimension) in head h - 1's Z (written before head h reads them, heads in turn)
    st, st_ref = fresh(), fresh()
    big = np.zeros(st.Z.size + d_, np.float32)
    big[d_:] = st.Z.reshape(-1)
    st = linattn.State(st.S, big[d_:].reshape(st.Z.shape))
    gate = big[:-d_].reshape(st.Z.shape)
    want = linattn.step(q, k, v, st_ref, feature_map=feature_map, gate=gate.copy())
    np.testing.assert_array_equal(linattn.step(q, k, v, st, feature_map=feature_map, gate=gate), want)
    np.testing.assert_array_equal(st.Z, st_ref.Z)
    st = fresh()
    S0, Z0 = st.S.copy(), st.Z.copy()
    with pytest.raises(ValueError, match=r"out: expected memory apart from state.S"):
        linattn.step(q, k, v, st, out=st.S[..., 0, :], feature_map=feature_map)
    with pytest.raises(ValueError, match=r"out: expected memory apart from state.S"):
        linattn.step(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), st,
                     out=st.S.view(np.float16)[..., 0, :dv], feature_map=feature_map)
    if dv == d_:
        with pytest.raises(ValueError, match=r"out: expected memory apart from state.Z"):
            linattn.step(q, k, v, st, out=st.Z, feature_map=feature_map)
    with pytest.raises(ValueError, match=r"state.Z: expected memory apart from state.S"):
        linattn.step(q, k, v, linattn.State(st.S, st.S[..., 0]), feature_map=feature_map)
    np.testing.assert_array_equal(st.S, S0)
    np.testing.assert_array_equal(st.Z, Z0)


def test_step_float16_and_ints(rng):
    q, k, v = make_qkv(rng, (2,), 5, 4, 3, np.float64)
    st = linattn.State.zeros((2,), 4, 3, np.float32)
    o = linattn.step(q[:, 0].astype(np.float16), k[:, 0].astype(np.float16), v[:, 0].astype(np.float16), st)
    assert o.dtype == np.float16
    st64 = linattn.State.zeros((2,), 4, 3, np.float64)
    assert linattn.step(np.ones((2, 4), int), np.ones((2, 4), int), np.ones((2, 3), int), st64).dtype == np.float64


@pytest.mark.parametrize("lead", [(2, 3), (4, 8)])  # 24 values (NumPy's conversions), 256 x 8 (compiled ones)
def test_step_float16_equals_float32_rounded(rng, lead):
    """float16 q, k, v (and gate) step as the same values in float32 would, the result rounded to
    float16, with and without ``out``; the state is float32 and ends the same."""
    d = 256 if lead == (4, 8) else 4
    q, k, v = (x[..., 0, :].astype(np.float16) for x in make_qkv(rng, lead, 1, d, d, np.float32))
    gate = (-rng.random(lead + (d,)) * 0.1).astype(np.float16)
    st16, st32 = linattn.State.zeros(lead, d, d), linattn.State.zeros(lead, d, d)
    out = np.empty(lead + (d,), np.float16)
    for i in range(3):
        got = linattn.step(q, k, v, st16, gate=gate, decay=0.9, out=out if i else None)
        want = linattn.step(*(x.astype(np.float32) for x in (q, k, v)), st32, gate=gate.astype(np.float32), decay=0.9)
        assert got.dtype == np.float16 and (got is out) == bool(i)
        np.testing.assert_array_equal(got, want.astype(np.float16))
        np.testing.assert_array_equal(st16.S, st32.S)
    with pytest.raises(ValueError, match="out"):
        linattn.step(q, k, v, st16, out=np.empty(lead + (d,), np.float32))
    with pytest.raises(TypeError, match="state.S: expected dtype float32"):
        linattn.step(q, k, v, linattn.State.zeros(lead, d, d, np.float64))


def test_step_errors(rng):
    q, k, v = make_qkv(rng, (2,), 1, 4, 3)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]
    st = linattn.State.zeros((2,), 4, 3)
    with pytest.raises(ValueError, match=r"state.S: expected shape \(2, 4, 3\)"):
        linattn.step(q, k, v, linattn.State.zeros((3,), 4, 3))
    with pytest.raises(ValueError, match=r"state.S: expected shape \(2, 4, 3\) .*D'=4, Dv=3"):
        linattn.step(q, k, v, linattn.State.zeros((2,), 5, 3))
    with pytest.raises(TypeError, match="state.S: expected dtype float32"):
        linattn.step(q, k, v, linattn.State.zeros((2,), 4, 3, np.float64))
    with pytest.raises(TypeError, match="state: expected a linattn.State"):
        linattn.step(q, k, v, st.S)
    ro = linattn.State(st.S.copy(), st.Z.copy())
    ro.S.setflags(write=False)
    with pytest.raises(ValueError, match="state.S: expected a writable NumPy array"):
        linattn.step(q, k, v, ro)
    with pytest.raises(ValueError, match=r"k: expected leading dimensions \(2,\)"):
        linattn.step(q, k[:1], v, st)
    with pytest.raises(ValueError, match="k: expected feature dimension D=4"):
        linattn.step(q, k[:, :3], v, st)
    with pytest.raises(ValueError, match=r"q: expected at least 1 dimensions"):
        linattn.step(np.float32(1), k, v, st)
    with pytest.raises(ValueError, match=r"out: expected an ndarray of shape \(2, 3\) and dtype float32"):
        linattn.step(q, k, v, st, out=np.empty((2, 4), np.float32))
    with pytest.raises(ValueError, match=r"out: expected an ndarray .* dtype float32"):
        linattn.step(q, k, v, st, out=np.empty((2, 3), np.float64))
    with pytest.raises(ValueError, match="eps: expected a finite number >= 0"):
        linattn.step(q, k, v, st, eps=-1.0)
    with pytest.raises(ValueError, match="feature_map: unknown name"):
        linattn.step(q, k, v, st, feature_map="tanh")
    with pytest.raises(TypeError, match="normalize: expected True or False"):
        linattn.step(q, k, v, st, normalize=None)
    with pytest.raises(TypeError, match="q: expected a real floating or integer array"):
        linattn.step(q.astype(complex), k, v, st)
    np.testing.assert_array_equal(st.S, 0)  # nothing above touched the state


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lengths(rng, dtype):
    B, H, N, D, Dv = 3, 2, 70, 5, 4
    q, k, v = make_qkv(rng, (B, H), N, D, Dv, dtype)
    lengths = np.array([70, 33, 0])
    out, st = linattn.causal_linear_attention(q, k, v, lengths=lengths, return_state=True)
    for b, L in enumerate(lengths):
        ref, st_ref = linattn.causal_linear_attention(q[b, :, :L], k[b, :, :L], v[b, :, :L], return_state=True)
        assert_close(out[b, :, :L], ref, dtype)
        np.testing.assert_array_equal(out[b, :, L:], 0)
        assert_close(st.S[b], st_ref.S, dtype)
        assert_close(st.Z[b], st_ref.Z, dtype)
    # per-head lengths, and continuing each sequence with step from its own state
    lh = np.array([[5, 70], [1, 2], [69, 0]])
    out2, st2 = linattn.causal_linear_attention(q, k, v, lengths=lh, return_state=True)
    for b in range(B):
        for h in range(H):
            L = lh[b, h]
            assert_close(out2[b, h, :L], reference.masked(q[b, h, :L], k[b, h, :L], v[b, h, :L]), dtype)
    nxt = linattn.step(q[:, :, 0], k[:, :, 0], v[:, :, 0], st2)
    assert np.isfinite(nxt).all()


def test_lengths_errors(rng):
    q, k, v = make_qkv(rng, (2, 3), 10, 4, 4)
    for bad in ([11, 3], [-1, 3]):
        with pytest.raises(ValueError, match=r"lengths: expected values in \[0, N=10\]"):
            linattn.causal_linear_attention(q, k, v, lengths=np.array(bad))
    with pytest.raises(ValueError, match=r"lengths: expected shape \(2, 3\) .* got \(3,\)"):
        linattn.causal_linear_attention(q, k, v, lengths=np.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"lengths: expected shape"):
        linattn.causal_linear_attention(q, k, v, lengths=5)
    with pytest.raises(TypeError, match="lengths: expected an integer array, got dtype float64"):
        linattn.causal_linear_attention(q, k, v, lengths=np.array([1.0, 2.0]))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("feature_map", ["elu", "relu", _doubled])
def test_attention_weights(rng, causal, feature_map):
    q, k, v = make_qkv(rng, (2, 2), 12, 4, 3, np.float64)
    if feature_map == "relu":
        q, k = np.abs(q) + 0.1, np.abs(k) + 0.1
    w = linattn.attention_weights(q, k, causal=causal, feature_map=feature_map, eps=0.0)
    assert w.shape == (2, 2, 12, 12)
    np.testing.assert_allclose(w.sum(-1), 1, rtol=1e-12)
    if causal:
        assert np.all(np.triu(w, 1) == 0)
    fn = linattn.causal_linear_attention if causal else linattn.linear_attention
    np.testing.assert_allclose(w @ v, fn(q, k, v, feature_map=feature_map, eps=0.0), rtol=1e-10)
    w32 = linattn.attention_weights(q.astype(np.float32), k.astype(np.float32), causal=causal,
                                    feature_map=feature_map)
    assert w32.dtype == np.float32


def test_attention_weights_errors(rng):
    q, k, _ = make_qkv(rng, (2,), 5, 3, 3)
    with pytest.raises(ValueError, match="k: expected leading dimensions and D like q"):
        linattn.attention_weights(q, k[..., :2])
    with pytest.raises(TypeError, match="causal: expected True or False"):
        linattn.attention_weights(q, k, causal="yes")
    with pytest.raises(ValueError, match="feature_map: unknown name"):
        linattn.attention_weights(q, k, feature_map="x")


def _position_options(rng, lead, n, d, dv, dtype):
    """The few-position tests' draws: (options, D', q, k, v) for maps, normalize, scale, decay, and gates per
    position and per key dimension (q and k positive with the identity map: denominators away from 0)."""
    T2R = linattn.feature_maps.T2R(rng.standard_normal((d, 4)), rng.standard_normal(4))
    for kw in (dict(), dict(feature_map="relu", normalize=False), dict(feature_map=T2R, scale=0.5),
               dict(decay=0.9), dict(gate="position"), dict(gate="dimension", feature_map="identity", eps=0.5)):
        dk = linattn.feature_maps.as_map(kw.get("feature_map", "elu")).out_dim(d)
        if "gate" in kw:
            kw["gate"] = np.log(rng.uniform(0.5, 1.0, lead + ((n,) if kw["gate"] == "position" else (n, dk)))).astype(
                dtype)
        q, k = (rng.standard_normal(lead + (n, d)).astype(dtype) for _ in range(2))
        if kw.get("feature_map") == "identity":
            q, k = np.abs(q), np.abs(k)
        yield kw, dk, q, k, rng.standard_normal(lead + (n, dv)).astype(dtype)


def _stepped(q, k, v, state, kw):
    """``step`` position after position (..., N, D) on ``state`` (updated in place), with the options ``kw`` (a
    gate's position taken at each step): the outputs, (..., N, Dv)."""
    one = {x: kw[x] for x in kw if x != "gate"}
    gate = kw.get("gate")
    per_dim = gate is not None and gate.ndim == q.ndim
    return np.stack([linattn.step(q[..., t, :], k[..., t, :], v[..., t, :], state, **one, **(
        {} if gate is None else {"gate": gate[..., t, :] if per_dim else gate[..., t]})) for t in range(q.shape[-2])],
        axis=-2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, attention.FEW_POSITIONS])
@pytest.mark.parametrize("lead", [(), (3,), (2, 3), (8, 8)])  # (8, 8) at D = Dv = 64: the parallel step
def test_causal_call_of_few_positions_from_a_state(rng, lead, n, dtype, monkeypatch):
    """causal_linear_attention of a few positions from a state (a decoding loop that does not call step,
    a check of a few drafted tokens) takes step's kernel, in one call for all positions, into a new state:
    the general path's result and state (the same call with device="cpu" takes that path), and bit for bit
    what ``step`` gives position after position, the initial state left as it was; with maps, decay, gates
    per position and per key dimension, scale and normalize; bad gate values (at the last position) still
    raise the call's error."""
    steps = []
    monkeypatch.setattr(attention, "step_fast", lambda *a: steps.append(1) or decoding.step_fast(*a))
    d, dv = (64, 64) if lead == (8, 8) else (5, 3)
    for kw, dk, q, k, v in _position_options(rng, lead, n, d, dv, dtype):
        S, Z = (rng.random(lead + (dk, dv)) * 0.5).astype(dtype), (rng.random(lead + (dk,)) + 0.5).astype(dtype)
        state = linattn.State(S.copy(), Z.copy())
        steps.clear()
        out, new = linattn.causal_linear_attention(q, k, v, initial_state=state, return_state=True, **kw)
        assert len(steps) == 1  # (the short path, every position in one call)
        want, want_state = linattn.causal_linear_attention(q, k, v, initial_state=state, return_state=True,
                                                           device="cpu", **kw)  # (general)
        assert out.shape == lead + (n, dv) and out.dtype == dtype
        assert_close(out, want, dtype)
        assert_close(new.S, want_state.S, dtype)
        assert_close(new.Z, want_state.Z, dtype)
        stepped = linattn.State(S.copy(), Z.copy())
        np.testing.assert_array_equal(out, _stepped(q, k, v, stepped, kw))
        np.testing.assert_array_equal(new.S, stepped.S)
        np.testing.assert_array_equal(new.Z, stepped.Z)
        np.testing.assert_array_equal(state.S, S)  # (the initial state as it was)
        np.testing.assert_array_equal(state.Z, Z)
        np.testing.assert_array_equal(linattn.causal_linear_attention(q, k, v, initial_state=state, **kw), out)
        buf = np.full(lead + (dv, n + 1), np.nan, dtype)  # out= a strided view: the same values
        res = linattn.causal_linear_attention(q, k, v, initial_state=state, out=np.swapaxes(buf, -1, -2)[..., :n, :],
                                              **kw)
        assert np.shares_memory(res, buf)
        np.testing.assert_array_equal(res, out)
    bad = np.zeros(lead + (n,), dtype)
    bad[..., -1] = 0.5
    with pytest.raises(ValueError, match=r"gate: expected log gates <= 0"):
        linattn.causal_linear_attention(q, k, v, initial_state=state, gate=bad)
    np.testing.assert_array_equal(state.S, S)
    with pytest.raises(ValueError, match=r"^k: "):  # (k of another length)
        linattn.causal_linear_attention(q, np.concatenate([k, k], -2), v, initial_state=state)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", list(range(1, attention.FRESH_POSITIONS + 2)))
@pytest.mark.parametrize("lead", [(), (3,), (2, 3), (8, 8)])  # (8, 8) at D = Dv = 64: the parallel step
def test_causal_call_of_few_positions_with_no_state(rng, lead, n, dtype, monkeypatch):
    """A causal call of at most FRESH_POSITIONS positions, no initial state (a short prompt) and a state of at most
    FRESH_STATE_BYTES runs step's kernel from a zero state (a broadcast row of zeros), in one call for all
    positions, else the chunkwise kernel: the reference's result and state (reference.loop, float64), bit for
    bit what ``step`` gives position after position from ``State.zeros``, the same result with the state
    returned or not and into ``out=`` (a strided view); with maps, decay, gates per position and per key
    dimension, scale and normalize. One position more takes the chunkwise kernel; a callable map and ``lengths``
    the general path."""
    steps = []
    monkeypatch.setattr(attention, "step_fast", lambda *a: steps.append(1) or decoding.step_fast(*a))
    d, dv = (64, 64) if lead == (8, 8) else (5, 3)
    comp = np.float32 if dtype == np.float16 else dtype
    for kw, dk, q, k, v in _position_options(rng, lead, n, d, dv, dtype):
        steps.clear()
        out, new = linattn.causal_linear_attention(q, k, v, return_state=True, **kw)
        fresh = n <= attention.FRESH_POSITIONS and np.prod(lead) * dk * dv * np.dtype(comp).itemsize <= (
            attention.FRESH_STATE_BYTES)  # ((8, 8) in float64, 2 MB: the chunkwise kernel)
        assert len(steps) == fresh  # (the short path, every position in one call)
        assert out.shape == lead + (n, dv) and out.dtype == dtype and new.S.dtype == comp
        assert new.S.flags.writeable and new.Z.flags.writeable  # (a state of its own, for the steps to come)
        ref, (S_ref, Z_ref) = linattn.reference.loop(q, k, v, return_state=True, **kw)
        assert_close(out, ref, dtype)
        assert_close(new.S, S_ref, comp)
        assert_close(new.Z, Z_ref, comp)
        np.testing.assert_array_equal(linattn.causal_linear_attention(q, k, v, **kw), out)
        buf = np.full(lead + (dv, n + 1), np.nan, dtype)  # out= a strided view: the same values
        res = linattn.causal_linear_attention(q, k, v, out=np.swapaxes(buf, -1, -2)[..., :n, :], **kw)
        assert np.shares_memory(res, buf)
        np.testing.assert_array_equal(res, out)
        if not fresh:
            continue
        stepped = linattn.State.zeros(lead, dk, dv, comp)
        np.testing.assert_array_equal(out, _stepped(q, k, v, stepped, kw))
        np.testing.assert_array_equal(new.S, stepped.S)
        np.testing.assert_array_equal(new.Z, stepped.Z)
    steps.clear()  # (a callable map, lengths: the general path, the same result)
    q, k, v = make_qkv(rng, lead, n, d, dv, dtype)

    def shifted(x):
        return np.maximum(x, 0) + 1

    assert_close(linattn.causal_linear_attention(q, k, v, feature_map=shifted),
                 linattn.reference.masked(q, k, v, feature_map=shifted), dtype)
    lens = np.full(lead[:1], n) if lead else None
    if lens is not None:
        np.testing.assert_array_equal(linattn.causal_linear_attention(q, k, v, lengths=lens),
                                      linattn.causal_linear_attention(q, k, v, device="cpu"))
    assert not steps


@pytest.mark.parametrize("layout", ["rows apart", "read-only", "broadcast", "columns apart"])
@pytest.mark.parametrize("n", [1, 3])
def test_few_positions_read_the_state_in_place(rng, n, layout, monkeypatch):
    """The short path's first step reads the given state where it is, in any layout with rows of adjacent
    elements (rows apart, read-only, heads broadcast), and writes the new one elsewhere: the general path's
    result and a C-contiguous state of its own, the given one as it was. A state whose rows are not adjacent
    elements takes the general path, with the same result."""
    steps = []
    monkeypatch.setattr(attention, "step_fast", lambda *a: steps.append(a[11]) or decoding.step_fast(*a))
    lead, d, dv = (2, 3), 5, 7
    q, k, v = make_qkv(rng, lead, n, d, dv)
    S, Z = (rng.random(lead + (d, dv)) * 0.5).astype(np.float32), (rng.random(lead + (d,)) + 0.5).astype(np.float32)
    if layout == "rows apart":
        S = np.concatenate([S, np.full_like(S, np.nan)], -1)[..., :dv]
        Z = np.concatenate([Z, np.full_like(Z, np.nan)], -1)[..., :d]
    elif layout == "read-only":
        S.flags.writeable = Z.flags.writeable = False
    elif layout == "broadcast":
        S, Z = np.broadcast_to(S[:1], S.shape), np.broadcast_to(Z[:1], Z.shape)
    else:
        S = np.swapaxes(np.ascontiguousarray(np.swapaxes(S, -1, -2)), -1, -2)
    S_was, Z_was = S.copy(), Z.copy()
    state = linattn.State(S, Z)
    out, new = linattn.causal_linear_attention(q, k, v, initial_state=state, return_state=True)
    want, want_state = linattn.causal_linear_attention(q, k, v, initial_state=state, return_state=True,
                                                       device="cpu")  # (general)
    assert steps == [state]  # (the source of the one call: all positions, or declined for "columns apart")
    assert_close(out, want, np.float32)
    assert_close(new.S, want_state.S, np.float32)
    assert_close(new.Z, want_state.Z, np.float32)
    assert new.S.flags.c_contiguous and new.Z.flags.c_contiguous and new.S.flags.writeable
    assert not np.shares_memory(new.S, S) and not np.shares_memory(new.Z, Z)
    np.testing.assert_array_equal(S, S_was)
    np.testing.assert_array_equal(Z, Z_was)


@pytest.mark.parametrize("n", [1, 3])
def test_few_positions_from_a_state_in_float16(rng, n, monkeypatch):
    """float16 q, k and v from a (float32) State take the short path too, computed in float32: the float32
    call's result rounded to float16 once, and its new state; a float16 gate as its float32 value; ``out`` of
    float16; the general path's result within float16's tolerance."""
    steps = []
    monkeypatch.setattr(attention, "step_fast", lambda *a: steps.append(1) or decoding.step_fast(*a))
    lead, d, dv = (2, 3), 5, 7
    q, k, v = (rng.standard_normal(lead + (n, x)).astype(np.float16) for x in (d, d, dv))
    wide = tuple(x.astype(np.float32) for x in (q, k, v))
    gate = np.log(rng.uniform(0.5, 1.0, lead + (n,))).astype(np.float16)
    state = linattn.State((rng.random(lead + (d, dv)) * 0.5).astype(np.float32),
                          (rng.random(lead + (d,)) + 0.5).astype(np.float32))
    for kw, wide_kw in ((dict(), dict()), (dict(gate=gate), dict(gate=gate.astype(np.float32))),
                        (dict(decay=0.9), dict(decay=0.9))):
        steps.clear()
        out, new = linattn.causal_linear_attention(q, k, v, initial_state=state, return_state=True, **kw)
        assert len(steps) == 1 and out.dtype == np.float16 and new.S.dtype == np.float32
        want, want_state = linattn.causal_linear_attention(*wide, initial_state=state, return_state=True, **wide_kw)
        np.testing.assert_array_equal(out, want.astype(np.float16))
        np.testing.assert_array_equal(new.S, want_state.S)
        np.testing.assert_array_equal(new.Z, want_state.Z)
        general = linattn.causal_linear_attention(q, k, v, initial_state=state, device="cpu", **kw)
        assert general.dtype == np.float16
        assert_close(out, general, np.float16)
        buf = np.full(lead + (n, dv), np.nan, np.float16)
        assert linattn.causal_linear_attention(q, k, v, initial_state=state, out=buf, **kw) is buf
        np.testing.assert_array_equal(buf, out)
    with pytest.raises(TypeError, match=r"^initial_state.S: expected dtype float32"):  # (a float16 state)
        linattn.causal_linear_attention(q, k, v, initial_state=linattn.State(*(x.astype(np.float16) for x in state)))


@pytest.mark.parametrize("d, dv", [(5, 3), (64, 64), (33, 17)])
def test_step_from_a_source_is_the_same_wherever_the_arrays_lie(rng, d, dv):
    """The step that reads the old state from other arrays (the short path's first position) gives the
    in-place step's result and state bit for bit, wherever the new state lies from the old: just after it,
    just before, or far away (the sum q.Z once took another order when the arrays were close, so results
    hung on where malloc put them)."""
    size = d * dv + d
    for _ in range(40):  # (a different order of the sum shows in the last bit of some draws: 4% at D 5)
        q, k = rng.standard_normal((2, d)).astype(np.float32)
        v = rng.standard_normal(dv).astype(np.float32)
        S, Z = (rng.random((d, dv)) * 0.5).astype(np.float32), (rng.random(d) + 0.5).astype(np.float32)
        inplace = linattn.State(S.copy(), Z.copy())
        want = decoding.step_fast(q, k, v, inplace, "elu", 1e-6, True, None, None, None, None)
        for gap in (-3 * size, -size, size, size + 1, size + 7, 3 * size):
            buf = np.full(8 * size, np.nan, np.float32)
            at = 4 * size
            source = linattn.State(buf[at:at + d * dv].reshape(d, dv), buf[at + d * dv:at + size])
            source.S[...], source.Z[...] = S, Z
            at += gap
            new = linattn.State(buf[at:at + d * dv].reshape(d, dv), buf[at + d * dv:at + size])
            got = decoding.step_fast(q, k, v, new, "elu", 1e-6, True, None, None, None, None, source)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(new.S, inplace.S)
            np.testing.assert_array_equal(new.Z, inplace.Z)
            np.testing.assert_array_equal(source.S, S)  # (only read)
    overlapping = linattn.State(*(x.copy() for x in source))
    assert decoding.step_fast(q, k, v, linattn.State(overlapping.S, overlapping.Z), "elu", 1e-6, True, None, None,
                              None, None, linattn.State(overlapping.S[::-1], overlapping.Z)) is None


def test_more_positions_from_a_state_take_the_chunkwise_kernel(rng, monkeypatch):
    """Past FEW_POSITIONS positions a call from a state takes the chunkwise kernel (step's is slower there),
    through the short path; up to it, step's kernel, on two threads too (its heads in parallel)."""
    steps = []
    monkeypatch.setattr(attention, "step_fast", lambda *a: steps.append(1) or decoding.step_fast(*a))
    state = linattn.State.zeros((2,), 4, 3)
    q = rng.standard_normal((2, attention.FEW_POSITIONS + 1, 4)).astype(np.float32)
    v = np.ascontiguousarray(q[..., :3])
    monkeypatch.setattr(attention, "_prepare", lambda *a, **k: pytest.fail("the checked path"))  # (the short one)
    linattn.causal_linear_attention(q, q, v, initial_state=state)
    assert not steps
    q, v = np.ascontiguousarray(q[:, :2]), np.ascontiguousarray(v[:, :2])
    want = linattn.causal_linear_attention(q, q, v, initial_state=state)
    assert len(steps) == 1
    monkeypatch.setattr(attention, "num_threads", lambda: 2)
    np.testing.assert_array_equal(linattn.causal_linear_attention(q, q, v, initial_state=state), want)
    assert len(steps) == 2


_PLAIN, _GATED, _PER_DIM, _TAYLOR = dict(), dict(decay=0.8, gate="position"), dict(gate="dimension"), dict(
    feature_map=linattn.feature_maps.Taylor())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lead, n, d, dv, options", [
    ((), 1, 5, 3, (_PLAIN,)), ((3,), 24, 5, 7, (_PLAIN, _GATED, _PER_DIM, _TAYLOR)), ((2, 3), 17, 1, 4, (_PER_DIM,)),
    ((8, 8), 9, 64, 64, (_PLAIN, _GATED)), ((2, 4, 4), 3, 64, 64, (_PLAIN,))])
def test_positions_kernel_against_the_reference(rng, dtype, lead, n, d, dv, options):
    """step's positions variant (decoding.step_fast(..., positions=True): each head's N positions one after
    the other, its state in the cache) against the masked O(N^2) float64 reference from the state (the new
    state against reference.loop's), for any N (the sequence function sends it up to FEW_POSITIONS), 0 to 3
    leading dims, D = 1 and D != Dv, serial and parallel (8 x 8 and 2 x 4 x 4 heads of 64 x 64), in place and
    from a source; with a decay, a gate
    per position and per key dimension, and a map of cpu/mapfns.py (Taylor's, whose D' > D)."""
    q, k, v = make_qkv(rng, lead, n, d, dv, dtype)
    for kw in (dict(x) for x in options):
        fm = kw.get("feature_map", "elu")
        dk = linattn.feature_maps.as_map(fm).out_dim(d)
        if "gate" in kw:
            kw["gate"] = np.log(rng.uniform(0.5, 1.0, lead + ((n,) if kw["gate"] == "position" else (n, dk)))).astype(
                dtype)
        S0 = (rng.random(lead + (dk, dv)) * 0.5).astype(dtype)
        Z0 = (rng.random(lead + (dk,)) + 0.5).astype(dtype)
        wide = dict(feature_map=fm, decay=kw.get("decay"), initial_state=(S0.astype(np.float64), Z0.astype(np.float64)),
                    gate=None if "gate" not in kw else kw["gate"].astype(np.float64))
        q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
        want = reference.masked(q64, k64, v64, **wide)
        want_state = reference.loop(q64, k64, v64, return_state=True, **wide)[1]
        for source in (False, True):
            state = linattn.State(S0.copy(), Z0.copy())
            new = linattn.State(np.full_like(S0, np.nan), np.full_like(Z0, np.nan)) if source else state
            out = decoding.step_fast(q, k, v, new, fm, 1e-6, True, kw.get("decay"), kw.get("gate"), None, None,
                                     state if source else None, True)
            assert out is not None and out.shape == lead + (n, dv) and out.dtype == dtype
            assert_close(out, want, dtype)
            assert_close(new.S, want_state[0], dtype)
            assert_close(new.Z, want_state[1], dtype)
            if source:
                np.testing.assert_array_equal(state.S, S0)
                np.testing.assert_array_equal(state.Z, Z0)
