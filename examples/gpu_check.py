"""GPU check: linattn's CUDA kernels against the CPU at real sizes, and their throughput.

    python examples/gpu_check.py            # on a machine with an NVIDIA GPU and linattn[cuda]
    NUMBA_ENABLE_CUDASIM=1 python examples/gpu_check.py --tiny   # the same code path, in the simulator

Prints, per case, the largest difference from the CPU result and the time of the causal forward
(and of the same kernels with each head in one block, unsplit: cuda/api.segments) and of one
decoding step, next to a PyTorch chunked implementation when torch with CUDA is installed; then two
maps that are computed on the device before the kernels (Taylor, Performer), cross-attention, and
the causal forward's time for several plans of the segments (to tune cuda/api._width).
Exits with status 1 if any result differs from the CPU by more than 1e-4 (relative).
"""
import sys
import time

import numpy as np

import linattn
from linattn.cuda import api, availability

TINY = "--tiny" in sys.argv
CASES = [(1, 2, 24, 4)] if TINY else [(1, 8, 2048, 64), (4, 8, 1024, 64), (2, 4, 8192, 64),
                                      (1, 1, 16384, 64), (1, 8, 4096, 128)]
STEP_BATCHES = [1] if TINY else [1, 32]


def torch_chunked(q, k, v):
    """The chunkwise form in PyTorch (as fla's reference chunk code), on q's device."""
    from linattn.benchmarks.torch_transformer import chunked_linear_attention

    return chunked_linear_attention(q, k, v)[0]


def timed(fn, sync, repeat=5):
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def planned(width, least, fn):
    """fn() with the heads' segments planned for a GPU ``width`` blocks wide and segments of at least
    ``least`` chunks (cuda/api.segments; a width of 1: every head in one block)."""
    saved = api._width
    api._width = lambda: (width, least)
    try:
        return fn()
    finally:
        api._width = saved


def unsplit(fn):
    """fn() with every head in one block (no segments), as before the split."""
    return planned(1, 1, fn)


def sweep(cuda, sync):
    """The causal forward's time for several plans of the segments (the default: four blocks a
    multiprocessor, 8 chunks at least), to tune cuda/api._width on this GPU."""
    sms = 4 if TINY else cuda.get_current_device().MULTIPROCESSOR_COUNT
    plans = [(1, 1), (16, 1)] if TINY else [(1, 1)] + [(m * sms, least) for m in (1, 2, 4, 8) for least in (4, 8, 16)]
    print(f"segments swept ({sms} multiprocessors; width 1: unsplit):")
    for (b, h, n, d) in (CASES[:1] if TINY else [CASES[0], CASES[3]]):
        rng = np.random.default_rng(0)
        dq, dk, dv = (cuda.to_device((rng.standard_normal((b, h, n, d)) * 0.5).astype(np.float32)) for _ in range(3))
        c, te = api.tiles(d, d)
        for width, least in plans:
            parts = api.segments(b * h * -(-d // te), -(-n // c), width, least)[0]
            t = planned(width, least, lambda: timed(lambda: linattn.causal_linear_attention(dq, dk, dv), sync,
                                                    repeat=1 if TINY else 5))
            print(f"  {str((b, h, n, d)):22s} width {width:5d}, least {least:2d}: {parts:4d} segments a head, "
                  f"{t * 1e3:.3f} ms")


def main():
    try:
        from numba import cuda
    except ImportError:
        print("numba.cuda is not installed: pip install 'linattn[cuda]'")
        return 0
    if not cuda.is_available():
        print("no CUDA GPU found (numba.cuda.is_available() is False); nothing to check")
        return 0
    sync = cuda.synchronize
    try:
        import torch
        have_torch = torch.cuda.is_available()
    except ImportError:
        have_torch = False
    ok = True
    print(f"CUDA: {availability()}")
    print(f"{'case (B,H,N,D)':22s} {'max rel err':>11s} {'linattn ms':>11s} {'GFLOP/s':>9s} {'unsplit ms':>11s} "
          f"{'torch ms':>9s}")
    for (b, h, n, d) in CASES:
        rng = np.random.default_rng(0)
        q, k, v = ((rng.standard_normal((b, h, n, d)) * 0.5).astype(np.float32) for _ in range(3))
        dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
        ref = linattn.causal_linear_attention(q, k, v)
        got = linattn.causal_linear_attention(dq, dk, dv).copy_to_host()
        got1 = unsplit(lambda: linattn.causal_linear_attention(dq, dk, dv).copy_to_host())
        err = max(float(np.max(np.abs(x - ref)) / np.max(np.abs(ref))) for x in (got, got1))
        ok &= err < 1e-4
        t = timed(lambda: linattn.causal_linear_attention(dq, dk, dv), sync)
        t1 = unsplit(lambda: timed(lambda: linattn.causal_linear_attention(dq, dk, dv), sync))
        flops = 4 * b * h * n * d * d
        t_torch = "-"
        if have_torch:
            tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
            t_torch = f"{timed(lambda: torch_chunked(tq, tk, tv), torch.cuda.synchronize) * 1e3:9.3f}"
        print(f"{str((b, h, n, d)):22s} {err:11.2e} {t * 1e3:11.3f} {flops / t / 1e9:9.1f} {t1 * 1e3:11.3f} "
              f"{t_torch:>9s}")
    for batch in STEP_BATCHES:
        H, D = (2, 4) if TINY else (8, 64)
        rng = np.random.default_rng(1)
        q, k, v = ((rng.standard_normal((batch, H, D)) * 0.5).astype(np.float32) for _ in range(3))
        st_cpu = linattn.State.zeros((batch, H), D, D)
        st = linattn.State(cuda.to_device(st_cpu.S), cuda.to_device(st_cpu.Z))
        dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
        got = linattn.step(dq, dk, dv, st).copy_to_host()
        ref = linattn.step(q, k, v, st_cpu)
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        ok &= err < 1e-4
        t = timed(lambda: linattn.step(dq, dk, dv, st), sync, repeat=20)
        print(f"step B={batch} H={H} D=Dv={D}: max rel err {err:.2e}, {t * 1e6:.1f} us per step")
    fm = linattn.feature_maps
    b, h, n = (1, 1, 12) if TINY else (1, 8, 2048)
    for name, fmap, d in (("Taylor", fm.Taylor(), 4 if TINY else 16),
                          ("Performer", fm.Performer.random(8 if TINY else 64, 8 if TINY else 64, seed=0)
                           .scaled(0.35), 8 if TINY else 64)):
        rng = np.random.default_rng(2)
        q, k = ((rng.standard_normal((b, h, n, d)) * 0.5).astype(np.float32) for _ in range(2))
        v = (rng.standard_normal((b, h, n, 4 if TINY else 64)) * 0.5).astype(np.float32)
        dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
        ref = linattn.causal_linear_attention(q, k, v, feature_map=fmap)
        got = linattn.causal_linear_attention(dq, dk, dv, feature_map=fmap).copy_to_host()
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        ok &= err < 1e-4
        t = timed(lambda: linattn.causal_linear_attention(dq, dk, dv, feature_map=fmap), sync)
        print(f"{name} map (mapped on the device), {(b, h, n, d)}: max rel err {err:.2e}, {t * 1e3:.3f} ms")
    b, h, n, nk, d = (1, 2, 6, 9, 4) if TINY else (1, 8, 2048, 512, 64)  # cross-attention, the keys' state
    rng = np.random.default_rng(3)
    q = (rng.standard_normal((b, h, n, d)) * 0.5).astype(np.float32)
    k, v = ((rng.standard_normal((b, h, nk, d)) * 0.5).astype(np.float32) for _ in range(2))
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    ref, st_ref = linattn.linear_attention(q, k, v, return_state=True)
    got, st = linattn.linear_attention(dq, dk, dv, return_state=True)
    dq1 = cuda.to_device(np.ascontiguousarray(q[:, :, :1]))
    over_state = linattn.linear_attention(dq1, initial_state=st).copy_to_host()
    qlens = np.full((b, h), n // 2)  # (padded queries: 0 past their lengths)
    padded = linattn.linear_attention(dq, dk, dv, query_lengths=qlens).copy_to_host()
    ok &= bool((padded[:, :, n // 2:] == 0).all())
    err = max(float(np.max(np.abs(x - y)) / np.max(np.abs(y))) for x, y in (
        (got.copy_to_host(), ref), (st.S.copy_to_host(), st_ref.S), (over_state, ref[:, :, :1]),
        (padded[:, :, :n // 2], ref[:, :, :n // 2])))
    ok &= err < 1e-4
    t = timed(lambda: linattn.linear_attention(dq, dk, dv), sync)
    t0 = unsplit(lambda: timed(lambda: linattn.linear_attention(dq, dk, dv), sync))
    t1 = timed(lambda: linattn.linear_attention(dq1, initial_state=st), sync, repeat=20)
    print(f"cross-attention {(b, h, n, d)} over {nk} keys: max rel err {err:.2e} (outputs, state, a query over "
          f"the state), {t * 1e3:.3f} ms (unsplit {t0 * 1e3:.3f}); a query over the state {t1 * 1e6:.1f} us")
    sweep(cuda, sync)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
