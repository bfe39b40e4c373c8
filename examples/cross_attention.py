"""An encoder-decoder's attention with linattn: the decoder's causal self-attention and its
cross-attention over the encoder's output, prefilled for a prompt, then decoded token by token.

Cross-attention is non-causal linear attention whose keys and values (the encoder's, Nk of them)
have another length than the queries (the decoder's). ``linattn.linear_attention(..., return_state=True)``
returns the keys' state (S = sum phi(k) v^T, Z = sum phi(k): D' x Dv a head, whatever Nk), and each
decoding step's queries read that state alone (``k`` and ``v`` None): the encoder's keys are read
once, not at every token. The script checks every decoded output against the same attention
computed in full on the whole sequence (float64 NumPy, the O(N * Nk) masked form) and times a
decoding step's cross-attention both ways (over the state; over the keys).

    python examples/cross_attention.py            # Nk = 2048 encoder positions, d_model 512, 8 heads
    python examples/cross_attention.py --small    # Nk = 256, d_model 128, 4 heads (a few seconds)
"""
import sys
import time

import numpy as np

import linattn
from linattn import reference

SMALL = "--small" in sys.argv
NK, D_MODEL, HEADS = (256, 128, 4) if SMALL else (2048, 512, 8)
PROMPT, NEW = (24, 8) if SMALL else (64, 32)  # decoder positions prefilled, then decoded one by one
DH = D_MODEL // HEADS

rng = np.random.default_rng(0)
f32 = np.float32
W = {name: (rng.standard_normal((D_MODEL, D_MODEL)) / np.sqrt(D_MODEL)).astype(f32)
     for name in ("q", "k", "v", "cq", "ck", "cv")}


def heads(x):
    """(N, d_model) -> (H, N, DH)."""
    return x.reshape(x.shape[0], HEADS, DH).transpose(1, 0, 2)


def main():
    encoder_out = rng.standard_normal((NK, D_MODEL)).astype(f32)  # what an encoder produced
    decoder_in = rng.standard_normal((PROMPT + NEW, D_MODEL)).astype(f32)  # the decoder's inputs, all known here
    k_enc, v_enc = heads(encoder_out @ W["ck"]), heads(encoder_out @ W["cv"])
    q_all, k_all, v_all = (heads(decoder_in @ W[n]) for n in "qkv")
    cq_all = heads(decoder_in @ W["cq"])

    # prefill: the prompt's self-attention (its state kept) and cross-attention (the keys' state kept)
    p = slice(0, PROMPT)
    self_out, state = linattn.causal_linear_attention(q_all[:, p], k_all[:, p], v_all[:, p], return_state=True)
    cross_out, memory = linattn.linear_attention(cq_all[:, p], k_enc, v_enc, return_state=True)
    self_outs, cross_outs = [self_out], [cross_out]
    for t in range(PROMPT, PROMPT + NEW):  # decoding: one position at a time
        self_outs.append(linattn.step(q_all[:, t], k_all[:, t], v_all[:, t], state)[:, None])
        cross_outs.append(linattn.linear_attention(np.ascontiguousarray(cq_all[:, t:t + 1]), initial_state=memory))
    self_out, cross_out = np.concatenate(self_outs, 1), np.concatenate(cross_outs, 1)

    want_self = reference.masked(q_all, k_all, v_all)
    want_cross = reference.masked(cq_all, k_enc, v_enc, causal=False)
    err = max(float(np.abs(got - want).max() / np.abs(want).max())
              for got, want in ((self_out, want_self), (cross_out, want_cross)))
    print(f"decoder of {PROMPT} + {NEW} positions over {NK} encoder positions, {HEADS} heads of {DH}")
    print(f"prefill + steps vs the full O(N*Nk) form in float64: max relative error {err:.1e}")

    q_t = np.ascontiguousarray(cq_all[:, -1:])
    over_state = _best(lambda: linattn.linear_attention(q_t, initial_state=memory))
    over_keys = _best(lambda: linattn.linear_attention(q_t, k_enc, v_enc))
    print(f"a step's cross-attention over the keys' state: {over_state * 1e6:8.1f} us")
    print(f"a step's cross-attention over the {NK} keys:  {over_keys * 1e6:8.1f} us "
          f"({over_keys / over_state:.0f}x the time)")
    return 0 if err < 1e-4 else 1


def _best(call, rounds=5, inner=20):
    """The best over ``rounds`` of the mean time of ``inner`` calls, after one call."""
    call()
    runs = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(inner):
            call()
        runs.append((time.perf_counter() - t0) / inner)
    return min(runs)


if __name__ == "__main__":
    sys.exit(main())
