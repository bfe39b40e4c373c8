"""A padded batch of sequences of different lengths through non-causal linear attention (an encoder's
self-attention), with ``lengths=`` (the keys') and ``query_lengths=`` (the queries'): padding is
never read (it holds NaN here) and its outputs are 0, every real row equals its sequence's own
unpadded call. Times the batch call against a Python loop over the sequences (what one would write
without lengths) and against the same batch without lengths (which computes the padding too).

    python examples/padded_batch.py            # 16 sequences of 64-1024 tokens, 8 heads of 64
    python examples/padded_batch.py --small    # 4 sequences of 8-64 tokens, 2 heads of 16
"""
import sys
import time

import numpy as np

import linattn

SMALL = "--small" in sys.argv
B, N, H, D = (4, 64, 2, 16) if SMALL else (16, 1024, 8, 64)


def best(fn, repeat=5):
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    rng = np.random.default_rng(0)
    lengths = rng.integers(N // 16, N + 1, B)
    lengths[0] = N  # (the longest sets the padded size)
    q, k, v = (rng.standard_normal((B, H, N, D)).astype(np.float32) for _ in range(3))
    padding = np.broadcast_to((np.arange(N) >= lengths[:, None])[:, None, :, None], q.shape)  # (B, H, N, D)
    for x in (q, k, v):
        x[padding] = np.nan  # never read

    out = linattn.linear_attention(q, k, v, lengths=lengths, query_lengths=lengths)
    worst = 0.0
    for b, n in enumerate(lengths):
        alone = linattn.linear_attention(q[b, :, :n], k[b, :, :n], v[b, :, :n])
        worst = max(worst, float(np.max(np.abs(out[b, :, :n] - alone)) / np.max(np.abs(alone))))
    padded_zero = bool(np.all(out[padding] == 0))
    print(f"{B} sequences of {lengths.min()}-{lengths.max()} tokens ({lengths.sum() / (B * N):.0%} of the padded "
          f"batch), {H} heads of {D}: each sequence's rows vs its own call: max relative error {worst:.1e}; "
          f"padding's outputs all 0: {padded_zero}")

    t_batch = best(lambda: linattn.linear_attention(q, k, v, lengths=lengths, query_lengths=lengths))
    t_loop = best(lambda: [linattn.linear_attention(q[b, :, :n], k[b, :, :n], v[b, :, :n])
                           for b, n in enumerate(lengths)])
    q0, k0, v0 = (np.nan_to_num(x) for x in (q, k, v))
    t_whole = best(lambda: linattn.linear_attention(q0, k0, v0))
    print(f"the padded batch with lengths: {t_batch * 1e3:.2f} ms; a loop over the sequences: {t_loop * 1e3:.2f} ms "
          f"({t_loop / t_batch:.1f}x); the batch without lengths (padding computed): {t_whole * 1e3:.2f} ms "
          f"({t_whole / t_batch:.2f}x)")
    return 0 if worst < 1e-5 and padded_zero else 1


if __name__ == "__main__":
    sys.exit(main())
