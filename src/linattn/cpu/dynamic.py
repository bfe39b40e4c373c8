"""The causal kernels' dynamic split of heads between threads: who runs which part of a head is decided
while the kernel runs, so that a thread slowed down (a core shared with another program, one that wakes
late) does less of it instead of holding the call up with a fixed share. Written below for the forward
kernel (cpu/chunked.py); the backward's (cpu/backward.py) is the same in its walk's order, from a head's
end back to its start: "before" a boundary there means later in time, its state the adjoint.

A head is cut into segments of one fold each (the kernel folds its float32 pending sums into the
float64 state every FOLD_EVERY chunks). A thread that takes a head from the shared counter (a runner)
runs it from its start and writes ("publishes") its state at every segment boundary it passes. A
thread with no head left to take (a helper) looks for the part of a head with the most segments still
to run and claims a boundary t ahead of that part's runner, which will stop there. It sums the segments
just before t, one at a time backward, each from a zero state, until it meets a boundary whose state
is published (or the head's start: the initial state), folds those sums into that state one by one as
the runner would have, and runs from t to the end of the runner's old part, publishing in turn, so that
another free thread can split its part the same way.

Nobody waits for another thread: a runner that reaches a boundary whose helper has not started yet
(still summing: slow or descheduled) takes the boundary back and runs on, and the helper, finding its
claim gone, looks for other work; a helper never waits for a state being written, it sums one segment
more. A segment's sums are made with the runner's own arithmetic (the same products of the same
transposed keys, the same gate factors) and folded with the runner's fold, so a helper's state at a
boundary is the runner's bit for bit: the results do not depend on who ran what.

Everything lives in the kernel's ``parts`` (heads, 2 * nseg + 1, D', Dv + 2), float64: rows [0, nseg]
the published state at each boundary ([S | Z | -], its first row's last element the boundary's mark,
an int64 kept in the float64's bits and only touched atomically), rows nseg + 1 + s the sums of
segment s ([P | Pz | log decay]: the pending sums a runner folds at the segment's end). A boundary's
mark moves UNTOUCHED -> PASSING -> PASSED (a runner) or UNTOUCHED -> SPLIT (a claim) -> STARTING ->
STARTED (its helper starts) or SPLIT -> PASSING -> PASSED (taken back); every move is one
compare-and-swap, so a runner and a helper that race for one boundary need no lock.
"""
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .._jit import njit

#: A boundary's marks: nobody has reached it; a runner is writing its state there (PASSING) and then
#: has (PASSED); a helper claimed it as its part's start (SPLIT), is about to write its state there
#: (STARTING), has (STARTED).
UNTOUCHED, PASSED, SPLIT, STARTED, PASSING, STARTING = 0, 1, 2, 3, 4, 5

#: A thread's next job: run a head from its start; sum one segment backward toward a runner; run from
#: a claimed boundary; nothing left.
RUN_HEAD, SUM, RUN_SPLIT, DONE = 0, 1, 2, 3

#: At most this many bytes of published states and sums in one call (a call that would need more, many
#: heads or very long ones, splits its heads the static way: cpu/runtime.plan's two runs).
MAX_BYTES = 64 << 20

#: The fewest segments left to run in a part that a free thread splits: with two, the helper would sum
#: one while the runner runs it and gain nothing.
MIN_SPLIT = 3

#: A segment's sums over its whole run: cpu/runtime.prefix_cost at D = Dv = 64, and what a helper's
#: sums cost here (one thread helping alone through a head of N = 16384 took 7.3 ms, a runner 5.0 ms:
#: about 41 segments summed besides the 32 run, 0.36 each).
SUM_COST = 0.36

#: The most threads a head for the dynamic split; a call with more takes the static split (cpu/runtime.plan's
#: two runs). Helpers that start together on one head each sum back to the nearest published state,
#: and with many of them the nearest is another helper's that is not written yet, so they sum the same
#: segments over and over: in a model of the schedule on equal cores (docs/schedule_model.py) one head
#: of 32 folds takes 1.19x the ideal time on 2 threads (the fixed parts 1.15x), but 1.54x on 4 (1.25x),
#: 1.77x on 8 (1.32x) and 2.44x on 16 (1.36x); with at most two threads a head the dynamic split
#: matches or beats the fixed parts (5 heads on 8 threads 1.22x against 1.30x; 3 on 8: 1.36x against
#: 1.32x).
THREADS_PER_HEAD = 2


def segments(bh, nchunks, dk, dv, fold, nthreads):
    """Segments a head of ``nchunks`` chunks is cut into (one a fold of the kernel: ``fold`` chunks,
    the last maybe shorter) for ``bh`` heads of states (dk, dv) on ``nthreads`` threads, or 0 where
    their published states and sums would take more than MAX_BYTES or the threads are more than
    THREADS_PER_HEAD a head (the static split then)."""
    nseg = -(-nchunks // fold)
    fits = bh * (2 * nseg + 1) * dk * (dv + 2) * 8 <= MAX_BYTES
    return nseg if fits and nthreads <= THREADS_PER_HEAD * bh else 0


def _mark_pointer(context, builder, aty, value, h, j):
    """An i64* to boundary j's mark of head h in ``parts`` (parts[h, j, 0, -1])."""
    arr = context.make_array(aty)(context, builder, value)
    shape = cgutils.unpack_tuple(builder, arr.shape, aty.ndim)
    last = builder.sub(shape[3], ir.Constant(shape[3].type, 1))
    zero = ir.Constant(shape[3].type, 0)
    ptr = cgutils.get_item_pointer(context, builder, aty, arr, [h, j, zero, last])
    return builder.bitcast(ptr, ir.IntType(64).as_pointer())


def _parts_ok(parts):
    return isinstance(parts, types.Array) and parts.ndim == 4 and parts.dtype == types.float64


@intrinsic
def mark_swap(typingctx, parts, h, j, expected, new):
    """Atomically: boundary j's mark of head h becomes ``new`` if it is ``expected``; returns the mark
    before (sequentially consistent: the caller's earlier writes are visible to whoever reads the new
    mark). Only callable from Numba code."""
    if not _parts_ok(parts):
        return None
    sig = types.int64(parts, types.intp, types.intp, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        ptr = _mark_pointer(context, builder, sig.args[0], args[0], args[1], args[2])
        pair = builder.cmpxchg(ptr, args[3], args[4], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return sig, codegen


@intrinsic
def mark_read(typingctx, parts, h, j):
    """Boundary j's mark of head h, read atomically (acquire: the state written before it is visible).
    Only callable from Numba code."""
    if not _parts_ok(parts):
        return None
    sig = types.int64(parts, types.intp, types.intp)

    def codegen(context, builder, sig, args):
        ptr = _mark_pointer(context, builder, sig.args[0], args[0], args[1], args[2])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def mark_write(typingctx, parts, h, j, value):
    """Boundary j's mark of head h = ``value``, atomically (release: the caller's earlier writes are
    visible to whoever reads it). Only callable from Numba code."""
    if not _parts_ok(parts):
        return None
    sig = types.none(parts, types.intp, types.intp, types.int64)

    def codegen(context, builder, sig, args):
        ptr = _mark_pointer(context, builder, sig.args[0], args[0], args[1], args[2])
        builder.store_atomic(args[3], ptr, "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@njit(helper=True)
def publish(parts, h, j, acc, accz, started):
    """parts[h, j] = [S | Z] from the float64 accumulators acc, accz, the state at boundary j of head h:
    a helper's at its claim (``started``: it then marks j STARTED), or a runner's as it passes j, which
    returns False instead where a helper has started from j (the runner's part ends there). A boundary a
    helper claimed but has not started from (it is still summing: a slow or descheduled thread) is
    taken back: nobody waits for another thread."""
    if not started:
        m = mark_swap(parts, h, j, UNTOUCHED, PASSING)
        if m == SPLIT and mark_swap(parts, h, j, SPLIT, PASSING) == SPLIT:
            m = UNTOUCHED  # (the helper finds its claim gone and looks for other work)
        if m != UNTOUCHED:
            return False
    row = parts[h, j]
    x = acc.shape[1]
    for a in range(acc.shape[0]):
        for e in range(x):
            row[a, e] = acc[a, e]
        row[a, x] = accz[a]
    mark_write(parts, h, j, STARTED if started else PASSED)
    return True


@njit(helper=True)
def next_job(take_item, items, dynamic, parts, lengths, chunk, per, cost, h, t, y):
    """The job (kind, item or head, segment or boundary, claimed boundary) of a thread that took
    ``take_item`` from the counter: a head's run while items are left, else (``dynamic``) a helper's
    next step: where t > 0, of its split of boundary t of head h with the segments from y summed, else
    of a new split (a boundary claimed, SPLIT, in the part with the most segments left to run, if one
    has MIN_SPLIT, u of them from its runner's segment, ``cost``: a segment's sum over its run, as
    SUM_COST); else DONE. A step: (SUM, y - 1) to sum the segment before y, (RUN_SPLIT, y) where the
    state at y is known (published, or the initial state at 0), or another split where the runner took
    t back. It never waits: a state being written is summed past."""
    if take_item < items:
        return RUN_HEAD, take_item, 0, 0
    if not dynamic:
        return DONE, 0, 0, 0
    while True:
        while t == 0:  # a new split
            best, bh, bf = int(0), int(-1), int(0)  # (run-time ints: no literal types, see _jit)
            for g in range(parts.shape[0]):
                ns = ((lengths[g] + chunk - 1) // chunk + per - 1) // per  # (its segments)
                front = 0  # the segment the runner of the current part runs (its start until it passes one)
                for j in range(1, ns + 1):
                    m = mark_read(parts, g, j) if j < ns else SPLIT
                    if m == PASSED or m == PASSING:
                        front = j
                    elif m != UNTOUCHED:  # the part ends at j
                        if j - front > best:
                            best, bh, bf = j - front, g, front
                        front = j
            if best < MIN_SPLIT:
                return DONE, 0, 0, 0
            # u: the whole number of segments left to the runner that ends both soonest on cores of equal
            # speed (the runner's u against the helper's sums back to where they meet, a u / (1 + a), and
            # its best - u: about 0.58 best, a = cost); a thread that ends first helps again
            a = cost
            lo = min(max(int(best / (2.0 - a / (1.0 + a))), 1), best - 1)
            hi = min(lo + 1, best - 1)
            u = lo if max(lo, a * lo / (1.0 + a) + best - lo) <= max(hi, a * hi / (1.0 + a) + best - hi) else hi
            if mark_swap(parts, bh, bf + u, UNTOUCHED, SPLIT) == UNTOUCHED:
                h, t, y = bh, bf + u, bf + u
        if mark_read(parts, h, t) != SPLIT:
            t = 0  # (taken back: another split)
            continue
        if y == 0:
            return RUN_SPLIT, h, 0, t
        m = mark_read(parts, h, y) if y < t else UNTOUCHED
        if m == PASSED or m == STARTED:
            return RUN_SPLIT, h, y, t
        return SUM, h, y - 1, t


@njit(helper=True)
def job_chunks(kind, y, tb, length, chunk, per):
    """A job of next_job on a head of ``length`` positions, as a kernel runs it: (first chunk, end,
    last, whole, sums_only) in the kernel's walk order (the backward's from a head's end): a head's run
    from its first chunk to its end, a sum of segment y's ``per`` chunks, a run from the claimed
    boundary tb to the end; ``last``, the run may reach the head's end (unless a helper started ahead),
    ``whole``, it starts from the initial state, ``sums_only``, a helper's sum."""
    nch = (length + chunk - 1) // chunk
    c0 = y * per if kind == SUM else (tb * per if kind == RUN_SPLIT else 0)
    c1 = min(c0 + per, nch) if kind == SUM else nch
    return c0, c1, kind != SUM, kind == RUN_HEAD, kind == SUM
