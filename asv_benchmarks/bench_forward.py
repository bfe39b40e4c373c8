"""Time of the causal and non-causal forward, with the NumPy chunked form as a baseline."""
import numpy as np

import linattn

from .common import SHAPES, inputs, interleaved_ratio, numpy_chunked


class Causal:
    params = (list(SHAPES), ["float32", "float64"])
    param_names = ["shape", "dtype"]

    def setup(self, shape, dtype):
        self.q, self.k, self.v = inputs(SHAPES[shape], np.dtype(dtype))
        linattn.causal_linear_attention(self.q, self.k, self.v)  # compile / load from cache

    def time_linattn(self, shape, dtype):
        linattn.causal_linear_attention(self.q, self.k, self.v)

    def time_numpy_chunked(self, shape, dtype):
        numpy_chunked(self.q, self.k, self.v)


class NonCausal:
    params = (list(SHAPES), ["float32", "float64"])
    param_names = ["shape", "dtype"]

    def setup(self, shape, dtype):
        if not hasattr(linattn, "linear_attention"):
            raise NotImplementedError
        self.q, self.k, self.v = inputs(SHAPES[shape], np.dtype(dtype))
        linattn.linear_attention(self.q, self.k, self.v)

    def time_linattn(self, shape, dtype):
        linattn.linear_attention(self.q, self.k, self.v)


class StateHandoff:
    """Prefill returning the state, as a server does before decoding."""

    def setup(self):
        self.q, self.k, self.v = inputs(SHAPES["medium"])
        linattn.causal_linear_attention(self.q, self.k, self.v, return_state=True)

    def time_prefill_with_state(self):
        linattn.causal_linear_attention(self.q, self.k, self.v, return_state=True)


class FromState:
    """A causal call continuing from a State (return_state=True), next to the same call from nothing (with and
    without its state returned: a short prompt's prefill): a decode loop written with the sequence function (1
    position), a check of a few drafted tokens (4), a streamed prompt's chunk (64); B1, B8 and B64 (an 8 MB
    state), H8 D64. Also with float16 q, k and v (the state float32)."""
    params = ([1, 8, 64], [1, 4, 64])
    param_names = ["batch", "positions"]

    def setup(self, batch, positions):
        rng = np.random.default_rng(0)
        self.q, self.k, self.v = ((rng.standard_normal((batch, 8, positions, 64)) * 0.5).astype(np.float32)
                                  for _ in range(3))
        prompt = (rng.standard_normal((batch, 8, 256, 64)) * 0.5).astype(np.float32)
        _, self.state = linattn.causal_linear_attention(prompt, prompt, prompt, return_state=True)
        self.halves = tuple(x.astype(np.float16) for x in (self.q, self.k, self.v))
        self.time_from_state(batch, positions)
        self.time_from_nothing(batch, positions)
        self.time_from_state_float16(batch, positions)
        self.time_from_nothing_with_state(batch, positions)
        self.time_from_nothing_float16(batch, positions)

    def time_from_state(self, batch, positions):
        linattn.causal_linear_attention(self.q, self.k, self.v, initial_state=self.state, return_state=True)

    def time_from_state_float16(self, batch, positions):
        linattn.causal_linear_attention(*self.halves, initial_state=self.state, return_state=True)

    def time_from_nothing(self, batch, positions):
        linattn.causal_linear_attention(self.q, self.k, self.v)

    def time_from_nothing_with_state(self, batch, positions):
        linattn.causal_linear_attention(self.q, self.k, self.v, return_state=True)

    def time_from_nothing_float16(self, batch, positions):
        linattn.causal_linear_attention(*self.halves)


class ManySmallHeads:
    """Many heads of few positions: each head's fixed cost in the kernels (their state buffers were made
    per head: B4 H8 N16 D16's forward 50-51 -> 36 us, B1 H32 N1 D16's 36 -> 24 us on one thread of a Xeon).
    The causal forward, and the vjp's forward + backward."""
    params = (["B4 H8 N16 D16", "B1 H32 N1 D16"], ["causal", "vjp"])
    param_names = ["shape", "call"]

    def setup(self, shape, call):
        dims = {"B4 H8 N16 D16": (4, 8, 16, 16), "B1 H32 N1 D16": (1, 32, 1, 16)}[shape]
        self.q, self.k, self.v = inputs(dims)
        self.dout = np.ones(dims, np.float32)
        self.time_call(shape, call)

    def time_call(self, shape, call):
        if call == "causal":
            linattn.causal_linear_attention(self.q, self.k, self.v)
        else:
            linattn.causal_linear_attention_vjp(self.q, self.k, self.v)[1](self.dout)


class ShortChunk:
    """Sequences whose last chunk is short (7 and 31 positions) next to whole chunks (8 and 32): B8 H8 D64,
    forward and backward (a short chunk's products ran a column at a time: 1.8x the time of 8)."""
    params = [7, 8, 31, 32]
    param_names = ["positions"]

    def setup(self, positions):
        rng = np.random.default_rng(0)
        self.q, self.k, self.v = ((rng.standard_normal((8, 8, positions, 64)) * 0.5).astype(np.float32)
                                  for _ in range(3))
        out, self.vjp = linattn.causal_linear_attention_vjp(self.q, self.k, self.v)
        self.dout = np.ones_like(out)
        self.time_forward(positions)
        self.time_backward(positions)

    def time_forward(self, positions):
        linattn.causal_linear_attention(self.q, self.k, self.v)

    def time_backward(self, positions):
        self.vjp(self.dout)


class Widths:
    """Head widths past a multiple of the vector width (63, 100) next to whole ones (64): B1 H8 N1024, D = Dv,
    causal and non-causal forward (the products' last columns went one at a time: 63 took 2.6x of 64)."""
    params = [63, 64, 100]
    param_names = ["width"]

    def setup(self, width):
        rng = np.random.default_rng(0)
        self.q, self.k, self.v = ((rng.standard_normal((1, 8, 1024, width)) * 0.5).astype(np.float32)
                                  for _ in range(3))
        self.time_causal(width)
        self.time_noncausal(width)

    def time_causal(self, width):
        linattn.causal_linear_attention(self.q, self.k, self.v)

    def time_noncausal(self, width):
        linattn.linear_attention(self.q, self.k, self.v)


class AfterMatmul:
    """A layer as a NumPy model runs it: a multithreaded projection (NumPy's BLAS), then attention.

    OpenMP workers spinning idle after the attention kernel used to starve the projection's BLAS
    threads (measured 8.2 ms for the layer against 3.4 ms for its two parts apart): compare
    time_layer with time_projection + time_attention.
    """

    def setup(self):
        b, h, n, d = 1, 8, 256, 64
        self.q, self.k, self.v = inputs((b, h, n, d))
        rng = np.random.default_rng(1)
        self.x = rng.standard_normal((n, h * d)).astype(np.float32)
        self.w = rng.standard_normal((h * d, 3 * h * d)).astype(np.float32)
        linattn.causal_linear_attention(self.q, self.k, self.v)

    def time_attention(self):
        linattn.causal_linear_attention(self.q, self.k, self.v)

    def time_projection(self):
        self.x @ self.w

    def time_layer(self):
        self.x @ self.w
        linattn.causal_linear_attention(self.q, self.k, self.v)


class HeadViews:
    """q, k, v as the head views of one fused (B, N, 3, H, D) projection, as a NumPy model passes them, next
    to the same call on C-contiguous copies: causal forward, non-causal forward and the causal vjp, at a
    size in the caches (B1 H8 N2048) and one beyond them (B8 H8 N512, 25 MB of inputs), and a small one
    (B2 H8 N16). Each try of a split of the leading dims that allowed no view used to copy the array (12
    copies of 8 MB at B8 N512: 5.2 ms against 2.4 contiguous); small calls on views took the checked path."""
    params = (["1x2048", "8x512", "2x16"], ["causal", "noncausal", "vjp"])
    param_names = ["batch_x_n", "call"]
    _SIZES = {"1x2048": (1, 2048), "8x512": (8, 512), "2x16": (2, 16)}

    def setup(self, batch_x_n, call):
        b, n = self._SIZES[batch_x_n]
        rng = np.random.default_rng(0)
        qkv = (rng.standard_normal((b, n, 3, 8, 64)) * 0.5).astype(np.float32)
        self.views = tuple(qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        self.copies = tuple(np.ascontiguousarray(x) for x in self.views)
        self.dout = np.ones(self.copies[2].shape, np.float32)
        self.time_views(batch_x_n, call)
        self.time_contiguous(batch_x_n, call)

    def _run(self, call, q, k, v):
        if call == "causal":
            linattn.causal_linear_attention(q, k, v)
        elif call == "noncausal":
            linattn.linear_attention(q, k, v)
        else:
            linattn.causal_linear_attention_vjp(q, k, v)[1](self.dout)

    def time_views(self, batch_x_n, call):
        self._run(call, *self.views)

    def time_contiguous(self, batch_x_n, call):
        self._run(call, *self.copies)

    def track_views_over_contiguous(self, batch_x_n, call):
        return interleaved_ratio(lambda: self._run(call, *self.views), lambda: self._run(call, *self.copies))
    track_views_over_contiguous.unit = "x contiguous"
