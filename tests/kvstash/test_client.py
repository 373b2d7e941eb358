"""kvstash.client, the public Python client: whatever goes wrong, a
kvstash.errors class, and no call waits for ever."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest

from kvstash import errors
from kvstash.client import Client
from kvstash.common import rpc_server
from kvstash.v1 import scheduler_pb2, scheduler_pb2_grpc


class StalledScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Takes calls and never answers them."""

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await asyncio.sleep(3600)

    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await asyncio.sleep(3600)


async def test_public_client_abort_and_stats_are_bounded() -> None:
    """They had no deadline: a scheduler that took the call and never
    answered held the caller for ever."""
    server, port, _ = await rpc_server.create_server(
        "127.0.0.1:0",
        [lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(StalledScheduler(), s)],
        [])
    address = f"127.0.0.1:{port}"
    try:
        async with Client(address, timeout_s=0.3) as client:  # the client's, for calls given none
            for call in (client.abort("r"), client.stats()):
                with pytest.raises(errors.Unavailable, match="DEADLINE_EXCEEDED"):
                    await asyncio.wait_for(call, 5)
        async with Client(address, timeout_s=None) as client:
            for call in (client.abort("r", timeout_s=0.3), client.stats(timeout_s=0.3)):
                with pytest.raises(errors.Unavailable, match="DEADLINE_EXCEEDED"):
                    await asyncio.wait_for(call, 5)
    finally:
        await server.stop(None)


class AnsweringScheduler(scheduler_pb2_grpc.SchedulerServicer):
    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return scheduler_pb2.SchedulerStats(num_total_blocks=7)


async def test_a_port_past_65535_is_refused_not_wrapped_around() -> None:
    """gRPC's client takes "host:PORT+65536" as host:PORT: the client called
    whatever served there (another stack) as if it were the one named."""
    server, port, _ = await rpc_server.create_server(
        "127.0.0.1:0",
        [lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(AnsweringScheduler(), s)],
        [])
    try:
        async with Client(f"127.0.0.1:{port}") as client:  # the one it serves on
            assert (await client.stats()).num_total_blocks == 7
        # A host without a port was called on 443.
        for address in (f"127.0.0.1:{port + 65536}", "127.0.0.1:", "", "localhost", "[::1]"):
            with pytest.raises(errors.InvalidArgument, match="is not host:port"):
                async with Client(address) as client:
                    await client.stats(timeout_s=10)
    finally:
        await server.stop(None)


@pytest.mark.parametrize(("address", "message"), [
    ("http://127.0.0.1:50051", "give host:port, not a URL"),
    ("grpc://localhost:50051", "give host:port, not a URL"),
    (" 127.0.0.1:50051", "it has spaces around it"),
    ("127.0.0.1:50051\n", "it has spaces around it"),
])
async def test_a_url_or_spaces_around_the_address_are_refused(address, message) -> None:
    """They were taken, and every call then failed Unavailable 'Misformatted
    domain name' (gRPC read the whole as a host name)."""
    with pytest.raises(errors.InvalidArgument, match=f"is not host:port: {message}"):
        Client(address)


async def test_grpc_target_forms_are_taken() -> None:
    for address in ("localhost:50051", "[::1]:50051", "unix:/tmp/kvstash.sock",
                    "unix:///tmp/kvstash.sock", "dns:///localhost:50051",
                    "ipv4:127.0.0.1:50051"):
        async with Client(address):
            pass


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 0}, "max_tokens is 0, must be > 0"),
    ({"prompt": [5, -1]}, r"prompt\[1\] is -1"),
    ({"seed": -1}, "seed is -1"),
    ({"top_k": -3}, "top_k is -3"),
    ({"stop_token_ids": [1 << 32]}, r"stop_token_ids\[0\] is 4294967296"),
    # Sent, 0 (or what rounds to 0 as a float32) is unset: top_p 1, every token.
    ({"top_p": 0.0}, r"top_p is 0.0, must be in \(0, 1\]"),
    ({"top_p": 1e-50}, r"top_p is 1e-50, must be in \(0, 1\]"),
    ({"top_p": -0.5}, r"top_p is -0.5, must be in \(0, 1\]"),
    ({"top_p": float("nan")}, r"top_p is nan, must be in \(0, 1\]"),
    # What Python makes of `kvstash generate` given latin-1 bytes: protobuf's
    # UnicodeEncodeError named neither argument.
    ({"prompt": "caf\udce9"}, r"prompt is not UTF-8 text: surrogates not allowed "
                               r"\(character 3, '\\udce9'\)"),
    ({"request_id": "r\udce9"}, r"request_id must be 1-256 visible ASCII characters"),
    ({"request_id": "a b"}, r"request_id must be 1-256 visible ASCII characters"),
    # Wrong types were TypeErrors naming no argument ("'<=' not supported
    # between instances of 'str' and 'int'"), from the client, grpc or protobuf,
    # and bytes were sent as the token ids of their bytes.
    ({"max_tokens": "5"}, "max_tokens is '5', must be an int"),
    ({"max_tokens": True}, "max_tokens is True, must be an int"),
    ({"top_k": 1.5}, "top_k is 1.5, must be an int"),
    ({"seed": "1"}, "seed is '1', must be an int"),
    ({"temperature": "x"}, "temperature is 'x', must be a number"),
    ({"top_p": "0.5"}, "top_p is '0.5', must be a number"),
    ({"ignore_eos": "no"}, "ignore_eos is 'no', must be a bool"),
    ({"request_id": 5}, "request_id is 5, must be a str"),
    ({"stop_token_ids": 5}, "stop_token_ids is 5, must be token ids"),
    ({"stop_token_ids": ["a"]}, r"stop_token_ids\[0\] is 'a', must be an int"),
    ({"prompt": None}, "prompt is None, must be text or token ids"),
    ({"prompt": b"abc"}, "prompt is b'abc', must be text or token ids"),
    ({"prompt": [1, 1.5]}, r"prompt\[1\] is 1.5, must be an int"),
    ({"prompt": [None]}, r"prompt\[0\] is None, must be an int"),
    # A deadline in the past was sent, to fail DEADLINE_EXCEEDED.
    ({"timeout_s": -1}, r"timeout_s is -1, must be > 0"),
    ({"timeout_s": float("nan")}, r"timeout_s is nan, must be > 0"),
    ({"timeout_s": "x"}, "timeout_s is 'x', must be a number"),
])
async def test_generate_argument_errors_are_invalid_argument(kwargs, message) -> None:
    """Not a bare ValueError, nor protobuf's, which names no argument."""
    async with Client("127.0.0.1:1") as client:  # nothing listens: nothing is sent
        with pytest.raises(errors.InvalidArgument, match=message):
            async for _ in client.generate(**{"prompt": "hi", **kwargs}):
                pass


class EchoingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Finishes each Generate at once, keeping what it was sent."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.requests.append(request)
        yield scheduler_pb2.GenerateResponse(request_id="r", token_ids=[9],
                                             finish_reason=scheduler_pb2.FINISH_REASON_STOP)


async def test_numpy_token_ids_are_sent_as_ints() -> None:
    """A numpy array of token ids failed with numpy's 'The truth value of an
    array ... is ambiguous' (a ValueError), though numpy ints one by one passed."""
    scheduler = EchoingScheduler()
    server, port, _ = await rpc_server.create_server(
        "127.0.0.1:0",
        [lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, s)], [])
    try:
        async with Client(f"127.0.0.1:{port}") as client:
            result = await client.complete(np.array([1, 2]),
                                           stop_token_ids=np.array([7], dtype=np.uint32))
            assert result.token_ids == [9]
            with pytest.raises(errors.InvalidArgument, match=r"prompt\[1\] is -2"):
                await client.complete(np.array([1, -2]))
            with pytest.raises(errors.InvalidArgument, match=r"prompt\[0\] is .*1.5"):
                await client.complete(np.array([1.5]))
        [sent] = scheduler.requests
        assert list(sent.token_ids.ids) == [1, 2]
        assert list(sent.sampling.stop_token_ids) == [7]
    finally:
        await server.stop(None)


class SlowScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Streams one token, then nothing; answers nothing else."""

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        yield scheduler_pb2.GenerateResponse(request_id="r", token_ids=[1], text="a")
        await asyncio.sleep(3600)

    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await asyncio.sleep(3600)


async def test_closing_the_client_ends_its_calls_with_kvstash_errors() -> None:
    """Calls in flight when the client was closed raised asyncio.CancelledError
    in tasks nobody cancelled (a gather of them read as its own cancellation),
    and a call made after close raised grpc's UsageError."""
    server, port, _ = await rpc_server.create_server(
        "127.0.0.1:0",
        [lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(SlowScheduler(), s)],
        [])
    try:
        client = Client(f"127.0.0.1:{port}")
        streamed = asyncio.Event()

        async def stream() -> None:
            async for _ in client.generate("hi"):
                streamed.set()

        calls = [asyncio.ensure_future(stream()), asyncio.ensure_future(client.stats())]
        await asyncio.wait_for(streamed.wait(), 30)
        await client.close()
        for call in calls:
            with pytest.raises(errors.Unavailable, match="the client was closed during the call"):
                await asyncio.wait_for(call, 30)
        for after in (client.stats(), client.abort("r"), client.complete("hi")):
            with pytest.raises(errors.FailedPrecondition, match="the client is closed"):
                await after
        # A task that is itself cancelled still ends cancelled.
        client = Client(f"127.0.0.1:{port}")
        task = asyncio.ensure_future(client.complete("hi"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.close()
    finally:
        await server.stop(None)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"address": 123}, "address is 123, must be a str"),
    ({"timeout_s": 0}, "timeout_s is 0, must be > 0"),
    ({"timeout_s": "60"}, "timeout_s is '60', must be a number"),
])
async def test_client_argument_errors_are_invalid_argument(kwargs, message) -> None:
    """They were AttributeError ('int' object has no attribute 'endswith'), or
    accepted to fail every call later."""
    with pytest.raises(errors.InvalidArgument, match=message):
        Client(**{"address": "127.0.0.1:1", **kwargs})


async def test_unary_argument_errors_are_invalid_argument() -> None:
    async with Client("127.0.0.1:1") as client:  # nothing listens: nothing is sent
        with pytest.raises(errors.InvalidArgument, match="request_id is 5, must be a str"):
            await client.abort(5)  # type: ignore[arg-type]
        with pytest.raises(errors.InvalidArgument, match="timeout_s is -1, must be > 0"):
            await client.stats(timeout_s=-1)
