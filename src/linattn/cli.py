"""Command line: ``python -m linattn info``, ``python -m linattn bench`` and ``python -m linattn compile``."""
import argparse
import json
import os
import platform
import sys
import time

import numpy as np

#: (B, H, N, D) cases of the default benchmark; Dv = D.
BENCH_CASES = [(1, 8, 1024, 64), (4, 8, 512, 64), (1, 1, 8192, 64), (1, 8, 2048, 128)]
QUICK_CASES = [(1, 4, 256, 32), (2, 2, 512, 16)]


def _versions():
    import numba

    from . import __version__

    out = {"linattn": __version__, "python": platform.python_version(), "numpy": np.__version__,
           "numba": numba.__version__}
    try:
        import llvmlite

        out["llvmlite"] = llvmlite.__version__
    except ImportError:  # pragma: no cover - numba requires it
        pass
    return out


def info():
    """Facts about this installation, as a dict."""
    import numba

    from . import _jit, _tuning
    from .attention import causal_linear_attention
    from .cpu import chunked, cpu_quota, runtime

    try:
        _jit.require_compiler()
    except RuntimeError as exc:  # (NUMBA_DISABLE_JIT: nothing compiles, the rest cannot be found out)
        return dict(_versions(), advice=[str(exc)])
    causal_linear_attention(np.ones((2, 2, 8, 2), np.float32), np.ones((2, 2, 8, 2), np.float32),
                            np.ones((2, 2, 8, 2), np.float32))  # starts the thread pool, loads a kernel
    layer = _threading_layer()
    disp = chunked.causal_forward.get(np.float32, ("C", 0)).worker
    cache = getattr(getattr(disp, "_cache", None), "cache_path", None)
    if cache is not None and getattr(disp._cache, "read_only", False):
        cache += " (precompiled, read only)"
    facts = _versions()
    facts.update({
        "cpu": _tuning.describe(),
        "threads": numba.get_num_threads(),
        "NUMBA_NUM_THREADS": numba.config.NUMBA_NUM_THREADS,
        "cpu_quota": cpu_quota.cpus(),
        "linattn_threads": runtime.num_threads(),
        "threads_cap_by": runtime.cap_source,
        "threading_layer": layer,
        "cache_dir": cache if _jit.cache_problem is None else None,
        "cache_problem": _jit.cache_problem,
        "cuda": _cuda_status(),
    })
    facts["blas"], advice = _blas_report()
    advice = (advice or []) + _quota_advice() + _cpu_name_advice()
    facts["advice"] = advice or None
    return facts


def _quota_advice():
    """What to set where a BLAS runs more threads than the process's CPU quota allows (its threads would use
    up the quota early in each period, then stand still until the next; linattn's keep to it)."""
    from threadpoolctl import threadpool_info

    from .cpu import cpu_quota

    quota, advice = cpu_quota.threads(), []
    if quota is None:
        return advice
    cpus = cpu_quota.cpus()
    for lib in threadpool_info():
        threads, api = lib.get("num_threads", 1), lib.get("internal_api")
        if lib.get("user_api") != "blas" or threads <= quota:
            continue
        variable = {"openblas": "OPENBLAS_NUM_THREADS", "mkl": "MKL_NUM_THREADS"}.get(api, "OMP_NUM_THREADS")
        advice.append(f"this process may use {cpus:g} CPU{'' if cpus == 1 else 's'} (its cgroup's CPU quota) "
                      f"but {os.path.basename(lib['filepath'])} runs {threads} threads, which use up the quota "
                      f"early in each period and then stand still until the next: start Python with "
                      f"{variable}={quota} (linattn's own kernels keep to the quota)")
    return advice


def _cpu_name_advice():
    """What to unset where NUMBA_CPU_NAME has Numba compile for another CPU than this one ("generic", set for a
    cache that machines share: linattn keeps each CPU's code apart in such a cache anyway)."""
    import numba
    from llvmlite import binding

    name, host = numba.config.CPU_NAME, binding.get_host_cpu_name()
    if not name or name in ("host", host):
        return []
    return [f"NUMBA_CPU_NAME={name}: linattn's kernels are compiled for that CPU instead of this one ({host}), "
            f"without its vector instructions where it lacks them ('generic' on a Zen 4: 3.1x slower, B1 H8 N2048). "
            f"A cache directory that machines share keeps each CPU's code apart (its entries name the CPU), "
            f"so linattn needs no common name: unset it for linattn's processes"]


def _blas_report():
    """The BLAS libraries loaded (whether they share linattn's thread pool), and what to set when a
    threaded one cannot: its idle threads would spin on the cores linattn's kernels need next."""
    from threadpoolctl import threadpool_info

    from .cpu.runtime import blas_sharing

    shared = blas_sharing()
    libs, advice = [], []
    for lib in threadpool_info():
        if lib.get("user_api") != "blas":
            continue
        path, api, threads = lib["filepath"], lib.get("internal_api"), lib.get("num_threads", 1)
        sharing = shared.get(path, False)
        libs.append(f"{os.path.basename(path)} ({api} {lib.get('version')}, {threads} threads"
                    f"{', runs on linattn pool' if sharing else ''})")
        if threads <= 1 or sharing:
            continue
        if api == "openblas":
            advice.append(f"{os.path.basename(path)} keeps its own threads, which spin ~0.1 s after each "
                          "call on the cores linattn needs next: start Python with OPENBLAS_THREAD_TIMEOUT=4 "
                          + _why_not_shared(path))
        elif api == "mkl":
            advice.append(f"{os.path.basename(path)} (MKL) keeps its own threads, which spin after each call "
                          "(Intel OpenMP: 200 ms by default): start Python with KMP_BLOCKTIME=0")
        else:
            advice.append(f"{os.path.basename(path)} ({api}) keeps threads of its own that linattn cannot share")
    return libs, advice or None


def _why_not_shared(path):
    """Why the OpenBLAS at ``path`` keeps threads of its own, in parentheses."""
    import numba

    from .cpu import blas_pool

    if blas_pool.turned_off():
        return f"(LINATTN_SHARE_BLAS_THREADS={os.environ['LINATTN_SHARE_BLAS_THREADS']} is set)"
    if blas_pool._setter(path) is None:
        return "(or use OpenBLAS 0.3.27 or later, whose threads linattn shares)"
    if blas_pool._platform() is None:
        return "(linattn shares OpenBLAS's threads on Linux and macOS only)"
    layer = numba.threading_layer()
    if layer not in ("omp", "tbb"):
        return f"(linattn shares OpenBLAS's threads on Numba's omp or tbb threading layer; this process runs {layer})"
    return "(loaded after linattn started its threads: it shares the OpenBLAS libraries loaded by then)"


def _cuda_status():
    try:
        from .cuda import availability
    except ImportError:
        return "not built in"
    return availability()


#: Calls before a fast call is timed (or WARMUP_SECONDS, whichever ends first). The first calls on many
#: threads are slower: each thread's first work items fault in its allocator's memory (measured with 16
#: threads on 2 cores: 23-112 page faults in each of calls 2 to 10, none later; on a fresh VM whose memory
#: is mapped on first touch each fault is expensive), and the cores' clocks and caches settle.
WARMUP_CALLS, WARMUP_SECONDS = 10, 0.3


#: A fast call is timed over at least TIMED_SECONDS (at least 5 calls, at most TIMED_MOST), its best
#: taken: on a shared VM a window of five calls of ~1.5 ms can fall wholly in a noisy moment.
TIMED_SECONDS, TIMED_MOST = 0.2, 200


def _best_times(fns, repeat=5, budget=1.0, warmup=0, min_seconds=0.0, most=TIMED_MOST):
    """Best wall time of each of ``fns``, called in turn (a round: each once), over at least ``repeat``
    rounds and ``min_seconds`` seconds (at most ``most`` rounds; stopping at ``budget`` seconds once two
    rounds are in), after up to ``warmup`` untimed rounds (at most WARMUP_SECONDS of them)."""
    start = time.perf_counter()
    for _ in range(warmup):
        for fn in fns:
            fn()
        if time.perf_counter() - start > WARMUP_SECONDS:
            break
    best, start, rounds = [float("inf")] * len(fns), time.perf_counter(), 0
    while True:
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            now = time.perf_counter()
            best[i] = min(best[i], now - t)
        rounds += 1
        if rounds >= 2 and now - start > budget:
            break
        if rounds >= repeat and (now - start >= min_seconds or rounds >= most):
            break
    return best


def _time(fn, **kwargs):
    """_best_times of ``fn`` alone."""
    return _best_times([fn], **kwargs)[0]


def bench(cases=None, quick=False, progress=True, stream=sys.stdout):
    """Time linattn against the NumPy reference forms and a same-FLOP GEMM; returns the rows.

    Where every threaded BLAS loaded runs its threads on linattn's pool (``python -m linattn info``
    says so), linattn and the GEMM are timed in turn, call by call, so that both meet the same moments
    of a shared machine. Otherwise linattn is timed for every case first: a BLAS with threads of its
    own leaves them spinning for a while after each call, which would slow whatever runs next.
    """
    from . import reference
    from .attention import causal_linear_attention

    cases = cases or (QUICK_CASES if quick else BENCH_CASES)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None
    bar = tqdm(total=4 * len(cases), desc="linattn bench", file=sys.stderr, disable=not progress) if tqdm else None
    t_first = time.perf_counter()
    causal_linear_attention(*(np.ones((1, 4, 2), np.float32),) * 3)
    first_call = time.perf_counter() - t_first
    in_turn = _blas_report()[1] is None  # (no advice: no BLAS keeps threads of its own)
    machine = _machine_line(in_turn)
    inputs, outs, rows, gemms = [], [], [], []
    for (b, h, n, d) in cases:
        rng = np.random.default_rng(0)
        q, k, v = ((rng.standard_normal((b, h, n, d)) * 0.5).astype(np.float32) for _ in range(3))
        inputs.append((q, k, v))
        outs.append(causal_linear_attention(q, k, v))
        gemms.append(_gemm(b * h * n, d))
        fns = [lambda q=q, k=k, v=v: causal_linear_attention(q, k, v)] + ([gemms[-1]] if in_turn else [])
        best = _best_times(fns, warmup=WARMUP_CALLS, min_seconds=TIMED_SECONDS * len(fns))
        rows.append({"case": f"B={b} H={h} N={n} D={d}", "linattn_ms": best[0] * 1e3,
                     "timed": "in turn" if in_turn else "apart"})
        if in_turn:
            rows[-1]["gemm_ms"] = best[1] * 1e3
            bar and bar.update()
        bar and bar.update()
    if not in_turn:  # the GEMMs after every case's linattn
        for row, gemm in zip(rows, gemms):
            row["gemm_ms"] = _time(gemm, warmup=WARMUP_CALLS, min_seconds=TIMED_SECONDS) * 1e3
            bar and bar.update()
    for (b, h, n, d), row, (q, k, v), out in zip(cases, rows, inputs, outs):
        # The references are O(N^2) in memory / per-token Python: time them on one head and scale.
        q1, k1, v1 = q[:1, :1], k[:1, :1], v[:1, :1]
        ref = reference.masked(q1, k1, v1)
        row["max_rel_err"] = float(np.max(np.abs(out[:1, :1] - ref)) / np.max(np.abs(ref)))
        row["masked_ms"] = _time(lambda: reference.masked(q1, k1, v1), repeat=2) * 1e3 * b * h
        bar and bar.update()
        nl = min(n, 512)
        row["loop_ms"] = _time(lambda: reference.loop(q1[..., :nl, :], k1[..., :nl, :], v1[..., :nl, :]),
                               repeat=1) * 1e3 * b * h * n / nl
        bar and bar.update()
    bar and bar.close()
    _print_table(rows, first_call, stream)
    print(machine, file=stream)
    return rows


def _threading_layer():
    """Numba's threading layer, once a parallel kernel has run."""
    import numba

    try:
        return numba.threading_layer()
    except ValueError:
        return "none yet"


def _machine_line(blas_shares):
    """What a figure of ``bench`` depends on, in a line: CPUs, linattn's threads and layer, BLAS's threads."""
    from . import _tuning
    from .cpu import cpu_quota, runtime
    from .cpu.runtime import num_threads

    quota = f", a CPU quota of {cpu_quota.cpus():g}" if runtime.cap_source == "CPU quota" else ""
    return (f"This machine: {os.cpu_count()} CPUs ({_tuning.describe()}{quota}); "
            f"linattn on {num_threads()} thread{'' if num_threads() == 1 else 's'} ({_threading_layer()} layer); "
            + ("every threaded BLAS runs on linattn's pool." if blas_shares else
               "a BLAS keeps threads of its own (python -m linattn info says what to set)."))


def _gemm(rows, d):
    """The same-FLOP GEMM of a case: two (rows, d) x (d, d) products into a buffer (4*N*D*Dv FLOPs a head)."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((rows, d)).astype(np.float32)
    w = rng.standard_normal((d, d)).astype(np.float32)
    c = np.empty((rows, d), np.float32)
    return lambda: (np.matmul(a, w, out=c), np.matmul(a, w, out=c))


def _print_table(rows, first_call, stream):
    head = f"{'case':24s} {'linattn ms':>11s} {'x GEMM':>7s} {'masked ms':>10s} {'speed-up':>9s} " \
           f"{'loop ms':>10s} {'speed-up':>9s} {'max rel err':>12s}"
    print(head, file=stream)
    print("-" * len(head), file=stream)
    for r in rows:
        print(f"{r['case']:24s} {r['linattn_ms']:11.3f} {r['linattn_ms'] / r['gemm_ms']:7.2f} "
              f"{r['masked_ms']:10.1f} {r['masked_ms'] / r['linattn_ms']:8.0f}x "
              f"{r['loop_ms']:10.1f} {r['loop_ms'] / r['linattn_ms']:8.0f}x {r['max_rel_err']:12.2e}",
              file=stream)
    together = rows and rows[0].get("timed") == "in turn"
    print(f"\nfloat32, causal, elu+1, the best of the calls in {TIMED_SECONDS} s (at least 5) after {WARMUP_CALLS} "
          f"warm-up calls; 'x GEMM': time over a same-FLOP BLAS GEMM (4*N*D*Dv per head), timed the same way "
          f"{'in turn with linattn, call by call' if together else 'after linattn (a BLAS keeps threads of its own)'}. "
          f"masked = reference.masked (O(N^2), float64), loop = reference.loop (per-token, float64), "
          f"both timed on one head (loop on <= 512 positions) and scaled. First call in this process "
          f"(compile or cache load): {first_call:.2f} s.", file=stream)


def _compile(args, parser):
    from .precompile import FUNCTIONS, precompile

    t = time.perf_counter()
    try:
        done = precompile(args.dtype or ["float32"], args.function or FUNCTIONS, gates=args.gates,
                          gradients=args.gradients, feature_map=args.feature_map,
                          progress=lambda name, secs: print(f"{secs:7.2f} s  {name}", flush=True))
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    from . import _jit

    where = "not cached: " + _jit.cache_problem if _jit.cache_problem else "in Numba's disk cache"
    print(f"{len(done)} items in {time.perf_counter() - t:.1f} s, {where}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m linattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, threads, threading layer, cache, CUDA")
    p_info.add_argument("--json", action="store_true", help="print JSON")
    p_bench = sub.add_parser("bench", help="time linattn against the NumPy reference forms")
    p_bench.add_argument("--quick", action="store_true", help="two small cases (a few seconds)")
    p_bench.add_argument("--case", action="append", metavar="B,H,N,D",
                         help="a case to run instead of the defaults (repeatable)")
    p_bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_bench.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p_bench.add_argument("--model", action="store_true",
                         help="time a small transformer in NumPy with linattn (prefill and decoding), next to "
                              "the same model in PyTorch when torch is installed")
    p_bench.add_argument("--rounds", type=int, metavar="R",
                         help="with --model: timed prefills of each model, in turn (default 9; more rounds, a "
                              "narrower interval for attention's cost inside the model)")
    p_compile = sub.add_parser("compile", help="compile the kernels of the common calls into the disk cache now")
    p_compile.add_argument("--dtype", action="append", choices=["float32", "float64"],
                           help="a computation dtype (repeatable; default float32)")
    p_compile.add_argument("--function", action="append", choices=["causal", "noncausal", "step"],
                           help="what to compile (repeatable; default all three)")
    p_compile.add_argument("--gates", action="store_true", help="also decay= and both kinds of gate")
    p_compile.add_argument("--gradients", action="store_true", help="also the vjps and their backward")
    p_compile.add_argument("--feature-map", default="elu", help="a feature map by name (default elu)")
    args = parser.parse_args(argv)
    from . import _jit
    from .cpu import blas_pool, runtime

    try:
        runtime._read_cap()  # linattn's variables, read as the first call reads them (a bad value: one line)
        blas_pool.turned_off()
        if args.command != "info":
            _jit.require_compiler()
    except (RuntimeError, ValueError) as exc:
        parser.exit(1, f"python -m linattn {args.command}: {exc}\n")
    if args.command == "compile":
        return _compile(args, p_compile)
    if args.command == "info":
        facts = info()
        if args.json:
            print(json.dumps(facts, indent=2))
        else:
            for key, val in facts.items():
                if isinstance(val, list):
                    for i, item in enumerate(val):
                        print(f"{key if i == 0 else '':18s} {item}")
                else:
                    print(f"{key:18s} {val}")
        return 0
    if args.rounds is not None and (not args.model or args.rounds < 2):
        parser.error(f"--rounds: expected an integer >= 2 with --model, got {args.rounds}"
                     + ("" if args.model else " without --model"))
    if args.model:
        from .benchmarks import model

        rows, _ = model.run(quick=args.quick, **({} if args.rounds is None else {"rounds": args.rounds}))
        if args.json:
            print(json.dumps(rows))
        return 0
    cases = None
    if args.case:
        try:
            cases = [tuple(int(x) for x in c.split(",")) for c in args.case]
            if any(len(c) != 4 or min(c) < 1 for c in cases):
                raise ValueError
        except ValueError:
            parser.error("--case: expected four positive integers B,H,N,D, e.g. --case 1,8,1024,64")
    rows = bench(cases, quick=args.quick, progress=not args.no_progress and not os.environ.get("CI"))
    if args.json:
        print(json.dumps(rows))
    return 0
