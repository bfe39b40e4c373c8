"""linattn.torch: autograd functions on CPU tensors, checked with torch.autograd.gradcheck in float64
and against PyTorch autograd through a plain PyTorch implementation of the same formula."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.feature_maps import DPFP, Hedgehog, Performer, ReBased, T2R, Taylor

torch = pytest.importorskip("torch")
import linattn  # noqa: E402
import linattn.torch as lt  # noqa: E402


def _plain(q, k, v, S0=None, Z0=None, eps=1e-6, feature_map="elu"):
    """Causal linear attention written out in PyTorch (a loop over positions)."""
    phi = {"elu": lambda x: torch.nn.functional.elu(x) + 1, "relu": torch.relu, "identity": lambda x: x}[feature_map]
    qf, kf = phi(q), phi(k)
    S = torch.zeros(q.shape[:-2] + (q.shape[-1], v.shape[-1]), dtype=q.dtype) if S0 is None else S0
    Z = torch.zeros(q.shape[:-2] + (q.shape[-1],), dtype=q.dtype) if Z0 is None else Z0
    outs = []
    for t in range(q.shape[-2]):
        S = S + kf[..., t, :, None] * v[..., t, None, :]
        Z = Z + kf[..., t, :]
        num = torch.einsum("...d,...de->...e", qf[..., t, :], S)
        outs.append(num / ((qf[..., t, :] * Z).sum(-1, keepdim=True) + eps))
    return torch.stack(outs, -2), S, Z


def _inputs(shape=(2, 9, 3), dv=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(shape, generator=g, dtype=dtype) * 0.5 for _ in range(2))
    v = torch.randn(shape[:-1] + (dv,), generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


@pytest.mark.parametrize("feature_map", ["elu", "relu", "identity"])
def test_gradcheck(feature_map):
    q, k, v = _inputs()
    S0 = torch.rand(2, 3, 2, dtype=torch.float64, requires_grad=True)
    Z0 = (torch.rand(2, 3, dtype=torch.float64) + 0.5).requires_grad_()
    normalize = feature_map != "identity"

    def f(q, k, v, S0, Z0):
        out, (S, Z) = lt.causal_linear_attention(q, k, v, feature_map=feature_map, normalize=normalize,
                                                 initial_state=(S0, Z0), return_state=True)
        return out, S, Z

    assert torch.autograd.gradcheck(f, (q, k, v, S0, Z0))
    assert torch.autograd.gradcheck(lambda q, k, v: lt.linear_attention(q, k, v, feature_map=feature_map,
                                                                        normalize=normalize), (q, k, v))


@pytest.mark.parametrize("feature_map", ["elu", "relu", Taylor(), Performer.random(3, 4, seed=0)])
def test_gradcheck_cross_attention(feature_map):
    """Keys and values of another length than the queries."""
    q = _inputs((2, 7, 3))[0]
    k, v = _inputs((2, 11, 3), seed=1)[1:]
    assert torch.autograd.gradcheck(lambda q, k, v: lt.linear_attention(q, k, v, feature_map=feature_map, scale=0.6),
                                    (q, k, v))


@pytest.mark.parametrize("with_keys", [True, False])
def test_gradcheck_noncausal_state(with_keys):
    """linear_attention's initial_state and returned state (the sums of every key), differentiable; with
    k, v None the queries read the state alone."""
    q = _inputs((2, 5, 3))[0]
    k, v = _inputs((2, 7, 3), seed=1)[1:] if with_keys else (None, None)
    S0 = torch.rand(2, 3, 2, dtype=torch.float64, requires_grad=True)
    Z0 = (torch.rand(2, 3, dtype=torch.float64) + 0.5).requires_grad_()

    def f(q, S0, Z0, *kv):
        out, (S, Z) = lt.linear_attention(q, *(kv or (k, v)), initial_state=(S0, Z0), return_state=True, scale=0.7)
        return out, S, Z

    assert torch.autograd.gradcheck(f, (q, S0, Z0) + ((k, v) if with_keys else ()))
    assert torch.autograd.gradcheck(lambda q, S0, Z0: lt.linear_attention(q, k, v, initial_state=(S0, Z0)),
                                    (q, S0, Z0))
    if with_keys:  # the keys' and the queries' lengths (right padding)
        assert torch.autograd.gradcheck(lambda q, k, v: lt.linear_attention(q, k, v, lengths=np.array([7, 4])),
                                        (q, k, v))

        def padded(q, k, v, S0, Z0):
            out, (S, Z) = lt.linear_attention(q, k, v, lengths=np.array([7, 4]), query_lengths=np.array([2, 5]),
                                              initial_state=(S0, Z0), return_state=True)
            return out, S, Z

        assert torch.autograd.gradcheck(padded, (q, k, v, S0, Z0))
        out = lt.linear_attention(q, k, v, query_lengths=np.array([2, 0]))
        out.sum().backward()
        assert (out[0, 2:] == 0).all() and (out[1] == 0).all()
        assert (q.grad[0, 2:] == 0).all() and (q.grad[1] == 0).all() and (k.grad[1] == 0).all()


@pytest.mark.parametrize("feature_map", ["softplus", Taylor(), DPFP(2)])
def test_gradcheck_other_maps(feature_map):
    """Maps the backward kernel does not differentiate itself (their vjp), causal and not."""
    q, k, v = _inputs()
    assert torch.autograd.gradcheck(lambda q, k, v: lt.causal_linear_attention(q, k, v, feature_map=feature_map),
                                    (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: lt.linear_attention(q, k, v, feature_map=feature_map), (q, k, v))


@pytest.mark.parametrize("per_dimension", [False, True])
def test_gradcheck_with_gate_and_decay(per_dimension):
    q, k, v = _inputs()
    shape = q.shape if per_dimension else q.shape[:-1]  # a gate per key dimension (GLA) or per position
    gate = (-torch.rand(*shape, dtype=torch.float64) - 0.01).requires_grad_()

    def f(q, k, v, gate):
        return lt.causal_linear_attention(q, k, v, gate=gate, decay=0.9)

    assert torch.autograd.gradcheck(f, (q, k, v, gate))


@pytest.mark.parametrize("shape", [(3,), ()])
def test_gradcheck_decay_tensor(shape):
    """A decay given as a tensor is differentiated (per head, or one for all), with and without a gate."""
    q, k, v = _inputs((2, 3, 9, 3))
    decay = torch.tensor([0.9, 0.8, 0.95][:shape[0]] if shape else 0.9, dtype=torch.float64).requires_grad_()
    gate = (-torch.rand(2, 3, 9, dtype=torch.float64) - 0.01).requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k, v, d: lt.causal_linear_attention(q, k, v, decay=d), (q, k, v, decay))
    assert torch.autograd.gradcheck(lambda q, k, v, d, g: lt.causal_linear_attention(q, k, v, decay=d, gate=g),
                                    (q, k, v, decay, gate))
    d32 = decay.detach().float().requires_grad_()  # (its gradient in its own dtype)
    lt.causal_linear_attention(q, k, v, decay=d32).sum().backward()
    assert d32.grad.dtype == torch.float32 and d32.grad.shape == d32.shape and torch.all(d32.grad != 0)


def _learned_maps(d=3):
    rng = np.random.default_rng(3)
    return [Hedgehog(rng.standard_normal((d, 4)) * 0.5, rng.standard_normal(4) * 0.1),
            T2R(rng.standard_normal((d, 4)), rng.standard_normal(4) * 0.1 + 0.3),
            Performer.random(d, 5, seed=1).scaled(0.7),
            ReBased(rng.standard_normal(d) + 1, rng.standard_normal(d) * 0.1)]


@pytest.mark.parametrize("index", range(4))
def test_gradcheck_trainable_maps(index):
    """A TrainableMap's parameters get gradients through both attentions and through the map itself."""
    fmap = lt.TrainableMap(_learned_maps()[index], dtype=torch.float64)
    q, k, v = _inputs()
    params = fmap.parameter_tensors()
    assert [name for name, _ in fmap.named_parameters()] == list(fmap.template.param_names)
    assert torch.autograd.gradcheck(lambda q, k, v, *p: lt.causal_linear_attention(q, k, v, feature_map=fmap),
                                    (q, k, v) + params)
    assert torch.autograd.gradcheck(lambda q, k, v, *p: lt.linear_attention(q, k, v, feature_map=fmap),
                                    (q, k, v) + params)
    assert torch.autograd.gradcheck(lambda x, *p: fmap(x), (q,) + params)


def test_trainable_map_matches_numpy_and_trains():
    """float32 parameters, float64 inputs: the gradients are linattn's vjp's (in the parameters'
    dtype), an optimiser's steps change the map the kernels run and fit a teacher's output."""
    base = _learned_maps(4)[0]
    fmap = lt.TrainableMap(base)
    q, k, v = _inputs((2, 20, 4), dv=3, seed=2)
    teacher = base.with_params(weight=np.random.default_rng(4).standard_normal((4, 4)))  # (a target it can reach)
    target = lt.causal_linear_attention(q, k, v, feature_map=teacher).detach()
    out = lt.causal_linear_attention(q, k, v, feature_map=fmap, lengths=np.array([20, 13]))
    ((out - target) ** 2).sum().backward()
    _, vjp = linattn.causal_linear_attention_vjp(*(x.detach().numpy() for x in (q, k, v)), lengths=np.array([20, 13]),
                                                 feature_map=base.with_params(**{n: p.detach().numpy() for n, p in
                                                                                 fmap.named_parameters()}))
    want = vjp(2 * (out - target).detach().numpy())[-1]
    for name, p in fmap.named_parameters():
        assert p.grad.dtype == torch.float32
        np.testing.assert_allclose(p.grad.numpy(), want[name], rtol=1e-6, atol=1e-6)
    opt = torch.optim.Adam(fmap.parameters(), lr=0.05)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = ((lt.causal_linear_attention(q.detach(), k.detach(), v.detach(), feature_map=fmap) - target) ** 2).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]  # (12.2 -> 2.3 here)
    np.testing.assert_array_equal(fmap.numpy_map().weight, fmap.weight.detach().numpy().astype(np.float64))


def test_inplace_change_after_forward_is_refused():
    """The backward reads the inputs: torch's own error when one was changed in place after the forward."""
    q, k, v = _inputs()
    for fn in (lt.causal_linear_attention, lt.linear_attention):
        out = fn(q, k, v)
        with torch.no_grad():
            k.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    fmap = lt.TrainableMap(_learned_maps()[1], dtype=torch.float64)
    y = fmap(q)
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_second_derivatives_raise():
    """A gradient taken with create_graph=True is the plain gradient, and differentiating it again (a
    gradient penalty) raises: the backward runs NumPy, so those terms were left out without a word."""
    q, k, v = _inputs()
    fmap = lt.TrainableMap(_learned_maps()[1], dtype=torch.float64)
    for fn in (lt.causal_linear_attention, lt.linear_attention, lambda q, k, v: fmap(q) * v.sum()):
        want = torch.autograd.grad(fn(q, k, v).sum(), (q, v))
        out = fn(q, k, v)
        got = torch.autograd.grad(out.sum(), (q, v), create_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="first derivatives only"):
            (out.sum() + sum((g ** 2).sum() for g in got)).backward()


def test_against_pytorch_autograd():
    q, k, v = _inputs((2, 3, 40, 4), dv=5, dtype=torch.float32, seed=1)
    out = lt.causal_linear_attention(q, k, v)
    w = torch.randn(out.shape)
    (out * w).sum().backward()
    got = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    ref, _, _ = _plain(q, k, v)
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)
    for g, x in zip(got, (q, k, v)):
        torch.testing.assert_close(g, x.grad, rtol=2e-4, atol=2e-5)


def test_bad_input():
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="q: expected float32 or float64, got torch.int64"):
        lt.causal_linear_attention(q.detach().long(), k, v)
    with pytest.raises(TypeError, match="k: expected a torch.Tensor"):
        lt.causal_linear_attention(q, np.zeros((2, 9, 3)), v)
    with pytest.raises(TypeError, match="feature_map: expected a map of linattn.feature_maps with parameters"):
        lt.TrainableMap(Taylor())
    with pytest.raises(TypeError, match="feature_map: expected a map"):
        lt.TrainableMap("elu")
    with pytest.raises(TypeError, match="dtype: expected torch.float32 or torch.float64"):
        lt.TrainableMap(_learned_maps()[0], dtype=torch.float16)
    fmap = lt.TrainableMap(_learned_maps()[0])
    with torch.no_grad():
        fmap.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="weight: expected finite values"):
        lt.causal_linear_attention(q, k, v, feature_map=fmap)
    with pytest.raises(TypeError, match="decay: expected float32 or float64"):
        lt.causal_linear_attention(q, k, v, decay=torch.tensor([1, 1]))
    for fn in (lt.causal_linear_attention, lt.linear_attention):
        for bad in ("SZ", 1.0, (torch.zeros(2, 3, 4),)):
            with pytest.raises(TypeError, match=f"initial_state: expected a pair of tensors \\(S, Z\\), got "
                                                f"{type(bad).__name__}"):
                fn(q, k, v, initial_state=bad)
        for bad in (torch.ones(2), "yes", 1):  # (a tensor of several values has no truth value: not a RuntimeError)
            with pytest.raises(TypeError, match=f"return_state: expected True or False, got {type(bad).__name__}"):
                fn(q, k, v, return_state=bad)


@settings(max_examples=40, deadline=None)
@given(lead=st.sampled_from([(2,), (2, 3)]), n=st.integers(1, 40), d=st.integers(1, 4), dv=st.integers(1, 3),
       f64=st.booleans(), map_index=st.sampled_from([None, 0, 1, 2, 3]),
       gating=st.sampled_from(["none", "decay", "position", "dimension"]), with_state=st.booleans(),
       with_lengths=st.booleans(), scale=st.sampled_from([None, 0.5]), seed=st.integers(0, 2**31))
def test_options_together_match_numpy(lead, n, d, dv, f64, map_index, gating, with_state, with_lengths, scale, seed):
    """The options drawn together (hypothesis): linattn.torch's outputs and every gradient (a TrainableMap's
    parameters, a decay tensor's included) equal linattn's NumPy vjp on the same arrays."""
    rng = np.random.default_rng(seed)
    dtype = torch.float64 if f64 else torch.float32
    ndt = np.float64 if f64 else np.float32
    base = None if map_index is None else _learned_maps(d)[map_index]
    fmap = "elu" if base is None else lt.TrainableMap(base, dtype=dtype)
    dk = d if base is None else base.out_dim(d)
    arrays = {"q": rng.standard_normal(lead + (n, d)) * 0.5, "k": rng.standard_normal(lead + (n, d)) * 0.5,
              "v": rng.standard_normal(lead + (n, dv))}
    if with_state:
        arrays["S"], arrays["Z"] = rng.standard_normal(lead + (dk, dv)) * 0.3, rng.uniform(0.5, 1.5, lead + (dk,))
    if gating in ("position", "dimension"):
        arrays["gate"] = np.log(rng.uniform(0.6, 0.98, lead + (n,) + ((dk,) if gating == "dimension" else ())))
    if gating == "decay":
        arrays["decay"] = rng.uniform(0.7, 0.95, lead[-1:])
    arrays = {name: a.astype(ndt) for name, a in arrays.items()}
    lengths = rng.integers(0, n + 1, lead) if with_lengths else None
    t = {name: torch.tensor(a, requires_grad=True) for name, a in arrays.items()}
    out, (S, Z) = lt.causal_linear_attention(t["q"], t["k"], t["v"], feature_map=fmap, scale=scale, lengths=lengths,
                                             initial_state=(t["S"], t["Z"]) if with_state else None,
                                             gate=t.get("gate"), decay=t.get("decay"), return_state=True)
    g_out, g_S, g_Z = (rng.standard_normal(x.shape).astype(ndt) for x in (out, S, Z))
    ((out * torch.from_numpy(g_out)).sum() + (S * torch.from_numpy(g_S)).sum()
     + (Z * torch.from_numpy(g_Z)).sum()).backward()
    ref, final, vjp = linattn.causal_linear_attention_vjp(
        arrays["q"], arrays["k"], arrays["v"], feature_map="elu" if base is None else fmap.numpy_map(), scale=scale,
        lengths=lengths, initial_state=linattn.State(arrays["S"], arrays["Z"]) if with_state else None,
        gate=arrays.get("gate"), decay=arrays.get("decay"), return_state=True)
    np.testing.assert_array_equal(out.detach().numpy(), ref)
    grads = list(vjp(g_out, (g_S, g_Z)))
    want = dict(zip("qkv", grads[:3]))
    rest = grads[3:]
    if with_state:
        want["S"], want["Z"] = rest[0].S, rest[0].Z
        rest = rest[1:]
    for name in ("gate", "decay"):
        if name in arrays:
            want[name], rest = rest[0], rest[1:]
    for name, grad in want.items():
        assert t[name].grad.dtype == dtype
        np.testing.assert_allclose(t[name].grad.numpy(), grad, rtol=1e-5 if not f64 else 1e-12, atol=1e-6)
    if base is not None:
        for name, p in fmap.named_parameters():
            np.testing.assert_allclose(p.grad.numpy(), rest[0][name], rtol=1e-5 if not f64 else 1e-12, atol=1e-6)
