"""Gradients (issue 14's targets), as ratios in one process, interleaved: the backward pass over the
forward (causal, float32, D = Dv = 64; target <= 2.5x), and forward + backward against PyTorch
autograd through the chunked PyTorch form of ../shared/bench/peers.py when torch is installed
(target: >= 2x faster)."""
import numpy as np

import linattn

from .common import SMOKE, inputs, interleaved_ratio

CHUNK = 64


def torch_chunked_forward_backward(q, k, v, dout):
    """The chunkwise form in PyTorch (linattn.benchmarks' twin of peers.torch_chunked), then autograd's
    backward."""
    import torch

    from linattn.benchmarks.torch_transformer import chunked_linear_attention

    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    chunked_linear_attention(tq, tk, tv, chunk=CHUNK)[0].backward(torch.from_numpy(dout))
    return tq.grad, tk.grad, tv.grad


def _shape(name):
    b, h, n = {"B1 H8 N2048": (1, 8, 2048), "B2 H4 N8192": (2, 4, 8192), "B1 H1 N16384": (1, 1, 16384)}[name]
    return (b, h, 256 if SMOKE else n, 64)


class Backward:
    params = ["B1 H8 N2048", "B2 H4 N8192"]
    param_names = ["shape"]
    timeout = 600

    def setup(self, shape):
        self.q, self.k, self.v = inputs(_shape(shape))
        self.dout = inputs(_shape(shape), seed=1)[2]

    def forward_backward(self):
        _, vjp = linattn.causal_linear_attention_vjp(self.q, self.k, self.v)
        return vjp(self.dout)

    def track_backward_over_forward(self, shape):
        """(forward + backward - forward) / forward, from interleaved timings."""
        ratio = interleaved_ratio(self.forward_backward,
                                  lambda: linattn.causal_linear_attention(self.q, self.k, self.v), 3 if SMOKE else 9)
        return ratio - 1

    track_backward_over_forward.unit = "x forward"

    def track_page_faults_per_training_step(self, shape):
        """Minor page faults of one training step's attention (forward, vjp, backward, every result
        dropped): 0 while large results are reused (linattn.workspace); ~2600 at B2 H4 N8192 when they
        were fresh arrays (at B1 H8 N2048 that depended on what else was freed with them: 0 to ~2000)."""
        try:
            import resource
        except ImportError:  # (not on Windows)
            return float("nan")

        def step():  # (as a training loop: the step's results live until it ends)
            out = linattn.causal_linear_attention(self.q, self.k, self.v)
            _, vjp = linattn.causal_linear_attention_vjp(self.q, self.k, self.v)
            grads = vjp(self.dout)
            return len(grads) + out.ndim

        for _ in range(3):
            step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            step()
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5

    track_page_faults_per_training_step.unit = "faults"


class GatedBackward:
    """The backward pass with a gate over the forward with the same gate, B1 H8 N2048."""
    params = ["per position", "per key dimension"]
    param_names = ["gate"]
    timeout = 600

    def setup(self, gate):
        shape = _shape("B1 H8 N2048")
        self.q, self.k, self.v = inputs(shape)
        self.dout = inputs(shape, seed=1)[2]
        self.gate = -0.1 * inputs(shape if gate == "per key dimension" else shape[:3], seed=2)[0] ** 2

    def track_backward_over_forward(self, gate):
        q, k, v, g = self.q, self.k, self.v, self.gate

        def forward_backward():
            return linattn.causal_linear_attention_vjp(q, k, v, gate=g)[1](self.dout)

        return interleaved_ratio(forward_backward, lambda: linattn.causal_linear_attention(q, k, v, gate=g),
                                 3 if SMOKE else 5) - 1

    track_backward_over_forward.unit = "x forward"


class NoncausalBackward:
    """The same for non-causal attention (``linear_attention_vjp``): 15.6-16.3 when its backward was
    three linear_attention calls among NumPy passes and the maps' general vjp, 5.2-5.3 with a compiled
    pass per head before and after those calls (B1 H8 N2048, three runs each), 2.6-2.7 with
    cpu/noncausal_grad.py's backward kernel (3.9-4.0 before it, alternating processes on the EPYC); 3.14-3.23
    (B1 H1 N16384: 3.08-3.26) -> 2.36-2.41 (2.31-2.33) with the forward's state as the backward's [S | Z] and
    the queries' features and adjoints made once for dq and G (stop 67, two runs each, alternating processes, on
    the Zen 4). One long head is cut into segments (each sums its own part of G first)."""
    params = ["B1 H8 N2048", "B1 H1 N16384"]
    param_names = ["shape"]
    timeout = 600

    def setup(self, shape):
        Backward.setup(self, shape)

    def forward_backward(self):
        _, vjp = linattn.linear_attention_vjp(self.q, self.k, self.v)
        return vjp(self.dout)

    def track_backward_over_forward(self, shape):
        ratio = interleaved_ratio(self.forward_backward, lambda: linattn.linear_attention(self.q, self.k, self.v),
                                  3 if SMOKE else 9)
        return ratio - 1

    track_backward_over_forward.unit = "x forward"


class TorchAutograd:
    """Forward + backward: PyTorch autograd through the chunked form over linattn (skipped without torch)."""
    params = Backward.params
    param_names = Backward.param_names
    timeout = 600

    def setup(self, shape):
        try:
            import torch  # noqa: F401
        except ImportError:
            raise NotImplementedError("torch is not installed") from None
        Backward.setup(self, shape)

    forward_backward = Backward.forward_backward

    def track_torch_autograd_over_linattn(self, shape):
        return interleaved_ratio(lambda: torch_chunked_forward_backward(self.q, self.k, self.v, self.dout),
                                 self.forward_backward, 3 if SMOKE else 5)

    track_torch_autograd_over_linattn.unit = "x linattn"


class TinyBackward:
    """A tiny call's forward + backward (B1 H1 N16, where the Python around the kernels is most of the
    time) over a tiny forward: 7.2-7.3x when the vjp took the checked path (72-76 us), 4.2-4.4x with the
    short one (43-44 us)."""
    timeout = 120

    def setup(self):
        self.q, self.k, self.v = inputs((1, 1, 16, 64))
        self.dout = inputs((1, 1, 16, 64), seed=1)[2]
        Backward.forward_backward(self)  # (compiled before timing)

    def time_forward_backward(self):
        Backward.forward_backward(self)

    def track_forward_backward_over_forward(self):
        return interleaved_ratio(lambda: Backward.forward_backward(self),
                                 lambda: linattn.causal_linear_attention(self.q, self.k, self.v), 3 if SMOKE else 9,
                                 inner=50)

    track_forward_backward_over_forward.unit = "x forward"


class TinyOptionsBackward:
    """A tiny call's forward + backward (B1 H1 N16 D16) with a model's options over the same without them:
    a decay (RetNet's, with a scale), gates per position and per key dimension (before stop 54: 1.7-2.1x
    the plain call's 30 us; its gradients of the gates or decay then took 18 us of NumPy)."""
    params = ["decay per head", "gate", "gate per dim"]
    param_names = ["option"]
    timeout = 120

    def setup(self, option):
        self.q, self.k, self.v = inputs((1, 1, 16, 16))
        rng = np.random.default_rng(1)
        self.kw = {"decay per head": dict(decay=np.array([0.97]), scale=0.25),
                   "gate": dict(gate=-rng.random((1, 1, 16)).astype(np.float32)),
                   "gate per dim": dict(gate=-rng.random((1, 1, 16, 16)).astype(np.float32) * 0.1)}[option]
        self.forward_backward(self.kw), self.forward_backward({})  # (compiled before timing)

    def forward_backward(self, kw):
        out, vjp = linattn.causal_linear_attention_vjp(self.q, self.k, self.v, **kw)
        return vjp(out)

    def track_over_plain(self, option):
        return interleaved_ratio(lambda: self.forward_backward(self.kw), lambda: self.forward_backward({}),
                                 3 if SMOKE else 9, inner=50)

    track_over_plain.unit = "x"


class TinyMapsBackward(TinyOptionsBackward):
    """A tiny call's forward + backward (B1 H1 N16 D16) with other feature maps over the same with elu + 1:
    the elementwise maps in the backward kernels (before: phi before the kernel, its vjp after, 2.2x the
    plain call's 30 us), the pair maps' tables from the parameters' cache (Taylor before: 6.1x, DPFP 3.6x)
    and their vjps in the causal backward kernel (Taylor 2.2x -> 1.7x, DPFP 2.0x -> 1.4x)."""
    params = ["squared relu", "gelu", "Taylor", "DPFP nu2"]

    def setup(self, option):
        self.q, self.k, self.v = inputs((1, 1, 16, 16))
        maps = linattn.feature_maps
        self.kw = dict(feature_map={"squared relu": "squared_relu", "gelu": "gelu", "Taylor": maps.Taylor(),
                                    "DPFP nu2": maps.DPFP(2)}[option])
        self.forward_backward(self.kw), self.forward_backward({})  # (compiled before timing)
