"""A port is one server's alone (kvstash.common.binding): a second server on
it is refused with one line naming it, and the first keeps serving; the
health service answers List as Check does. Real servers on real sockets."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from kvstash.common import rpc_server
from kvstash.common.binding import BindError, check_free, split_address
from kvstash.common.metrics import MetricsServer

SERVICE = "kvstash.test.Nothing"


@pytest.fixture
async def first() -> AsyncIterator[tuple[grpc.aio.Server, int, rpc_server.HealthServicer]]:
    server, port, health = await rpc_server.create_server("127.0.0.1:0", [], [SERVICE])
    yield server, port, health
    await server.stop(None)


async def check(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(reply.status)


async def test_a_second_server_on_a_taken_port_is_refused_and_the_first_serves(
    first: tuple[grpc.aio.Server, int, rpc_server.HealthServicer],
) -> None:
    _, port, _ = first
    with pytest.raises(BindError) as refused:
        await rpc_server.create_server(f"127.0.0.1:{port}", [], [SERVICE])
    assert str(refused.value) == (
        f"cannot listen on 127.0.0.1:{port}: the address is in use "
        "(another kvstash stack or another program listens there)")
    assert await check(port, SERVICE) == health_pb2.HealthCheckResponse.SERVING


async def test_not_even_a_grpc_server_that_skips_the_check_can_share_the_port(
    first: tuple[grpc.aio.Server, int, rpc_server.HealthServicer],
) -> None:
    """gRPC's default (SO_REUSEPORT on both) would let this one in silently:
    ours turns it off, so the kernel refuses the second bind."""
    _, port, _ = first
    other = grpc.aio.server()
    with pytest.raises(RuntimeError, match="Failed to bind"):
        other.add_insecure_port(f"127.0.0.1:{port}")
    await other.stop(None)
    assert await check(port) == health_pb2.HealthCheckResponse.SERVING


def test_a_metrics_port_in_use_is_refused_by_name() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(BindError, match=rf"^cannot listen on 127\.0\.0\.1:{port} "
                                            r"\(/metrics\): the address is in use"):
            MetricsServer(CollectorRegistry(), port, "127.0.0.1")


def test_check_free_passes_a_free_port_and_port_0() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_free("127.0.0.1", port)
    check_free("127.0.0.1", 0)
    assert split_address("[::1]:50051") == ("::1", 50051)
    with pytest.raises(ValueError, match="not host:port"):
        split_address("localhost")


async def test_list_answers_every_status_check_answers(
    first: tuple[grpc.aio.Server, int, rpc_server.HealthServicer],
) -> None:
    _, port, health = first
    await health.set("other", health_pb2.HealthCheckResponse.NOT_SERVING)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).List(
            health_pb2.HealthListRequest(), timeout=5)
    assert {name: r.status for name, r in reply.statuses.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING,
        SERVICE: health_pb2.HealthCheckResponse.SERVING,
        "other": health_pb2.HealthCheckResponse.NOT_SERVING,
    }


async def test_a_server_serves_until_what_it_was_told_to_await_completes(
    first: tuple[grpc.aio.Server, int, rpc_server.HealthServicer],
) -> None:
    """As a scheduler whose step loop failed stops: its calls end, its port closes."""
    server, port, _ = first
    failed = asyncio.Event()
    serving = asyncio.create_task(rpc_server.run_until_signalled(
        server, grace_s=0, until=failed.wait()))
    assert await check(port) == health_pb2.HealthCheckResponse.SERVING
    assert not serving.done()
    failed.set()
    await asyncio.wait_for(serving, 10)
    with pytest.raises(grpc.aio.AioRpcError):
        await check(port)


async def test_a_port_past_65535_is_refused_not_wrapped_around() -> None:
    """gRPC takes 99999 modulo 65536 and would serve on 34463 without a word."""
    with pytest.raises(BindError, match=r"^cannot listen on 127\.0\.0\.1:99999: .*port 0-65535"):
        await rpc_server.create_server("127.0.0.1:99999", [], [SERVICE])
    with pytest.raises(ValueError, match="not host:port"):
        split_address("127.0.0.1:65536")
    assert split_address("127.0.0.1:65535") == ("127.0.0.1", 65535)
