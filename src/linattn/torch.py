"""PyTorch autograd functions on CPU tensors, for training with linattn's kernels (``import linattn.torch``;
torch is imported only by this module).

``causal_linear_attention`` and ``linear_attention`` take and return ``torch.Tensor`` s (float32 or
float64, on the CPU) and are differentiable: the forward and the backward pass run linattn's kernels
(see :mod:`linattn.gradients`), through ``.numpy()`` views where the layout allows (no copy).
``TrainableMap`` makes a map's parameters (Hedgehog's, T2R's, ...) ``torch.nn.Parameter`` s.
First derivatives only: differentiating a gradient through them (``create_graph=True``, a gradient
penalty, say) raises a RuntimeError rather than leaving out those terms.
"""
import numpy as np
import torch

from . import gradients
from .checks import check_flag
from .feature_maps import FeatureMap
from .state import State


def _array(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise TypeError(f"{name}: expected a CPU tensor, got one on {t.device} (linattn.torch runs on the CPU)")
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name}: expected float32 or float64, got {t.dtype}")
    return t.detach().numpy()


def _state_tensors(state):
    """(S, Z) of an ``initial_state`` (None: (None, None)); the tensors themselves are checked by _array."""
    if state is None:
        return None, None
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise TypeError(f"initial_state: expected a pair of tensors (S, Z), got {type(state).__name__}")
    return tuple(state)


def _tensor(x):
    return None if x is None else torch.from_numpy(np.ascontiguousarray(x))


def _grad_like(grad, like):
    """A gradient from linattn (an array, or None) as a tensor for the input ``like`` (its dtype)."""
    if grad is None or not isinstance(like, torch.Tensor):
        return None
    return _tensor(np.asarray(grad)).to(like.dtype).reshape(like.shape)


class _FirstDerivativeOnly(torch.autograd.Function):
    """The identity on gradients that linattn computed outside autograd: differentiating them raises.
    (torch's ``once_differentiable`` raises only when the incoming gradients need a graph; a gradient
    penalty's do not, and its second-derivative terms were left out without a word.)"""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(g.clone() for g in grads)

    @staticmethod
    def backward(ctx, *args):
        raise RuntimeError("linattn.torch computes first derivatives only (its backward runs NumPy code): a "
                           "gradient taken with create_graph=True cannot be differentiated again")


def _first_only(grads):
    """The gradients a backward returns (tensors and Nones); while a graph is being built
    (``create_graph=True``), as tensors whose own gradient raises."""
    if not torch.is_grad_enabled():
        return grads
    at = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    marked = _FirstDerivativeOnly.apply(*(grads[i].detach().requires_grad_() for i in at))
    grads = list(grads)
    for i, g in zip(at, marked):
        grads[i] = g
    return tuple(grads)


class _Causal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S0, Z0, gate, decay, fmap, options, return_state, *params):
        state = None if S0 is None else State(_array(S0, "initial_state.S"), _array(Z0, "initial_state.Z"))
        res = gradients.causal_linear_attention_vjp(
            _array(q, "q"), _array(k, "k"), _array(v, "v"), initial_state=state, return_state=return_state,
            gate=None if gate is None else _array(gate, "gate"),
            decay=_array(decay, "decay") if isinstance(decay, torch.Tensor) else decay,
            feature_map=_numpy_map(fmap), **options)
        ctx.save_for_backward(q, k, v, gate)  # (the vjp reads them: torch refuses a backward if changed in place)
        ctx.vjp, ctx.has_state, ctx.has_gate = res[-1], S0 is not None, gate is not None
        ctx.decay, ctx.fmap, ctx.params = decay, fmap, params
        final = res[1] if return_state else State(None, None)  # (no state asked: none made, no zero gradient)
        return _tensor(res[0]), _tensor(final.S), _tensor(final.Z)

    @staticmethod
    def backward(ctx, dout, dS, dZ):
        ctx.saved_tensors  # (raises if q, k, v or the gate changed since the forward)
        dout = dout.detach().contiguous().numpy()
        dstate = None if dS is None else State(*(g.detach().contiguous().numpy() for g in (dS, dZ)))
        grads = list(ctx.vjp(dout, dstate))
        dq, dk, dv = (_tensor(g) for g in grads[:3])
        rest = grads[3:]
        dS0 = dZ0 = dgate = ddecay = None
        if ctx.has_state:
            dS0, dZ0 = _tensor(rest[0].S), _tensor(rest[0].Z)
            rest = rest[1:]
        if ctx.has_gate:
            dgate, rest = _tensor(rest[0]), rest[1:]
        if ctx.decay is not None:
            ddecay, rest = _grad_like(rest[0], ctx.decay), rest[1:]
        return _first_only((dq, dk, dv, dS0, dZ0, dgate, ddecay, None, None, None,
                            *_param_grads(ctx.fmap, ctx.params, rest)))


class _NonCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S0, Z0, fmap, options, return_state, *params):
        state = None if S0 is None else State(_array(S0, "initial_state.S"), _array(Z0, "initial_state.Z"))
        res = gradients.linear_attention_vjp(
            _array(q, "q"), None if k is None else _array(k, "k"), None if v is None else _array(v, "v"),
            initial_state=state, return_state=return_state, feature_map=_numpy_map(fmap), **options)
        ctx.save_for_backward(q, k, v)  # (the vjp reads them: torch refuses a backward if changed in place)
        ctx.vjp, ctx.has_state, ctx.fmap, ctx.params = res[-1], S0 is not None, fmap, params
        final = res[1] if return_state else State(None, None)
        return _tensor(res[0]), _tensor(final.S), _tensor(final.Z)

    @staticmethod
    def backward(ctx, dout, dS, dZ):
        ctx.saved_tensors  # (raises if q, k or v changed since the forward)
        dout = dout.detach().contiguous().numpy()
        dstate = None if dS is None else State(*(g.detach().contiguous().numpy() for g in (dS, dZ)))
        grads = ctx.vjp(dout, dstate)
        rest = grads[3:]
        dS0 = dZ0 = None
        if ctx.has_state:
            dS0, dZ0 = _tensor(rest[0].S), _tensor(rest[0].Z)
            rest = rest[1:]
        return _first_only((*(_tensor(g) for g in grads[:3]), dS0, dZ0, None, None, None,
                            *_param_grads(ctx.fmap, ctx.params, rest)))


class _MapFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmap, *params):
        xa = _array(x, "x")
        numpy_map = fmap.numpy_map()
        y = _tensor(numpy_map(xa))
        ctx.save_for_backward(x, y)  # (torch then refuses a backward after either was changed in place)
        ctx.numpy_map, ctx.fmap, ctx.params = numpy_map, fmap, params
        return y

    @staticmethod
    def backward(ctx, dy):
        x, y = ctx.saved_tensors
        dx, dparams = ctx.numpy_map._vjps(x.detach().numpy(), dy.detach().contiguous().numpy(), y.detach().numpy())
        return _first_only((_grad_like(dx, x), None, *_param_grads(ctx.fmap, ctx.params, [dparams])))


class TrainableMap(torch.nn.Module):
    """A feature map of :mod:`linattn.feature_maps` with parameters (``Hedgehog``, ``T2R``,
    ``Performer``, ``ReBased``) whose parameters are ``torch.nn.Parameter`` s, trained through
    :func:`causal_linear_attention` and :func:`linear_attention` (pass it as ``feature_map=``): the
    kernels run the map with the parameters' current values and the backward returns their gradients.
    Calling the module on a tensor x (..., D) returns phi(x), differentiable too.

    Parameters
    ----------
    feature_map : linattn.feature_maps.FeatureMap
        The map and the parameters' initial values (its input scale and other settings are kept).
    dtype : torch.dtype, default torch.float32
        The parameters' dtype (the kernels compute in the inputs' dtype either way).

    Examples
    --------
    >>> import numpy as np, torch, linattn.torch
    >>> from linattn.feature_maps import Hedgehog
    >>> fmap = linattn.torch.TrainableMap(Hedgehog(np.eye(16, 8)))
    >>> [name for name, _ in fmap.named_parameters()]
    ['weight', 'bias']
    >>> q, k, v = (torch.randn(2, 4, 64, 16) for _ in range(3))
    >>> linattn.torch.causal_linear_attention(q, k, v, feature_map=fmap).square().sum().backward()
    >>> fmap.weight.grad.shape
    torch.Size([16, 8])
    """

    def __init__(self, feature_map, dtype=torch.float32):
        super().__init__()
        if not isinstance(feature_map, FeatureMap) or not feature_map.param_names:
            raise TypeError(f"feature_map: expected a map of linattn.feature_maps with parameters (Hedgehog, T2R, "
                            f"Performer, ReBased), got {feature_map!r}")
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
        self.template = feature_map
        for name, value in feature_map.param_values().items():
            self.register_parameter(name, torch.nn.Parameter(torch.tensor(value, dtype=dtype)))

    def parameter_tensors(self):
        """The parameters, in the order of the map's ``param_names``."""
        return tuple(getattr(self, name) for name in self.template.param_names)

    def numpy_map(self):
        """The map of :mod:`linattn.feature_maps` with the parameters' current values (a ValueError
        names a parameter that has become non-finite)."""
        return self.template.with_params(**{name: t.detach().cpu().numpy()
                                            for name, t in zip(self.template.param_names, self.parameter_tensors())})

    def forward(self, x):
        return _MapFunction.apply(x, self, *self.parameter_tensors())

    def extra_repr(self):
        return repr(self.template)


def _numpy_map(fmap):
    return fmap.numpy_map() if isinstance(fmap, TrainableMap) else fmap


def _map_params(fmap):
    return fmap.parameter_tensors() if isinstance(fmap, TrainableMap) else ()


def _param_grads(fmap, params, rest):
    """The parameters' gradients (a TrainableMap's, from the dict linattn's vjp returns last)."""
    if not params:
        return ()
    grads = rest[-1]
    return tuple(_grad_like(grads[name], p) for name, p in zip(fmap.template.param_names, params))


def causal_linear_attention(q, k, v, *, feature_map="elu", eps=1e-6, normalize=True, initial_state=None,
                            return_state=False, lengths=None, decay=None, gate=None, scale=None):
    """:func:`linattn.causal_linear_attention` on CPU tensors, differentiable: q, k, v, the initial
    state, ``gate`` (a tensor of log gates, per position or per key dimension), ``decay`` (a tensor of
    decay factors, per head or of any shape that broadcasts to the leading dims) and the parameters of
    a :class:`TrainableMap`. ``initial_state``: a pair of tensors (S, Z); ``return_state=True``
    returns ``(out, (S, Z))``, differentiable too. Feature maps: any of :mod:`linattn.feature_maps`
    (a map with parameters given as such: its parameters are constants; as a :class:`TrainableMap`:
    trained).

    Examples
    --------
    >>> import torch, linattn.torch
    >>> q, k, v = (torch.randn(2, 4, 64, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> linattn.torch.causal_linear_attention(q, k, v).square().sum().backward()
    >>> q.grad.shape
    torch.Size([2, 4, 64, 16])
    """
    S0, Z0 = _state_tensors(initial_state)
    return_state = check_flag(return_state, "return_state")
    options = dict(eps=eps, normalize=normalize, lengths=lengths, scale=scale)
    out, S, Z = _Causal.apply(q, k, v, S0, Z0, gate, decay, feature_map, options, return_state,
                              *_map_params(feature_map))
    return (out, (S, Z)) if return_state else out


def linear_attention(q, k=None, v=None, *, feature_map="elu", eps=1e-6, normalize=True, initial_state=None,
                     return_state=False, lengths=None, query_lengths=None, scale=None):
    """:func:`linattn.linear_attention` on CPU tensors, differentiable (q, k, v, the initial state and the
    parameters of a :class:`TrainableMap`); k and v may have another length than q (cross-attention),
    or be None with ``initial_state`` (a pair of tensors (S, Z): the sums of keys seen before);
    ``return_state=True`` returns ``(out, (S, Z))``, the state of every key, differentiable too;
    ``lengths``, ``query_lengths``: the keys' and the queries' true lengths (right padding), as for
    :func:`linattn.linear_attention`."""
    S0, Z0 = _state_tensors(initial_state)
    return_state = check_flag(return_state, "return_state")
    options = dict(eps=eps, normalize=normalize, scale=scale, lengths=lengths, query_lengths=query_lengths)
    out, S, Z = _NonCausal.apply(q, k, v, S0, Z0, feature_map, options, return_state, *_map_params(feature_map))
    return (out, (S, Z)) if return_state else out
