"""Chart and code cannot drift apart: every KVSTASH_* variable the chart gives
a container must name a flag of that service, and the service's own parser
and config checks must accept the values (a dry parse: nothing is started).
The paths the pod would mount are made here, under tmp_path."""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trustme
from chart_helpers import VALUE_SETS, env, one, rendered

from kvstash.common import security, settings, telemetry
from kvstash.launch import cli

SERVICES = {"scheduler": "SCHEDULER", "worker": "WORKER", "cache": "CACHE"}


def check_scheduler() -> None:
    from scheduler_svc.flags import parse_args

    args = parse_args([])
    security.check_listen(args.listen, security.from_args(args, require_client_cert=False))


def check_worker() -> None:
    from gpu_worker.__main__ import parse_args

    parse_args([])  # builds and checks WorkerConfig and the listen address


def check_cache() -> None:
    from cache_svc.__main__ import build_parser, config_from_args

    args = settings.parse_args(build_parser(), "cache", [])
    config_from_args(args)
    security.check_listen(args.listen, security.from_args(args))


CHECKS: dict[str, Callable[[], None]] = {
    "scheduler": check_scheduler, "worker": check_worker, "cache": check_cache}


def as_local(variables: dict[str, str], container: dict[str, Any], root: Path) -> dict[str, str]:
    """The variables with every path under one of the container's mounts
    moved under `root`, where it then exists (a file for *_FILE and TLS
    variables, else a directory; a TLS variable's file a real PEM, which the
    services check at start)."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    pems = {"CA": ca.cert_pem.bytes(), "CERT": issued.cert_chain_pems[0].bytes(),
            "KEY": issued.private_key_pem.bytes()}
    mount_paths = [m["mountPath"] for m in container.get("volumeMounts", [])]
    local = dict(variables)
    for name, value in variables.items():
        if any(value == m or value.startswith(m + "/") for m in mount_paths):
            path = root / value.lstrip("/")
            if name.endswith("_FILE") or "_TLS_" in name:
                path.parent.mkdir(parents=True, exist_ok=True)
                tls_file = name.rsplit("_TLS_", 1)[1] if "_TLS_" in name else None
                if tls_file is not None:
                    path.write_bytes(pems[tls_file])
                else:
                    path.write_text("not-a-real-secret\n")
            else:
                path.mkdir(parents=True, exist_ok=True)
            local[name] = str(path)
    return local


def dry_parse(service: str, variables: dict[str, str], monkeypatch: pytest.MonkeyPatch,
              capsys: pytest.CaptureFixture[str]) -> argparse.ArgumentParser:
    """Runs the service's start-up parsing with exactly `variables` set;
    returns the parser it used."""
    for name in list(os.environ):
        if name.startswith(("KVSTASH_", "OTEL_")):
            monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    parsers: list[argparse.ArgumentParser] = []
    real_parse = settings.parse_args

    def spy(parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> argparse.Namespace:
        parsers.append(parser)
        return real_parse(parser, *args, **kwargs)

    monkeypatch.setattr(settings, "parse_args", spy)
    try:
        CHECKS[service]()
    except SystemExit:
        pytest.fail(f"{service} refuses the chart's settings: {capsys.readouterr().err}")
    except ValueError as exc:
        pytest.fail(f"{service} refuses the chart's settings: {exc}")
    (parser,) = parsers
    return parser


def known_variables(parser: argparse.ArgumentParser, service: str) -> set[str]:
    """The variables kvstash/common/settings.py reads for `parser`."""
    names = set()
    for action in parser._actions:
        long_options = [o for o in action.option_strings if o.startswith("--")]
        if long_options and action.dest != "help":
            names.add(settings.env_name(service, long_options[0]))
    return names


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_services_accept_what_the_chart_passes(
    value_set: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    values = VALUE_SETS[value_set]
    docs = rendered(value_set)
    # Every pool's containers (P/D renders a scheduler and a worker per pool).
    containers = [c for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
                  for c in d["spec"]["template"]["spec"]["containers"]]
    for name, service in SERVICES.items():
        found = [c for c in containers if c["name"] == name]
        if not found:
            assert name == "cache" and value_set == "no-cache"
            continue
        for c in found:
            variables = as_local(env(c), c, tmp_path / name)
            parser = dry_parse(name, variables, monkeypatch, capsys)
            ours = {k for k in variables if k.startswith(f"KVSTASH_{service}_")}
            unknown = ours - known_variables(parser, service)
            assert not unknown, f"{name} has no flag for {sorted(unknown)}"
            assert not {k for k in variables if k.startswith("KVSTASH_")} - ours
            tracing = values.get("tracing", {}).get("enabled", False)
            assert telemetry.tracing_requested(variables) is tracing, name


@pytest.mark.parametrize("value_set", ["defaults", "tls", "auth"])
def test_helm_test_pod_cli_accepts_its_arguments(
    value_set: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pod = one(rendered(value_set), "Pod")
    c = pod["spec"]["containers"][0]
    script = c["command"][-1].replace('"$PROMPT"', shlex.quote(env(c)["PROMPT"]))
    generate = shlex.split(script.split("&&")[1])
    assert generate[0] == "kvstash"
    seen: list[argparse.Namespace] = []

    async def fake_generate(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(cli, "_generate", fake_generate)
    assert cli.main(generate[1:]) == 0
    (args,) = seen
    assert args.prompt == VALUE_SETS[value_set].get("tests", {}).get("prompt", "Once upon a time")
    assert (args.tls_ca is not None) is (value_set == "tls")
    # Its token goes to the scheduler's Service: in plaintext only where the
    # chart serves plaintext (auth without TLS), and said so.
    assert (args.token_file is not None) is (value_set != "defaults")
    sends = security.Security(token="t" if args.token_file else None, plaintext=args.plaintext,
                              tls=security.Tls(b"ca") if args.tls_ca else None)
    security.check_send(args.address, sends)
    assert args.plaintext is (value_set == "auth")
