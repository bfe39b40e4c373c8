"""Launch the CUDA kernels on (BH, N, D)-shaped arrays, on the device or copied from the host."""
import numpy as np

from . import _simulating, cuda_module, is_device_array

_SHARED_BYTES = 48 * 1024  # static limit for dynamic shared memory without an opt-in


def shared_doubles(c, te, d, w=0):
    """Size of the dynamic shared buffer of the sequence kernels, in float64 values (d: the features'
    number D'; w: columns of the gates' G and R, 0 without gates)."""
    return 2 * c * d + c * te + c * c + d * te + d + 5 * c + 2 * c * w


def _too_many_features(d, fits):
    """The ValueError for D' features that do not fit in a block's shared memory (``fits(x)``: whether x do;
    monotone)."""
    most = 0
    for bit in range(14, -1, -1):  # the largest x that fits, bit by bit (x < 2**15)
        if fits(most + (1 << bit)):
            most += 1 << bit
    return ValueError(f"q: D'={d} features (the feature map's output) do not fit in the CUDA kernels' shared "
                      f"memory ({_SHARED_BYTES // 1024} KB a block): at most {most} on the GPU (the CPU takes any)")


def gate_columns(kind, d):
    """Columns of the gates' G and R in shared memory: 0 without gates, 1 per position, D' per key dimension."""
    return 0 if kind == 0 else (1 if kind == 1 else d)


def tiles(d, dv, kind=0):
    """(C, TE): positions per chunk and value columns per block (C*TE threads per block), for gates of ``kind``."""
    w = gate_columns(kind, d)
    c, te = (4, 4) if _simulating() else (16, 16)  # the simulator runs each thread as a Python thread
    while shared_doubles(c, te, d, w) * 8 > _SHARED_BYTES and (c > 1 or te > 1):
        if te >= c and te > 1:
            te //= 2
        else:
            c //= 2
    if shared_doubles(c, te, d, w) * 8 > _SHARED_BYTES:
        raise _too_many_features(d, lambda x: shared_doubles(1, 1, x, gate_columns(kind, x)) * 8 <= _SHARED_BYTES)
    return c, te


def segments(blocks, chunks, width, least):
    """(P, chunks per segment): a head of ``chunks`` chunks split into P segments so that the forward's
    ``blocks`` blocks (heads x value tiles) become about ``width`` (the GPU's width), each segment at
    least ``least`` chunks long; P = 1 (one segment of every chunk) where the heads alone fill
    ``width`` or a head has fewer than 4 x ``least`` chunks (a split costs two more launches)."""
    if blocks >= width or chunks < 4 * least:
        return 1, max(chunks, 1)
    per = max(least, -(-chunks * blocks // width))
    return -(-chunks // per), per


def _width():
    """(width, least) for ``segments``: four blocks per multiprocessor of the current GPU, segments of
    at least 8 chunks (128 positions: a launch cost about 0.16 ms on an H200 machine, a chunk of the
    unsplit kernel about 0.03 ms); in the simulator (16, 1), so that its tiny shapes run split."""
    if _simulating():
        return 16, 1
    return 4 * cuda_module().get_current_device().MULTIPROCESSOR_COUNT, 8


def _segment_states(k, v, code, fp, d, lens, S0, Z0, parts, length, c, te, shared, gates, kind, log_decay, status,
                    totals=False):
    """(Sb, Zb, St, Zt): each of ``parts`` segments (of ``length`` positions) of every head's keys k and
    values v summed (kernels.segment_sums), then carried from the initial state S0, Z0 through the
    segments before it (kernels.scan_segments): Sb, Zb ((heads x parts, D', Dv), (heads x parts, D'))
    hold each segment's starting state and, with ``totals``, St, Zt ((heads, D', Dv), (heads, D')) the
    state after the last (else empty); all float64 device arrays. D' = d, chunks of c positions, tiles
    of te value columns."""
    cuda = cuda_module()
    from . import kernels
    bh, dv = k.shape[0], v.shape[2]
    ntiles, rows, w = -(-dv // te), bh * parts, gate_columns(kind, d)
    Sb, Zb = cuda.device_array((rows, d, dv), np.float64), cuda.device_array((rows, d), np.float64)
    Fb = cuda.device_array((rows, w), np.float64) if w else constant(np.ones((1, 1)))  # (unread without gates)
    kernels.segment_sums[(rows, ntiles), (te, c), 0, shared](
        k, v, code, fp, lens, Sb, Zb, Fb, c, te, gates, kind, log_decay, status, parts, length)
    if totals:
        St, Zt = cuda.device_array((bh, d, dv), np.float64), cuda.device_array((bh, d), np.float64)
    else:
        St, Zt = constant(np.zeros((0, 1, 1))), constant(np.zeros((0, 1)))
    kernels.scan_segments[(bh, ntiles), (te, c)](S0, Z0, Sb, Zb, Fb, kind, parts, te, St, Zt)
    return Sb, Zb, St, Zt


def step_shared_bytes(d):
    """Dynamic shared memory of the step kernel for D' = d features: phi(q), phi(k), the factors, 4 statistics."""
    return (3 * d + 4) * 8


#: Largest host array that ``constant`` keeps a device copy of, in bytes.
_CONSTANT_BYTES = 1 << 16
_constants = {}  # (id of the context, dtype, shape, bytes) -> (context, device copy); see constant()
_zeros = {}  # (id of the context, dtype) -> (context, device zeros); see device_zeros()
_device_array_type = None


def _on_device(x):
    """x as a Numba device array: a view of a device array, a copy of a host array."""
    return as_device(x) if is_device_array(x) else to_device(np.ascontiguousarray(x))


def to_device(x):
    """A copy of host array ``x`` on the device."""
    return cuda_module().to_device(x)


def _in_context(cache, key, usable, make):
    """``cache``'s device array for ``key`` in the current CUDA context, made by ``make()`` unless there
    is one for which ``usable(array)``. Entries are keyed by the context's id and hold the context
    itself (Numba's contexts are not hashable; holding one keeps its id from being reused)."""
    ctx = None if _simulating() else cuda_module().current_context()  # (the simulator's: a new one a call)
    full = (id(ctx),) + key
    found = cache.get(full)
    if found is None or found[0] is not ctx or not usable(found[1]):
        if len(cache) >= 256:
            cache.clear()
        found = cache[full] = (ctx, make())
    return found[1]


def constant(x):
    """A device copy of the small host array ``x`` that the kernels only read (a map's parameters,
    lengths, decays, the empty state and gates of calls without them), made once per CUDA context and
    value: these repeat from call to call, and each copy cost 0.19 ms on an H200 machine (numba-cuda
    0.30.4), several times a small kernel's launch. Larger arrays are copied each time."""
    x = np.ascontiguousarray(x)
    if x.nbytes > _CONSTANT_BYTES:
        return to_device(x)
    return _in_context(_constants, (x.dtype.str, x.shape, x.tobytes()), lambda _: True, lambda: to_device(x))


def device_zeros(size, dtype):
    """``size`` zeros of ``dtype`` on the device, read-only: a view of a buffer kept per context and
    dtype, copied from the host only when it grows (to twice the size asked for)."""
    dtype = np.dtype(dtype)
    buf = _in_context(_zeros, (dtype.str,), lambda b: b.shape[0] >= size,
                      lambda: to_device(np.zeros(max(2 * size, 1024), dtype)))
    return buf[:size]


def as_device(x):
    """A Numba device array viewing the device array ``x`` (no copy)."""
    global _device_array_type
    if _simulating():
        return x
    if _device_array_type is None:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray

        _device_array_type = DeviceNDArray
    if type(x) is _device_array_type:  # (as_cuda_array would wrap it again: 0.03 ms on an H200 machine)
        return x
    return cuda_module().as_cuda_array(x)


def flat_state(S, Z, bh, dk, dv, where):
    """A checked state as (BH, D', Dv), (BH, D') arrays: device views, or host arrays for "cuda-host"."""
    if where == "device":
        from ..checks import check_device_inputs

        S, Z = as_device(S), as_device(Z)
        check_device_inputs({"initial_state.S": S, "initial_state.Z": Z}, np.dtype(S.dtype), np.dtype(S.dtype))
        return S.reshape(bh, dk, dv), Z.reshape(bh, dk)
    return np.ascontiguousarray(np.asarray(S).reshape(bh, dk, dv)), np.ascontiguousarray(np.asarray(Z).reshape(bh, dk))


def _result(x, host):
    return x.copy_to_host() if host else x


def _map_args(fmap):
    """(code, fp on the device, D') from a map's (code, fp, D') (cuda/maps.device_map)."""
    code, fp, dk = fmap
    return code, constant(np.asarray(fp, np.float64)), dk


def causal(q, k, v, fmap, eps, normalize, lengths, S0, Z0, want_state, dtype, gates=None, kind=0, log_decay=None,
           scale=1.0):
    """Causal forward of (BH, N, D) arrays with feature map ``fmap`` (code, parameters, D':
    cuda/maps.device_map); returns (out, S, Z, status) (S, Z have no rows unless ``want_state``) on the
    host if q is a host array, else on the device. ``gates``: (BH, N, 1) or (BH, N, D') log gates of
    ``kind`` (linattn.gates; None with a kind: zero gates, for a decay alone), ``log_decay`` (BH,);
    ``status`` (host, 3 ints) reports a bad gate value as the CPU kernels do. Where the heads alone
    would leave the GPU idle, each is split into segments (``segments``; cuda/kernels.py)."""
    cuda = cuda_module()
    from . import kernels
    host = not is_device_array(q)
    bh, n = q.shape[:2]
    code, fp, d = _map_args(fmap)
    dv = v.shape[2]
    q, k, v = (_on_device(x) for x in (q, k, v))
    S0, Z0 = (_on_device(x) if is_device_array(x) or x.shape[0] else constant(x) for x in (S0, Z0))
    lens = constant(np.asarray(lengths, dtype=np.int64))
    out = cuda.device_array((bh, n, dv), dtype)
    rows = bh if want_state else 0
    S, Z = cuda.device_array((rows, d, dv), dtype), cuda.device_array((rows, d), dtype)
    if gates is not None:
        g = _on_device(gates)
    elif kind and bh and n:  # a decay alone: zero gates of one column
        g = device_zeros(bh * n, dtype).reshape(bh, n, 1)
    else:
        g = constant(np.zeros((1, 1, 1), dtype))
    ld = constant(np.zeros(bh if log_decay is not None or kind else 0)) if log_decay is None else constant(
        np.asarray(log_decay, np.float64))
    # only a bad gate writes the status (kernels.chunk_gates): without the user's gates, nothing to copy
    status = to_device(np.zeros(3, np.int64)) if gates is not None else None
    if bh and n:
        w = gate_columns(kind, d)
        c, te = tiles(d, dv, kind)
        ntiles, shared = -(-dv // te), shared_doubles(c, te, d, w) * 8
        status_d = constant(np.zeros(3, np.int64)) if status is None else status
        parts, per = segments(bh * ntiles, -(-n // c), *_width())
        if parts > 1:  # each segment from its starting state
            S0, Z0 = _segment_states(k, v, code, fp, d, lens, S0, Z0, parts, per * c, c, te, shared, g, kind, ld,
                                     status_d)[:2]
        kernels.causal[(bh * parts, ntiles), (te, c), 0, shared](
            q, k, v, code, fp, float(eps), bool(normalize), lens, S0, Z0, out, S, Z, c, te, g, kind, ld,
            float(scale), status_d, parts, per * c)
    elif want_state and S0.shape[0]:
        S, Z = S0, Z0
    elif want_state:
        S, Z = to_device(np.zeros((bh, d, dv), dtype)), to_device(np.zeros((bh, d), dtype))
    return (_result(out, host), _result(S, host), _result(Z, host),
            np.zeros(3, np.int64) if status is None else status.copy_to_host())


def noncausal(q, k, v, fmap, eps, normalize, dtype, scale, S0, Z0, want_state, lengths, qlengths):
    """Non-causal forward of q (BH, N, D) over k (BH, Nk, D) and v (BH, Nk, Dv) with feature map ``fmap`` (as
    ``causal``); ``scale`` multiplies phi(q); S0, Z0 ((BH, D', Dv), (BH, D')) the keys' sums before k (or None);
    ``lengths``, ``qlengths`` (BH,) how many of each head's keys and queries count (outputs past them
    are 0). Returns (out, S, Z) (the state of every key: S, Z
    None unless ``want_state``), on the host for a host q."""
    cuda = cuda_module()
    from . import kernels
    host = not is_device_array(q)
    bh, n = q.shape[:2]
    code, fp, d = _map_args(fmap)
    dv = v.shape[2]
    q, k, v = (_on_device(x) for x in (q, k, v))
    if S0 is None:
        S0, Z0 = constant(np.zeros((0, d, dv), dtype)), constant(np.zeros((0, d), dtype))
    else:
        S0, Z0 = _on_device(S0), _on_device(Z0)
    out = cuda.device_array((bh, n, dv), dtype)
    rows = bh if want_state else 0
    S, Z = cuda.device_array((rows, d, dv), dtype), cuda.device_array((rows, d), dtype)
    lens, qlens = (constant(np.asarray(x, dtype=np.int64)) for x in (lengths, qlengths))
    if bh:
        c, te = tiles(d, dv)
        ntiles, shared = -(-dv // te), shared_doubles(c, te, d) * 8
        width, least = _width()
        kparts, kper = segments(bh * ntiles, -(-k.shape[1] // c), width, least)
        parts, per = segments(bh * ntiles, -(-n // c), width, least)
        summed = kparts > 1 or parts > 1
        if summed:  # the state of every key from the keys' sums by segment
            S0, Z0 = _segment_states(k, v, code, fp, d, lens, S0, Z0, kparts, kper * c, c, te, shared,
                                     constant(np.zeros((1, 1, 1), dtype)), 0, constant(np.zeros(0)),
                                     constant(np.zeros(3, np.int64)), totals=True)[2:]
        kernels.noncausal[(bh * parts, ntiles), (te, c), 0, shared](
            q, k, v, code, fp, float(eps), bool(normalize), lens, qlens, S0, Z0, out, S, Z, c, te, float(scale),
            parts, per * c, summed)
    state = (_result(S, host), _result(Z, host)) if want_state else (None, None)
    return (_result(out, host),) + state


def step(q, k, v, fmap, eps, normalize, S, Z, out, dtype, gates=None, kind=0, decay=None, scale=1.0):
    """One step on (BH, D) arrays with feature map ``fmap`` (as ``causal``); S, Z (device arrays,
    (BH, D', Dv) and (BH, D')) are updated in place. Host q, k, v are copied over; returns out (a
    device array, or a host array for host q). ``gates``: (BH,) or (BH, D') of ``kind``, ``decay``
    (BH,) in (0, 1]; their values already checked."""
    cuda = cuda_module()
    from .kernels import step as kern
    host = not is_device_array(q)
    bh = q.shape[0]
    if step_shared_bytes(fmap[2]) > _SHARED_BYTES:  # (before anything is copied to the device)
        raise _too_many_features(fmap[2], lambda x: step_shared_bytes(x) <= _SHARED_BYTES)
    code, fp, d = _map_args(fmap)
    dv = v.shape[1]
    q, k, v = (_on_device(x) for x in (q, k, v))
    res = out if out is not None else cuda.device_array((bh, dv), dtype)
    g = constant(np.zeros((1, 1), dtype)) if gates is None else _on_device(
        gates.reshape(bh, -1) if hasattr(gates, "reshape") else gates)
    ld = constant(np.zeros(0)) if decay is None else constant(np.log(np.asarray(decay, np.float64)))
    if bh:
        t = 4 if _simulating() else min(256, max(32, -(-dv // 32) * 32))
        kern[bh, t, 0, step_shared_bytes(d)](q, k, v, code, fp, float(eps), bool(normalize), S, Z, res, t, g, kind,
                                             ld, float(scale))
    return _result(res, host)
