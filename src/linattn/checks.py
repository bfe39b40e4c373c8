"""Every input check of the public API, shared by the CPU and CUDA paths, with one message style:
``<argument>: expected <what>, got <what>``."""
import math
import numbers
import operator

import numpy as np

_REJECTED_KINDS = {"b": "bool", "c": "complex", "O": "object", "U": "string", "S": "bytes",
                   "V": "structured/void", "M": "datetime", "m": "timedelta"}


def _dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def check_real_dtype(dtype, name):
    """Raise TypeError unless ``dtype`` is a real floating or integer NumPy dtype."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "fiu":
        kind = _REJECTED_KINDS.get(dtype.kind, str(dtype))
        raise TypeError(f"{name}: expected a real floating or integer array, got dtype {dtype} ({kind})")
    return dtype


def asarray_named(x, name):
    """np.asarray(x), with a TypeError that names the argument where NumPy cannot make an array of it
    (ragged lists, a State given where numbers were expected, and the like)."""
    try:
        return np.asarray(x)
    except Exception as exc:
        raise TypeError(f"{name}: expected an array-like of numbers, got {type(x).__name__} ({exc})") from None


def as_array(x, name, min_ndim, host=True):
    """np.asarray(x) with a real numeric dtype and at least ``min_ndim`` dimensions; with
    ``host=False`` (device arrays) x is only checked, never copied."""
    arr = asarray_named(x, name) if host else x
    check_real_dtype(arr.dtype, name)
    if len(arr.shape) < min_ndim:
        what = "(N, D)" if min_ndim == 2 else "(D,)"
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions {what}, got shape {tuple(arr.shape)}")
    return arr


def compute_dtypes(*dtypes):
    """(compute dtype, output dtype): float32 for float16/float32, float64 otherwise; ints as NumPy does."""
    out = np.result_type(*dtypes)
    if out.kind in "iu":
        out = np.dtype(np.float64)
    comp = np.dtype(np.float32) if out.itemsize <= 4 else np.dtype(np.float64)
    return comp, out


def check_qkv(q, k, v, seq_axis=True, host=True, cross=False):
    """Validate q, k (..., N, D) and v (..., N, Dv) (or (..., D)/(..., Dv) when ``seq_axis`` is False);
    with ``cross`` (non-causal attention), k and v may have another length than q, equal to each other.

    Returns ``(q, k, v, lead, n, d, dv, compute_dtype, out_dtype)``; n (q's length) is None without a
    sequence axis.
    """
    nd = 2 if seq_axis else 1
    q, k, v = as_array(q, "q", nd, host), as_array(k, "k", nd, host), as_array(v, "v", nd, host)
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)  # plain tuples, also for device arrays
    lead = qs[:-nd]
    for name, shape in (("k", ks), ("v", vs)):
        if shape[:-nd] != lead:
            raise ValueError(
                f"{name}: expected leading dimensions {lead} like q, got {shape[:-nd]} "
                f"(q has shape {qs}, {name} has shape {shape})")
    if seq_axis:
        n = qs[-2]
        if cross and vs[-2] != ks[-2]:
            raise ValueError(f"v: expected the keys' length {ks[-2]} like k (q may have another), got {vs[-2]}")
        for name, shape in () if cross else (("k", ks), ("v", vs)):
            if shape[-2] != n:
                raise ValueError(f"{name}: expected sequence length N={n} like q, got {shape[-2]} (keys and "
                                 f"values of another length than the queries: linear_attention, non-causal)")
    else:
        n = None
    if ks[-1] != qs[-1]:
        raise ValueError(f"k: expected feature dimension D={qs[-1]} like q, got {ks[-1]}")
    d, dv = qs[-1], vs[-1]
    if d < 1:
        raise ValueError(f"q: expected a feature dimension D >= 1, got shape {qs}")
    if dv < 1:
        raise ValueError(f"v: expected a value dimension Dv >= 1, got shape {vs}")
    comp, out = compute_dtypes(q.dtype, k.dtype, v.dtype)
    return q, k, v, lead, n, d, dv, comp, out


def check_eps(eps):
    """eps must be a finite real number >= 0."""
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps: expected a real number >= 0, got {type(eps).__name__}")
    eps = float(eps)
    if not np.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite number >= 0, got {eps}")
    return eps


def check_flag(value, name):
    """A bool argument (Python or NumPy bool)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {type(value).__name__}")
    return bool(value)


def check_mapped(phi, name, lead, n, d_expected=None):
    """Output of a feature-map callable applied to ``name``: shape (*lead, n, D') with D' >= 1."""
    phi = as_array(phi, f"feature_map({name})", 1 if n is None else 2)
    want = lead + ((n,) if n is not None else ())
    got_lead = phi.shape[:-1]
    if got_lead != want or phi.shape[-1] < 1 or (d_expected is not None and phi.shape[-1] != d_expected):
        dstr = "D'" if d_expected is None else str(d_expected)
        shape = "(" + ", ".join([str(x) for x in want] + [dstr]) + ")"
        raise ValueError(
            f"feature_map: expected the callable to map {name} to shape {shape} "
            f"(same leading dims{' and N' if n is not None else ''}, D' >= 1), got {phi.shape}")
    return phi


def check_out(out, shape, dtype):
    """An ``out=`` argument: a writable ndarray of ``shape`` and ``dtype``."""
    if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != dtype:
        got = (f"{type(out).__name__} of shape {getattr(out, 'shape', None)}, "
               f"dtype {getattr(out, 'dtype', None)}")
        raise ValueError(f"out: expected an ndarray of shape {shape} and dtype {dtype}, got {got}")
    if not out.flags.writeable:
        raise ValueError("out: expected a writable array")
    return out


def state_parts(state):
    """(S, Z) of a state-like value, or (state, None) when it is not a pair (check_state says why)."""
    return (state[0], state[1]) if isinstance(state, tuple) and len(state) == 2 else (state, None)


def check_state(state, name, lead, dk, dv, dtype):
    """A State/(S, Z) pair with S (*lead, dk, dv), Z (*lead, dk) of dtype ``dtype`` (None: any)."""
    if not isinstance(state, tuple) or len(state) != 2:
        raise TypeError(f"{name}: expected a linattn.State (S, Z), got {type(state).__name__}")
    S, Z = state
    for part, arr, shape in (("S", S, lead + (dk, dv)), ("Z", Z, lead + (dk,))):
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise TypeError(f"{name}.{part}: expected an array, got {type(arr).__name__}")
        if tuple(arr.shape) != shape:
            raise ValueError(
                f"{name}.{part}: expected shape {shape} (leading dims {lead}, D'={dk}, Dv={dv}), "
                f"got {tuple(arr.shape)}")
        if dtype is not None and np.dtype(arr.dtype) != dtype:
            raise TypeError(
                f"{name}.{part}: expected dtype {dtype} (the computation's dtype for these inputs), "
                f"got {np.dtype(arr.dtype)}")
    return S, Z


def _span(x):
    """(first, end) byte addresses of a non-empty NumPy or CUDA array's elements."""
    face = getattr(x, "__cuda_array_interface__", None) or x.__array_interface__
    itemsize = np.dtype(x.dtype).itemsize
    shape = tuple(face["shape"])
    strides = face.get("strides") or tuple(itemsize * math.prod(shape[i + 1:]) for i in range(len(shape)))
    lo = hi = face["data"][0]
    for size, stride in zip(shape, strides):
        ext = (size - 1) * stride
        lo, hi = (lo + ext, hi) if ext < 0 else (lo, hi + ext)
    return lo, hi + itemsize


def overlap(a, b):
    """Whether arrays ``a`` and ``b`` (NumPy or CUDA device arrays; None: no array) share memory:
    exactly for two NumPy arrays, by the spans of their elements otherwise."""
    if a is None or b is None or math.prod(a.shape) == 0 or math.prod(b.shape) == 0:
        return False
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return np.may_share_memory(a, b) and np.shares_memory(a, b)
    if isinstance(a, np.ndarray) != isinstance(b, np.ndarray):
        return False  # host and device memory
    alo, ahi = _span(a)
    blo, bhi = _span(b)
    return alo < bhi and blo < ahi


def check_written_apart(S, Z, out, name="state"):
    """A step writes S, Z and out in place: raise ValueError where two of them share memory."""
    if overlap(S, Z):
        raise ValueError(f"{name}.Z: expected memory apart from {name}.S (both are updated in place), got "
                         "arrays that overlap")
    for part, arr in (("S", S), ("Z", Z)):
        if overlap(out, arr):
            raise ValueError(f"out: expected memory apart from {name}.{part} (the state is updated in place), "
                             "got an array that overlaps it")


def check_lengths(lengths, lead, n, what="N", name="lengths"):
    """Integer lengths in [0, n] (``what``: n's name in the message, ``name``: the argument's) with the
    shape of the leading dims or of their first dims.

    Returns the lengths broadcast over all leading dims and flattened, as int64.
    """
    arr = lengths if type(lengths) is np.ndarray else asarray_named(lengths, name)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    if arr.shape != lead[:arr.ndim] or (arr.ndim == 0 and lead != ()):
        raise ValueError(
            f"{name}: expected shape {lead} (the leading dims) or a prefix of it such as "
            f"{lead[:1]}, got {arr.shape}")
    if arr.size <= 64:  # (Python's min and max of a short list: ~0.3 us, against ~1.3 each in NumPy)
        items = arr.ravel().tolist()
        wrong = bool(items) and (min(items) < 0 or max(items) > n)
    else:
        wrong = arr.min() < 0 or arr.max() > n
    if wrong:
        bad = arr[(arr < 0) | (arr > n)].ravel()[0]
        raise ValueError(f"{name}: expected values in [0, {what}={n}], got {bad}")
    # each length repeated over the trailing leading dims, as broadcasting in C order would, in a new
    # array (a vjp keeps it); the broadcast and its copy took 4.6 us of a tiny call's 2 x 4.6 us of checks
    return np.repeat(arr.reshape(-1), math.prod(lead[arr.ndim:])).astype(np.int64, copy=False)


def _int_not_bool(x):
    """operator.index(x), refusing bools (a TypeError)."""
    if isinstance(x, (bool, np.bool_)):
        raise TypeError("a bool")
    return operator.index(x)


def check_state_zeros_args(batch_shape, d_k, d_v, dtype):
    if isinstance(batch_shape, (numbers.Integral, np.integer)) and not isinstance(batch_shape, (bool, np.bool_)):
        batch_shape = (batch_shape,)
    try:
        if not isinstance(batch_shape, (tuple, list, np.ndarray)):  # (not a str, bytes, dict, set, ...)
            raise TypeError
        batch_shape = tuple(_int_not_bool(b) for b in batch_shape)
    except TypeError:
        raise TypeError(f"batch_shape: expected a tuple of ints, got {batch_shape!r}") from None
    if any(b < 0 for b in batch_shape):
        raise ValueError(f"batch_shape: expected non-negative sizes, got {batch_shape}")
    dims = []
    for name, val in (("d_k", d_k), ("d_v", d_v)):
        try:
            val = _int_not_bool(val)
        except TypeError:
            raise TypeError(f"{name}: expected an int, got {type(val).__name__}") from None
        if val < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {val}")
        dims.append(val)
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
    return batch_shape, dims[0], dims[1], dtype


DEVICES = (None, "cpu", "cuda")


def check_placement(arrays, device):
    """Where to run: "cpu", "cuda-host" (host arrays computed on the GPU) or "device" (all inputs
    are CUDA device arrays). ``arrays`` maps argument names to arrays (None entries are skipped)."""
    from .cuda import is_device_array

    if not (device is None or isinstance(device, str)) or device not in DEVICES:  # (an array: no truth value)
        raise ValueError(f"device: expected None, 'cpu' or 'cuda', got {device!r}")
    flags = {name: is_device_array(x) for name, x in arrays.items() if x is not None}
    on_dev = [name for name, f in flags.items() if f]
    if on_dev and len(on_dev) < len(flags):
        on_host = [name for name, f in flags.items() if not f]
        raise TypeError(f"{', '.join(flags)}: expected all host arrays or all CUDA device arrays; "
                        f"{', '.join(on_dev)} on a CUDA device, {', '.join(on_host)} on the host")
    if on_dev:
        if device == "cpu":
            raise ValueError("device: 'cpu' was asked for but the inputs are CUDA device arrays; "
                             "copy them to the host first")
        return "device"
    return "cuda-host" if device == "cuda" else "cpu"


def check_device_inputs(arrays, comp, out_dt):
    """Device arrays: one float32/float64 dtype (no promotion on the device), C-contiguous."""
    dts = {name: np.dtype(x.dtype) for name, x in arrays.items()}
    if comp != out_dt or any(dt != comp for dt in dts.values()):
        got = ", ".join(f"{n} {dt}" for n, dt in dts.items())
        raise TypeError(f"{', '.join(arrays)}: on a CUDA device expected float32 or float64 arrays of one "
                        f"dtype, got {got}")
    for name, x in arrays.items():
        if not x.is_c_contiguous():
            raise ValueError(f"{name}: expected a C-contiguous CUDA device array")
