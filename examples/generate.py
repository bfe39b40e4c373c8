"""A tiny NumPy language model with linear attention: prefill a prompt, then generate with `step`.

Prints the time per generated token at several context lengths next to a softmax-attention decoder
with a key/value cache: linear attention's cost per token is flat, softmax attention's grows.

    python examples/generate.py            # contexts 1k, 4k, 16k
    python examples/generate.py --small    # contexts 64, 256 (a few seconds)
"""
import sys
import time

import numpy as np

import linattn

SMALL = "--small" in sys.argv
VOCAB, D_MODEL, HEADS, LAYERS = 256, 128, 4, 2
DH = D_MODEL // HEADS
CONTEXTS = [64, 256] if SMALL else [1024, 4096, 16384]
NEW_TOKENS = 8 if SMALL else 32

rng = np.random.default_rng(0)
f32 = np.float32
embed = (rng.standard_normal((VOCAB, D_MODEL)) / np.sqrt(D_MODEL)).astype(f32)
layers = [{name: (rng.standard_normal((D_MODEL, D_MODEL)) / np.sqrt(D_MODEL)).astype(f32)
           for name in ("wq", "wk", "wv", "wo")} for _ in range(LAYERS)]


def norm(x):
    return (x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + 1e-5)


def heads(x):
    """(..., D_MODEL) -> (..., HEADS, DH), then heads before positions for sequences."""
    return x.reshape(x.shape[:-1] + (HEADS, DH))


def prefill(tokens):
    """Run the prompt through the model; returns the last hidden state and each layer's State."""
    x = embed[tokens]
    states = []
    for p in layers:
        h = norm(x)
        q, k, v = (heads(h @ p[w]).transpose(1, 0, 2) for w in ("wq", "wk", "wv"))  # (H, N, DH)
        o, st = linattn.causal_linear_attention(q, k, v, return_state=True)
        states.append(st)
        x = x + o.transpose(1, 0, 2).reshape(len(tokens), D_MODEL) @ p["wo"]
    return x[-1], states


def decode_linear(token, states):
    """One token through the model with linattn.step: O(1) in the context length."""
    x = embed[token]
    for p, st in zip(layers, states):
        h = norm(x)
        q, k, v = (heads(h @ p[w]) for w in ("wq", "wk", "wv"))  # (H, DH)
        x = x + linattn.step(q, k, v, st).reshape(D_MODEL) @ p["wo"]
    return x


def decode_softmax(token, caches, length):
    """One token with softmax attention over a key/value cache: O(context length)."""
    x = embed[token]
    for p, (K, V) in zip(layers, caches):
        h = norm(x)
        q, k, v = (heads(h @ p[w]) for w in ("wq", "wk", "wv"))
        K[:, length], V[:, length] = k, v
        s = np.einsum("hd,hnd->hn", q, K[:, :length + 1]) / np.sqrt(DH)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hn,hnd->hd", a, V[:, :length + 1]).reshape(D_MODEL) @ p["wo"]
    return x


def main():
    _, states = prefill(rng.integers(0, VOCAB, 8))  # compile (or load) the kernels before timing
    decode_linear(0, states)
    print(f"model: {LAYERS} layers, d_model {D_MODEL}, {HEADS} heads; {NEW_TOKENS} new tokens per context")
    print(f"{'context':>8s} {'linear (step) us/token':>24s} {'softmax + KV cache us/token':>29s}")
    for ctx in CONTEXTS:
        prompt = rng.integers(0, VOCAB, ctx)
        last, states = prefill(prompt)
        # the softmax decoder gets a cache of the same length (its prefill is not what we time)
        caches = [(rng.standard_normal((HEADS, ctx + NEW_TOKENS, DH)).astype(f32),
                   rng.standard_normal((HEADS, ctx + NEW_TOKENS, DH)).astype(f32)) for _ in layers]
        token = int(np.argmax(last @ embed.T))
        generated = []
        t0 = time.perf_counter()
        for _ in range(NEW_TOKENS):
            x = decode_linear(token, states)
            token = int(np.argmax(x @ embed.T))
            generated.append(token)
        t_lin = (time.perf_counter() - t0) / NEW_TOKENS
        t0 = time.perf_counter()
        for i in range(NEW_TOKENS):
            decode_softmax(generated[i], caches, ctx + i)
        t_soft = (time.perf_counter() - t0) / NEW_TOKENS
        print(f"{ctx:8d} {t_lin * 1e6:24.1f} {t_soft * 1e6:29.1f}")
    # the state handoff is exact: prefill + steps equals one call on the whole sequence
    seq = rng.integers(0, VOCAB, 40)
    _, states = prefill(seq[:30])
    x_steps = [decode_linear(t, states) for t in seq[30:]]
    x_full = embed[seq]
    for p in layers:
        h = norm(x_full)
        q, k, v = (heads(h @ p[w]).transpose(1, 0, 2) for w in ("wq", "wk", "wv"))
        x_full = x_full + linattn.causal_linear_attention(q, k, v).transpose(1, 0, 2).reshape(40, D_MODEL) @ p["wo"]
    err = np.max(np.abs(np.stack(x_steps) - x_full[30:])) / np.max(np.abs(x_full[30:]))
    print(f"prefill + steps vs one call on the whole sequence: max relative difference {err:.1e}")
    assert err < 1e-4


if __name__ == "__main__":
    main()
