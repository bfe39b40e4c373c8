"""workspace: pooled scratch arrays go back to the pool when their owner is collected, and only then."""
import gc

import numpy as np

from linattn import workspace


def test_reuse_after_the_owner_dies():
    workspace.clear()

    def owner():
        pass

    arr = workspace.take((3, 5), np.float32)
    assert arr.shape == (3, 5) and arr.dtype == np.float32
    workspace.release_with(owner, arr)
    other = workspace.take((3, 5), np.float32)
    assert other is not arr  # still owned
    address = arr.__array_interface__["data"][0]
    del arr, owner
    gc.collect()
    again = workspace.take((3, 5), np.float32)
    assert again.__array_interface__["data"][0] == address  # the same memory, handed out once
    assert workspace.take((3, 5), np.float32).__array_interface__["data"][0] != address
    assert workspace.take((3, 5), np.float64).dtype == np.float64  # a new one per dtype and shape


def test_the_pool_is_bounded(monkeypatch):
    workspace.clear()
    monkeypatch.setattr(workspace, "MAX_FREE_BYTES", 100)

    def owner():
        pass

    workspace.release_with(owner, workspace.take((200,), np.uint8))  # too large to keep
    del owner
    gc.collect()
    assert workspace._free_bytes == 0
    workspace.clear()


def test_vjp_states_return_to_the_pool():
    import linattn

    workspace.clear()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 100, 4)) for _ in range(3))
    _, vjp = linattn.causal_linear_attention_vjp(q, k, v)
    assert workspace._free_bytes == 0
    first = vjp(np.ones((2, 100, 4)))
    del vjp
    gc.collect()
    assert workspace._free_bytes > 0
    _, vjp = linattn.causal_linear_attention_vjp(q, k, v)  # reuses them: the same gradients
    assert workspace._free_bytes == 0
    for a, b in zip(vjp(np.ones((2, 100, 4))), first):
        np.testing.assert_array_equal(a, b)
    workspace.clear()
