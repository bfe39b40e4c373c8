"""``view_as``: an array under another shape as a view, or None where its strides allow none, found from
the strides alone.

NumPy has no cheap way to ask: assigning ``.shape`` builds the reshaped copy before it raises (NumPy 2.4,
a B8 H8 N512 D64 float32 head view of a fused projection: 8 MB, 0.19 ms a try; the causal call tried 12
splits of q, k, v and its result, 2.3 ms of a 5.2 ms call), ``reshape`` returns that copy, and
``reshape(copy=False)`` exists only from NumPy 2.1.
"""


def _no_copy(shape, strides, new):
    """Whether an array of ``shape`` and ``strides`` reshapes (C order) to ``new`` without a copy:
    NumPy's rule (``_attempt_nocopy_reshape``): each run of old dims that makes up a run of new dims
    must be contiguous within itself (dims of size 1 left out)."""
    old = [(n, s) for n, s in zip(shape, strides) if n != 1]
    dims = [n for n in new if n != 1]
    if len(old) == len(dims) and all(n == d for (n, _), d in zip(old, dims)):
        return True  # only dims of 1 come or go
    oi = ni = 0
    while oi < len(old) and ni < len(dims):
        oj, nj = oi + 1, ni + 1
        op, np_ = old[oi][0], dims[ni]
        while op != np_:
            if np_ < op:
                np_ *= dims[nj]
                nj += 1
            else:
                op *= old[oj][0]
                oj += 1
        for a in range(oi, oj - 1):
            if old[a][1] != old[a + 1][0] * old[a + 1][1]:
                return False
        oi, ni = oj, nj
    return True


def view_as(x, shape):
    """``x`` (a NumPy array) reshaped to ``shape`` (a tuple of as many elements) as a view of the same
    memory, or None where its strides allow no view. Nothing is copied, not even to find out."""
    if x.shape == shape:
        return x
    if x.size == 0 or x.flags.c_contiguous:
        return x.reshape(shape)
    if not _no_copy(x.shape, x.strides, shape):
        return None
    view = x.view()
    view.shape = shape  # (in place on the view: this raises rather than copy, and here it does not)
    return view
