"""``gemm``: a BLAS matrix product callable from Numba kernels, with transposes and beta.

It calls the same BLAS as ``np.dot`` inside Numba (SciPy's, through Numba's ``numba_xxgemm``
helper), but takes row-major operands with any row stride, optional transposes, and
``C = alpha op(A) op(B) + beta C``, so kernels need neither transposed copies nor temporaries.
"""
from numba.core import types
from numba.extending import overload
from numba.np.linalg import _BLAS, ensure_blas, get_blas_kind


def gemm(trans_a, trans_b, a, b, beta, c, coef):
    """C = op(A) @ op(B) + beta * C for 2-D row-major views (last stride 1); ``coef`` is a
    2-element scratch array of C's dtype. Only callable from Numba code."""
    raise NotImplementedError("linattn.cpu.blas.gemm runs inside Numba kernels only")


@overload(gemm, jit_options={"error_model": "numpy"})
def _gemm_overload(trans_a, trans_b, a, b, beta, c, coef):
    if not all(isinstance(x, types.Array) and x.ndim == 2 for x in (a, b, c)):
        return None
    ensure_blas()
    xxgemm = _BLAS().numba_xxgemm(c.dtype)
    kind = ord(get_blas_kind(c.dtype))
    T, N = ord("t"), ord("n")

    def impl(trans_a, trans_b, a, b, beta, c, coef):
        m, n = c.shape
        k = a.shape[0] if trans_a else a.shape[1]
        if m == 0 or n == 0:
            return
        coef[0] = 1
        coef[1] = beta
        isz = c.itemsize
        # Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
        xxgemm(kind, T if trans_b else N, T if trans_a else N, n, m, k,
               coef.ctypes, b.ctypes, b.strides[0] // isz, a.ctypes, a.strides[0] // isz,
               coef[1:].ctypes, c.ctypes, c.strides[0] // isz)

    return impl
