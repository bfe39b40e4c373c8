"""small_gemm(_tn), the chunk's register-tiled matrix products, against NumPy: every tile and panel
edge, strided rows, accumulation, the causal bands, a transposed A (and a lower triangular one), B
stacked from two arrays with the rows of the product scaled (small_gemm_stacked); with 512-bit
vectors (AVX-512) and 256-bit (AVX2)."""
import os
import subprocess
import sys

import numpy as np
from numba import njit

from linattn.cpu.smallgemm import row_tiles, small_gemm, small_gemm_stacked, small_gemm_tn, small_gemm_tn_lower


@njit
def _run(a, b, c, accumulate, kband, nband):
    small_gemm(a, b, c, accumulate, kband, nband)


@njit
def _run_stacked(a, b1, b2, c, rs, kband, nband):
    small_gemm_stacked(a, b1, b2, c, rs, kband, nband)


@njit
def _run_tn(a, b, c, accumulate):
    small_gemm_tn(a, b, c, accumulate)


@njit
def _run_tn_lower(a, b, c, accumulate):
    small_gemm_tn_lower(a, b, c, accumulate)


SHAPES = [(1, 1, 1), (3, 5, 7), (4, 64, 64), (5, 17, 33), (32, 64, 64), (32, 96, 64), (64, 32, 64), (33, 70, 129),
          (8, 128, 16), (31, 9, 80), (6, 20, 8), (9, 13, 27), (4, 8, 12), (12, 64, 56),  # half vectors
          (21, 64, 32), (13, 40, 16), (17, 9, 24), (40, 33, 31), (37, 21, 16), (26, 64, 5), (20, 64, 64),
          (14, 40, 80), (26, 30, 128), (11, 16, 64)]  # tiles of 8 rows (AVX-512), then 4, then single rows


def check_all(seed=0):
    """Every shape x dtype x band x beta; returns the number of failures (0 expected)."""
    rng = np.random.default_rng(seed)
    failures = 0
    for dtype, tol in ((np.float32, 2e-6), (np.float64, 1e-13)):
        for m, k, n in SHAPES:
            tiles = row_tiles(m)  # each row's (first row, rows) of its tile
            for kband, nband in ((-1, -1), (0, -1), (5, -1), (-1, 0), (-1, 3)):
                for accumulate in (False, True, 0.5):  # beta: c's factor (False: c not read)
                    a = rng.standard_normal((m, k + 3)).astype(dtype)[:, 2:k + 2]  # rows k + 3 apart
                    b = rng.standard_normal((k, n + 4)).astype(dtype)[:, :n]
                    before = rng.standard_normal((m, n + 1)).astype(dtype)
                    c = before.copy()[:, :n]
                    _run(a, b, c, accumulate, kband, nband)
                    for i in range(m):
                        r0, rows = tiles[i]
                        kend = k if kband < 0 else min(k, kband + r0 + rows)
                        nend = n if nband < 0 else min(n, nband + r0 + rows)  # guaranteed columns
                        want = a[i, :kend].astype(np.float64) @ b[:kend].astype(np.float64)
                        if accumulate:
                            want = want + float(accumulate) * before[i, :n]
                        scale = max(1.0, float(np.abs(want).max()))
                        if np.abs(c[i, :nend] - want[:nend]).max(initial=0) > tol * scale * np.sqrt(k + 1):
                            failures += 1
                        rest = c[i, nend:]  # beyond the band: either untouched or computed
                        ok = (rest == before[i, nend:n]) | (np.abs(rest - want[nend:]) <= tol * scale * np.sqrt(k + 1))
                        failures += int(not ok.all())
            for split in sorted({0, k // 3, k}):  # B = [b1 ; b2], b1 of `split` rows, each with rows apart
                for kband, nband in ((-1, -1), (0, -1), (5, -1), (-1, 3)):
                    for scaled in (False, True):
                        a = rng.standard_normal((m, k + 1)).astype(dtype)[:, :k]
                        b = rng.standard_normal((k, n)).astype(dtype)
                        b1 = np.zeros((split, n + 3), dtype)[:, 1:n + 1]
                        b2 = np.zeros((k - split, n + 5), dtype)[:, 2:n + 2]
                        b1[:], b2[:] = b[:split], b[split:]
                        rs = rng.standard_normal(m + 2).astype(dtype)[1:m + 1] if scaled else np.zeros(0, dtype)
                        before = np.full((m, n), np.nan, dtype)  # (c is not read)
                        c = before.copy()
                        _run_stacked(a, b1, b2, c, rs, kband, nband)
                        for i in range(m):
                            r0, rows = tiles[i]
                            kend = k if kband < 0 else min(k, kband + r0 + rows)
                            nend = n if nband < 0 else min(n, nband + r0 + rows)
                            want = a[i, :kend].astype(np.float64) @ b[:kend].astype(np.float64)
                            if scaled:
                                want = want * float(rs[i])
                            bound = tol * max(1.0, float(np.abs(want).max())) * np.sqrt(k + 1)
                            failures += int(np.abs(c[i, :nend] - want[:nend]).max(initial=0) > bound)
                            rest = c[i, nend:]
                            failures += int(not (np.isnan(rest) | (np.abs(rest - want[nend:]) <= bound)).all())
            for accumulate in (False, True, 0.5):  # a stored transposed, (K, M) with rows apart
                at = rng.standard_normal((k, m + 2)).astype(dtype)[:, 1:m + 1]
                b = rng.standard_normal((k, n)).astype(dtype)
                before = rng.standard_normal((m, n)).astype(dtype)
                c = before.copy()
                _run_tn(at, b, c, accumulate)
                want = at.T.astype(np.float64) @ b + float(accumulate) * before
                failures += int(np.abs(c - want).max() > tol * max(1.0, float(np.abs(want).max())) * np.sqrt(k + 1))
                # a lower triangular (square, k = m rows): the product that skips its zeros; NaN where
                # a tile of rows of c starting at r0 skips them (a[k, i], k < r0) shows they are never read
                low = np.tril(rng.standard_normal((m, m + 3))[:, :m]).astype(dtype)
                i = np.arange(m)
                r0 = np.array([first for first, _ in tiles])
                low_nan = np.where(i[:, None] < r0[None, :], np.nan, low).astype(dtype)
                b = rng.standard_normal((m, n)).astype(dtype)
                c = before.copy()
                _run_tn_lower(low_nan, b, c, accumulate)
                want = low.T.astype(np.float64) @ b + float(accumulate) * before
                failures += int(not np.isfinite(c).all())
                failures += int(np.abs(c - want).max() > tol * max(1.0, float(np.abs(want).max())) * np.sqrt(m + 1))
    return failures


def test_small_gemm_against_numpy():
    assert check_all() == 0


def test_small_gemm_with_256_bit_vectors(tmp_path):
    # compiled as for an AVX2 machine (Haswell): two-vector panels, 8 floats a vector
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="", NUMBA_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "import test_smallgemm as t; print('failures', t.check_all(1))"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("failures 0"), res.stdout


def test_small_gemm_does_not_read_c_without_beta():
    # the kernels hand it uninitialised buffers: NaN there must not leak into the product. Compared with
    # the float64 product under check_all's bound (an element's error scales with the row's terms, not
    # with its own value: an element that cancels to 0.005 differed from NumPy's float32 product by
    # 2.7e-5 relative on an AVX2 CPU, one rounding of terms of size 1)
    rng = np.random.default_rng(2)
    for dtype, tol in ((np.float32, 2e-6), (np.float64, 1e-13)):
        a, b = rng.standard_normal((9, 13)).astype(dtype), rng.standard_normal((13, 27)).astype(dtype)
        at = rng.standard_normal((13, 9)).astype(dtype)  # a stored transposed
        for run, x in ((lambda c: _run(a, b, c, False, -1, -1), a), (lambda c: _run_tn(at, b, c, 0.0), at.T)):
            c = np.full((9, 27), np.nan, dtype)
            run(c)
            want = x.astype(np.float64) @ b.astype(np.float64)
            assert np.isfinite(c).all()
            assert np.abs(c - want).max() <= tol * max(1.0, float(np.abs(want).max())) * np.sqrt(13 + 1)


_ONE_DTYPE = """
import numpy as np, linattn
from linattn.cpu import smallgemm, symbols
rng = np.random.default_rng(0)
q, k, v, g = (rng.standard_normal((2, 3, 40, 8)).astype(np.float32) * 0.5 for _ in range(4))
gate_pos, gate_dim = -rng.random((2, 3, 40)).astype(np.float32), -rng.random((2, 3, 40, 8)).astype(np.float32)
outs = [linattn.causal_linear_attention(q, k, v), linattn.causal_linear_attention(q, k, v, decay=0.9),
        linattn.causal_linear_attention(q, k, v, gate=gate_pos), linattn.linear_attention(q, k, v),
        linattn.causal_linear_attention(q, k, v, feature_map=linattn.feature_maps.Taylor())]
for kw in ({}, dict(gate=gate_dim)):
    out, vjp = linattn.causal_linear_attention_vjp(q, k, v, **kw)
    outs += [out, *vjp(g)]
out, vjp = linattn.linear_attention_vjp(q, k, v)
outs += [out, *vjp(g)]
outs.append(linattn.step(q[:, :, 0], k[:, :, 0], v[:, :, 0], linattn.State.zeros((2, 3), 8, 8)))
assert all(np.isfinite(np.asarray(x)).all() for x in outs)
print(sorted(str(dt) for (dt, _), symbol in smallgemm._SYMBOLS.items() if symbol in symbols._registered))
"""


def test_float32_kernels_need_only_the_float32_products():
    """The products are registered per dtype before a kernel of that dtype is compiled or loaded
    from the disk cache: every float32 kernel (compiled here, or loaded, when earlier tests cached
    it) runs with the float32 products alone."""
    res = subprocess.run([sys.executable, "-c", _ONE_DTYPE], capture_output=True, text=True, timeout=900,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[-2] == "['float32', 'float32']"
