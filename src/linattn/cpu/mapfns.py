"""The feature maps beyond plain elu+1, relu and identity, computed row by row into a chunk buffer by C
functions (one per map family and dtype, cpu/symbols.py) that the kernels call by an address they
take as an argument: the maps' code is compiled once, not into every kernel variant, and a family
only once a map of it is used.

A map is a code (below) and a parameter vector ``fp`` in the compute dtype: ``fp[0]`` the scale of
the input (phi(s x)), ``fp[1]`` the mapped dimension D', then the family's own parameters:

- elementwise (D' = D): identity, elu+1, relu with a scale; squared relu, gelu, silu,
  sigmoid, softplus;
- TAYLOR (Based): [1, x / d**(1/4), x_i**2 / sqrt(2 d) (i = j), x_i x_j / sqrt(d) (i < j)], so that
  phi(x).phi(y) = 1 + x.y / sqrt(d) + (x.y)**2 / (2 d), D' = 1 + D + D(D+1)/2;
- REBASED: u = gamma * layernorm(x) + beta (fp[2]: the norm's eps, then gamma, beta: D each), then
  [u_i**2 for i = j, sqrt(2) u_i u_j for i < j]: phi(x).phi(x') = (u.u')**2, D' = D(D+1)/2;
- DPFP (Schlag et al. 2021, their code): u = [relu(x), relu(-x)] (2D), then for nu' = 1..nu the
  products u_i u_{(i - nu') mod 2D} (u times u rolled by nu'), D' = 2 D nu;

  these three are products of pairs of a vector u (Taylor's is [x, 1]): their parameters end with
  the tables I, J, C (D' each) of y_f = u[I_f] u[J_f] C_f (feature_maps.py builds them);
- PERFORMER (FAVOR+): exp(omega^T x - |x|**2 / 2) / sqrt(m), omega (D, m) after fp[1], D' = m;
- HEDGEHOG: softmax([2 z, -2 z]) with z = x W + b (W (D, m), b (m)), D' = 2m;
- T2R: relu(x W + b), D' = m.

The exponentials of the elementwise maps and of Hedgehog's softmax take non-positive arguments only
(exp_le0, vectorised); Performer's is exp of any argument (it overflows to inf as the formula does,
for inputs too large: scale them). gelu: see ``gelu``.
"""
import math

import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic, overload

from .._jit import OVERLOAD_OPTIONS, array, njit, run_before_kernels
from .. import workspace
from .buffers import empty
from . import symbols
from .elementwise import abs_bits, elu1, exp_f32_parts, exp_le0, float_of_bits, fma, load_rows, relu
from .gating import like
from .smallgemm import noinline, small_gemm
from .vector import transpose_rows, wide_vectors
from .runtime import kernel_section, threads_for
from .schedule import take
from .threaded import ThreadedKernel
from .views import as_contiguous, keep_alive, unowned


# Codes 0-2 (elementwise.py: IDENTITY, ELU, RELU) are applied by the kernels themselves; these go
# through map_rows. The first three are the same maps with an input scale.
SCALED_IDENTITY, SCALED_ELU, SCALED_RELU = 3, 4, 5
SQUARED_RELU, GELU, SILU, SIGMOID, SOFTPLUS = 6, 7, 8, 9, 10
TAYLOR, REBASED, DPFP, PERFORMER, HEDGEHOG, T2R = 11, 12, 13, 14, 15, 16
#: First code that map_rows computes (kernels apply smaller codes inline).
FIRST = SCALED_IDENTITY
#: Parameters before a family's own in ``fp``: the input scale and D'.
HEAD = 2


def exp_any(x):
    """exp(x) for any x: a vectorising polynomial in float32 (inf past the largest float32, 0 below
    the smallest normal), libm in float64. Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(exp_any, jit_options=OVERLOAD_OPTIONS)
def _exp_any_overload(x):
    if x == types.float32:
        def impl(x):
            p, n = exp_f32_parts(min(max(x, np.float32(-87.33654)), np.float32(88.72283)))
            big = n > np.float32(127.0)  # n reaches 128 (2**128 is not a float32): p * 2 * 2**127
            p = p + p if big else p
            m = np.int32(n) - np.int32(1) if big else np.int32(n)
            y = p * np.int32((m + np.int32(127)) << np.int32(23)).view(np.float32)
            y = y if x >= np.float32(-87.33654) else np.float32(0.0)
            y = y if x <= np.float32(88.72283) else np.float32(np.inf)
            return y if x == x else x
        return impl
    return lambda x: math.exp(x)


def _plus_log1p_01(x, e):
    """x + log(1 + e) for 0 <= e <= 1, in code that vectorises: in float32 e p(e) with p a degree-9
    least-squares fit of log1p(x) / x on [0, 1] (Chebyshev nodes; truncation 5e-9, 1.7e-7 relative
    with float32 rounding; no division: softplus over identity 1.24-1.26 instead of 1.27-1.30 with
    the series below); in float64 2 atanh(u) with u = e / (2 + e) <= 1/3, a series to u**35. The last
    product and the sum with x are one fma (elementwise.fma: the same in vectorised and scalar code).
    NaN stays NaN. Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


_LOG1P_F32 = tuple(np.float32(c) for c in (
    0.9999999953848531, -0.49999903992765465, 0.33330004035249367, -0.24954558871319, 0.19678117257459637,
    -0.1531186310530405, 0.10614264692310249, -0.05706420081439122, 0.01990716095508309, -0.003256378479573084))


def _plus_log1p_f32(x, e):
    p = _LOG1P_F32[9]
    for j in range(8, -1, -1):
        p = p * e + _LOG1P_F32[j]
    return fma(e, p, x)


def _series(dtype, terms):
    def impl(x, e):
        two = dtype(2.0)
        u = e / (two + e)
        u2 = u * u
        p = dtype(1.0 / (2 * terms + 1))
        for j in range(terms - 1, -1, -1):
            p = p * u2 + dtype(1.0 / (2 * j + 1))
        return fma(two * u, p, x)
    return impl


@overload(_plus_log1p_01, jit_options=OVERLOAD_OPTIONS)
def _plus_log1p_overload(x, e):
    if e == types.float32:
        return _plus_log1p_f32
    return _series(np.float64, 17)


def gelu(x):
    """x Phi(x) = x (1 + erf(x / sqrt(2))) / 2 (see ``normal_cdf``). Numba code only."""
    raise NotImplementedError("runs inside Numba kernels only")


def normal_cdf(x):
    """Phi(x) = (1 + erf(x / sqrt(2))) / 2: in float32 with Eigen's rational erf (absolute error
    < 2e-7; relative accuracy is lost far left, where 1 + erf cancels, as in PyTorch's float32 gelu),
    in float64 as erfc(-x / sqrt(2)) / 2 with libm's erfc (no cancellation). Numba code only."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(normal_cdf, jit_options=OVERLOAD_OPTIONS)
def _normal_cdf_overload(x):
    if x == types.float32:
        def impl(x):
            c = min(max(x * np.float32(0.7071067811865476), np.float32(-4.0)), np.float32(4.0))
            x2 = c * c
            p = x2 * np.float32(-2.72614225801306e-10) + np.float32(2.77068142495902e-08)
            p = x2 * p + np.float32(-2.10102402082508e-06)
            p = x2 * p + np.float32(-5.69250639462346e-05)
            p = x2 * p + np.float32(-7.34990630326855e-04)
            p = x2 * p + np.float32(-2.95459980854025e-03)
            p = x2 * p + np.float32(-1.60960333262415e-02)
            q = x2 * np.float32(-1.45660718464996e-05) + np.float32(-2.13374055278905e-04)
            q = x2 * q + np.float32(-1.68282697438203e-03)
            q = x2 * q + np.float32(-7.37332916720468e-03)
            q = x2 * q + np.float32(-1.42647390514189e-02)
            return (np.float32(1.0) + c * p / q) * np.float32(0.5)
        return impl
    return lambda x: math.erfc(-x * 0.7071067811865476) * 0.5


@overload(gelu, jit_options=OVERLOAD_OPTIONS)
def _gelu_overload(x):
    return lambda x: x * normal_cdf(x)  # (the same rounding as x (1 + erf) / 2: halving is exact)


@njit(helper=True)
def _elementwise(code, scale, x, y):
    """y = f(scale x) for the elementwise codes, in x's dtype."""
    wide_vectors()
    one = like(1.0, y)
    if code == SCALED_IDENTITY:
        for a in range(x.shape[0]):
            y[a] = scale * x[a]
    elif code == SCALED_ELU:
        for a in range(x.shape[0]):
            y[a] = elu1(scale * x[a])
    elif code == SCALED_RELU:
        for a in range(x.shape[0]):
            y[a] = relu(scale * x[a])
    elif code == SQUARED_RELU:
        for a in range(x.shape[0]):
            r = relu(scale * x[a])
            y[a] = r * r
    elif code == GELU:
        for a in range(x.shape[0]):
            y[a] = gelu(scale * x[a])
    elif code == SILU or code == SIGMOID:
        silu = code == SILU
        for a in range(x.shape[0]):
            v = scale * x[a]
            e = exp_le0(-abs(v))  # sigmoid(v) = 1 / (1 + e) for v >= 0, e / (1 + e) below
            s = (one if v >= 0 else e) / (one + e)
            s = s if v == v else v
            y[a] = v * s if silu else s
    else:  # SOFTPLUS: max(v, 0) + log(1 + exp(-|v|))
        for a in range(x.shape[0]):
            v = scale * x[a]
            y[a] = _plus_log1p_01(relu(v), exp_le0(-abs(v)))


# One function per family for a block of rows: Y[t, :D'] = phi(X[t]) (X: rows of D values already
# scaled by fp[0]; Y: rows with unit stride; ``work``: work_size(D, D') - BLOCK D values). Each is
# compiled into its own C function (below), only once it is used.

#: Rows mapped at a time (the projections' products are BLOCK x D by D x m).
BLOCK = 64
#: Rows whose pair products are computed at a time (transposed: D' x PAIR_ROWS values).
PAIR_ROWS = 32


@njit(helper=True)
def work_size(d, dk):
    """Values of scratch a C function needs for inputs of D and maps of D' features (with the gathered
    block of rows)."""
    return BLOCK * (d + dk) + PAIR_ROWS * (2 * d + dk + 3) + 4 * d + dk + 2


@njit(helper=True)
def _pairs(X, Y, fp, off, work):
    """Y[t, f] = u_t[I[f]] u_t[J[f]] C[f] for the rows t of X, with I, J, C (D' each) from fp[off:]:
    the products that the Taylor and ReBased maps are made of, u = [x, 1]. Computed transposed,
    PAIR_ROWS rows at a time: u^T (one row of u's element i for all rows t) and then each feature for
    all rows as a product of two contiguous rows (vectors), transposed into Y at the end
    (vector.transpose_rows); per row and feature a gather of two elements cost 3-4x more."""
    d, dk = X.shape[1], Y.shape[1]
    nu = d + 1
    UT = work[:nu * PAIR_ROWS].reshape(nu, PAIR_ROWS)
    YT = work[nu * PAIR_ROWS:(nu + dk) * PAIR_ROWS].reshape(dk, PAIR_ROWS)
    colsum = work[(nu + dk) * PAIR_ROWS:(nu + dk + 1) * PAIR_ROWS + 2 * d]  # transpose_rows' sums, unused
    idx_i, idx_j, coef = fp[off:off + dk], fp[off + dk:off + 2 * dk], fp[off + 2 * dk:off + 3 * dk]
    UT[d, :] = 1
    for s0 in range(0, X.shape[0], PAIR_ROWS):
        nb = min(PAIR_ROWS, X.shape[0] - s0)
        transpose_rows(X[s0:s0 + nb], UT, colsum, nb)
        for f in range(dk):
            ui, uj, yt, c = UT[np.intp(idx_i[f])], UT[np.intp(idx_j[f])], YT[f], coef[f]
            for t in range(nb):
                yt[t] = ui[t] * uj[t] * c
        transpose_rows(YT[:, :nb], Y[s0:s0 + nb], colsum, dk)


@njit(helper=True)
def _elementwise_block(code, fp, X, Y, work):
    """(X not yet scaled: the scale is applied by _elementwise, as for rows read in place, so that
    every layout rounds the same.)"""
    for t in range(X.shape[0]):
        _elementwise(code, fp[0], X[t], as_contiguous(Y[t]))


@njit(helper=True)
def _taylor_block(code, fp, X, Y, work):
    """u = [x, 1]: the constant, x / D**(1/4) and the products as pairs of u (fp: I, J, C)."""
    _pairs(X, Y, fp, HEAD, work)


@njit(helper=True)
def rebased_norm(X, fp):
    """X's rows x become ReBased's u = gamma LN(x) + beta (fp: the map's parameters, eps, gamma, beta from
    HEAD): for its features here and for its vjp (cpu/pair_grad.py's C function). X's rows have unit stride
    (as_contiguous: rows of a view typed as such vectorise; 4x faster there)."""
    d = X.shape[1]
    for t in range(X.shape[0]):
        x = as_contiguous(X[t])
        mean = 0.0
        for a in range(d):
            mean += x[a]
        mean /= d
        var = 0.0
        for a in range(d):
            var += (x[a] - mean) ** 2
        inv = 1.0 / math.sqrt(var / d + fp[HEAD])
        for a in range(d):
            x[a] = (x[a] - mean) * inv * fp[HEAD + 1 + a] + fp[HEAD + 1 + d + a]


@njit(helper=True)
def _rebased_block(code, fp, X, Y, work):
    """u = gamma LN(x) + beta (fp: eps, gamma, beta, then I, J, C)."""
    rebased_norm(X, fp)  # (X's rows become u)
    _pairs(X, Y, fp, HEAD + 1 + 2 * X.shape[1], work)


@njit(helper=True)
def _dpfp_block(code, fp, X, Y, work):
    """u = [relu(x), relu(-x)] and feature (nu' - 1) 2D + i = u_i u_{(i - nu') mod 2D}, nu' = 1..nu (the
    table in fp says the same), row by row: u in E after a copy of its last nu values, so that each nu'
    is the product of two contiguous runs of E, E[nu:nu + 2D] * E[nu - nu':nu - nu' + 2D] (through
    _pairs' transposes: 1.5x the time of the map, D 32, nu 1)."""
    d, n2 = X.shape[1], 2 * X.shape[1]
    nu = Y.shape[1] // n2
    E = work[:n2 + nu]
    for t in range(X.shape[0]):
        x, y = X[t], as_contiguous(Y[t])
        for a in range(d):
            E[nu + a] = relu(x[a])
            E[nu + d + a] = relu(-x[a])
        for a in range(nu):
            E[a] = E[nu + (a - nu) % n2]  # u_{(a - nu) mod 2D} (nu may pass 2D)
        for p in range(1, nu + 1):
            yp, up, shifted = y[(p - 1) * n2:p * n2], E[nu:nu + n2], E[nu - p:nu - p + n2]
            for i in range(n2):
                yp[i] = up[i] * shifted[i]


@njit(helper=True)
def _projection(fp, X, Z):
    """Z = X W with W (D, m) from fp (a register-tiled product)."""
    d, m = X.shape[1], Z.shape[1]
    small_gemm(X, fp[HEAD:HEAD + d * m].reshape(d, m), Z, False, -1, -1)


@njit(helper=True)
def _performer_block(code, fp, X, Y, work):
    """(X not yet scaled, as for the other projections: (s x) W = s (x W), |s x|**2 = s**2 |x|**2.)
    The block's |x|**2 first, then its exponentials (as in _hedgehog_block: 0.92 -> 0.82 ms)."""
    c, d, m = X.shape[0], X.shape[1], Y.shape[1]
    _projection(fp, X, Y)
    inv, s = like(1.0 / math.sqrt(m), Y), fp[0]
    half = work[:c]
    for t in range(c):
        x = as_contiguous(X[t])
        total = 0.0
        for a in range(d):
            total += x[a] * x[a]
        half[t] = like(0.5 * s * s * total, Y)
    for t in range(c):
        y, h = as_contiguous(Y[t]), half[t]
        for j in range(m):
            y[j] = exp_any(s * y[j] - h) * inv


@njit(helper=True)
def _t2r_block(code, fp, X, Y, work):
    """(X not yet scaled: (s x) W = s (x W).)"""
    d, m = X.shape[1], Y.shape[1]
    _projection(fp, X, Y)
    b, s = fp[HEAD + d * m:HEAD + d * m + m], fp[0]
    for t in range(X.shape[0]):
        y = as_contiguous(Y[t])
        for j in range(m):
            y[j] = relu(s * y[j] + b[j])


@njit(helper=True)
def _hedgehog_block(code, fp, X, Y, work):
    """softmax over [2z, -2z], z = x W + b: shifted by 2 max |z|, exponentials of numbers <= 0 (a row's
    maximum over the bits of |z|: an integer maximum, which vectorises, where a float one was a scalar
    loop; transposing blocks of rows for elementwise maxima and sums cost more: ~21% of the map). In
    three passes over the block's rows (shifts, exponentials and their sums, scaling), not all three
    row by row: no pass waits on the one before for the same row (the map 0.88 -> 0.67 ms on 16384
    rows, D 64, m 32; the two halves' exponentials in loops of their own, then their sum: 0.64)."""
    wide_vectors()
    c, d, m = X.shape[0], X.shape[1], Y.shape[1] // 2
    Z = work[:c * m].reshape(c, m)
    _projection(fp, X, Z)  # (X not yet scaled: (s x) W = s (x W))
    b, s = fp[HEAD + d * m:HEAD + d * m + m], fp[0]
    two, zero = like(2.0, Y), like(0.0, Y)
    per_row = work[c * m:c * m + c]  # each row's shift, then its 1 / sum
    for t in range(c):
        z = as_contiguous(Z[t])
        top = abs_bits(zero)
        for j in range(m):
            v = s * z[j] + b[j]
            z[j] = v
            a = abs_bits(v)
            top = a if a > top else top  # (NaN in z: the maximum, and NaN in every feature of its row)
        per_row[t] = two * float_of_bits(top, zero)
    for t in range(c):
        z, y, h = as_contiguous(Z[t]), as_contiguous(Y[t]), per_row[t]
        total = zero  # (in Y's dtype: the 2m terms are summed in vector lanes, no conversions)
        for j in range(m):
            y[j] = exp_le0(two * z[j] - h)
        for j in range(m):
            y[m + j] = exp_le0(-two * z[j] - h)
        for j in range(2 * m):
            total += y[j]
        per_row[t] = like(1.0, Y) / total
    for t in range(c):
        y, inv = as_contiguous(Y[t]), per_row[t]
        for j in range(2 * m):
            y[j] *= inv


def _rows(src, rs, cs, c, d, dst, drs, code, fp, nfp, work, family):
    """dst[t, :D'] = phi(scale src[t]) for t < c with family ``family``'s block function (a constant:
    each C function compiles only its own): src rows ``rs`` elements apart with ``cs`` between their
    elements, dst rows ``drs`` apart; ``work`` holds work_size(D, D') values. Numba code only.

    Rows of adjacent elements in memory order (cs = 1, rs >= 0: the usual case) are read as
    contiguous rows (an element-by-element gather cost ~20 ns a row of 64); the elementwise maps
    then read them in place, with no copy (silu over identity 1.33 -> ~1.2 at B1 H8 N2048), and so do
    the other families' blocks (but ReBased's, which writes them) when the rows follow each other and
    the input scale is 1 (T2R over identity 1.53-1.61 -> 1.49-1.53), or is applied by the block: the
    projections (Performer, Hedgehog, T2R) scale their product instead of a copy of the rows."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(_rows, jit_options=OVERLOAD_OPTIONS, prefer_literal=True)
def _rows_overload(src, rs, cs, c, d, dst, drs, code, fp, nfp, work, family):
    block = _BLOCKS[family.literal_value]
    elementwise = family.literal_value == 0
    in_place = block is not _rebased_block  # the blocks that only read X (ReBased normalises it in place)
    # the blocks that apply the input scale themselves: the elementwise maps, and the projections, which
    # scale their product (one multiply per feature, no copy of a scaled block)
    scales_itself = elementwise or block in (_performer_block, _hedgehog_block, _t2r_block)

    def impl(src, rs, cs, c, d, dst, drs, code, fp, nfp, work, family):
        params = carray(fp, (nfp,))
        dk = int(params[1])
        out = carray(dst, (c, drs))  # (the last row's tail past D' is never touched)
        buf = carray(work, (work_size(d, dk),))
        scale = params[0] if not scales_itself else like(1.0, params)
        in_rows = cs == 1 and rs >= 0
        flat = carray(src, ((c - 1) * rs + d if in_rows else 0,))  # the rows, when in_rows
        if elementwise and in_rows:
            if rs == d and drs == d:  # one run of c d values: a loop over rows of 64 costs ~1.5x
                _elementwise(code, params[0], as_contiguous(flat[:c * d]), as_contiguous(out.reshape(c * d)))
            else:
                for t in range(c):
                    _elementwise(code, params[0], as_contiguous(flat[t * rs:t * rs + d]), as_contiguous(out[t, :dk]))
            return
        for t0 in range(0, c, BLOCK):
            cb = min(BLOCK, c - t0)
            if in_place and in_rows and rs == d and scale == 1:  # the block's rows as they are
                block(code, params, flat[t0 * d:(t0 + cb) * d].reshape(cb, d), out[t0:t0 + cb, :dk], buf[BLOCK * d:])
                continue
            X = buf[:cb * d].reshape(cb, d)
            for t in range(cb):
                x = X[t]
                if in_rows:
                    row = as_contiguous(flat[(t0 + t) * rs:(t0 + t) * rs + d])
                    for a in range(d):
                        x[a] = scale * row[a]
                else:
                    for a in range(d):
                        x[a] = scale * src[(t0 + t) * rs + a * cs]
            block(code, params, X, out[t0:t0 + cb, :dk], buf[BLOCK * d:])
    return impl


_BLOCKS = (_elementwise_block, _taylor_block, _rebased_block, _dpfp_block, _performer_block, _hedgehog_block,
           _t2r_block)


# The C functions (arguments: src, rs, cs, c, d, dst, drs, code, fp, len(fp), work; D' is fp[1]), one
# per family: plain module-level functions, each cached on disk by Numba (one that
# took its row function as an argument could not be: "dynamic globals").
def _elementwise_c(src, rs, cs, c, d, dst, drs, code, fp, nfp, work):
    _rows(src, rs, cs, c, d, dst, drs, code, fp, nfp, work, 0)


def _taylor_c(src, rs, cs, c, d, dst, drs, code, fp, nfp, work):
    _rows(src, rs, cs, c, d, dst, drs, code, fp, nfp, work, 1)


def _rebased_c(src, rs, cs, c, d, dst, drs, code, fp, nfp, work):
    _rows(src, rs, cs, c, d, dst, drs, code, fp, nfp, work, 2)


def _dpfp_c(src, rs, cs, c, d, dst, drs, code, fp, nfp, work):
    _rows(src, rs, cs, c, d, dst, drs, code, fp, nfp, work, 3)


def _performer_c(src, rs, cs, c, d, dst, drs, code, fp, nfp, work):
    _rows(src, rs, cs, c, d, dst, drs, code, fp, nfp, work, 4)


def _hedgehog_c(src, rs, cs, c, d, dst, drs, code, fp, nfp, work):
    _rows(src, rs, cs, c, d, dst, drs, code, fp, nfp, work, 5)


def _t2r_c(src, rs, cs, c, d, dst, drs, code, fp, nfp, work):
    _rows(src, rs, cs, c, d, dst, drs, code, fp, nfp, work, 6)


_FAMILIES = {"elementwise": _elementwise_c, "taylor": _taylor_c, "rebased": _rebased_c, "dpfp": _dpfp_c,
             "performer": _performer_c, "hedgehog": _hedgehog_c, "t2r": _t2r_c}
_FAMILY_OF = {TAYLOR: "taylor", REBASED: "rebased", DPFP: "dpfp", PERFORMER: "performer", HEDGEHOG: "hedgehog",
              T2R: "t2r"}


def _c_signature(dt):
    ptr, i = types.CPointer(dt), types.intp
    return types.void(ptr, i, i, i, i, ptr, i, i, ptr, i, ptr)


_SYMBOLS = {(dt, family): symbols.define(f"map_rows_{family}_{dt}", fn, _c_signature(dt))
            for dt in (types.float32, types.float64) for family, fn in _FAMILIES.items()}


def address(dtype, code):
    """The address of the C function computing map ``code`` for a NumPy dtype (compiled or loaded on
    first use): the kernels take it as an argument, so they need nothing registered and a family's
    code is compiled only once it is used."""
    family = _FAMILY_OF.get(code, "elementwise")
    run_before_kernels(np.dtype(dtype))  # the learned maps' functions call small_gemm's by symbol
    return symbols.address(_SYMBOLS[numba.from_dtype(np.dtype(dtype)), family])


@intrinsic
def _call_map_rows(typingctx, addr, src, i0, c, code, fp, dst, work):
    """Call map_rows at ``addr`` for src[i0:i0 + c] (2-D, strides multiples of the itemsize) into
    dst (2-D, unit column stride) with map ``code``, parameters ``fp`` (1-D, contiguous), ``work``."""
    sig = types.void(addr, src, i0, c, code, fp, dst, work)

    def codegen(context, builder, sig, args):
        dtype = sig.args[1].dtype
        size = context.get_abi_sizeof(context.get_data_type(dtype))
        intp = context.get_value_type(types.intp)
        s = context.make_array(sig.args[1])(context, builder, args[1])
        start = context.cast(builder, args[2], sig.args[2], types.intp)
        rs, cs = (builder.sdiv(builder.extract_value(s.strides, k), ir.Constant(intp, size)) for k in (0, 1))
        first = builder.gep(s.data, [builder.mul(start, rs)])
        dsta = context.make_array(sig.args[6])(context, builder, args[6])
        drs = builder.sdiv(builder.extract_value(dsta.strides, 0), ir.Constant(intp, size))
        fpa = context.make_array(sig.args[5])(context, builder, args[5])
        wa = context.make_array(sig.args[7])(context, builder, args[7])
        values = [first, rs, cs, context.cast(builder, args[3], sig.args[3], types.intp),
                  builder.extract_value(s.shape, 1), dsta.data, drs,
                  context.cast(builder, args[4], sig.args[4], types.intp), fpa.data,
                  builder.extract_value(fpa.shape, 0), wa.data]
        symbols.emit_call_address(builder, context.cast(builder, args[0], sig.args[0], types.intp), values)
        return context.get_dummy_value()

    return sig, codegen


@njit(helper=True)
def _mapped_rows(src, i0, c, mp, dst):
    """The C function's call, kept out of the kernels' inlined code (it compiles once per signature)."""
    noinline()
    if c > 0:
        _call_map_rows(mp[2], src, i0, c, mp[0], mp[1], dst, mp[3])


@njit(helper=True)
def load_features(src, i0, c, mp, dst):
    """dst[t, :D'] = phi(src[i0 + t]) for t < c, for the map ``mp`` = (code, fp, address, work): codes
    below FIRST inline (elementwise.load_rows), the others through map_rows (dst: unit column
    stride; work: work_size(D, D') values)."""
    if mp[0] < FIRST:
        load_rows(src, i0, c, mp[0], dst)
    else:
        _mapped_rows(src, i0, c, mp, dst)


@njit(helper=True)
def mapped_dim(code, fp, d):
    """D' of map ``code`` with parameters ``fp`` for inputs of D features."""
    return int(fp[1]) if code >= FIRST else d


@njit(helper=True)
def map_state(code, fp, addr, d, dk, dtype):
    """The tuple load_features takes, with its work buffer."""
    return (code, fp, addr, empty(work_size(d, dk) if code >= FIRST else 0, dtype))


#: Rows per work item of ``apply`` (four of the blocks above).
APPLY_ROWS = 4 * BLOCK
#: Work per thread below which ``apply`` runs on fewer threads: rows times D + D' (values read and
#: written), twice that for the maps that are not elementwise (about twice the time per value): about
#: 20 us of one thread's work (gelu on 1024 rows of 64 took 18 us on one thread and on two).
APPLY_WORK_PER_THREAD = 1 << 17


def _apply(x, code, fp, addr, y, per_item, counter):
    """y[r] = phi(x[r]) for the rows of x, ``per_item`` at a time taken from ``counter`` (one thread's
    share; each thread its own work buffer)."""
    mapper = map_state(code, fp, addr, x.shape[1], y.shape[1], y.dtype)
    mp = unowned(mapper)
    x, y = unowned((x, y))  # (views not counted: the threads would contend for one count)
    rows = x.shape[0]
    item = take(counter)
    while item * per_item < rows:
        r0 = item * per_item
        c = min(per_item, rows - r0)
        load_features(x, r0, c, mp, y[r0:r0 + c])
        item = take(counter)
    keep_alive(mapper)


def _apply_signature(dt, variant):
    return types.void(array(dt, 2, "A", readonly=True), types.int64, array(dt, 1, readonly=True), types.int64,
                      array(dt, 2), types.int64)


_apply_kernel = ThreadedKernel(_apply, _apply_signature)


def apply(x, code, fp, dk):
    """phi of the rows of a 2-D float32/float64 array ``x`` (strides multiples of its itemsize), as a
    new (rows, D') array (a large one from linattn.workspace's pool): the kernels' own code, for paths
    that map before they compute; on as many threads as the rows are worth (threads_for)."""
    rows = x.shape[0]
    y = workspace.empty((rows, dk), x.dtype)
    if rows:
        work = rows * (x.shape[1] + dk) * (1 if code < TAYLOR else 2)
        nthreads = 1 if work <= APPLY_WORK_PER_THREAD else threads_for(work, APPLY_WORK_PER_THREAD)
        kernel = _apply_kernel.get(x.dtype, None)
        args = (x, code, fp, address(x.dtype, code), y)
        if nthreads == 1:  # the worker on this thread through its unchecked entry point (the arguments
            kernel.unchecked(*args, rows, np.zeros(1, np.int64))  # have its types): ~1 us less than a typed call
        else:
            with kernel_section(nthreads):
                kernel(nthreads, *args, APPLY_ROWS)
    return y
