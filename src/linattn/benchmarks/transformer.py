"""A small decoder-only transformer in NumPy with causal linear attention, as a user would write it.

Embedding, then per layer: layer norm, one fused QKV projection, causal linear attention (elu+1,
normalised) over the heads, output projection, layer norm, a 4x MLP with GELU (tanh form), both
with residual connections; a final layer norm and logits through the (tied) embedding. Prefill
runs a batch of prompts and returns the last position's logits and each layer's State; ``decode``
advances every sequence by one token with :func:`linattn.step`.

``attention="skip"`` leaves the attention call out (its output buffer is used as it is), so the
model's time with and without attention gives attention's cost inside the model.
"""
from dataclasses import dataclass

import numpy as np

import linattn

#: The benchmark's model: 4 layers, d_model 512, 8 heads of 64.
CONFIG = dict(vocab=4096, d_model=512, heads=8, layers=4)


@dataclass
class Weights:
    """float32 weights, drawn from a seeded NumPy generator (the PyTorch twin loads the same ones)."""

    embed: np.ndarray  # (vocab, d)
    layers: list  # of dicts: ln1_g, ln1_b, w_qkv (d, 3d), w_o (d, d), ln2_g, ln2_b, w1 (d, 4d), b1, w2 (4d, d), b2
    lnf_g: np.ndarray
    lnf_b: np.ndarray
    heads: int

    @classmethod
    def random(cls, vocab, d_model, heads, layers, seed=0):
        rng = np.random.default_rng(seed)

        def w(*shape, scale=0.02):
            return (rng.standard_normal(shape) * scale).astype(np.float32)

        def ones():
            return np.ones(d_model, np.float32)

        def zeros(m=d_model):
            return np.zeros(m, np.float32)

        blocks = [dict(ln1_g=ones(), ln1_b=zeros(), w_qkv=w(d_model, 3 * d_model), w_o=w(d_model, d_model),
                       ln2_g=ones(), ln2_b=zeros(), w1=w(d_model, 4 * d_model), b1=zeros(4 * d_model),
                       w2=w(4 * d_model, d_model), b2=zeros()) for _ in range(layers)]
        return cls(w(vocab, d_model, scale=0.5), blocks, ones(), zeros(), heads)


_C0 = np.float32(-2 * 0.7978845608028654)  # -2 sqrt(2 / pi)
_C1 = np.float32(-2 * 0.044715 * 0.7978845608028654)

#: Rows (positions) per block of the MLP: its (rows, 4 d) intermediate stays in the cache.
BLOCK_ROWS = 512


def layer_norm(x, g, b, eps=1e-5):
    """Layer norm over the last axis of a 2-D array, into a new array."""
    xc = x - x.mean(-1, keepdims=True)
    inv = np.einsum("ij,ij->i", xc, xc)[:, None]
    inv *= np.float32(1 / x.shape[-1])
    inv += np.float32(eps)
    np.sqrt(inv, out=inv)
    xc /= inv
    xc *= g
    xc += b
    return xc


#: Elements per piece of the GELU (512 KB of float32): its passes over a piece stay in the L2 cache.
GELU_PIECE = 1 << 17


def gelu_(u):
    """GELU, tanh form (PyTorch's ``approximate="tanh"``), of u in place.

    Written as u sigmoid(2 t) = u / (1 + exp(-2 t)), t = sqrt(2/pi) (u + 0.044715 u^3), which is
    0.5 u (1 + tanh t): NumPy's float32 ``exp`` runs in SIMD on AVX2 and AVX-512 CPUs, its ``tanh``
    only with AVX-512 (on an AVX2 CPU 3.6 ms against 2.1 ms per 512 x 2048 block). exp(-2 t)
    overflows to inf for u < -10 or so, where the quotient is the right -0. A contiguous u goes in
    pieces of GELU_PIECE elements, each through all six passes while it is in the L2 cache (a
    512 x 2048 block from L3 took 2.2-3.5 ms, in pieces 1.4-1.8 ms on a Xeon).
    """
    if not u.flags.c_contiguous:  # one piece, the whole array
        return _gelu_piece_(u, np.empty_like(u))
    flat = u.reshape(-1)  # a view
    t = np.empty(min(flat.size, GELU_PIECE), u.dtype)
    for i in range(0, flat.size, GELU_PIECE):
        p = flat[i:i + GELU_PIECE]
        _gelu_piece_(p, t[:p.size])
    return u


def _gelu_piece_(u, t):
    """gelu_ of u in place, with t (u's shape) for the intermediate."""
    np.multiply(u, u, out=t)
    t *= _C1
    t += _C0
    t *= u
    with np.errstate(over="ignore"):
        np.exp(t, out=t)
    t += 1
    u /= t
    return u


class NumpyTransformer:
    """The model; ``attention`` is "linattn" or "skip" (see the module docstring).

    Written as a NumPy user who cares about speed would: a fused QKV projection whose head views go
    to attention as they are, an output buffer with the heads side by side, in-place element-wise
    work, and the MLP in blocks of BLOCK_ROWS rows so that its intermediates stay in the cache.
    """

    def __init__(self, weights, attention="linattn"):
        if attention not in ("linattn", "skip"):
            raise ValueError(f"attention: expected 'linattn' or 'skip', got {attention!r}")
        self.w = weights
        self.attention = attention
        self.d = weights.embed.shape[1]
        self.h = weights.heads
        self.dh = self.d // self.h
        self._buffers = {}

    def _buffer(self, shape):
        """A float32 buffer of this shape, made once (zeros) and reused by every layer and call."""
        buf = self._buffers.get(shape)
        if buf is None:
            buf = self._buffers[shape] = np.zeros(shape, np.float32)
        return buf

    def _rest_of_block(self, x, a, p):
        """x + a @ w_o, then the MLP with its residual, in place on x (rows, d)."""
        for i in range(0, x.shape[0], BLOCK_ROWS):
            xb = x[i:i + BLOCK_ROWS]
            xb += a[i:i + BLOCK_ROWS] @ p["w_o"]
            u = layer_norm(xb, p["ln2_g"], p["ln2_b"]) @ p["w1"]
            u += p["b1"]
            y = gelu_(u) @ p["w2"]
            y += p["b2"]
            xb += y

    def prefill(self, tokens):
        """tokens (B, N) -> (logits of the last position (B, vocab), one State per layer)."""
        b, n = tokens.shape
        x = self.w.embed[tokens.reshape(-1)]  # (B*N, d), a new array
        states = []
        for p in self.w.layers:
            qkv = (layer_norm(x, p["ln1_g"], p["ln1_b"]) @ p["w_qkv"]).reshape(b, n, 3, self.h, self.dh)
            q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # (B, H, N, dh) views
            buf = self._buffer((b, n, self.h, self.dh))  # heads side by side for w_o
            st = None
            if self.attention == "linattn":
                _, st = linattn.causal_linear_attention(q, k, v, out=buf.transpose(0, 2, 1, 3), return_state=True)
            states.append(st)
            self._rest_of_block(x, buf.reshape(b * n, self.d), p)
        last = x.reshape(b, n, self.d)[:, -1]
        return layer_norm(last, self.w.lnf_g, self.w.lnf_b) @ self.w.embed.T, states

    def decode(self, tokens, states):
        """tokens (B,) -> logits (B, vocab) of the next position; ``states`` advance in place."""
        x = self.w.embed[tokens]
        b = x.shape[0]
        for p, st in zip(self.w.layers, states):
            qkv = (layer_norm(x, p["ln1_g"], p["ln1_b"]) @ p["w_qkv"]).reshape(b, 3, self.h, self.dh)
            buf = self._buffer((b, self.h, self.dh))
            if self.attention == "linattn":
                linattn.step(qkv[:, 0], qkv[:, 1], qkv[:, 2], st, out=buf)
            self._rest_of_block(x, buf.reshape(b, self.d), p)
        return layer_norm(x, self.w.lnf_g, self.w.lnf_b) @ self.w.embed.T

    def empty_states(self, batch):
        """Zero states, for the "skip" model's decode (it has no prefill states)."""
        return [linattn.State.zeros((batch, self.h), self.dh, self.dh) for _ in self.w.layers]
