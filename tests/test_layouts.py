"""Memory layouts as a NumPy model has them: the heads of a fused QKV projection as strided views,
``out=`` buffers (heads side by side for the next projection), and the work split over threads."""
import tracemalloc

import numba
import numpy as np
import pytest

import linattn
from linattn import attention, gradients, reference
from linattn.cpu import chunked
from linattn.cpu.runtime import chunk_size

from conftest import assert_close, make_qkv


def _NO_STATE(d, dv):
    """The non-causal kernel's (S0, Z0, S_out, Z_out) with no rows: no initial state, none written."""
    return (np.zeros((0, d, dv), np.float32), np.zeros((0, d), np.float32), np.zeros((0, d, dv), np.float32),
            np.zeros((0, d), np.float32))


def _fused_qkv(rng, b, n, h, d, dtype):
    """q, k, v as a model gets them: views (B, H, N, D) into one (B, N, 3, H, D) projection."""
    qkv = (rng.standard_normal((b, n, 3, h, d)) * 0.5).astype(dtype)
    return qkv, tuple(qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
def test_fused_qkv_views_are_read_in_place(rng, dtype, causal):
    qkv, (q, k, v) = _fused_qkv(rng, 2, 70, 3, 8, dtype)
    assert not q.flags.c_contiguous
    (q4, k4, v4), layout, copied = attention._seq4((q, k, v), q.shape[:-2])
    assert copied == (False, False, False) and layout == "A"
    assert all(np.shares_memory(x, qkv) for x in (q4, k4, v4))
    fn = linattn.causal_linear_attention if causal else linattn.linear_attention
    assert_close(fn(q, k, v), reference.masked(q, k, v, causal=causal), dtype)


def test_the_split_of_head_views_is_found_without_copies(rng):
    """_seq4 tries every split of the leading dims: each try that allows no view is answered from
    the strides (view_as), not by a copy of the array (NumPy's shape assignment made one: 2.3 ms of a
    5.2 ms call at B8 H8 N512 D64)."""
    _, (q, k, v) = _fused_qkv(rng, 4, 256, 8, 64, np.float32)
    res = np.zeros((4, 256, 8, 64), np.float32).transpose(0, 2, 1, 3)
    tracemalloc.start()
    try:
        arrays, layout, copied = attention._seq4((q, k, v, res), q.shape[:-2])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert copied == (False,) * 4 and layout == "A"
    assert peak < q.nbytes // 10


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
def test_head_views_take_the_short_path(rng, dtype, causal, monkeypatch):
    """A plain call on a fused projection's head views (4-D, unit-stride rows) runs the strided kernel
    from the short path (the checked path, patched to fail, is not reached), with and without the
    state, with ``out=`` (heads of a buffer, or C-contiguous), and for the vjp: the same results bit for
    bit as the checked path (reached with ``device="cpu"``, the vjps' with their short path patched out)
    and, within float rounding, as the float64 reference; views of other shapes, and an ``out`` in an
    input's memory, take the checked path."""
    _, (q, k, v) = _fused_qkv(rng, 2, 70, 3, 8, dtype)
    fn = linattn.causal_linear_attention if causal else linattn.linear_attention
    vjp_fn = linattn.causal_linear_attention_vjp if causal else linattn.linear_attention_vjp
    want, want_state = fn(q, k, v, device="cpu", return_state=True)
    assert_close(want, reference.masked(q, k, v, causal=causal), dtype)
    dout = rng.standard_normal(want.shape).astype(dtype)
    with monkeypatch.context() as m:  # (the vjps' checked path)
        m.setattr(gradients, "_fast", lambda *a, **kw: None)
        want_grads = vjp_fn(q, k, v)[1](dout)
    three = tuple(x.reshape(1, *x.shape) for x in (q, k, v))  # (5-D views: not the short path's)
    with monkeypatch.context() as m:
        m.setattr(attention, "_prepare", lambda *a, **kw: pytest.fail("the general path"))
        np.testing.assert_array_equal(fn(q, k, v), want)
        out, state = fn(q, k, v, return_state=True)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(state.S, want_state.S)
        np.testing.assert_array_equal(state.Z, want_state.Z)
        for got, expected in zip(vjp_fn(q, k, v)[1](dout), want_grads):
            np.testing.assert_array_equal(got, expected)
        # out=: the heads of a (B, N, H, Dv) buffer (the model's call), or a C-contiguous array
        buf = np.full((2, 70, 3, 8), np.nan, dtype)
        res, state = fn(q, k, v, out=buf.transpose(0, 2, 1, 3), return_state=True)
        assert np.shares_memory(res, buf)
        np.testing.assert_array_equal(buf.transpose(0, 2, 1, 3), want)
        np.testing.assert_array_equal(state.S, want_state.S)
        plain = np.full(want.shape, np.nan, dtype)
        assert fn(*(np.ascontiguousarray(x) for x in (q, k, v)), out=plain) is plain
        np.testing.assert_array_equal(plain, want)
        with pytest.raises(BaseException, match="the general path"):  # 5-D views
            fn(*three)
        with pytest.raises(BaseException, match="the general path"):  # out in the inputs' memory
            fn(q, k, v.copy(), out=v)
    np.testing.assert_array_equal(fn(*three)[0], want)
    vv = v.copy()
    assert fn(q, k, vv, out=vv) is vv
    np.testing.assert_array_equal(vv, want)


@pytest.mark.parametrize("causal", [True, False])
def test_one_sequence_head_views_take_the_short_path(rng, causal, monkeypatch):
    """A model without a batch dim: q, k, v the (H, N, D) heads of an (N, 3, H, D) projection, and one head
    (N, D) of it, through the short path (leading dims of 1 added as views), into ``out=`` too."""
    qkv = (rng.standard_normal((70, 3, 3, 8)) * 0.5).astype(np.float32)
    q, k, v = (qkv[:, i].transpose(1, 0, 2) for i in range(3))
    fn = linattn.causal_linear_attention if causal else linattn.linear_attention
    for args in ((q, k, v), (q[1], k[1], v[1])):
        want = fn(*args, device="cpu")  # (the checked path)
        assert_close(want, reference.masked(*args, causal=causal), np.float32)
        with monkeypatch.context() as m:
            m.setattr(attention, "_prepare", lambda *a, **kw: pytest.fail("the general path"))
            np.testing.assert_array_equal(fn(*args), want)
            # out=: the heads of an (N, H, Dv) buffer (rows apart), or an (N, Dv) array
            buf = np.full(want.shape[-2:-1] + want.shape[:-2] + want.shape[-1:], np.nan, np.float32)
            res = fn(*args, out=np.moveaxis(buf, 0, -2))
            assert np.shares_memory(res, buf)
            np.testing.assert_array_equal(res, want)


@pytest.mark.parametrize("causal", [True, False])
def test_rows_not_unit_stride_are_copied_first(rng, causal):
    """Inputs (and an ``out=``) whose rows are not unit-stride (Fortran order, a transposed copy, every
    other column) are copied once and run by the C-contiguous kernel (read in place they took 6-30x
    as long): the same results as contiguous inputs, bit for bit."""
    q, k, v = make_qkv(rng, (2, 3), 70, 8, 5, np.float32)
    fn = linattn.causal_linear_attention if causal else linattn.linear_attention
    expected = fn(q, k, v)
    wide = np.zeros((2, 3, 70, 10), np.float32)
    for qq, kk, vv in [(np.asfortranarray(q), np.asfortranarray(k), np.asfortranarray(v)),
                       (np.swapaxes(np.swapaxes(q, -1, -2).copy(), -1, -2), k, v),
                       (q, k, np.repeat(v, 2, axis=-1)[..., ::2])]:
        arrays, layout, copied = attention._seq4((qq, kk, vv), q.shape[:-2])
        assert layout == "C" and copied == tuple(x.strides[-1] != 4 for x in (qq, kk, vv))
        np.testing.assert_array_equal(fn(qq, kk, vv), expected)
        res = fn(qq, kk, vv, out=wide[..., ::2])
        assert np.shares_memory(res, wide)
        np.testing.assert_array_equal(wide[..., ::2], expected)
        assert not wide[..., 1::2].any()


@pytest.mark.parametrize("causal", [True, False])
def test_out_buffer_with_heads_side_by_side(rng, causal):
    b, n, h, d = 2, 50, 3, 4
    _, (q, k, v) = _fused_qkv(rng, b, n, h, d, np.float32)
    buf = np.full((b, n, h, d), np.nan, np.float32)
    fn = linattn.causal_linear_attention if causal else linattn.linear_attention
    res = fn(q, k, v, out=buf.transpose(0, 2, 1, 3))
    assert np.shares_memory(res, buf)
    assert_close(buf.transpose(0, 2, 1, 3), reference.masked(q, k, v, causal=causal), np.float32)
    np.testing.assert_array_equal(res, fn(np.ascontiguousarray(q), k, v))


def test_out_every_kind(rng):
    q, k, v = make_qkv(rng, (2, 3), 40, 5, 6)
    ref = linattn.causal_linear_attention(q, k, v)
    # a C-contiguous buffer, one with a column stride (written through a buffer of ours)
    for out in (np.empty((2, 3, 40, 6), np.float32), np.empty((2, 3, 40, 12), np.float32)[..., ::2]):
        res = linattn.causal_linear_attention(q, k, v, out=out)
        assert res is out
        np.testing.assert_array_equal(out, ref)
    out16 = np.empty((2, 3, 40, 6), np.float16)  # float16 inputs, float16 out: computed in float32
    res = linattn.causal_linear_attention(*(x.astype(np.float16) for x in (q, k, v)), out=out16)
    assert res is out16 and np.abs(out16 - ref).max() < 2e-2
    # out may be the memory of an input: the result is computed aside first
    vv = v.copy()
    linattn.causal_linear_attention(q, k, vv, out=vv)
    np.testing.assert_array_equal(vv, ref)
    # with the state and lengths
    out = np.empty_like(ref)
    res, st = linattn.causal_linear_attention(q, k, v, out=out, lengths=np.array([40, 7]), return_state=True)
    assert res is out and np.all(out[1, :, 7:] == 0)
    assert_close(out[1, :, :7], reference.masked(q[1, :, :7], k[1, :, :7], v[1, :, :7]), np.float32)


@pytest.mark.parametrize("threads", [1, 2])
def test_out_in_the_memory_of_a_gate_or_the_initial_state(rng, threads):
    """out sharing memory with what the kernel reads as it writes (the initial state, a gate per key
    dimension or per position), each head's out over the next head's part: the result is as from
    copies (it was wrong, or a spurious gate error, when head h's rows overwrote head h + 1's)."""
    b, h, n, d = 2, 4, 48, 48
    q, k, v = make_qkv(rng, (b, h), n, d, d)
    _, st = linattn.causal_linear_attention(q, k, v, return_state=True)
    gate = (-np.abs(rng.standard_normal((b, h, n, d))) * 0.1).astype(np.float32)
    gate1 = gate[..., 0].copy()
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        big = np.zeros((b * h + 1, n, d), np.float32)  # S0 of head h + 1 where head h's out goes
        big[:-1] = st.S.reshape(b * h, d, d)
        S0, out = big[:-1].reshape(b, h, d, d), big[1:].reshape(b, h, n, d)
        want = linattn.causal_linear_attention(q, k, v, initial_state=linattn.State(S0.copy(), st.Z))
        got = linattn.causal_linear_attention(q, k, v, initial_state=linattn.State(S0, st.Z), out=out)
        assert got is out
        np.testing.assert_array_equal(got, want)
        for g in (gate, gate1):
            big = np.zeros(gate.size + n * d, np.float32)  # the gates of head h + 1 where head h's out goes
            gg = big[:g.size].reshape(g.shape)
            gg[...] = g
            out = big[n * d:].reshape(b, h, n, d)
            want = linattn.causal_linear_attention(q, k, v, gate=g)
            np.testing.assert_array_equal(linattn.causal_linear_attention(q, k, v, gate=gg, out=out), want)
    finally:
        numba.set_num_threads(before)


def test_out_errors(rng):
    q, k, v = make_qkv(rng, (2,), 10, 4, 3)
    for fn in (linattn.causal_linear_attention, linattn.linear_attention):
        with pytest.raises(ValueError, match=r"out: expected an ndarray of shape \(2, 10, 3\) and dtype float32"):
            fn(q, k, v, out=np.empty((2, 10, 4), np.float32))
        with pytest.raises(ValueError, match=r"out: expected an ndarray .* dtype float32, got .*float16"):
            fn(q, k, v, out=np.empty((2, 10, 3), np.float16))
        with pytest.raises(ValueError, match="out: expected an ndarray"):
            fn(q, k, v, out=[[0.0]])
        ro = np.empty((2, 10, 3), np.float32)
        ro.setflags(write=False)
        with pytest.raises(ValueError, match="out: expected a writable array"):
            fn(q, k, v, out=ro)


@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize("nthreads", [1, 2, 3, 7])
def test_any_number_of_threads_takes_all_items(rng, nthreads, views):
    """Threads take work items from a shared counter: however many there are, every item is done
    once (more threads than Numba runs, or than items, included); on contiguous heads and on head views
    of fused projections (rows apart: the prefixes' and the non-causal sums' values are copied)."""
    n, d, dv = 300, 6, 5
    q, k, v = make_qkv(rng, (2, 3), n, d, dv)
    layout = "A" if views else "C"
    if views:
        _, (q, k, _) = _fused_qkv(rng, 2, n, 3, d, np.float32)
        v = np.zeros((2, n, 3, dv + 2), np.float32)[..., 1:dv + 1].transpose(0, 2, 1, 3)
        v[...] = rng.standard_normal(v.shape)
    frac = np.array([0, 0.3, 0.7, 1.0])
    lengths = np.array([300, 131, 0, 1, 299, 64], np.int64)
    out = np.full((2, 3, n, dv), np.nan, np.float32)
    S, Z = np.full((6, d, dv), np.nan, np.float32), np.full((6, d), np.nan, np.float32)
    none = np.zeros((0, d, dv), np.float32), np.zeros((0, d), np.float32)
    no_gates = (np.zeros(0, np.float32), np.zeros(0), np.zeros(3, np.int64))
    no_map = (np.zeros(0, np.float32), 0)  # elu+1 inline: no parameters, no map_rows
    parts = np.full((6, 3, d, dv + 2), np.nan)
    kernel = chunked.causal_forward.get(np.float32, (layout, 0))
    for runs in (((1, parts[:0]),), ((0, parts), (1, parts))):  # segments after their prefix; in two runs
        out[...], S[...], Z[...] = np.nan, np.nan, np.nan
        for phase, p in runs:
            kernel(nthreads, q, k, v, 1, *no_map, np.float32(1e-6), True, np.float32(1), lengths, chunk_size(n), frac,
                   *none, out, S, Z, *no_gates, np.zeros((1, 1, 0), np.float32), np.zeros((1, 1, 0, 1, 1), np.float32),
                   phase, p)
        for h, L in enumerate(lengths):
            i, j = divmod(h, 3)
            ref, (S_ref, Z_ref) = reference.loop(q[i, j, :L], k[i, j, :L], v[i, j, :L], return_state=True)
            assert_close(out[i, j, :L], ref, np.float32)
            np.testing.assert_array_equal(out[i, j, L:], 0)
            assert_close(S[h], S_ref, np.float32)
            assert_close(Z[h], Z_ref, np.float32)
    out2 = np.full((2, 3, n, dv), np.nan, np.float32)
    parts = np.full((6, 3, d, dv + 1), np.nan)  # each segment's part of its head's state, then the outputs
    noncausal = chunked.noncausal_forward.get(np.float32, layout)
    for phase in (0, 1):
        noncausal(nthreads, q, k, v, 1, *no_map, np.float32(1e-6), True, np.float32(1), np.full(6, n), np.full(6, n),
                  chunk_size(n), frac, *_NO_STATE(d, dv)[:2], out2, *_NO_STATE(d, dv)[2:], phase, parts)
    assert_close(out2, reference.masked(q, k, v, causal=False), np.float32)


def test_fast_and_checked_paths_agree(rng):
    """The plain call takes a short path, as do every length given and ``out=``; the same call with
    ``device="cpu"`` takes the checked one: the same kernel, the same bits. (A causal call of at most
    FRESH_POSITIONS positions with no state runs step's kernel instead: within rounding of the checked path's
    here, bit for bit the steps' in tests/test_decoding.py.)"""
    for lead, n in (((), 1), ((3,), 17), ((2, 2), 200)):
        q, k, v = make_qkv(rng, lead, n, 7, 5)
        full = np.full(lead, n) if lead else n
        want = linattn.causal_linear_attention(q, k, v, device="cpu")
        if n <= attention.FRESH_POSITIONS:
            assert_close(linattn.causal_linear_attention(q, k, v), want, np.float32)
        else:
            np.testing.assert_array_equal(linattn.causal_linear_attention(q, k, v), want)
        np.testing.assert_array_equal(linattn.causal_linear_attention(q, k, v, lengths=full), want)
        want = linattn.linear_attention(q, k, v, device="cpu")
        np.testing.assert_array_equal(linattn.linear_attention(q, k, v), want)
        np.testing.assert_array_equal(linattn.linear_attention(q, k, v, lengths=full, query_lengths=full), want)
        np.testing.assert_array_equal(linattn.linear_attention(q, k, v, out=np.empty(lead + (n, 5), np.float32)),
                                      want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fast_path_passes_the_workers_signature(rng, monkeypatch, dtype):
    """The plain call runs the worker through its unchecked entry point (no type dispatch): wrong
    argument types there would be read as the signature's. Here the entry points are the checked
    dispatchers (explicit signatures: a mismatch raises TypeError) for every form of the short path,
    decay, gates and scale included, on C-contiguous arrays and on views."""
    calls = []

    def checked(worker):
        def call(*args):
            calls.append(len(args))
            return worker(*args)
        return call

    variants = [(chunked.causal_forward, (layout, kind)) for layout in "CA" for kind in range(4)]
    for kernel, variant in variants + [(chunked.noncausal_forward, "C")]:
        run = kernel.get(np.dtype(dtype), variant)
        monkeypatch.setattr(run, "unchecked", checked(run.worker))
    for lead, n, d, dv in (((), 1, 1, 1), ((3,), 17, 7, 5), ((2, 2), 40, 4, 6), ((1, 2, 1, 2), 9, 3, 2)):
        q, k, v = make_qkv(rng, lead, n, d, dv, dtype)
        k.setflags(write=False)  # read-only inputs as well
        gate = -rng.random(lead + (n,)).astype(dtype)
        gate.setflags(write=False)
        per_dim = -rng.random(lead + (n, d)).astype(dtype)
        for kw in (dict(decay=0.9, scale=0.5), dict(gate=gate), dict(gate=per_dim, decay=np.full(lead[-1:], 0.8))):
            before = len(calls)
            out = linattn.causal_linear_attention(q, k, v, **kw)
            assert len(calls) == before + 1
            assert_close(out, reference.loop(q, k, v, **kw), dtype)
        if len(lead) in (2, 3):  # head views: the strided kernels
            view = tuple(np.ascontiguousarray(np.swapaxes(x, 0, -2)).swapaxes(0, -2) for x in (q, k, v))
            gate_view = np.ascontiguousarray(np.swapaxes(gate, 0, -1)).swapaxes(0, -1)
            before = len(calls)
            out = linattn.causal_linear_attention(*view, gate=gate_view, decay=0.5)
            assert len(calls) == before + 1
            assert_close(out, reference.loop(q, k, v, gate=gate, decay=0.5), dtype)
        for kw in ({}, dict(feature_map="relu", normalize=False, eps=0.0)):
            before = len(calls)
            out = linattn.causal_linear_attention(q, k, v, **kw)
            (out2, state), _ = attention._fast(True, q, k, v, kw.get("feature_map", "elu"), kw.get("eps", 1e-6),
                                               kw.get("normalize", True), keep=True, return_state=True)
            out3 = linattn.linear_attention(q, k, v, **kw)
            assert len(calls) == before + 3  # each one ran the worker on this thread
            assert_close(out, reference.masked(q, k, v, **kw), dtype)
            np.testing.assert_array_equal(out2, out)
            assert_close(state.S, reference.loop(q, k, v, return_state=True, **kw)[1][0], dtype)
            assert_close(out3, reference.masked(q, k, v, causal=False, **kw), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_step_out(rng, dtype):
    q, k, v = make_qkv(rng, (2, 3), 4, 8, 5, dtype)
    st, st2 = linattn.State.zeros((2, 3), 8, 5, dtype), linattn.State.zeros((2, 3), 8, 5, dtype)
    out = np.full((2, 3, 5), np.nan, dtype)
    strided = np.full((2, 3, 10), np.nan, dtype)[..., ::2]
    for i in range(4):
        before = linattn.State(st.S.copy(), st.Z.copy())
        ref = linattn.step(q[..., i, :], k[..., i, :], v[..., i, :], st)
        assert linattn.step(q[..., i, :], k[..., i, :], v[..., i, :], st2, out=out) is out
        np.testing.assert_array_equal(out, ref)
        np.testing.assert_array_equal(st2.S, st.S)
        assert linattn.step(q[..., i, :], k[..., i, :], v[..., i, :], before, out=strided) is strided
        np.testing.assert_allclose(strided, ref, rtol=1e-5)


@pytest.mark.parametrize("lead", [(5,), (3, 4), (2, 2, 3), (2, 1, 2, 2)])
def test_step_on_fused_qkv_views(rng, lead):
    # a decoding step of a model: q, k, v are views of one projection (..., 3, D); heads are read
    # in place on the fast path (any number of leading dims)
    qkv = (rng.standard_normal(lead + (3, 6)) * 0.5).astype(np.float32)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    assert not q.flags.c_contiguous
    st, ref_st = linattn.State.zeros(lead, 6, 6), linattn.State.zeros(lead, 6, 6)
    out = np.empty(lead + (6,), np.float32)
    for _ in range(3):
        res = linattn.step(q, k, v, st, out=out)
        ref = linattn.step(*(np.ascontiguousarray(x) for x in (q, k, v)), ref_st)
        assert res is out
        np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(st.S, ref_st.S)
    np.testing.assert_array_equal(st.Z, ref_st.Z)
