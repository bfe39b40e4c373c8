"""Machine check: linattn's CPU speed on this machine, as issue 10's targets state it, in one run.

    python examples/machine_check.py            # a few minutes (for a machine with many cores)
    python examples/machine_check.py --quick    # small sizes, a few seconds a part (what the tests run)

Every part runs in fresh processes, each with its own environment:

1. ``python -m linattn info``: threads, threading layer, the BLAS libraries and whether they run on
   linattn's thread pool;
2. the causal forward of ``run_peers.py``'s five cases against a same-FLOP GEMM timed in turn with it
   (``python -m linattn bench --case ...``), twice at every thread and twice at 8 (``NUMBA_NUM_THREADS=8``),
   against issue 10's target (at most 2.5x the GEMM in every run);
3. NumPy's own matrix products at a model's shapes with linattn loaded and OpenBLAS's threaded work on
   linattn's pool (the default) over the same with OpenBLAS's own threads
   (``LINATTN_SHARE_BLAS_THREADS=0``), processes alternating: sharing the pool must leave NumPy as fast;
4. the causal forward (B1 H8 N2048) right after the model's QKV projection over the same call alone, in
   turn (target: at most 1.15x);
5. small and mid calls (forward and the vjp's backward) with the threads ``runtime.plan`` gives them
   against one thread and against every thread (its thresholds, measured on two cores only, set aside in
   the process): a call whose plan is slower than either says which threshold (``runtime``'s
   SECOND_THREAD_WORK, SECOND_THREAD_WORK_ONE_HEAD, MIN_WORK_PER_THREAD) does not suit this machine.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np

QUICK = "--quick" in sys.argv
PEER_CASES = [(1, 2, 256, 16), (2, 2, 128, 16)] if QUICK else [
    (1, 8, 2048, 64), (4, 8, 1024, 64), (2, 4, 8192, 64), (1, 1, 16384, 64), (1, 8, 4096, 128)]
#: (M, K, N) of NumPy's products in a 4-layer d_model-512 transformer: decoding (batch 1 and 8) and prefill.
MATMULS = [(8, 64, 64), (64, 64, 192)] if QUICK else [
    (1, 512, 1536), (8, 512, 1536), (8, 512, 2048), (8, 2048, 512), (512, 512, 1536), (2048, 512, 1536),
    (2048, 512, 2048), (2048, 2048, 512)]
SHAPE_AFTER_MATMUL = (1, 2, 128, 16) if QUICK else (1, 8, 2048, 64)
#: (B, H, N, D) of the small and mid calls of part 5.
SMALL_CALLS = [(1, 4, 16, 16), (1, 1, 64, 16)] if QUICK else [
    (1, 2, 16, 64), (1, 8, 16, 64), (4, 8, 16, 16), (1, 8, 64, 64), (1, 1, 64, 64), (1, 1, 256, 64),
    (1, 8, 256, 64), (4, 8, 128, 64)]
PAIRS = 1 if QUICK else 3  # alternating processes, each way
ROUNDS = 3 if QUICK else 25


def _run(args, **env):
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=dict(os.environ, **env))
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return res.stdout


def _best_per_call(fn, seconds):
    """The best time of one call over loops of calls lasting ``seconds`` each (at least 5 loops)."""
    fn()
    t = time.perf_counter()
    fn()
    calls = max(1, int(seconds / 5 / max(time.perf_counter() - t, 1e-7)))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def matmul_worker():
    """Prints the best time of each of MATMULS's products, with linattn loaded and run once."""
    import linattn

    linattn.causal_linear_attention(*(np.ones((1, 2, 64, 16), np.float32),) * 3)  # the pool, and sharing it
    rng = np.random.default_rng(0)
    times = {}
    for m, k, n in MATMULS:
        a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
        c = np.empty((m, n), np.float32)
        times[f"{m}x{k}x{n}"] = _best_per_call(lambda: np.matmul(a, b, out=c), 0.02 if QUICK else 0.2)
    print(json.dumps(times))


def after_matmul_worker():
    """Prints the causal forward's median time right after the QKV projection over its median alone."""
    import linattn

    b, h, n, d = SHAPE_AFTER_MATMUL
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b * n, h * d), np.float32)
    w = rng.standard_normal((h * d, 3 * h * d), np.float32) / np.sqrt(h * d)
    qkv = np.empty((b * n, 3 * h * d), np.float32)
    out = np.empty((b, h, n, d), np.float32)

    def heads():
        t = qkv.reshape(b, n, 3, h, d)
        return [t[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]

    np.matmul(x, w, out=qkv)
    q, k, v = heads()
    after, alone = [], []
    for _ in range(ROUNDS):
        np.matmul(x, w, out=qkv)
        t = time.perf_counter()
        linattn.causal_linear_attention(q, k, v, out=out)
        after.append(time.perf_counter() - t)
        time.sleep(0.01)
        linattn.causal_linear_attention(q, k, v, out=out)
        t = time.perf_counter()
        linattn.causal_linear_attention(q, k, v, out=out)
        alone.append(time.perf_counter() - t)
    print(json.dumps({"after_ms": 1e3 * float(np.median(after)), "alone_ms": 1e3 * float(np.median(alone))}))


def threads_worker():
    """Prints, for each of SMALL_CALLS, the best time of the causal forward and of its vjp's backward with
    the plan's threads, on one thread and on every thread (the thresholds set aside), and the plan's
    thread count."""
    import linattn
    from linattn import attention
    from linattn.cpu import runtime

    rng = np.random.default_rng(0)
    names = ("SECOND_THREAD_WORK", "SECOND_THREAD_WORK_ONE_HEAD", "MIN_WORK_PER_THREAD")
    planned = {name: getattr(runtime, name) for name in names}
    times = {}
    for b, h, n, d in SMALL_CALLS:
        q, k, v = (rng.standard_normal((b, h, n, d)).astype(np.float32) * 0.5 for _ in range(3))
        row = {}
        for label, value in (("plan", None), ("one", 1 << 60), ("all", 1)):
            for name in names:
                setattr(runtime, name, planned[name] if value is None else value)
            runtime._plans.clear()  # (the plans kept for the thresholds before)
            attention._constants.clear()
            if value is None:
                row["threads"] = runtime.plan(b * h, n, d, d)[2]
            out, vjp = linattn.causal_linear_attention_vjp(q, k, v)
            row[label] = [_best_per_call(lambda: linattn.causal_linear_attention(q, k, v), 0.02 if QUICK else 0.2),
                          _best_per_call(lambda: vjp(out), 0.02 if QUICK else 0.2)]
        times[f"B{b} H{h} N{n} D{d}"] = row
    for name in names:
        setattr(runtime, name, planned[name])
    print(json.dumps(times))


def main():
    print(_run(["-m", "linattn", "info"]).rstrip(), flush=True)

    print("\n2. causal forward over a same-FLOP GEMM timed in turn (x GEMM), two runs each", flush=True)
    worst = {}
    case_args = [a for c in PEER_CASES for a in ("--case", ",".join(map(str, c)))]
    for label, env in (("all threads", {}), ("8 threads", {"NUMBA_NUM_THREADS": "8"})):
        runs = [json.loads(_run(["-m", "linattn", "bench", "--no-progress", "--json", *case_args], **env)
                           .strip().splitlines()[-1]) for _ in range(2)]
        for i, case in enumerate(PEER_CASES):
            ratios = [r[i]["linattn_ms"] / r[i]["gemm_ms"] for r in runs]
            worst[case] = max(worst.get(case, 0.0), *ratios)
            ms = ", ".join(f"{r[i]['linattn_ms']:.3f}" for r in runs)
            print(f"  {label:11s} B{case[0]} H{case[1]} N{case[2]} D{case[3]}: linattn {ms} ms, x GEMM "
                  f"{', '.join(f'{x:.2f}' for x in ratios)}", flush=True)
    over = [c for c, x in worst.items() if x > 2.5]
    verdict = "(quick sizes: none)" if QUICK else "met" if not over else f"NOT met for {over}"
    print(f"  largest x GEMM {max(worst.values()):.2f}; issue 10's <= 2.5 in every run: {verdict}", flush=True)

    print("\n3. NumPy's matmuls, OpenBLAS on linattn's pool over OpenBLAS's own threads (alternating "
          "processes)", flush=True)
    shared, own = [], []
    for _ in range(PAIRS):
        shared.append(json.loads(_run([__file__, "--worker", "matmul", *sys.argv[1:]]).strip().splitlines()[-1]))
        own.append(json.loads(_run([__file__, "--worker", "matmul", *sys.argv[1:]],
                                   LINATTN_SHARE_BLAS_THREADS="0").strip().splitlines()[-1]))
    for shape in shared[0]:
        ratios = [s[shape] / o[shape] for s, o in zip(shared, own)]
        print(f"  {shape:16s} {min(s[shape] for s in shared) * 1e6:9.1f} us shared, "
              f"{min(o[shape] for o in own) * 1e6:9.1f} us own: ratios {', '.join(f'{x:.2f}' for x in ratios)}",
              flush=True)

    print("\n4. causal forward right after the QKV projection over the same call alone", flush=True)
    for _ in range(PAIRS):
        r = json.loads(_run([__file__, "--worker", "after", *sys.argv[1:]]).strip().splitlines()[-1])
        print(f"  {r['after_ms']:.3f} ms after, {r['alone_ms']:.3f} ms alone: {r['after_ms'] / r['alone_ms']:.2f}x",
              flush=True)

    print("\n5. small and mid calls, forward / backward, us: the plan's threads, one thread, every thread "
          "(two processes)", flush=True)
    runs = [json.loads(_run([__file__, "--worker", "threads", *sys.argv[1:]]).strip().splitlines()[-1])
            for _ in range(2)]
    slower = []
    for case in runs[0]:
        rows = [r[case] for r in runs]
        cols = [" / ".join(f"{min(r[label][i] for r in rows) * 1e6:.1f}" for i in range(2)) for label in
                ("plan", "one", "all")]
        print(f"  {case:18s} plan ({rows[0]['threads']} threads) {cols[0]}; one {cols[1]}; all {cols[2]}", flush=True)
        for i in range(2):
            best_plan = min(r["plan"][i] for r in rows)
            if best_plan > 1.1 * min(min(r[label][i] for r in rows) for label in ("one", "all")):
                slower.append(f"{case} {('forward', 'backward')[i]}")
    print(f"  the plan more than 10% slower than one or every thread: {', '.join(slower) or 'none'}", flush=True)
    print("\ndone")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        {"matmul": matmul_worker, "after": after_matmul_worker,
         "threads": threads_worker}[sys.argv[sys.argv.index("--worker") + 1]]()
    else:
        main()
