"""The CPUs this process may actually keep busy, for sizing thread pools.

`os.cpu_count()` is the node's cores; a process may be allowed far fewer:
its affinity mask (taskset, cpusets, Kubernetes' static CPU manager) and its
cgroup's CPU quota (a container's CPU limit, enforced by the CFS bandwidth
controller) both bound it. torch sizes its thread pool by the node, so a
worker in a 2-CPU pod on a 64-core node would run 64 threads in 2 CPUs of
time, each parallel region waiting for threads the kernel has throttled.

    usable = min(len(affinity mask), ceil(tightest quota on the cgroup path)), >= 1

No torch here: the launcher and the scheduler import this.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class UsableCpus:
    num_cpus: int  # whole CPUs this process may keep busy; >= 1
    reason: str  # where the count came from, for a log line


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (all of them where there is no mask)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def cgroup_cpu_quota(
    proc_cgroup: Path = PROC_SELF_CGROUP, cgroup_root: Path = CGROUP_ROOT
) -> float | None:
    """The tightest CPU quota (in CPUs, e.g. 1.5) on this process's cgroup
    and its ancestors, or None where none is set or none can be read.

    `proc_cgroup` is /proc/self/cgroup; `cgroup_root` where the hierarchies
    are mounted. The cpu controller lives in exactly one hierarchy: cgroup v1
    (`cpu.cfs_quota_us` / `cpu.cfs_period_us`, -1 = none) when a v1 line names
    it, else cgroup v2 (`cpu.max`: "<quota> <period>" or "max <period>").
    Ancestors count because a parent's limit binds its children (a pod's
    limit over its containers'). Where the cgroup's path does not exist under
    the mount (a container sees its own cgroup at the mount's root), the
    walk up reaches the root and reads it there."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    v2_path = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "cpu" in controllers.split(","):
            mounts = [cgroup_root / controllers, cgroup_root / "cpu"]
            base = next((m for m in mounts if m.is_dir()), None)
            return None if base is None else _tightest(base, path, _v1_quota)
        if hierarchy == "0" and not controllers:
            v2_path = path
    if v2_path is None:
        return None
    # Pure v2 mounts the hierarchy at the root; hybrid systems at unified/.
    base = cgroup_root if (cgroup_root / "cgroup.controllers").exists() else cgroup_root / "unified"
    return _tightest(base, v2_path, _v2_quota)


def usable_cpus(
    proc_cgroup: Path = PROC_SELF_CGROUP, cgroup_root: Path = CGROUP_ROOT,
    affinity: int | None = None,
) -> UsableCpus:
    """The affinity mask bounded by the cgroup quota (rounded up: 1.5 CPUs
    of quota keep 2 threads busy part of the time), at least 1. `affinity`
    overrides the mask's size (for tests)."""
    allowed = affinity_cpus() if affinity is None else affinity
    node = os.cpu_count() or allowed
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    if quota is not None and math.ceil(quota) < allowed:
        rounded = "" if quota == math.ceil(quota) else ", rounded up"
        return UsableCpus(max(1, math.ceil(quota)),
                          f"cgroup CPU quota {quota:g} of {node} CPUs{rounded}")
    if allowed < node:
        return UsableCpus(allowed, f"affinity mask {allowed} of {node} CPUs")
    return UsableCpus(allowed, f"all {allowed} CPUs: no smaller affinity mask or cgroup quota")


def threads_per_worker(usable: UsableCpus, num_workers: int, num_reserved: int = 0) -> int:
    """Usable CPUs, less `num_reserved` kept for other processes, shared
    evenly among `num_workers` workers on one host (rounded down: a remainder
    would oversubscribe), at least 1 each."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if num_reserved < 0:
        raise ValueError(f"num_reserved must be >= 0, got {num_reserved}")
    return max(1, (usable.num_cpus - num_reserved) // num_workers)


def _tightest(base: Path, path: str, read: Callable[[Path], float | None]) -> float | None:
    """The smallest quota `read` finds from base/path up to base."""
    directory = base / path.strip("/")
    found = []
    while True:
        quota = read(directory)
        if quota is not None:
            found.append(quota)
        if directory == base or base not in directory.parents:
            break
        directory = directory.parent
    return min(found, default=None)


def _v1_quota(directory: Path) -> float | None:
    quota = _read_int(directory / "cpu.cfs_quota_us")
    period = _read_int(directory / "cpu.cfs_period_us")
    if quota is None or period is None or quota <= 0 or period <= 0:
        return None
    return quota / period


def _v2_quota(directory: Path) -> float | None:
    try:
        fields = (directory / "cpu.max").read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None

