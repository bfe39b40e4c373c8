"""linattn's results on the machine it runs on, checked against the float64 reference in a few calls (each
kernel kind compiled once): run by tools/arm64_check.sh under emulation, where compiling takes minutes.
Exits non-zero on a wrong result."""
import platform
import threading
import time

import numba
import numpy as np

import linattn
from linattn.cpu import runtime

t_start = time.perf_counter()
rng = np.random.default_rng(0)
B, H, N, D, Dv = 2, 3, 70, 16, 12
q, k, v = (rng.standard_normal(s).astype(np.float32) * 0.5 for s in [(B, H, N, D), (B, H, N, D), (B, H, N, Dv)])
q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
ref = linattn.reference.masked(q64, k64, v64)


def check(name, got, want, tol):
    err = float(np.abs(got - want).max())
    print(f"{name}: largest error {err:.2e} ({time.perf_counter() - t_start:.0f} s so far)", flush=True)
    assert err < tol, name


out, _ = linattn.causal_linear_attention(q, k, v, return_state=True)
print("machine", platform.machine(), "linattn", linattn.__version__, "numba", numba.__version__, "layer",
      numba.threading_layer(), "threads", numba.get_num_threads(), flush=True)
check("causal", out, ref, 1e-5)
a, s1 = linattn.causal_linear_attention(q[..., :33, :], k[..., :33, :], v[..., :33, :], return_state=True)
b = linattn.causal_linear_attention(q[..., 33:, :], k[..., 33:, :], v[..., 33:, :], initial_state=s1)
check("split and resumed through the state", np.concatenate([a, b], axis=2), ref, 1e-5)
c, s2 = linattn.causal_linear_attention(q[..., 33:36, :], k[..., 33:36, :], v[..., 33:36, :], initial_state=s1,
                                        return_state=True)  # (step's kernel, reading s1 and writing a new state)
check("a few positions from a State", c, ref[..., 33:36, :], 1e-5)
st = linattn.State.zeros((B, H), D, Dv)
check("step", np.stack([linattn.step(q[:, :, i], k[:, :, i], v[:, :, i], st) for i in range(3)], axis=2),
      ref[:, :, :3], 1e-5)
check("non-causal", linattn.linear_attention(q, k, v), linattn.reference.masked(q64, k64, v64, causal=False), 1e-5)
g = -rng.random((B, H, N, D)) * 0.3
check("gate per key dimension, float64", linattn.causal_linear_attention(q64, k64, v64, gate=g),
      linattn.reference.masked(q64, k64, v64, gate=g), 1e-12)

# the vjp's dq along a random direction against a central difference of the forward (float64)
out64, vjp = linattn.causal_linear_attention_vjp(q64, k64, v64, gate=g)
dout = rng.standard_normal(out64.shape)
dq = vjp(dout)[0]
u = rng.standard_normal(q64.shape)
h = 1e-6
fd = np.sum((linattn.causal_linear_attention(q64 + h * u, k64, v64, gate=g)
             - linattn.causal_linear_attention(q64 - h * u, k64, v64, gate=g)) * dout) / (2 * h)
check("vjp dq along a direction, against a central difference", np.sum(dq * u), fd, 1e-6 * max(1.0, abs(fd)))

# the non-causal vjp (cross-attention over padded keys, its backward from the forward's state): dk along a
# direction against a central difference
kc, vc = k64[..., :40, :], v64[..., :40, :]
lens = np.array([40, 23])
out64, vjp = linattn.linear_attention_vjp(q64, kc, vc, lengths=lens)
dout = rng.standard_normal(out64.shape)
dk = vjp(dout)[1]
u = rng.standard_normal(kc.shape)
fd = np.sum((linattn.linear_attention(q64, kc + h * u, vc, lengths=lens)
             - linattn.linear_attention(q64, kc - h * u, vc, lengths=lens)) * dout) / (2 * h)
check("non-causal vjp dk along a direction, against a central difference", np.sum(dk * u), fd,
      1e-6 * max(1.0, abs(fd)))

# one long head split between the threads, NumPy's matmuls and linattn's calls from several threads at once
q1, k1, v1 = (rng.standard_normal((1, 1, 2000, 16)).astype(np.float32) * 0.5 for _ in range(3))
one = linattn.causal_linear_attention(q1, k1, v1)
check("one head of 2000 positions", one, linattn.reference.masked(*(x.astype(np.float64) for x in (q1, k1, v1))),
      1e-5)
x, w = rng.standard_normal((600, 500)), rng.standard_normal((500, 700))
product = x @ w
print("BLAS sharing linattn's pool:", runtime.blas_sharing(), flush=True)
same = {}


def work(i):
    ok = True
    for _ in range(3):
        ok &= np.array_equal(x @ w, product) and np.array_equal(linattn.causal_linear_attention(q1, k1, v1), one)
    same[i] = ok


threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("three Python threads at once, every result the serial one:", same, flush=True)
assert all(same.values()) and len(same) == 3
print(f"all checks passed in {time.perf_counter() - t_start:.0f} s", flush=True)
