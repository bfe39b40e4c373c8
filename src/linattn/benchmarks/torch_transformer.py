"""The benchmark's transformer in PyTorch eager (CPU), with the same weights as the NumPy model.

``attention`` is "chunked" (causal linear attention in PyTorch's chunkwise form, as in
flash-linear-attention's reference code, with a recurrent step for decoding), "sdpa" (softmax
attention through ``torch.nn.functional.scaled_dot_product_attention`` with a key/value cache: what
a PyTorch user would pick instead) or "skip". Importing this module imports torch.
"""
import numpy as np
import torch
import torch.nn.functional as F

EPS = 1e-6
CHUNK = 64


def _phi(x):
    return F.elu(x) + 1


def chunked_linear_attention(q, k, v, chunk=CHUNK, eps=EPS, phi=_phi):
    """Causal linear attention (normalised, feature map ``phi``: elu+1 by default) of (..., N, D) tensors
    on their device, differentiable by autograd; returns (out, (S, Z)). N need not be a multiple of
    ``chunk``: the features are padded with zeros, which add nothing to the state."""
    qf, kf = phi(q), phi(k)
    *lead, n, d = qf.shape
    pad = -n % chunk
    qf, kf, vp = (F.pad(x, (0, 0, 0, pad)) if pad else x for x in (qf, kf, v))
    nc = (n + pad) // chunk
    qf, kf = qf.reshape(*lead, nc, chunk, d), kf.reshape(*lead, nc, chunk, d)
    vc = vp.reshape(*lead, nc, chunk, v.shape[-1])
    va = torch.cat([vc, torch.ones(vc.shape[:-1] + (1,), dtype=v.dtype, device=v.device)], -1)  # Z as a column
    kv = kf.transpose(-1, -2) @ va
    s = torch.cumsum(kv, dim=-3) - kv
    a = (qf @ kf.transpose(-1, -2)) * torch.tril(torch.ones(chunk, chunk, dtype=q.dtype, device=q.device))
    o = a @ va + qf @ s
    out = (o[..., :-1] / (o[..., -1:] + eps)).reshape(*lead, n + pad, v.shape[-1])[..., :n, :]
    total = kv.sum(-3)
    return out, (total[..., :-1].contiguous(), total[..., -1].contiguous())


def linear_step(q, k, v, state):
    """One decoding position of (B, H, D) tensors; the state (S, Z) advances in place."""
    S, Z = state
    qf, kf = _phi(q), _phi(k)
    S += kf.unsqueeze(-1) * v.unsqueeze(-2)
    Z += kf
    num = (qf.unsqueeze(-2) @ S).squeeze(-2)
    return num / ((qf * Z).sum(-1, keepdim=True) + EPS)


class TorchTransformer(torch.nn.Module):
    def __init__(self, weights, attention="chunked"):
        super().__init__()
        if attention not in ("chunked", "sdpa", "skip"):
            raise ValueError(f"attention: expected 'chunked', 'sdpa' or 'skip', got {attention!r}")
        t = torch.from_numpy
        self.attention = attention
        self.embed = t(weights.embed)
        self.blocks = [{key: t(val) for key, val in p.items()} for p in weights.layers]
        self.lnf = (t(weights.lnf_g), t(weights.lnf_b))
        self.d = weights.embed.shape[1]
        self.h = weights.heads
        self.dh = self.d // self.h

    def _ln(self, x, g, b):
        return F.layer_norm(x, (self.d,), g, b, 1e-5)

    def _mlp(self, x, p):
        return F.linear(F.gelu(x @ p["w1"] + p["b1"], approximate="tanh"), p["w2"].T, p["b2"])

    @torch.inference_mode()
    def prefill(self, tokens):
        """tokens (B, N) -> (logits of the last position (B, vocab), per-layer caches)."""
        x = self.embed[tokens]
        b, n, _ = x.shape
        caches = []
        for p in self.blocks:
            qkv = (self._ln(x, p["ln1_g"], p["ln1_b"]) @ p["w_qkv"]).reshape(b, n, 3, self.h, self.dh)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (B, H, N, dh) each
            if self.attention == "chunked":
                o, cache = chunked_linear_attention(q, k, v)
            elif self.attention == "sdpa":
                o, cache = F.scaled_dot_product_attention(q, k, v, is_causal=True), [k, v, n]
                cache[0] = torch.cat([k, torch.empty(b, self.h, 256, self.dh)], 2)  # room for new tokens
                cache[1] = torch.cat([v, torch.empty(b, self.h, 256, self.dh)], 2)
            else:
                o, cache = torch.zeros_like(v), None
            caches.append(cache)
            x = x + o.transpose(1, 2).reshape(b, n, self.d) @ p["w_o"]
            x = x + self._mlp(self._ln(x, p["ln2_g"], p["ln2_b"]), p)
        return self._ln(x[:, -1], *self.lnf) @ self.embed.T, caches

    @torch.inference_mode()
    def decode(self, tokens, caches):
        """tokens (B,) -> logits (B, vocab); caches advance in place."""
        x = self.embed[tokens]
        b = x.shape[0]
        for p, cache in zip(self.blocks, caches):
            qkv = (self._ln(x, p["ln1_g"], p["ln1_b"]) @ p["w_qkv"]).reshape(b, 3, self.h, self.dh)
            q, k, v = qkv.unbind(1)
            if self.attention == "chunked":
                o = linear_step(q, k, v, cache)
            elif self.attention == "sdpa":
                K, V, n = cache
                K[:, :, n], V[:, :, n] = k, v
                cache[2] = n + 1
                o = F.scaled_dot_product_attention(q.unsqueeze(2), K[:, :, :n + 1], V[:, :, :n + 1]).squeeze(2)
            else:
                o = torch.zeros_like(v)
            x = x + o.reshape(b, self.d) @ p["w_o"]
            x = x + self._mlp(self._ln(x, p["ln2_g"], p["ln2_b"]), p)
        return self._ln(x, *self.lnf) @ self.embed.T


def as_numpy(x):
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
