"""Feature maps (issue 12's targets), as ratios measured in one process, interleaved: Based's Taylor map
at D = 16 computed inside the kernels vs the same map as a NumPy callable (time: target >= 2x faster;
peak NumPy-level memory: target <= 1/4), and every built-in map's forward vs the identity map on
inputs already mapped to the same D' (target <= 1.3x: what computing phi inside the kernel costs), and
the same for forward and backward."""
import math
import tracemalloc

import numpy as np

import linattn
from linattn import feature_maps as fm

from .common import SMOKE, inputs, interleaved_ratio


def taylor_numpy(x):
    """The Taylor map as a NumPy user writes it (all D**2 products, as flash-linear-attention's)."""
    d = x.shape[-1]
    outer = (x[..., :, None] * x[..., None, :]).reshape(x.shape[:-1] + (d * d,))
    return np.concatenate([np.ones(x.shape[:-1] + (1,), x.dtype), x / np.float32(d ** 0.25),
                           outer / np.float32(math.sqrt(2 * d))], -1)


def _qkv(d, dv=64):
    n = 256 if SMOKE else 2048
    q, k, _ = inputs((1, 8, n, d))
    v = inputs((1, 8, n, dv), seed=1)[2]
    return q, k, v


def _peak(fn):
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


class TaylorFusedVsCallable:
    """B1 H8 N2048, D = 16 (D' = 153), Dv = 64, float32."""
    timeout = 600

    def setup(self):
        self.q, self.k, self.v = _qkv(16)
        self.call(fm.Taylor()), self.call(taylor_numpy)

    def call(self, fmap):
        return linattn.causal_linear_attention(self.q, self.k, self.v, feature_map=fmap)

    def track_callable_over_fused_time(self):
        return interleaved_ratio(lambda: self.call(taylor_numpy), lambda: self.call(fm.Taylor()), 3 if SMOKE else 9)

    track_callable_over_fused_time.unit = "x fused"

    def track_fused_over_callable_memory(self):
        return _peak(lambda: self.call(fm.Taylor())) / _peak(lambda: self.call(taylor_numpy))

    track_fused_over_callable_memory.unit = "x callable"


def builtin_maps(d):
    """name -> (map, D) of every built-in map at a size a model would use it (D' = 64 to 153)."""
    rng = np.random.default_rng(2)
    maps = {name: (fm.Elementwise(name), d) for name in ("elu", "squared_relu", "gelu", "silu", "sigmoid",
                                                         "softplus")}
    maps.update({
        "elu scaled": (fm.Elementwise("elu").scaled(0.5), d),
        "Taylor D16": (fm.Taylor(), 16),
        "ReBased D16": (fm.ReBased(np.ones(16), np.zeros(16)), 16),
        "DPFP nu1 D32": (fm.DPFP(1), 32),
        "Performer m64": (fm.Performer.random(d, 64, seed=0).scaled(d ** -0.25), d),
        "Hedgehog m32": (fm.Hedgehog(rng.standard_normal((d, 32)) / 8), d),
        "T2R m64": (fm.T2R(rng.standard_normal((d, 64)) / 8), d),
    })
    return maps


def numpy_map(fmap):
    """A learned or random-feature map as a NumPy user writes it, from the map's own weights (float32)."""
    s = fmap.input_scale
    w = (fmap.weight * s).astype(np.float32)  # (s x) W = x (s W)
    if isinstance(fmap, fm.Performer):
        half, inv = np.float32(s * s / 2), np.float32(1 / math.sqrt(w.shape[1]))
        return lambda x: np.exp(x @ w - half * (x * x).sum(-1, keepdims=True)) * inv
    b = fmap.bias.astype(np.float32)
    if isinstance(fmap, fm.T2R):
        return lambda x: np.maximum(x @ w + b, 0)

    def hedgehog(x):
        z = x @ w + b
        z = np.concatenate([2 * z, -2 * z], -1)
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    return hedgehog


class LearnedFusedVsCallable:
    """B1 H8 N2048 D64, Dv = 64, float32, causal: the learned and random-feature maps as NumPy callables
    (the projection, then the map, then the kernel) over the same maps computed inside the kernels."""
    params = ["Performer m64", "Hedgehog m32", "T2R m64"]
    param_names = ["map"]
    timeout = 600

    def setup(self, name):
        self.fmap, d = builtin_maps(64)[name]
        self.numpy_map = numpy_map(self.fmap)
        self.q, self.k, self.v = _qkv(d)

    def track_callable_over_fused_time(self, name):
        q, k, v = self.q, self.k, self.v
        return interleaved_ratio(lambda: linattn.causal_linear_attention(q, k, v, feature_map=self.numpy_map),
                                 lambda: linattn.causal_linear_attention(q, k, v, feature_map=self.fmap),
                                 3 if SMOKE else 9)

    track_callable_over_fused_time.unit = "x fused"


class MapOverIdentity:
    """B1 H8 N2048, Dv = 64, float32, causal: each map's forward over identity on pre-mapped inputs."""
    params = list(builtin_maps(64))
    param_names = ["map"]
    timeout = 600

    def setup(self, name):
        self.fmap, d = builtin_maps(64)[name]
        self.q, self.k, self.v = _qkv(d)
        self.qm, self.km = self.fmap(self.q), self.fmap(self.k)

    def track_over_identity_premapped(self, name):
        q, k, v, qm, km = self.q, self.k, self.v, self.qm, self.km
        return interleaved_ratio(lambda: linattn.causal_linear_attention(q, k, v, feature_map=self.fmap),
                                 lambda: linattn.causal_linear_attention(qm, km, v, feature_map="identity"),
                                 3 if SMOKE else 9)

    track_over_identity_premapped.unit = "x identity"


class MapGradientOverIdentity(MapOverIdentity):
    """The same, forward and backward (``causal_linear_attention_vjp``, then ``vjp(dout)``): what
    differentiating through the map costs (the elementwise maps' and the pair maps' derivatives inside the
    backward kernel, ReBased's but its norm's, which follows it as the learned maps' vjps do)."""
    params = ["gelu", "Taylor D16", "ReBased D16", "DPFP nu1 D32", "Performer m64", "Hedgehog m32", "T2R m64"]

    def setup(self, name):
        super().setup(name)
        self.dout = inputs(self.v.shape, seed=2)[0]

    def _forward_backward(self, q, k, fmap):
        _, vjp = linattn.causal_linear_attention_vjp(q, k, self.v, feature_map=fmap)
        vjp(self.dout)

    def track_over_identity_premapped(self, name):
        return interleaved_ratio(lambda: self._forward_backward(self.q, self.k, self.fmap),
                                 lambda: self._forward_backward(self.qm, self.km, "identity"), 3 if SMOKE else 7)

    track_over_identity_premapped.unit = "x identity"


class StepMapOverIdentity:
    """One decoding step (``step``) at B1 H8, Dv = 64, float32, with each built-in map, over the step
    with the identity map on q and k already mapped to the same D' (the kernel computes the map for
    every head of the step itself)."""
    params = list(builtin_maps(64))
    param_names = ["map"]
    timeout = 300

    def setup(self, name):
        self.fmap, d = builtin_maps(64)[name]
        rng = np.random.default_rng(3)
        self.q, self.k = ((rng.standard_normal((1, 8, d)) * 0.5).astype(np.float32) for _ in range(2))
        self.v = rng.standard_normal((1, 8, 64)).astype(np.float32)
        self.qm, self.km = self.fmap(self.q), self.fmap(self.k)
        dk = self.qm.shape[-1]
        self.state, self.state_id = linattn.State.zeros((1, 8), dk, 64), linattn.State.zeros((1, 8), dk, 64)

    def _mapped(self):
        linattn.step(self.q, self.k, self.v, self.state, feature_map=self.fmap)

    def _identity(self):
        linattn.step(self.qm, self.km, self.v, self.state_id, feature_map="identity")

    def time_step(self, name):
        self._mapped()

    def track_over_identity_premapped(self, name):
        calls = 20 if SMOKE else 200

        def block(f):
            def run():
                for _ in range(calls):
                    f()
            return run

        return interleaved_ratio(block(self._mapped), block(self._identity), 3 if SMOKE else 9)

    track_over_identity_premapped.unit = "x identity"
