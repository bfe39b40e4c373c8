"""The built-in feature maps: each against its formula written out here in float64 NumPy from its paper
(constants included), the kernel identities of the Taylor and ReBased maps, D' as a function of D,
the fused kernels against the float64 reference with the formula as a callable, through the state
(split/resume, prefill + step), with gates, and bad parameters."""
import math

import numpy as np
import pytest

import linattn
from linattn import feature_maps as fm
from linattn import reference

from conftest import assert_close, make_qkv

_erf = np.vectorize(math.erf)


def _relu(x):
    return np.maximum(x, 0)


def _taylor_full(x):
    """Based (flash-linear-attention's TaylorFeatureMap): [1, x / d**(1/4), vec(x x^T) / (sqrt(2) sqrt(d))]."""
    d = x.shape[-1]
    outer = (x[..., :, None] * x[..., None, :]).reshape(x.shape[:-1] + (d * d,))
    return np.concatenate([np.ones(x.shape[:-1] + (1,)), x / d ** 0.25, outer / math.sqrt(2) / math.sqrt(d)], -1)


def _layer_norm(x, gamma, beta, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gamma + beta


def _rebased_full(x, gamma, beta):
    """ReBased: (gamma LN(x) + beta), all D**2 products: phi(x).phi(y) = (y.y')**2."""
    y = _layer_norm(x, gamma, beta)
    d = x.shape[-1]
    return (y[..., :, None] * y[..., None, :]).reshape(x.shape[:-1] + (d * d,))


def _dpfp(x, nu):
    """Schlag et al. 2021, the authors' code: x = cat([relu(x), relu(-x)]); cat(x * roll(x, j), j = 1..nu)."""
    r = np.concatenate([_relu(x), _relu(-x)], -1)
    return np.concatenate([r * np.roll(r, j, axis=-1) for j in range(1, nu + 1)], -1)


def _performer(x, omega):
    """FAVOR+: exp(omega^T x - |x|^2 / 2) / sqrt(m)."""
    return np.exp(x @ omega - (x * x).sum(-1, keepdims=True) / 2) / math.sqrt(omega.shape[1])


def _hedgehog(x, w, b):
    z = x @ w + b
    e = np.concatenate([2 * z, -2 * z], -1)
    e = np.exp(e - e.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _t2r(x, w, b):
    return _relu(x @ w + b)


ELEMENTWISE = {
    "elu": lambda x: np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))),
    "relu": _relu,
    "identity": lambda x: x,
    "squared_relu": lambda x: _relu(x) ** 2,
    "gelu": lambda x: x * 0.5 * (1 + _erf(x / math.sqrt(2))),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "swish": lambda x: x / (1 + np.exp(-x)),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "softplus": lambda x: np.log1p(np.exp(-np.abs(x))) + _relu(x),
}
#: maps whose features' dot products are positive: normalised attention is well conditioned with them
POSITIVE = {"elu", "sigmoid", "softplus", "taylor", "performer", "hedgehog", "rebased"}


def _maps(d, seed=7):
    """name -> (map object, float64 formula), for inputs of d features."""
    rng = np.random.default_rng(seed)
    gamma, beta = 1 + 0.2 * rng.standard_normal(d), 0.1 * rng.standard_normal(d)
    omega = rng.standard_normal((d, 12))
    w, b = rng.standard_normal((d, 6)) / math.sqrt(d), 0.1 * rng.standard_normal(6)
    maps = {name: (fm.Elementwise(name), f) for name, f in ELEMENTWISE.items()}
    maps.update({
        "taylor": (fm.Taylor(), None),  # (D' differs from the full form: checked through its kernel)
        "rebased": (fm.ReBased(gamma, beta), None),
        "dpfp": (fm.DPFP(2), lambda x: _dpfp(x, 2)),
        "performer": (fm.Performer(omega), lambda x: _performer(x, omega)),
        "hedgehog": (fm.Hedgehog(w, b), lambda x: _hedgehog(x, w, b)),
        "t2r": (fm.T2R(w, b), lambda x: _t2r(x, w, b)),
    })
    return maps


NAMES = list(_maps(3))


def _gram(phi_q, phi_k):
    return phi_q @ np.swapaxes(phi_k, -1, -2)


def _kernel_formula(name, d, seed=7):
    """phi(x).phi(y) in closed form for the maps whose features differ from the written-out ones."""
    if name == "taylor":
        return lambda x, y: 1 + _gram(x, y) / math.sqrt(d) + _gram(x, y) ** 2 / (2 * d)
    mp = _maps(d, seed)["rebased"][0]
    return lambda x, y: _gram(_layer_norm(x, mp.gamma, mp.beta), _layer_norm(y, mp.gamma, mp.beta)) ** 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", NAMES)
def test_map_of_many_rows_on_threads(rng, name, dtype):
    """A map applied to many rows at once (on several threads, items of rows taken in turn) equals the
    same map applied to slices of a few rows (each on the calling thread), row for row."""
    from linattn.cpu import mapfns, runtime
    d = 16
    mp = _maps(d)[name][0]
    x = rng.standard_normal((3, 4001, d)).astype(dtype)[:, ::-1]  # (a view: rows not in memory order)
    rows, dk = 3 * 4001, mp.out_dim(d)
    if runtime.num_threads() > 1:  # large enough to be shared out
        work = rows * (d + dk) * (1 if mp.kernel_code() < mapfns.TAYLOR else 2)
        assert runtime.threads_for(work, mapfns.APPLY_WORK_PER_THREAD) > 1
    phi = mp(x)
    assert phi.shape == (3, 4001, dk) and phi.dtype == dtype
    by_slices = np.concatenate([mp(x[:, i:i + 97]) for i in range(0, 4001, 97)], axis=1)
    size = np.abs(by_slices).max(-1, keepdims=True) + np.finfo(dtype).tiny
    assert (np.abs(phi - by_slices) / size).max() <= 4 * np.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", NAMES)
def test_map_against_formula(rng, name, dtype):
    d = 5
    mp, formula = _maps(d)[name]
    x = (rng.standard_normal((3, 40, d)) * 1.5).astype(dtype)
    x[0, 0, :] = [-12, -3, 0, 3, 12]  # far tails and zero
    phi = mp(x)
    assert phi.dtype == dtype and phi.shape == (3, 40, mp.out_dim(d))
    x64 = x.astype(np.float64)
    if formula is not None:
        # relative to each row's largest feature or input (gelu's left tail cancels in float32, as in
        # PyTorch: its error is that of erf, ~1e-7, times |x|)
        want = formula(x64)
        size = np.maximum(np.abs(want).max(-1, keepdims=True), np.abs(x64).max(-1, keepdims=True))
        if name == "performer":  # exp(u) carries u's rounding, ~eps (|omega^T x| + |x|^2 / 2), relatively
            size = np.abs(want) * (1 + np.abs(x64) @ np.abs(mp.weight) + (x64 * x64).sum(-1, keepdims=True) / 2)
        # values below the smallest normal number are flushed to 0 (exp(-110) in float32, say)
        err = np.maximum(np.abs(phi - want) - np.finfo(dtype).tiny, 0) / size
        assert err.max() <= {np.float32: 5e-7, np.float64: 1e-14}[dtype], err.max()
    if name in ("taylor", "rebased"):  # phi(x).phi(y) equals the closed form
        want = _kernel_formula(name, d)(x64, x64[::-1])
        full = (_taylor_full if name == "taylor" else lambda z: _rebased_full(z, mp.gamma, mp.beta))(x64)
        assert_close(_gram(full, full[::-1]), want, np.float64)  # the written-out features, too
        assert_close(_gram(phi.astype(np.float64), phi[::-1].astype(np.float64)), want, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_maps_at_infinities(name, dtype):
    """The formula's value at +-inf, NaN and -0 (relu of -inf was NaN, as was softplus of it)."""
    x = np.array([[-np.inf, np.inf, np.nan, -0.0, -1e30]], dtype)
    with np.errstate(all="ignore"):
        want = ELEMENTWISE[name](x.astype(np.float64))
    phi = fm.Elementwise(name)(x)
    np.testing.assert_array_equal(np.isnan(phi), np.isnan(want))
    # (exp of a large negative number is clamped at about the smallest normal number)
    np.testing.assert_allclose(phi[~np.isnan(want)], want[~np.isnan(want)],
                               rtol={np.float32: 5e-7, np.float64: 1e-14}[dtype], atol=4 * np.finfo(dtype).tiny)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name, d, rows", [("taylor", 16, 100), ("rebased", 16, 33), ("dpfp", 8, 97),
                                           ("taylor", 9, 64), ("dpfp", 1, 31), ("hedgehog", 16, 100),
                                           ("hedgehog", 3, 65)])
def test_maps_over_whole_and_partial_tiles(rng, name, d, rows, dtype):
    """The pair maps and Hedgehog are computed transposed, 32 rows at a time, through vector
    transposes of 8 x 8 (float32) or 4 x 4 (float64) tiles: sizes with whole tiles, edges and a last
    partial block."""
    mp, formula = _maps(d)[name]
    if name == "hedgehog":  # m = 24: whole tiles of the projection's columns
        w, b = rng.standard_normal((d, 24)) / math.sqrt(d), 0.1 * rng.standard_normal(24)
        mp, formula = fm.Hedgehog(w, b), lambda x: _hedgehog(x, w, b)
    x = rng.standard_normal((rows, d)).astype(dtype)
    x64, phi = x.astype(np.float64), mp(x)
    if formula is None:  # Taylor, ReBased: phi(x).phi(y) equals the closed form
        want = _kernel_formula(name, d)(x64, x64[::-1])
        assert_close(_gram(phi.astype(np.float64), phi[::-1].astype(np.float64)), want, dtype)
    else:
        want = formula(x64)
        size = np.maximum(np.abs(want).max(-1, keepdims=True), 1.0)
        assert (np.abs(phi - want) / size).max() <= {np.float32: 5e-7, np.float64: 1e-14}[dtype]
    view = np.asfortranarray(x)[::-1]  # rows far apart in memory
    np.testing.assert_array_equal(mp(view), mp(np.ascontiguousarray(view)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("nu, d", [(1, 1), (2, 1), (3, 1), (4, 2), (9, 2), (5, 3), (2, 32)])
def test_dpfp_shifts_past_its_length(rng, nu, d, dtype):
    """DPFP's shifts nu' = 1..nu run past u's length 2D where nu > 2D (the roll wraps more than once;
    nu' = 2D is u * u), as in the authors' code: mapped alone, and inside the causal kernel (the
    numerator: DPFP's features may all be 0, where normalised attention is 0 / eps)."""
    mp = fm.DPFP(nu)
    x = rng.standard_normal((2, 37, d)).astype(dtype)
    want = _dpfp(x.astype(np.float64), nu)
    size = np.maximum(np.abs(want).max(-1, keepdims=True), 1.0)
    assert (np.abs(mp(x) - want) / size).max() <= {np.float32: 5e-7, np.float64: 1e-14}[dtype]
    q, k, v = x, x[:, ::-1], rng.standard_normal((2, 37, 4)).astype(dtype)
    out = linattn.causal_linear_attention(q, k, v, feature_map=mp, normalize=False)
    ref = reference.masked(_dpfp(q.astype(np.float64), nu), _dpfp(k.astype(np.float64), nu), v.astype(np.float64),
                           feature_map="identity", normalize=False)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["elu", "relu", "squared_relu", "gelu", "silu", "sigmoid", "softplus"])
def test_elementwise_maps_alone_and_among_others(rng, name, dtype):
    """A value gets the same bits mapped with thousands of others (vectorised loops) and as a row of its own
    far from the next (each value in the loops' scalar remainder): LLVM may fuse a multiply into an add in
    one path and not the other (softplus's last add did on an AVX-512 CPU: 6% of float32 values 1 ulp apart)."""
    x = (rng.standard_normal(4099) * 3).astype(dtype)
    mp = fm.Elementwise(name).scaled(0.75)
    far = np.zeros((4099, 8), dtype)
    far[:, 3] = x
    np.testing.assert_array_equal(mp(far[:, 3:4]), mp(x[:, None]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["identity", "elu", "relu", "squared_relu", "gelu", "silu", "sigmoid", "softplus"])
def test_elementwise_maps_on_every_row_layout(rng, name, dtype):
    """The elementwise maps read rows of adjacent elements in place (one run when the rows follow each
    other, else row by row) and gather the others: every layout gives the same values, bit for bit,
    and the formula's, with an input scale."""
    x = (rng.standard_normal((67, 13)) * 2).astype(dtype)
    mp = fm.Elementwise(name).scaled(0.75)
    want = mp(x)
    formula = {"identity": lambda z: z, "elu": lambda z: np.where(z > 0, z + 1, np.exp(np.minimum(z, 0))),
               "relu": _relu, "squared_relu": lambda z: _relu(z) ** 2,
               "gelu": lambda z: z * (1 + _erf(z / math.sqrt(2))) / 2, "silu": lambda z: z / (1 + np.exp(-z)),
               "sigmoid": lambda z: 1 / (1 + np.exp(-z)), "softplus": lambda z: np.logaddexp(z, 0)}[name]
    assert_close(want, formula(0.75 * x.astype(np.float64)), dtype)
    wide = np.zeros((67, 26), dtype)
    wide[:, ::2] = x
    twice = np.concatenate([x, x], 1)
    for view, rows in [(np.asfortranarray(x), want), (x[::-1], want[::-1]), (wide[:, ::2], want),
                       (twice[:, :13], want), (twice[::2, 13:], want[::2])]:
        np.testing.assert_array_equal(mp(view), rows)


@pytest.mark.parametrize("name, d, want", [("taylor", 16, 153), ("taylor", 1, 3), ("rebased", 16, 136),
                                           ("dpfp", 4, 16), ("performer", 16, 12), ("hedgehog", 16, 12),
                                           ("t2r", 16, 6), ("gelu", 16, 16)])
def test_out_dim(name, d, want):
    mp = _maps(d)[name][0]
    assert mp.out_dim(d) == want
    assert mp(np.zeros((2, d))).shape == (2, want)


def test_taylor_and_rebased_shapes_follow_d():
    for d in (1, 2, 7, 16, 64):
        assert fm.Taylor().out_dim(d) == 1 + d + d * (d + 1) // 2
        assert fm.ReBased(np.ones(d), np.zeros(d)).out_dim(d) == d * (d + 1) // 2
        assert fm.DPFP(3).out_dim(d) == 6 * d


def test_performer_estimates_the_softmax_kernel():
    """E[phi(x).phi(y)] = exp(x.y): with 50000 features the estimate is within a few percent (its
    relative variance per feature is exp(|x + y|^2) - 1, about 1 here)."""
    rng = np.random.default_rng(3)
    d = 8
    x, y = rng.standard_normal((2, 4, d)) * 0.25
    for orthogonal in (True, False):
        mp = fm.Performer.random(d, 50000, seed=11, orthogonal=orthogonal)
        assert abs(mp.weight.mean()) < 0.01 and abs(mp.weight.std() - 1) < 0.01
        est = _gram(mp(x), mp(y))
        np.testing.assert_allclose(est, np.exp(_gram(x, y)), rtol=0.05)
    omega = fm.Performer.random(d, 16, seed=1).weight  # orthogonal within each block of d columns
    block = omega[:, :d] / np.linalg.norm(omega[:, :d], axis=0)
    np.testing.assert_allclose(block.T @ block, np.eye(d), atol=1e-12)
    np.testing.assert_array_equal(fm.Performer.random(d, 16, seed=1).weight, omega)


def test_scaled_composes(rng):
    x = rng.standard_normal((10, 6))
    taylor = fm.Taylor()
    np.testing.assert_allclose(taylor.scaled(0.5)(x), taylor(0.5 * x), rtol=1e-14)
    np.testing.assert_allclose(taylor.scaled(0.5).scaled(4.0)(x), taylor(2 * x), rtol=1e-14)
    assert repr(taylor.scaled(0.5)) == "Taylor().scaled(0.5)"
    elu = fm.Elementwise("elu").scaled(0.25)
    np.testing.assert_allclose(elu(x), ELEMENTWISE["elu"](0.25 * x), rtol=1e-14)
    q, k, v = make_qkv(rng, (2,), 50, 6, 3, np.float64)
    out = linattn.causal_linear_attention(q, k, v, feature_map=elu)
    assert_close(out, reference.masked(q * 0.25, k * 0.25, v), np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["performer", "hedgehog", "t2r"])
def test_scaled_projections_on_every_row_layout(rng, name, dtype):
    """The projections scale their product (s x) W = s (x W) rather than a copy of the rows: the
    formula of the scaled input for rows read in place and for gathered ones, and in the kernels."""
    d, s = 5, 0.6
    mp, formula = _maps(d)[name]
    scaled = mp.scaled(s)
    x = (rng.standard_normal((70, d)) * 1.5).astype(dtype)
    want = formula(s * x.astype(np.float64))
    wide = np.zeros((70, 2 * d), dtype)
    wide[:, ::2] = x
    for view, rows in [(x, want), (x[::-1], want[::-1]), (wide[:, ::2], want), (np.asfortranarray(x), want)]:
        assert_close(scaled(view), rows, dtype)
    q, k, v = make_qkv(rng, (2,), 65, d, 3, dtype)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    ref = reference.masked(s * q64, s * k64, v64, feature_map=formula, normalize=name in POSITIVE)
    for qv, kv in [(q, k), (q[:, ::-1].copy()[:, ::-1], np.asfortranarray(k))]:
        out = linattn.causal_linear_attention(qv, kv, v, feature_map=scaled, normalize=name in POSITIVE)
        assert_close(out, ref, dtype)


def _callable(mp, formula):
    """The reference's phi: the written-out formula, or the map itself where the formula's D' differs."""
    return formula if formula is not None else mp


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("lead, n, d, dv", [((2, 3), 70, 5, 4), ((), 1, 1, 1), ((3,), 65, 4, 8), ((1, 2), 63, 3, 7)])
def test_attention_against_reference(rng, name, lead, n, d, dv, dtype):
    mp, formula = _maps(d)[name]
    phi = _callable(mp, formula)
    q, k, v = make_qkv(rng, lead, n, d, dv, dtype)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    for normalize in (True, False) if name in POSITIVE else (False,):
        out = linattn.causal_linear_attention(q, k, v, feature_map=mp, normalize=normalize)
        assert out.dtype == dtype
        assert_close(out, reference.masked(q64, k64, v64, feature_map=phi, normalize=normalize), dtype)
        out = linattn.linear_attention(q, k, v, feature_map=mp, normalize=normalize)
        assert_close(out, reference.masked(q64, k64, v64, feature_map=phi, normalize=normalize, causal=False), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", NAMES)
def test_maps_take_the_short_path(rng, monkeypatch, name, dtype):
    """Every built-in map, as an object and (elementwise ones) by name, takes the plain call's short path
    (the checked path, patched to fail, is not reached), with D' its own: the same bits as the checked
    path (``device="cpu"``), alone and with an initial state, the final state, a gate per key dimension
    (D' columns), a decay, lengths and ``out=``, causal and not, and queries over a state alone; the same
    map on q or k with strides that are not whole elements goes to the checked path, which copies them."""
    from linattn import attention

    lead, n, d, dv = (2, 3), 70, 4, 5
    mp = _maps(d)[name][0]
    dk = mp.out_dim(d)
    q, k, v = make_qkv(rng, lead, n, d, dv, dtype)
    st = linattn.State(rng.random(lead + (dk, dv)).astype(dtype), rng.random(lead + (dk,)).astype(dtype))
    cases = [(linattn.causal_linear_attention, dict()), (linattn.linear_attention, dict()),
             (linattn.causal_linear_attention, dict(initial_state=st, gate=-rng.random(lead + (n, dk)).astype(dtype),
                                                    lengths=np.array([70, 41]))),
             (linattn.causal_linear_attention, dict(decay=0.9, scale=0.5)),
             (linattn.linear_attention, dict(initial_state=st, lengths=np.array([3, 70]))),
             (linattn.linear_attention, dict(lengths=np.array([70, 9]), query_lengths=np.array([0, 70])))]
    fmaps = [mp] + ([name] if name in ELEMENTWISE else [])
    for fn, kw in cases:
        kw = dict(kw, normalize=name in POSITIVE)
        want, want_state = fn(q, k, v, feature_map=mp, device="cpu", return_state=True, **kw)
        with monkeypatch.context() as m:
            m.setattr(attention, "_prepare", lambda *a, **kw: pytest.fail("the general path"))
            for fmap in fmaps:
                out, state = fn(q, k, v, feature_map=fmap, return_state=True, **kw)
                np.testing.assert_array_equal(out, want)
                assert state.S.shape == lead + (dk, dv)
                np.testing.assert_array_equal(state.S, want_state.S)
                np.testing.assert_array_equal(state.Z, want_state.Z)
                buf = np.full(want.shape, np.nan, dtype)
                assert fn(q, k, v, feature_map=fmap, out=buf, **kw) is buf
                np.testing.assert_array_equal(buf, want)
    # queries over a state alone (k, v None: a decoder over its encoder's keys; one query a sequence takes the
    # step kernel instead: test_cross_attention.test_one_query_over_state)
    want = linattn.linear_attention(q, initial_state=st, feature_map=mp, normalize=name in POSITIVE, device="cpu")
    with monkeypatch.context() as m:
        m.setattr(attention, "_prepare", lambda *a, **kw: pytest.fail("the general path"))
        for fmap in fmaps:
            out = linattn.linear_attention(q, initial_state=st, feature_map=fmap, normalize=name in POSITIVE)
            np.testing.assert_array_equal(out, want)
    isz = q.itemsize  # rows of adjacent elements, d * isz + 1 bytes apart
    raw = np.zeros(6 * n * (d * isz + 1), np.uint8)
    odd = np.ndarray(q.shape, dtype, raw, 0, (3 * n * (d * isz + 1), n * (d * isz + 1), d * isz + 1, isz))
    odd[...] = q
    np.testing.assert_array_equal(linattn.causal_linear_attention(odd, k, v, feature_map=mp),
                                  linattn.causal_linear_attention(q, k, v, feature_map=mp))
    np.testing.assert_array_equal(linattn.linear_attention(q, odd, v, feature_map=mp),
                                  linattn.linear_attention(q, q, v, feature_map=mp))


@pytest.mark.parametrize("name", ["taylor", "performer", "hedgehog", "dpfp", "gelu"])
def test_non_contiguous_views(rng, name):
    """Heads of a fused QKV projection (strided views) and reversed sequences read in place."""
    d, dv = 4, 4
    mp, formula = _maps(d)[name]
    phi = _callable(mp, formula)
    qkv = rng.standard_normal((2, 90, 3, 3, d)).astype(np.float32) * 0.5  # (B, N, 3, H, D)
    q, k, v = (qkv[:, ::-1, i].transpose(0, 2, 1, 3) for i in range(3))
    normalize = name in POSITIVE
    out = linattn.causal_linear_attention(q, k, v, feature_map=mp, normalize=normalize)
    ref = reference.masked(*(x.astype(np.float64) for x in (q, k, v)), feature_map=phi, normalize=normalize)
    assert_close(out, ref, np.float32)


@pytest.mark.parametrize("name", NAMES)
def test_split_resume_and_step(rng, name):
    """Two calls through the state, and a prefill followed by steps, equal one call."""
    lead, n, d, dv = (2, 3), 100, 4, 5
    mp, _ = _maps(d)[name]
    q, k, v = make_qkv(rng, lead, n, d, dv, np.float64)
    normalize = name in POSITIVE
    full, st = linattn.causal_linear_attention(q, k, v, feature_map=mp, normalize=normalize, return_state=True)
    assert st.S.shape == lead + (mp.out_dim(d), dv) and st.Z.shape == lead + (mp.out_dim(d),)
    a, st1 = linattn.causal_linear_attention(q[..., :37, :], k[..., :37, :], v[..., :37, :], feature_map=mp,
                                             normalize=normalize, return_state=True)
    b, st2 = linattn.causal_linear_attention(q[..., 37:, :], k[..., 37:, :], v[..., 37:, :], feature_map=mp,
                                             normalize=normalize, initial_state=st1, return_state=True)
    assert_close(np.concatenate([a, b], -2), full, np.float64)
    assert_close(st2.S, st.S, np.float64)
    steps = []
    for t in range(37, 45):
        steps.append(linattn.step(q[..., t, :], k[..., t, :], v[..., t, :], st1, feature_map=mp, normalize=normalize))
    assert_close(np.stack(steps, -2), full[..., 37:45, :], np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", NAMES)
def test_steps_on_fused_heads_with_gates(rng, name, dtype):
    """step with every map (computed by the step kernel itself) on the heads of a fused QKV projection,
    with a gate per mapped dimension, a decay, a scale and ``out=``, continues one call's sequence; by
    name too for the elementwise maps; a gate or state of D columns instead of D' is a ValueError."""
    b, h, n, d, dv = 2, 3, 12, 4, 4
    mp, _ = _maps(d)[name]
    dk = mp.out_dim(d)
    qkv = (rng.standard_normal((b, n, 3, h, d)) * 0.5).astype(dtype)  # (B, N, 3, H, D)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # strided (B, H, N, D) views
    gate = (-rng.random((b, h, n, dk)) * 0.3).astype(dtype)
    normalize = name in POSITIVE
    kw = dict(feature_map=mp, normalize=normalize, decay=0.9, scale=0.5)
    full = linattn.causal_linear_attention(q, k, v, gate=gate, **kw)
    _, st = linattn.causal_linear_attention(q[..., :5, :], k[..., :5, :], v[..., :5, :], gate=gate[..., :5, :],
                                            return_state=True, **kw)
    out = np.empty((b, h, dv), dtype)
    steps = []
    for t in range(5, n):
        got = linattn.step(q[..., t, :], k[..., t, :], v[..., t, :], st, gate=gate[..., t, :], out=out, **kw)
        assert got is out and got.dtype == dtype
        steps.append(got.copy())
    assert_close(np.stack(steps, -2), full[..., 5:, :], dtype)
    if name in ELEMENTWISE:
        st2 = linattn.State.zeros((b, h), d, dv, dtype=dtype)
        by_name = [linattn.step(q[..., t, :], k[..., t, :], v[..., t, :], st2, feature_map=name, normalize=normalize)
                   for t in range(n)]
        assert_close(np.stack(by_name, -2), linattn.causal_linear_attention(q, k, v, feature_map=name,
                                                                            normalize=normalize), dtype)
    if dk != d:
        with pytest.raises(ValueError, match="gate"):
            linattn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :], st, gate=gate[..., 0, :d], **kw)
        with pytest.raises(ValueError, match="state"):
            linattn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :], linattn.State.zeros((b, h), d, dv, dtype=dtype),
                         **kw)


@pytest.mark.parametrize("name", ["taylor", "hedgehog", "dpfp"])
def test_with_gates_and_weights(rng, name):
    """Gates per key dimension have D' columns; attention_weights @ v equals the output."""
    lead, n, d, dv = (2,), 80, 3, 4
    mp, formula = _maps(d)[name]
    phi = _callable(mp, formula)
    q, k, v = make_qkv(rng, lead, n, d, dv, np.float64)
    gate = -rng.random(lead + (n, mp.out_dim(d))) * 0.3
    out = linattn.causal_linear_attention(q, k, v, feature_map=mp, gate=gate, decay=0.95)
    assert_close(out, reference.loop(q, k, v, feature_map=phi, gate=gate, decay=0.95), np.float64)
    w = linattn.attention_weights(q, k, feature_map=mp, gate=gate, decay=0.95)
    assert_close(w @ v, out, np.float64)
    with pytest.raises(ValueError, match="gate"):
        linattn.causal_linear_attention(q, k, v, feature_map=mp, gate=gate[..., :d])


def test_with_params_keeps_the_settings(rng):
    """with_params: new parameter values, the input scale and the other settings kept, checked as
    the constructor checks them."""
    x = rng.standard_normal((5, 4))
    w, b = rng.standard_normal((4, 3)), rng.standard_normal(3)
    g, be = rng.standard_normal(4) + 1, rng.standard_normal(4)
    cases = [(fm.Hedgehog(np.ones((4, 3))).scaled(0.5), {"weight": w, "bias": b}, lambda: _hedgehog(0.5 * x, w, b)),
             (fm.T2R(np.ones((4, 3))).scaled(2.0), {"weight": w}, lambda: _relu(2 * x @ w)),
             (fm.Performer(np.ones((4, 3))).scaled(0.3), {"omega": w}, lambda: _performer(0.3 * x, w)),
             (fm.ReBased(np.ones(4), np.zeros(4), eps=0.5), {"gamma": g, "beta": be},
              lambda: _upper_rows(_layer_norm(x, g, be, eps=0.5)))]
    for fmap, values, want in cases:
        new = fmap.with_params(**values)
        assert type(new) is type(fmap) and new.input_scale == fmap.input_scale
        assert set(new.param_values()) == set(fmap.param_names)
        for name, value in values.items():
            np.testing.assert_array_equal(new.param_values()[name], value)
        assert_close(new(x), want(), np.float64)
        np.testing.assert_array_equal(fmap(x), fmap.with_params()(x))  # (no values: the same map)
    assert fm.Taylor().param_values() == {}
    for fmap in (fm.Taylor(), fm.DPFP(2), fm.as_map("gelu")):  # (maps without parameters: themselves)
        assert fmap.with_params() is fmap
    with pytest.raises(TypeError, match="Hedgehog has no parameter 'omega' \\(its parameters: weight, bias\\)"):
        fm.Hedgehog(w).with_params(omega=w)
    with pytest.raises(TypeError, match="Taylor has no parameter 'weight' \\(its parameters: none\\)"):
        fm.Taylor().with_params(weight=w)
    with pytest.raises(ValueError, match="weight: expected finite values"):
        fm.Hedgehog(w).with_params(weight=np.full((4, 3), np.nan))
    with pytest.raises(ValueError, match="bias: expected shape \\(3\\)"):
        fm.Hedgehog(w).with_params(bias=np.ones(4))


def _upper_rows(y):
    """ReBased's features from its normalised rows y: y_i**2, then sqrt(2) y_i y_j for i < j (row by row)."""
    d = y.shape[-1]
    return np.stack([y[..., i] * y[..., j] * (1.0 if i == j else math.sqrt(2)) for i in range(d) for j in range(i, d)],
                    -1)


def test_bad_parameters(rng):
    d = 4
    q, k, v = make_qkv(rng, (2,), 10, d, 3, np.float32)
    with pytest.raises(ValueError, match="feature_map: unknown name 'tanh'"):
        linattn.causal_linear_attention(q, k, v, feature_map="tanh")
    with pytest.raises(TypeError, match="feature_map"):
        linattn.causal_linear_attention(q, k, v, feature_map=3)
    with pytest.raises(ValueError, match=r"weight of shape \(5, 6\).*D=4"):
        linattn.causal_linear_attention(q, k, v, feature_map=fm.T2R(np.ones((5, 6))))
    with pytest.raises(ValueError, match="D=4"):
        linattn.step(q[:, 0], k[:, 0], v[:, 0], linattn.State(np.zeros((2, 6, 3)), np.zeros((2, 6))),
                     feature_map=fm.Performer(np.ones((5, 6))))
    with pytest.raises(ValueError, match="gamma and beta for D=3"):
        linattn.linear_attention(q, k, v, feature_map=fm.ReBased(np.ones(3), np.zeros(3)))
    with pytest.raises(ValueError, match="beta: expected shape"):
        fm.ReBased(np.ones(3), np.zeros(4))
    with pytest.raises(ValueError, match="omega: expected finite"):
        fm.Performer(np.full((4, 2), np.nan))
    with pytest.raises(ValueError, match="weight: expected shape"):
        fm.Hedgehog(np.ones(4))
    with pytest.raises(ValueError, match="bias: expected shape"):
        fm.Hedgehog(np.ones((4, 3)), np.ones(2))
    with pytest.raises(ValueError, match="bias: expected finite"):
        fm.T2R(np.ones((4, 3)), [0, np.inf, 0])
    with pytest.raises(TypeError, match="weight: expected an array of real numbers"):
        fm.T2R([["a"]])
    with pytest.raises(ValueError, match="nu: expected an integer >= 1"):
        fm.DPFP(0)
    with pytest.raises(TypeError, match="nu: expected an integer"):
        fm.DPFP(1.5)
    with pytest.raises(ValueError, match="scale: expected a finite number > 0"):
        fm.Taylor().scaled(0)
    with pytest.raises(ValueError, match="eps: expected a finite number >= 0"):
        fm.ReBased(np.ones(3), np.zeros(3), eps=-1)
    with pytest.raises(ValueError, match="m: expected an integer >= 1"):
        fm.Performer.random(4, 0)
    with pytest.raises(ValueError, match="feature_map: expected an array"):
        fm.Taylor()(np.zeros((3, 0)))
    # complex weights would lose their imaginary part, bools are no weights
    for bad, name in ((lambda w: fm.Performer(w), "omega"), (lambda w: fm.T2R(w), "weight"),
                      (lambda w: fm.Hedgehog(np.ones((4, 3)), w[0]), "bias"),
                      (lambda w: fm.ReBased(w[0], w[1]), "gamma")):
        for w in (np.ones((4, 3), complex), np.ones((4, 3), bool)):
            with pytest.raises(TypeError, match=f"{name}: expected an array of real numbers, got dtype {w.dtype}"):
                bad(w)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_too_many_features(rng, dtype):
    """D' over 2**24 is refused before anything of its size is built: float32 parameters would round D'
    and the feature tables' indices (Taylor on D = 6000, D' = 18009001, returned numbers 4000x off), and
    DPFP's tables grow with nu (nu = 10**30 filled memory until the process was killed)."""
    q, k, v = make_qkv(rng, (1,), 3, 4, 2, dtype)
    huge = fm.DPFP(10 ** 30)
    for call in (lambda: linattn.causal_linear_attention(q, k, v, feature_map=huge),
                 lambda: linattn.linear_attention(q, k, v, feature_map=huge),
                 lambda: linattn.step(q[:, 0], k[:, 0], v[:, 0], linattn.State.zeros(1, 8, 2, dtype), feature_map=huge),
                 lambda: linattn.attention_weights(q, k, feature_map=huge),
                 lambda: linattn.causal_linear_attention_vjp(q, k, v, feature_map=huge),
                 lambda: huge(q)):
        with pytest.raises(ValueError, match=r"feature_map: expected at most 16777216 features D' "
                                             r".*DPFP\(nu=10+\) on D = 4"):
            call()
    for d, m in ((4, 10 ** 30), (4, 2 ** 24 + 1), (2 ** 24 + 1, 4)):  # (m = 10**30 drew blocks until memory ran out)
        with pytest.raises(ValueError, match=f"{'m' if m > 4 else 'd'}: expected an integer <= 16777216"):
            fm.Performer.random(d, m)
    assert fm.Taylor().out_dim(5791) <= fm.MAX_FEATURES < fm.Taylor().out_dim(5792)
    with pytest.raises(ValueError, match=f"got D' = {fm.Taylor().out_dim(5792)} from Taylor"):
        fm.Taylor().params(5792, dtype)
