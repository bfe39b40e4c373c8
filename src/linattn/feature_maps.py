"""Feature maps phi: the named ones (which the kernels also apply themselves) and user callables."""
import numpy as np

from .cpu.elementwise import ELU, IDENTITY, RELU


def elu_plus_one(x):
    """elu(x) + 1, computed as ``where(x > 0, x + 1, exp(x))`` so positive values don't cancel."""
    x = np.asarray(x)
    with np.errstate(over="ignore"):
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))).astype(x.dtype, copy=False)


def relu(x):
    """max(x, 0), keeping NaN."""
    x = np.asarray(x)
    return np.where(x > 0, x, x * 0)


def identity(x):
    """phi(x) = x."""
    return np.asarray(x)


#: name -> (NumPy function, kernel code)
NAMED = {
    "elu": (elu_plus_one, ELU),
    "relu": (relu, RELU),
    "identity": (identity, IDENTITY),
}


def resolve(feature_map):
    """Return ``(numpy_function, kernel_code, is_callable)`` for a name or a callable.

    Raises ``ValueError`` for an unknown name and ``TypeError`` for anything else.
    """
    if isinstance(feature_map, str):
        if feature_map not in NAMED:
            raise ValueError(
                f"feature_map: unknown name {feature_map!r}; expected one of "
                f"{', '.join(repr(n) for n in NAMED)} or a callable"
            )
        fn, code = NAMED[feature_map]
        return fn, code, False
    if callable(feature_map):
        return feature_map, IDENTITY, True
    raise TypeError(
        f"feature_map: expected a name ({', '.join(repr(n) for n in NAMED)}) or a callable, "
        f"got {type(feature_map).__name__}"
    )


def resolve_for_device(feature_map):
    """Kernel code of a named map for the CUDA kernels; callables (host code) are a TypeError."""
    _, code, is_callable = resolve(feature_map)
    if is_callable:
        raise TypeError("feature_map: a callable runs on host arrays; on CUDA device arrays use "
                        f"{', '.join(repr(n) for n in NAMED)} (or pass host arrays with device='cuda')")
    return code
