"""One long sequence through linattn on a Dask cluster, from Zarr to Zarr, never gathered on the client.

q, k, v are written to Zarr arrays chunked along N (by the workers), read by the workers, causal
linear attention runs over the blocks (two parallel passes and a scan over the blocks' states), and
the output is written back to Zarr. The first positions are checked against one NumPy call.

    python examples/dask_zarr.py                       # N = 2**22, D = Dv = 64, 16 blocks, 2 workers
    python examples/dask_zarr.py --small               # N = 2**14, quick
    python examples/dask_zarr.py --bench               # also: one process doing the same, in memory

Start it on an existing cluster with ``--scheduler tcp://scheduler:8786`` (the store must then be a
path every worker sees, e.g. a shared file system or object storage URL).
"""
import argparse
import os
import resource
import shutil
import tempfile
import time

import dask
import dask.array as da
import numpy as np
import zarr
from distributed import Client, LocalCluster

import linattn


def _peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="N = 2**14")
    parser.add_argument("--n", type=int, default=None, help="sequence length (default 2**22)")
    parser.add_argument("--d", type=int, default=64, help="D = Dv")
    parser.add_argument("--blocks", type=int, default=16, help="Zarr/Dask blocks along N")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--store", default=None, help="directory for the Zarr arrays (default: a temporary one)")
    parser.add_argument("--scheduler", default=None, help="address of an existing scheduler")
    parser.add_argument("--bench", action="store_true", help="time one process doing the same, too")
    args = parser.parse_args()
    n = args.n or (2 ** 14 if args.small else 2 ** 22)
    d, blocks = args.d, args.blocks
    root = args.store or tempfile.mkdtemp(prefix="linattn-zarr-")
    path = {name: os.path.join(root, name + ".zarr") for name in ("q", "k", "v", "out", "out1")}

    if args.scheduler:
        client = Client(args.scheduler)
    else:
        with dask.config.set(linattn.dask.worker_settings(1)):  # one Numba thread per single-threaded worker
            cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, host="127.0.0.1",
                                   dashboard_address=None)
        client = Client(cluster)
    try:
        chunks = (-(-n // blocks), d)
        rng = da.random.default_rng(0)
        for i, name in enumerate(("q", "k", "v")):  # written by the workers
            x = (rng.standard_normal((n, d), chunks=chunks, dtype=np.float32) * np.float32(0.5 if i < 2 else 1))
            da.to_zarr(x, path[name], overwrite=True)
        q, k, v = (da.from_zarr(path[name]) for name in ("q", "k", "v"))

        if not args.scheduler:
            client.restart()  # fresh workers: their peak memory is then the attention's alone
        client.run(lambda: linattn.causal_linear_attention(*np.ones((3, 64, d), np.float32)))  # load kernels
        out = linattn.causal_linear_attention(q, k, v)  # lazy: a dask array
        tasks = len(dict(out.__dask_graph__()))
        t = time.perf_counter()
        da.to_zarr(out, path["out"], overwrite=True)  # read, attention, write: on the workers
        t_cluster = time.perf_counter() - t
        peak = client.run(_peak_rss_mib)
        print(f"N={n} D=Dv={d}, {blocks} blocks, {len(peak)} workers: Zarr -> attention -> Zarr in "
              f"{t_cluster:.2f} s; {tasks} tasks in the graph; peak memory per worker "
              f"{', '.join(f'{m:.0f}' for m in peak.values())} MiB")

        m = min(n, 1 << 16)  # causal: the first m outputs need only the first m positions
        first = [zarr.open_array(path[name], mode="r")[:m] for name in ("q", "k", "v")]
        got = zarr.open_array(path["out"], mode="r")[:m]
        want = linattn.causal_linear_attention(*first)
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        print(f"first {m} positions vs one NumPy call: max relative error {err:.1e}")
        if not err < 1e-5:
            raise SystemExit("the cluster's result differs from one NumPy call")

        if args.bench:
            t = time.perf_counter()  # one process: read everything, attend, write everything
            q1, k1, v1 = (zarr.open_array(path[name], mode="r")[:] for name in ("q", "k", "v"))
            res = linattn.causal_linear_attention(q1, k1, v1)
            z = zarr.open_array(path["out1"], mode="w", shape=res.shape, chunks=chunks, dtype=res.dtype)
            z[:] = res
            t_one = time.perf_counter() - t
            t = time.perf_counter()
            linattn.causal_linear_attention(q1, k1, v1)
            t_mem = time.perf_counter() - t
            print(f"one process, Zarr -> attention -> Zarr: {t_one:.2f} s (cluster / one process: "
                  f"{t_cluster / t_one:.2f}); attention alone, in memory: {t_mem:.3f} s")
    finally:
        client.close()
        if not args.scheduler:
            cluster.close()
        if args.store is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
