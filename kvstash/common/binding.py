"""Refusing an address in use, the same way for every listener.

gRPC Python sets SO_REUSEPORT on its listening sockets by default, so a
second server on a port another one serves would start without a word and
share it: the kernel then spreads new connections between the two (an old
stack, perhaps with another model, and the new one). Every kvstash gRPC server
turns that off (`NO_REUSEPORT`, a server option) and checks a fixed port
before it builds anything (`check_free`), so the second one fails at start
with `BindError`: one line naming the address, which each service's
`__main__` prints before it exits non-zero. The /metrics servers
(kvstash.common.metrics) raise the same error.
"""

from __future__ import annotations

import contextlib
import errno
import socket

# The gRPC server option that keeps a port to one server (gRPC's default: shared).
NO_REUSEPORT = ("grpc.so_reuseport", 0)
MAX_PORT = 65535


class BindError(OSError):
    """An address this process was told to listen on cannot be had (in use,
    or not this host's); the message names it."""


def in_use(address: str) -> BindError:
    """The error for `address` (host:port) being taken by another listener."""
    return BindError(f"cannot listen on {address}: the address is in use "
                     "(another kvstash stack or another program listens there)")


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; ValueError if the port is
    not a number from 0 to 65535 (gRPC would take 99999 modulo 65536 and
    listen on 34463 without a word)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) > MAX_PORT:
        raise ValueError(f"address {address!r} is not host:port (port 0-{MAX_PORT})")
    return host.strip("[]"), int(port)


def port_past_range(address: str) -> bool:
    """Whether a peer's `address` ends in a port past 65535, which gRPC's
    client takes modulo 65536 ("host:99999" reaches 34463 there); forms with
    no port number ("unix:/path") have none to check."""
    port = address.rpartition(":")[2]
    return port.isdigit() and int(port) > MAX_PORT


def check_target(address: str) -> None:
    """ValueError unless `address` is one a client may call: not empty, a
    port after a bare host, and any port number it ends in 0-65535 (gRPC's
    client would call "host:99999" on 34463, another service perhaps, and
    "host:", "host" and "[::1]" on 443). gRPC's other forms ("unix:/path",
    "dns:///host:port") pass; a URL ("http://host:port") or spaces around
    it, which gRPC takes as a host name to fail every call on, do not."""
    scheme, slashes, _ = address.partition("://")
    if slashes and scheme.lower() not in _GRPC_SCHEMES:
        raise ValueError(f"address {address!r} is not host:port: give host:port, not a URL")
    if address != address.strip():
        raise ValueError(f"address {address!r} is not host:port: it has spaces around it")
    if (not address or address.endswith((":", "]")) or ":" not in address
            or port_past_range(address)):
        raise ValueError(f"address {address!r} is not host:port (port 0-{MAX_PORT})")


# gRPC's own target schemes (name resolvers) written with "//".
_GRPC_SCHEMES = frozenset({"dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds"})


def join_address(host: str, port: int) -> str:
    """"host:port", an IPv6 host in brackets ("[::1]:50051"): split_address's inverse."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_free(host: str, port: int) -> None:
    """BindError if something listens on `host`:`port` (port 0: never);
    `host` as split_address gives it, IPv6 without brackets.

    Binds every address `host` resolves to as a server would, then lets go:
    with SO_REUSEADDR, so a port whose old connections linger in TIME_WAIT
    (a service restarted on its address) counts as free, and without
    SO_REUSEPORT, so any listener counts as taken, gRPC's included. Other
    failures (a host that does not resolve, an address not on this host) are
    left to the server's own bind, which reports them."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    for family, kind, proto, _name, sockaddr in infos:
        with contextlib.closing(socket.socket(family, kind, proto)) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise in_use(join_address(host, port)) from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a child told to listen there (one
    that does not say which port 0 got it). Another program may take it
    before the child binds it; the child then fails with BindError. `host`
    is an IP address or name, IPv6 without brackets."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
