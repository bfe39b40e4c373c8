"""A model of how the causal kernels' heads are shared between threads, on equal cores: the dynamic split
(src/linattn/cpu/dynamic.py) against the fixed parts of runtime.plan's two runs. Lab tool, not a test:

    python docs/schedule_model.py

Times are in folds (one fold's run = 1; a fold's sums, what a helper does to reach a runner's state,
cost ``SUM_COST`` of that). A thread is a runner (a head from its start, publishing at every boundary,
stopping at one a helper started from and taking back one claimed but not started), a helper (claims a
boundary as next_job does, sums the folds before it one by one until a published or started boundary)
or done. The fixed parts: the plan's segments for that many threads, phase 0 (the first segment whole,
the others their own sums) then phase 1, items taken in order by the first free thread. Printed: the
time of each over the ideal (all the folds over the threads). Costs left out: a second run's start, the
published states' copies, cache effects; so compare the two, not each with a measurement.
"""
import os
import sys
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from linattn.cpu import dynamic, runtime  # noqa: E402

UNTOUCHED, PASSED, SPLIT, STARTED = dynamic.UNTOUCHED, dynamic.PASSED, dynamic.SPLIT, dynamic.STARTED
SUM_COST = dynamic.SUM_COST


def _claim(marks, ns, a):
    """next_job's new split: (head, boundary) claimed, or None where no part has MIN_SPLIT folds left."""
    while True:
        best, bh, bf = 0, -1, 0
        for g, row in enumerate(marks):
            front = 0
            for j in range(1, ns + 1):
                m = row[j] if j < ns else SPLIT
                if m == PASSED:
                    front = j
                elif m != UNTOUCHED:
                    if j - front > best:
                        best, bh, bf = j - front, g, front
                    front = j
        if best < dynamic.MIN_SPLIT:
            return None
        lo = min(max(int(best / (2.0 - a / (1.0 + a))), 1), best - 1)
        hi = min(lo + 1, best - 1)
        u = lo if max(lo, a * lo / (1 + a) + best - lo) <= max(hi, a * hi / (1 + a) + best - hi) else hi
        if marks[bh][bf + u] == UNTOUCHED:
            marks[bh][bf + u] = SPLIT
            return bh, bf + u


def dynamic_time(threads, heads, ns, a=SUM_COST, dt=0.002, cooperative=False):
    """The dynamic split's time for ``heads`` heads of ``ns`` folds on ``threads`` equal threads.
    ``cooperative``: a helper skips the folds another helper sums or has summed (their sums kept, as the
    kernel keeps them in a head's parts) and, at a published state, waits until every fold up to its
    claim is summed (not built: docs/performance.md, stop 63)."""
    marks = [[UNTOUCHED] * (ns + 1) for _ in range(heads)]
    summed = [[0] * ns for _ in range(heads)]  # (cooperative: 0 not yet, 1 being summed, 2 summed)
    taken = [0]

    def next_job(th):
        if taken[0] < heads:
            th.update(kind="run", h=taken[0], pos=0, left=1.0)
            taken[0] += 1
            return
        found = _claim(marks, ns, a)
        if found is None:
            th.update(kind="done")
            return
        th.update(kind="sum", h=found[0], t=found[1], y=found[1])
        helper_step(th)

    def helper_step(th):
        h, t, y = th["h"], th["t"], th["y"]
        if cooperative and th.get("fold") is not None:
            summed[h][th.pop("fold")] = 2
        if marks[h][t] != SPLIT:  # (taken back)
            next_job(th)
        elif y == 0 or (y < t and marks[h][y] in (PASSED, STARTED)):
            if cooperative and any(summed[h][f] != 2 for f in range(y, t)):
                th.update(left=dt)  # (another helper's sums not ready yet)
                return
            marks[h][t] = STARTED
            th.update(kind="run", pos=t, left=1.0)
        elif cooperative and summed[h][y - 1] != 0:  # (summed, or being summed, by another helper)
            th["y"] = y - 1
            helper_step(th)
        else:
            if cooperative:
                summed[h][y - 1], th["fold"] = 1, y - 1
            th.update(y=y - 1, left=a)

    threads = [{} for _ in range(threads)]
    for th in threads:
        next_job(th)
    time = 0.0
    while any(th["kind"] != "done" for th in threads):
        time += dt
        for th in threads:
            if th["kind"] == "done":
                continue
            th["left"] -= dt
            if th["left"] > 1e-12:
                continue
            if th["kind"] == "sum":
                helper_step(th)
                continue
            th["pos"] += 1
            j = th["pos"]
            if j < ns and marks[th["h"]][j] in (UNTOUCHED, SPLIT):
                marks[th["h"]][j] = PASSED
                th["left"] = 1.0
            else:
                next_job(th)
    return time


def _greedy(costs, threads):
    t = np.zeros(threads)
    for c in costs:
        t[np.argmin(t)] += c
    return t.max()


def fixed_time(threads, heads, ns, a=SUM_COST):
    """The fixed parts' time (runtime.plan's segments for ``threads``), or None where it does not split."""
    with mock.patch.object(runtime, "num_threads", lambda: threads):
        _, frac, nt, two_runs = runtime.plan(heads, ns * 16 * 32, 64, 64)
    segs = np.diff(np.round(frac * ns * 16)) / 16
    if len(segs) == 1:
        return None
    if two_runs:
        return (_greedy(([segs[0]] + [a * s for s in segs[1:-1]]) * heads, nt)
                + _greedy(list(segs[1:]) * heads, nt))
    starts = np.cumsum(np.concatenate([[0], segs[:-1]]))
    return _greedy([s + a * x for s, x in zip(segs, starts)] * heads, nt)


if __name__ == "__main__":
    print("threads heads folds | fixed parts / ideal | dynamic / ideal | cooperative / ideal")
    for threads, cases in ((2, [(1, 32), (3, 16)]), (3, [(1, 32)]), (4, [(1, 32), (2, 16), (3, 16), (5, 16)]),
                           (8, [(1, 32), (3, 16), (5, 16), (9, 16)]), (16, [(1, 32), (1, 64), (5, 16), (17, 16)])):
        for heads, ns in cases:
            fixed = fixed_time(threads, heads, ns)
            ideal = heads * ns / threads
            fixed = "-" if fixed is None else f"{fixed / ideal:.2f}"
            dyn, coop = (dynamic_time(threads, heads, ns, cooperative=c) / ideal for c in (False, True))
            print(f"{threads:7d} {heads:5d} {ns:5d} | {fixed:>19} | {dyn:15.2f} | {coop:.2f}")
