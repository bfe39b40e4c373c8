"""workspace: pooled scratch arrays go back to the pool when their owner is collected, and only then."""
import gc

import numpy as np
import pytest

from linattn import workspace


def test_reuse_after_the_owner_dies():
    workspace.clear()

    def owner():
        pass

    shape = (300, 500)  # (pooled from 256 KiB)
    arr = workspace.take(shape, np.float32)
    assert arr.shape == shape and arr.dtype == np.float32
    workspace.release_with(owner, arr)
    other = workspace.take(shape, np.float32)
    assert other is not arr  # still owned
    address = arr.__array_interface__["data"][0]
    del arr, owner
    gc.collect()
    again = workspace.take(shape, np.float32)
    assert again.__array_interface__["data"][0] == address  # the same memory, handed out once
    assert workspace.take(shape, np.float32).__array_interface__["data"][0] != address
    assert workspace.take(shape, np.float64).dtype == np.float64  # a new one per dtype and shape


def test_small_arrays_are_left_to_malloc():
    workspace.clear()

    def owner():
        pass

    small = workspace.take((3, 5), np.float32)
    assert small.shape == (3, 5) and small.dtype == np.float32 and small.flags.owndata  # plain np.empty
    workspace.release_with(owner, small)
    del owner, small
    gc.collect()
    assert workspace._free_bytes == 0
    a, b = workspace.take_views([(3, 5), (7,)], np.float64)
    assert a.flags.owndata and b.flags.owndata  # plain arrays
    workspace.clear()


def test_the_pool_is_bounded(monkeypatch):
    workspace.clear()
    monkeypatch.setattr(workspace, "MAX_FREE_BYTES", 100)

    def owner():
        pass

    monkeypatch.setattr(workspace, "POOL_MIN_BYTES", 10)
    workspace.release_with(owner, workspace.take((200,), np.uint8))  # too large to keep
    del owner
    gc.collect()
    assert workspace._free_bytes == 0
    workspace.clear()


def test_vjp_states_return_to_the_pool(monkeypatch):
    import linattn

    workspace.clear()
    monkeypatch.setattr(workspace, "POOL_MIN_BYTES", 1024)  # (these states are small)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 100, 4)) for _ in range(3))
    _, vjp = linattn.causal_linear_attention_vjp(q, k, v)

    def free_states():  # (the chunk states: (lead, chunks, Dv + 1, D), the other pooled blocks 1-D)
        return [key for key, arrays in workspace._free.items() if arrays and len(key[0]) == 4]

    assert workspace._free_bytes == 0
    first = vjp(np.ones((2, 100, 4)))
    del vjp
    gc.collect()
    assert free_states()
    _, vjp = linattn.causal_linear_attention_vjp(q, k, v)  # reuses them: the same gradients
    assert not free_states()
    for a, b in zip(vjp(np.ones((2, 100, 4))), first):
        np.testing.assert_array_equal(a, b)
    workspace.clear()


def _address(x):
    return x.__array_interface__["data"][0]


def _pooled(x):
    """Whether ``x`` is a view of a block from the pool (``take_views``)."""
    while x is not None and not isinstance(x, workspace._Owner):
        x = x.base
    return x is not None


def test_views_share_one_block_that_returns_when_the_last_view_dies(monkeypatch):
    workspace.clear()
    monkeypatch.setattr(workspace, "POOL_MIN_BYTES", 10)
    a, b = workspace.take_views([(3, 5), (7,)], np.float64)
    assert a.shape == (3, 5) and b.shape == (7,) and a.dtype == b.dtype == np.float64
    assert _address(a) % 64 == 0 and _address(b) % 64 == 0 and not np.may_share_memory(a, b)
    start = _address(a)
    a[...] = 1.0
    b[...] = 2.0
    tail = a[1:, ::2]  # a view of a view keeps the block too
    del a, b
    gc.collect()
    c, d = workspace.take_views([(3, 5), (7,)], np.float64)
    assert _address(c) != start  # still in use: a new block
    assert np.all(tail == 1.0)
    second = _address(c)
    del tail
    gc.collect()
    e, _ = workspace.take_views([(3, 5), (7,)], np.float64)
    assert _address(e) == start  # the first block, back with its last view
    del c, d
    gc.collect()
    assert _address(workspace.take_views([(3, 5), (7,)], np.float64)[0]) == second
    workspace.clear()


def test_large_results_are_reused_and_never_while_held():
    """Outputs and gradients of 256 KiB or more come from the pool: a result a loop drops is reused by
    the next call (no page faults), one it holds is never written again."""
    import linattn

    workspace.clear()
    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((2, 4, 2048, 16)).astype(np.float32) for _ in range(4))  # 1 MiB each
    out = linattn.causal_linear_attention(q, k, v)
    assert out.nbytes >= workspace.POOL_MIN_BYTES and not out.flags.owndata
    kept = out.copy()
    _, vjp = linattn.causal_linear_attention_vjp(q, k, v)
    grads = vjp(g)
    grads_kept = [x.copy() for x in grads]
    head = grads[0][0]  # a view alone keeps its block
    del grads
    gc.collect()
    for _ in range(2):  # new calls with other inputs while the results above are held
        linattn.causal_linear_attention(-q, k, v)
        vjp(-g)
    np.testing.assert_array_equal(out, kept)
    np.testing.assert_array_equal(head, grads_kept[0][0])
    address = _address(out)
    del out
    gc.collect()
    assert _address(linattn.causal_linear_attention(q, k, v)) == address  # dropped: reused
    small = linattn.causal_linear_attention(q[:, :, :16], k[:, :, :16], v[:, :, :16])
    assert small.flags.owndata  # below the size the pool starts at: plain np.empty
    workspace.clear()


@pytest.mark.parametrize("call", ["causal", "causal, checked path", "non-causal"])
def test_final_states_are_pooled_reused_when_dropped_and_never_while_held(call):
    """A model keeps each layer's final state until its next prompt: large states (S and Z of 256 KiB or
    more) come from the pool, so dropped ones are reused in place; a held one, or a view of it alone,
    is never written again."""
    import linattn

    workspace.clear()
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((8, 8, 40, 64)).astype(np.float32) for _ in range(3))  # S: 1 MiB
    if call == "non-causal":
        def run(sign):
            return linattn.linear_attention(sign * q, k, v, return_state=True)[1]
    else:
        extra = {"device": "cpu"} if call == "causal, checked path" else {}

        def run(sign):
            return linattn.causal_linear_attention(sign * q, k, sign * v, return_state=True, **extra)[1]
    state = run(1.0)
    S, Z = state
    assert S.shape == (8, 8, 64, 64) and Z.shape == (8, 8, 64) and _pooled(S) and _pooled(Z)
    assert S.flags.c_contiguous and S.flags.writeable and Z.flags.c_contiguous
    kept = (S.copy(), Z.copy())
    del state, Z
    gc.collect()  # S alone holds the block
    for _ in range(2):
        run(-1.0)
    np.testing.assert_array_equal(S, kept[0])
    address = _address(S)
    del S
    gc.collect()
    again = run(1.0)
    assert _address(again.S) == address  # dropped: reused
    np.testing.assert_array_equal(again.S, kept[0])
    np.testing.assert_array_equal(again.Z, kept[1])
    workspace.clear()


def test_pooled_final_states_from_concurrent_calls():
    """Python threads calling at once, each keeping some of its states and dropping the rest: every
    kept state stays what its own call computed (no two live states share a pooled block)."""
    from concurrent.futures import ThreadPoolExecutor

    import linattn

    workspace.clear()
    rng = np.random.default_rng(4)
    inputs = [tuple(rng.standard_normal((2, 8, 24, 64)).astype(np.float32) for _ in range(3)) for _ in range(6)]
    expected = [linattn.causal_linear_attention(*x, return_state=True)[1] for x in inputs]
    expected = [(s.S.copy(), s.Z.copy()) for s in expected]
    assert _pooled(linattn.causal_linear_attention(*inputs[0], return_state=True)[1].S)

    def work(i):
        kept = []
        for r in range(12):
            state = linattn.causal_linear_attention(*inputs[(i + r) % 6], return_state=True)[1]
            if r % 3 == 0:
                kept.append(((i + r) % 6, state))
        return kept

    with ThreadPoolExecutor(max_workers=6) as ex:
        results = list(ex.map(work, range(6)))
    gc.collect()
    for kept in results:
        for j, state in kept:
            np.testing.assert_array_equal(state.S, expected[j][0])
            np.testing.assert_array_equal(state.Z, expected[j][1])
    workspace.clear()


def test_the_oldest_free_arrays_go_first_and_nearby_sizes_share_blocks(monkeypatch):
    workspace.clear()
    monkeypatch.setattr(workspace, "MAX_FREE_BYTES", 3000)
    monkeypatch.setattr(workspace, "POOL_MIN_BYTES", 10)
    a, b, c = (workspace.take((1000,), np.uint8) for _ in range(3))
    for x in (a, b, c):
        workspace._release(x)
    assert workspace._free_bytes == 3000
    d = workspace.take((1500,), np.uint8)
    workspace._release(d)  # over the bound: a and b (the oldest) are dropped, c stays
    assert workspace._free_bytes == 2500
    assert workspace.take((1000,), np.uint8) is c
    workspace.clear()
    monkeypatch.setattr(workspace, "MAX_FREE_BYTES", 1 << 30)
    (x,) = workspace.take_views([(100_000,)], np.float32)
    address = _address(x)
    del x
    gc.collect()
    (y,) = workspace.take_views([(103_000,)], np.float32)  # within the same size class: the same block
    assert _address(y) == address and y.shape == (103_000,)
    workspace.clear()


def test_a_free_block_serves_requests_from_two_thirds_of_its_size(monkeypatch):
    workspace.clear()
    monkeypatch.setattr(workspace, "POOL_MIN_BYTES", 1024)
    (big,) = workspace.take_views([(300_000,)], np.uint8)
    address = _address(big)
    del big
    gc.collect()
    (tiny,) = workspace.take_views([(100_000,)], np.uint8)  # a third: a new block
    assert _address(tiny) != address
    (near,) = workspace.take_views([(220_000,)], np.uint8)  # within 2/3: the free block
    assert _address(near) == address and near.shape == (220_000,)
    workspace.clear()


@pytest.mark.parametrize("call", ["causal", "noncausal"])
def test_final_states_from_a_size_on_start_at_multiples_of_64_bytes(call):
    """A returned state of attention.ALIGNED_STATE_BYTES or more starts at a multiple of 64 bytes, S and Z
    apart (in a block of their own up to POOL_MIN_BYTES, from the pool past it); a smaller one is malloc's,
wherever that falls.
    The values are the same either way."""
    import linattn
    from linattn import attention

    fn = linattn.causal_linear_attention if call == "causal" else linattn.linear_attention
    rng = np.random.default_rng(0)
    for heads in (1, 8, 32):  # (D 64: 16 KB, 130 KB, 520 KB)
        q, k, v = (rng.standard_normal((1, heads, 10, 64)).astype(np.float32) for _ in range(3))
        _, st = fn(q, k, v, return_state=True)
        if st.S.nbytes + st.Z.nbytes >= attention.ALIGNED_STATE_BYTES:
            assert heads > 1 and st.S.ctypes.data % 64 == 0 and st.Z.ctypes.data % 64 == 0
            assert not np.shares_memory(st.S, st.Z) and st.S.flags.writeable and st.S.flags.c_contiguous
        else:
            assert heads == 1  # (malloc's, where it falls)
        _, want = fn(q, k, v, return_state=True, device="cpu")  # (the checked path: its own arrays)
        np.testing.assert_allclose(st.S, want.S, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(st.Z, want.Z, rtol=1e-5, atol=1e-6)
