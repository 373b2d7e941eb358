"""What one gRPC connection carries and allows, from both ends.

A client channel (`channel`) and every server (kvstash.common.rpc_server)
agree on the largest message (`MAX_MESSAGE_BYTES`) and on keepalive: clients
ping a silent server (`KEEPALIVE_OPTIONS`), servers ping a silent client,
close idle connections and cap the calls one connection keeps open
(`Connections`, set from each service's command line by
`add_connection_flags`/`connections_from_args`).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from kvstash.common import flag_types
from kvstash.common.security import PLAINTEXT, PemFiles, Security, channel_args, check_send
from kvstash.common.units import MIB

# Snapshot chunks are at most 4 MiB of payload; leave room for framing.
MAX_MESSAGE_BYTES = 8 * MIB
# A worker's GetInfo carries the model's tokenizer.json (Llama 3's is ~9 MB):
# the worker may send, and its scheduler receive, this much.
MAX_WORKER_INFO_BYTES = 64 * MIB
# A step plan carries every sequence's whole block table (512 sequences of
# 128k-token contexts in blocks of 16: ~13 MiB): the scheduler may send, and
# its worker receive, this much; a scheduler whose largest plan could be
# more refuses to start (scheduler_svc.worker_link.largest_plan_bytes).
MAX_STEP_PLAN_BYTES = 64 * MIB
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Bulk KV transfers want a large flow-control window from the start.
    ("grpc.http2.lookahead_bytes", 4 * MIB),
    # A peer back after an outage (a decode instance, the cache) is seen within
    # ~2 s: gRPC's default backoff grows by 1.6x to 120 s, and until it ends
    # every call fails UNAVAILABLE at once though the peer answers.
    ("grpc.max_reconnect_backoff_ms", 2000),
]

# The deadline of a client's unary call whose caller names none (a stats
# poll, an abort, a delete): a stuck server fails it instead of hanging it.
DEFAULT_TIMEOUT_S = 60.0

# Clients find a dead server within ~80 s (a ping after 60 s of silence, 20 s
# to answer) instead of when the kernel gives up on the socket.
KEEPALIVE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
]
# Clients reach kvstash's services directly: the proxy an environment names
# (http_proxy) is for the internet, and gRPC would send even a loopback call
# through it (refused there: no service would ever reach another).
DIRECT_OPTIONS: list[tuple[str, Any]] = [("grpc.enable_http_proxy", 0)]


@dataclass(frozen=True, slots=True)
class Connections:
    """What every server allows one client connection (`add_connection_flags`)."""

    keepalive_s: float = 60.0  # ping a silent client after this long...
    keepalive_timeout_s: float = 20.0  # ...and drop it without an answer in this
    idle_s: float = 600.0  # close a connection without calls this long (clients reconnect)
    max_streams: int = 0  # calls open at once per connection; 0 = the service's default

    def __post_init__(self) -> None:
        for name in ("keepalive_s", "keepalive_timeout_s", "idle_s"):
            if not 0 < getattr(self, name) < math.inf:  # NaN fails it too
                raise ValueError(f"{name} is {getattr(self, name)}, must be > 0 and finite")
        if self.max_streams < 0:
            raise ValueError(f"max_streams is {self.max_streams}, must be >= 0")

    def server_options(self) -> list[tuple[str, Any]]:
        options = [
            ("grpc.keepalive_time_ms", _option_ms(self.keepalive_s)),
            ("grpc.keepalive_timeout_ms", _option_ms(self.keepalive_timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            # Clients ping every 60 s (KEEPALIVE_OPTIONS); faster is abuse.
            ("grpc.http2.min_ping_interval_without_data_ms", 30_000),
            ("grpc.max_connection_idle_ms", _option_ms(self.idle_s)),
        ]
        if self.max_streams:
            options.append(("grpc.max_concurrent_streams", self.max_streams))
        return options


DEFAULT_CONNECTIONS = Connections()


def _option_ms(seconds: float) -> int:
    """`seconds` as a gRPC option in ms: a C int, so at most 2**31 - 1 (24.8
    days; more raised OverflowError as the server was built), which gRPC's
    defaults for these options use for "never"."""
    return min(int(seconds * 1000), 2**31 - 1)


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    d = DEFAULT_CONNECTIONS
    group = parser.add_argument_group("connections")
    # Refused as they are parsed, naming the flag: Connections' own check names
    # its field, and comes once a service has started.
    group.add_argument("--keepalive", type=flag_types.positive_duration, default=d.keepalive_s,
                       help="ping a client silent this long (e.g. 60s)")
    group.add_argument("--keepalive-timeout", type=flag_types.positive_duration,
                       default=d.keepalive_timeout_s,
                       help="drop a client that does not answer a ping within this")
    group.add_argument("--idle-timeout", type=flag_types.positive_duration, default=d.idle_s,
                       help="close a connection without calls this long (e.g. 10m)")
    group.add_argument("--max-streams-per-connection", type=flag_types.non_negative_int,
                       default=d.max_streams,
                       help="calls open at once on one connection; more wait on the client's "
                            "side; 0 = this service's default")


def connections_from_args(args: argparse.Namespace) -> Connections:
    return Connections(args.keepalive, args.keepalive_timeout, args.idle_timeout,
                       args.max_streams_per_connection)


def channel(address: str, security: Security = PLAINTEXT,
            options: Iterable[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A client channel: TLS (with this process's certificate, for mutual
    TLS) and the bearer token as `security` says (ValueError where it would
    go in plaintext beyond loopback unasked: security.check_send). With TLS
    files that may change, its calls use them as they are now (RenewingChannel)."""
    check_send(address, security)
    merged = list((dict(CHANNEL_OPTIONS) | dict(KEEPALIVE_OPTIONS) | dict(DIRECT_OPTIONS)
                   | dict(options)).items())

    def make() -> grpc.aio.Channel:
        extra = channel_args(security)
        if extra["credentials"] is None:
            return grpc.aio.insecure_channel(address, options=merged,
                                             interceptors=extra["interceptors"])
        return grpc.aio.secure_channel(address, extra["credentials"], options=merged,
                                       interceptors=extra["interceptors"])

    if security.tls is None or security.tls.files is None:
        return make()
    return RenewingChannel(make, security.tls.files)


class RenewingChannel(grpc.aio.Channel):
    """A channel for TLS files that may change (PemFiles): each call goes out
    on a channel made with the files as they are now. A gRPC channel keeps the
    credentials it was made with for every reconnect, so one made at start
    would present an expired certificate, or trust a retired CA, at its
    first reconnect after a rotation, until the process restarted. A channel
    made with files since changed serves the calls it started to their end
    (a worker's Execute stream lasts as long as it does), then is closed."""

    def __init__(self, make: Callable[[], grpc.aio.Channel], files: PemFiles) -> None:
        self._make = make
        self._files = files
        self._pems = files.current()
        self._channel = make()
        self._num_calls: dict[grpc.aio.Channel, int] = {}  # channel -> its calls in flight
        self._closing: set[asyncio.Task[None]] = set()

    def current(self) -> grpc.aio.Channel:
        """The channel made with the TLS files as they are now."""
        pems = self._files.current()
        if pems is not self._pems:
            self._pems, old, self._channel = pems, self._channel, self._make()
            if not self._num_calls.get(old):
                self._close_later(old)
        return self._channel

    def started(self, channel: grpc.aio.Channel, call: Any) -> None:
        self._num_calls[channel] = self._num_calls.get(channel, 0) + 1
        call.add_done_callback(lambda _: self._ended(channel))

    def _ended(self, channel: grpc.aio.Channel) -> None:
        self._num_calls[channel] -= 1
        if not self._num_calls[channel]:
            del self._num_calls[channel]
            if channel is not self._channel:
                self._close_later(channel)

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self, grace: float | None = None) -> None:
        for channel in {self._channel, *self._num_calls}:
            await channel.close(grace)
        for task in list(self._closing):
            await task

    async def __aenter__(self) -> RenewingChannel:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _Method(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _Method(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _Method(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _Method(self, "stream_stream", args, kwargs)


class _Method:
    """A stub's method on a RenewingChannel: each call on its current channel."""

    def __init__(self, owner: RenewingChannel, kind: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self._owner = owner
        self._kind = kind
        self._args = args
        self._kwargs = kwargs
        self._channel: grpc.aio.Channel | None = None
        self._method: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self._owner.current()
        if channel is not self._channel:
            self._channel = channel
            self._method = getattr(channel, self._kind)(*self._args, **self._kwargs)
        call = self._method(*args, **kwargs)
        self._owner.started(channel, call)
        return call


def insecure_channel(address: str) -> grpc.aio.Channel:
    return channel(address)
