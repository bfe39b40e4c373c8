"""Decay and gates on the Python side: their checks, the arrays the kernels take, and the report of a
bad gate value that a kernel found (the kernels read every gate anyway, so they check the values:
no extra pass over a gate as large as q).

The kernels' convention (cpu/gating.py): a log gate per position, (..., N), or per position and
key dimension, (..., N, D'), in the computation's dtype, and a log decay per sequence (float64),
added to every log gate of its sequence. A constant decay alone is a zero gate seen through a view
with stride 0, so it costs no memory.
"""
import math
import numbers

import numpy as np

from . import checks

#: Kinds of gate: none, a scalar per position, one per key dimension, a constant decay alone (its
#: gates: a zero view, for the kernels that treat it as a scalar gate).
NONE, SCALAR, VECTOR, CONSTANT = 0, 1, 2, 3


def check_decay(decay, lead):
    """A decay in (0, 1] broadcastable to the leading dims; returns it per sequence (float64, flattened
    over ``lead``)."""
    arr = checks.asarray_named(decay, "decay") if not isinstance(decay, (str, bytes)) else np.asarray(None)
    if arr.dtype.kind not in "fiu":
        got = f"an array of dtype {arr.dtype}" if isinstance(decay, np.ndarray) else type(decay).__name__
        raise TypeError(f"decay: expected a real number or an array of them, got {got}")
    try:
        full = np.broadcast_to(arr.astype(np.float64), lead)
    except ValueError:
        raise ValueError(f"decay: expected a shape that broadcasts to the leading dims {lead} (for example "
                         f"{lead[-1:]}: one per head), got {arr.shape}") from None
    bad = ~((full > 0) & (full <= 1))
    if bad.any():
        raise ValueError(f"decay: expected values in (0, 1], got {full[bad].ravel()[0]}")
    return full.reshape(-1)


def check_gate(gate, lead, n, dk, comp, per_position=True):
    """(kind, gate array in the compute dtype). Shapes: ``lead + (N,)`` (a gate per position) or
    ``lead + (N, D')`` (per key dimension); for a decoding step (``per_position=False``) ``lead`` or
    ``lead + (D',)``. Values are checked where they are read (see ``raise_bad_gate``)."""
    g = checks.as_array(gate, "gate", 0)
    seq = (n,) if per_position else ()
    if g.shape == lead + seq:
        kind = SCALAR
    elif g.shape == lead + seq + (dk,):
        kind = VECTOR
    else:
        raise ValueError(f"gate: expected shape {lead + seq} (one log gate per {'position' if per_position else 'sequence'}) "
                         f"or {lead + seq + (dk,)} (one per key dimension, D'={dk}), got {g.shape}")
    g = g.astype(comp, copy=False)
    if any(st % g.itemsize for st in g.strides):  # the kernels step through gates in whole elements
        g = np.ascontiguousarray(g)
    return kind, g


def check_scale(scale):
    """None (1.0) or a finite real number > 0."""
    if scale is None:
        return 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected None or a real number > 0, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite number > 0, got {scale}")
    return float(scale)


def prepare(decay, gate, lead, n, dk, comp):
    """(kind, gates, log_decay) for the kernels: gates of shape ``lead + (N,)`` or ``lead + (N, D')``
    (None for no decay at all), log_decay one per sequence (float64) or None."""
    log_decay = None if decay is None else np.log(check_decay(decay, lead))
    if gate is not None:
        kind, gates = check_gate(gate, lead, n, dk, comp)
    elif log_decay is not None:
        kind, gates = CONSTANT, np.broadcast_to(np.zeros((), comp), lead + (n,))
    else:
        return NONE, None, None
    return kind, gates, log_decay


def check_gate_values(gate):
    """ValueError for a positive or NaN log gate (small gates: a decoding step's)."""
    bad = (gate > 0) | np.isnan(gate)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        what = "NaN" if np.isnan(gate[where]) else "a positive value"
        raise ValueError(f"gate: expected log gates <= 0 (natural log; -inf resets the state), got {what} at {where}")


def raise_bad_gate(status, lead):
    """Raise the ValueError for a bad gate value a kernel reported (status: kind, flat sequence, position)."""
    if status[0] == 0:
        return
    what = "a positive value" if status[0] == 1 else "NaN"
    seq = tuple(int(i) for i in np.unravel_index(int(status[1]), lead)) if lead else ()
    where = f"sequence {seq}, position {int(status[2])}"
    raise ValueError(f"gate: expected log gates <= 0 (natural log; -inf resets the state), got {what} at {where}")
