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
    if not cuda.is_available():
        raise RuntimeError(
            "linattn's CUDA path needs an NVIDIA GPU with a working driver (numba.cuda.is_available() is "
            "False); install the CUDA target with pip install 'linattn[cuda]', or set "
            "NUMBA_ENABLE_CUDASIM=1 before importing numba to run the kernels in Numba's simulator")
    _cuda = cuda
    return cuda


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
