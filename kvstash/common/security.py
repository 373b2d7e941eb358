"""Who may talk to whom: TLS and mutual TLS on every channel, bearer tokens
on the public API, and the rule that plaintext is never silent.

    client --TLS + "authorization: Bearer <token>"--> scheduler (public API)
    scheduler --mTLS--> worker, cache          worker --mTLS--> cache
    prefill scheduler --mTLS + token (--token-file)--> decode scheduler (P/D)

Each service gets one certificate (usable for server and client auth, as
cert-manager issues them) and one CA bundle: as a server it presents the
certificate and, with `require_client_cert` (the worker and the cache), accepts
only peers whose certificate that CA signed; as a client it verifies the
server against the CA and presents its own certificate. The scheduler's
public port takes clients without certificates; `--auth-token-file` makes it
demand a bearer token on every call but the health service (Kubernetes
probes carry none), and is read again when it changes (TokenAuth), so a
token removed from it is refused without a restart. Tokens are compared in
constant time and never logged.

Without TLS a service serves plaintext only on loopback, or where told so
with `--plaintext`: `check_listen` refuses anything else at start-up. A
client sends its bearer token in plaintext by the same rule (`check_send`):
only to loopback, or with `--plaintext`.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

_HEALTH_PREFIX = "/grpc.health.v1.Health/"
AUTHORIZATION = "authorization"
# How often a call may look whether --auth-token-file changed.
TOKEN_FILE_CHECK_S = 1.0


@dataclass(frozen=True, slots=True)
class Tls:
    """PEM bytes, read once at start-up (a file that changes needs a restart)."""

    ca: bytes  # trusted CA bundle
    cert: bytes | None = None  # this process's chain; servers need one
    key: bytes | None = field(default=None, repr=False)
    require_client_cert: bool = True  # as a server: mutual TLS

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError("serving TLS needs a certificate and its key (--tls-cert, --tls-key)")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca,
            require_client_auth=self.require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


@dataclass(frozen=True, slots=True)
class Security:
    tls: Tls | None = None
    # Allowed without TLS beyond loopback: to serve, and to send the token.
    plaintext: bool = False
    # As a server: bearer tokens accepted (empty = none asked), and the file
    # they came from, read again when it changes.
    tokens: frozenset[str] = field(default=frozenset(), repr=False)
    token_file: Path | None = None
    token: str | None = field(default=None, repr=False)  # as a client: the bearer token sent


PLAINTEXT = Security()


def add_flags(parser: argparse.ArgumentParser, *, server: bool = True,
              accepts_tokens: bool = False, sends_token: bool = False) -> None:
    """The TLS (and token) flags of a service or client."""
    group = parser.add_argument_group("security")
    group.add_argument("--tls-cert", type=Path, default=None,
                       help="PEM certificate chain this process presents (server and client)")
    group.add_argument("--tls-key", type=Path, default=None, help="its PEM private key")
    group.add_argument("--tls-ca", type=Path, default=None,
                       help="PEM CA bundle that peers' certificates must chain to; "
                            "setting it turns TLS on for every channel")
    if server:
        group.add_argument("--plaintext", action="store_true",
                           help="serve without TLS on a non-loopback address (only on a "
                                "network you trust)" + (", and send --token-file's token so"
                                                        if sends_token else ""))
    elif sends_token:
        group.add_argument("--plaintext", action="store_true",
                           help="send --token-file's token without TLS to a non-loopback "
                                "address (only on a network you trust)")
    if accepts_tokens:
        group.add_argument("--auth-token-file", type=Path, default=None,
                           help="file of accepted bearer tokens, one per line: every call but "
                                "health checks must carry one")
    if sends_token:
        group.add_argument("--token-file", type=Path, default=None,
                           help="file holding the bearer token to send")


def from_args(args: argparse.Namespace, require_client_cert: bool = True) -> Security:
    """The Security the flags of `add_flags` ask for; ValueError naming the
    flag and file when one cannot be used."""
    tls = None
    if args.tls_ca is not None:
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        tls = Tls(_read(args.tls_ca, "--tls-ca"),
                  _read(args.tls_cert, "--tls-cert") if args.tls_cert else None,
                  _read(args.tls_key, "--tls-key") if args.tls_key else None,
                  require_client_cert)
    elif args.tls_cert is not None or args.tls_key is not None:
        raise ValueError("--tls-cert/--tls-key need --tls-ca (the CA that peers chain to)")
    tokens: frozenset[str] = frozenset()
    token_file = getattr(args, "auth_token_file", None)
    if token_file is not None:
        tokens = frozenset(_tokens(token_file, "--auth-token-file"))
    token = None
    if getattr(args, "token_file", None) is not None:
        token = _tokens(args.token_file, "--token-file")[0]
    return Security(tls, getattr(args, "plaintext", False), tokens, token_file, token)


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None


def _tokens(path: Path, flag: str) -> list[str]:
    lines = _read(path, flag).decode("utf-8", "replace").splitlines()
    tokens = [t.strip() for t in lines if t.strip() and not t.lstrip().startswith("#")]
    if not tokens:
        raise ValueError(f"{flag} {path}: no token in it")
    return tokens


def check_listen(address: str, security: Security) -> None:
    """Refuses plaintext beyond loopback unless `--plaintext` said so."""
    if security.tls is not None or security.plaintext or is_loopback(address):
        return
    raise ValueError(
        f"refusing to serve plaintext on {address}: give --tls-cert, --tls-key and --tls-ca, "
        "or --plaintext to accept that anyone who reaches this address can call it")


def check_send(address: str, security: Security) -> None:
    """Refuses to send a bearer token in plaintext beyond loopback unless
    `--plaintext` said so: anyone on the path could read and reuse it."""
    if (security.token is None or security.tls is not None or security.plaintext
            or is_loopback(address)):
        return
    raise ValueError(
        f"refusing to send the bearer token in plaintext to {address}: give --tls-ca (the CA "
        "that signed the server's certificate), or --plaintext to accept that anyone on the "
        "path can read it")


def is_loopback(address: str) -> bool:
    """A loopback host (or a Unix socket): nothing outside this machine sees it."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:///", "ipv4:", "ipv6:"):  # gRPC's target forms
        address = address.removeprefix(scheme)
    host = address.rsplit(":", 1)[0].strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def channel_args(security: Security) -> dict[str, Any]:
    """What a client channel needs beyond its options: credentials and the
    interceptors that send the token."""
    interceptors: list[Any] = []
    if security.token is not None:
        header = (AUTHORIZATION, f"Bearer {security.token}")
        # grpc.aio files an interceptor under the first call kind it serves:
        # one instance per kind.
        interceptors = [kind(header) for kind in _TOKEN_INTERCEPTORS]
    return {"credentials": None if security.tls is None else security.tls.channel_credentials(),
            "interceptors": interceptors}


class _SendsToken:
    def __init__(self, header: tuple[str, str]) -> None:
        self._header = header

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout,
            grpc.aio.Metadata(*(details.metadata or ()), self._header),
            details.credentials, details.wait_for_ready)


class _UnaryUnaryToken(_SendsToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _UnaryStreamToken(_SendsToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _StreamUnaryToken(_SendsToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any,
                                     requests: Any) -> Any:
        return await continuation(self._with_token(details), requests)


class _StreamStreamToken(_SendsToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any,
                                      requests: Any) -> Any:
        return await continuation(self._with_token(details), requests)


_TOKEN_INTERCEPTORS = (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken,
                       _StreamStreamToken)


class TokenAuth(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call but health checks without an accepted
    bearer token. With `token_file` the tokens are read from it again once
    it changes (its inode, size or mtime; a call looks at most once every
    TOKEN_FILE_CHECK_S), as the kubelet re-projects a Secret: a token removed
    from it is refused from then on. A read that fails or finds no token
    keeps the tokens in force and logs an error."""

    def __init__(self, tokens: frozenset[str], token_file: Path | None = None) -> None:
        self._tokens = _encoded(tokens)
        self._token_file = token_file
        self._seen: tuple[int, ...] | None = None  # the file as last read (() = unreadable)
        self._look_after = 0.0

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        if details.method.startswith(_HEALTH_PREFIX) or self._accepts(details.invocation_metadata):
            return await continuation(details)
        return _refusal(await continuation(details))

    def _accepts(self, metadata: Any) -> bool:
        self._reread_if_changed()
        values = [v for k, v in metadata or () if k == AUTHORIZATION]
        if len(values) != 1 or not isinstance(values[0], str):
            return False
        scheme, _, token = values[0].partition(" ")
        given = token.strip().encode()
        # Every token is compared, so the time taken says nothing about which.
        matches = [hmac.compare_digest(given, t) for t in self._tokens]
        return scheme.lower() == "bearer" and any(matches)

    def _reread_if_changed(self) -> None:
        now = time.monotonic()
        if self._token_file is None or now < self._look_after:
            return
        self._look_after = now + TOKEN_FILE_CHECK_S
        try:
            status = os.stat(self._token_file)
            seen: tuple[int, ...] = (status.st_dev, status.st_ino, status.st_size,
                                     status.st_mtime_ns)
        except OSError:
            seen = ()
        if seen == self._seen:
            return
        self._seen = seen
        try:
            tokens = _tokens(self._token_file, "--auth-token-file")
        except ValueError as exc:
            log.error("%s; keeping the %d tokens read before", exc, len(self._tokens))
            return
        encoded = _encoded(tokens)
        if encoded != self._tokens:
            self._tokens = encoded  # one assignment: a call sees the old set or the new
            log.info("--auth-token-file %s changed: %d tokens accepted now", self._token_file,
                     len(encoded))


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
