"""Large arrays reused from one call to the next: the scratch a closure keeps (the vjp's chunk states)
and the large results the caller drops (outputs, gradients, final states).

A fresh large array costs a page fault per page when it is first written, and two threads writing it
fault concurrently: measured on a 2-core VM, the forward that keeps 34 MB of chunk states took 30 ms
with a fresh array and 16 ms with a reused one (B2 H4 N8192 D64 float32; the forward alone: 12 ms).
``take`` hands out an array from the pool (or a new one), ``release_with`` puts it back when its owner
(the vjp closure) is garbage-collected. ``take_views`` hands out arrays carved from one pooled block
that goes back when the last of them (and of their views) is gone: the gradients a training loop
drops every step (freed, glibc returned them to the system, and the next step faulted them in again:
~1000 page faults a call at B1 H8 N2048); a block serves any request from 2/3 of its size up, so
calls of nearby sizes share blocks. The pool keeps at most ``MAX_FREE_BYTES`` of free arrays, dropping
the oldest first; ``clear`` drops them all.
"""
import math
import threading
import weakref

import numpy as np

#: Free arrays kept for reuse, at most (bytes; the oldest go first).
MAX_FREE_BYTES = 256 << 20
#: Arrays are pooled from this size (bytes); smaller ones come from malloc, which reuses them.
POOL_MIN_BYTES = 256 << 10

_lock = threading.RLock()  # (re-entrant: a collection inside a locked section may release a block)
_free = {}  # (shape, dtype) -> [arrays]
_order = []  # the free arrays, oldest first
_free_bytes = 0


def take(shape, dtype):
    """An array of ``shape`` and ``dtype`` with undefined contents: a pooled one when there is one,
    64-byte aligned (for streaming stores); below ``POOL_MIN_BYTES`` a plain new one (``release_with``
    keeps none of those, and the kernels' streaming copy uses plain stores where it is not aligned:
    aligning cost 4 us, half a tiny call's own kernel time)."""
    key = (tuple(shape), np.dtype(dtype))
    if math.prod(key[0]) * key[1].itemsize < POOL_MIN_BYTES:
        return np.empty(key[0], key[1])
    arr = _pop(key)
    return aligned_empty(shape, dtype) if arr is None else arr


def _pop(key):
    """A free array of ``key`` (shape, dtype) out of the pool, or None."""
    global _free_bytes
    with _lock:
        arrays = _free.get(key)
        if not arrays:
            return None
        arr = arrays.pop()
        _forget(arr)
        _free_bytes -= arr.nbytes
        return arr


def _forget(arr, arrays=None):
    """Remove ``arr`` from ``arrays`` (by identity; default: the pool's order)."""
    arrays = _order if arrays is None else arrays
    for i, x in enumerate(arrays):
        if x is arr:
            del arrays[i]
            return


def aligned_empty(shape, dtype, align=64):
    """np.empty(shape, dtype) starting at a multiple of ``align`` bytes (streaming stores need 64; ``align`` a
    multiple of the itemsize). One array of the dtype, a few elements longer, and a slice of it: no views of
    bytes as the dtype (aligned_views took 5.4 us for a State's two arrays that way, 4.4 now)."""
    dtype = np.dtype(dtype)
    isz = dtype.itemsize
    count = math.prod(shape)
    flat = np.empty(count + align // isz, dtype)
    start = -flat.ctypes.data % align // isz  # (NumPy's data is aligned to the itemsize at least)
    return flat[start:start + count].reshape(shape)


def _offsets(sizes, align):
    """Where arrays of ``sizes`` bytes start in one block, each at a multiple of ``align``; and its size."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // align) * align
    return offsets, max(total, 1)


def aligned_views(shapes, dtype, align=64):
    """New arrays of ``shapes`` and ``dtype`` (undefined contents) in one block, each starting at a multiple of
    ``align`` bytes (a multiple of the itemsize; not pooled: the block lives as long as any of them). A state
    that ``step`` updates in place: its loads and stores of whole vectors then never straddle two cache lines."""
    dtype = np.dtype(dtype)
    isz = dtype.itemsize
    sizes = [math.prod(s) * isz for s in shapes]
    offsets, total = _offsets(sizes, align)
    flat = aligned_empty((-(-total // isz),), dtype, align)  # (at least one element: views of none start there)
    return tuple(flat[o // isz:(o + size) // isz].reshape(s) for o, size, s in zip(offsets, sizes, shapes))


def _release(arr):
    global _free_bytes
    if arr.nbytes > MAX_FREE_BYTES:
        return
    with _lock:
        while _order and _free_bytes + arr.nbytes > MAX_FREE_BYTES:  # drop the oldest
            old = _order.pop(0)
            _forget(old, _free[(old.shape, old.dtype)])
            _free_bytes -= old.nbytes
        _free.setdefault((arr.shape, arr.dtype), []).append(arr)
        _order.append(arr)
        _free_bytes += arr.nbytes


def release_with(owner, arr):
    """Put ``arr`` back in the pool once ``owner`` (an object that holds the only other references to
    it) is garbage-collected (arrays below ``POOL_MIN_BYTES`` are left to malloc, which reuses them)."""
    if arr.nbytes >= POOL_MIN_BYTES:
        weakref.finalize(owner, _release, arr)


class _Owner(np.ndarray):
    """The pooled bytes behind the arrays ``take_views`` hands out. NumPy stops collapsing a view's base
    at a change of type, so every view of them keeps this object alive, and the bytes go back to the
    pool when it is collected."""


class _Ref(weakref.ref):
    __slots__ = ("raw",)


_refs = {}  # id -> _Ref: the live owners' weak references (with their bytes)


def _returned(ref):
    try:
        del _refs[id(ref)]
        _release(ref.raw)
    except Exception:  # pragma: no cover - interpreter shutdown
        pass


def _take_bytes(nbytes, align):
    """A free block of bytes from the pool: the smallest of ``nbytes`` to 1.5 ``nbytes``, else a new one
    of ``nbytes`` rounded up to its size class (1/16 to 1/8 of the size apart), so that calls of nearby
    sizes share blocks."""
    with _lock:
        sizes = [shape[0] for (shape, dt), arrays in _free.items() if arrays and dt == np.uint8 and len(shape) == 1
                 and nbytes <= shape[0] <= nbytes + nbytes // 2]
        if sizes:
            return _pop(((min(sizes),), np.dtype(np.uint8)))
    step = max(align, 1 << max(0, nbytes.bit_length() - 4))
    return aligned_empty((-(-nbytes // step) * step,), np.uint8)


def take_views(shapes, dtype, align=64):
    """Arrays of ``shapes`` and ``dtype`` (undefined contents) from one pooled block of bytes, which
    goes back to the pool once none of them, nor any view of them, is referenced; each starts at a
    multiple of ``align`` bytes. Below ``POOL_MIN_BYTES`` in all, plain new arrays (np.empty)."""
    dtype = np.dtype(dtype)
    sizes = [math.prod(s) * dtype.itemsize for s in shapes]
    if sum(sizes) < POOL_MIN_BYTES:
        return tuple(np.empty(s, dtype) for s in shapes)
    offsets, total = _offsets(sizes, align)
    raw = _take_bytes(total, align)
    owner = raw.view(_Owner)
    ref = _Ref(owner, _returned)
    ref.raw = raw  # (what goes back to the pool, under the key it was taken with)
    _refs[id(ref)] = ref
    return tuple(np.asarray(owner[o:o + size]).view(dtype).reshape(s) for o, size, s in zip(offsets, sizes, shapes))


def empty(shape, dtype):
    """np.empty(shape, dtype), from the pool (``take_views``) when it has ``POOL_MIN_BYTES`` or more: a
    result the caller drops is reused by the next call instead of faulted in again."""
    return take_views([shape], dtype)[0]


def clear():
    """Drop every pooled array."""
    global _free_bytes
    with _lock:
        _free.clear()
        _order.clear()
        _free_bytes = 0
