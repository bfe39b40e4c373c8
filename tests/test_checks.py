"""Bad input gets a ValueError or TypeError that names the argument and says what was expected."""
import numpy as np
import pytest

import linattn

F = np.float32


def qkv(lead=(2,), n=5, d=3, dv=4, dtype=F):
    return (np.ones(lead + (n, d), dtype), np.ones(lead + (n, d), dtype), np.ones(lead + (n, dv), dtype))


BOTH = [linattn.causal_linear_attention, linattn.linear_attention]


@pytest.mark.parametrize("fn", BOTH)
def test_shapes(fn):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k: expected leading dimensions \(2,\)"):
        fn(q, k[None], v)
    with pytest.raises(ValueError, match=r"v: expected leading dimensions"):
        fn(q, k, v[:1])
    if fn is linattn.causal_linear_attention:
        with pytest.raises(ValueError, match=r"k: expected sequence length N=5 like q, got 4 .*linear_attention"):
            fn(q, k[:, :4], v[:, :4])
        with pytest.raises(ValueError, match=r"v: expected sequence length N=5"):
            fn(q, k, v[:, :4])
    else:  # keys and values may have another length than the queries (cross-attention), not each other's
        with pytest.raises(ValueError, match=r"v: expected the keys' length 4 like k .*got 5"):
            fn(q, k[:, :4], v)
        with pytest.raises(ValueError, match=r"v: expected the keys' length 5 like k .*got 4"):
            fn(q, k, v[:, :4])
    with pytest.raises(ValueError, match=r"k: expected feature dimension D=3"):
        fn(q, k[..., :2], v)
    with pytest.raises(ValueError, match=r"q: expected at least 2 dimensions"):
        fn(q[0, 0], k, v)
    with pytest.raises(ValueError, match=r"v: expected at least 2 dimensions"):
        fn(q, k, np.float32(1.0))
    with pytest.raises(ValueError, match=r"q: expected a feature dimension D >= 1"):
        fn(q[..., :0], k[..., :0], v)
    with pytest.raises(ValueError, match=r"v: expected a value dimension Dv >= 1"):
        fn(q, k, v[..., :0])


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("bad,kind", [(np.bool_, "bool"), (np.complex64, "complex"), (object, "object"),
                                      (np.str_, "string"), ("datetime64[s]", "datetime")])
def test_dtypes(fn, bad, kind):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"v: expected a real floating or integer array, got dtype .*{kind}"):
        fn(q, k, v.astype(bad) if bad is not np.str_ else v.astype(str))


@pytest.mark.parametrize("fn", BOTH)
def test_not_arrays(fn):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q: expected an array-like of numbers"):
        fn([[1.0, 2.0], [3.0]], k, v)
    with pytest.raises(TypeError, match="k: expected a real floating or integer array"):
        fn(q, "abc", v)


@pytest.mark.parametrize("fn", BOTH)
def test_feature_map(fn):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"feature_map: unknown name .softmax.; expected one of .elu., .relu., .identity"):
        fn(q, k, v, feature_map="softmax")
    with pytest.raises(TypeError, match="feature_map: expected a name"):
        fn(q, k, v, feature_map=3)
    with pytest.raises(ValueError, match=r"feature_map: expected the callable to map q to shape \(2, 5, D'\)"):
        fn(q, k, v, feature_map=lambda x: x[..., :4, :])
    calls = []

    def first_call_doubles(x):  # maps q to D'=6 but k to D'=3
        calls.append(1)
        return np.concatenate([x, x], -1) if len(calls) == 1 else x

    with pytest.raises(ValueError, match=r"feature_map: expected the callable to map k to shape \(2, 5, 6\)"):
        fn(q, k, v, feature_map=first_call_doubles)
    with pytest.raises(TypeError, match=r"feature_map\(q\): expected a real floating or integer array"):
        fn(q, k, v, feature_map=lambda x: x.astype(bool))
    with pytest.raises(ValueError, match=r"feature_map: expected the callable to map q"):
        fn(q, k, v, feature_map=lambda x: x[..., :0])


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("eps,exc,msg", [(-1e-3, ValueError, "eps: expected a finite number >= 0, got -0.001"),
                                         (np.inf, ValueError, "eps: expected a finite number >= 0, got inf"),
                                         (np.nan, ValueError, "eps: expected a finite number >= 0, got nan"),
                                         ("1e-6", TypeError, "eps: expected a real number >= 0, got str"),
                                         (None, TypeError, "eps: expected a real number >= 0, got NoneType"),
                                         (True, TypeError, "eps: expected a real number >= 0, got bool")])
def test_eps(fn, eps, exc, msg):
    with pytest.raises(exc, match=msg):
        fn(*qkv(), eps=eps)


def test_flags():
    with pytest.raises(TypeError, match="normalize: expected True or False, got str"):
        linattn.linear_attention(*qkv(), normalize="yes")
    with pytest.raises(TypeError, match="return_state: expected True or False, got int"):
        linattn.causal_linear_attention(*qkv(), return_state=1)


def test_state():
    q, k, v = qkv()
    good = linattn.State(np.zeros((2, 3, 4), F), np.zeros((2, 3), F))
    linattn.causal_linear_attention(q, k, v, initial_state=good)
    with pytest.raises(TypeError, match=r"initial_state: expected a linattn.State \(S, Z\), got ndarray"):
        linattn.causal_linear_attention(q, k, v, initial_state=good.S)
    with pytest.raises(ValueError, match=r"initial_state.S: expected shape \(2, 3, 4\)"):
        linattn.causal_linear_attention(q, k, v, initial_state=(good.S[:1], good.Z))
    with pytest.raises(ValueError, match=r"initial_state.Z: expected shape \(2, 3\)"):
        linattn.causal_linear_attention(q, k, v, initial_state=(good.S, good.Z[:, :2]))
    with pytest.raises(TypeError, match="initial_state.S: expected dtype float32 .* got float64"):
        linattn.causal_linear_attention(q, k, v, initial_state=(good.S.astype(np.float64), good.Z))
    with pytest.raises(TypeError, match="initial_state.Z: expected an array, got list"):
        linattn.causal_linear_attention(q, k, v, initial_state=(good.S, [0, 0, 0]))
    # a state from a callable feature map has D' columns
    fm = lambda x: np.concatenate([x, x], -1) ** 2  # noqa: E731
    with pytest.raises(ValueError, match=r"initial_state.S: expected shape \(2, 6, 4\)"):
        linattn.causal_linear_attention(q, k, v, feature_map=fm, initial_state=good)


def test_state_zeros():
    st = linattn.State.zeros(3, 4, 5, np.float64)
    assert st.S.shape == (3, 4, 5) and st.Z.shape == (3, 4) and st.S.dtype == np.float64
    for st in (st, linattn.State.zeros((2, 8), 64, 64), linattn.State.zeros((), 3, 1, np.float32),
               linattn.State.zeros((0, 2), 3, 4)):
        # zeros, C-contiguous and writable, S and Z apart, each at a multiple of 64 bytes (step's vectors then
        # never straddle two cache lines)
        assert not st.S.any() and not st.Z.any() and st.S.flags.c_contiguous and st.Z.flags.c_contiguous
        assert st.S.flags.writeable and st.Z.flags.writeable and not np.shares_memory(st.S, st.Z)
        assert st.S.ctypes.data % 64 == 0 and st.Z.ctypes.data % 64 == 0
    assert linattn.State.zeros((), 2, 2).S.shape == (2, 2)
    with pytest.raises(TypeError, match="batch_shape: expected a tuple of ints"):
        linattn.State.zeros((2.5,), 4, 5)
    with pytest.raises(ValueError, match="batch_shape: expected non-negative sizes"):
        linattn.State.zeros((-1,), 4, 5)
    with pytest.raises(ValueError, match="d_k: expected an int >= 1, got 0"):
        linattn.State.zeros((2,), 0, 5)
    with pytest.raises(TypeError, match="d_v: expected an int, got float"):
        linattn.State.zeros((2,), 3, 5.0)
    with pytest.raises(TypeError, match="dtype: expected float32 or float64, got int32"):
        linattn.State.zeros((2,), 3, 5, np.int32)
    # bools, and containers that are no shape, are not taken for sizes
    for bad in (True, (2, False), {2: 3}, b"ab", {2}, "2"):
        with pytest.raises(TypeError, match="batch_shape: expected a tuple of ints"):
            linattn.State.zeros(bad, 4, 5)
    with pytest.raises(TypeError, match="d_k: expected an int, got bool"):
        linattn.State.zeros((2,), True, 5)
    assert linattn.State.zeros([2, np.int64(3)], 4, 5).S.shape == (2, 3, 4, 5)
    assert linattn.State.zeros(np.array([2, 3]), 4, 5).Z.shape == (2, 3, 4)
