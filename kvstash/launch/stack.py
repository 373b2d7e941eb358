"""Starts the three services as separate local processes and stops them cleanly.

Used by `kvstash up`, `kvstash demo` and the integration tests. Each service
binds port 0 and announces its address on stdout
(`kvstash.common.rpc_server.announce_ready`); the launcher waits for that
line, so no port is ever guessed.

    cache  <-- worker <-- scheduler <-- clients

With `pd`, two instances share the cache: clients call the prefill instance,
which hands each prefilled request to the decode instance.

    cache  <-- worker <-- scheduler (prefill) <-- clients
      ^                            | ReserveBlocks, Decode
      +---- worker <-- scheduler (decode)

With `instances` N, N instances (each a worker and its scheduler; prefill
ones with `pd`, all handing off to the one decode instance) share the
cache, and with `gateway` the Shepherd Model Gateway (kvstash/launch/gateway.py)
serves OpenAI HTTP in front of them, routing by prefix:

    HTTP clients --> smg --> scheduler 1..N --> worker 1..N --> cache

Why one file over 300 lines: what a stack starts, in which order, with which
flags, and how a failed or interrupted start stops what it started are one
piece; starting and stopping one process is processes.py's, smg gateway.py's.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from kvstash.common.binding import check_free, free_port, join_address
from kvstash.common.cpu import threads_per_worker, usable_cpus
from kvstash.common.units import parse_bytes
from kvstash.launch.data_dir import DataDir
from kvstash.launch.gateway import Gateway, check_gateway, start_gateway
from kvstash.launch.processes import Service, start_service, stop_signals_held

SHARED_MEMORY_DIR = "/dev/shm"
# CPUs worker_threads() leaves to the schedulers, the cache and the clients.
CONTROL_PLANE_CPUS = 1


@dataclass(frozen=True, slots=True)
class StackConfig:
    """What `kvstash up` starts. The defaults run anywhere on a CPU."""

    model: str = "tiny"
    # auto: a checkpoint's own dtype; float64 for the tiny model, so greedy
    # outputs are bit-stable however requests are batched, chunked, preempted
    # or restored (see README).
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int = 512  # KV blocks on the worker = the scheduler's pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    preemption_mode: str = "auto"
    cache_memory_budget: str = "1GiB"
    cache_disk_budget: str = "4GiB"  # 0: no disk tier
    cache_disk_dir: str | None = None  # None: a temporary directory, removed on stop
    # The cache's memory tier in a shared-memory arena the worker maps (the
    # co-located path), where /dev/shm has room for it; else gRPC streams.
    cache_arena: bool = True
    host: str = "127.0.0.1"  # IPv6 without brackets: "::1"
    # Serve plaintext on a non-loopback host (every service refuses otherwise).
    plaintext: bool = False
    scheduler_port: int = 0
    scheduler_args: tuple[str, ...] = ()  # extra flags, for tests and experiments
    worker_args: tuple[str, ...] = ()
    cache_args: tuple[str, ...] = ()
    # P/D disaggregation: a prefill and a decode instance (each a scheduler
    # and its worker); scheduler_args and worker_args go to both, the
    # prefill_*/decode_* ones to that instance only.
    pd: bool = False
    prefill_scheduler_args: tuple[str, ...] = ()
    decode_scheduler_args: tuple[str, ...] = ()
    decode_worker_args: tuple[str, ...] = ()
    # Instances clients call (mixed, or prefill with pd), sharing the cache;
    # the first listens on scheduler_port, the others on free ports.
    instances: int = 1
    # smg in front of them (pip install 'kvstash[gateway]'); port 0: a free one.
    gateway: bool = False
    gateway_port: int = 0
    gateway_policy: str = "cache_aware"
    # Every service (not smg: it always serves its own) serves /metrics on a
    # free port of `host`.
    metrics: bool = False
    # torch threads of each worker; None: the CPUs this process may use,
    # less one, shared among the workers it starts (worker_threads()).
    worker_threads: int | None = None
    # Seconds each service (and smg) may take to say it is ready: a worker
    # loading a large checkpoint takes longer than the default.
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "instances"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.worker_threads is not None and self.worker_threads <= 0:
            raise ValueError(f"worker_threads must be > 0, got {self.worker_threads}")
        if not 0 < self.start_timeout_s < math.inf:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s}")


class Instance(NamedTuple):
    scheduler: Service
    worker: Service


@dataclass(slots=True)
class Stack:
    cache: Service
    worker: Service
    scheduler: Service  # the first one clients call (the prefill instance's, with pd)
    log_dir: Path
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)
    # The log directory was made for this stack (none was given): removed on stop.
    _own_logs: bool = field(default=False, repr=False)
    # With pd: the decode instance.
    decode_scheduler: Service | None = None
    decode_worker: Service | None = None
    # With instances > 1: the second one clients call and on.
    more_instances: list[Instance] = field(default_factory=list)
    gateway: Gateway | None = None

    @property
    def instances(self) -> list[Instance]:
        """The instances clients call, first to last."""
        return [Instance(self.scheduler, self.worker), *self.more_instances]

    @property
    def services(self) -> list[Service]:
        decode = [s for s in (self.decode_scheduler, self.decode_worker) if s is not None]
        return [*(s for i in self.instances for s in i), *decode, self.cache]

    @property
    def address(self) -> str:
        return self.scheduler.address

    @property
    def addresses(self) -> list[str]:
        """Of every scheduler clients call."""
        return [i.scheduler.address for i in self.instances]

    def stop(self) -> None:
        """Stops every service and removes what the stack made (its logs too,
        unless it was given their directory)."""
        # Front to back, so nobody sees its dependency vanish mid-request.
        if self.gateway is not None:
            self.gateway.stop()
        for service in self.services:
            service.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if self._own_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self._own_logs = False

    def wait_for_exit(self, poll_s: float = 0.5) -> Service | Gateway:
        """Blocks until a service (or the gateway) exits and returns it."""
        watched: list[Service | Gateway] = [*self.services]
        if self.gateway is not None:
            watched.append(self.gateway)
        while True:
            for service in watched:
                if service.process.poll() is not None:
                    return service
            time.sleep(poll_s)


def worker_threads(config: StackConfig) -> tuple[int, str]:
    """torch threads for each worker the stack starts, and why: the
    configured count, else this process's usable CPUs (kvstash.common.cpu),
    less one for the schedulers, the cache and the clients, shared among its
    workers (every instance's, and the decode one's with pd), since they all
    run on this host. Without that CPU, a worker's threads would take every
    core and each step would wait for the one a scheduler preempted."""
    if config.worker_threads is not None:
        return config.worker_threads, "--worker-threads"
    usable = usable_cpus()
    num_workers = config.instances + (1 if config.pd else 0)
    threads = threads_per_worker(usable, num_workers, num_reserved=CONTROL_PLANE_CPUS)
    return threads, (f"{usable.reason}; {CONTROL_PLANE_CPUS} left to the schedulers and "
                     f"cache, the rest shared by {num_workers} worker(s)")


def arena_args(config: StackConfig) -> list[str]:
    """--arena-dir /dev/shm where it is a tmpfs with room for the budget."""
    shm = Path(SHARED_MEMORY_DIR)
    if not config.cache_arena or not shm.is_dir() or not os.access(shm, os.W_OK):
        return []
    free = os.statvfs(shm)
    if free.f_bavail * free.f_frsize < parse_bytes(config.cache_memory_budget):
        return []
    return ["--arena-dir", str(shm)]


def disk_args(config: StackConfig, tmp_dir: str) -> list[str]:
    """--disk-dir (cache_disk_dir, else one in `tmp_dir`) and --disk-budget;
    none with a budget of 0 and no directory given (the cache refuses a
    directory without a budget: a tier of 0 bytes would evict all it holds)."""
    if not parse_bytes(config.cache_disk_budget) and config.cache_disk_dir is None:
        return []
    disk_dir = config.cache_disk_dir or str(Path(tmp_dir) / "cache")
    return ["--disk-dir", disk_dir, "--disk-budget", config.cache_disk_budget]


def metrics_args(config: StackConfig) -> list[str]:
    """--metrics-port (a free one) and --metrics-host, with config.metrics."""
    if not config.metrics:
        return []
    return ["--metrics-port", str(free_port(config.host)), "--metrics-host", config.host]


def start_stack(config: StackConfig, log_dir: Path | None = None) -> Stack:
    """Starts cache, workers, schedulers and the gateway (as configured),
    each logging to `log_dir` (made if missing, kept at stop; default: a
    temporary directory removed at stop); on any failure stops what started.
    Before anything starts: OSError if `log_dir` cannot be made, BindError if
    the scheduler's or the gateway's fixed port is taken."""
    if log_dir is not None:
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file there, no permission
            raise OSError(f"log directory {log_dir}: {exc.strerror or exc}") from None
    # Fail now, not after every worker has loaded its model.
    check_free(config.host, config.scheduler_port)
    if config.gateway:  # smg installed, the policy known, its port free
        check_gateway(config.gateway_policy)
        check_free(config.host, config.gateway_port)
    tmp = DataDir()  # removes those killed launchers left
    # Logs live apart from the data (the cache's disk tier), so they can
    # outlive a failed stack without keeping gigabytes of snapshots.
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvstash-logs-"))
    listen = join_address(config.host, 0)
    plain = ["--plaintext"] if config.plaintext else []
    started: list[Service] = []
    gateway: Gateway | None = None
    try:
        cache = start_service("cache", "cache_svc", [
            "--listen", listen, "--memory-budget", config.cache_memory_budget,
            *disk_args(config, tmp.name), *arena_args(config), *plain, *metrics_args(config),
            *config.cache_args,
        ], logs, config.start_timeout_s)
        started.append(cache)
        decode: list[Service] = []
        pd_args: list[str] = []
        if config.pd:
            decode = _start_instance(
                config, "decode-", cache.address, ["--role", "decode"],
                config.decode_scheduler_args, config.decode_worker_args, logs, started)
            pd_args = ["--role", "prefill", "--decode-address", decode[0].address]
        front = [Instance(*_start_instance(
            config, f"instance{k + 1}-" if k else "", cache.address, pd_args,
            config.prefill_scheduler_args if config.pd else (), (), logs, started,
            scheduler_port=0 if k else config.scheduler_port)) for k in range(config.instances)]
        if config.gateway:
            gateway = start_gateway([i.scheduler.address for i in front], logs,
                                    host=config.host, port=config.gateway_port,
                                    policy=config.gateway_policy,
                                    startup_timeout_s=config.start_timeout_s)
        return Stack(cache, front[0].worker, front[0].scheduler, logs, tmp,
                     _own_logs=log_dir is None, decode_scheduler=decode[0] if decode else None,
                     decode_worker=decode[1] if decode else None, more_instances=front[1:],
                     gateway=gateway)
    except BaseException:
        # Signals held, as the running stack's stop holds them (the CLI's
        # _stop_undisturbed): a second Ctrl-C or SIGTERM must not cut this
        # short and leave the rest (the cache's arena, the data) behind.
        with stop_signals_held():
            if gateway is not None:
                gateway.stop()
            for service in reversed(started):
                service.stop()
            tmp.cleanup()
        raise


def _start_instance(
    config: StackConfig, prefix: str, cache_address: str, role_args: Sequence[str],
    scheduler_args: Sequence[str], worker_args: Sequence[str], logs: Path,
    started: list[Service], scheduler_port: int = 0,
) -> list[Service]:
    """A worker and its scheduler, named `prefix`worker / `prefix`scheduler;
    each appended to `started` once up. Returns [scheduler, worker]."""
    listen = join_address(config.host, 0)
    plain = ["--plaintext"] if config.plaintext else []
    worker = start_service(prefix + "worker", "gpu_worker", [
        "--listen", listen, "--model", config.model, "--dtype", config.dtype,
        "--device", config.device, "--block-size", str(config.block_size),
        "--num-blocks", str(config.num_blocks), "--cache-address", cache_address,
        "--num-threads", str(worker_threads(config)[0]),
        *plain, *metrics_args(config), *config.worker_args, *worker_args,
    ], logs, config.start_timeout_s)
    started.append(worker)
    scheduler = start_service(prefix + "scheduler", "scheduler_svc", [
        "--listen", join_address(config.host, scheduler_port),
        "--worker-address", worker.address, "--cache-address", cache_address,
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--preemption-mode", config.preemption_mode,
        *role_args, *plain, *metrics_args(config), *config.scheduler_args, *scheduler_args,
    ], logs, config.start_timeout_s)
    started.append(scheduler)
    return [scheduler, worker]


@contextlib.contextmanager
def running_stack(config: StackConfig, log_dir: Path | None = None) -> Iterator[Stack]:
    stack = start_stack(config, log_dir)
    try:
        yield stack
    finally:
        stack.stop()
