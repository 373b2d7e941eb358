"""The Python client: `async with Client(address) as c: async for d in c.generate(...)`.

Failures raise kvstash.errors (InvalidArgument, NotFound, Unavailable, ...)
carrying the server's message, never raw grpc exceptions; a bad argument is
InvalidArgument before anything is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import numbers
from collections.abc import AsyncIterator, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from kvstash import errors
from kvstash.common import rpc_connections, rpc_errors
from kvstash.common.binding import check_target
from kvstash.common.ids import check_request_id
from kvstash.common.rpc_connections import DEFAULT_TIMEOUT_S
from kvstash.common.security import PLAINTEXT, Security
from kvstash.common.wire import check_uint, check_uints
from kvstash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

_FINISH_REASON = {
    scheduler_pb2.FINISH_REASON_STOP: "stop",
    scheduler_pb2.FINISH_REASON_LENGTH: "length",
    scheduler_pb2.FINISH_REASON_ABORT: "abort",
}


def _check_kinds(**values: tuple[object, type]) -> None:
    """InvalidArgument naming the first value that is not None nor its kind
    (numbers.Integral, numbers.Real, str; a bool is no number): what grpc and
    protobuf raise instead is a TypeError naming no argument."""
    for name, (value, kind) in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise errors.InvalidArgument(
                f"{name} is {value!r:.60}, must be {_KIND_NAMES[kind]}")


_KIND_NAMES: dict[type, str] = {numbers.Integral: "an int", numbers.Real: "a number", str: "a str"}


def _check_ids(name: str, values: object, kind: str = "token ids (ints)") -> None:
    """InvalidArgument unless `values` are token ids (bytes are not: a
    prompt of bytes would be sent as the ids of its bytes)."""
    if isinstance(values, str | bytes | bytearray) or not isinstance(values, Collection):
        raise errors.InvalidArgument(f"{name} is {values!r:.60}, must be {kind}")
    if not all(type(v) is int for v in values):  # the common case, quickly
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise errors.InvalidArgument(f"{name}[{i}] is {v!r:.60}, must be an int")
    check_uints(name, values)  # type: ignore[arg-type]


def _check_timeout(timeout_s: float | None) -> None:
    _check_kinds(timeout_s=(timeout_s, numbers.Real))
    if timeout_s is not None and not timeout_s > 0:  # NaN too
        raise errors.InvalidArgument(f"timeout_s is {timeout_s}, must be > 0 (None: no deadline)")


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    num_preemptions: int
    num_recomputed_tokens: int
    bytes_offloaded: int
    ttft_s: float


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """One streamed message: new tokens and their text. The last one also
    carries finish_reason ("stop", "length", "abort") and usage."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass(slots=True)
class GenerateResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None


class Client:
    def __init__(self, address: str, security: Security = PLAINTEXT,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S) -> None:
        """`security`: TLS (the CA that signed the scheduler's certificate) and
        the bearer token the scheduler may ask for. `timeout_s`: deadline of
        an abort or stats call given none (None = no deadline)."""
        _check_kinds(address=(address, str))
        _check_timeout(timeout_s)
        self.timeout_s = timeout_s
        try:
            check_target(address)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        self._channel = rpc_connections.channel(address, security)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._closed = False

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Calls still in flight end with Unavailable; later ones, FailedPrecondition."""
        self._closed = True
        await self._channel.close()

    @contextlib.contextmanager
    def _calling(self, what: str) -> Iterator[None]:
        """A failed call as a kvstash.errors class: its status; grpc's
        UsageError for a closed channel; and the CancelledError grpc raises in a
        call whose channel close() closed, which would read as the caller's own
        task cancelled (unless it is the task being cancelled)."""
        if self._closed:
            raise errors.FailedPrecondition(f"{what}: the client is closed")
        try:
            yield
        except grpc.aio.AioRpcError as exc:
            raise rpc_errors.error_from_rpc(exc, what) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._closed or (task is not None and task.cancelling()):
                raise
            raise errors.Unavailable(f"{what}: the client was closed during the call") from None

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = 64,
        temperature: float | None = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        request_id: str = "",
        timeout_s: float | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Streams a completion. `prompt` is text or token ids. None leaves a
        field unset, for the server's default (max_tokens: until the context
        ends; temperature: 1.0, as OpenAI's); the defaults here are a short
        greedy answer."""
        _check_kinds(max_tokens=(max_tokens, numbers.Integral),
                     temperature=(temperature, numbers.Real), top_p=(top_p, numbers.Real),
                     top_k=(top_k, numbers.Integral), seed=(seed, numbers.Integral),
                     request_id=(request_id, str))
        if not isinstance(ignore_eos, bool | numbers.Integral):
            raise errors.InvalidArgument(f"ignore_eos is {ignore_eos!r:.60}, "
                                         "must be a bool")
        _check_timeout(timeout_s)
        if max_tokens is not None and max_tokens <= 0:
            raise errors.InvalidArgument(f"max_tokens is {max_tokens}, must be > 0")
        for name, value, bits in (("max_tokens", max_tokens, 32), ("top_k", top_k, 32),
                                  ("seed", seed, 64)):
            if value is not None:
                check_uint(name, value, bits)
        _check_ids("stop_token_ids", stop_token_ids)
        if request_id:  # "": the scheduler makes one
            check_request_id(request_id)
        if not isinstance(prompt, str):
            _check_ids("prompt", prompt, "text or token ids (ints)")
        elif not prompt.isascii():
            try:  # a lone surrogate: what Python makes of a non-UTF-8 argv, e.g. latin-1
                prompt.encode()
            except UnicodeEncodeError as exc:
                raise errors.InvalidArgument(
                    f"prompt is not UTF-8 text: {exc.reason} (character {exc.start}, "
                    f"{prompt[exc.start]!r})") from None
        sampling = common_pb2.SamplingParams(
            top_p=top_p, top_k=top_k, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        # Checked as sent (a float32): the server reads a top_p of 0, which is
        # also what 1e-50 becomes, as unset, 1.0, and would sample from every token.
        if not 0 < sampling.top_p <= 1:
            raise errors.InvalidArgument(f"top_p is {top_p}, must be in (0, 1]")
        if max_tokens is not None:
            sampling.max_tokens = max_tokens
        if temperature is not None:
            sampling.temperature = temperature
        if seed is not None:
            sampling.seed = seed
        request = scheduler_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        with self._calling("generate"):
            call = self._stub.Generate(request, timeout=timeout_s)
            try:
                async for message in call:
                    response = rpc_errors.decoded(message, "generate")
                    usage = None
                    if response.HasField("usage"):
                        u = response.usage
                        usage = Usage(u.prompt_tokens, u.completion_tokens, u.num_preemptions,
                                      u.num_recomputed_tokens, u.bytes_offloaded, u.ttft_s)
                    yield TokenDelta(
                        request_id=response.request_id,
                        token_ids=list(response.token_ids),
                        text=response.text,
                        finish_reason=_FINISH_REASON.get(response.finish_reason),
                        usage=usage,
                    )
            finally:
                call.cancel()  # a caller that stops iterating early aborts the request

    async def complete(self, prompt: str | Sequence[int], **kwargs: object) -> GenerateResult:
        """Runs `generate` to the end and returns the whole result."""
        result = GenerateResult(request_id="")
        async for delta in self.generate(prompt, **kwargs):  # type: ignore[arg-type]
            result.request_id = delta.request_id
            result.token_ids.extend(delta.token_ids)
            result.text += delta.text
            if delta.finish_reason is not None:
                result.finish_reason, result.usage = delta.finish_reason, delta.usage
        return result

    async def abort(self, request_id: str, timeout_s: float | None = None) -> None:
        """`timeout_s`: the call's deadline, else the client's."""
        _check_kinds(request_id=(request_id, str))
        with self._calling("abort"):
            await self._stub.Abort(scheduler_pb2.AbortRequest(request_id=request_id),
                                   timeout=self._timeout(timeout_s))

    async def stats(self, timeout_s: float | None = None) -> scheduler_pb2.SchedulerStats:
        """`timeout_s`: the call's deadline, else the client's."""
        with self._calling("stats"):
            response = await self._stub.GetStats(common_pb2.GetStatsRequest(),
                                                 timeout=self._timeout(timeout_s))
        return rpc_errors.decoded(response, "stats")

    def _timeout(self, timeout_s: float | None) -> float | None:
        _check_timeout(timeout_s)
        return self.timeout_s if timeout_s is None else timeout_s
