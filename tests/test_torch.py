"""linattn.torch: autograd functions on CPU tensors, checked with torch.autograd.gradcheck in float64
and against PyTorch autograd through a plain PyTorch implementation of the same formula."""
import numpy as np
import pytest

from linattn.feature_maps import DPFP, Taylor

torch = pytest.importorskip("torch")
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
