"""What the `kvstash` command tells its user: every flag's help and default,
and one line with a hint when nothing answers at the address."""

from __future__ import annotations

import re
import socket

import pytest

from kvstash.launch.cli import main


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
