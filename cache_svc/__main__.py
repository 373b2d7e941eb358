"""`python -m cache_svc --listen 127.0.0.1:50071 --memory-budget 8GiB
--disk-dir DIR --disk-budget 100GiB --default-ttl 1h`"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from cache_svc.config import CacheConfig
from cache_svc.server import create_cache_server
from kvstash import rpc, settings, telemetry
from kvstash.malloc_tuning import tune_malloc
from kvstash.metrics import DEFAULT_METRICS_HOST, listen_host

_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """"90", "90s", "30m", "1h" -> seconds."""
    s = text.strip().lower()
    unit = s[-1] if s and s[-1] in _SECONDS else "s"
    try:
        return float(s.rstrip("smhd")) * _SECONDS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 90s, 30m, 1h)") from None


def parse_size(text: str) -> int:
    try:
        return rpc.parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cache_svc", description=__doc__,
        epilog="Every flag may also be set as KVSTASH_CACHE_<FLAG> (e.g. "
               "KVSTASH_CACHE_MEMORY_BUDGET=8GiB); the command line wins.")
    p.add_argument("--listen", default="127.0.0.1:50071", help="host:port; port 0 = any free")
    p.add_argument("--memory-budget", type=parse_size, default=1 << 30)
    p.add_argument("--disk-dir", type=Path, default=None, help="disk tier; omit for none")
    p.add_argument("--disk-budget", type=parse_size, default=0)
    p.add_argument("--default-ttl", type=parse_duration, default=3600.0,
                   help="expiry after the last access for puts that send ttl_s=0")
    p.add_argument("--sweep-interval", type=parse_duration, default=5.0)
    p.add_argument("--max-inflight", type=parse_size, default=32 << 20,
                   help="chunk payload bytes in flight over all streams")
    p.add_argument("--max-concurrent-rpcs", type=int, default=CacheConfig().max_concurrent_rpcs,
                   help="calls served at once; more get RESOURCE_EXHAUSTED")
    p.add_argument("--reserve-wait", type=parse_duration, default=10.0,
                   help="how long a put waits for room before RESOURCE_EXHAUSTED")
    p.add_argument("--io-threads", type=int, default=2)
    p.add_argument("--bandwidth-limit", type=parse_size, default=0, metavar="BYTES_PER_S",
                   help="cap on put and get payload bytes per second, all streams "
                        "together, e.g. 2MiB; 0 = unlimited")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port; 0 = off")
    p.add_argument("--metrics-host", type=listen_host, default=DEFAULT_METRICS_HOST,
                   help="address the Prometheus endpoint listens on; 0.0.0.0 = every interface")
    p.add_argument("--buffer-pool", type=parse_size, default=1 << 30,
                   help="freed snapshot buffers kept (within the memory budget) for "
                        "reuse by puts of the same size; 0 = off")
    p.add_argument("--buffer-pool-idle", type=parse_duration, default=60.0,
                   help="pooled buffers unused this long are unmapped")
    p.add_argument("--grace", type=parse_duration, default=5.0,
                   help="time in-flight calls get to finish on SIGTERM/SIGINT")
    p.add_argument("--log-level", default="info")
    # Test hook: simulates a slow disk (bytes per second).
    p.add_argument("--disk-throttle", type=parse_size, default=0, help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> CacheConfig:
    return CacheConfig(
        memory_budget_bytes=args.memory_budget,
        disk_dir=args.disk_dir,
        disk_budget_bytes=args.disk_budget,
        default_ttl_s=max(1, round(args.default_ttl)),
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
    )


async def serve(config: CacheConfig, address: str, grace_s: float) -> None:
    server, port, cache = await create_cache_server(config, address)
    host = address.rsplit(":", 1)[0]
    rpc.announce_ready("cache", host, port)
    # Puts still running after the grace period are cancelled; their
    # reservations are released and nothing of them stays.
    await rpc.run_until_signalled(server, grace_s=grace_s)
    await cache.close_store()


def main(argv: list[str] | None = None) -> int:
    args = settings.parse_args(build_parser(), "cache", argv)
    rpc.setup_logging(args.log_level)
    tune_malloc()
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"cache_svc: {exc}", file=sys.stderr)
        return 2
    with telemetry.tracing_for(telemetry.CACHE_SERVICE):
        asyncio.run(serve(config, args.listen, args.grace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
