"""Inputs and baselines shared by the benchmarks: a NumPy chunked form and a same-FLOP GEMM."""
import os
import time

import numpy as np

#: LINATTN_ASV_SMOKE=1 (tests/test_asv_benchmarks.py, CI) shrinks the sizes: it checks that every benchmark runs.
SMOKE = bool(os.environ.get("LINATTN_ASV_SMOKE"))

SHAPES = {  # name -> (B, H, N, D); Dv = D
    "decode-sized": (32, 8, 16, 64),
    "medium": (1, 8, 2048, 64),
    "long": (1, 1, 4096 if SMOKE else 65536, 64),
}


def inputs(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = ((rng.standard_normal(shape) * 0.5).astype(dtype) for _ in range(3))
    return q, k, v


def elu1(x):
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))).astype(x.dtype)


def numpy_chunked(q, k, v, eps=1e-6, chunk=64):
    """What a NumPy user would write: the chunkwise causal form on batched matmuls."""
    *lead, n, d = q.shape
    pad = -n % chunk
    if pad:
        q, k, v = (np.concatenate([x, np.zeros(x.shape[:-2] + (pad, x.shape[-1]), x.dtype)], -2)
                   for x in (q, k, v))
    nc = (n + pad) // chunk
    qf = elu1(q).reshape(*lead, nc, chunk, d)
    kf = elu1(k).reshape(*lead, nc, chunk, d)
    vc = v.reshape(*lead, nc, chunk, v.shape[-1])
    va = np.concatenate([vc, np.ones(vc.shape[:-1] + (1,), vc.dtype)], -1)  # Z as a column
    kv = np.swapaxes(kf, -1, -2) @ va
    s = np.cumsum(kv, axis=-3) - kv
    a = (qf @ np.swapaxes(kf, -1, -2)) * np.tril(np.ones((chunk, chunk), q.dtype))
    o = a @ va + qf @ s
    out = o[..., :-1] / (o[..., -1:] + eps)
    return out.reshape(*lead, n + pad, v.shape[-1])[..., :n, :]


def gemm_pair(shape, dtype=np.float32):
    """A callable doing the 4*N*D*Dv flops per head of the recurrence as two BLAS GEMMs."""
    *lead, n, d = shape
    rows = int(np.prod(lead)) * n
    rng = np.random.default_rng(1)
    a = rng.standard_normal((rows, d)).astype(dtype)
    b = rng.standard_normal((d, d)).astype(dtype)
    c = np.empty((rows, d), dtype)

    def run():
        np.matmul(a, b, out=c)
        np.matmul(a, b, out=c)

    return run


def best_of(fn, repeat=7):
    """Best wall time of fn() over ``repeat`` calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def interleaved_ratio(fn, base, rounds=5, inner=3):
    """fn's time over base's: the median over ``rounds`` rounds of (best of ``inner`` calls of fn) / (best
    of ``inner`` calls of base), the two measured back to back in every round. This machine's speed
    changes for seconds at a time: a roof timed once beside a kernel timed later read 1.2-2.1 for the
    same code."""
    fn(), base()

    def best(f):
        times = []
        for _ in range(inner):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return min(times)

    return float(np.median([best(fn) / best(base) for _ in range(rounds)]))
