"""Optional CUDA path (Numba's CUDA target, ``pip install linattn[cuda]``).

Nothing here imports ``numba.cuda`` or touches a GPU until a device array (anything exposing
``__cuda_array_interface__``: Numba device arrays, CuPy arrays, PyTorch CUDA tensors) or
``device="cuda"`` reaches a public function.
"""
import os

_cuda = None


def _simulating():
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def is_device_array(x):
    """True for arrays that live on a CUDA device (or on the Numba CUDA simulator's fake device)."""
    if hasattr(x, "__cuda_array_interface__"):
        return True
    return _simulating() and type(x).__name__ == "FakeCUDAArray"


def cuda_module():
    """numba.cuda, or a RuntimeError that says what is missing."""
    global _cuda
    if _cuda is not None:
        return _cuda
    try:
        from numba import cuda
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise RuntimeError("linattn's CUDA path needs Numba's CUDA target: pip install 'linattn[cuda]'"
                           f" ({exc})") from None
    if not _simulating():
        _check_target_loads()
    if not cuda.is_available():
        raise RuntimeError(
            "linattn's CUDA path needs an NVIDIA GPU with a working driver (numba.cuda.is_available() is "
            "False); install the CUDA target with pip install 'linattn[cuda]', or set "
            "NUMBA_ENABLE_CUDASIM=1 before importing numba to run the kernels in Numba's simulator")
    _cuda = cuda
    return cuda


def _check_target_loads():
    """A RuntimeError naming the versions where the CUDA target cannot load its NumPy support, which
    its first kernel compilation needs (seen: numba-cuda 0.30.4 with NumPy 2.5, which removed
    ``np.row_stack``: every compilation failed with an AttributeError from deep inside numba-cuda)."""
    try:
        import numba.cuda.cudaimpl  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name == "numba.cuda.cudaimpl":  # another layout of the target: nothing to check here
            return
        raise RuntimeError(f"Numba's CUDA target cannot load: {exc}") from None
    except Exception as exc:
        import numpy as np

        try:
            from importlib.metadata import version

            target = f"numba-cuda {version('numba-cuda')}"
        except Exception:  # pragma: no cover - numba.cuda installed some other way
            target = "Numba's CUDA target"
        raise RuntimeError(f"{target} cannot compile kernels with NumPy {np.__version__} ({type(exc).__name__}: "
                           f"{exc}): install a NumPy that it supports (pip install 'linattn[cuda]' picks one) or "
                           "a newer numba-cuda") from None


def availability():
    """A line for ``python -m linattn info``: whether the CUDA path can run here, and on what."""
    try:
        cuda = cuda_module()
    except RuntimeError as exc:
        return f"no ({exc})"
    if _simulating():
        return "yes (Numba CUDA simulator)"
    try:
        dev = cuda.get_current_device()
        return f"yes ({dev.name.decode() if isinstance(dev.name, bytes) else dev.name})"
    except Exception as exc:  # pragma: no cover - needs a GPU
        return f"yes ({exc})"
