"""TLS, mutual TLS and bearer tokens (kvstash.common.security) over real channels to
in-process servers, with throwaway CAs from trustme."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_svc.config import CacheConfig
from cache_svc.server import create_cache_server
from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.client import Client
from kvstash.common import bearer, rpc_connections, security
from kvstash.common.security import Security, Tls
from kvstash.common.units import MIB
from scheduler_svc.serving import create_scheduler_server

TOKEN = "s3cret-token"


def tls_of(ca: trustme.CA, name: str | None = None, require_client_cert: bool = True) -> Tls:
    """The CA bundle and, with `name`, a certificate for it (127.0.0.1 as
    well, so it serves on loopback)."""
    if name is None:
        return Tls(ca.cert_pem.bytes(), require_client_cert=require_client_cert)
    cert = ca.issue_cert(name, "127.0.0.1")
    return Tls(ca.cert_pem.bytes(), cert.cert_chain_pems[0].bytes(),
               cert.private_key_pem.bytes(), require_client_cert)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


# -- the rules --------------------------------------------------------------------


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1:5", True), ("127.1.2.3:5", True), ("localhost:5", True), ("[::1]:5", True),
    ("0.0.0.0:5", False), ("10.0.0.7:5", False), ("[::]:5", False), ("cache.svc:5", False),
])
def test_plaintext_only_on_loopback_unless_asked(address: str, loopback: bool) -> None:
    assert security.is_loopback(address) is loopback
    security.check_listen(address, Security(plaintext=True))
    if loopback:
        security.check_listen(address, security.PLAINTEXT)
    else:
        with pytest.raises(ValueError, match="refusing to serve plaintext"):
            security.check_listen(address, security.PLAINTEXT)


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1:5", True), ("localhost:5", True), ("[::1]:5", True), ("unix:/tmp/s", True),
    ("LOCALHOST:5", True), ("dns:///localhost:5", True), ("ipv4:127.0.0.1:5", True),
    ("ipv6:[::1]:5", True), ("10.0.0.7:5", False), ("decode.svc:5", False),
    ("dns:///decode.svc:5", False), ("ipv4:127.0.0.1:5,10.0.0.7:5", False),
])
def test_a_token_goes_in_plaintext_only_to_loopback_unless_asked(
    address: str, loopback: bool, ca: trustme.CA,
) -> None:
    """As serving: a client's bearer token crosses a network only inside TLS,
    or where --plaintext accepted that anyone on the path can read it."""
    token = Security(token="secret")
    for allowed in (security.PLAINTEXT, Security(plaintext=True, token="secret"),
                    Security(Tls(ca.cert_pem.bytes()), token="secret")):
        security.check_send(address, allowed)
    if loopback:
        security.check_send(address, token)
        return
    with pytest.raises(ValueError, match=f"refusing to send the bearer token in plaintext to "
                                         f"{address}"):
        security.check_send(address, token)
    with pytest.raises(ValueError, match="refusing to send the bearer token"):
        Client(address, token)  # before any connection is made


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    security.add_flags(parser, accepts_tokens=True, sends_token=True)
    return parser.parse_args(argv)


def test_flags_are_checked_and_files_read(tmp_path: Path, ca: trustme.CA) -> None:
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    tokens = tmp_path / "tokens"
    tokens.write_text("# operators\nfirst\n\n  second  \n")
    got = security.from_args(parse("--tls-ca", str(ca_file), "--auth-token-file", str(tokens),
                                   "--token-file", str(tokens)))
    assert got.tls is not None and got.tls.ca == ca.cert_pem.bytes() and got.tls.cert is None
    assert got.tokens == {"first", "second"} and got.token == "first"
    assert got.sent_token_file == tokens
    with pytest.raises(ValueError, match="need --tls-ca"):
        security.from_args(parse("--tls-cert", str(ca_file), "--tls-key", str(ca_file)))
    with pytest.raises(ValueError, match="go together"):
        security.from_args(parse("--tls-ca", str(ca_file), "--tls-cert", str(ca_file)))
    with pytest.raises(ValueError, match=r"--tls-ca .*missing.pem"):
        security.from_args(parse("--tls-ca", str(tmp_path / "missing.pem")))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="no token in it"):
        security.from_args(parse("--auth-token-file", str(tmp_path / "empty")))


@pytest.mark.parametrize("module", ["cache_svc", "scheduler_svc", "gpu_worker"])
def test_a_service_refuses_tls_files_it_cannot_serve_naming_them(
    tmp_path: Path, ca: trustme.CA, module: str,
) -> None:
    """A real service given --tls-ca alone, a key of another certificate, the
    certificate and key swapped or no CA in --tls-ca exits at once naming the
    flags. It used to die with a traceback (--tls-ca alone) or say "cannot
    listen on ... (in use, or not an address of this host)"."""
    files = {}
    for name in ("a", "b"):
        issued = ca.issue_cert(name, "127.0.0.1")
        files[f"{name}.pem"] = issued.cert_chain_pems[0].bytes()
        files[f"{name}.key"] = issued.private_key_pem.bytes()
    files["ca.pem"] = ca.cert_pem.bytes()
    files["junk"] = b"not a certificate\n"
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)

    def flags(ca_file: str, cert: str | None = None, key: str | None = None) -> list[str]:
        given = ["--tls-ca", str(tmp_path / ca_file)]
        if cert is not None and key is not None:
            given += ["--tls-cert", str(tmp_path / cert), "--tls-key", str(tmp_path / key)]
        return given

    for given, said in (
        (flags("ca.pem"), "needs this service's certificate and key"),
        (flags("ca.pem", "a.pem", "b.key"), "not a PEM certificate chain and its private key"),
        (flags("ca.pem", "a.key", "a.pem"), "not a PEM certificate chain and its private key"),
        (flags("junk", "a.pem", "a.key"), "no PEM CA certificate"),
    ):
        done = subprocess.run([sys.executable, "-m", module, "--listen", "127.0.0.1:0", *given],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode in (1, 2), done.stderr
        assert said in done.stderr and "Traceback" not in done.stderr, done.stderr


async def test_tls_files_grpc_serves_with_but_python_ssl_refuses_still_start(
        tmp_path: Path) -> None:
    """The start-up check loads the files with Python's ssl, whose OpenSSL
    security level refuses an RSA-1024 key ("ee key too small") that gRPC
    serves and connects with: a setup that worked was refused at start."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = (rsa.generate_private_key(65537, 1024) for _ in range(2))
    ca_name, name = (x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
                     for cn in ("old CA", "cache"))

    def issue(subject: x509.Name, public_key: Any, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name)
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(days=1))
                   .not_valid_after(now + datetime.timedelta(days=1)))
        builder = builder.add_extension(x509.BasicConstraints(ca=ca, path_length=None), True)
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        return builder.sign(ca_key, hashes.SHA256())

    pem = serialization.Encoding.PEM
    (tmp_path / "ca").write_bytes(issue(ca_name, ca_key.public_key(), True).public_bytes(pem))
    (tmp_path / "cert").write_bytes(issue(name, key.public_key(), False).public_bytes(pem))
    (tmp_path / "key").write_bytes(key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    files = security.from_args(parse(*(arg for f in ("ca", "cert", "key")
                                       for arg in (f"--tls-{f}", str(tmp_path / f)))))
    _, port, cache = await create_cache_server(
        CacheConfig(memory_budget_bytes=16 * MIB), "127.0.0.1:0", security=files)
    try:
        async with CacheClient(f"127.0.0.1:{port}", security=files, timeout_s=10) as client:
            await client.stats()
    finally:
        await cache.stop(None)


def test_settings_show_no_token_or_private_key(ca: trustme.CA) -> None:
    """Settings get logged and land in tracebacks: their repr holds no secret."""
    tls = tls_of(ca, "scheduler")
    assert tls.key is not None
    shown = repr(Security(tls, tokens=frozenset({TOKEN}), token="sent-token"))
    assert TOKEN not in shown and "sent-token" not in shown
    assert "PRIVATE KEY" not in shown and repr(tls.key) not in shown


# -- mutual TLS: the cache takes only certificates its CA signed ---------------------


@pytest.fixture
async def tls_cache(ca: trustme.CA) -> AsyncIterator[str]:
    _, port, cache = await create_cache_server(
        CacheConfig(memory_budget_bytes=16 * MIB), "127.0.0.1:0",
        security=Security(tls_of(ca, "cache")))
    yield f"127.0.0.1:{port}"
    await cache.stop(None)


async def test_the_cache_serves_peers_with_a_certificate_of_its_ca(tls_cache: str,
                                                                   ca: trustme.CA) -> None:
    async with CacheClient(tls_cache, security=Security(tls_of(ca, "worker"))) as client:
        await client.put("s", _layout(), 1, 16, bytes(_block_bytes()))
        _, data = await client.get("s")
        assert data == bytes(_block_bytes())


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate", "plaintext"])
async def test_the_cache_refuses_everyone_else(tls_cache: str, ca: trustme.CA, who: str) -> None:
    stranger = {
        "no certificate": Security(tls_of(ca)),
        "another CA's certificate": Security(Tls(ca.cert_pem.bytes(),
                                                 *_cert_of(trustme.CA(), "worker"))),
        "plaintext": security.PLAINTEXT,
    }[who]
    async with CacheClient(tls_cache, security=stranger, timeout_s=5) as client:
        with pytest.raises(errors.Unavailable):
            await client.stats()


async def _served_soon(call: Callable[[], Awaitable[object]]) -> None:
    """`call` until it is served (UNAVAILABLE until the rotated files are in
    use on both ends), within 30 s."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        try:
            await call()
            return
        except errors.Unavailable:
            assert asyncio.get_running_loop().time() < deadline, (
                "the rotated certificates were never used")
        await asyncio.sleep(0.2)


async def test_rotated_certificates_are_used_without_a_restart(tmp_path: Path) -> None:
    """cert-manager rotates a service's Secret (here to a new CA, as at a CA
    rotation): the cache presents, and checks clients against, the new files
    from its next handshake on, and a channel made after the rotation from
    a client's start-up settings presents the client's new certificate."""
    old_ca, new_ca = trustme.CA(), trustme.CA()

    def write_files(who: str, ca: trustme.CA) -> list[str]:
        return _write_tls_files(tmp_path, who, ca)

    served = security.from_args(parse(*write_files("cache", old_ca)))
    client = security.from_args(parse(*write_files("worker", old_ca)))
    _, port, cache = await create_cache_server(
        CacheConfig(memory_budget_bytes=16 * MIB), "127.0.0.1:0", security=served)
    address = f"127.0.0.1:{port}"
    try:
        async with CacheClient(address, security=client, timeout_s=5) as before:
            await before.stats()
        write_files("cache", new_ca)
        write_files("worker", new_ca)
        stranger = Security(Tls(new_ca.cert_pem.bytes(), *_cert_of(new_ca, "worker")))
        for who in (stranger, client):  # a new process; one started before the rotation
            async def stats_anew(who: Security = who) -> None:
                async with CacheClient(address, security=who, timeout_s=5) as after:
                    await after.stats()

            await _served_soon(stats_anew)
    finally:
        await cache.stop(None)


async def test_a_channel_made_before_a_rotation_reconnects_with_the_new_certificate(
        tmp_path: Path) -> None:
    """A long-lived channel (the scheduler's to its cache and worker, the
    worker's to the cache) kept the certificate and CA it was made with for
    every reconnect: after a rotation to a new CA, the cache restarted and
    the client's next calls failed UNAVAILABLE until the client restarted
    too. Now its calls use the files as they are now, on the same client."""
    old_ca, new_ca = trustme.CA(), trustme.CA()
    served = security.from_args(parse(*_write_tls_files(tmp_path, "cache", old_ca)))
    config = CacheConfig(memory_budget_bytes=16 * MIB)
    _, port, cache = await create_cache_server(config, "127.0.0.1:0", security=served)
    address = f"127.0.0.1:{port}"
    client = security.from_args(parse(*_write_tls_files(tmp_path, "worker", old_ca)))
    async with CacheClient(address, security=client, timeout_s=5) as long_lived:
        try:
            await long_lived.stats()
            _write_tls_files(tmp_path, "cache", new_ca)
            _write_tls_files(tmp_path, "worker", new_ca)
            await cache.stop(None)  # its connections go: the client must reconnect
            _, _, cache = await create_cache_server(config, address, security=served)
            # First a client of the new CA only: the cache serves the new files.
            stranger = Security(Tls(new_ca.cert_pem.bytes(), *_cert_of(new_ca, "worker")))
            async with CacheClient(address, security=stranger, timeout_s=5) as new_client:
                for client_now in (new_client, long_lived):
                    await _served_soon(client_now.stats)
        finally:
            await cache.stop(None)


async def test_a_call_in_flight_at_a_rotation_goes_on_and_its_channel_closes_after(
        tmp_path: Path) -> None:
    """A stream open at the rotation (a scheduler's Execute stream to its
    worker lasts as long as the process) stays on the channel it began on,
    which closes once it ends; calls made after go on the new one."""
    ca = trustme.CA()
    served = security.from_args(parse(*_write_tls_files(tmp_path, "cache", ca)))
    _, port, cache = await create_cache_server(
        CacheConfig(memory_budget_bytes=16 * MIB), "127.0.0.1:0", security=served)
    client = security.from_args(parse(*_write_tls_files(tmp_path, "worker", ca)))
    channel = rpc_connections.channel(f"127.0.0.1:{port}", client)
    assert isinstance(channel, rpc_connections.RenewingChannel)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        first = channel.current()
        watch = health.Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        _write_tls_files(tmp_path, "worker", ca)  # a renewed certificate
        deadline = asyncio.get_running_loop().time() + 30
        while channel.current() is first:
            assert asyncio.get_running_loop().time() < deadline, "never renewed"
            await asyncio.sleep(0.2)
        await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert not watch.done() and first.get_state() is not grpc.ChannelConnectivity.SHUTDOWN
        watch.cancel()
        while first.get_state() is not grpc.ChannelConnectivity.SHUTDOWN:
            assert asyncio.get_running_loop().time() < deadline, "the old channel stayed open"
            await asyncio.sleep(0.05)
    finally:
        await channel.close()
        await cache.stop(None)


def _write_tls_files(directory: Path, who: str, ca: trustme.CA) -> list[str]:
    """`who`'s CA bundle, certificate and key from `ca`, as files in
    `directory`; the flags that name them."""
    cert, key = _cert_of(ca, who)
    for name, pem in (("ca", ca.cert_pem.bytes()), ("cert", cert), ("key", key)):
        (directory / f"{who}.{name}").write_bytes(pem)
    return [arg for name in ("ca", "cert", "key")
            for arg in (f"--tls-{name}", str(directory / f"{who}.{name}"))]


def _cert_of(ca: trustme.CA, name: str) -> tuple[bytes, bytes]:
    cert = ca.issue_cert(name, "127.0.0.1")
    return cert.cert_chain_pems[0].bytes(), cert.private_key_pem.bytes()


def _layout():  # type: ignore[no-untyped-def]
    from kvstash.common.layout import Layout

    return Layout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=64, dtype="float16")


def _block_bytes() -> int:
    return 2 * 16 * 64 * 2


# -- the public API: TLS without client certificates, bearer tokens ------------------


@pytest.fixture
async def public_scheduler(ca: trustme.CA) -> AsyncIterator[str]:
    scheduler = await create_scheduler_server(
        "127.0.0.1:0", Security(tls_of(ca, "scheduler", require_client_cert=False),
                                tokens=frozenset({TOKEN, "other"})))
    yield f"127.0.0.1:{scheduler.port}"
    await scheduler.server.stop(None)


@pytest.mark.parametrize(("token", "code"), [
    (None, grpc.StatusCode.UNAUTHENTICATED),
    ("wrong", grpc.StatusCode.UNAUTHENTICATED),
    (TOKEN, grpc.StatusCode.UNAVAILABLE),  # let in; no engine attached yet
])
async def test_calls_need_an_accepted_token(public_scheduler: str, ca: trustme.CA,
                                            token: str | None, code: grpc.StatusCode) -> None:
    secured = Security(tls_of(ca), token=token)
    async with rpc_connections.channel(public_scheduler, secured) as channel:
        from kvstash.v1 import common_pb2, scheduler_pb2_grpc

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(common_pb2.GetStatsRequest())
        assert info.value.code() == code
        if code == grpc.StatusCode.UNAUTHENTICATED:
            assert TOKEN not in (info.value.details() or "")  # never echoed


async def test_a_token_removed_from_the_file_is_refused_without_a_restart(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--auth-token-file is read again once it changes (the kubelet
    re-projects an edited Secret): a revoked token is refused within a
    couple of seconds and a new one accepted. A file emptied or gone keeps
    the tokens in force."""
    tokens = tmp_path / "tokens"
    tokens.write_text("leaked\nkept\n")
    scheduler = await create_scheduler_server(
        "127.0.0.1:0", security.from_args(parse("--auth-token-file", str(tokens))))
    address = f"127.0.0.1:{scheduler.port}"
    let_in, refused = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED
    try:
        assert await _call_with(address, "leaked") == let_in
        tokens.write_text("kept\nnew\n")
        await asyncio.sleep(bearer.TOKEN_FILE_CHECK_S + 0.2)
        assert await _call_with(address, "leaked") == refused
        assert await _call_with(address, "new") == let_in
        for broken in ("# nobody\n", None):
            if broken is None:
                tokens.unlink()
            else:
                tokens.write_text(broken)
            await asyncio.sleep(bearer.TOKEN_FILE_CHECK_S + 0.2)
            assert await _call_with(address, "kept") == let_in
            assert await _call_with(address, "leaked") == refused
        assert "no token in it; keeping the 2 tokens read before" in caplog.text
        assert "No such file or directory; keeping the 2 tokens" in caplog.text
    finally:
        await scheduler.server.stop(None)


async def test_a_rotated_token_file_is_sent_without_a_restart(tmp_path: Path) -> None:
    """--token-file (what a prefill instance sends its decode instances) is
    read again once it changes: after a rotation that revokes the old token,
    calls on a channel opened before it, and on a new one built from the
    same start-up settings, carry the new token and are let in."""
    accepted, sent = tmp_path / "accepted", tmp_path / "sent"
    accepted.write_text("old\n")
    sent.write_text("old\n")
    scheduler = await create_scheduler_server(
        "127.0.0.1:0", security.from_args(parse("--auth-token-file", str(accepted))))
    address = f"127.0.0.1:{scheduler.port}"
    sender = security.from_args(parse("--token-file", str(sent)))
    let_in = grpc.StatusCode.UNAVAILABLE
    try:
        async with rpc_connections.channel(address, sender) as channel:
            assert await _stats_call(channel) == let_in
            accepted.write_text("new\n")  # the old token revoked...
            sent.write_text("# rotated\nnew\n")  # ...and replaced where it is sent from
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while await _call_with(address, "old") != grpc.StatusCode.UNAUTHENTICATED:
                assert loop.time() < deadline, "the revoked token was never refused"
                await asyncio.sleep(0.2)
            while await _stats_call(channel) != let_in:
                assert loop.time() < deadline, "the rotated token was never sent"
                await asyncio.sleep(0.2)
        async with rpc_connections.channel(address, sender) as channel:
            assert await _stats_call(channel) == let_in
    finally:
        await scheduler.server.stop(None)


async def test_calls_at_once_on_a_channel_made_after_a_rotation_carry_the_new_token(
        tmp_path: Path) -> None:
    """A channel made after --token-file changed (to a decode instance's pod
    that came back at a new address, days after a rotation that revoked the
    start-up token): its first calls at once all carry the new token. Only
    the first waited for the file's re-read; the others sent the start-up
    token and were refused (a prefill instance asks no more, for those
    requests, a decode instance that refused its token)."""
    accepted, sent = tmp_path / "accepted", tmp_path / "sent"
    accepted.write_text("new\n")
    sent.write_text("old\n")
    sender = security.from_args(parse("--token-file", str(sent)))  # at its start
    sent.write_text("new\n")
    scheduler = await create_scheduler_server(
        "127.0.0.1:0", security.from_args(parse("--auth-token-file", str(accepted))))
    try:
        async with rpc_connections.channel(f"127.0.0.1:{scheduler.port}", sender) as channel:
            codes = await asyncio.gather(*(_stats_call(channel) for _ in range(8)))
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 8  # let in, no worker behind
    finally:
        await scheduler.server.stop(None)


async def _stats_call(channel: grpc.aio.Channel) -> grpc.StatusCode:
    from kvstash.v1 import common_pb2, scheduler_pb2_grpc

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            common_pb2.GetStatsRequest(), timeout=5)
    return info.value.code()


async def _call_with(address: str, token: str) -> grpc.StatusCode:
    from kvstash.v1 import common_pb2, scheduler_pb2_grpc

    async with rpc_connections.channel(address, Security(token=token)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                common_pb2.GetStatsRequest(), timeout=5)
    return info.value.code()


async def test_health_checks_need_no_token(public_scheduler: str, ca: trustme.CA) -> None:
    async with rpc_connections.channel(public_scheduler, Security(tls_of(ca))) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no worker yet


@pytest.mark.parametrize("token", [None, TOKEN])
async def test_streaming_calls_carry_the_token(public_scheduler: str, ca: trustme.CA,
                                               token: str | None) -> None:
    async with Client(public_scheduler, Security(tls_of(ca), token=token)) as client:
        with pytest.raises(errors.KvstashError) as info:
            await client.complete([1, 2, 3], max_tokens=2)
    # Without the token: refused at the door. With it: let in (and told no
    # worker is attached yet).
    assert ("bearer token" in str(info.value)) is (token is None), info.value


async def test_a_plaintext_client_cannot_reach_a_tls_server(public_scheduler: str) -> None:
    async with rpc_connections.channel(public_scheduler, Security(token=TOKEN)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
