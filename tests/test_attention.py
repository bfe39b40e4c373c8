"""causal_linear_attention and linear_attention against the float64 O(N^2) reference."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn
from linattn import attention, reference
from linattn.cpu import chunked
from linattn.cpu.runtime import chunk_size

from conftest import assert_close, cancellation, causal_results, make_qkv, rel_err

LEADS = [(), (1,), (2, 3)]
SIZES = [1, 63, 65, 1000]
DIMS = [(1, 1), (16, 8), (5, 33)]
DTYPES = [np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,dv", DIMS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("lead", LEADS)
def test_against_reference(rng, lead, n, d, dv, dtype):
    q, k, v = make_qkv(rng, lead, n, d, dv, dtype)
    out = linattn.causal_linear_attention(q, k, v)
    assert out.shape == lead + (n, dv) and out.dtype == dtype
    assert_close(out, reference.masked(q, k, v), dtype)
    out = linattn.linear_attention(q, k, v)
    assert out.shape == lead + (n, dv) and out.dtype == dtype
    assert_close(out, reference.masked(q, k, v, causal=False), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [3, 4, 8, 9, 13, 20])
@pytest.mark.parametrize("n", [8, 33, 70])
def test_key_transpose_edges(rng, n, d, dtype):
    # phi(K)^T is built from blocks of 8 (float32) / 4 (float64) rows and columns, then the edges.
    q, k, v = make_qkv(rng, (2,), n, d, 6, dtype)
    out, state = linattn.causal_linear_attention(q, k, v, return_state=True)
    ref, (S, Z) = reference.loop(q, k, v, return_state=True)
    assert_close(out, ref, dtype)
    assert_close(state.S, S, dtype)
    assert_close(state.Z, Z, dtype)
    lengths = np.array([n, n // 2 + 1])  # a last chunk cut short
    out, state = linattn.causal_linear_attention(q, k, v, lengths=lengths, return_state=True)
    m = lengths[1]
    ref, (S, Z) = reference.loop(q[1, :m], k[1, :m], v[1, :m], return_state=True)
    assert_close(out[1, :m], ref, dtype)
    assert_close(state.Z[1], Z, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_textbook_loop(rng, dtype):
    q, k, v = make_qkv(rng, (2, 2), 70, 6, 4, dtype)
    assert_close(linattn.causal_linear_attention(q, k, v), reference.loop(q, k, v), dtype)


def _doubled_elu(x):
    """A feature map with D' = 2D: [elu(x)+1, elu(-x)+1]."""
    return np.concatenate([np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))),
                           np.where(x < 0, 1 - x, np.exp(np.minimum(-x, 0)))], axis=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature_map", ["relu", "identity", _doubled_elu, np.abs])
def test_feature_maps(rng, feature_map, dtype):
    q, k, v = make_qkv(rng, (3,), 100, 7, 5, dtype)
    if feature_map == "identity":  # positive inputs keep the denominators away from zero
        q, k = np.abs(q) + 0.1, np.abs(k) + 0.1
    for normalize in (True, False):
        kw = dict(feature_map=feature_map, normalize=normalize)
        assert_close(linattn.causal_linear_attention(q, k, v, **kw), reference.masked(q, k, v, **kw), dtype)
        assert_close(linattn.linear_attention(q, k, v, **kw),
                     reference.masked(q, k, v, causal=False, **kw), dtype)


def test_relu_all_negative_gives_zero_not_nan(rng):
    q, k, v = make_qkv(rng, (), 40, 4, 3)
    out = linattn.causal_linear_attention(-np.abs(q), -np.abs(k), v, feature_map="relu")
    np.testing.assert_array_equal(out, 0)


def test_elu_extremes():
    x = np.array([[-1e4, -100.0, -87.0, -20.0, -1e-30, 0.0, 1e-30, 30.0, 1e30]], np.float32).T
    for dtype in DTYPES:
        q = np.zeros((x.shape[0], 1), dtype)  # phi(0) = 1
        out = linattn.causal_linear_attention(q, x.astype(dtype), np.ones_like(q), normalize=False)
        phi = np.where(x > 0, x.astype(np.float64) + 1, np.exp(np.minimum(x, 0).astype(np.float64)))
        np.testing.assert_allclose(out[:, 0], np.cumsum(phi[:, 0]), rtol=3e-7, atol=1e-37)


def test_normalize_and_eps(rng):
    q, k, v = make_qkv(rng, (2,), 50, 4, 4, np.float64)
    for eps in (0.0, 1e-6, 3.5):
        assert_close(linattn.causal_linear_attention(q, k, v, eps=eps),
                     reference.masked(q, k, v, eps=eps), np.float64)


@pytest.mark.parametrize("causal", [True, False])
def test_views_and_strides(rng, causal):
    fn = linattn.causal_linear_attention if causal else linattn.linear_attention
    base = rng.standard_normal((2, 90, 3, 40)).astype(np.float32)  # (B, N, H, 40)
    q = base[..., :16].transpose(0, 2, 1, 3)  # (B, H, N, 16), heads and a column slice
    k = base[:, ::-1, :, 16:32].transpose(0, 2, 1, 3)  # negative stride along N
    v = np.asfortranarray(base[..., 32:].transpose(0, 2, 1, 3))  # Fortran order
    ref = fn(*(np.ascontiguousarray(x) for x in (q, k, v)))
    out = fn(q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    ro = [np.ascontiguousarray(x) for x in (q, k, v)]
    for x in ro:
        x.setflags(write=False)
    np.testing.assert_allclose(fn(*ro), ref, rtol=1e-5, atol=1e-6)
    bq = np.broadcast_to(q[:1], q.shape)  # zero strides along the batch
    np.testing.assert_allclose(fn(bq, k, v), fn(np.ascontiguousarray(bq), k, v), rtol=1e-5, atol=1e-6)


def test_dtypes(rng):
    q, k, v = make_qkv(rng, (2,), 40, 4, 3, np.float64)
    for dtype in (np.float16, np.float32):
        out = linattn.causal_linear_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype))
        assert out.dtype == dtype
        ref = reference.masked(*(x.astype(dtype) for x in (q, k, v)))
        assert rel_err(out, ref) < (2e-3 if dtype == np.float16 else 2e-5)
    qi, ki, vi = (np.round(x * 3).astype(np.int32) for x in (q, k, v))
    out = linattn.causal_linear_attention(qi, ki, vi)
    assert out.dtype == np.float64
    assert_close(out, reference.masked(qi, ki, vi), np.float64)
    out = linattn.causal_linear_attention(q.astype(np.float32), k, v.astype(np.float16))
    assert out.dtype == np.float64  # mixed dtypes promote as NumPy does
    out = linattn.linear_attention(q.tolist(), k.tolist(), v.tolist())  # nested lists work too
    assert_close(out, reference.masked(q, k, v, causal=False), np.float64)


def test_empty(rng):
    q, k, v = make_qkv(rng, (2, 3), 0, 4, 5)
    out, st = linattn.causal_linear_attention(q, k, v, return_state=True)
    assert out.shape == (2, 3, 0, 5) and out.dtype == np.float32
    np.testing.assert_array_equal(st.S, 0)
    assert st.S.shape == (2, 3, 4, 5) and st.Z.shape == (2, 3, 4)
    init = linattn.State(np.ones((2, 3, 4, 5), np.float32), np.ones((2, 3, 4), np.float32))
    _, st2 = linattn.causal_linear_attention(q, k, v, initial_state=init, return_state=True)
    np.testing.assert_array_equal(st2.S, 1)
    assert linattn.linear_attention(q, k, v).shape == (2, 3, 0, 5)
    q, k, v = make_qkv(rng, (0, 3), 7, 4, 5)
    assert linattn.causal_linear_attention(q, k, v).shape == (0, 3, 7, 5)
    assert linattn.linear_attention(q, k, v).shape == (0, 3, 7, 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature_map", ["elu", "relu", _doubled_elu])
def test_split_and_resume(rng, dtype, feature_map):
    q, k, v = make_qkv(rng, (2, 2), 150, 5, 7, dtype)
    if feature_map == "relu":
        q, k = q + 0.3, k + 0.3
    kw = dict(feature_map=feature_map)
    full, st_full = linattn.causal_linear_attention(q, k, v, return_state=True, **kw)
    _, (S_ref, Z_ref) = reference.loop(q, k, v, return_state=True, **kw)
    assert_close(st_full.S, S_ref, dtype)
    assert_close(st_full.Z, Z_ref, dtype)
    for cuts in ([0], [1], [31, 32, 33], [64, 100], [149], [150]):
        pieces, st = [], None
        for a, b in zip([0] + cuts, cuts + [150]):
            o, st = linattn.causal_linear_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :],
                                                    initial_state=st, return_state=True, **kw)
            pieces.append(o)
        assert_close(np.concatenate(pieces, axis=-2), full, dtype)
        assert_close(st.S, S_ref, dtype)
        assert_close(st.Z, Z_ref, dtype)


def test_state_with_non_contiguous_views(rng):
    q, k, v = make_qkv(rng, (3,), 60, 4, 6)
    _, st = linattn.causal_linear_attention(q[:, :30], k[:, :30], v[:, :30], return_state=True)
    S = np.asfortranarray(st.S)
    out = linattn.causal_linear_attention(q[:, 30:], k[:, 30:], v[:, 30:], initial_state=(S, st.Z[:, ::1]))
    assert_close(out, linattn.causal_linear_attention(q, k, v)[:, 30:], np.float32)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_states_through_the_short_path(rng, causal, dtype, monkeypatch):
    """A call with a State of C-contiguous arrays, returning one, takes the short path (no checks in
    Python: the general path patched to raise is not reached); a State of other arrays, a tuple, takes
    the general path: the same kernel, the same results bit for bit."""
    fn = linattn.causal_linear_attention if causal else linattn.linear_attention
    q, k, v = make_qkv(rng, (2, 3), 70, 8, 5, dtype)
    _, first = fn(q[..., :30, :], k[..., :30, :], v[..., :30, :], return_state=True)
    rest = tuple(np.ascontiguousarray(x[..., 30:, :]) for x in (q, k, v))  # (C-contiguous: the short path's)
    want, want_state = fn(*rest, initial_state=tuple(first), return_state=True)  # (a tuple: the general path)
    assert_close(want, (fn(q, k, v)[..., 30:, :] if causal else
                        fn(rest[0], k, v)), dtype)  # (the keys so far: all of them, not causal)
    ro = linattn.State(first.S.copy(), first.Z.copy())
    for x in ro:
        x.setflags(write=False)
    states = [first, linattn.State(np.asfortranarray(first.S), first.Z), ro]
    for state in states:
        out, new = fn(*rest, initial_state=state, return_state=True)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(new.S, want_state.S)
        np.testing.assert_array_equal(new.Z, want_state.Z)
        np.testing.assert_array_equal(fn(*rest, initial_state=state), want)
    with monkeypatch.context() as m:
        m.setattr(attention, "_prepare", lambda *a, **kw: pytest.fail("the general path"))
        out, new = fn(*rest, initial_state=first, return_state=True)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(new.S, want_state.S)
        if causal:  # (a read-only state is the non-causal kernel's general path: it copies it)
            fn(*rest, initial_state=ro)
    with pytest.raises(TypeError, match=r"initial_state\.S: expected dtype"):
        fn(*rest, initial_state=linattn.State(first.S.astype(np.float16), first.Z))


@pytest.mark.parametrize("gating", [None, "position", "dimension"])
def test_a_head_cut_for_one_run_gives_the_unsplit_bits(rng, monkeypatch, gating):
    """Segments that run once each walk the chunks before them as the unsplit run does, only without
    outputs (the forward from a head's start, the backward from its end), so over several folds the
    outputs, the final state and the vjp's gradients are the unsplit call's bit for bit."""
    from linattn import gradients
    lead, n, d, dv = (2,), 1700, 5, 4
    q, k, v = make_qkv(rng, lead, n, d, dv)
    kw = dict(initial_state=linattn.State(rng.random(lead + (d, dv)).astype(np.float32),
                                          rng.random(lead + (d,)).astype(np.float32)),
              lengths=np.array([1700, 1300]), return_state=True)
    if gating:
        kw["gate"] = np.log(rng.uniform(0.95, 1.0, lead + (n,) + ((d,) if gating == "dimension" else ()))
                            ).astype(np.float32)
    W = rng.standard_normal(lead + (n, dv)).astype(np.float32)
    found = []
    for frac, threads in (([0.0, 1.0], 1), ([0.0, 0.3, 0.55, 1.0], 2)):
        for module in (attention, gradients):
            monkeypatch.setattr(module, "plan", lambda *a, **k: (32, np.array(frac), threads, False))
        attention._constants.clear()
        out, state = linattn.causal_linear_attention(q, k, v, **kw)
        grads = linattn.causal_linear_attention_vjp(q, k, v, **kw)[2](W)
        found.append([out, state.S, state.Z, *grads[:3], *grads[3]])
    attention._constants.clear()
    for got, want in zip(*found):
        np.testing.assert_array_equal(got, want)


_SPLITS = [[0, 0.5, 1], [0, 0.2, 0.21, 0.9, 1], [0, 0, 0, 1], [0, 1, 1, 1],
           [0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1]]


@pytest.mark.parametrize("frac, two_runs", [([0, 1], False)] + [(f, t) for f in _SPLITS for t in (False, True)])
def test_segments(rng, frac, two_runs):
    """The kernels split a head into segments when heads are few; check every kind of split, causal
    segments that sum their prefix (one run) and that sum their own part first (two runs)."""
    n, d, dv = 300, 6, 5
    q, k, v = make_qkv(rng, (3,), n, d, dv)
    lengths = np.array([300, 131, 0], np.int64)
    S0 = rng.random((3, d, dv)).astype(np.float32)
    Z0 = rng.random((3, d)).astype(np.float32)
    out = np.full((3, n, dv), np.nan, np.float32)
    S, Z = np.full_like(S0, np.nan), np.full_like(Z0, np.nan)
    frac = np.asarray(frac, np.float64)
    no_gates = (np.zeros(0, np.float32), np.zeros(0), np.zeros(3, np.int64))
    no_map = (np.zeros(0, np.float32), 0)  # elu+1 inline: no parameters, no map_rows
    den = np.full((1, 3, n), np.nan, np.float32)  # the denominators kept for the backward pass
    chunk = chunk_size(n)
    states = np.full((1, 3, -(-n // chunk), dv + 1, d), np.nan, np.float32)  # and the states at chunk starts
    parts = np.full((3, len(frac) - 1, d, dv + 2), np.nan)  # two runs: each segment's part of the state first
    runs = ((0, parts), (1, parts)) if two_runs else ((1, parts[:0]),)  # (one run: each sums its prefix)
    kernel = chunked.causal_forward.get(np.float32, ("C", 0))
    for phase, p in runs:
        kernel(2, q[None], k[None], v[None], 1, *no_map, np.float32(1e-6), True, np.float32(1), lengths, chunk, frac,
               S0, Z0, out[None], S, Z, *no_gates, den, states, phase, p)
    for h, L in enumerate(lengths):
        for ci in range(-(-L // chunk)):
            i0 = ci * chunk
            _, (S_i, Z_i) = reference.loop(q[h, :i0], k[h, :i0], v[h, :i0], initial_state=(S0[h], Z0[h]),
                                           return_state=True)
            assert_close(states[0, h, ci], np.concatenate([S_i, Z_i[:, None]], 1).T, np.float32)
        ref, (S_ref, Z_ref) = reference.loop(q[h, :L], k[h, :L], v[h, :L], initial_state=(S0[h], Z0[h]),
                                             return_state=True)
        assert_close(out[h, :L], ref, np.float32)
        qf, kf = (np.where(x[h, :L] > 0, x[h, :L] + 1.0, np.exp(np.minimum(x[h, :L], 0.0))) for x in (q, k))
        den_ref = np.einsum("nd,nd->n", qf, Z0[h] + np.cumsum(kf, 0)) + 1e-6
        assert_close(den[0, h, :L], den_ref, np.float32)
        np.testing.assert_array_equal(out[h, L:], 0)
        assert_close(S[h], S_ref, np.float32)
        assert_close(Z[h], Z_ref, np.float32)
    out2 = np.full((3, n, dv), np.nan, np.float32)  # non-causal: each segment's part of the state, then the outputs
    parts = np.full((3, len(frac) - 1, d, dv + 1), np.nan)
    for phase in (0, 1) if len(frac) > 2 else (1,):
        chunked.noncausal_forward.get(np.float32, "C")(2, q[None], k[None], v[None], 1, *no_map, np.float32(1e-6),
                                                        True, np.float32(1), np.full(3, n), np.full(3, n),
                                                        chunk_size(n), frac,
                                                        S0[:0], Z0[:0],
                                                        out2[None], S[:0], Z[:0], phase,
                                                        parts if len(frac) > 2 else parts[:0])
    assert_close(out2, reference.masked(q, k, v, causal=False), np.float32)


@pytest.mark.parametrize("nseg", [2, 3, 7])
def test_two_runs_equal_one_call(rng, monkeypatch, nseg):
    """Heads in equal segments that each sum their own part of the state first (what runtime.plan picks
    with many threads a head) give the unsegmented results: with every kind of gate and decay, lengths,
    an initial state, the final state, through the plain call's short path and the vjp's forward (its
    kept denominators and chunk states, and so its gradients)."""
    lead, n, d, dv = (2, 2), 700, 5, 3
    q, k, v = make_qkv(rng, lead, n, d, dv, np.float64)
    S0 = linattn.State(rng.random(lead + (d, dv)), rng.random(lead + (d,)))
    g_pos = -rng.random(lead + (n,)) * 0.05
    g_pos[0, 1, 333] = -np.inf  # a reset
    g_dim = -rng.random(lead + (n, d)) * 0.05
    g_dim[1, 0, 40, 2] = -np.inf
    options = [{}, dict(initial_state=S0, lengths=np.array([[700, 333], [0, 1]])), dict(gate=g_pos),
               dict(gate=g_dim, initial_state=S0), dict(decay=np.full(lead, 0.97)),
               dict(decay=np.full(lead, 0.99), gate=g_pos, normalize=False, scale=0.5)]
    W = rng.standard_normal(lead + (n, dv))

    def results():
        return causal_results(q, k, v, options, W)

    whole = results()
    real_plan = linattn.attention.plan

    def split(bh, n, dk, dv, causal=True, two_runs=True):
        chunk, _, _, _ = real_plan(bh, n, dk, dv, causal, two_runs)
        return chunk, np.linspace(0, 1, nseg + 1), 2, True

    monkeypatch.setattr(linattn.attention, "plan", split)
    for got, want in zip(results(), whole):
        assert_close(got, want, np.float64)
    linattn.attention._constants.clear()


def test_long_sequence_float32_accuracy(rng):
    """float32 stays within 2e-4 of float64 over a million positions (the state is kept in float64)."""
    n = 1 << 20
    q, k, v = make_qkv(rng, (), n, 4, 3, np.float32)
    v = v + 0.5  # a drift that the state accumulates over the whole sequence
    out32, st32 = linattn.causal_linear_attention(q, k, v, return_state=True)
    out64, st64 = linattn.causal_linear_attention(*(x.astype(np.float64) for x in (q, k, v)), return_state=True)
    row_err = np.linalg.norm(out32 - out64, axis=-1) / np.linalg.norm(out64, axis=-1)
    assert row_err.max() < 2e-4
    assert rel_err(st32.S, st64.S) < 2e-6 and rel_err(st32.Z, st64.Z) < 2e-6
    out32 = linattn.linear_attention(q, k, v)
    out64 = linattn.linear_attention(*(x.astype(np.float64) for x in (q, k, v)))
    assert rel_err(out32, out64) < 2e-5


def test_nan_and_inf_propagate(rng):
    q, k, v = make_qkv(rng, (2,), 200, 4, 3)
    k[0, 100, 1] = np.nan
    v[1, 150, 0] = np.inf
    out = linattn.causal_linear_attention(q, k, v)
    chunk = chunk_size(200)
    first = 100 // chunk * chunk  # positions of earlier chunks are untouched
    assert np.isfinite(out[0, :first]).all() and np.isnan(out[0, 100:]).all()
    assert np.isfinite(out[1, :150 // chunk * chunk]).all() and not np.isfinite(out[1, 150:, 0]).any()
    assert np.isnan(linattn.linear_attention(q, k, v)[0]).all()


def test_concurrent_calls(rng):
    cases = [make_qkv(rng, (b, 2), n, 8, 4, dt) for b, n, dt in
             [(1, 300, np.float32), (3, 50, np.float64), (2, 1000, np.float32), (1, 7, np.float64)] * 3]
    expected = [linattn.causal_linear_attention(*c) for c in cases]
    with ThreadPoolExecutor(max_workers=6) as ex:
        got = list(ex.map(lambda c: linattn.causal_linear_attention(*c), cases))
        got_nc = list(ex.map(lambda c: linattn.linear_attention(*c), cases))
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e, g)
    for g, c in zip(got_nc, cases):
        np.testing.assert_array_equal(g, linattn.linear_attention(*c))


@settings(max_examples=60, deadline=None)
@given(lead=st.lists(st.integers(1, 3), max_size=2).map(tuple), n=st.integers(0, 80),
       d=st.integers(1, 9), dv=st.integers(1, 9), f64=st.booleans(), seed=st.integers(0, 2**31))
def test_random_shapes(lead, n, d, dv, f64, seed):
    """Against the float64 reference: within TOL of the largest output, plus the rounding of sums that
    cancel, a few eps of the dtype times what they add up (the weights times |v|, as positive as elu's
    weights are): an output far smaller than its terms carries their rounding (D = Dv = 1 with 41
    keys drew a sum 4100 times smaller than its terms, 6.5e-5 relative in float32, NumPy's float32
    2.0e-5)."""
    dtype = np.float64 if f64 else np.float32
    q, k, v = make_qkv(np.random.default_rng(seed), lead, n, d, dv, dtype)
    for causal, fn in ((True, linattn.causal_linear_attention), (False, linattn.linear_attention)):
        out, ref = fn(q, k, v), reference.masked(q, k, v, causal=causal)
        assert out.shape == ref.shape and out.dtype == dtype
        if ref.size == 0:
            continue
        terms = reference.masked(q, k, np.abs(v), causal=causal)
        assert_close(out, ref, dtype, cancellation(ref, terms, dtype))
