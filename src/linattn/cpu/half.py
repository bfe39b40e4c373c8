"""float16 <-> float32 conversions in loops that vectorise: NumPy's ``astype`` between the two took
~3.8 ns a value here (scalar code on AVX2), 2.5 times a float32 forward's own time for float16
inputs. Bit for bit NumPy's results: float32 -> float16 rounds to nearest, ties to even (as NumPy and
IEEE 754 do), overflows to inf (without NumPy's warning); a NaN keeps its sign and the top of its
payload both ways."""
import numpy as np
from numba import types

from .._jit import Kernel, array, njit
from .vector import wide_vectors

#: Values below which NumPy's astype is used (a compiled call's overhead is 1-3 us: measured, NumPy's
#: float16 -> float32 is as fast up to ~700 values, float32 -> float16 up to ~300).
MIN_VALUES = 1024


_U32 = np.uint32


@njit(helper=True)
def _half_to_single(h):
    """The float32 bits (uint32) of the float16 bits ``h`` (uint32)."""
    sign = _U32(_U32(h & _U32(0x8000)) << _U32(16))
    e = _U32(_U32(h >> _U32(10)) & _U32(0x1F))
    m = _U32(h & _U32(0x3FF))
    normal = _U32(sign | _U32(_U32(e + _U32(112)) << _U32(23)) | _U32(m << _U32(13)))
    special = _U32(sign | _U32(0x7F800000) | _U32(m << _U32(13)))  # inf, NaN (its payload kept, as NumPy)
    sub = _U32(np.float32(np.float32(np.int32(m)) * np.float32(5.9604644775390625e-08)).view(np.uint32) | sign)
    return normal if (e != _U32(0) and e != _U32(31)) else (special if e == _U32(31) else sub)


@njit(helper=True)
def _single_to_half(f):
    """The float16 bits (uint32) of the float32 bits ``f`` (uint32): rounded to nearest, ties to even
    (F. Giesen's float_to_half_fast3_rtne); a NaN keeps the top of its payload (0x7C01 if that is 0),
    as NumPy's."""
    sign = _U32(_U32(f >> _U32(16)) & _U32(0x8000))
    a = _U32(f & _U32(0x7FFFFFFF))
    payload = _U32(_U32(a & _U32(0x7FFFFF)) >> _U32(13))
    nan = _U32(_U32(0x7C00) | payload) if payload != _U32(0) else _U32(0x7C01)
    big = nan if a > _U32(0x7F800000) else _U32(0x7C00)  # NaN, or inf and what overflows
    # below 2**-14: a float add aligns the mantissa at 2**-24 and rounds it (to nearest, ties to even)
    magic = _U32(((127 - 15) + (23 - 10) + 1) << 23)
    sub = _U32(_U32(np.float32(a.view(np.float32) + magic.view(np.float32)).view(np.uint32)) - magic)
    odd = _U32(_U32(a >> _U32(13)) & _U32(1))
    normal = _U32(_U32(_U32(a + _U32(0xC8000000)) + _U32(_U32(0xFFF) + odd)) >> _U32(13))  # exponent - 112
    h = big if a >= _U32((127 + 16) << 23) else (sub if a < _U32(113 << 23) else normal)
    return _U32(h | sign)


def _to_single(src, dst):
    """dst = float32 of the float16 values whose bits are ``src`` (uint16, 1-D)."""
    wide_vectors()
    for i in range(src.shape[0]):
        dst[i] = _U32(_half_to_single(_U32(src[i]))).view(np.float32)


def _to_half(src, dst):
    """dst (uint16 bits) = float16 of the float32 values ``src`` (1-D)."""
    wide_vectors()
    for i in range(src.shape[0]):
        dst[i] = np.uint16(_single_to_half(np.float32(src[i]).view(np.uint32)))


_to_single_kernel = Kernel(_to_single, lambda dt, variant: types.void(
    array(types.uint16, 1, readonly=True), array(types.float32, 1)), parallel=False)
_to_half_kernel = Kernel(_to_half, lambda dt, variant: types.void(
    array(types.float32, 1, readonly=True), array(types.uint16, 1)), parallel=False)


def astype(x, dtype):
    """``x.astype(dtype, copy=False)``, through the loops above between float16 and float32 (C-contiguous
    arrays of MIN_VALUES values or more), else NumPy's."""
    if x.dtype == dtype or x.size < MIN_VALUES or (x.dtype, np.dtype(dtype)) not in _PAIRS or not x.flags.c_contiguous:
        return x.astype(dtype, copy=False)  # (first: the common call, no conversion, in ~0.1 us)
    out = np.empty(x.shape, dtype)
    if dtype == np.float32:
        _to_single_kernel.get(np.dtype(np.float32), None)(x.reshape(-1).view(np.uint16), out.reshape(-1))
    else:
        _to_half_kernel.get(np.dtype(np.float32), None)(x.reshape(-1), out.reshape(-1).view(np.uint16))
    return out


_PAIRS = {(np.dtype(np.float16), np.dtype(np.float32)), (np.dtype(np.float32), np.dtype(np.float16))}
