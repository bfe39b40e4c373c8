"""cpu_quota reads a cgroup's CPU quota (v1 and v2, a container's view and the host's) from trees of files
laid out as Linux shows them; runtime caps linattn's threads at it."""
import os
import subprocess
import sys

import numba
import pytest

from linattn.cpu import cpu_quota

_POOL = numba.config.NUMBA_NUM_THREADS

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


def _tree(tmp_path, cgroup, mountinfo, files):
    """The files under tmp_path (/proc/self/cgroup and mountinfo left out where None)."""
    for path, text in {"proc/self/cgroup": cgroup, "proc/self/mountinfo": mountinfo, **files}.items():
        if text is None:
            continue
        full = tmp_path / path
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_text(text)
    return str(tmp_path)


def test_v2_in_a_container(tmp_path):  # (a cgroup namespace: the container's group is "/")
    root = _tree(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "150000 100000\n"})
    assert cpu_quota.cpus(root) == 1.5 and cpu_quota.threads(root) == 2


def test_v2_a_parents_quota_binds(tmp_path):
    root = _tree(tmp_path, "0::/a/b\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "max 100000\n",
                                                   "sys/fs/cgroup/a/cpu.max": "50000 100000\n",
                                                   "sys/fs/cgroup/a/b/cpu.max": "400000 100000\n"})
    assert cpu_quota.cpus(root) == 0.5 and cpu_quota.threads(root) == 1


@pytest.mark.parametrize("text", ["max 100000\n", "max\n", "abc 100000\n", "0 100000\n", "100000 0\n", ""])
def test_v2_without_a_quota(tmp_path, text):
    root = _tree(tmp_path, "0::/a\n", V2_MOUNT, {"sys/fs/cgroup/a/cpu.max": text})
    assert cpu_quota.cpus(root) is None and cpu_quota.threads(root) is None


def test_v1_docker_without_a_namespace(tmp_path):  # (the mount's root is the container's group)
    mountinfo = ("40 31 0:35 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
                 "41 31 0:36 /docker/abc /sys/fs/cgroup/cpuset ro,nosuid - cgroup cgroup rw,cpuset\n")
    cgroup = "12:cpuset:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"
    root = _tree(tmp_path, cgroup, mountinfo, {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "250000\n",
                                               "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
                                               "sys/fs/cgroup/cpuset/cpu.cfs_quota_us": "10000\n",
                                               "sys/fs/cgroup/cpuset/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota.cpus(root) == 2.5 and cpu_quota.threads(root) == 3  # (cpuset's hierarchy not read)


def test_v1_on_the_host_walks_up_to_the_mount(tmp_path):
    mountinfo = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    files = {}
    for group, quota in (("", "-1"), ("svc/", "100000"), ("svc/w1/", "-1")):
        files[f"sys/fs/cgroup/cpu/{group}cpu.cfs_quota_us"] = quota + "\n"
        files[f"sys/fs/cgroup/cpu/{group}cpu.cfs_period_us"] = "100000\n"
    assert cpu_quota.cpus(_tree(tmp_path, "1:cpu:/svc/w1\n", mountinfo, files)) == 1.0
    files["sys/fs/cgroup/cpu/svc/cpu.cfs_quota_us"] = "-1\n"
    assert cpu_quota.cpus(_tree(tmp_path, "1:cpu:/svc/w1\n", mountinfo, files)) is None


def test_escaped_mount_points_and_the_smallest_of_both_versions(tmp_path):
    mountinfo = ("32 31 0:29 / /sys/fs/cgroup/my\\040cpu rw - cgroup cgroup rw,cpu\n"
                 "30 23 0:26 / /sys/fs/cgroup/unified rw shared:4 - cgroup2 cgroup2 rw\n")
    files = {"sys/fs/cgroup/my cpu/g/cpu.cfs_quota_us": "300000",
             "sys/fs/cgroup/my cpu/g/cpu.cfs_period_us": "100000",
             "sys/fs/cgroup/unified/g/cpu.max": "200000 100000"}
    assert cpu_quota.cpus(_tree(tmp_path, "1:cpu:/g\n0::/g\n", mountinfo, files)) == 2.0


@pytest.mark.parametrize("cgroup, mountinfo", [(None, V2_MOUNT), ("0::/\n", None), ("garbage\n", V2_MOUNT),
                                               ("0::/\n", "not a mountinfo line\n")])
def test_nothing_to_read(tmp_path, cgroup, mountinfo):
    root = _tree(tmp_path, cgroup, mountinfo, {"sys/fs/cgroup/cpu.max": "100000 100000\n"})
    assert cpu_quota.cpus(root) is None


_CAP_PROBE = """
import numpy as np, linattn
from linattn.cpu import cpu_quota, runtime
cpu_quota.threads = lambda root="/": 1  # a quota of one CPU, as a container's --cpus=1 would set
linattn.causal_linear_attention(*np.ones((3, 2, 64, 4)))
print(runtime.num_threads(), runtime.cap_source)
"""


@pytest.mark.parametrize("env, shown", [({}, "1 CPU quota"),
                                        ({"LINATTN_NUM_THREADS": "2"}, f"{min(2, _POOL)} LINATTN_NUM_THREADS")])
def test_a_quota_caps_the_kernels_threads(env, shown):
    """Under a quota of one CPU the kernels run on one thread; LINATTN_NUM_THREADS, where set, decides
    instead. (Measured in a cgroup of one CPU on two cores: docs/performance.md, stop 63.)"""
    base = {k: v for k, v in os.environ.items() if k != "LINATTN_NUM_THREADS"}
    res = subprocess.run([sys.executable, "-c", _CAP_PROBE], capture_output=True, text=True, timeout=300,
                         env=dict(base, **env))
    assert res.stdout.strip() == shown, res.stdout + res.stderr


def test_info_advises_a_blas_over_the_quota(monkeypatch):
    import threadpoolctl

    from linattn import cli

    monkeypatch.setattr(cpu_quota, "cpus", lambda root="/": 1.0)
    monkeypatch.setattr(cpu_quota, "threads", lambda root="/": 1)
    monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: [
        {"user_api": "blas", "internal_api": "openblas", "filepath": "/x/libopenblas.so", "num_threads": 4,
         "version": "0.3.30"},
        {"user_api": "blas", "internal_api": "mkl", "filepath": "/x/libmkl_rt.so", "num_threads": 1}])
    advice = cli._quota_advice()
    assert len(advice) == 1
    assert "may use 1 CPU (its cgroup's CPU quota) but libopenblas.so runs 4 threads" in advice[0]
    assert "OPENBLAS_NUM_THREADS=1" in advice[0]
    monkeypatch.setattr(cpu_quota, "threads", lambda root="/": None)
    assert cli._quota_advice() == []
