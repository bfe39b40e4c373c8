"""Quickstart: the textbook per-token loop and linattn give the same answer; linattn is much faster.

    python examples/quickstart.py [--small]
"""
import sys
import time

import numpy as np

import linattn

small = "--small" in sys.argv
B, H, N, D = (1, 2, 256, 32) if small else (1, 8, 2048, 64)
rng = np.random.default_rng(0)
q, k, v = ((rng.standard_normal((B, H, N, D)) * 0.5).astype(np.float32) for _ in range(3))


def textbook(q, k, v, eps=1e-6):
    """The seed's per-token loop: S += phi(k) v^T, Z += phi(k), out = phi(q) S / (phi(q) Z + eps)."""
    phi = lambda x: np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))  # noqa: E731  elu(x) + 1
    out = np.empty_like(v)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            S = np.zeros((q.shape[-1], v.shape[-1]), np.float32)
            Z = np.zeros(q.shape[-1], np.float32)
            for i in range(q.shape[2]):
                kf, qf = phi(k[b, h, i]), phi(q[b, h, i])
                S += np.outer(kf, v[b, h, i])
                Z += kf
                out[b, h, i] = qf @ S / (qf @ Z + eps)
    return out


t0 = time.perf_counter()
expected = textbook(q, k, v)
t_loop = time.perf_counter() - t0

linattn.causal_linear_attention(q, k, v)  # the first call compiles (or loads from the disk cache)
t0 = time.perf_counter()
out = linattn.causal_linear_attention(q, k, v)
t_lin = time.perf_counter() - t0

err = np.max(np.abs(out - expected)) / np.max(np.abs(expected))
print(f"(B, H, N, D) = {(B, H, N, D)}, float32, causal, elu+1")
print(f"textbook loop {t_loop * 1e3:9.2f} ms")
print(f"linattn       {t_lin * 1e3:9.2f} ms   ({t_loop / t_lin:.0f}x faster, max relative difference {err:.1e})")
assert err < 1e-4
