"""Bearer tokens, both ends: the interceptors that send one on every call
of a client channel (`token_interceptors`), and the server's check of every
call but health checks (`TokenAuth`). Tokens are read from files of one per
line (`read_tokens`: blank lines and # comments skipped), compared in
constant time and never logged. At both ends a file is read again once it
changes (`TokenFile`), as the kubelet re-projects a rotated Secret."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

_HEALTH_PREFIX = "/grpc.health.v1.Health/"
AUTHORIZATION = "authorization"
# How often a call may look whether a token file changed.
TOKEN_FILE_CHECK_S = 1.0


def read_tokens(path: Path, flag: str) -> list[str]:
    """The tokens of the file `flag` names; ValueError naming both where it
    cannot be read or holds none."""
    try:
        lines = path.read_bytes().decode("utf-8", "replace").splitlines()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    tokens = [t.strip() for t in lines if t.strip() and not t.lstrip().startswith("#")]
    if not tokens:
        raise ValueError(f"{flag} {path}: no token in it")
    return tokens


def file_identity(path: Path | None) -> tuple[int, ...]:
    """What tells a file changed: its device, inode, size and mtime (() when
    there is none to read), as a re-projected Secret swaps a symlink."""
    if path is None:
        return ()
    try:
        status = os.stat(path)
    except OSError:
        return ()
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


class TokenFile:
    """The tokens of a file, read again once it changes (its inode, size or
    mtime; looked at most once every TOKEN_FILE_CHECK_S, in a thread, not on
    the event loop). A read that fails or finds no token keeps the tokens in
    force and logs an error."""

    def __init__(self, path: Path, flag: str, tokens: Iterable[str]) -> None:
        self.path = path
        self.tokens = tuple(tokens)  # replaced whole: a reader sees the old or the new
        self._flag = flag
        self._seen: tuple[int, ...] | None = None  # the file as last read (() = unreadable)
        self._look_after = 0.0
        self._reading: asyncio.Future[None] | None = None  # the latest look

    async def current(self) -> tuple[str, ...]:
        now = time.monotonic()
        if now >= self._look_after:
            self._look_after = now + TOKEN_FILE_CHECK_S
            self._reading = asyncio.ensure_future(asyncio.to_thread(self._reread_if_changed))
        if self._reading is not None and not self._reading.done():
            # Calls meanwhile wait for it too, or a channel made after a
            # rotation would send its start-up token on all its first calls
            # but one.
            await asyncio.shield(self._reading)
        return self.tokens

    def _reread_if_changed(self) -> None:
        seen = file_identity(self.path)
        if seen == self._seen:
            return
        self._seen = seen
        try:
            tokens = tuple(read_tokens(self.path, self._flag))
        except ValueError as exc:
            log.error("%s; keeping the %d tokens read before", exc, len(self.tokens))
            return
        if tokens != self.tokens:
            self.tokens = tokens
            log.info("%s %s changed: %d tokens in it now", self._flag, self.path, len(tokens))


def token_interceptors(token: str, token_file: Path | None = None) -> list[Any]:
    """A client channel's interceptors that send `token` on every call, or
    with `token_file` (where `token` came from) its first token as it is
    now."""
    source = TokenFile(token_file, "--token-file", [token]) if token_file else token
    # grpc.aio files an interceptor under the first call kind it serves: one
    # instance per kind.
    return [kind(source) for kind in _TOKEN_INTERCEPTORS]


class _SendsToken:
    def __init__(self, source: str | TokenFile) -> None:
        self._source = source

    async def _with_token(self, details: grpc.aio.ClientCallDetails
                          ) -> grpc.aio.ClientCallDetails:
        token = (self._source if isinstance(self._source, str)
                 else (await self._source.current())[0])
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout,
            grpc.aio.Metadata(*(details.metadata or ()), (AUTHORIZATION, f"Bearer {token}")),
            details.credentials, details.wait_for_ready)


class _UnaryUnaryToken(_SendsToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(await self._with_token(details), request)


class _UnaryStreamToken(_SendsToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(await self._with_token(details), request)


class _StreamUnaryToken(_SendsToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any,
                                     requests: Any) -> Any:
        return await continuation(await self._with_token(details), requests)


class _StreamStreamToken(_SendsToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any,
                                      requests: Any) -> Any:
        return await continuation(await self._with_token(details), requests)


_TOKEN_INTERCEPTORS = (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken,
                       _StreamStreamToken)


class TokenAuth(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call but health checks without an accepted
    bearer token. With `token_file` the tokens are read from it again once
    it changes (TokenFile): a token removed from it is refused from then on."""

    def __init__(self, tokens: frozenset[str], token_file: Path | None = None) -> None:
        self._file = (None if token_file is None
                      else TokenFile(token_file, "--auth-token-file", sorted(tokens)))
        self._read: tuple[str, ...] | None = None  # the file's tokens that _tokens encodes
        self._tokens = _encoded(tokens)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        if (details.method.startswith(_HEALTH_PREFIX)
                or await self._accepts(details.invocation_metadata)):
            return await continuation(details)
        return _refusal(await continuation(details))

    async def _accepts(self, metadata: Any) -> bool:
        if self._file is not None:
            read = await self._file.current()
            if read is not self._read:
                self._read, self._tokens = read, _encoded(read)
        values = [v for k, v in metadata or () if k == AUTHORIZATION]
        if len(values) != 1 or not isinstance(values[0], str):
            return False
        scheme, _, token = values[0].partition(" ")
        given = token.strip().encode()
        # Every token is compared, so the time taken says nothing about which.
        matches = [hmac.compare_digest(given, t) for t in self._tokens]
        return scheme.lower() == "bearer" and any(matches)


def _encoded(tokens: Iterable[str]) -> tuple[bytes, ...]:
    return tuple(sorted({t.encode() for t in tokens}))


def _refusal(handler: Any) -> Any:
    """A handler of the same shape that ends the call UNAUTHENTICATED."""
    if handler is None:
        return None

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or unknown bearer token (header 'authorization: Bearer …')")

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(request, context)
        yield  # pragma: no cover - abort raises

    kinds = {"unary_unary": refuse, "stream_unary": refuse, "unary_stream": refuse_stream,
             "stream_stream": refuse_stream}
    changes = {kind: behaviour for kind, behaviour in kinds.items()
               if getattr(handler, kind) is not None}
    return handler._replace(**changes)
