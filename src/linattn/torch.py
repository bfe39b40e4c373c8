"""PyTorch autograd functions on CPU tensors, for training with linattn's kernels (``import linattn.torch``;
torch is imported only by this module).

``causal_linear_attention`` and ``linear_attention`` take and return ``torch.Tensor`` s (float32 or
float64, on the CPU) and are differentiable: the forward and the backward pass run linattn's kernels
(see :mod:`linattn.gradients`), through ``.numpy()`` views where the layout allows (no copy).
"""
import numpy as np
import torch

from . import gradients
from .state import State


def _array(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise TypeError(f"{name}: expected a CPU tensor, got one on {t.device} (linattn.torch runs on the CPU)")
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name}: expected float32 or float64, got {t.dtype}")
    return t.detach().numpy()


def _tensor(x):
    return None if x is None else torch.from_numpy(np.ascontiguousarray(x))


class _Causal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S0, Z0, gate, options):
        state = None if S0 is None else State(_array(S0, "initial_state.S"), _array(Z0, "initial_state.Z"))
        out, final, vjp = gradients.causal_linear_attention_vjp(
            _array(q, "q"), _array(k, "k"), _array(v, "v"), initial_state=state, return_state=True,
            gate=None if gate is None else _array(gate, "gate"), **options)
        ctx.vjp, ctx.has_state, ctx.has_gate = vjp, S0 is not None, gate is not None
        return _tensor(out), _tensor(final.S), _tensor(final.Z)

    @staticmethod
    def backward(ctx, dout, dS, dZ):
        grads = list(ctx.vjp(dout.contiguous().numpy(), State(dS.contiguous().numpy(), dZ.contiguous().numpy())))
        dq, dk, dv = (_tensor(g) for g in grads[:3])
        dS0 = dZ0 = dgate = None
        rest = grads[3:]
        if ctx.has_state:
            dS0, dZ0 = _tensor(rest[0].S), _tensor(rest[0].Z)
            rest = rest[1:]
        if ctx.has_gate:
            dgate = _tensor(rest[0])
        return dq, dk, dv, dS0, dZ0, dgate, None


class _NonCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, options):
        out, vjp = gradients.linear_attention_vjp(_array(q, "q"), _array(k, "k"), _array(v, "v"), **options)
        ctx.vjp = vjp
        return _tensor(out)

    @staticmethod
    def backward(ctx, dout):
        return (*(_tensor(g) for g in ctx.vjp(dout.contiguous().numpy())[:3]), None)  # (a map's weights: constants)


def causal_linear_attention(q, k, v, *, feature_map="elu", eps=1e-6, normalize=True, initial_state=None,
                            return_state=False, lengths=None, decay=None, gate=None, scale=None):
    """:func:`linattn.causal_linear_attention` on CPU tensors, differentiable (q, k, v, the initial
    state and ``gate``: a tensor of log gates, per position or per key dimension). ``initial_state``: a pair of tensors
    (S, Z); ``return_state=True`` returns ``(out, (S, Z))``, differentiable too. ``decay``: constants
    (not differentiated here). Feature maps: any of :mod:`linattn.feature_maps` (a learned map's
    weights are constants here).

    Examples
    --------
    >>> import torch, linattn.torch
    >>> q, k, v = (torch.randn(2, 4, 64, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> linattn.torch.causal_linear_attention(q, k, v).square().sum().backward()
    >>> q.grad.shape
    torch.Size([2, 4, 64, 16])
    """
    S0, Z0 = (None, None) if initial_state is None else initial_state
    if decay is not None and isinstance(decay, torch.Tensor):
        decay = _array(decay, "decay")
    options = dict(feature_map=feature_map, eps=eps, normalize=normalize, lengths=lengths, scale=scale,
                   decay=decay)
    out, S, Z = _Causal.apply(q, k, v, S0, Z0, gate, options)
    return (out, (S, Z)) if return_state else out


def linear_attention(q, k, v, *, feature_map="elu", eps=1e-6, normalize=True, scale=None):
    """:func:`linattn.linear_attention` on CPU tensors, differentiable."""
    return _NonCausal.apply(q, k, v, dict(feature_map=feature_map, eps=eps, normalize=normalize, scale=scale))
