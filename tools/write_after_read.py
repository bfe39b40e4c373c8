"""Does another core's reading of an array slow the main thread's next writes where it was?

The model benchmark's "with minus without attention" (docs/performance.md, stops 38 and 45) loses its
time in a temporary written where an earlier QKV output lay, memory both cores read during attention.
This repeats that without the model: ``x @ w`` into a 2048 x 1536 float32 array, a two-thread Numba
loop in which the second thread (or the calling one) reads part of it, the array freed, then the main
thread writing a new array of the same size (malloc hands back the same block; checked). Prints the
median write time after each kind of read::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tools/write_after_read.py [rounds]

Seen on a 2-vCPU guest of a Zen 5 EPYC: in some processes every read by the second thread makes the
write 2-3x slower, whichever rows or columns it read; in others nothing is slower.
"""
import sys
import time

import numpy as np
from numba import njit, prange

import linattn  # noqa: F401  (NumPy's OpenBLAS then runs on Numba's pool, as in a model using linattn)

N, C = 2048, 1536


@njit(parallel=True, cache=False)
def _read(a, boxes, out):
    """Item t sums rows boxes[t, 0]:boxes[t, 1], columns boxes[t, 2]:boxes[t, 3] of a."""
    for t in prange(2):
        s = np.float32(0)
        for i in range(boxes[t, 0], boxes[t, 1]):
            for j in range(boxes[t, 2], boxes[t, 3]):
                s += a[i, j]
        out[t] = s


def main(rounds):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 512)).astype(np.float32)
    w = (rng.standard_normal((512, C)) * 0.05).astype(np.float32)
    u = rng.standard_normal((N, C)).astype(np.float32)
    h, c, none = N // 2, C // 2, [0, 0, 0, 0]
    cases = {"nothing read": None,
             "main: rows 0-1023": [[0, h, 0, C], none], "main: rows 1024-2047": [[h, N, 0, C], none],
             "other: rows 0-1023": [none, [0, h, 0, C]], "other: rows 1024-2047": [none, [h, N, 0, C]],
             "other: columns 0-767": [none, [0, N, 0, c]], "other: columns 768-1535": [none, [0, N, c, C]],
             "other: q": [none, [0, N, 0, 512]], "other: v": [none, [0, N, 1024, C]]}
    cases = {k: None if b is None else np.array(b, np.int64) for k, b in cases.items()}
    sums = np.zeros(2, np.float32)
    _read(u, cases["other: q"], sums)  # compile
    times = {k: [] for k in cases}
    for _ in range(rounds):
        for name, boxes in cases.items():
            qkv = x @ w
            if boxes is not None:
                _read(qkv, boxes, sums)
            where = qkv.ctypes.data
            del qkv
            t0 = time.perf_counter()
            t = np.empty((N, C), np.float32)
            np.multiply(u, u, out=t)  # ordinary stores (fill() streams past the caches and shows nothing)
            times[name].append(time.perf_counter() - t0)
            if t.ctypes.data != where:
                raise RuntimeError("malloc did not reuse the block: the comparison does not hold")
            del t
    for name, ts in times.items():
        print(f"{name:24s} write after: {np.median(ts) * 1e3:6.3f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
