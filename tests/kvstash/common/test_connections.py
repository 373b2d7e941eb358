"""Per-connection limits every server applies
(kvstash.common.rpc_connections.Connections): flags, and what a real server does with them."""

from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from cache_svc.config import CacheConfig
from cache_svc.server import create_cache_server
from kvstash.common import rpc_connections
from kvstash.common.units import MIB
from kvstash.v1 import cache_pb2, cache_pb2_grpc, common_pb2

REPO = Path(__file__).resolve().parents[3]


def parse(*argv: str) -> rpc_connections.Connections:
    parser = argparse.ArgumentParser()
    rpc_connections.add_connection_flags(parser)
    return rpc_connections.connections_from_args(parser.parse_args(argv))


def test_flags_reach_the_server_options() -> None:
    assert parse() == rpc_connections.DEFAULT_CONNECTIONS
    options = dict(parse("--keepalive", "5s", "--keepalive-timeout", "2", "--idle-timeout",
                         "1m", "--max-streams-per-connection", "7").server_options())
    assert (options["grpc.keepalive_time_ms"], options["grpc.keepalive_timeout_ms"],
            options["grpc.max_connection_idle_ms"], options["grpc.max_concurrent_streams"]) == (
        5000, 2000, 60_000, 7)
    assert "grpc.max_concurrent_streams" not in dict(parse().server_options())


@pytest.mark.parametrize(("argv", "message"), [
    (("--idle-timeout", "0"), "argument --idle-timeout: not a duration > 0: '0'"),
    (("--keepalive=-5s",), "argument --keepalive: not a duration > 0: '-5s'"),
    (("--max-streams-per-connection", "-1"),
     "argument --max-streams-per-connection: not a whole number >= 0: '-1'"),
])
@pytest.mark.parametrize("service", ["scheduler_svc", "cache_svc"])
def test_a_bad_connection_flag_is_refused_as_it_is_parsed_naming_it(
    service: str, argv: tuple[str, ...], message: str,
) -> None:
    """Exit 2 with the flag named; the scheduler printed a traceback (Connections'
    ValueError, raised as it started serving), the cache named the field."""
    done = subprocess.run([sys.executable, "-m", service, "--listen", "127.0.0.1:0", *argv],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("seconds", [math.nan, math.inf])
def test_durations_must_be_finite(seconds: float) -> None:
    """A NaN passed `<= 0`, and an infinity overflowed the server's options."""
    with pytest.raises(ValueError, match=f"keepalive_s is {seconds}, must be > 0 and finite"):
        rpc_connections.Connections(keepalive_s=seconds)


async def test_a_month_long_setting_is_grpcs_never_not_an_overflow() -> None:
    """30 days in ms is past a C int: building the server raised OverflowError."""
    month = rpc_connections.Connections(keepalive_s=30 * 86400, idle_s=30 * 86400)
    _, port, cache = await create_cache_server(
        CacheConfig(memory_budget_bytes=16 * MIB), "127.0.0.1:0", connections=month)
    try:
        async with rpc_connections.channel(f"127.0.0.1:{port}") as channel:
            await cache_pb2_grpc.KVCacheStub(channel).GetStats(common_pb2.GetStatsRequest())
    finally:
        await cache.stop(None)


async def test_an_idle_connection_is_closed_and_reopened() -> None:
    _, port, cache = await create_cache_server(
        CacheConfig(memory_budget_bytes=16 * MIB), "127.0.0.1:0",
        connections=rpc_connections.Connections(idle_s=0.3))
    try:
        async with rpc_connections.channel(f"127.0.0.1:{port}") as channel:
            stub = cache_pb2_grpc.KVCacheStub(channel)
            await stub.GetStats(common_pb2.GetStatsRequest())
            assert channel.get_state() == grpc.ChannelConnectivity.READY
            for _ in range(100):  # the server says goodbye after 0.3 s without calls
                await asyncio.sleep(0.05)
                if channel.get_state() == grpc.ChannelConnectivity.IDLE:
                    break
            assert channel.get_state() == grpc.ChannelConnectivity.IDLE
            await stub.GetStats(common_pb2.GetStatsRequest())  # and the client comes back
    finally:
        await cache.stop(None)


async def test_clients_reach_a_service_directly_whatever_proxy_the_environment_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC sends even loopback calls through `http_proxy` (here a port where
    nothing listens): kvstash's channels never use it."""
    for name in ("http_proxy", "https_proxy", "grpc_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("no_proxy", "NO_PROXY", "no_grpc_proxy"):
        monkeypatch.delenv(name, raising=False)
    _, port, cache = await create_cache_server(
        CacheConfig(memory_budget_bytes=16 * MIB), "127.0.0.1:0")
    try:
        async with rpc_connections.channel(f"127.0.0.1:{port}") as channel:
            await cache_pb2_grpc.KVCacheStub(channel).GetStats(common_pb2.GetStatsRequest(),
                                                                timeout=10)
    finally:
        await cache.stop(None)


async def test_calls_beyond_the_stream_limit_wait_for_a_free_stream() -> None:
    _, port, cache = await create_cache_server(
        CacheConfig(memory_budget_bytes=16 * MIB), "127.0.0.1:0",
        connections=rpc_connections.Connections(max_streams=1))
    address = f"127.0.0.1:{port}"
    try:
        async with rpc_connections.channel(address) as channel:
            stub = cache_pb2_grpc.KVCacheStub(channel)
            await stub.GetStats(common_pb2.GetStatsRequest())  # connected
            # A put that sends nothing after its header holds the one stream.
            sent, release = asyncio.Event(), asyncio.Event()

            async def header_then_wait() -> AsyncIterator[cache_pb2.PutSnapshotRequest]:
                yield cache_pb2.PutSnapshotRequest(header=cache_pb2.SnapshotHeader(
                    snapshot_id="held", layout=common_pb2.KvLayout(
                        num_layers=1, block_size=16, num_kv_heads=1, head_dim=64,
                        dtype="float16"),
                    num_blocks=1, num_tokens=16, total_bytes=4096, chunk_bytes=MIB,
                    checksum_algorithm=cache_pb2.CHECKSUM_ALGORITHM_XXH3_64))
                sent.set()
                await release.wait()

            held = stub.PutSnapshot(header_then_wait())
            await sent.wait()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetStats(common_pb2.GetStatsRequest(), timeout=0.5)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # Another connection is served (channels share connections unless told not to).
            own_connection = [("grpc.use_local_subchannel_pool", 1)]
            async with rpc_connections.channel(address, options=own_connection) as other:
                await cache_pb2_grpc.KVCacheStub(other).GetStats(common_pb2.GetStatsRequest())
            held.cancel()
            release.set()
            await stub.GetStats(common_pb2.GetStatsRequest(), timeout=5)
    finally:
        await cache.stop(None)
