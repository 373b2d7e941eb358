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
probes carry none). Token files are read again when they change, at both
ends: a token removed from `--auth-token-file` is refused, and a rotated
`--token-file` sent, without a restart (kvstash.common.bearer: both ends of
the token, compared in constant time and never logged).

Without TLS a service serves plaintext only on loopback, or where told so
with `--plaintext`: `check_listen` refuses anything else at start-up. A
client sends its bearer token in plaintext by the same rule (`check_send`):
only to loopback, or with `--plaintext`.
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvstash.common.bearer import read_tokens, token_interceptors


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
    # ...and the file it came from (--token-file), whose first token is sent
    # as the file is now: read again when it changes.
    sent_token_file: Path | None = None


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
        tokens = frozenset(read_tokens(token_file, "--auth-token-file"))
    token = None
    if getattr(args, "token_file", None) is not None:
        token = read_tokens(args.token_file, "--token-file")[0]
    return Security(tls, getattr(args, "plaintext", False), tokens, token_file, token,
                    getattr(args, "token_file", None))


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None


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
        interceptors = token_interceptors(security.token, security.sent_token_file)
    return {"credentials": None if security.tls is None else security.tls.channel_credentials(),
            "interceptors": interceptors}
