"""cpu/views.py: arrays without reference counting (unowned, keep_alive) and what the kernels do with them."""
import subprocess
import sys

import numpy as np
import pytest
from numba import njit

import linattn
from linattn.cpu.views import keep_alive, unowned


@njit
def _rows_sum(x):
    """Sums of the rows of x through per-row views of an unowned x (a tuple of arrays comes back as one)."""
    (u,), out = unowned((x,)), np.empty(x.shape[0], x.dtype)
    own = np.zeros(x.shape[1], x.dtype)
    acc = unowned(own)
    for t in range(u.shape[0]):
        row = u[t]
        acc[:] = row
        out[t] = acc.sum()
    keep_alive(own)
    return out


def test_unowned_views_read_the_same_data():
    x = np.arange(12.0).reshape(3, 4)[:, ::-1]  # a strided view
    np.testing.assert_array_equal(_rows_sum(x), x.sum(axis=1))


def test_kernels_leave_reference_counts_alone(rng):
    """The kernels drop no reference they did not take (the arguments are unowned inside them)."""
    q, k, v = (rng.standard_normal((2, 3, 40, 8)).astype(np.float32) for _ in range(3))
    state = linattn.State.zeros((2, 3), 8, 8)
    linattn.causal_linear_attention(q, k, v)
    linattn.linear_attention(q, k, v)
    linattn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :], state)
    before = [sys.getrefcount(x) for x in (q, k, v, state.S, state.Z)]
    for _ in range(50):
        linattn.causal_linear_attention(q, k, v)
        linattn.linear_attention(q, k, v)
        linattn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :], state)
    assert [sys.getrefcount(x) for x in (q, k, v, state.S, state.Z)] == before


_GUARDED = r'''
import ctypes, mmap
import numpy as np
from numba import njit
import linattn
from linattn.cpu.views import prefetch_rows_for_writing, touch_rows

PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
maps = []


def guarded(shape, dtype=np.float32):
    """A writable array whose last byte is the last before a page that may not be read (PROT_NONE)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    pages = -(-size // PAGE)
    m = mmap.mmap(-1, (pages + 1) * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert libc.mprotect(base + pages * PAGE, PAGE, 0) == 0, ctypes.get_errno()
    maps.append(m)
    return np.frombuffer(m, dtype, count=int(np.prod(shape)), offset=pages * PAGE - size).reshape(shape)


@njit
def touch(x, i0, c):
    touch_rows(x, i0, c)
    prefetch_rows_for_writing(x, i0, c)


x = guarded((PAGE // 256, 64))
x[:] = 1
flat = x.reshape(-1)
for view in (x, x[:, :8], x[:, 56:], x[:, 1::2], x[:, ::-1], x[::-1], flat.reshape(-1, 1), flat[4:].reshape(-1, 5),
             flat[1:].reshape(-1, 31)[:, 1:]):
    for i0 in range(view.shape[0]):
        touch(view, i0, view.shape[0] - i0)
touch(x, x.shape[0], 0)

rng = np.random.default_rng(0)
for shape in ((1, 2, 63, 16), (1, 1, 64, 16), (2, 1, 1000, 5), (1, 1, 1, 1), (1, 1, 8191, 16)):  # (the last: segments)
    args = []
    for _ in range(3):
        a = guarded(shape)
        a[:] = rng.standard_normal(shape) * 0.5
        args.append(a)
    copies = [a.copy() for a in args]
    for fn in (linattn.causal_linear_attention, linattn.linear_attention):
        np.testing.assert_array_equal(fn(*args), fn(*copies))
    lengths = np.full(shape[0], max(1, shape[2] // 2))
    np.testing.assert_array_equal(linattn.causal_linear_attention(*args, lengths=lengths),
                                  linattn.causal_linear_attention(*copies, lengths=lengths))
    gate = guarded(shape)  # per key dimension: as large as k, loaded ahead too
    gate[:] = -0.1 * rng.random(shape)
    np.testing.assert_array_equal(linattn.causal_linear_attention(*args, gate=gate),
                                  linattn.causal_linear_attention(*copies, gate=gate.copy()))
    dout = guarded(shape)
    dout[:] = rng.standard_normal(shape)
    for fn, kw in ((linattn.causal_linear_attention_vjp, {}), (linattn.causal_linear_attention_vjp,
                   {"lengths": lengths}), (linattn.causal_linear_attention_vjp, {"gate": gate}),
                   (linattn.linear_attention_vjp, {})):
        grads = fn(*args, **kw)[1](dout)
        copied = {key: (val.copy() if key == "gate" else val) for key, val in kw.items()}
        for a, b in zip(grads, fn(*copies, **copied)[1](dout.copy())):
            np.testing.assert_array_equal(a, b)
print("ok")
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect through ctypes: Linux's libc")
def test_rows_touched_ahead_stay_inside_the_arrays():
    """touch_rows (real loads of the next chunks' rows) and prefetch_rows_for_writing on views of every
    kind, and the kernels (forward, non-causal, backward; with gates per key dimension) on inputs whose
    last byte is followed by a page that may not be read: any read past the rows asked for, or past a
    sequence's end, is a segmentation fault (in a subprocess)."""
    res = subprocess.run([sys.executable, "-c", _GUARDED], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), (res.returncode, res.stdout, res.stderr[-3000:])
