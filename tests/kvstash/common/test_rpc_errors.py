"""kvstash.common.rpc_errors over a real channel, on a server built by
kvstash.common.rpc_server: undecodable requests, whatever the
handler's shape, end with INVALID_ARGUMENT and a plain message; a servicer's
failures, unary or streamed, with their status (INTERNAL for a bug); a call
ends once, whatever fails after its status or after its client left."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool

from kvstash import errors
from kvstash.common import rpc_connections, rpc_errors, rpc_server

SERVICE = "test.Echo"


def _decode(raw: bytes) -> bytes:
    if raw.startswith(b"bad"):
        raise ValueError("not an echo request")
    return raw


async def _unary(request: bytes, context: Any) -> bytes:
    return request


async def _stream_out(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield request
    yield request


async def _written_out(request: bytes, context: Any) -> None:
    await context.write(request)


async def _stream_in(requests: AsyncIterator[bytes], context: Any) -> bytes:
    return b"".join([r async for r in requests])


async def _stream_both(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request


def _register(server: grpc.aio.Server) -> None:
    kw: dict[str, Any] = {"request_deserializer": _decode, "response_serializer": None}
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, **kw),
        "StreamOut": grpc.unary_stream_rpc_method_handler(_stream_out, **kw),
        "WrittenOut": grpc.unary_stream_rpc_method_handler(_written_out, **kw),
        "StreamIn": grpc.stream_unary_rpc_method_handler(_stream_in, **kw),
        "StreamBoth": grpc.stream_stream_rpc_method_handler(_stream_both, **kw),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server, port, _ = await rpc_server.create_server("127.0.0.1:0", [_register], [SERVICE])
    async with rpc_connections.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    await server.stop(None)


async def _call(channel: grpc.aio.Channel, method: str, requests: list[bytes]) -> list[bytes]:
    path = f"/{SERVICE}/{method}"
    if method == "Unary":
        return [await channel.unary_unary(path)(requests[0])]
    if method in ("StreamOut", "WrittenOut"):
        return [r async for r in channel.unary_stream(path)(requests[0])]
    if method == "StreamIn":
        return [await channel.stream_unary(path)(iter(requests))]
    return [r async for r in channel.stream_stream(path)(iter(requests))]


@pytest.mark.parametrize("method", ["Unary", "StreamOut", "WrittenOut"])
async def test_undecodable_unary_request_is_invalid_argument(
    channel: grpc.aio.Channel, method: str
) -> None:
    assert (await _call(channel, method, [b"ok"]))[0] == b"ok"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _call(channel, method, [b"bad"])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "undecodable request: not an echo request"


@pytest.mark.parametrize("method", ["StreamIn", "StreamBoth"])
async def test_undecodable_message_in_a_stream_is_invalid_argument(
    channel: grpc.aio.Channel, method: str
) -> None:
    assert b"".join(await _call(channel, method, [b"a", b"b"])) == b"ab"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _call(channel, method, [b"a", b"bad", b"c"])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "<class" not in (caught.value.details() or "")


class Failing:
    """A servicer whose methods fail as the request says, after one response
    for the streamed one."""

    @staticmethod
    async def _fail(request: bytes, context: grpc.aio.ServicerContext) -> None:
        if request == b"domain":
            raise errors.NotFound("snapshot s is not there")
        if request == b"aborted":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")
        if request == b"bug":
            raise KeyError("a bug")

    @rpc_errors.maps_errors
    async def Unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await self._fail(request, context)
        return request

    @rpc_errors.maps_errors
    async def Stream(self, request: bytes, context: grpc.aio.ServicerContext,
                     ) -> AsyncIterator[bytes]:
        yield b"first"
        await self._fail(request, context)
        yield request

    @rpc_errors.maps_errors
    async def FailsTwice(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Ends the call, then fails again as it cleans up."""
        try:
            raise errors.NotFound("snapshot s is not there")
        except errors.NotFound as exc:
            await rpc_errors.abort_with(context, exc)
        finally:
            raise errors.Unavailable("and its cleanup failed too")

    @rpc_errors.maps_errors
    async def Conversation(self, requests: AsyncIterator[bytes],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Answers the first message, then expects a second; a client that
        leaves instead is refused, as cache_svc's shared calls do."""
        messages = aiter(requests)
        yield await anext(messages)
        try:
            try:
                second = await anext(messages, None)
            except asyncio.CancelledError:
                # grpc tells a handler its client left by EOF or by cancelling
                # it, whichever comes first; here both go on as a handler's
                # cleanup would, so that the refusal always meets a call
                # that has lost its client.
                second = None
            if second is None:
                raise errors.InvalidArgument("expected a second message")
        except errors.KvstashError as exc:
            self.refused.set()
            await rpc_errors.abort_with(context, exc)

    refused = asyncio.Event()


@pytest.fixture
async def failing() -> AsyncIterator[grpc.aio.Channel]:
    servicer = Failing()
    Failing.refused = asyncio.Event()  # of this test's event loop

    def register(server: grpc.aio.Server) -> None:
        handlers = {"Unary": grpc.unary_unary_rpc_method_handler(servicer.Unary),
                    "Stream": grpc.unary_stream_rpc_method_handler(servicer.Stream),
                    "FailsTwice": grpc.unary_unary_rpc_method_handler(servicer.FailsTwice),
                    "Conversation": grpc.stream_stream_rpc_method_handler(
                        servicer.Conversation)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    server, port, _ = await rpc_server.create_server("127.0.0.1:0", [register], [SERVICE])
    async with rpc_connections.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    await server.stop(None)


@pytest.mark.parametrize("method", ["Unary", "Stream"])
@pytest.mark.parametrize(("sent", "code", "details"), [
    (b"domain", grpc.StatusCode.NOT_FOUND, "snapshot s is not there"),
    (b"aborted", grpc.StatusCode.PERMISSION_DENIED, "not yours"),
    (b"bug", grpc.StatusCode.INTERNAL, "Failing.{method} failed: KeyError: 'a bug'"),
])
async def test_maps_errors_gives_each_failure_its_status(
    failing: grpc.aio.Channel, caplog: pytest.LogCaptureFixture, method: str,
    sent: bytes, code: grpc.StatusCode, details: str,
) -> None:
    """Before: a bug was UNKNOWN, "Unexpected <class 'KeyError'>", and a
    streamed method's domain error too."""
    path = f"/{SERVICE}/{method}"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if method == "Unary":
            await failing.unary_unary(path)(sent)
        else:
            assert [r async for r in failing.unary_stream(path)(sent)] == [b"first"]
    assert (caught.value.code(), caught.value.details()) == (code, details.format(method=method))
    logged = [r for r in caplog.records if r.name == "kvstash.common.rpc_errors"]
    if code == grpc.StatusCode.INTERNAL:  # a bug: logged with its traceback
        [record] = logged
        assert record.exc_info is not None and f"Failing.{method}" in record.getMessage()
    else:
        assert not logged


def _grpc_complaints(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("grpc") and r.levelno >= 30]


async def test_a_call_ends_once_when_its_cleanup_fails_too(
    failing: grpc.aio.Channel, caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: the second failure was aborted again, grpc raised "Abort
    already called!" and logged it as an unexpected error."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await failing.unary_unary(f"/{SERVICE}/FailsTwice")(b"x")
    assert (caught.value.code(), caught.value.details()) == (
        grpc.StatusCode.NOT_FOUND, "snapshot s is not there")
    await asyncio.sleep(0.1)  # the server's handler has finished and logged
    assert _grpc_complaints(caplog) == []


async def test_a_call_whose_client_left_ends_once(
    failing: grpc.aio.Channel, caplog: pytest.LogCaptureFixture,
) -> None:
    """The client cancels where the server expects its next message: the
    server's refusal can no longer be sent. Before: that failed send was
    aborted again ("Abort already called!" in the server's log)."""
    call = failing.stream_stream(f"/{SERVICE}/Conversation")()
    await call.write(b"hello")
    assert await call.read() == b"hello"
    call.cancel()
    await asyncio.wait_for(Failing.refused.wait(), 10)
    await asyncio.sleep(0.2)
    assert _grpc_complaints(caplog) == []
    assert not [r for r in caplog.records if r.name == "kvstash.common.rpc_errors"]
    # A client still listening gets the refusal itself.
    call = failing.stream_stream(f"/{SERVICE}/Conversation")()
    await call.write(b"hello")
    assert await call.read() == b"hello"
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert (caught.value.code(), caught.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "expected a second message")


SERVICERS = [  # (module, servicer class, the service it implements)
    ("scheduler_svc.server", "SchedulerServicer", "kvstash.v1.Scheduler"),
    ("scheduler_svc.vllm_engine", "VllmEngineServicer", "vllm.grpc.engine.VllmEngine"),
    ("gpu_worker.server", "WorkerServicer", "kvstash.v1.Worker"),
    ("cache_svc.server", "CacheServicer", "kvstash.v1.KVCache"),
]


@pytest.mark.parametrize(("module", "servicer", "service"), SERVICERS)
def test_every_rpc_of_every_service_maps_its_errors(module, servicer, service) -> None:
    """Whatever a handler raises, its client gets a status it can act on (and
    a bug INTERNAL), never grpc's UNKNOWN: every RPC goes through maps_errors."""
    cls = getattr(importlib.import_module(module), servicer)  # registers its protos
    methods = descriptor_pool.Default().FindServiceByName(service).methods
    unmapped = [m.name for m in methods
                if getattr(cls, m.name).__code__.co_filename != rpc_errors.__file__]
    assert not unmapped, f"{servicer} methods without rpc_errors.maps_errors: {unmapped}"


def test_preview_clips_client_input() -> None:
    assert errors.preview("abc") == "'abc'"
    clipped = errors.preview("x" * 10_000)
    assert len(clipped) < 80
    assert clipped.endswith("(10000 chars)")
