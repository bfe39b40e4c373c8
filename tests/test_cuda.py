"""The CUDA path, on a GPU or in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1 set before numba is
imported; test_cuda_simulator.py runs this file that way). Shapes are tiny: the simulator runs each
GPU thread as a Python thread. Every result is compared with the CPU path."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn
from conftest import random_options

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def _cuda_or_skip():
    try:
        from numba import cuda
    except ImportError:
        pytest.skip("numba.cuda is not installed")
    if not cuda.is_available():
        pytest.skip("no CUDA GPU and no simulator (NUMBA_ENABLE_CUDASIM=1)")
    return cuda


@pytest.fixture(scope="module")
def cuda():
    return _cuda_or_skip()


def qkv(rng, lead, n, d, dv, dtype):
    return tuple((rng.standard_normal(lead + (n, x)) * 0.6).astype(dtype) for x in (d, d, dv))


def dev(cuda, x):
    """A device copy of a (possibly non-contiguous) host array."""
    return cuda.to_device(np.ascontiguousarray(x))


def close(a, b, dtype):
    tol = 2e-5 if dtype == np.float32 else 1e-11
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.max(np.abs(b)))))


@pytest.mark.parametrize("dtype, feature_map", [(dt, fm) for dt in (np.float32, np.float64)
                                                for fm in ("elu", "relu", "identity")]
                         + [(np.float64, fm) for fm in ("squared_relu", "gelu", "silu", "sigmoid", "softplus")])
def test_causal_and_noncausal(cuda, dtype, feature_map):
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, (2,), 9, 3, 5, dtype)
    if feature_map in ("identity", "gelu", "silu"):  # maps with negative values: keep the normaliser away from 0
        q, k = np.abs(q) + 0.2, np.abs(k) + 0.2
    dq, dk, dv = (dev(cuda, x) for x in (q, k, v))
    for normalize in (True, False):
        kw = dict(feature_map=feature_map, normalize=normalize)
        out = linattn.causal_linear_attention(dq, dk, dv, **kw)
        assert not isinstance(out, np.ndarray) and out.shape == (2, 9, 5)
        close(out.copy_to_host(), linattn.causal_linear_attention(q, k, v, **kw), dtype)
        out = linattn.linear_attention(dq, dk, dv, **kw)
        close(out.copy_to_host(), linattn.linear_attention(q, k, v, **kw), dtype)


@pytest.mark.parametrize("n, nk", [(9, 4), (3, 11), (5, 0)])
def test_cross_attention(cuda, n, nk):
    """Keys and values of another length than the queries (non-causal): device arrays, host arrays with
    device="cuda", a map with row statistics (ReBased), against the CPU."""
    rng = np.random.default_rng(9)
    for dtype in (np.float32, np.float64):
        q = (rng.standard_normal((2, n, 3)) * 0.6).astype(dtype)
        k, v = ((rng.standard_normal((2, nk, w)) * 0.6).astype(dtype) for w in (3, 5))
        rebased = linattn.feature_maps.ReBased(rng.random(3) + 0.5, rng.random(3))
        for kw in (dict(), dict(feature_map=rebased, normalize=False, scale=0.5)):
            want = linattn.linear_attention(q, k, v, **kw)
            out = linattn.linear_attention(dev(cuda, q), dev(cuda, k), dev(cuda, v), **kw)
            assert out.shape == (2, n, 5)
            close(out.copy_to_host(), want, dtype)
            close(linattn.linear_attention(q, k, v, device="cuda", **kw), want, dtype)
    with pytest.raises(ValueError, match="v: expected the keys' length"):
        linattn.linear_attention(dev(cuda, q), dev(cuda, k), dev(cuda, np.zeros((2, nk + 1, 5), np.float64)))


def test_state_of_keys_on_device(cuda):
    """Non-causal initial_state / return_state on the device: keys in two pieces through the state, then
    queries over the state alone (k, v None), device and host arrays, against the CPU."""
    rng = np.random.default_rng(10)
    for dtype in (np.float32, np.float64):
        q = (rng.standard_normal((2, 5, 3)) * 0.6).astype(dtype)
        k, v = ((rng.standard_normal((2, 9, w)) * 0.6).astype(dtype) for w in (3, 6))
        want, st_want = linattn.linear_attention(q, k, v, return_state=True)
        a, st = linattn.linear_attention(dev(cuda, q), dev(cuda, k[:, :4]), dev(cuda, v[:, :4]), return_state=True)
        assert not isinstance(st.S, np.ndarray)
        b, st2 = linattn.linear_attention(dev(cuda, q), dev(cuda, k[:, 4:]), dev(cuda, v[:, 4:]), initial_state=st,
                                          return_state=True)
        close(a.copy_to_host(), linattn.linear_attention(q, k[:, :4], v[:, :4]), dtype)
        close(b.copy_to_host(), want, dtype)
        close(st2.S.copy_to_host(), st_want.S, dtype)
        close(st2.Z.copy_to_host(), st_want.Z, dtype)
        close(linattn.linear_attention(dev(cuda, q), initial_state=st2).copy_to_host(), want, dtype)
        out, st3 = linattn.linear_attention(q, initial_state=st_want, device="cuda", return_state=True)
        assert isinstance(out, np.ndarray) and isinstance(st3.S, np.ndarray)
        close(out, want, dtype)
        close(st3.S, st_want.S, dtype)
        lengths = np.array([9, 3])  # right-padded keys (NaN past each length)
        kp, vp = (np.where((np.arange(9) < lengths[:, None])[..., None], x, np.nan).astype(dtype) for x in (k, v))
        want, st_want = linattn.linear_attention(q, kp, vp, lengths=lengths, return_state=True)
        out, st4 = linattn.linear_attention(dev(cuda, q), dev(cuda, kp), dev(cuda, vp), lengths=lengths,
                                            return_state=True)
        close(out.copy_to_host(), want, dtype)
        close(st4.S.copy_to_host(), st_want.S, dtype)
        qlengths = np.array([2, 0])  # and right-padded queries: 0 past their lengths
        qp = np.where((np.arange(q.shape[1]) < qlengths[:, None])[..., None], q, np.nan).astype(dtype)
        out = linattn.linear_attention(dev(cuda, qp), dev(cuda, kp), dev(cuda, vp), lengths=lengths,
                                       query_lengths=qlengths).copy_to_host()
        close(out, linattn.linear_attention(qp, kp, vp, lengths=lengths, query_lengths=qlengths), dtype)
        np.testing.assert_array_equal(out[np.isnan(qp[..., 0])], 0)


def test_scale_on_device(cuda):
    """scale multiplies phi(q) in both forms on the device (the non-causal kernel ignored it: 2x its result
    at scale 0.5 without normalisation)."""
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, (2,), 7, 3, 2, np.float64)
    for normalize in (True, False):
        for fn in (linattn.causal_linear_attention, linattn.linear_attention):
            kw = dict(scale=0.5, normalize=normalize, eps=0.1)
            close(fn(*(dev(cuda, x) for x in (q, k, v)), **kw).copy_to_host(), fn(q, k, v, **kw), np.float64)
            close(fn(q, k, v, device="cuda", **kw), fn(q, k, v, **kw), np.float64)


@pytest.mark.parametrize("feature_map", ["relu", "squared_relu", "softplus"])
def test_maps_of_minus_inf(cuda, feature_map):
    """Keys at -inf: phi is 0 there (relu's was NaN on the device), as on the CPU."""
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, (2,), 7, 3, 4, np.float64)
    q, k = np.abs(q) + 0.2, np.abs(k) + 0.2
    k[0, 2, 1] = k[1, 5, 0] = -np.inf
    out = linattn.causal_linear_attention(dev(cuda, q), dev(cuda, k), dev(cuda, v), feature_map=feature_map)
    want = linattn.causal_linear_attention(q, k, v, feature_map=feature_map)
    assert np.isfinite(want).all()
    close(out.copy_to_host(), want, np.float64)


@pytest.mark.parametrize("taylor", [False, True])
def test_state_handoff_and_lengths(cuda, taylor):
    """Also with a map computed on the device before the kernels (Taylor: D' = 10 for D = 3), whose
    state and gates per key dimension have D' rows."""
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, (2,), 11, 3, 5, np.float32)
    kw = dict(feature_map=linattn.feature_maps.Taylor()) if taylor else {}
    dq, dk, dv = (dev(cuda, x) for x in (q, k, v))
    full, st = linattn.causal_linear_attention(q, k, v, return_state=True, **kw)
    a, dst = linattn.causal_linear_attention(dev(cuda, q[:, :6]), dev(cuda, k[:, :6]),
                                             dev(cuda, v[:, :6]), return_state=True, **kw)
    b, dst2 = linattn.causal_linear_attention(dev(cuda, q[:, 6:]), dev(cuda, k[:, 6:]),
                                              dev(cuda, v[:, 6:]), initial_state=dst, return_state=True, **kw)
    close(np.concatenate([a.copy_to_host(), b.copy_to_host()], axis=1), full, np.float32)
    close(dst2.S.copy_to_host(), st.S, np.float32)
    close(dst2.Z.copy_to_host(), st.Z, np.float32)
    lengths = np.array([11, 4])
    out, stl = linattn.causal_linear_attention(dq, dk, dv, lengths=lengths, return_state=True, **kw)
    ref, st_ref = linattn.causal_linear_attention(q, k, v, lengths=lengths, return_state=True, **kw)
    close(out.copy_to_host(), ref, np.float32)
    close(stl.S.copy_to_host(), st_ref.S, np.float32)
    if taylor:  # a gate per key dimension of the mapped features
        gate = -0.2 * rng.random((2, 11, 10)).astype(np.float32)
        close(linattn.causal_linear_attention(dq, dk, dv, gate=gate, **kw).copy_to_host(),
              linattn.causal_linear_attention(q, k, v, gate=gate, **kw), np.float32)


@pytest.mark.parametrize("dtype, feature_map", [(np.float32, "elu"), (np.float64, "elu"), (np.float32, "relu"),
                                                (np.float64, "relu"), (np.float32, "softplus")])
def test_step_on_device(cuda, dtype, feature_map):
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, (2, 2), 6, 3, 5, dtype)
    full = linattn.causal_linear_attention(q, k, v, feature_map=feature_map)
    _, st = linattn.causal_linear_attention(q[..., :3, :], k[..., :3, :], v[..., :3, :], return_state=True,
                                            feature_map=feature_map)
    dst = linattn.State(dev(cuda, st.S), dev(cuda, st.Z))
    for i in range(3, 6):
        o = linattn.step(dev(cuda, q[..., i, :]), dev(cuda, k[..., i, :]),
                         dev(cuda, v[..., i, :]), dst, feature_map=feature_map)
        close(o.copy_to_host(), full[..., i, :], dtype)
    out = cuda.device_array((2, 2, 5), dtype)
    r = linattn.step(dev(cuda, q[..., 0, :]), dev(cuda, k[..., 0, :]), dev(cuda, v[..., 0, :]),
                     dst, feature_map=feature_map, out=out)
    assert r.shape == (2, 2, 5)
    S0 = dst.S.copy_to_host()
    with pytest.raises(ValueError, match="out: expected memory apart from state.S"):  # (the state is written)
        linattn.step(dev(cuda, q[..., 0, :]), dev(cuda, k[..., 0, :]), dev(cuda, v[..., 0, :]),
                     dst, feature_map=feature_map, out=dst.S.reshape(60)[:20].reshape(2, 2, 5))
    with pytest.raises(ValueError, match="v: expected memory apart from the state and out"):
        linattn.step(dev(cuda, q[..., 0, :]), dev(cuda, k[..., 0, :]), dst.S.reshape(60)[40:].reshape(2, 2, 5), dst,
                     feature_map=feature_map)
    np.testing.assert_array_equal(dst.S.copy_to_host(), S0)


def test_device_option_on_host_arrays(cuda):
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, (3,), 7, 2, 3, np.float32)
    out = linattn.causal_linear_attention(q, k, v, device="cuda")
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    close(out, linattn.causal_linear_attention(q, k, v), np.float32)
    close(linattn.linear_attention(q, k, v, device="cuda"), linattn.linear_attention(q, k, v), np.float32)
    fm = lambda x: np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], -1) + 0.1  # noqa: E731
    close(linattn.causal_linear_attention(q, k, v, feature_map=fm, device="cuda"),
          linattn.causal_linear_attention(q, k, v, feature_map=fm), np.float32)
    for fmap in (linattn.feature_maps.Taylor(), "softplus"):  # computed inside the kernels, as on a device
        close(linattn.causal_linear_attention(q, k, v, feature_map=fmap, device="cuda"),
              linattn.causal_linear_attention(q, k, v, feature_map=fmap), np.float32)
        close(linattn.linear_attention(q, k, v, feature_map=fmap, device="cuda"),
              linattn.linear_attention(q, k, v, feature_map=fmap), np.float32)
    st, st_cpu = linattn.State.zeros((3,), 2, 3), linattn.State.zeros((3,), 2, 3)
    for i in range(3):
        o = linattn.step(q[:, i], k[:, i], v[:, i], st, device="cuda")
        o_cpu = linattn.step(q[:, i], k[:, i], v[:, i], st_cpu)
        assert isinstance(o, np.ndarray)
        close(o, o_cpu, np.float32)
    close(st.S, st_cpu.S, np.float32)
    # a host state whose leading dims cannot be flattened without a copy is stepped in a copy and
    # written back
    q2, k2, v2 = (x.astype(np.float32) for x in rng.standard_normal((3, 2, 3, 2)))  # (2, 3, 2) each
    S_t = np.zeros((3, 2, 2, 2), np.float32).transpose(1, 0, 2, 3)  # (2, 3, 2, 2), no flat view
    Z_t = np.zeros((3, 2, 2), np.float32).transpose(1, 0, 2)
    st_t, st_t_cpu = linattn.State(S_t, Z_t), linattn.State.zeros((2, 3), 2, 2)
    linattn.step(q2, k2, v2, st_t, device="cuda")
    linattn.step(q2, k2, v2, st_t_cpu)
    assert np.abs(st_t_cpu.S).max() > 0
    close(st_t.S, st_t_cpu.S, np.float32)
    close(st_t.Z, st_t_cpu.Z, np.float32)


def _device_maps(d, seed=3):
    """The expansion, learned and scaled maps (the kernels compute them with cuda/maps.py's features)."""
    rng = np.random.default_rng(seed)
    fm = linattn.feature_maps
    w, b = rng.standard_normal((d, 3)) / np.sqrt(d), 0.1 * rng.standard_normal(3)
    return [fm.Taylor(), fm.ReBased(1 + 0.2 * rng.standard_normal(d), 0.1 * rng.standard_normal(d)), fm.DPFP(2),
            fm.Performer(rng.standard_normal((d, 5))), fm.Hedgehog(w, b), fm.T2R(w, b + 0.5),
            fm.Elementwise("gelu").scaled(0.5), fm.Elementwise("elu").scaled(2.0), fm.Elementwise("relu").scaled(0.7)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_maps_on_device_arrays(cuda, dtype):
    """The expansion, learned and scaled maps on device arrays: causal, non-causal and step equal the CPU."""
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, (2,), 5, 3, 2, dtype)
    dq, dk, dv = (dev(cuda, x) for x in (q, k, v))
    for fmap in _device_maps(3):
        kw = dict(feature_map=fmap, normalize=not isinstance(fmap, linattn.feature_maps.Elementwise))
        out = linattn.causal_linear_attention(dq, dk, dv, **kw)
        close(out.copy_to_host(), linattn.causal_linear_attention(q, k, v, **kw), dtype)
        close(linattn.linear_attention(dq, dk, dv, **kw).copy_to_host(), linattn.linear_attention(q, k, v, **kw),
              dtype)
        dk_ = fmap.out_dim(3)
        st = linattn.State(cuda.to_device(np.zeros((2, dk_, 2), dtype)), cuda.to_device(np.zeros((2, dk_), dtype)))
        st_cpu = linattn.State.zeros((2,), dk_, 2, dtype)
        for i in range(2):
            o = linattn.step(dev(cuda, q[:, i]), dev(cuda, k[:, i]), dev(cuda, v[:, i]), st, **kw)
            close(o.copy_to_host(), linattn.step(q[:, i], k[:, i], v[:, i], st_cpu, **kw), dtype)
        close(st.S.copy_to_host(), st_cpu.S, dtype)


def test_maps_allocate_nothing_of_the_features_shape(cuda, monkeypatch):
    """phi(q), phi(k) are computed inside the kernels: no device array of shape (BH, N, D') is made
    (the maps used to be applied to the inputs first), for device and host inputs."""
    rng = np.random.default_rng(8)
    bh, n, d = 2, 5, 3
    q, k, v = qkv(rng, (bh,), n, d, 2, np.float32)
    shapes = []
    for name in ("device_array", "to_device"):
        real = getattr(cuda, name)

        def record(*args, _real=real, **kw):
            arr = _real(*args, **kw)
            shapes.append(tuple(arr.shape))
            return arr

        monkeypatch.setattr(cuda, name, record)
    fmap = linattn.feature_maps.Taylor()  # D' = 10
    want = linattn.causal_linear_attention(q, k, v, feature_map=fmap)
    close(linattn.causal_linear_attention(q, k, v, feature_map=fmap, device="cuda"), want, np.float32)
    inputs = [dev(cuda, x) for x in (q, k, v)]
    close(linattn.causal_linear_attention(*inputs, feature_map=fmap).copy_to_host(), want, np.float32)
    assert (bh, n, 2) in shapes  # the outputs were seen
    assert not [s for s in shapes if np.prod(s) >= bh * n * fmap.out_dim(d)], shapes


def test_repeated_calls_copy_nothing_from_the_host(cuda, monkeypatch):
    """Calls on device arrays copy no host array to the device once the constants they share (a map's
    parameters, lengths, decays, the empty state and gates of calls without them) are there: each copy
    cost 0.19 ms on an H200 machine, more than a decoding step's kernel. Nothing is copied back
    either, except a gate's status. The constants are per value: other parameters are copied once."""
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, (2, 2), 5, 3, 2, np.float32)
    dq, dk, dv = (dev(cuda, x) for x in (q, k, v))
    q1, k1, v1 = (dev(cuda, x[:, :, 0]) for x in (q, k, v))
    st, st4 = (linattn.State(dev(cuda, np.zeros((2, 2, f, 2), np.float32)), dev(cuda, np.zeros((2, 2, f), np.float32)))
               for f in (3, 4))
    perf = [linattn.feature_maps.Performer.random(3, 4, seed=s) for s in (0, 1)]
    calls = [lambda: linattn.causal_linear_attention(dq, dk, dv),
             lambda: linattn.causal_linear_attention(dq, dk, dv, decay=0.9, feature_map=perf[0]),
             lambda: linattn.linear_attention(dq, dk, dv, return_state=True),
             lambda: linattn.step(q1, k1, v1, st),
             lambda: linattn.step(q1, k1, v1, st4, decay=[0.5, 0.9], feature_map=perf[0])]
    wants = [linattn.causal_linear_attention(q, k, v), linattn.causal_linear_attention(q, k, v, decay=0.9,
                                                                                       feature_map=perf[0])]
    for call in calls:
        call()
    copies = []
    real_to_device = cuda.to_device
    monkeypatch.setattr(cuda, "to_device", lambda *a, **kw: copies.append(a[0].shape) or real_to_device(*a, **kw))
    for call, want in zip(calls, wants + [None] * 3):
        got = call()
        if want is not None:
            close(got.copy_to_host(), want, np.float32)
    assert copies == [], copies
    linattn.causal_linear_attention(dq, dk, dv, feature_map=perf[1])  # other parameters: copied once
    assert len(copies) == 1, copies


def test_constants_per_context_of_an_unhashable_type(monkeypatch):
    """The constants' cache on a GPU (the simulator takes another branch): Numba's CUDA contexts define
    __eq__ and no __hash__, so they are keyed by id and held; a new context (after cuda.close())
    gets copies of its own; the zeros' buffer grows to twice what is asked."""
    from linattn.cuda import api

    class Ctx:  # as numba.cuda.cudadrv.driver.Context
        def __eq__(self, other):
            return isinstance(other, Ctx)

    class FakeCuda:
        ctx, copies = Ctx(), 0

        def current_context(self):
            return self.ctx

        def to_device(self, x):
            self.copies += 1
            return x.copy()

    fake = FakeCuda()
    for name, value in (("cuda_module", lambda: fake), ("_simulating", lambda: False), ("_constants", {}),
                        ("_zeros", {})):
        monkeypatch.setattr(api, name, value)
    a = api.constant(np.arange(3.0))
    assert api.constant(np.arange(3.0)) is a and fake.copies == 1
    api.constant(np.arange(4.0))
    assert fake.copies == 2
    z = api.device_zeros(10, np.float32)
    assert z.shape == (10,) and z.dtype == np.float32 and not z.any() and fake.copies == 3
    assert api.device_zeros(900, np.float32).shape == (900,) and fake.copies == 3  # (1024 made)
    assert api.device_zeros(5000, np.float32).shape == (5000,) and fake.copies == 4
    assert api.device_zeros(9000, np.float32).shape == (9000,) and fake.copies == 4
    fake.ctx = Ctx()  # a new context: its own copies
    assert api.constant(np.arange(3.0)) is not a and fake.copies == 5
    assert api.constant(np.arange(3.0, dtype=np.float32)) is not a and fake.copies == 6  # (another dtype)


def test_errors(cuda):
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, (2,), 4, 2, 3, np.float32)
    dq = dev(cuda, q)
    with pytest.raises(TypeError, match="expected all host arrays or all CUDA device arrays; q on a CUDA"):
        linattn.causal_linear_attention(dq, k, v)
    with pytest.raises(TypeError, match="feature_map: a callable runs on host arrays"):
        linattn.causal_linear_attention(dq, dev(cuda, k), dev(cuda, v), feature_map=np.abs)
    with pytest.raises(ValueError, match="device: 'cpu' was asked for"):
        linattn.linear_attention(dq, dev(cuda, k), dev(cuda, v), device="cpu")
    with pytest.raises(TypeError, match="on a CUDA device expected float32 or float64 arrays of one dtype"):
        linattn.causal_linear_attention(dq, dev(cuda, k.astype(np.float64)), dev(cuda, v))
    st = linattn.State.zeros((2,), 2, 3)
    with pytest.raises(TypeError, match="q, k, v on a CUDA device, state.S, state.Z on the host"):
        linattn.step(dev(cuda, q[:, 0]), dev(cuda, k[:, 0]), dev(cuda, v[:, 0]), st)
    with pytest.raises(ValueError, match="q: expected a C-contiguous CUDA device array"):
        linattn.causal_linear_attention(dq[:, ::2], dev(cuda, k[:, ::2]), dev(cuda, v[:, ::2]))


def test_too_many_features_for_shared_memory(cuda):
    """D' past what a block's shared memory holds (the state's tile, phi of a chunk) is a ValueError naming D'
    and the most that fits, raised before any launch: a GPU would refuse the launch, the simulator has no such
    limit. The most differs by kernel: causal 1534, with gates per key dimension 1022, step 2046 (float64
    shared buffers of 48 KB)."""
    rng = np.random.default_rng(7)
    taylor = linattn.feature_maps.Taylor()
    q, k, v = (dev(cuda, x) for x in qkv(rng, (1,), 3, 64, 2, np.float32))  # D' = 1 + 64 + 64 * 65 / 2 = 2145
    with pytest.raises(ValueError, match=r"D'=2145 features .* at most 1534 on the GPU"):
        linattn.causal_linear_attention(q, k, v, feature_map=taylor)
    q1, k1, v1 = (dev(cuda, x) for x in qkv(rng, (), 1, 64, 2, np.float32))  # one step of one sequence
    st = linattn.State(dev(cuda, np.zeros((1, 2145, 2), np.float32)), dev(cuda, np.zeros((1, 2145), np.float32)))
    with pytest.raises(ValueError, match=r"D'=2145 features .* at most 2046 on the GPU"):
        linattn.step(q1, k1, v1, st, feature_map=taylor)
    q, k, v = (dev(cuda, x) for x in qkv(rng, (1,), 3, 52, 2, np.float32))  # D' = 1431: fits, but not with
    gate = dev(cuda, np.zeros((1, 3, 1431), np.float32))  # a gate per key dimension
    with pytest.raises(ValueError, match=r"D'=1431 features .* at most 1022 on the GPU"):
        linattn.causal_linear_attention(q, k, v, feature_map=taylor, gate=gate)


def test_no_gpu_error():
    try:
        from numba import cuda
        if cuda.is_available():
            pytest.skip("a GPU or the simulator is available")
    except ImportError:
        pass
    q = np.ones((2, 3, 4), np.float32)
    with pytest.raises(RuntimeError, match="linattn's CUDA path needs"):
        linattn.causal_linear_attention(q, q, q, device="cuda")
    with pytest.raises(ValueError, match="device: expected None, 'cpu' or 'cuda', got 'gpu'"):
        linattn.causal_linear_attention(q, q, q, device="gpu")


def test_target_that_cannot_load_with_this_numpy():
    """numba-cuda 0.30.4 with NumPy 2.5 (np.row_stack removed) fails at its first compilation: the CUDA path
    says so, naming both versions, instead of an AttributeError from inside numba-cuda."""
    if SIM:
        pytest.skip("the simulator compiles nothing")
    pytest.importorskip("numba.cuda")
    setup = ("import numpy as np\n"
             "import linattn\n"
             "del np.row_stack  # (after Numba's own CPU target, which checks NumPy's version, has loaded)\n")
    loads = subprocess.run([sys.executable, "-c", setup + "import numba.cuda.cudaimpl\n"], capture_output=True,
                           text=True, timeout=120)
    if loads.returncode == 0:  # (seen: numba-cuda 0.30.4 beside Numba 0.62.1 and NumPy 1.24.4)
        pytest.skip("this numba-cuda loads without np.row_stack: the failure recreated here cannot happen")
    code = (setup +
            "try:\n"
            "    linattn.causal_linear_attention(*(np.ones((1, 3, 2), np.float32),) * 3, device='cuda')\n"
            "except RuntimeError as exc:\n"
            "    print('RuntimeError:', exc)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert re.search(r"RuntimeError: numba-cuda \S+ cannot compile kernels with NumPy \S+ \(AttributeError: .*"
                     r"row_stack.*\): install a NumPy that it supports", res.stdout), res.stdout


def _gate_options(rng, lead, n, d, dtype):
    g1 = -rng.random(lead + (n,)).astype(dtype)
    g2 = np.where(rng.random(lead + (n, d)) < 0.15, -np.inf, -rng.random(lead + (n, d))).astype(dtype)
    return [dict(decay=0.8), dict(gate=g1, scale=0.5), dict(gate=g2, decay=np.linspace(0.6, 1.0, lead[-1]))]


@pytest.mark.parametrize("dtype", [np.float64])
def test_gates_on_device(cuda, dtype):
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, (2,), 9, 3, 5, dtype)
    dq, dk, dv = (dev(cuda, x) for x in (q, k, v))
    for kw in _gate_options(rng, (2,), 9, 3, dtype):
        ref, st_ref = linattn.causal_linear_attention(q, k, v, return_state=True, **kw)
        out, st = linattn.causal_linear_attention(dq, dk, dv, return_state=True, **kw)
        close(out.copy_to_host(), ref, dtype)
        close(st.S.copy_to_host(), st_ref.S, dtype)
        close(st.Z.copy_to_host(), st_ref.Z, dtype)
        close(linattn.causal_linear_attention(q, k, v, device="cuda", **kw), ref, dtype)
        # prefill 6 positions on the device, then step the last 3 on the device
        part = {key: (val[:, :6] if key == "gate" else val) for key, val in kw.items()}
        _, dst = linattn.causal_linear_attention(dev(cuda, q[:, :6]), dev(cuda, k[:, :6]), dev(cuda, v[:, :6]),
                                                 return_state=True, **part)
        host_st = linattn.State(dst.S.copy_to_host(), dst.Z.copy_to_host())
        for i in range(6, 9):
            one = {key: (val[:, i] if key == "gate" else val) for key, val in kw.items()}
            o = linattn.step(dev(cuda, q[:, i]), dev(cuda, k[:, i]), dev(cuda, v[:, i]), dst, **one)
            close(o.copy_to_host(), ref[:, i], dtype)
            o = linattn.step(q[:, i], k[:, i], v[:, i], host_st, device="cuda", **one)
            close(o, ref[:, i], dtype)
    bad = np.zeros((2, 9), dtype)
    bad[1, 4] = 0.5
    with pytest.raises(ValueError, match=r"gate: expected log gates <= 0 .* at sequence \(1,\), position 4"):
        linattn.causal_linear_attention(dq, dk, dv, gate=bad)


def test_segments_plan():
    """How a head is split: none where the heads fill the width or a head is short (under 4 x ``least``
    chunks), else about ``width`` blocks in all, every chunk in exactly one segment, none shorter than
    ``least`` chunks but the last."""
    from linattn.cuda.api import segments

    assert segments(32, 128, 528, 8) == (16, 8)  # B1 H8 N2048 D64 on an H200 (132 multiprocessors)
    assert segments(4, 1024, 528, 8) == (128, 8)  # B1 H1 N16384
    assert segments(16, 1024, 528, 8) == (32, 32)  # B2 H4 N8192 D128 (two tiles of 64 columns)
    assert segments(528, 128, 528, 8) == (1, 128) and segments(4, 31, 528, 8) == (1, 31)
    assert segments(1, 33, 528, 8) == (5, 8) and segments(4, 6, 16, 1) == (3, 2) and segments(1, 0, 16, 1) == (1, 1)
    for blocks in (1, 3, 7, 40):
        for chunks in (1, 2, 5, 9, 100, 1001):
            for width, least in ((16, 1), (528, 8)):
                parts, per = segments(blocks, chunks, width, least)
                assert (parts - 1) * per < chunks <= parts * per
                assert parts == 1 or (per >= least and blocks * parts <= 2 * width)
                assert parts > 1 or chunks < 4 * least or blocks >= width


@pytest.mark.parametrize("width", [1, 16, 10**6])
def test_heads_split_into_segments(cuda, monkeypatch, width):
    """The causal forward with each head split into segments (each one's sums, their starting states
    carried through the ones before, the outputs from them) equals the CPU path for every split (a
    GPU ``width`` of 1 block: none; 10**6: one chunk a segment): with a decay, gates per position and
    per key dimension (resets included; per feature of the Taylor map), an initial state, and lengths
    that end inside a segment and before the last one; and the non-causal form (the keys' sums by
    segment, the queries' outputs by segment) with an initial state and padded keys and queries."""
    from linattn.cuda import api

    monkeypatch.setattr(api, "_width", lambda: (width, 1))
    rng = np.random.default_rng(11)
    n = 23 if SIM else 70  # six chunks of 4 in the simulator, five of 16 on a GPU
    q, k, v = qkv(rng, (2,), n, 3, 5, np.float64)
    dq, dk, dv = (dev(cuda, x) for x in (q, k, v))
    init = linattn.State(0.3 * rng.random((2, 3, 5)), rng.random((2, 3)))
    for kw in _gate_options(rng, (2,), n, 3, np.float64) + [{}, dict(initial_state=init, lengths=np.array([23, 9])),
                                                            dict(lengths=np.array([2, 14]), decay=0.9),
                                                            dict(feature_map=linattn.feature_maps.Taylor(),
                                                                 gate=-0.2 * rng.random((2, n, 10)))]:
        ref, st_ref = linattn.causal_linear_attention(q, k, v, return_state=True, **kw)
        dkw = dict(kw)
        if "initial_state" in kw:
            dkw["initial_state"] = linattn.State(dev(cuda, init.S), dev(cuda, init.Z))
        out, st = linattn.causal_linear_attention(dq, dk, dv, return_state=True, **dkw)
        close(out.copy_to_host(), ref, np.float64)
        close(st.S.copy_to_host(), st_ref.S, np.float64)
        close(st.Z.copy_to_host(), st_ref.Z, np.float64)
    # non-causal: keys (17, padded with NaN past their lengths) summed by segment, queries' outputs by segment
    kx, vx = (rng.standard_normal((2, 17, w)) * 0.6 for w in (3, 5))
    lengths, qlengths = np.array([17, 6]), np.array([23, 10])
    kp, vp = (np.where((np.arange(17) < lengths[:, None])[..., None], x, np.nan) for x in (kx, vx))
    qp = np.where((np.arange(n) < qlengths[:, None])[..., None], q, np.nan)
    for kw in ({}, dict(initial_state=init, lengths=lengths, query_lengths=qlengths)):
        args = (q, kx, vx) if not kw else (qp, kp, vp)
        ref, st_ref = linattn.linear_attention(*args, return_state=True, **kw)
        dkw = dict(kw)
        if "initial_state" in kw:
            dkw["initial_state"] = linattn.State(dev(cuda, init.S), dev(cuda, init.Z))
        out, st = linattn.linear_attention(*(dev(cuda, x) for x in args), return_state=True, **dkw)
        close(out.copy_to_host(), ref, np.float64)
        close(st.S.copy_to_host(), st_ref.S, np.float64)
        close(st.Z.copy_to_host(), st_ref.Z, np.float64)
    c, te = api.tiles(3, 5)
    parts = api.segments(2 * -(-5 // te), -(-n // c), width, 1)[0]
    assert parts == {1: 1, 16: 3 if SIM else 5, 10**6: 6 if SIM else 5}[width]


@settings(max_examples=25 if SIM else 100, deadline=None)
@given(lead=st.sampled_from([(), (2,)]), n=st.integers(1, 10), d=st.integers(1, 3), dv=st.integers(1, 3),
       f64=st.booleans(), fmap=st.sampled_from(["elu", "relu", "softplus", "taylor", "dpfp", "hedgehog"]),
       gating=st.sampled_from(["none", "decay", "position", "dimension"]), with_state=st.booleans(),
       with_lengths=st.booleans(), scale=st.sampled_from([None, 0.5]), seed=st.integers(0, 2**31),
       split=st.booleans())
def test_options_together_on_device(cuda, lead, n, d, dv, f64, fmap, gating, with_state, with_lengths, scale, seed,
                                    split):
    """The options drawn together (hypothesis) on device arrays: the output, the final state, a step after it
    and the non-causal form equal the CPU path's (which tests/test_combinations.py checks against the
    reference the same way). With ``split``, 12 positions more and every head split into segments of one
    chunk (in the simulator; cuda/api.segments)."""
    from unittest import mock

    from linattn.cuda import api

    with mock.patch.object(api, "_width", lambda: (10**6, 1) if split else (1, 1)):
        _options_on_device(cuda, lead, n + 12 * split, d, dv, f64, fmap, gating, with_state, with_lengths, scale,
                           seed)


def _options_on_device(cuda, lead, n, d, dv, f64, fmap, gating, with_state, with_lengths, scale, seed):
    rng = np.random.default_rng(seed)
    dtype = np.float64 if f64 else np.float32
    q, k, v = qkv(rng, lead, n, d, dv, dtype)
    fmap, _, kw = random_options(rng, lead, n, d, dv, dtype, fmap, gating, with_state, with_lengths, scale)
    ref, st_ref = linattn.causal_linear_attention(q, k, v, return_state=True, **kw)
    dkw = dict(kw)
    if with_state:
        dkw["initial_state"] = linattn.State(dev(cuda, kw["initial_state"].S), dev(cuda, kw["initial_state"].Z))
    out, st = linattn.causal_linear_attention(*(dev(cuda, x) for x in (q, k, v)), return_state=True, **dkw)
    close(out.copy_to_host(), ref, dtype)
    close(st.S.copy_to_host(), st_ref.S, dtype)
    close(st.Z.copy_to_host(), st_ref.Z, dtype)
    # one more position with step, from the final states (on the device, and on the host)
    extra = {key: kw[key] for key in ("feature_map", "scale", "decay") if key in kw}
    if "gate" in kw:
        extra["gate"] = kw["gate"][(Ellipsis, -1) + ((slice(None),) if gating == "dimension" else ())]
    one = [x[..., -1, :] for x in (q, k, v)]
    o = linattn.step(*(dev(cuda, x) for x in one), st, **extra)
    close(o.copy_to_host(), linattn.step(*one, st_ref, **extra), dtype)
    close(st.S.copy_to_host(), st_ref.S, dtype)
    if gating == "none" and not with_state and not with_lengths:  # and the non-causal form
        close(linattn.linear_attention(*(dev(cuda, x) for x in (q, k, v)), **kw).copy_to_host(),
              linattn.linear_attention(q, k, v, **kw), dtype)
