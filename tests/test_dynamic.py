"""The causal kernels' dynamic split of heads between threads (cpu/dynamic.py): helpers that sum back
to a runner and run on from a claimed boundary, runners that stop there or take a boundary back, against
the float64 reference (the forward) and the unsplit kernel (the backward); the segment sizes; and the
public calls that take this path on two threads."""
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn
from linattn import attention, gradients, reference
from linattn import gates as gates_mod
from linattn.cpu import chunked, dynamic
from linattn.cpu.runtime import chunk_size

from conftest import assert_close, causal_results, make_qkv
from test_combinations import GATINGS, MAPS, _layout, _options_together, _segments

N, D, DV = 1700, 5, 4  # 54 chunks of 32: 4 segments of 16 chunks (3 whole, one of 6)
LENGTHS = np.array([1700, 1100, 0], np.int64)  # 4, 3 and no segments


def _marks(parts, nseg):
    return parts[:, :nseg + 1, 0, -1].view(np.int64)


def _setup(rng, kind, layout="C"):
    """The causal kernel's arguments for three heads (lengths LENGTHS, an initial state, gates of
    ``kind``) with outputs, final state, denominators and chunk states NaN, and dynamic parts."""
    q, k, v = make_qkv(rng, (1, 3), N, D, DV)
    S0 = rng.random((3, D, DV)).astype(np.float32)
    Z0 = rng.random((3, D)).astype(np.float32)
    shape = (1, 3, N) + ((D,) if kind == gates_mod.VECTOR else ())
    g = (-rng.random(shape) * 0.02).astype(np.float32)
    g[0, 0, 700] = -np.inf  # a reset (every key dimension of head 0 at 700)
    chunk = chunk_size(N)
    parts = attention._causal_parts(True, 3, N, chunk, np.array([0.0, 0.5, 1.0]), D, DV, 2)[0]
    nseg = (parts.shape[1] - 1) // 2
    arrays = dict(out=np.full((1, 3, N, DV), np.nan, np.float32), S=np.full((3, D, DV), np.nan, np.float32),
                  Z=np.full((3, D), np.nan, np.float32), den=np.full((1, 3, N), np.nan, np.float32),
                  states=np.full((1, 3, -(-N // chunk), DV + 1, D), np.nan, np.float32))
    args = (q, k, v, 1, np.zeros(0, np.float32), 0, np.float32(1e-6), True, np.float32(1), LENGTHS, chunk,
            np.array([0.0, 1.0]), S0, Z0, arrays["out"], arrays["S"], arrays["Z"],
            g if kind else np.zeros(0, np.float32), np.zeros(3) if kind else np.zeros(0), np.zeros(3, np.int64),
            arrays["den"], arrays["states"], 2, parts)
    worker = chunked.causal_forward.get(np.float32, (layout, kind)).worker
    ref = dict(q=q, k=k, v=v, S0=S0, Z0=Z0, g=g if kind else None, chunk=chunk)
    return worker, args, arrays, parts, nseg, ref


def _check(arrays, ref, rows=None):
    """Each head's outputs (those from ``rows[h]`` on, where given), final state and chunk states against
    the float64 reference (the states chunk by chunk through the textbook loop)."""
    q, k, v, S0, Z0, g, chunk = (ref[x] for x in ("q", "k", "v", "S0", "Z0", "g", "chunk"))
    for h, L in enumerate(LENGTHS):
        gate = (lambda sl: {}) if g is None else (lambda sl: {"gate": g[0, h, sl]})
        want = reference.masked(q[0, h, :L], k[0, h, :L], v[0, h, :L], initial_state=(S0[h], Z0[h]),
                                **gate(slice(0, L)))
        r0 = 0 if rows is None else rows[h]
        assert_close(arrays["out"][0, h, r0:L], want[r0:], np.float32)
        np.testing.assert_array_equal(arrays["out"][0, h, L:], 0)
        state = (S0[h].astype(np.float64), Z0[h].astype(np.float64))
        for ci in range(-(-L // chunk)):
            if ci >= r0 // chunk:
                assert_close(arrays["states"][0, h, ci], np.concatenate([state[0], state[1][:, None]], 1).T,
                             np.float32)
            sl = slice(ci * chunk, min((ci + 1) * chunk, L))
            _, state = reference.loop(q[0, h, sl], k[0, h, sl], v[0, h, sl], initial_state=state, return_state=True,
                                      **gate(sl))
        assert_close(arrays["S"][h], state[0], np.float32)
        assert_close(arrays["Z"][h], state[1], np.float32)


KINDS = [0, gates_mod.SCALAR, gates_mod.VECTOR]


@pytest.mark.parametrize("kind", KINDS)
def test_helpers_then_runners(rng, kind):
    """A thread that finds no head left to take helps: here one thread first does all the helping
    (each head's claims from the initial state, summed back to its start), then runs every head from
    its start; each runner stops at the first boundary a helper started from. Every output, the final
    state, the denominators and the chunk states equal the reference."""
    worker, args, arrays, parts, nseg, ref = _setup(rng, kind)
    assert nseg == 4
    worker(*args, np.array([3], np.int64))  # (every head taken: helping only)
    marks = _marks(parts, nseg)
    assert (marks[0] == dynamic.STARTED).sum() >= 1 and (marks[1] == dynamic.STARTED).sum() == 1
    assert np.isnan(arrays["out"][0, 0, 0]).all() and not np.isnan(arrays["out"][0, 0, -1]).any()  # (the ends alone)
    worker(*args, np.array([0], np.int64))
    _check(arrays, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_helpers_meet_published_states(rng, kind):
    """After a whole run (every boundary's state published), the boundaries after the first are made
    untouched again and the outputs after it NaN: a helper then sums back to the state published at
    that boundary and runs on from its claim. What it ran equals the reference; what nobody ran (the
    runner's part, too short to split) stays NaN."""
    worker, args, arrays, parts, nseg, ref = _setup(rng, kind)
    worker(*args, np.array([0], np.int64))
    marks = _marks(parts, nseg)
    assert (marks[0, 1:nseg] == dynamic.PASSED).all() and (marks[1, 1:3] == dynamic.PASSED).all()
    per = chunked.FOLD_EVERY
    marks[0, 2:] = dynamic.UNTOUCHED
    arrays["out"][0, 0, per * 32:] = np.nan
    worker(*args, np.array([3], np.int64))  # (head 0's part from boundary 1: 3 segments, split at 3)
    assert list(marks[0, :nseg]) == [0, dynamic.PASSED, dynamic.UNTOUCHED, dynamic.STARTED]
    start = 3 * per * ref["chunk"]
    assert np.isnan(arrays["out"][0, 0, per * 32:start]).all()
    _check(arrays, ref, rows=[start, 0, 0])


@pytest.mark.parametrize("kind", KINDS + [gates_mod.CONSTANT])
@pytest.mark.parametrize("apart", [False, True])
def test_every_schedule_gives_the_same_bits(rng, kind, apart):
    """Outputs, final state, denominators and chunk states do not depend on who ran what: one runner a
    head, helpers first (their states summed back to the head's start) then runners, and helpers that
    meet a runner's published state give the same bits (v's rows apart: a fused projection's views)."""
    found = []
    for order in ("runners", "helpers first", "meet"):
        worker, args, arrays, parts, nseg, ref = _setup(np.random.default_rng(7), kind, "A" if apart else "C")
        if kind == gates_mod.CONSTANT:  # a decay per head, no gates array
            args = args[:17] + (np.zeros((0, 0), np.float32), np.log([0.999, 0.99, 0.9])) + args[19:]
        if apart:
            wide = np.zeros(args[2].shape[:-1] + (3 * DV,), np.float32)
            wide[..., ::3] = args[2]
            args = args[:2] + (wide[..., ::3],) + args[3:]
        if order == "meet":  # (as test_helpers_meet_published_states, the whole head then run again)
            worker(*args, np.array([0], np.int64))
            _marks(parts, nseg)[0, 2:] = dynamic.UNTOUCHED
            worker(*args, np.array([3], np.int64))
        else:
            if order == "helpers first":
                worker(*args, np.array([3], np.int64))
            worker(*args, np.array([0], np.int64))
        found.append(arrays)
    for arrays in found[1:]:
        for name, x in arrays.items():
            np.testing.assert_array_equal(x, found[0][name], err_msg=name)


def test_runner_takes_back_a_claim_and_stops_at_a_start(rng):
    """A runner that reaches a boundary a helper claimed but has not started from (still summing: a slow
    thread) takes it back and runs on; one a helper started from ends its part."""
    worker, args, arrays, parts, nseg, ref = _setup(rng, 0)
    marks = _marks(parts, nseg)
    marks[0, 2] = dynamic.SPLIT
    marks[1, 2] = dynamic.STARTED
    worker(*args, np.array([0], np.int64))
    assert marks[0, 2] == dynamic.PASSED and marks[1, 2] == dynamic.STARTED
    start = 2 * chunked.FOLD_EVERY * ref["chunk"]
    assert np.isnan(arrays["out"][0, 1, start:LENGTHS[1]]).all()
    assert_close(arrays["out"][0, 0], reference.masked(ref["q"][0, 0], ref["k"][0, 0], ref["v"][0, 0],
                                                       initial_state=(ref["S0"][0], ref["Z0"][0])), np.float32)


def _flat(grads):
    """A vjp's gradients as a list of arrays (copies), those in tuples (a state's) and dicts (a map's
    parameters) in order."""
    if isinstance(grads, dict):
        return _flat([grads[key] for key in sorted(grads)])
    if isinstance(grads, (tuple, list)):
        return [y for x in grads for y in _flat(x)]
    return [np.array(grads)]


def _vjp(rng, kind, plan):
    """The causal vjp of three heads (lengths LENGTHS, an initial state, gates of ``kind``) along a random
    output and final state gradient, with the backward's plan ``plan``: the gradients, and the backward
    kernel's worker, arguments (before ``phase``) and parts as the vjp ran it."""
    lead = (3,)
    q, k, v = make_qkv(rng, lead, N, D, DV)
    S0 = linattn.State(rng.random(lead + (D, DV)).astype(np.float32), rng.random(lead + (D,)).astype(np.float32))
    kw = dict(initial_state=S0, lengths=LENGTHS, return_state=True)
    if kind:
        g = (-rng.random(lead + (N,) + ((D,) if kind == gates_mod.VECTOR else ())) * 0.02).astype(np.float32)
        g[0, 700] = -np.inf  # a reset (every key dimension of head 0 at 700)
        kw["gate"] = g
    W = rng.standard_normal(lead + (N, DV)).astype(np.float32)
    dstate = (rng.standard_normal(lead + (D, DV)).astype(np.float32),
              rng.standard_normal(lead + (D,)).astype(np.float32))
    ran = {}
    real = gradients._run

    def run(kernel, nthreads, args, parts):
        ran.update(worker=kernel.worker, args=args, parts=parts)
        return real(kernel, nthreads, args, parts)

    with mock.patch.object(gradients, "plan", plan), mock.patch.object(gradients, "_run", run):
        _, _, vjp = linattn.causal_linear_attention_vjp(q, k, v, **kw)
        grads = _flat(vjp(W, dstate))
    return grads, ran["worker"], ran["args"], ran["parts"]


#: The backward kernel's outputs among its arguments: dq, dk, dv, the initial state's gradient (H_out,
#: Z_out) and the gates' per-position terms (rq, rk).
_BACKWARD_OUTPUTS = dict(dq=21, dk=22, dv=23, H=24, Z=25, rq=26, rk=27)


@pytest.mark.parametrize("kind", KINDS)
def test_backward_every_schedule_gives_the_unsplit_bits(rng, kind):
    """The backward splits heads as it runs, mirrored (a runner from a head's end, boundaries every fold
    counted from there, helpers summing the adjoint's updates back toward the end). The vjp on two threads
    gives the gradients of the unsplit kernel bit for bit, and so does the kernel driven by hand on one
    thread whoever runs what: runners alone, helpers first (summed back to the head's end) then runners,
    and a helper that meets a runner's published adjoint (what it ran; what nobody ran stays NaN)."""
    seed = int(rng.integers(1 << 30))
    unsplit, _, _, parts = _vjp(np.random.default_rng(seed), kind,
                                lambda *a, **kw: (32, np.array([0.0, 1.0]), 1, False))
    assert parts is None
    grads, worker, args, parts = _vjp(np.random.default_rng(seed), kind,
                                      lambda *a, **kw: (32, np.array([0.0, 0.5, 1.0]), 2, True))
    assert isinstance(parts, tuple)
    for got, want in zip(grads, unsplit):
        np.testing.assert_array_equal(got, want)
    parts = parts[0]
    nseg = (parts.shape[1] - 1) // 2
    assert nseg == 4
    outputs = {name: args[i] for name, i in _BACKWARD_OUTPUTS.items() if args[i].size}
    assert ("rq" in outputs) == bool(kind)
    marks = _marks(parts, nseg)

    def schedule(*counters, before=None):
        marks[:] = dynamic.UNTOUCHED
        if before is not None:  # (a whole run first, then boundaries from ``before`` untouched again)
            worker(*args, 2, parts, np.array([0], np.int64))
            marks[0, before:] = dynamic.UNTOUCHED
        for x in outputs.values():
            x[...] = np.nan
        for first in counters:
            worker(*args, 2, parts, np.array([first], np.int64))
        return {name: x.copy() for name, x in outputs.items()}

    runners = schedule(0)
    for i, name in enumerate(("dq", "dk", "dv")):
        np.testing.assert_array_equal(runners[name].reshape(3, N, -1), unsplit[i], err_msg=name)
    helpers_first = schedule(3, 0)
    assert (marks[0] == dynamic.STARTED).sum() >= 1 and (marks[1] == dynamic.STARTED).sum() == 1
    for name, x in runners.items():
        np.testing.assert_array_equal(helpers_first[name], x, err_msg=name)
    met = schedule(3, before=2)  # (head 0's part from boundary 1: three segments, split at 3)
    assert list(marks[0, :nseg]) == [0, dynamic.PASSED, dynamic.UNTOUCHED, dynamic.STARTED]
    rows = (-(-N // 32) - 3 * chunked.FOLD_EVERY) * 32  # (the helper's: head 0's first rows in time)
    for name in ("dq", "dk", "dv"):
        got, want = met[name].reshape(3, N, -1), runners[name].reshape(3, N, -1)
        np.testing.assert_array_equal(got[0, :rows], want[0, :rows], err_msg=name)
        assert np.isnan(got[0, rows:]).all() and np.isnan(got[1:]).all()
    np.testing.assert_array_equal(met["H"][0], runners["H"][0])


def test_backward_runner_takes_back_a_claim_and_stops_at_a_start(rng):
    """As the forward's: a backward runner takes back a boundary claimed but not started from, and ends
    its part at one a helper started from (its rows before it in time stay NaN)."""
    grads, worker, args, parts = _vjp(rng, 0, lambda *a, **kw: (32, np.array([0.0, 0.5, 1.0]), 2, True))
    parts = parts[0]
    marks = _marks(parts, 4)
    marks[:] = dynamic.UNTOUCHED
    marks[0, 2] = dynamic.SPLIT
    marks[1, 2] = dynamic.STARTED
    dq = args[_BACKWARD_OUTPUTS["dq"]]
    dq[...] = np.nan
    worker(*args, 2, parts, np.array([0], np.int64))
    assert marks[0, 2] == dynamic.PASSED and marks[1, 2] == dynamic.STARTED
    np.testing.assert_array_equal(dq[0, 0], grads[0][0])  # (dq: (1, 3, N, D), the vjp's: (3, N, D))
    end = (-(-LENGTHS[1] // 32) - 2 * chunked.FOLD_EVERY) * 32  # (head 1: 35 chunks, the last 32 its runner's)
    assert np.isnan(dq[0, 1, :end]).all() and not np.isnan(dq[0, 1, end:LENGTHS[1]]).any()
    assert np.isnan(dq[0, 1, LENGTHS[1]:]).all()  # (the padding: zeroed by whoever runs the head's first chunk)


@pytest.mark.parametrize("bh, nchunks, dk, dv", [(1, 54, 5, 4), (1, 512, 64, 64), (1, 1 << 15, 64, 64),
                                                 (3, 100, 8, 8), (64, 4096, 256, 256), (1, 5, 4, 4)])
@pytest.mark.parametrize("nthreads", [1, 2, 3, 8, 16])
def test_segment_sizes(bh, nchunks, dk, dv, nthreads):
    """A segment is one fold's chunks (the last maybe fewer), unless the published states and sums would
    take more than MAX_BYTES or the threads are more than two a head (0: the static split)."""
    fold = chunked.FOLD_EVERY
    nseg = dynamic.segments(bh, nchunks, dk, dv, fold, nthreads)
    need = bh * (2 * -(-nchunks // fold) + 1) * dk * (dv + 2) * 8
    fits = need <= dynamic.MAX_BYTES and nthreads <= 2 * bh
    assert nseg == (-(-nchunks // fold) if fits else 0)


def test_the_schedule_model_behind_two_threads_a_head():
    """docs/schedule_model.py, the model THREADS_PER_HEAD rests on: with at most two threads a head the
    dynamic split is within 5% of the fixed parts or better, and one head on more threads falls behind
    them more the more threads share it."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parents[1] / "docs" / "schedule_model.py"
    spec = importlib.util.spec_from_file_location("schedule_model", path)
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    for threads, heads in ((2, 1), (2, 3), (4, 2), (8, 5)):
        assert model.dynamic_time(threads, heads, 16) <= 1.05 * model.fixed_time(threads, heads, 16)
    behind = [model.dynamic_time(t, 1, 32) / model.fixed_time(t, 1, 32) for t in (4, 8, 16)]
    assert 1.1 < behind[0] < behind[1] < behind[2]


@pytest.mark.parametrize("bh, nthreads, dynamic_split", [(1, 2, True), (1, 3, False), (1, 16, False), (2, 4, True),
                                                         (3, 8, False), (5, 8, True), (9, 16, True)])
def test_many_threads_a_head_split_the_static_way(bh, nthreads, dynamic_split):
    """The causal kernels split heads as they run only with at most two threads a head (more helpers on
    one head sum the same segments back to states nobody has written yet: docs/schedule_model.py); else
    their plan's two runs, whose parts are an array of the plan's segments."""
    frac = np.array([0.0, 0.25, 0.5, 1.0])
    parts = attention._causal_parts(True, bh, 16384, 32, frac, 64, 64, nthreads)
    assert isinstance(parts, tuple) == dynamic_split
    if not dynamic_split:
        assert parts.shape == (bh, 3, 64, 66)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_public_calls_on_two_threads(rng, monkeypatch, dtype):
    """Heads split between two threads as they run (the plans of the forward and the backward forced to
    split three heads of 1700 positions, which takes the dynamic path) give the unsplit results,
    repeatedly: every kind of gate and decay, lengths, an initial state, the final state, through the
    plain call's short path and the vjp (its forward's kept denominators and chunk states, its
    backward)."""
    lead, n, d, dv = (3,), N, D, DV
    q, k, v = make_qkv(rng, lead, n, d, dv, dtype)
    S0 = linattn.State(rng.random(lead + (d, dv)).astype(dtype), rng.random(lead + (d,)).astype(dtype))
    g_pos = (-rng.random(lead + (n,)) * 0.02).astype(dtype)
    g_pos[1, 333] = -np.inf
    g_dim = (-rng.random(lead + (n, d)) * 0.02).astype(dtype)
    options = [{}, dict(initial_state=S0, lengths=np.array([1700, 1100, 1])), dict(gate=g_pos),
               dict(gate=g_dim, initial_state=S0), dict(decay=np.full(lead, 0.999)),
               dict(decay=np.full(lead, 0.999), gate=g_pos, normalize=False, scale=0.5)]
    W = rng.standard_normal(lead + (n, dv)).astype(dtype)

    def results():
        return causal_results(q, k, v, options, W)

    for module in (attention, gradients):
        monkeypatch.setattr(module, "plan", lambda *a, **kw: (32, np.array([0.0, 1.0]), 1, False))
    whole = results()
    for module in (attention, gradients):
        monkeypatch.setattr(module, "plan", lambda *a, **kw: (32, np.array([0.0, 0.2, 0.6, 1.0]), 2, True))
    assert isinstance(attention._causal_parts(True, 3, n, 32, None, d, dv, 2), tuple)
    for _ in range(3):
        for got, want in zip(results(), whole):
            assert_close(got, want, dtype)
    attention._constants.clear()


_OPTIONS = dict(lead=st.sampled_from([(1,), (3,), (2, 1)]), n=st.integers(1025, 1500), d=st.integers(1, 4),
                dv=st.integers(1, 3), dtype=st.sampled_from([np.float32, np.float64]),
                map_name=st.sampled_from(sorted(MAPS)), gating=st.sampled_from(GATINGS), reset=st.booleans(),
                with_state=st.booleans(), with_lengths=st.sampled_from([None, "leading"]),
                scale=st.sampled_from([None, 0.5]), layout=st.sampled_from(["c", "transposed", "heads"]),
                seed=st.integers(0, 2**31))


@settings(max_examples=15, deadline=None)
@given(split=st.floats(0, 1), **_OPTIONS)
def test_options_together_split_as_they_run(lead, n, d, dv, dtype, map_name, gating, reset, with_state, with_lengths,
                                            scale, layout, split, seed):
    """test_combinations' every option drawn (maps of another width, gates and resets, a state, lengths,
    views, out=, split/resume and steps, against the float64 reference) with heads long enough for the
    dynamic split, on two threads."""
    with _segments(([0.5], True)):
        assert isinstance(attention._causal_parts(True, 1, n, chunk_size(n), None, d, dv, 2), tuple)
        _options_together(lead, n, d, dv, dtype, map_name, gating, reset, with_state, with_lengths, scale, layout,
                          split, seed)


@contextmanager
def _threads(count):
    """Causal calls split as they run (the plans of the forward and the backward forced to split) on
    ``count`` threads."""
    forced = (lambda *a, **kw: (chunk_size(a[1]), np.array([0.0, 0.5, 1.0]), count, True))
    attention._constants.clear()
    try:
        with mock.patch.object(attention, "plan", forced), mock.patch.object(gradients, "plan", forced):
            yield
    finally:
        attention._constants.clear()


@settings(max_examples=15, deadline=None)
@given(**_OPTIONS)
def test_one_thread_or_two_the_same_bits(lead, n, d, dv, dtype, map_name, gating, reset, with_state, with_lengths,
                                         scale, layout, seed):
    """A head run by one thread alone and by two that split it as they run give the same bits (outputs,
    final state and the vjp's gradients along a random output gradient), whatever the options."""
    rng = np.random.default_rng(seed)
    make_map, positive = MAPS[map_name]
    fmap = make_map(d, rng)
    q, k = ((rng.standard_normal(lead + (n, d)) * 0.5).astype(dtype) for _ in range(2))
    v = rng.standard_normal(lead + (n, dv)).astype(dtype)
    dk = linattn.feature_maps.as_map(fmap).out_dim(d)
    kw = dict(feature_map=fmap, normalize=positive, scale=scale, return_state=True)
    if "decay" in gating:
        kw["decay"] = rng.uniform(0.8, 1.0, lead[-1:]).astype(dtype)
    if gating in ("position", "decay+position", "dimension"):
        gate = np.log(rng.uniform(0.7, 1.0, lead + (n,) + ((dk,) if gating == "dimension" else ()))).astype(dtype)
        if reset:  # (a position, or one of its dimensions, that forgets everything before it)
            gate[(Ellipsis, rng.integers(n)) + ((rng.integers(dk),) if gating == "dimension" else ())] = -np.inf
        kw["gate"] = gate
    if with_state:
        kw["initial_state"] = linattn.State((rng.standard_normal(lead + (dk, dv)) * 0.3).astype(dtype),
                                            rng.uniform(0.5, 1.5, lead + (dk,)).astype(dtype))
    if with_lengths:
        kw["lengths"] = rng.integers(0, n + 1, lead)
    args = [_layout(x, layout) for x in (q, k, v)]
    W = rng.standard_normal(lead + (n, dv)).astype(dtype)
    found = []
    for count in (1, 2, 2):
        with _threads(count):
            out, state = linattn.causal_linear_attention(*args, **kw)
            grads = linattn.causal_linear_attention_vjp(*args, **kw)[2](W)
            found.append([out, state.S, state.Z] + _flat(grads))
    for got in found[1:]:
        for x, want in zip(got, found[0]):
            np.testing.assert_array_equal(x, want)
