"""The CPUs this process may use by its cgroup's CPU quota (a container's ``--cpus``, Kubernetes' CPU
limit), which neither ``os.cpu_count()`` nor the CPU affinity Numba sizes its pool by shows.

Under a quota of q CPUs a process may run q CPUs' worth of time per period (100 ms by default), on as
many cores as it likes: a kernel on 16 threads under a 2-CPU quota spends the period's time in an
eighth of it and is then stopped for the rest. linattn caps its threads at the quota, rounded up
(runtime.num_threads), unless LINATTN_NUM_THREADS says otherwise.

Read from Linux's cgroup files: cgroup v2's ``cpu.max`` ("max 100000", "200000 100000") and cgroup v1's
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none), in the process's own cgroup and every one above it
up to the mount (a parent's quota binds its children too); the smallest quota found counts. Nothing found,
or anything unreadable: None (no cap).
"""
import math
import os
import re


def cpus(root="/"):
    """The CPUs the quotas of this process's cgroups allow (a float, e.g. 1.5), or None where none is set
    or none can be read. ``root``: where the file system starts (tests give a tree of their own)."""
    groups = _read(os.path.join(root, "proc/self/cgroup"))
    mounts = _read(os.path.join(root, "proc/self/mountinfo"))
    if groups is None or mounts is None:
        return None
    v2_path, v1_path = None, None
    for line in groups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif "cpu" in parts[1].split(","):
            v1_path = parts[2]
    found = []
    for line in mounts.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        if len(fields) < dash + 2:
            continue
        fstype, mount_root, mount_point = fields[dash + 1], _unescape(fields[3]), _unescape(fields[4])
        if fstype == "cgroup2" and v2_path is not None:
            found += _walk(root, mount_point, _relative(v2_path, mount_root), _v2_quota)
        elif (fstype == "cgroup" and v1_path is not None and len(fields) > dash + 3
              and "cpu" in fields[dash + 3].split(",")):
            found += _walk(root, mount_point, _relative(v1_path, mount_root), _v1_quota)
    return min(found) if found else None


def threads(root="/"):
    """The quota's CPUs rounded up (a thread for a part of a CPU), or None without a quota."""
    q = cpus(root)
    return None if q is None else max(1, math.ceil(q - 1e-9))


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _unescape(path):
    """mountinfo's octal escapes (a space is \\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _relative(path, mount_root):
    """The cgroup ``path`` (from /proc/self/cgroup) below a mount of the hierarchy's ``mount_root``;
    "/" where the mount shows a part of the hierarchy that does not hold it (a container's own view)."""
    if mount_root == "/":
        return path
    if path == mount_root or path.startswith(mount_root.rstrip("/") + "/"):
        return path[len(mount_root.rstrip("/")):] or "/"
    return "/"


def _walk(root, mount_point, path, quota_of):
    """The quotas (CPUs) set in the cgroup at ``path`` below ``mount_point`` and in those above it, up to
    the mount's own."""
    base = os.path.join(root, mount_point.lstrip("/"))
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    found = []
    for depth in range(len(parts), -1, -1):
        q = quota_of(os.path.join(base, *parts[:depth]))
        if q is not None:
            found.append(q)
    return found


def _v2_quota(directory):
    text = _read(os.path.join(directory, "cpu.max"))
    if text is None:
        return None
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def _v1_quota(directory):
    quota = _read(os.path.join(directory, "cpu.cfs_quota_us"))
    period = _read(os.path.join(directory, "cpu.cfs_period_us"))
    if quota is None or period is None:
        return None
    return _ratio(quota.strip(), period.strip())


def _ratio(quota, period):
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
