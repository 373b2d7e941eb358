"""`python -m cache_svc --listen 127.0.0.1:50071 --memory-budget 8GiB
--disk-dir DIR --disk-budget 100GiB --default-ttl 1h`"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from cache_svc.config import CacheConfig
from cache_svc.server import create_cache_server
from kvstash.common import (
    flag_types,
    rpc_connections,
    rpc_server,
    security,
    settings,
    telemetry,
)
from kvstash.common.binding import BindError
from kvstash.common.malloc_tuning import tune_malloc
from kvstash.common.metrics import listen_host

# Every flag that sets a CacheConfig field defaults to that field's default.
_DEFAULTS = CacheConfig()


def build_parser() -> argparse.ArgumentParser:
    d = _DEFAULTS
    p = argparse.ArgumentParser(
        prog="python -m cache_svc", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Every flag may also be set as KVSTASH_CACHE_<FLAG> (e.g. "
               "KVSTASH_CACHE_MEMORY_BUDGET=8GiB); the command line wins. "
               "Sizes are in bytes, durations in seconds.")
    p.add_argument("--listen", default="127.0.0.1:50071", help="host:port; port 0 = any free")
    p.add_argument("--memory-budget", type=flag_types.byte_size, default=d.memory_budget_bytes,
                   help="bytes of snapshots kept in memory, e.g. 8GiB")
    p.add_argument("--unpinned-share", type=float, default=d.unpinned_share,
                   help="share of the memory budget unpinned snapshots (prefix-tier "
                        "segments) may hold; they never displace pinned ones")
    p.add_argument("--disk-dir", type=Path, default=d.disk_dir, help="disk tier; omit for none")
    p.add_argument("--disk-budget", type=flag_types.byte_size, default=d.disk_budget_bytes,
                   help="bytes of snapshots kept on disk, e.g. 100GiB")
    p.add_argument("--max-snapshots", type=int, default=d.max_snapshots,
                   help="snapshots listed at most, both tiers: each costs ~2 KiB of "
                        "bookkeeping whatever its size; beyond, a put evicts the least "
                        "recently used unpinned one or is refused")
    p.add_argument("--default-ttl", type=flag_types.positive_duration, default=d.default_ttl_s,
                   help="expiry after the last access for puts that send ttl_s=0, e.g. 1h")
    p.add_argument("--sweep-interval", type=flag_types.duration, default=d.sweep_interval_s,
                   help="how often expired snapshots are looked for")
    p.add_argument("--max-inflight", type=flag_types.byte_size, default=d.max_inflight_bytes,
                   help="chunk payload bytes in flight over all streams")
    p.add_argument("--max-concurrent-rpcs", type=int, default=d.max_concurrent_rpcs,
                   help="calls served at once; more get RESOURCE_EXHAUSTED")
    p.add_argument("--reserve-wait", type=flag_types.duration, default=d.reserve_wait_s,
                   help="how long a put waits for room before RESOURCE_EXHAUSTED")
    p.add_argument("--io-threads", type=int, default=d.io_threads,
                   help="threads for disk reads, writes and scans")
    p.add_argument("--bandwidth-limit", type=flag_types.byte_size,
                   default=d.bandwidth_limit_bytes_per_s,
                   metavar="BYTES_PER_S",
                   help="cap on put and get payload bytes per second, all streams "
                        "together, e.g. 2MiB; 0 = unlimited")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port,
                   help="Prometheus port; 0 = off")
    p.add_argument("--metrics-host", type=listen_host, default=d.metrics_host,
                   help="address the Prometheus endpoint listens on; 0.0.0.0 = every interface")
    p.add_argument("--buffer-pool", type=flag_types.byte_size, default=d.buffer_pool_bytes,
                   help="freed snapshot buffers kept (within the memory budget) for "
                        "reuse by puts of the same size; 0 = off")
    p.add_argument("--buffer-pool-idle", type=flag_types.duration, default=d.buffer_pool_idle_s,
                   help="pooled buffers unused this long are unmapped")
    p.add_argument("--arena-dir", type=Path, default=d.arena_dir,
                   help="keep the memory tier in a shared-memory arena file here (a tmpfs "
                        "such as /dev/shm, with room for the whole memory budget), which "
                        "co-located workers map; omit for private memory")
    p.add_argument("--shared-lease", type=flag_types.duration, default=d.shared_lease_s,
                   help="how long a co-located put or get may hold its arena extent (that of a "
                        "put ended without its writer's answer is then quarantined as long)")
    p.add_argument("--put-idle", type=flag_types.duration, default=d.put_idle_s,
                   help="how long a streamed put may wait for its client's next chunk")
    p.add_argument("--get-idle", type=flag_types.duration, default=d.get_idle_s,
                   help="how long a streamed get may wait for its client to take a chunk")
    p.add_argument("--grace", type=flag_types.duration, default=5.0,
                   help="time in-flight calls get to finish on SIGTERM/SIGINT")
    p.add_argument("--log-level", default="info", choices=rpc_server.LOG_LEVELS)
    security.add_flags(p)
    rpc_connections.add_connection_flags(p)
    # Test hook: simulates a slow disk (bytes per second).
    p.add_argument("--disk-throttle", type=flag_types.byte_size, default=d.disk_write_bytes_per_s,
                   help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> CacheConfig:
    return CacheConfig(
        memory_budget_bytes=args.memory_budget,
        unpinned_share=args.unpinned_share,
        disk_dir=args.disk_dir,
        disk_budget_bytes=args.disk_budget,
        default_ttl_s=max(1, round(args.default_ttl)),
        max_snapshots=args.max_snapshots,
        sweep_interval_s=args.sweep_interval,
        max_inflight_bytes=args.max_inflight,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        reserve_wait_s=args.reserve_wait,
        io_threads=args.io_threads,
        bandwidth_limit_bytes_per_s=args.bandwidth_limit,
        disk_write_bytes_per_s=float(args.disk_throttle),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        buffer_pool_bytes=args.buffer_pool,
        buffer_pool_idle_s=args.buffer_pool_idle,
        arena_dir=args.arena_dir,
        shared_lease_s=args.shared_lease,
        put_idle_s=args.put_idle,
        get_idle_s=args.get_idle,
    )


async def serve(config: CacheConfig, address: str, grace_s: float,
                secured: security.Security, connections: rpc_connections.Connections) -> None:
    server, port, cache = await create_cache_server(config, address, security=secured,
                                                    connections=connections)
    host = address.rsplit(":", 1)[0]
    rpc_server.announce_ready("cache", host, port)
    # Puts still running after the grace period are cancelled; their
    # reservations are released and nothing of them stays.
    await rpc_server.run_until_signalled(server, grace_s=grace_s)
    await cache.close_store()


def main(argv: list[str] | None = None) -> int:
    args = settings.parse_args(build_parser(), "cache", argv)
    rpc_server.setup_logging(args.log_level)
    tune_malloc()
    try:
        config = config_from_args(args)
        secured = security.from_args(args, require_client_cert=True)
        security.check_listen(args.listen, secured)
        connections = rpc_connections.connections_from_args(args)
    except ValueError as exc:
        print(f"cache_svc: {exc}", file=sys.stderr)
        return 2
    with telemetry.tracing_for(telemetry.CACHE_SERVICE):
        try:
            asyncio.run(serve(config, args.listen, args.grace, secured, connections))
        except BindError as exc:  # its port (or its metrics port) is taken
            print(f"cache_svc: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:  # the arena, or a disk tier another cache holds
            print(f"cache_svc: cannot start: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C before it served (then it stops gracefully)
            print("cache_svc: interrupted while starting", file=sys.stderr)
            return rpc_server.INTERRUPTED_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
