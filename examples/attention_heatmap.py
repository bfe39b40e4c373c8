"""Save a heatmap of the causal linear-attention weights of a small random sequence.

    python examples/attention_heatmap.py [output.png]
"""
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import linattn  # noqa: E402

out = sys.argv[1] if len(sys.argv) > 1 else "attention_heatmap.png"
rng = np.random.default_rng(3)
n, d = 24, 8
q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
w = linattn.attention_weights(q, k, causal=True)  # (N, N), rows sum to 1 over j <= i
assert np.allclose(w @ v, linattn.causal_linear_attention(q, k, v))

fig, ax = plt.subplots(figsize=(5.2, 4.4), dpi=110)
im = ax.imshow(np.where(np.tril(np.ones((n, n))) > 0, w, np.nan), cmap="viridis", vmin=0)
ax.set_xlabel("key position j")
ax.set_ylabel("query position i")
ax.set_title("causal linear attention weights (elu+1)")
fig.colorbar(im, ax=ax, label="weight (row sums to 1)")
fig.tight_layout()
fig.savefig(out)
print(f"wrote {out}")
