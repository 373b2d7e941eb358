"""`kvstash up --worker-threads`: the workers one launcher starts share its
usable CPUs instead of each taking one thread per node core."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstash.common.cpu import threads_per_worker, usable_cpus
from kvstash.launch import cli
from kvstash.launch.stack import StackConfig, running_stack, worker_threads


@pytest.mark.parametrize(("config", "num_workers"), [
    (StackConfig(), 1),
    (StackConfig(instances=3), 3),
    (StackConfig(pd=True, instances=2), 3),  # two prefill workers and the decode one
])
def test_default_shares_the_usable_cpus_among_the_workers(
    config: StackConfig, num_workers: int,
) -> None:
    """One CPU is left to the schedulers, the cache and the clients."""
    usable = usable_cpus()
    threads, why = worker_threads(config)
    assert threads == max(1, (usable.num_cpus - 1) // num_workers)
    assert why.startswith(usable.reason)
    assert f"1 left to the schedulers and cache, the rest shared by {num_workers} worker" in why


def test_explicit_count_wins() -> None:
    assert worker_threads(StackConfig(instances=4, worker_threads=3)) == (3, "--worker-threads")


def test_bad_count_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="worker_threads must be > 0, got 0"):
        StackConfig(worker_threads=0)
    assert cli.main(["demo", "--worker-threads", "-2"]) == 2
    assert "kvstash demo: worker_threads must be > 0, got -2" in capsys.readouterr().err


def logged_threads(log: Path) -> list[int]:
    return [int(n) for n in re.findall(r"(\d+) torch threads: ", log.read_text())]


def test_each_worker_gets_its_share(tmp_path: Path) -> None:
    """Two instances on this host: each worker runs its share of the usable
    CPUs (1 each on a 2-CPU machine, where torch's default gave each 2)."""
    share = threads_per_worker(usable_cpus(), 2, num_reserved=1)
    with running_stack(StackConfig(instances=2, num_blocks=16), tmp_path) as stack:
        logs = [i.worker.log_path for i in stack.instances]
    assert [logged_threads(log) for log in logs] == [[share], [share]]


def test_worker_args_still_override(tmp_path: Path) -> None:
    """Extra worker flags come after the launcher's, so they win (benchmarks
    that pin a count pass it that way)."""
    config = StackConfig(num_blocks=16, worker_threads=2, worker_args=("--num-threads", "1"))
    with running_stack(config, tmp_path) as stack:
        assert logged_threads(stack.worker.log_path) == [1]
