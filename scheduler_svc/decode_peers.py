"""A prefill instance's decode instances (P/D): where each request decodes.

    reserve()  ReserveBlocks on the decode instances in turn, from a start
               that rotates per request (a DNS name counts as every address
               it resolves to, looked up again each round). After a round of
               refusals it waits (the decode instances' retry hint, doubling
               per round up to `max_backoff_s`) and tries again, until
               `wait_s` is spent: then None, and the prefill instance takes
               the request back from the cache and decodes it itself. A
               request is never dropped for want of a decode instance. A
               call given up on (timed out, cancelled) is released there, and
               that instance not asked again for the request until the
               release is answered (`release_later`).
    decode()   Decode on the instance that reserved: its stream as domain
               events (RemoteTokens, then RemoteFinished or RemoteAborted);
               a failed call raises its kvstash.errors class; one cancelled
               before any answer is released there (`release_later`)
    release()  Abort there, best effort, for a reservation that will not be
               used (it would expire anyway); `release_later` in a task of
               its own, which cancelling its caller does not cancel

The request id each takes is the one the decode instance knows the request
by: a prefill instance sends its hand-off's snapshot id (handoff.py).

An instance that is down, or answers an error, is skipped for that round;
one that refuses the request itself (another KV layout, a request it cannot
serve: FAILED_PRECONDITION, INVALID_ARGUMENT) or our token (UNAUTHENTICATED)
is logged and not asked again for it: when no other instance is left, the
request decodes here at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import grpc

from kvstash import errors
from kvstash.common import rpc_connections, rpc_errors, wire
from kvstash.common.layout import Layout
from kvstash.common.sampling import SamplingParams
from kvstash.common.security import PLAINTEXT, Security
from kvstash.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.core.pd import HANDOFF_WAIT_S, RESERVATION_MAX_BACKOFF_S
from scheduler_svc.core.request import RequestStatus, RequestUsage
from scheduler_svc.v1_wire import FINISH_STATUS, usage_from_proto

log = logging.getLogger(__name__)

# One ReserveBlocks call; a decode instance answers it without I/O. Within
# --handoff-wait, a call waits at most what is left of it, or _LAST_ASK_S for
# the last round's: one hung instance (a dead pod's address still in DNS)
# must not hold every request asking it for the whole bound.
_RESERVE_TIMEOUT_S = 5.0
_LAST_ASK_S = 0.5
# Answers that refuse the request itself (or this instance's token), not the
# moment: asking again would get the same.
_FOR_GOOD = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                       grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED,
                       grpc.StatusCode.PERMISSION_DENIED})


@dataclass(frozen=True, slots=True)
class DecodePeer:
    """A decode instance that holds a reservation for a request."""

    address: str  # host:port as dialled
    stub: scheduler_pb2_grpc.SchedulerStub


@dataclass(frozen=True, slots=True)
class RemoteTokens:
    """Tokens the decode instance generated."""

    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class RemoteFinished:
    """The decode instance finished the request with these last tokens."""

    token_ids: list[int]
    status: RequestStatus  # FINISHED_STOPPED or FINISHED_LENGTH
    usage: RequestUsage  # its part of the request


@dataclass(frozen=True, slots=True)
class RemoteAborted:
    """The request was aborted there (not by us: we cancel the call)."""


RemoteEvent = RemoteTokens | RemoteFinished | RemoteAborted


def remote_event(response: scheduler_pb2.GenerateResponse) -> RemoteEvent:
    if not response.finish_reason:
        return RemoteTokens(list(response.token_ids))
    status = FINISH_STATUS.get(response.finish_reason)
    if status is None:  # a peer of another version: lost there, recomputed here
        raise errors.Unimplemented(f"decode instance sent finish reason "
                                   f"{response.finish_reason!r}, unknown here")
    if status is RequestStatus.FINISHED_ABORTED:
        return RemoteAborted()
    return RemoteFinished(list(response.token_ids), status, usage_from_proto(response.usage))


class DecodePeers:
    def __init__(
        self, addresses: Sequence[str], layout: Layout, security: Security = PLAINTEXT, *,
        wait_s: float = HANDOFF_WAIT_S, max_backoff_s: float = RESERVATION_MAX_BACKOFF_S,
    ) -> None:
        # An empty entry ("a:1,") passes --decode-address's check as nothing.
        addresses = [a.strip() for a in addresses if a.strip()]
        if not addresses:
            raise ValueError("a prefill instance needs at least one decode instance address")
        self._addresses = addresses
        self._layout = layout
        self._security = security
        self._wait_s = wait_s
        self._max_backoff_s = max_backoff_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._turn = itertools.count()
        # Releases in flight, by (address, request id).
        self._releases: dict[tuple[str, str], asyncio.Task[None]] = {}

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def reserve(
        self, request_id: str, prompt: Sequence[int], sampling: SamplingParams
    ) -> DecodePeer | None:
        """A decode instance that reserved blocks for the request, or None
        once `wait_s` passed with every one refusing or unreachable."""
        request = scheduler_pb2.ReserveBlocksRequest(
            request_id=request_id, prompt=scheduler_pb2.TokenIds(ids=prompt),
            sampling=wire.sampling_to_proto(sampling), block_size=self._layout.block_size,
            bytes_per_block=self._layout.bytes_per_block,
            layout=wire.layout_to_proto(self._layout))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait_s
        backoff = 0.0
        refused: set[str] = set()  # addresses that refused the request itself
        while True:
            peers = await self._resolve()
            start = next(self._turn)
            hint = 0.0
            for i in range(len(peers)):
                peer = peers[(start + i) % len(peers)]
                if peer.address in refused or (peer.address, request_id) in self._releases:
                    continue  # a grant now could be ended by that release arriving after it
                timeout_s = min(_RESERVE_TIMEOUT_S, max(deadline - loop.time(), _LAST_ASK_S))
                answer = await self._ask(peer, request, timeout_s)
                if isinstance(answer, grpc.StatusCode):
                    if answer in _FOR_GOOD:
                        refused.add(peer.address)
                    continue
                if answer.accepted:
                    return peer
                hint = max(hint, answer.retry_after_s)
            if peers and refused.issuperset(peer.address for peer in peers):
                log.info("request %s: every decode instance refused it; decoding it here",
                         request_id)
                return None
            now = loop.time()
            if now >= deadline:
                log.info("request %s: no decode instance reserved blocks within %.1f s; "
                         "decoding it here", request_id, self._wait_s)
                return None
            backoff = min(max(hint, 2 * backoff, 0.01), self._max_backoff_s)
            await asyncio.sleep(min(backoff, deadline - now))  # the last round at the deadline

    async def _ask(
        self, peer: DecodePeer, request: scheduler_pb2.ReserveBlocksRequest, timeout_s: float
    ) -> scheduler_pb2.ReserveBlocksResponse | grpc.StatusCode:
        """One ReserveBlocks: its answer, or the code of the error it failed
        with. A reservation the instance may have granted to a call
        cancelled or timed out here is released."""
        call = peer.stub.ReserveBlocks(request, timeout=timeout_s)
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            log.log(logging.ERROR if code in _FOR_GOOD else logging.DEBUG,
                    "decode instance %s: ReserveBlocks failed (%s: %s)", peer.address,
                    code.name, exc.details())
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.release_later(peer, request.request_id)
            return code
        except asyncio.CancelledError:
            self.release_later(peer, request.request_id)
            raise

    def release_later(self, peer: DecodePeer, request_id: str) -> asyncio.Task[None]:
        """`release` in a task of its own: cancelling whoever asked for it
        leaves it to be sent."""
        key = (peer.address, request_id)
        task = asyncio.get_running_loop().create_task(self.release(peer, request_id))
        self._releases[key] = task
        task.add_done_callback(lambda _: self._releases.pop(key, None))
        return task

    async def release(self, peer: DecodePeer, request_id: str) -> None:
        """Lets go of request_id's reservation (or decode) on `peer`, if any
        (the decode instance answers NOT_FOUND where there is none)."""
        # UsageError: the channel closed (shutting down); the reservation expires there.
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
            await peer.stub.Abort(scheduler_pb2.AbortRequest(request_id=request_id),
                                  timeout=_RESERVE_TIMEOUT_S)

    async def decode(
        self, peer: DecodePeer, request_id: str, snapshot_id: str, num_tokens: int,
        first_token_id: int,
    ) -> AsyncGenerator[RemoteEvent, None]:
        """The decode instance's stream for the request, as events; a failed
        call raises its kvstash.errors class ("decode instance: ..."). Closing
        it before its end (or cancelling the task reading it) aborts the
        request there."""
        call = peer.stub.Decode(scheduler_pb2.DecodeRequest(
            request_id=request_id, snapshot_id=snapshot_id, num_tokens=num_tokens,
            first_token_id=first_token_id))
        answered = False
        try:
            async for response in call:
                answered = True
                yield remote_event(response)
        except grpc.aio.AioRpcError as exc:
            raise rpc_errors.error_from_rpc(exc, "decode instance") from None
        except asyncio.CancelledError:
            # Stub.Decode only schedules the request: cancelled before any
            # answer, it may never have left, or never been served there,
            # and cancelling the call tells the instance nothing. Its
            # reservation would be held until it expires.
            if not answered:
                self.release_later(peer, request_id)
            raise
        finally:
            call.cancel()

    async def _resolve(self) -> list[DecodePeer]:
        """Every address of every configured name, in configuration order.
        The channels to addresses no longer among them are dropped."""
        loop = asyncio.get_running_loop()
        peers: list[DecodePeer] = []
        for address in self._addresses:
            host, _, port = address.rpartition(":")
            host = host.strip("[]")
            try:
                ipaddress.ip_address(host)
                hosts = [host]
            except ValueError:
                try:
                    infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                except OSError as exc:
                    log.warning("decode instance %s does not resolve (%s)", address, exc)
                    continue
                hosts = list(dict.fromkeys(str(info[4][0]) for info in infos))
            peers.extend(self._peer(h, port, host) for h in hosts)
        # A headless Service's pods come back at new addresses. Closing a channel
        # would cancel its calls: grpc closes it once no DecodePeer holds it.
        resolved = {peer.address for peer in peers}
        for target in [t for t in self._channels if t not in resolved]:
            del self._channels[target]
        return peers

    def _peer(self, ip: str, port: str, name: str) -> DecodePeer:
        target = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        channel = self._channels.get(target)
        if channel is None:
            # TLS checks the name the operator configured, not the address.
            options = [] if ip == name else [("grpc.ssl_target_name_override", name)]
            channel = rpc_connections.channel(target, self._security, options)
            self._channels[target] = channel
        return DecodePeer(target, scheduler_pb2_grpc.SchedulerStub(channel))
