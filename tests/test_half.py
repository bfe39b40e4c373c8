"""cpu/half.py: float16 <-> float32 conversions, bit for bit NumPy's."""
import numpy as np
import pytest

from linattn.cpu import half


def _bits(x):
    return x.view(np.uint16 if x.dtype == np.float16 else np.uint32)


def test_every_float16_to_float32():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)  # every bit pattern
    got = half.astype(h, np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(_bits(got), _bits(h.astype(np.float32)))
    assert half._to_single_kernel._compiled  # (the compiled loop ran, not NumPy's astype)


def test_float32_to_float16_rounds_as_numpy(rng):
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    finite = np.sort(every[np.isfinite(every)])
    mids = (finite[:-1].astype(np.float64) + finite[1:]) / 2  # ties (to even) and their neighbours
    near = np.concatenate([mids.astype(np.float32), np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
                           np.nextafter(mids.astype(np.float32), np.float32(-np.inf))])
    random_bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([65504, 65519.99, 65520, 65536, 1e10, np.inf, -np.inf, 2.0 ** -24, 2.0 ** -25, 2.0 ** -26,
                      2.0 ** -14, 5.96e-8, -0.0, 0.0], np.float32)
    nans = np.array([0x7FC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF, 0x7F802000], np.uint32).view(np.float32)
    for x in (every, near, random_bits, edges, nans):
        got = half.astype(np.ascontiguousarray(np.resize(x, max(x.size, half.MIN_VALUES))), np.float16)
        with np.errstate(over="ignore"):  # (NumPy warns where a value overflows to inf)
            want = np.resize(x, max(x.size, half.MIN_VALUES)).astype(np.float16)
        assert got.dtype == np.float16
        np.testing.assert_array_equal(_bits(got), _bits(want))
    assert half._to_half_kernel._compiled


def test_other_conversions_are_numpys(rng):
    x = rng.standard_normal((3, 5000)).astype(np.float16)
    cases = ((x, np.float64), (x[:, ::2], np.float32), (x[:, :10], np.float32), (x.astype(np.float32), np.float32))
    for src, dt in cases:
        got = half.astype(src, dt)
        assert got.dtype == dt
        np.testing.assert_array_equal(got, src.astype(dt))
    same = x.astype(np.float32)
    assert half.astype(same, np.float32) is same  # (copy=False, as NumPy)


def test_float16_inputs_compute_in_float32(rng):
    """float16 inputs large enough for the compiled conversions: the float32 computation's results
    (output, gradients) rounded to float16 once."""
    import linattn

    q, k, v = (rng.standard_normal((2, 3, 700, 8)).astype(np.float16) for _ in range(3))
    wide = tuple(x.astype(np.float32) for x in (q, k, v))
    for fn in (linattn.causal_linear_attention, linattn.linear_attention):
        got = fn(q, k, v)
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, fn(*wide).astype(np.float16))
    g = rng.standard_normal(v.shape).astype(np.float16)
    out, vjp = linattn.causal_linear_attention_vjp(q, k, v)
    out32, vjp32 = linattn.causal_linear_attention_vjp(*wide)
    np.testing.assert_array_equal(out, out32.astype(np.float16))
    for a, b in zip(vjp(g), vjp32(g.astype(np.float32))):
        assert a.dtype == np.float16
        np.testing.assert_array_equal(a, b.astype(np.float16))


def test_float16_calls_take_the_short_path(rng, monkeypatch):
    """float16 q, k and v with the sequence functions' options take their short path (the checked path, patched
    to fail, is not reached): the same bits as the checked path (reached with ``device="cpu"``), a float32 state
    in and out, a float16 result (written into ``out=``, a strided view included)."""
    import linattn
    from linattn import attention

    def calls(n):
        q, k, v = (rng.standard_normal((2, 3, n, 8)).astype(np.float16) for _ in range(3))
        st = linattn.causal_linear_attention(*(x.astype(np.float32) for x in (q, k, v)), return_state=True)[1]
        gate = -np.abs(rng.standard_normal((2, 3, n))).astype(np.float16)
        lens = np.array([n, n // 2])
        causal, noncausal = linattn.causal_linear_attention, linattn.linear_attention
        return [(causal, (q, k, v), {}), (causal, (q, k, v), dict(return_state=True)),
                (causal, (q, k, v), dict(initial_state=st, return_state=True, scale=0.5)),
                (causal, (q, k, v), dict(gate=gate, decay=0.9, lengths=lens)),
                (causal, (q, k, v), dict(feature_map="relu", normalize=False)),
                (noncausal, (q, k, v), dict(return_state=True)),
                (noncausal, (q, k, v), dict(lengths=lens, query_lengths=lens, initial_state=st))]

    for n in (20, 300):  # (300: the compiled conversions, from 1024 values)
        cases = calls(n)
        want = [fn(*args, device="cpu", **kw) for fn, args, kw in cases]
        with monkeypatch.context() as m:
            m.setattr(attention, "_prepare", lambda *a, **k: pytest.fail("the checked path"))
            for (fn, args, kw), w in zip(cases, want):
                got = fn(*args, **kw)
                out, w_out = (got[0], w[0]) if kw.get("return_state") else (got, w)
                assert out.dtype == np.float16
                np.testing.assert_array_equal(out, w_out)
                if kw.get("return_state"):
                    assert got[1].S.dtype == np.float32
                    np.testing.assert_array_equal(got[1].S, w[1].S)
                    np.testing.assert_array_equal(got[1].Z, w[1].Z)
                buf = np.zeros((2, n, 3, 8), np.float16)
                res = fn(*args, out=buf.transpose(0, 2, 1, 3), **kw)
                assert (res[0] if kw.get("return_state") else res).base is buf
                np.testing.assert_array_equal(buf.transpose(0, 2, 1, 3), w_out)
        with pytest.raises(ValueError, match="out"):  # (a float32 out for a float16 result)
            cases[0][0](*cases[0][1], out=np.zeros((2, 3, n, 8), np.float32))
