"""Usable CPUs from fixture cgroup trees: real files laid out as the kernel
lays them out, under tmp_path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstash.common.cpu import (
    UsableCpus,
    affinity_cpus,
    cgroup_cpu_quota,
    threads_per_worker,
    usable_cpus,
)

POD = "/kubepods.slice/pod1/ctr"


def v2_tree(tmp_path: Path, cpu_max: dict[str, str], path: str = POD) -> tuple[Path, Path]:
    """A pure cgroup v2 mount with `cpu.max` written where given (relative
    directories, "" = the root). Returns (proc_cgroup, cgroup_root)."""
    root = tmp_path / "cgroup"
    (root / path.strip("/")).mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for directory, content in cpu_max.items():
        (root / directory / "cpu.max").write_text(content + "\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(f"0::{path}\n")
    return proc, root


def v1_tree(tmp_path: Path, quota: str, period: str = "100000",
            mount: str = "cpu,cpuacct") -> tuple[Path, Path]:
    """A cgroup v1 (hybrid) layout: the cpu controller's hierarchy at
    cgroup_root/`mount`, the process in /docker/abc."""
    root = tmp_path / "cgroup"
    directory = root / mount / "docker" / "abc"
    directory.mkdir(parents=True)
    (directory / "cpu.cfs_quota_us").write_text(quota + "\n")
    (directory / "cpu.cfs_period_us").write_text(period + "\n")
    (root / "unified").mkdir()
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(f"12:memory:/docker/abc\n4:{mount}:/docker/abc\n0::/docker/abc\n")
    return proc, root


def test_v2_quota_rounds_up(tmp_path: Path) -> None:
    proc, root = v2_tree(tmp_path, {POD.strip("/"): "150000 100000"})
    assert cgroup_cpu_quota(proc, root) == 1.5
    usable = usable_cpus(proc, root, affinity=16)
    assert usable.num_cpus == 2
    assert "cgroup CPU quota 1.5" in usable.reason and "rounded up" in usable.reason


def test_v2_max_means_the_affinity_mask(tmp_path: Path) -> None:
    proc, root = v2_tree(tmp_path, {POD.strip("/"): "max 100000", "": "max 100000"})
    assert cgroup_cpu_quota(proc, root) is None
    assert usable_cpus(proc, root, affinity=3).num_cpus == 3


def test_v2_an_ancestors_tighter_quota_binds(tmp_path: Path) -> None:
    proc, root = v2_tree(tmp_path, {POD.strip("/"): "800000 100000",
                                    "kubepods.slice/pod1": "300000 100000"})
    assert cgroup_cpu_quota(proc, root) == 3.0
    assert usable_cpus(proc, root, affinity=16) == UsableCpus(
        3, f"cgroup CPU quota 3 of {os.cpu_count()} CPUs")


def test_v2_own_cgroup_at_the_mount_root(tmp_path: Path) -> None:
    """In a container (cgroup namespace or not) the process's own cgroup is
    mounted at the root, whatever path /proc/self/cgroup names."""
    proc, root = v2_tree(tmp_path, {"": "200000 100000"})
    proc.write_text("0::/kubepods/burstable/pod9/elsewhere\n")
    assert cgroup_cpu_quota(proc, root) == 2.0


def test_v1_quota(tmp_path: Path) -> None:
    proc, root = v1_tree(tmp_path, "250000")
    assert cgroup_cpu_quota(proc, root) == 2.5
    assert usable_cpus(proc, root, affinity=8).num_cpus == 3


def test_v1_unlimited_is_minus_one(tmp_path: Path) -> None:
    proc, root = v1_tree(tmp_path, "-1", mount="cpu")
    assert cgroup_cpu_quota(proc, root) is None
    assert usable_cpus(proc, root, affinity=4).num_cpus == 4


def test_v1_wins_over_v2_on_a_hybrid_system(tmp_path: Path) -> None:
    """The cpu controller is bound to v1 there; unified/ holds no cpu.max that counts."""
    proc, root = v1_tree(tmp_path, "100000")
    (root / "unified" / "cpu.max").write_text("800000 100000\n")
    assert cgroup_cpu_quota(proc, root) == 1.0


def test_missing_files_mean_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path / "no-such-file", tmp_path) is None
    proc, root = v2_tree(tmp_path, {})  # no cpu.max anywhere
    assert cgroup_cpu_quota(proc, root) is None
    assert usable_cpus(proc, root, affinity=5).num_cpus == 5
    proc.write_text("garbage\n4:cpu:/x\n")  # v1 cpu line, but no v1 mount
    assert cgroup_cpu_quota(proc, root) is None


def test_malformed_files_mean_no_quota(tmp_path: Path) -> None:
    proc, root = v2_tree(tmp_path, {POD.strip("/"): "lots 100000"})
    assert cgroup_cpu_quota(proc, root) is None
    proc, root = v1_tree(tmp_path / "v1", "250000", period="0")
    assert cgroup_cpu_quota(proc, root) is None


def test_affinity_smaller_than_quota(tmp_path: Path) -> None:
    proc, root = v2_tree(tmp_path, {POD.strip("/"): "400000 100000"})
    usable = usable_cpus(proc, root, affinity=2)
    assert usable.num_cpus == 2
    if (os.cpu_count() or 0) > 2:
        assert "affinity mask 2 of" in usable.reason


def test_tiny_quota_still_one_cpu(tmp_path: Path) -> None:
    proc, root = v2_tree(tmp_path, {POD.strip("/"): "10000 100000"})
    assert usable_cpus(proc, root, affinity=4).num_cpus == 1


def test_this_process_matches_its_affinity_mask() -> None:
    """On the real host: never more than the mask, always at least 1."""
    assert 1 <= usable_cpus().num_cpus <= affinity_cpus() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("num_cpus", "num_workers", "num_reserved", "each"), [
    (2, 2, 0, 1), (16, 3, 0, 5), (2, 3, 0, 1), (8, 1, 0, 8),
    (2, 1, 1, 1), (16, 3, 1, 5), (17, 2, 1, 8), (1, 1, 1, 1),
])
def test_threads_per_worker_shares_without_oversubscribing(
    num_cpus: int, num_workers: int, num_reserved: int, each: int,
) -> None:
    usable = UsableCpus(num_cpus, "test")
    assert threads_per_worker(usable, num_workers, num_reserved) == each


def test_threads_per_worker_refuses_bad_counts() -> None:
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        threads_per_worker(UsableCpus(4, "test"), 0)
    with pytest.raises(ValueError, match="num_reserved must be >= 0, got -1"):
        threads_per_worker(UsableCpus(4, "test"), 1, -1)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs an affinity mask of 2+ CPUs to narrow")
def test_the_arena_copy_threads_follow_the_cpus_this_process_may_use() -> None:
    """They were sized by the node's CPUs: 8 hashing threads beside torch's
    2 in a 2-CPU pod on a big node."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from kvstash.cache_sdk import shared_arena; "
            "print(shared_arena._hashers._max_workers)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True, cwd=Path(__file__).resolve().parents[3])
    assert int(out.stdout) == 1
