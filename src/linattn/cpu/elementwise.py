"""Feature maps as Numba loops (over a chunk of rows, or a flat array), with an elu+1 that vectorises,
and the exp of decay factors (exp_le0) from the same polynomials."""
import math

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .._jit import OVERLOAD_OPTIONS, njit, target_features
from .buffers import empty
from .vector import wide_vectors
from .views import as_contiguous, flat_rows

#: Codes of the feature maps the kernels apply themselves (callables are applied before, as IDENTITY).
IDENTITY, ELU, RELU = 0, 1, 2

#: Rows shorter than this are mapped a block at a time (load_rows).
FLAT_BELOW = 64


def elu1(x):
    """elu(x) + 1 without cancellation: x + 1 for x > 0, exp(x) otherwise (NaN stays NaN).

    The exp is a polynomial that LLVM vectorises (Numba's np.exp is scalar libm without SVML), within
    1.05 ulp: fitted ones of degree 6 in float32 and 11 in float64 (see _reduced_f32 and _exp_f64).
    Only callable from Numba code.
    """
    raise NotImplementedError("runs inside Numba kernels only")


#: 1.5 * 2**23 + 127: t = x / ln2 + this, rounded, holds round(x / ln2) + 127 in its low mantissa bits
#: (the floats in [2**23, 2**24) are the integers), so that t's bits shifted left by 23 are the float32
#: 2**round(x / ln2) (for round(x / ln2) in [-126, 127]); t minus this is round(x / ln2).
_SHIFTER_F32 = 12583039.0


@njit(helper=True)
def _reduced_f32(xn):
    """(exp(r), t) for |xn| <= 88.7 (the caller clamps; NaN gives NaNs): t = xn / ln2 + _SHIFTER_F32
    rounded by one fma, n = t - _SHIFTER_F32 = round(xn / ln2) (no floor, no conversion to an
    integer), r = xn - n ln2 with ln2 in two parts (Cephes'), |r| <= ln2/2, exp(r) by a degree-6
    polynomial fitted to its relative error there (1.7e-8 with float32 coefficients). Each step is an
    explicit fma (the last two ``exp_tail``): with reassociation allowed, LLVM folded the two parts of
    ln2 into one (errors up to 2.9e-7 relative, 4 ulp, where n is large), and a value could round
    differently in a vectorised loop and in its scalar remainder."""
    t = fma(xn, np.float32(1.44269504088896341), np.float32(_SHIFTER_F32))
    n = strict_sub(t, np.float32(_SHIFTER_F32))  # (not simplified back to xn / ln2)
    r = fma(n, np.float32(-0.693359375), xn)
    r = fma(n, np.float32(2.12194440e-4), r)
    p = fma(np.float32(1.3846145011484623e-3), r, np.float32(8.37411917746067e-3))
    p = fma(p, r, np.float32(4.1667960584163666e-2))
    p = fma(p, r, np.float32(0.16666431725025177))
    p = fma(p, r, np.float32(0.4999999403953552))
    return exp_tail(p, r), t


@njit(helper=True)
def _exp_f32(xn):
    """exp(xn) for -87.33654 <= xn <= 0 (the caller clamps; NaN gives NaN), within 1.05 ulp: exp(r)
    times 2**n made from t's bits (_reduced_f32)."""
    p, t = _reduced_f32(xn)
    return p * np.int32(np.float32(t).view(np.int32) << np.int32(23)).view(np.float32)


@njit(helper=True)
def exp_f32_parts(xn):
    """(exp(r), n) with xn = n ln2 + r, n = round(xn / ln2) as a float, |r| <= ln2/2, for
    |xn| <= 88.7 (the caller clamps)."""
    p, t = _reduced_f32(xn)
    return p, strict_sub(t, np.float32(_SHIFTER_F32))


#: 1.5 * 2**52 + 1023: as _SHIFTER_F32, for float64 (its bits shifted left by 52: 2**round(x / ln2)).
_SHIFTER_F64 = 6755399441056767.0


@njit(helper=True)
def _exp_f64(xn):
    """exp(xn) for -708.39 <= xn <= 0 (the caller clamps; NaN gives NaN): 2**n * exp(r) as in
    _exp_f32, ln2 in two parts so that n * hi is exact, exp(r) by a degree-11 Chebyshev fit on
    |r| <= ln2/2 (mpmath.chebyfit: 3.2e-18, below float64's eps; the Taylor series needed r**13), each
    step an explicit fma (the last two ``exp_tail``)."""
    t = fma(xn, 1.4426950408889634, _SHIFTER_F64)
    n = strict_sub(t, _SHIFTER_F64)  # (not simplified back to xn / ln2)
    r = fma(n, -0.6931471803691238, xn)
    r = fma(n, -1.9082149292705877e-10, r)
    p = fma(2.5110037605963777e-08, r, 2.763263963904103e-07)
    p = fma(p, r, 2.755724091857897e-06)
    p = fma(p, r, 2.4801485482328494e-05)
    p = fma(p, r, 0.00019841269890047113)
    p = fma(p, r, 0.0013888888952314775)
    p = fma(p, r, 0.008333333333319601)
    p = fma(p, r, 0.0416666666664881)
    p = fma(p, r, 0.1666666666666668)
    p = fma(p, r, 0.5000000000000019)
    return exp_tail(p, r) * np.int64(np.float64(t).view(np.int64) << np.int64(52)).view(np.float64)


@njit(helper=True)
def _elu1_f32(x):
    t = np.float32(0.0) if x >= np.float32(0.0) else x  # (comparisons that a NaN fails: it goes through)
    t = np.float32(-87.33654) if t < np.float32(-87.33654) else t  # exp(-87.34): the smallest normal
    return x + np.float32(1.0) if x > np.float32(0.0) else _exp_f32(t)


@njit(helper=True)
def _elu1_f64(x):
    t = 0.0 if x >= 0.0 else x  # (as in _elu1_f32)
    t = -708.39 if t < -708.39 else t  # exp(-708.39): about the smallest normal float64
    return x + 1.0 if x > 0.0 else _exp_f64(t)


def exp_le0(x):
    """exp(x) for x <= 0 (a decay factor): exactly 1 at 0, exactly 0 from exp(x) < the smallest
    normal (-inf included), the same vectorising polynomial as elu1 in float32 and float64.
    Only callable from Numba code."""
    raise NotImplementedError("runs inside Numba kernels only")


@overload(exp_le0, jit_options=OVERLOAD_OPTIONS)
def _exp_le0_overload(x):
    if x == types.float32:
        def impl(x):
            e = _exp_f32(max(x, np.float32(-87.33654)))
            return e if x >= np.float32(-87.33654) else np.float32(0.0)
        return impl
    if x == types.float64:
        def impl(x):
            e = _exp_f64(max(x, -708.39))
            return e if x >= -708.39 else 0.0
        return impl
    return None


@njit(helper=True)
def _elu1_any(x):
    return x + 1 if x > 0 else math.exp(x)


@overload(elu1, jit_options=OVERLOAD_OPTIONS)
def _elu1_overload(x):
    if x == types.float32:
        return lambda x: _elu1_f32(x)
    if x == types.float64:
        return lambda x: _elu1_f64(x)
    return lambda x: _elu1_any(x)


#: The one fast-math flag of the operations below that must keep their rounding: Numba gives its
#: flags (``reassoc``, ``contract``, ...) to every float operation of a kernel that has none, and with
#: them LLVM rewrites (a + b) - b to a, folds the exp's two-part reduction into one, and fuses a
#: multiply into an add in one code path and not another. ``arcp`` only concerns divisions.
_KEEP = ("arcp",)


def target_has_fma(context):
    """Whether the CPU Numba compiles for has a fused multiply-add: on x86 from its features (FMA3:
    Intel since Haswell, AMD since Piledriver; not some Atom, Celeron and Pentium cores); every other
    target Numba supports (aarch64, ppc64le) has one in its base instruction set."""
    if not llvm_binding.get_process_triple().startswith(("x86", "i386", "i686")):
        return True
    return "+fma" in target_features(context).split(",")


@intrinsic
def fma(typingctx, x, y, z):
    """x * y + z, for three floats of one type, computed alike in every code path: rounded once
    (llvm.fma) where the CPU has a fused multiply-add, else a product and a sum that LLVM may not
    rewrite or fuse (there, llvm.fma would call libm's fma for every value and no loop would
    vectorise). With contraction allowed, LLVM fused a multiply into the add after it in a vectorised
    loop and not in its scalar remainder (seen: softplus's last add on an AVX-512 CPU), so a value
    mapped alone or among others could differ in its last bit. Only callable from Numba code."""
    if not (isinstance(x, types.Float) and x == y == z):
        return None

    def codegen(context, builder, sig, args):
        if not target_has_fma(context):
            return builder.fadd(builder.fmul(args[0], args[1], flags=_KEEP), args[2], flags=_KEEP)
        return builder.call(_llvm_fma(builder, args[0].type), args)

    return x(x, y, z), codegen


def _llvm_fma(builder, ty):
    """The declaration of llvm.fma for floats of LLVM type ``ty``."""
    return builder.module.declare_intrinsic("llvm.fma", [ty], ir.FunctionType(ty, [ty, ty, ty]))


@intrinsic
def exp_tail(typingctx, p, r):
    """1 + r + r**2 p, the last steps of the exps' polynomials (``p``: the polynomial from r**2's coefficient on),
    for two floats of one type: (p r + 1) r + 1 in two fmas where the CPU has a fused multiply-add (as ``fma``
    twice); else 1 + (r + r (r p)), so that the roundings of the products and sums fall on the terms smaller
    than 1: (p r + 1) r + 1 with its products rounded was up to 1.18 ulp from the exact exp in float64 (1.15 in
    float32), this 0.96 (1.04; tests/no_fma_check.py's values). Only callable from Numba code."""
    if not (isinstance(p, types.Float) and p == r):
        return None

    def codegen(context, builder, sig, args):
        p_, r_ = args
        one = ir.Constant(p_.type, 1.0)
        if target_has_fma(context):
            fn = _llvm_fma(builder, p_.type)
            return builder.call(fn, [builder.call(fn, [p_, r_, one]), r_, one])
        small = builder.fmul(r_, builder.fmul(r_, p_, flags=_KEEP), flags=_KEEP)
        return builder.fadd(one, builder.fadd(r_, small, flags=_KEEP), flags=_KEEP)

    return p(p, r), codegen


@intrinsic
def strict_sub(typingctx, x, y):
    """x - y, for two floats of one type, that LLVM may not rewrite with the operations around it (see
    _KEEP: (x + y) - y would become x). Only callable from Numba code."""
    if not (isinstance(x, types.Float) and x == y):
        return None
    return x(x, y), lambda context, builder, sig, args: builder.fsub(args[0], args[1], flags=_KEEP)


@intrinsic
def abs_bits(typingctx, x):
    """The bits of |x| as a signed integer of x's width: ordered as |x| is (every NaN above inf), so
    that a maximum over them is an integer maximum, which LLVM vectorises (a float one it does not
    without "nnan"). Only callable from Numba code."""
    if not isinstance(x, types.Float):
        return None
    ity = types.int32 if x.bitwidth == 32 else types.int64

    def codegen(context, builder, sig, args):
        lty = ir.IntType(x.bitwidth)
        return builder.and_(builder.bitcast(args[0], lty), ir.Constant(lty, (1 << (x.bitwidth - 1)) - 1))

    return ity(x), codegen


@intrinsic
def float_of_bits(typingctx, b, like):
    """The float of ``like``'s type whose bits are the integer ``b`` (of its width): abs_bits' inverse.
    Only callable from Numba code."""
    if not (isinstance(like, types.Float) and isinstance(b, types.Integer) and b.bitwidth == like.bitwidth):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(like))

    return like(b, like), codegen


@njit(helper=True)
def relu(x):
    """max(x, 0) that keeps NaN, in x's type (+0 for every x <= 0: x * 0 gave NaN for -inf, and
    with an integer 0 a float64 for a float32 x)."""
    return x if (x > 0 or x != x) else np.float32(0.0)


@njit(helper=True)
def map_row(src, fm, dst):
    """dst[d] = phi(src[d]) for d < len(src), for feature map code ``fm`` (1-D arrays)."""
    wide_vectors()
    if fm == ELU:
        for d in range(src.shape[0]):
            dst[d] = elu1(src[d])
    elif fm == RELU:
        for d in range(src.shape[0]):
            dst[d] = relu(src[d])
    else:
        for d in range(src.shape[0]):
            dst[d] = src[d]


@njit(helper=True)
def load_rows(src, i0, c, fm, dst):
    """dst[t, :D] = phi(src[i0 + t, :]) for t < c, for feature map code ``fm`` (src: (N, D), any strides).

    ``dst`` may have more than D columns (the rest is left alone); pass a whole C-contiguous array,
    not a column slice, so that the loops vectorise. Rows of adjacent elements are read as such
    (as_contiguous), so strided views of rows vectorise too.
    """
    wide_vectors()
    d, size = src.shape[1], src.itemsize
    if (fm != IDENTITY and c > 1 and src.strides[1] == size and src.strides[0] == d * size
            and dst.shape[1] == d and dst.strides[1] == size and dst.strides[0] == d * size):
        # rows adjacent in memory on both sides: one flat run (no call and loop set-up per row)
        map_flat(flat_rows(src, i0, c), fm, flat_rows(dst, 0, c))
    elif fm != IDENTITY and d < FLAT_BELOW and src.strides[1] == size and abs(src.strides[0]) == d * size and c > 1:
        # short rows: the vectorised loop over one row would leave them all to its scalar remainder,
        # so the block is mapped as one flat run (rows forward or backward in memory), then copied
        up = src.strides[0] > 0
        flat = empty(c * d, dst.dtype)
        map_flat(flat_rows(src, i0 if up else i0 + c - 1, c), fm, flat)
        for t in range(c):
            row, off = dst[t], (t if up else c - 1 - t) * d
            for a in range(d):
                row[a] = flat[off + a]
    elif src.strides[1] == size:
        _map_rows_apart(src, i0, c, fm, dst)
    else:
        for t in range(c):
            map_row(src[i0 + t], fm, dst[t])


@njit(helper=True)
def _map_rows_apart(src, i0, c, fm, dst):
    """load_rows for rows of adjacent elements that lie apart in memory (a fused projection's head
    views): the loop over the rows inside each map's branch, so its constants are set up once for the
    block, not once per row through a call to map_row (non-causal B1 H8 N2048 on such views 1.04 ->
    1.00 ms)."""
    wide_vectors()
    d = src.shape[1]
    if fm == ELU:
        for t in range(c):
            s, o = as_contiguous(src[i0 + t]), dst[t]
            for a in range(d):
                o[a] = elu1(s[a])
    elif fm == RELU:
        for t in range(c):
            s, o = as_contiguous(src[i0 + t]), dst[t]
            for a in range(d):
                o[a] = relu(s[a])
    else:
        for t in range(c):
            s, o = as_contiguous(src[i0 + t]), dst[t]
            for a in range(d):
                o[a] = s[a]


@njit(helper=True)
def map_flat(src, fm, dst):
    """dst[i] = phi(src[i]) for 1-D arrays, for feature map code ``fm``: one loop over all elements
    (for a decoding step, every head at once; measured faster than ``load_rows`` on one long row)."""
    wide_vectors()
    if fm == ELU:
        for i in range(dst.shape[0]):
            dst[i] = elu1(src[i])
    elif fm == RELU:
        for i in range(dst.shape[0]):
            dst[i] = relu(src[i])
    else:
        for i in range(dst.shape[0]):
            dst[i] = src[i]
