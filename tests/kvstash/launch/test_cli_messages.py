"""What the `kvstash` command tells its user: every flag's help and default,
one line with a hint when nothing answers at the address, one line (never a
traceback) for a bad flag, and nothing at all for a Ctrl-C."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import trustme

from kvstash.launch import cli
from kvstash.launch.cli import main
from kvstash.launch.processes import Service
from kvstash.launch.stack import StackConfig, metrics_args
from kvstash.v1 import scheduler_pb2_grpc


def help_of(capsys: pytest.CaptureFixture[str], command: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def described(text: str, flag: str) -> str:
    """The help text after `flag` (and its metavar) in argparse's output."""
    found = re.search(rf"^  {flag}(?: [A-Z_]+| \{{[^}}]*\}})?\s+(\S.*?)(?=^  \S|\Z)", text,
                      re.MULTILINE | re.DOTALL)
    assert found, f"{flag} not in the help"
    return " ".join(found[1].split())


def test_up_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capsys, "up")
    for flag, default in [("--listen", "127.0.0.1:50051"), ("--gateway-port", "8000"),
                          ("--model", "tiny"), ("--dtype", "auto"), ("--device", "auto"),
                          ("--num-blocks", "512"), ("--block-size", "16"),
                          ("--preemption-mode", "auto"), ("--cache-memory-budget", "1GiB"),
                          ("--cache-disk-budget", "4GiB"), ("--instances", "1"),
                          ("--gateway-policy", "cache_aware")]:
        assert described(text, flag).endswith(f"(default: {default})"), flag
    assert "temporary" in described(text, "--log-dir")
    assert "None" not in text and "False" not in text


def test_generate_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capsys, "generate")
    flags = re.findall(r"^  (--[a-z-]+)", text, re.MULTILINE)
    assert {"--address", "--max-tokens", "--temperature", "--top-p", "--top-k",
            "--seed"} <= set(flags)
    for flag in flags:
        assert described(text, flag), flag
    assert described(text, "--max-tokens").endswith("(default: 64)")
    assert re.search(r"^  prompt\s+\S", text, re.MULTILINE)


@pytest.mark.parametrize("command", ["generate", "stats"])
def test_nothing_at_the_address_is_one_line_with_a_hint(
    capsys: pytest.CaptureFixture[str], command: str,
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    argv = [command, "hello"] if command == "generate" else [command]
    assert main([*argv, "--address", address]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"kvstash {command}: failed to connect")
    assert err[0].endswith(f"(no kvstash stack at {address}? start one with `kvstash up`)")


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def scheduler_port(request: pytest.FixtureRequest, ca: trustme.CA) -> Iterator[int]:
    """A real gRPC server of the Scheduler service on a free port: TLS with
    a certificate of `ca`, or plaintext (request.param)."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler_pb2_grpc.SchedulerServicer(),
                                                        server)
    if request.param == "tls":
        cert = ca.issue_cert("127.0.0.1")
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
            [(cert.private_key_pem.bytes(), cert.cert_chain_pems[0].bytes())]))
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(None)


@pytest.mark.parametrize(("scheduler_port", "ca_file", "hint"), [
    ("tls", "another CA's", "(TLS failed: does the scheduler serve TLS, and is --tls-ca the CA "
                            "that signed its certificate?)"),
    ("tls", None, "(the scheduler closed the connection: does it serve TLS? give --tls-ca)"),
    ("plaintext", "its CA's", "(TLS failed: does the scheduler serve TLS, and is --tls-ca the "
                              "CA that signed its certificate?)"),
], indirect=["scheduler_port"])
def test_tls_that_fails_is_not_called_a_missing_stack(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ca: trustme.CA, scheduler_port: int,
    ca_file: str | None, hint: str,
) -> None:
    """A scheduler that serves, reached with the wrong CA or without TLS:
    "no kvstash stack at ...? start one with `kvstash up`" sent its user off
    to start a second stack."""
    flags = []
    if ca_file is not None:
        pem = (ca if ca_file == "its CA's" else trustme.CA()).cert_pem.bytes()
        (tmp_path / "ca.pem").write_bytes(pem)
        flags = ["--tls-ca", str(tmp_path / "ca.pem")]
    assert main(["stats", "--address", f"127.0.0.1:{scheduler_port}", *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("kvstash stats: failed to connect"), err
    assert err[0].endswith(hint), err


@pytest.mark.parametrize(("argv", "message"), [
    (["up", "--listen", "127.0.0.1:99999"], "argument --listen: address '127.0.0.1:99999' is "
                                            "not host:port (port 0-65535)"),
    (["up", "--listen", "localhost"], "argument --listen: address 'localhost' is not host:port"),
    (["up", "--listen", "127.0.0.1:abc"], "argument --listen: address '127.0.0.1:abc'"),
    (["up", "--listen", "0.0.0.0:50051"], "argument --listen: 0.0.0.0:50051 is not a loopback "
                                          "address and kvstash up serves plaintext gRPC: add "
                                          "--plaintext"),
    (["up", "--gateway-port", "70000"], "argument --gateway-port: not a port (0-65535): '70000'"),
    (["up", "--cache-memory-budget", "1XB"], "argument --cache-memory-budget: not a byte size"),
    (["demo", "--cache-disk-budget", "lots"], "argument --cache-disk-budget: not a byte size"),
    (["demo", "--requests", "0"], "argument --requests: not a whole number > 0: '0'"),
    (["demo", "--max-tokens", "-1"], "argument --max-tokens: not a whole number > 0: '-1'"),
    (["up", "--start-timeout", "0"], "argument --start-timeout: not a duration > 0: '0'"),
    (["demo", "--start-timeout", "soon"], "argument --start-timeout: not a duration: 'soon'"),
])
def test_a_bad_stack_flag_is_refused_by_name_before_anything_starts(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str,
) -> None:
    """Not a traceback (IndexError on `--listen localhost`), not a stack on
    another port (gRPC wraps 99999 around to 34463), not a cache service's
    refusal after the others started."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"kvstash {argv[0]}: error: {message}" in err, err


def test_a_gateway_port_that_is_the_schedulers_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both ports were free when checked: the stack started, the scheduler
    took the port, and only then did smg fail on it."""
    started: list[StackConfig] = []

    def recorded(config: StackConfig, log_dir: Path | None = None) -> None:
        started.append(config)
        raise RuntimeError("started")

    monkeypatch.setattr(cli, "_stop_on_signals", lambda: None)
    monkeypatch.setattr(cli, "start_stack", recorded)
    with pytest.raises(SystemExit) as done:
        main(["up", "--listen", "127.0.0.1:50151", "--gateway", "--gateway-port", "50151"])
    assert done.value.code == 2
    assert ("kvstash up: error: argument --gateway-port: 50151 is --listen's port too (the "
            "scheduler's); smg needs a port of its own") in capsys.readouterr().err
    assert not started


@pytest.mark.parametrize(("command", "argv"), [
    ("generate", ["generate", "hello"]), ("stats", ["stats"]),
    ("tokenizer export", ["tokenizer", "export", "out"]),
])
@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1:", "", "localhost"])
def test_an_address_grpc_would_call_elsewhere_is_refused_by_name(
    capsys: pytest.CaptureFixture[str], command: str, argv: list[str], address: str,
) -> None:
    """Not a call to port 34463 (gRPC takes 99999 modulo 65536, and reached
    whatever listened there), nor to 443 for an empty port or none."""
    with pytest.raises(SystemExit) as done:
        main([*argv, "--address", address])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert (f"kvstash {command}: error: argument --address: address {address!r} is not "
            "host:port (port 0-65535)") in err, err


@pytest.mark.parametrize(("command", "argv"), [
    ("generate", ["generate", "hello"]), ("stats", ["stats"]),
])
@pytest.mark.parametrize(("address", "message"), [
    ("http://127.0.0.1:50051", "give host:port, not a URL"),
    (" 127.0.0.1:50051", "it has spaces around it"),
])
def test_a_url_or_spaces_around_the_address_are_a_usage_error(
    capsys: pytest.CaptureFixture[str], command: str, argv: list[str], address: str,
    message: str,
) -> None:
    """Not a call that fails UNAVAILABLE 'Misformatted domain name'."""
    with pytest.raises(SystemExit) as done:
        main([*argv, "--address", address])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert (f"kvstash {command}: error: argument --address: address {address!r} is not "
            f"host:port: {message}") in err, err


@pytest.mark.parametrize("command", ["generate", "stats"])
def test_a_token_is_not_sent_in_plaintext_beyond_loopback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str,
) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    argv = [command, "hello"] if command == "generate" else [command]
    assert main([*argv, "--address", "10.0.0.7:50051", "--token-file", str(token)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvstash {command}: refusing to send the bearer token in plaintext "
                          "to 10.0.0.7:50051: give --tls-ca"), err


def test_a_log_dir_that_cannot_be_one_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "_stop_on_signals", lambda: None)
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["up", "--log-dir", str(afile)]) == 2
    assert capsys.readouterr().err == f"kvstash up: --log-dir {afile}: File exists\n"


def test_an_ipv6_listen_address_is_checked_and_its_metrics_served_there(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--listen [::1]:PORT`: the port is checked on ::1 (the brackets kept
    the check from resolving it, so it passed), and --metrics finds its free
    ports there (a socket.gaierror traceback)."""
    with socket.socket(socket.AF_INET6) as taken:
        try:
            taken.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback")
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(cli, "_stop_on_signals", lambda: None)
        assert main(["up", "--listen", f"[::1]:{port}", "--metrics"]) == 2
    assert capsys.readouterr().err.startswith(
        f"kvstash up: cannot listen on [::1]:{port}: the address is in use")
    flags = metrics_args(StackConfig(host="::1", metrics=True))
    assert flags[2:] == ["--metrics-host", "::1"]
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", int(flags[1])))  # a free port of ::1
    service = Service("cache", None, "[::1]:1", Path("cache.log"),  # type: ignore[arg-type]
                      "cache_svc", tuple(flags))  # (no process: only its flags are read)
    assert service.metrics_url == f"http://[::1]:{flags[1]}/metrics"


def test_ctrl_c_in_generate_exits_130_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def interrupted(args: object) -> int:
        signal.raise_signal(signal.SIGINT)  # Ctrl-C while the tokens stream
        await asyncio.sleep(30)
        return 0

    monkeypatch.setattr(cli, "_generate", interrupted)
    # Python's own SIGINT handler, as `kvstash generate` starts with (a test
    # of `kvstash demo` before this one may have left the launcher's).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(["generate", "hello"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err == ""
