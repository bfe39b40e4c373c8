"""Multi-scale retention (RetNet, Sun et al. 2023, "Retentive Network") with linattn.

A retention layer's heads each forget at their own rate, gamma_h = 1 - 2^(-5-h). The paper gives
three forms of one computation; this script runs all three on the same projections and checks that
they agree, then decodes with ``linattn.step`` from a prefilled state:

- parallel:   (Q K^T * s, times D with D[n, m] = gamma^(n-m) for m <= n, else 0) @ V, written here
              in NumPy (float64): the published formula, O(N^2);
- recurrent:  S_n = gamma S_{n-1} + k_n v_n^T, o_n = s q_n^T S_n: ``linattn.step`` per position;
- chunkwise:  ``linattn.causal_linear_attention(..., decay=gamma)``, O(N).

Retention has no feature map and no normaliser (``feature_map="identity", normalize=False``; the
layer's GroupNorm normalises instead) and scales by s = d_head^-0.5 (``scale=``). Q and K carry
RetNet's relative-position rotation (the real form of its Theta: rotary embeddings).

    python examples/retnet.py            # N = 2048, d_model 512, 8 heads
    python examples/retnet.py --small    # N = 192, d_model 128, 4 heads (a few seconds)
"""
import sys
import time

import numpy as np

import linattn

SMALL = "--small" in sys.argv
N, D_MODEL, HEADS = (192, 128, 4) if SMALL else (2048, 512, 8)
DH = D_MODEL // HEADS
PROMPT = N * 3 // 4  # decoding: prefill this many positions, then step the rest
GAMMA = 1 - 2.0 ** (-5 - np.arange(HEADS))  # one decay per head
SCALE = DH ** -0.5

rng = np.random.default_rng(0)
f32 = np.float32
W = {name: (rng.standard_normal((D_MODEL, D_MODEL)) / np.sqrt(D_MODEL)).astype(f32)
     for name in ("q", "k", "v", "g", "o")}


def rotate(x, positions):
    """RetNet's Theta (relative positions) in real form: pairs of features rotated by position."""
    freq = 10000.0 ** (-np.arange(0, DH, 2) / DH)
    angle = positions[:, None] * freq  # (N, DH/2)
    cos, sin = np.cos(angle).astype(x.dtype), np.sin(angle).astype(x.dtype)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


def projections(x):
    """(N, D_MODEL) -> q, k, v of shape (HEADS, N, DH)."""
    positions = np.arange(len(x))

    def heads(y):
        return y.reshape(len(x), HEADS, DH).transpose(1, 0, 2)

    return rotate(heads(x @ W["q"]), positions), rotate(heads(x @ W["k"]), positions), heads(x @ W["v"])


def retention_parallel(q, k, v):
    """The parallel form, in float64: (Q K^T * s * D) V."""
    n = q.shape[1]
    idx = np.arange(n)
    expo = (idx[:, None] - idx[None, :]).astype(np.float64)
    D = np.where(expo >= 0, GAMMA[:, None, None] ** np.maximum(expo, 0), 0.0)  # (H, N, N)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    return ((q64 @ k64.transpose(0, 2, 1)) * SCALE * D) @ v64


def retention_recurrent(q, k, v):
    """The recurrent form: one linattn.step per position."""
    state = linattn.State.zeros((HEADS,), DH, DH)
    out = np.empty_like(v)
    for i in range(q.shape[1]):
        out[:, i] = linattn.step(q[:, i], k[:, i], v[:, i], state, feature_map="identity", normalize=False,
                                 decay=GAMMA, scale=SCALE)
    return out


def retention_chunkwise(q, k, v, **kwargs):
    """The chunkwise form: one call (kwargs: return_state, initial_state)."""
    return linattn.causal_linear_attention(q, k, v, feature_map="identity", normalize=False, decay=GAMMA,
                                           scale=SCALE, **kwargs)


def layer_output(x, retained):
    """GroupNorm per head, the swish gate, the output projection."""
    n = len(x)
    mu = retained.mean(-1, keepdims=True)
    normed = (retained - mu) / np.sqrt(retained.var(-1, keepdims=True) + 1e-5)
    y = normed.transpose(1, 0, 2).reshape(n, D_MODEL)
    g = x @ W["g"]
    return (g / (1 + np.exp(-g)) * y) @ W["o"]


def timed(fn, *args, repeat=3):
    """(result, best time of ``repeat`` calls)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        res = fn(*args)
        best = min(best, time.perf_counter() - t)
    return res, best


def main():
    x = rng.standard_normal((N, D_MODEL)).astype(f32)
    q, k, v = projections(x)
    retention_chunkwise(q[:, :8], k[:, :8], v[:, :8])  # compile (or load) the kernels before timing
    retention_recurrent(q[:, :2], k[:, :2], v[:, :2])

    ref, t_par = timed(retention_parallel, q, k, v, repeat=1)
    rec, t_rec = timed(retention_recurrent, q, k, v)
    chk, t_chk = timed(retention_chunkwise, q, k, v)
    scale = np.abs(ref).max()
    print(f"multi-scale retention: {HEADS} heads, d_head {DH}, N {N}, gammas {np.round(GAMMA, 5).tolist()}")
    print(f"{'form':<12s} {'time ms':>9s} {'max |diff| / max |parallel|':>29s}")
    ok = True
    for name, res, t in (("parallel", ref, t_par), ("recurrent", rec, t_rec), ("chunkwise", chk, t_chk)):
        err = float(np.abs(res - ref).max() / scale)
        ok = ok and err < 1e-5
        print(f"{name:<12s} {t * 1e3:9.2f} {err:29.2e}")

    # decoding: prefill the prompt (the state comes back), then one step per new position
    _, state = retention_chunkwise(q[:, :PROMPT], k[:, :PROMPT], v[:, :PROMPT], return_state=True)
    steps = []
    t = time.perf_counter()
    for i in range(PROMPT, N):
        steps.append(linattn.step(q[:, i], k[:, i], v[:, i], state, feature_map="identity", normalize=False,
                                  decay=GAMMA, scale=SCALE))
    t_step = (time.perf_counter() - t) / (N - PROMPT)
    err = float(np.abs(np.stack(steps, axis=1) - ref[:, PROMPT:]).max() / scale)
    ok = ok and err < 1e-5
    print(f"prefill {PROMPT} + {N - PROMPT} steps ({t_step * 1e6:.1f} us per step): max |diff| / max |parallel| "
          f"{err:.2e}")

    y = layer_output(x, chk)
    print(f"layer output: shape {y.shape}, finite: {bool(np.isfinite(y).all())}")
    if not ok or not np.isfinite(y).all():
        print("FAILED: the forms disagree")
        sys.exit(1)
    print("the three forms agree")


if __name__ == "__main__":
    main()
