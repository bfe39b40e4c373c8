"""Profile linattn's compiled kernels with Linux perf, by function and instruction.

perf cannot name Numba's JIT code (no symbols, no code on disk). This script runs a workload, writes
the code and the function addresses of the kernels it names, and maps perf's samples onto them::

    NUMBA_CACHE_DIR=$(mktemp -d) perf record -e cpu-clock -F 5000 -o bw.data \\
        python tools/perf_jit.py run workload.py /tmp/bw
    python tools/perf_jit.py report /tmp/bw bw.data

``workload.py`` defines ``setup()`` returning (dispatchers, run, n): the Numba dispatchers whose
libraries to map (a ThreadedKernel's ``.get(dtype, variant).worker``, a Kernel's ``.get(...)``), a
callable, and how many times to call it. Use an empty ``NUMBA_CACHE_DIR``: code loaded from the disk
cache has no LLVM IR to read the function names from. Helpers LLVM did not inline show as functions
of their own; ``NRT_incref``/``NRT_decref`` are Numba's reference counts.
"""
import bisect
import collections
import ctypes
import json
import re
import runpy
import subprocess
import sys

_DEFINE = re.compile(r"^define [^@]*@(\"?[^(\"]+\"?)\(", re.M)


def _functions(library):
    found = {}
    for name in _DEFINE.findall(library.get_llvm_str()):
        name = name.strip('"')
        try:
            found[name] = library.get_pointer_to_function(name)
        except Exception:  # declared elsewhere
            pass
    return found


def run(workload, prefix):
    from linattn.cpu import symbols

    dispatchers, fn, n = runpy.run_path(workload)["setup"]()
    names = {}
    for d in dispatchers:
        for compiled in d.overloads.values():
            names.update(_functions(compiled.library))
    for symbol, compiled in symbols._registered.items():  # the C helpers kernels call by name
        names[symbol] = compiled.address
        names.update({"C:" + k: v for k, v in _functions(compiled._library).items()})
    spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in open("/proc/self/maps")
             if "x" in line.split()[1]]
    regions = []
    for a, b in spans:
        if any(a <= addr < b for addr in names.values() if addr):
            path = f"{prefix}_{len(regions)}.bin"
            with open(path, "wb") as f:
                f.write(ctypes.string_at(a, b - a))
            regions.append([a, b, path])
    with open(prefix + ".json", "w") as f:
        json.dump({"names": names, "regions": regions}, f)
    for _ in range(n):
        fn()


def report(prefix, data, top=30):
    meta = json.load(open(prefix + ".json"))
    short = lambda s: re.sub(r"B\d+v\d+B.*|_3clocals_3e|12_3clambda_3e", "", s.replace("_ZN7linattn3cpu", ""))[:70]
    syms = sorted((a, short(n)) for n, a in meta["names"].items() if a)
    starts = [a for a, _ in syms]
    ips = collections.Counter()
    listing = subprocess.run(["perf", "script", "-i", data, "-F", "ip"], capture_output=True, text=True).stdout
    for line in listing.split():
        ips[int(line, 16)] += 1
    inside = {ip: c for ip, c in ips.items() if any(a <= ip < b for a, b, _ in meta["regions"])}
    total = sum(inside.values()) or 1
    by_function = collections.Counter()
    for ip, c in inside.items():
        by_function[syms[bisect.bisect_right(starts, ip) - 1][1]] += c
    print(f"{sum(ips.values())} samples, {total} in the mapped JIT code")
    for name, c in by_function.most_common(25):
        print(f"{100 * c / total:6.1f}% {name}")
    code = {}
    for a, _, path in meta["regions"]:
        listing = subprocess.run(["objdump", "-D", "-b", "binary", "-mi386:x86-64", f"--adjust-vma={hex(a)}", path],
                                 capture_output=True, text=True).stdout
        for line in listing.splitlines():
            m = re.match(r"\s*([0-9a-f]+):\s+(?:[0-9a-f]{2} )+\s*(.*)", line)
            if m:
                code[int(m.group(1), 16)] = m.group(2)
    print("hottest instructions (a sample lands on the instruction after a slow one):")
    for ip, c in sorted(inside.items(), key=lambda x: -x[1])[:top]:
        name = syms[bisect.bisect_right(starts, ip) - 1][1]
        print(f"{100 * c / total:5.1f}% {hex(ip)} {name[:30]:30s} {code.get(ip, '?')[:70]}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    elif len(sys.argv) in (4, 5) and sys.argv[1] == "report":
        report(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:]))
    else:
        sys.exit(__doc__)
