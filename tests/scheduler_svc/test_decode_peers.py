"""DecodePeers, the prefill instance's side of ReserveBlocks and Decode, over
real gRPC to scripted decode instances: which instance is asked, in which
order, how long it keeps asking, what it releases, and what a Decode stream
becomes (domain events, domain errors)."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import pytest

from kvstash import errors
from kvstash.common.bearer import TokenAuth
from kvstash.common.binding import free_port
from kvstash.common.layout import Layout
from kvstash.common.sampling import SamplingParams
from kvstash.common.security import Security
from kvstash.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc import decode_peers
from scheduler_svc.core.request import RequestStatus, RequestUsage
from scheduler_svc.decode_peers import (
    DecodePeers,
    RemoteAborted,
    RemoteEvent,
    RemoteFinished,
    RemoteTokens,
    remote_event,
)

LAYOUT = Layout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")
SAMPLING = SamplingParams(max_tokens=8)


@dataclass(slots=True)
class ScriptedDecode(scheduler_pb2_grpc.SchedulerServicer):
    """A decode instance that answers ReserveBlocks as `answer` says."""

    answer: Callable[[scheduler_pb2.ReserveBlocksRequest], scheduler_pb2.ReserveBlocksResponse]
    delay_s: float = 0.0
    asked: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    async def ReserveBlocks(self, request: scheduler_pb2.ReserveBlocksRequest,
                            context: grpc.aio.ServicerContext,
                            ) -> scheduler_pb2.ReserveBlocksResponse:
        self.asked.append(request.request_id)
        await asyncio.sleep(self.delay_s)
        return self.answer(request)

    async def Abort(self, request: scheduler_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> scheduler_pb2.AbortResponse:
        self.aborted.append(request.request_id)
        return scheduler_pb2.AbortResponse()


def accept(_: scheduler_pb2.ReserveBlocksRequest) -> scheduler_pb2.ReserveBlocksResponse:
    return scheduler_pb2.ReserveBlocksResponse(accepted=True, expires_in_s=30)


def refuse(_: scheduler_pb2.ReserveBlocksRequest) -> scheduler_pb2.ReserveBlocksResponse:
    return scheduler_pb2.ReserveBlocksResponse(accepted=False, retry_after_s=0.05)


Serve = Callable[[ScriptedDecode], Awaitable[int]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Starts a decode instance on loopback; returns its port."""
    servers: list[grpc.aio.Server] = []

    async def start(servicer: ScriptedDecode) -> int:
        server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return port

    yield start
    for server in servers:
        await server.stop(None)



async def test_refusals_and_unreachable_instances_are_skipped(serve: Serve) -> None:
    full, free = ScriptedDecode(refuse), ScriptedDecode(accept)
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{await serve(full)}",
                 f"127.0.0.1:{await serve(free)}"]
    peers = DecodePeers(addresses, LAYOUT, wait_s=5)
    try:
        chosen = [await peers.reserve(f"r{i}", [1, 2, 3], SAMPLING) for i in range(3)]
    finally:
        await peers.close()
    assert [p.address if p else None for p in chosen] == [addresses[2]] * 3
    assert free.asked == ["r0", "r1", "r2"]
    # The start rotates: the full instance is asked only when it comes first
    # or the unreachable one came before it.
    assert 1 <= len(full.asked) <= 3


async def test_every_refusal_until_the_wait_is_spent_means_none(serve: Serve) -> None:
    a, b = ScriptedDecode(refuse), ScriptedDecode(refuse)
    peers = DecodePeers([f"127.0.0.1:{await serve(a)}", f"127.0.0.1:{await serve(b)}"],
                        LAYOUT, wait_s=0.6, max_backoff_s=0.2)
    started = time.monotonic()
    try:
        assert await peers.reserve("r", [1, 2, 3], SAMPLING) is None
    finally:
        await peers.close()
    elapsed = time.monotonic() - started
    assert 0.3 < elapsed < 2.0
    # Round after round, backing off: more than once each, far from a busy loop.
    assert 2 <= len(a.asked) <= 12 and 2 <= len(b.asked) <= 12


@dataclass(slots=True)
class FreesUp(ScriptedDecode):
    """Refuses (hinting `hint_s`) until `after_s` past its first ReserveBlocks."""

    hint_s: float = 1.0
    after_s: float = 1.25
    first: float | None = None

    async def ReserveBlocks(self, request: scheduler_pb2.ReserveBlocksRequest,
                            context: grpc.aio.ServicerContext,
                            ) -> scheduler_pb2.ReserveBlocksResponse:
        self.asked.append(request.request_id)
        now = time.monotonic()
        self.first = now if self.first is None else self.first
        if now - self.first >= self.after_s:
            return accept(request)
        return scheduler_pb2.ReserveBlocksResponse(accepted=False, retry_after_s=self.hint_s)


async def test_the_last_round_is_asked_when_the_wait_is_spent(serve: Serve) -> None:
    """A back-off that would end past the wait is cut to it, and the
    instances are asked once more then. Before, the asking stopped as soon
    as the next back-off would overrun: here after 1 s of a 1.5 s wait (up
    to --handoff-wait's last second, or a third of a short one, went
    unused), though the instance freed up within the wait."""
    instance = FreesUp(accept)
    peers = DecodePeers([f"127.0.0.1:{await serve(instance)}"], LAYOUT, wait_s=1.5,
                        max_backoff_s=1.0)
    try:
        assert await peers.reserve("r", [1], SAMPLING) is not None
    finally:
        await peers.close()
    assert 2 <= len(instance.asked) <= 3


async def test_a_name_counts_as_every_address_it_resolves_to(serve: Serve) -> None:
    free = ScriptedDecode(accept)
    port = await serve(free)
    peers = DecodePeers([f"localhost:{port}"], LAYOUT, wait_s=5)
    try:
        peer = await peers.reserve("r", [1], SAMPLING)
    finally:
        await peers.close()
    assert peer is not None and peer.address == f"127.0.0.1:{port}"
    assert free.asked == ["r"]


async def test_an_empty_or_padded_address_in_the_list_is_no_instance(serve: Serve) -> None:
    """--decode-address "a:1," (or "a:1, b:2") passes the start-up check;
    the empty entry made every hand-off fail with a ValueError traceback
    (each request then decoded on the prefill instance), and a padded
    one never resolved."""
    a, b = ScriptedDecode(refuse), ScriptedDecode(accept)
    listed = f"127.0.0.1:{await serve(a)}, 127.0.0.1:{await serve(b)},"
    peers = DecodePeers(listed.split(","), LAYOUT, wait_s=5)
    try:
        peer = await peers.reserve("r", [1], SAMPLING)
    finally:
        await peers.close()
    assert peer is not None and b.asked == ["r"]


class Mismatched(ScriptedDecode):
    """A decode instance with another KV layout."""

    async def ReserveBlocks(self, request: scheduler_pb2.ReserveBlocksRequest,
                            context: grpc.aio.ServicerContext,
                            ) -> scheduler_pb2.ReserveBlocksResponse:
        self.asked.append(request.request_id)
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV layout differs")


async def test_a_layout_mismatch_is_logged_and_skipped(
        serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    other, free = Mismatched(accept), ScriptedDecode(accept)
    peers = DecodePeers([f"127.0.0.1:{await serve(other)}", f"127.0.0.1:{await serve(free)}"],
                        LAYOUT, wait_s=5)
    with caplog.at_level(logging.ERROR, logger="scheduler_svc.decode_peers"):
        try:
            peer = await peers.reserve("r", [1], SAMPLING)
        finally:
            await peers.close()
    assert peer is not None and free.asked == ["r"]
    assert other.asked == ["r"] and "KV layout differs" in caplog.text


async def test_an_instance_that_refuses_the_request_itself_is_not_asked_again(
        serve: Serve) -> None:
    """Before, a layout mismatch or a request too long for the decode
    instances was asked again round after round for the whole wait (10 s
    by default) before the request decoded here."""
    other, full = Mismatched(accept), ScriptedDecode(refuse)
    peers = DecodePeers([f"127.0.0.1:{await serve(other)}", f"127.0.0.1:{await serve(full)}"],
                        LAYOUT, wait_s=0.6, max_backoff_s=0.1)
    try:
        assert await peers.reserve("r", [1], SAMPLING) is None
        assert other.asked == ["r"] and len(full.asked) >= 3
        started = time.monotonic()
        alone = DecodePeers([f"127.0.0.1:{await serve(other)}"], LAYOUT, wait_s=30)
        try:
            assert await alone.reserve("s", [1], SAMPLING) is None
        finally:
            await alone.close()
        assert time.monotonic() - started < 5 and other.asked == ["r", "s"]
    finally:
        await peers.close()


async def test_a_decode_instance_refusing_the_token_is_not_asked_again(
        caplog: pytest.LogCaptureFixture) -> None:
    """The prefill instance's --token-file token goes with ReserveBlocks and
    Decode. One the decode instance refuses (UNAUTHENTICATED) was asked
    again round after round, logged at DEBUG only, so every request waited
    out --handoff-wait (10 s) before decoding on the prefill instance, and
    nothing said why."""
    instance = DecodingInstance(accept, responses=[scheduler_pb2.GenerateResponse(token_ids=[8])])
    server = grpc.aio.server(interceptors=[TokenAuth(frozenset({"right"}))])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(instance, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        right = DecodePeers([address], LAYOUT, Security(token="right"), wait_s=5)
        try:
            peer = await right.reserve("r", [1], SAMPLING)
            assert peer is not None
            assert [e async for e in right.decode(peer, "r", "s", 1, 7)] == [RemoteTokens([8])]
        finally:
            await right.close()
        wrong = DecodePeers([address], LAYOUT, Security(token="wrong"), wait_s=60)
        try:
            assert await asyncio.wait_for(wrong.reserve("q", [1], SAMPLING), 20) is None
        finally:
            await wrong.close()
    finally:
        await server.stop(None)
    assert instance.asked == ["r"]
    assert any(r.levelno == logging.ERROR and "UNAUTHENTICATED" in r.getMessage()
               for r in caplog.records)


async def released(decode: ScriptedDecode) -> None:
    """Waits up to 2 s for the release the decode instance hears as an Abort."""
    for _ in range(100):
        if decode.aborted:
            return
        await asyncio.sleep(0.02)


async def test_a_reservation_cancelled_in_flight_is_released(serve: Serve) -> None:
    slow = ScriptedDecode(accept, delay_s=0.3)
    peers = DecodePeers([f"127.0.0.1:{await serve(slow)}"], LAYOUT, wait_s=5)
    try:
        task = asyncio.create_task(peers.reserve("r", [1], SAMPLING))
        while not slow.asked:
            await asyncio.sleep(0.01)
        task.cancel()  # the client went away while the decode instance decided
        with pytest.raises(asyncio.CancelledError):
            await task
        await released(slow)
    finally:
        await peers.close()
    assert slow.aborted == ["r"]


async def test_a_reservation_timed_out_in_flight_is_released(
        serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    """The instance may grant it after the call gave up: the grant is let go
    at once, not left to expire. (A timeout of 1 s, not less: the call must
    reach the instance before it expires, its connection made on a loaded
    machine; at 0.1 s CI once saw it expire unsent.)"""
    monkeypatch.setattr(decode_peers, "_RESERVE_TIMEOUT_S", 1.0)
    slow = ScriptedDecode(accept, delay_s=2.0)
    peers = DecodePeers([f"127.0.0.1:{await serve(slow)}"], LAYOUT, wait_s=1.0)
    try:
        assert await peers.reserve("r", [1], SAMPLING) is None
        await released(slow)
    finally:
        await peers.close()
    assert slow.asked == ["r"] and slow.aborted == ["r"]


async def test_a_hung_instance_holds_a_request_no_longer_than_the_wait(
        serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ReserveBlocks waits at most what is left of --handoff-wait (or
    half a second, for the last round's): a hung instance held every request
    asking it for the call's whole bound (5 s, 30 here) past a 0.3 s wait."""
    monkeypatch.setattr(decode_peers, "_RESERVE_TIMEOUT_S", 30.0)
    hung = ScriptedDecode(accept, delay_s=60)
    peers = DecodePeers([f"127.0.0.1:{await serve(hung)}"], LAYOUT, wait_s=0.3)
    try:
        started = time.monotonic()
        assert await peers.reserve("r", [1], SAMPLING) is None
        assert time.monotonic() - started < 10  # 0.3 s wait + at most 0.5 s more, loaded
    finally:
        await peers.close()


@dataclass(slots=True)
class SlowToLetGo(ScriptedDecode):
    """Answers its first ReserveBlocks after `delay_s`, every Abort after
    `abort_delay_s`; `done` lists what it did, in order."""

    abort_delay_s: float = 0.0
    done: list[str] = field(default_factory=list)

    async def ReserveBlocks(self, request: scheduler_pb2.ReserveBlocksRequest,
                            context: grpc.aio.ServicerContext,
                            ) -> scheduler_pb2.ReserveBlocksResponse:
        self.asked.append(request.request_id)
        if len(self.asked) == 1:
            await asyncio.sleep(self.delay_s)
        self.done.append("reserved")
        return self.answer(request)

    async def Abort(self, request: scheduler_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> scheduler_pb2.AbortResponse:
        await asyncio.sleep(self.abort_delay_s)
        self.done.append("aborted")
        return scheduler_pb2.AbortResponse()


async def test_an_instance_is_asked_again_only_once_its_release_is_answered(
        serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grant made before the release of a timed-out call arrived would be
    ended by it."""
    monkeypatch.setattr(decode_peers, "_RESERVE_TIMEOUT_S", 0.1)
    slow = SlowToLetGo(accept, delay_s=0.3, abort_delay_s=0.05)
    peers = DecodePeers([f"127.0.0.1:{await serve(slow)}"], LAYOUT, wait_s=5)
    try:
        assert await peers.reserve("r", [1], SAMPLING) is not None
    finally:
        await peers.close()
    # The first call ended at its deadline there too.
    assert slow.done == ["aborted", "reserved"]


def test_no_address_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one decode instance"):
        DecodePeers([], LAYOUT)


@dataclass(slots=True)
class DecodingInstance(ScriptedDecode):
    """A decode instance that sends `responses` for Decode, then fails with
    `error` if set."""

    responses: list[scheduler_pb2.GenerateResponse] = field(default_factory=list)
    error: grpc.StatusCode | None = None
    hang: bool = False  # then sends nothing more until cancelled
    decoded: list[str] = field(default_factory=list)  # ids of calls served
    ended: list[str] = field(default_factory=list)  # ids of calls served to their end

    async def Decode(self, request: scheduler_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext,
                     ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        self.decoded.append(request.request_id)
        try:
            for response in self.responses:
                yield response
            if self.hang:
                await asyncio.Event().wait()
            if self.error is not None:
                await context.abort(self.error, "its worker went away")
        finally:
            self.ended.append(request.request_id)


async def decoded(serve: Serve, instance: DecodingInstance) -> list[RemoteEvent]:
    peers = DecodePeers([f"127.0.0.1:{await serve(instance)}"], LAYOUT, wait_s=5)
    try:
        peer = await peers.reserve("r", [1, 2, 3], SAMPLING)
        assert peer is not None
        return [event async for event in peers.decode(peer, "r", "s", 3, 7)]
    finally:
        await peers.close()


async def test_a_channel_to_an_address_no_longer_resolved_closes_once_unused(
        serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod of a headless Service restarted at another address: its old
    channel leaves at the next lookup, still serving the calls of a peer
    held, and is closed once none is."""
    instance = DecodingInstance(accept, responses=[scheduler_pb2.GenerateResponse(token_ids=[8])])
    port = await serve(instance)
    addresses = ["127.0.0.1"]

    async def getaddrinfo(host: str, port: int, **kwargs: object) -> list[tuple[object, ...]]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    peers = DecodePeers([f"decode.svc:{port}"], LAYOUT, wait_s=0.05)
    try:
        peer = await peers.reserve("r", [1], SAMPLING)
        assert peer is not None
        old = weakref.ref(peers._channels[peer.address])
        addresses[:] = ["127.0.0.2"]  # nothing listens there
        assert await peers.reserve("s", [1], SAMPLING) is None
        assert list(peers._channels) == [f"127.0.0.2:{port}"]
        assert [e async for e in peers.decode(peer, "r", "s", 1, 7)] == [RemoteTokens([8])]
        del peer
        gc.collect()
        assert old() is None  # grpc.aio.Channel.__del__ closed it
    finally:
        await peers.close()


async def test_a_decode_stream_arrives_as_domain_events(serve: Serve) -> None:
    usage = scheduler_pb2.Usage(prompt_tokens=3, completion_tokens=4, num_preemptions=1,
                                num_recomputed_tokens=2, bytes_offloaded=64)
    events = await decoded(serve, DecodingInstance(accept, responses=[
        scheduler_pb2.GenerateResponse(token_ids=[8, 9]),
        scheduler_pb2.GenerateResponse(
            token_ids=[5], finish_reason=scheduler_pb2.FINISH_REASON_STOP, usage=usage)]))
    assert events == [RemoteTokens([8, 9]), RemoteFinished(
        [5], RequestStatus.FINISHED_STOPPED, RequestUsage(3, 4, 1, 2, 64, None))]
    aborted = await decoded(serve, DecodingInstance(accept, responses=[
        scheduler_pb2.GenerateResponse(finish_reason=scheduler_pb2.FINISH_REASON_ABORT)]))
    assert aborted == [RemoteAborted()]


async def test_a_failed_decode_call_raises_its_domain_error(serve: Serve) -> None:
    with pytest.raises(errors.Unavailable, match="decode instance: its worker went away"):
        await decoded(serve, DecodingInstance(accept, error=grpc.StatusCode.UNAVAILABLE))
    with pytest.raises(errors.NotFound):
        await decoded(serve, DecodingInstance(accept, error=grpc.StatusCode.NOT_FOUND))


def test_a_finish_reason_unknown_here_is_an_error_the_hand_off_handles() -> None:
    """A decode instance of a newer version may end a stream with a reason
    this one does not know: that is a KvstashError (the relay then takes the
    request back and finishes it here), not a KeyError out of the relay."""
    assert remote_event(scheduler_pb2.GenerateResponse(token_ids=[3])) == RemoteTokens([3])
    with pytest.raises(errors.Unimplemented, match="finish reason 99, unknown here"):
        remote_event(scheduler_pb2.GenerateResponse(token_ids=[3], finish_reason=99))


async def relay(peers: DecodePeers, peer: decode_peers.DecodePeer, read: asyncio.Event) -> None:
    async for _ in peers.decode(peer, "r", "s", 3, 7):
        read.set()


async def test_a_decode_cancelled_before_any_answer_is_released(serve: Serve) -> None:
    """Stub.Decode only schedules its request: the relay cancelled at once
    (its client's abort) cancelled the call before it left, and the decode
    instance, hearing neither Decode nor Abort, held the reservation until
    it expired (30 s by default)."""
    instance = DecodingInstance(accept, hang=True)
    peers = DecodePeers([f"127.0.0.1:{await serve(instance)}"], LAYOUT, wait_s=5)
    try:
        peer = await peers.reserve("r", [1, 2, 3], SAMPLING)
        assert peer is not None
        task = asyncio.create_task(relay(peers, peer, asyncio.Event()))
        await asyncio.sleep(0)  # its Decode is made, not sent
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await released(instance)
    finally:
        await peers.close()
    assert instance.aborted == ["r"]


async def test_a_decode_cancelled_after_an_answer_is_only_cancelled(serve: Serve) -> None:
    """The instance answered, so it has the call: cancelling it aborts the
    request there, and no Abort follows."""
    instance = DecodingInstance(accept, hang=True,
                                responses=[scheduler_pb2.GenerateResponse(token_ids=[8])])
    peers = DecodePeers([f"127.0.0.1:{await serve(instance)}"], LAYOUT, wait_s=5)
    try:
        peer = await peers.reserve("r", [1, 2, 3], SAMPLING)
        assert peer is not None
        read = asyncio.Event()
        task = asyncio.create_task(relay(peers, peer, read))
        await asyncio.wait_for(read.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):  # its cancellation reaches the instance
            if instance.ended:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # an Abort sent with it would have arrived
    finally:
        await peers.close()
    assert (instance.ended, instance.aborted) == (["r"], [])
