"""Who may talk to whom: TLS and mutual TLS on every channel, bearer tokens
on the public API, and the rule that plaintext is never silent.

    client --TLS + "authorization: Bearer <token>"--> scheduler (public API)
    scheduler --mTLS--> worker, cache          worker --mTLS--> cache
    prefill scheduler --mTLS + token (--token-file)--> decode scheduler (P/D)

Each service gets one certificate (usable for server and client auth, as
cert-manager issues them) and one CA bundle: as a server it presents the
certificate and, with `require_client_cert` (the worker and the cache), accepts
only peers whose certificate that CA signed; as a client it verifies the
server against the CA and presents its own certificate. The files are read
again when they change (PemFiles): a server uses them from its next
handshake, a client's channel for its calls from then on (its reconnects
included: kvstash.common.rpc_connections.RenewingChannel). The scheduler's
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
import logging
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvstash.common.bearer import file_identity, read_tokens, token_interceptors

log = logging.getLogger(__name__)


# How often a handshake or a new channel may look whether the TLS files changed.
TLS_FILE_CHECK_S = 1.0

Pems = tuple[bytes, bytes | None, bytes | None]  # CA bundle, certificate chain, key


class PemFiles:
    """--tls-ca, --tls-cert and --tls-key as they are now: read again once
    one of them changes (inode, size or mtime, as cert-manager's Secret is
    re-projected; looked at most once every TLS_FILE_CHECK_S). A read that
    fails keeps the PEMs read before and logs an error. Thread-safe: gRPC
    fetches a server's certificates from its own threads."""

    def __init__(self, paths: tuple[Path, Path | None, Path | None], pems: Pems) -> None:
        self.pems = pems  # replaced whole
        self._paths = paths
        self._seen: tuple[tuple[int, ...], ...] | None = None
        self._look_after = 0.0
        self._lock = threading.Lock()

    def current(self) -> Pems:
        with self._lock:
            now = time.monotonic()
            if now < self._look_after:
                return self.pems
            self._look_after = now + TLS_FILE_CHECK_S
            seen = tuple(file_identity(path) for path in self._paths)
            if seen == self._seen:
                return self.pems
            self._seen = seen
            try:
                ca, cert, key = (None if path is None else _read(path, flag)
                                 for path, flag in zip(self._paths, _TLS_FLAGS, strict=True))
            except ValueError as exc:
                log.error("%s; keeping the TLS files read before", exc)
                return self.pems
            assert ca is not None  # --tls-ca is always set
            if (ca, cert, key) != self.pems:
                self.pems = (ca, cert, key)
                log.info("TLS files changed (%s): new connections use them now",
                         ", ".join(str(path) for path in self._paths if path is not None))
            return self.pems


_TLS_FLAGS = ("--tls-ca", "--tls-cert", "--tls-key")


@dataclass(frozen=True, slots=True)
class Tls:
    """PEM bytes as read at start-up; with `files`, read again when they
    change: a server presents, and checks peers against, the new ones from
    its next handshake on, and a client channel (rpc_connections.channel)
    for its calls made after the change."""

    ca: bytes  # trusted CA bundle
    cert: bytes | None = None  # this process's chain; servers need one
    key: bytes | None = field(default=None, repr=False)
    require_client_cert: bool = True  # as a server: mutual TLS
    files: PemFiles | None = field(default=None, repr=False, compare=False)

    def pems(self) -> Pems:
        return (self.ca, self.cert, self.key) if self.files is None else self.files.current()

    def server_credentials(self) -> grpc.ServerCredentials:
        served = self.pems()
        if served[1] is None or served[2] is None:
            raise ValueError("serving TLS needs a certificate and its key (--tls-cert, --tls-key)")
        if self.files is None:
            return grpc.ssl_server_credentials(
                [(served[2], served[1])], root_certificates=served[0],
                require_client_auth=self.require_client_cert)
        files = self.files

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            """Called by gRPC on each handshake: None keeps what it has."""
            nonlocal served
            pems = files.current()
            if pems is served:
                return None
            served = pems
            return _server_certificates(pems)

        return grpc.dynamic_ssl_server_credentials(
            _server_certificates(served), fetch,
            require_client_authentication=self.require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca, cert, key = self.pems()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)


def _server_certificates(pems: Pems) -> grpc.ServerCertificateConfiguration:
    ca, cert, key = pems
    assert cert is not None and key is not None  # a server's files name both
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


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
        paths = (args.tls_ca, args.tls_cert, args.tls_key)
        pems = (_read(args.tls_ca, "--tls-ca"),
                _read(args.tls_cert, "--tls-cert") if args.tls_cert else None,
                _read(args.tls_key, "--tls-key") if args.tls_key else None)
        _check_pems(*paths)
        tls = Tls(*pems, require_client_cert, PemFiles(paths, pems))
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


def _check_pems(ca: Path, cert: Path | None, key: Path | None) -> None:
    """ValueError naming the flags where the files hold no PEM CA certificate,
    or no certificate chain with its key: gRPC takes them, and then a server
    fails to listen (said as "address in use") and a client every handshake."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # OpenSSL's default security level refuses keys and signatures gRPC
    # serves with (an RSA-1024 key: "ee key too small"): checked here is only
    # that the files hold what they should.
    context.set_ciphers("ALL:@SECLEVEL=0")
    try:
        context.load_verify_locations(cafile=ca)
    except ssl.SSLError as exc:
        raise ValueError(f"--tls-ca {ca}: no PEM CA certificate in it ({exc})") from None
    if cert is not None and key is not None:
        try:  # the password: an encrypted key fails here, as gRPC takes none
            context.load_cert_chain(cert, key, password=b"")
        except ssl.SSLError as exc:
            raise ValueError(f"--tls-cert {cert} and --tls-key {key}: not a PEM certificate "
                             f"chain and its private key ({exc})") from None


def check_listen(address: str, security: Security) -> None:
    """Refuses plaintext beyond loopback unless `--plaintext` said so, and
    TLS without this server's certificate."""
    if security.tls is not None and (security.tls.cert is None or security.tls.key is None):
        raise ValueError("serving TLS needs this service's certificate and key: give --tls-cert "
                         "and --tls-key with --tls-ca")
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
