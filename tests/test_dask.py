"""linattn on Dask arrays: equal to one NumPy call for chunks along every axis, with state, lengths and
gates, on the threaded scheduler and on a two-process LocalCluster; errors at graph construction; a
task graph that grows linearly with the number of blocks."""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn

from conftest import assert_close, random_options

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    environ = dict(os.environ)  # a LocalCluster's nanny sets its workers' variables in this process too
    with dask.config.set(linattn.dask.worker_settings(1)):
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1",
                                           dashboard_address=None, processes=True)
    c = distributed.Client(cluster)
    yield c
    c.close()
    cluster.close()
    os.environ.clear()
    os.environ.update(environ)


def _qkv(rng, lead, n, d, dv, dtype=np.float64):
    q, k = ((rng.standard_normal(lead + (n, d)) * 0.5).astype(dtype) for _ in range(2))
    return q, k, rng.standard_normal(lead + (n, dv)).astype(dtype)


def _lazy(x, chunks):
    return da.from_array(x, chunks=chunks)


CHUNKINGS = {  # (B, H, N, D) chunks; v takes the same with its Dv
    "one block": (2, 3, 200, 5),
    "lead dims": (1, 2, 200, 5),
    "along N, uneven": (2, 3, (1, 63, 65, 71), 5),
    "both": (1, 1, (100, 100), 5),
    "positions of one": (2, 3, (1,) * 200, 5),
    "D and Dv split": (2, 3, 50, 2),
}


def _chunks_v(ch, dv):
    return ch[:-1] + ((dv // 2, dv - dv // 2) if ch[-1] == 2 else dv,)


@pytest.mark.parametrize("name", list(CHUNKINGS))
def test_causal_matches_numpy(rng, name):
    lead, n, d, dv = (2, 3), 200, 5, 4
    q, k, v = _qkv(rng, lead, n, d, dv)
    ch = CHUNKINGS[name]
    if name == "positions of one":  # a graph of 200 blocks per sequence: keep it to the scheduler in-process
        q, k, v = q[:, :1, :40], k[:, :1, :40], v[:, :1, :40]
        ch = (2, 1, (1,) * 40, 5)
    gate = -rng.random(q.shape[:-1])
    gate[..., 17] = -np.inf  # a reset
    lengths = np.array([q.shape[-2], q.shape[-2] - 13])
    S0, Z0 = rng.random(q.shape[:-2] + (d, dv)), rng.random(q.shape[:-2] + (d,))
    kw = dict(gate=gate, decay=0.9, lengths=lengths, initial_state=linattn.State(S0, Z0), return_state=True)
    with dask.config.set(scheduler="threads"):
        out, st = linattn.causal_linear_attention(_lazy(q, ch), _lazy(k, ch), _lazy(v, _chunks_v(ch, dv)), **kw)
        assert isinstance(out, da.Array) and isinstance(st.S, da.Array) and isinstance(st.Z, da.Array)
        ref, st_ref = linattn.causal_linear_attention(q, k, v, **kw)
        assert_close(out.compute(), ref, np.float64)
        assert_close(st.S.compute(), st_ref.S, np.float64)
        assert_close(st.Z.compute(), st_ref.Z, np.float64)
        plain = linattn.causal_linear_attention(_lazy(q, ch), _lazy(k, ch), _lazy(v, _chunks_v(ch, dv)))
        assert_close(plain.compute(), linattn.causal_linear_attention(q, k, v), np.float64)


@pytest.mark.parametrize("option", ["gate per dim", "decay per head", "feature map", "scale, no normaliser"])
def test_options_across_blocks(rng, option):
    lead, n, d, dv = (2, 3), 150, 4, 3
    q, k, v = _qkv(rng, lead, n, d, dv)
    kw = {"gate per dim": dict(gate=-rng.random(lead + (n, d)) * 0.5),
          "decay per head": dict(decay=np.array([0.5, 0.9, 0.99])),
          "feature map": dict(feature_map=linattn.feature_maps.Taylor(), gate=-rng.random(lead + (n,)) * 0.1),
          "scale, no normaliser": dict(scale=0.3, normalize=False, feature_map="identity")}[option]
    ch = (1, 3, (40, 40, 70), d)
    with dask.config.set(scheduler="threads"):
        out = linattn.causal_linear_attention(_lazy(q, ch), k, v, **kw).compute()  # k, v: NumPy, wrapped
    assert_close(out, linattn.causal_linear_attention(q, k, v, **kw), np.float64)


def test_views_of_a_dask_projection(rng):
    """Heads sliced out of one dask array (a fused QKV projection) and a gate computed in dask: the
    second pass's copy of their graphs computes them again."""
    x = rng.standard_normal((2, 120, 3, 4, 8))
    qkv = da.from_array(x, chunks=(1, 40, 3, 4, 8))
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    gate = -da.random.default_rng(1).random((2, 4, 120), chunks=(1, 2, 40))[:, :, ::-1]
    with dask.config.set(scheduler="sync"):
        out, st = linattn.causal_linear_attention(q, k, v, gate=gate, return_state=True)
        out, S, g = dask.compute(out, st.S, gate)
    ref, st_ref = linattn.causal_linear_attention(*(x[:, :, i].transpose(0, 2, 1, 3) for i in range(3)), gate=g,
                                                  return_state=True)
    assert_close(out, ref, np.float64)
    assert_close(S, st_ref.S, np.float64)


def test_float32_and_noncausal(rng):
    q, k, v = _qkv(rng, (2,), 300, 8, 6, np.float32)
    ch = (1, (100, 120, 80), 8)
    with dask.config.set(scheduler="threads"):
        out = linattn.causal_linear_attention(_lazy(q, ch), _lazy(k, ch), _lazy(v, (1, (100, 120, 80), 6)))
        assert out.dtype == np.float32
        assert_close(out.compute(), linattn.causal_linear_attention(q, k, v), np.float32)
        for kw in ({}, dict(feature_map="relu", scale=0.5), dict(normalize=False)):
            nc = linattn.linear_attention(_lazy(q, ch), _lazy(k, ch), v, **kw)
            assert isinstance(nc, da.Array) and nc.dtype == np.float32
            assert_close(nc.compute(), linattn.linear_attention(q, k, v, **kw), np.float32)


@pytest.mark.parametrize("q_chunks, kv_chunks", [((1, (20, 30), 4), None), (None, (1, (30, 40), 4)),
                                                 ((2, (10,) * 5, 4), (1, (69, 1), 4)), ((1, 50, 4), (2, 70, 2))])
def test_cross_attention(rng, q_chunks, kv_chunks):
    """Keys and values of another length than the queries, each side chunked its own way along N (or
    NumPy), with a map with parameters and a callable."""
    q = rng.standard_normal((2, 50, 4))
    k, v = rng.standard_normal((2, 70, 4)), rng.standard_normal((2, 70, 3))
    lq = q if q_chunks is None else _lazy(q, q_chunks)
    lk, lv = (k, v) if kv_chunks is None else (_lazy(k, kv_chunks), _lazy(v, kv_chunks[:-1] + (3,)))
    for kw in ({}, dict(feature_map=linattn.feature_maps.Taylor(), scale=0.5),
               dict(feature_map=lambda x: np.maximum(x, 0) + 0.1, normalize=False)):
        out = linattn.linear_attention(lq, lk, lv, **kw)
        assert isinstance(out, da.Array) and out.shape == (2, 50, 3)
        assert_close(out.compute(scheduler="threads"), linattn.linear_attention(q, k, v, **kw), np.float64)
    with pytest.raises(ValueError, match="v: expected the keys' length 70 like k"):
        linattn.linear_attention(lq, lk, v[:, :69])
    with pytest.raises(ValueError, match="k: expected sequence length N=50 like q"):
        linattn.causal_linear_attention(lq, lk, lv)


def test_noncausal_state(rng):
    """linear_attention's initial_state / return_state on dask arrays: keys in pieces, a dask or NumPy state,
    queries over the state alone (k, v None), against NumPy; and a causal call whose only dask array is its
    initial state."""
    q, k, v = rng.standard_normal((2, 3, 40, 5)), rng.standard_normal((2, 3, 70, 5)), rng.standard_normal((2, 3, 70, 4))
    S0 = linattn.State(rng.random((2, 3, 5, 4)), rng.random((2, 3, 5)) + 0.5)
    want, st_want = linattn.linear_attention(q, k, v, initial_state=S0, return_state=True)
    lazy_state = linattn.State(_lazy(S0.S, (1, 3, 5, 4)), S0.Z)
    for args, state in (((_lazy(q, (1, 2, 15, 5)), k, v), S0), ((q, _lazy(k, (2, 1, 30, 5)), v), S0),
                        ((q, k, v), lazy_state)):
        out, st = linattn.linear_attention(*args, initial_state=state, return_state=True)
        assert isinstance(out, da.Array) and isinstance(st.S, da.Array) and st.S.dtype == np.float64
        assert_close(out.compute(), want, np.float64)
        assert_close(st.S.compute(), st_want.S, np.float64)
        assert_close(st.Z.compute(), st_want.Z, np.float64)
    keyless = linattn.linear_attention(_lazy(q, (1, 2, 15, 5)), initial_state=st_want)
    assert_close(keyless.compute(), linattn.linear_attention(q, initial_state=st_want), np.float64)
    lengths = np.array([70, 31])  # right-padded keys (NaN past each length), the lengths inside blocks
    kp, vp = (np.where((np.arange(70) < lengths[:, None, None])[..., None], x, np.nan) for x in (k, v))
    want, st_want = linattn.linear_attention(q, kp, vp, lengths=lengths, initial_state=S0, return_state=True)
    out, st = linattn.linear_attention(q, _lazy(kp, (1, 3, 20, 5)), _lazy(vp, (2, 1, 35, 4)), lengths=lengths,
                                       initial_state=S0, return_state=True)
    assert_close(out.compute(), want, np.float64)
    assert_close(st.S.compute(), st_want.S, np.float64)
    qlengths = np.array([[40, 0, 17], [16, 15, 1]])  # and right-padded queries, their lengths inside blocks
    qp = np.where((np.arange(40) < qlengths[..., None])[..., None], q, np.nan)
    want = linattn.linear_attention(qp, kp, vp, lengths=lengths, query_lengths=qlengths)
    out = linattn.linear_attention(_lazy(qp, (1, 2, 15, 5)), _lazy(kp, (1, 3, 20, 5)), vp, lengths=lengths,
                                   query_lengths=qlengths).compute()
    assert_close(out, want, np.float64)
    np.testing.assert_array_equal(out[np.isnan(qp[..., 0])], 0)
    S1 = linattn.State(rng.random((2, 3, 5, 5)), rng.random((2, 3, 5)) + 0.5)
    out, st = linattn.causal_linear_attention(q, q, q, initial_state=linattn.State(_lazy(S1.S, (1, 3, 5, 5)), S1.Z),
                                              return_state=True)
    out_np, st_np = linattn.causal_linear_attention(q, q, q, initial_state=S1, return_state=True)
    assert isinstance(out, da.Array)
    assert_close(out.compute(), out_np, np.float64)
    assert_close(st.S.compute(), st_np.S, np.float64)


def test_on_a_local_cluster(client, rng):
    """Processes: the kernels are pickled to the workers and compiled or loaded there."""
    lead, n, d, dv = (2, 2), 400, 8, 8
    q, k, v = _qkv(rng, lead, n, d, dv)
    gate = -rng.random(lead + (n,)) * 0.2
    ch = (1, 2, (150, 150, 100), d)
    out, st = linattn.causal_linear_attention(_lazy(q, ch), _lazy(k, ch), _lazy(v, ch), gate=gate,
                                              lengths=np.array([400, 321]), return_state=True)
    res, S = client.compute([out, st.S], sync=True)
    ref, st_ref = linattn.causal_linear_attention(q, k, v, gate=gate, lengths=np.array([400, 321]), return_state=True)
    assert_close(res, ref, np.float64)
    assert_close(S, st_ref.S, np.float64)
    nc = client.compute(linattn.linear_attention(_lazy(q, ch), _lazy(k, ch), _lazy(v, ch)), sync=True)
    assert_close(nc, linattn.linear_attention(q, k, v), np.float64)
    assert set(client.run(lambda: os.environ.get("LINATTN_NUM_THREADS")).values()) == {"1"}  # worker_settings

    def kernel_threads():
        from linattn.cpu import runtime

        return runtime.num_threads()

    assert set(client.run(kernel_threads).values()) == {1}  # linattn's kernels run on one thread there


def test_task_count_grows_linearly(rng):
    q, k, v = _qkv(rng, (1,), 4096, 4, 4)
    counts = []
    for blocks in (4, 8, 16, 32):
        c = (1, 4096 // blocks, 4)
        out, st = linattn.causal_linear_attention(_lazy(q, c), _lazy(k, c), _lazy(v, c), return_state=True)
        counts.append(len(dict(out.__dask_graph__())))
    steps = np.diff(counts) / np.diff([4, 8, 16, 32])
    assert np.allclose(steps, steps[0]), counts  # the same number of tasks per block, whatever P
    assert steps[0] <= 16, counts


def test_leading_dims_only_is_one_task_per_block(rng):
    q, k, v = _qkv(rng, (4, 2), 100, 4, 3)
    S0, Z0 = rng.random((4, 2, 4, 3)), rng.random((4, 2, 4))
    kw = dict(gate=-rng.random((4, 2, 100, 4)), decay=0.9, lengths=np.array([100, 3, 0, 50]),
              initial_state=linattn.State(S0, Z0), feature_map="relu")
    c = (1, 2, 100, 4)
    out = linattn.causal_linear_attention(_lazy(q, c), _lazy(k, c), _lazy(v, (1, 2, 100, 3)), **kw)
    blocks = [key for key in dict(out.__dask_graph__()) if key[0] == out.name]
    assert len(blocks) == 4
    layers = {name.rsplit("-", 1)[0] for name in out.__dask_graph__().layers}
    assert not layers & {"local", "cumulative", "block"}, layers  # no passes, no scan: the inputs and one call
    with dask.config.set(scheduler="threads"):
        assert_close(out.compute(), linattn.causal_linear_attention(q, k, v, **kw), np.float64)


def test_empty_sequences_keep_the_state(rng):
    q, k, v = (np.zeros((2, 0, 3)) for _ in range(3))
    state = linattn.State(rng.random((2, 3, 3)), rng.random((2, 3)))
    out, st = linattn.causal_linear_attention(_lazy(q, (1, 1, 3)), k, v, initial_state=state, return_state=True)
    assert isinstance(out, da.Array) and isinstance(st.S, da.Array) and out.shape == (2, 0, 3)
    np.testing.assert_array_equal(st.S.compute(), state.S)
    np.testing.assert_array_equal(st.Z.compute(), state.Z)


def test_errors_at_graph_construction(rng):
    q, k, v = _qkv(rng, (2,), 50, 4, 3)
    lq = _lazy(q, (1, 25, 4))
    with pytest.raises(ValueError, match="k: expected sequence length N=50"):
        linattn.causal_linear_attention(lq, k[:, :40], v)
    with pytest.raises(ValueError, match="eps: expected a finite number"):
        linattn.causal_linear_attention(lq, k, v, eps=-1.0)
    with pytest.raises(ValueError, match="gate: expected shape"):
        linattn.causal_linear_attention(lq, k, v, gate=_lazy(np.zeros((2, 49)), (1, 49)))
    with pytest.raises(ValueError, match="lengths: expected values in"):
        linattn.causal_linear_attention(lq, k, v, lengths=np.array([60, 1]))
    with pytest.raises(ValueError, match=r"initial_state.S: expected shape"):
        linattn.causal_linear_attention(lq, k, v, initial_state=linattn.State(np.zeros((2, 3, 3)), np.zeros((2, 4))))
    with pytest.raises(TypeError, match="out, device: not available with dask arrays"):
        linattn.causal_linear_attention(lq, k, v, out=np.empty((2, 50, 3)))
    with pytest.raises(TypeError, match="decay"):
        linattn.linear_attention(lq, k, v, decay=0.9)
    with pytest.raises(ValueError, match="feature_map: unknown name"):
        linattn.linear_attention(lq, k, v, feature_map="tanh")
    with pytest.raises(ValueError, match="threads: expected an integer >= 1"):
        linattn.dask.worker_settings(0)
    bad = linattn.causal_linear_attention(lq, k, v, gate=np.full((2, 50), 0.5))  # values: found when computed
    with pytest.raises(ValueError, match="gate: expected log gates <= 0"):
        bad.compute(scheduler="sync")


def test_importing_linattn_does_not_import_dask():
    code = "import sys, linattn; linattn.causal_linear_attention; print('dask' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "False", res.stdout + res.stderr


@settings(max_examples=40, deadline=None)
@given(lead=st.sampled_from([(), (2,), (2, 2)]), n=st.integers(1, 40), d=st.integers(1, 4), dv=st.integers(1, 3),
       f64=st.booleans(), fmap=st.sampled_from(["elu", "relu", "softplus", "taylor", "dpfp", "hedgehog"]),
       gating=st.sampled_from(["none", "decay", "position", "dimension", "decay+position"]),
       with_state=st.booleans(), with_lengths=st.booleans(), scale=st.sampled_from([None, 0.5]),
       cuts=st.lists(st.integers(1, 39), max_size=4), lead_chunk=st.booleans(), seed=st.integers(0, 2**31))
def test_options_and_chunks_together(lead, n, d, dv, f64, fmap, gating, with_state, with_lengths, scale, cuts,
                                     lead_chunk, seed):
    """The options drawn together with random chunks along N (and the leading dims): the dask result and
    final state equal one NumPy call's."""
    rng = np.random.default_rng(seed)
    dtype = np.float64 if f64 else np.float32
    q, k, v = _qkv(rng, lead, n, d, dv, dtype)
    fmap, _, kw = random_options(rng, lead, n, d, dv, dtype, fmap, gating, with_state, with_lengths, scale)
    bounds = sorted({c for c in cuts if c < n})
    along_n = tuple(np.diff([0] + bounds + [n]))
    lead_chunks = tuple(1 if lead_chunk else s for s in lead)
    lazy = [_lazy(x, lead_chunks + (along_n, x.shape[-1])) for x in (q, k, v)]
    lazy_kw = dict(kw)
    if "gate" in kw:
        g = kw["gate"]
        lazy_kw["gate"] = _lazy(g, lead_chunks + (along_n,) + g.shape[len(lead) + 1:])
    ref, st_ref = linattn.causal_linear_attention(q, k, v, return_state=True, **kw)
    out, st = linattn.causal_linear_attention(*lazy, return_state=True, **lazy_kw)
    assert_close(out.compute(), ref, dtype)
    assert_close(st.S.compute(), st_ref.S, dtype)
    assert_close(st.Z.compute(), st_ref.Z, dtype)
