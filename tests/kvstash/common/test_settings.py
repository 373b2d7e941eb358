"""Flags from KVSTASH_<SERVICE>_* variables: read once, the command line wins."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvstash.common import settings
from kvstash.common.units import MIB
from kvstash.launch.processes import start_service
from tests.integration.workload import cache_stats


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--num-blocks", type=int, default=8)
    p.add_argument("--mode", choices=["auto", "offload"], default="auto")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--budget", type=_size, default=0)
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True)
    return p


def _size(text: str) -> int:
    """A flag type that fails the argparse way (ArgumentTypeError)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(text)


def test_variable_sets_default_and_flag_wins() -> None:
    env = {"KVSTASH_WORKER_NUM_BLOCKS": "64", "KVSTASH_WORKER_VERBOSE": "true",
           "KVSTASH_SCHEDULER_NUM_BLOCKS": "5"}  # another service's: ignored
    args = settings.parse_args(make_parser(), "worker", [], env)
    assert (args.num_blocks, args.verbose, args.mode) == (64, True, "auto")
    args = settings.parse_args(make_parser(), "worker", ["--num-blocks", "3"], env)
    assert args.num_blocks == 3


def test_switch_variables_set_either_way() -> None:
    env = {"KVSTASH_WORKER_FAST": "off", "KVSTASH_WORKER_VERBOSE": "1"}
    args = settings.parse_args(make_parser(), "worker", [], env)
    assert (args.fast, args.verbose) == (False, True)
    assert settings.parse_args(make_parser(), "worker", ["--fast"], env).fast


@pytest.mark.parametrize(("value", "meant"), [("1", "false"), ("off", "true")])
def test_the_off_form_of_a_switch_is_refused_naming_the_variable_to_set(
    value: str, meant: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """KVSTASH_WORKER_NO_FAST names a flag (--no-fast) but was never read (a
    chart's `worker.flags: {no-cache-arena: true}` left the arena on): each
    setting comes from one variable, its first flag's."""
    with pytest.raises(SystemExit):
        settings.parse_args(make_parser(), "worker", [], {"KVSTASH_WORKER_NO_FAST": value})
    assert (f"KVSTASH_WORKER_NO_FAST: not read; set KVSTASH_WORKER_FAST={meant} instead"
            in capsys.readouterr().err)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("KVSTASH_WORKER_NUM_BLOCKS", "many", "KVSTASH_WORKER_NUM_BLOCKS='many'"),
    ("KVSTASH_WORKER_MODE", "sometimes", "choose from auto, offload"),
    ("KVSTASH_WORKER_BUDGET", "lots", "KVSTASH_WORKER_BUDGET='lots': not a size: 'lots'"),
    ("KVSTASH_WORKER_VERBOSE", "maybe", "KVSTASH_WORKER_VERBOSE='maybe': use one of 1, true"),
])
def test_bad_variable_fails_at_start_naming_it(
    name: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        settings.parse_args(make_parser(), "worker", [], {name: value})
    assert message in capsys.readouterr().err


async def test_a_service_takes_its_settings_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTASH_CACHE_MEMORY_BUDGET", "48MiB")
    cache = start_service("cache", "cache_svc", ["--listen", "127.0.0.1:0"], tmp_path)
    try:
        stats = await cache_stats(cache.address)
    finally:
        cache.stop()
    assert stats.memory_budget_bytes == 48 * MIB


def test_a_variable_that_names_no_flag_fails_at_start_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A typo (a Helm chart's `flags: {num-block: 64}`) must not leave the
    setting at its default without a word."""
    with pytest.raises(SystemExit):
        settings.parse_args(make_parser(), "worker", [], {"KVSTASH_WORKER_NUM_BLOCK": "64"})
    assert ("KVSTASH_WORKER_NUM_BLOCK: no flag of this service takes it (did you mean "
            "KVSTASH_WORKER_NUM_BLOCKS, for --num-blocks?)") in capsys.readouterr().err
    # Other prefixes, and the sim's build cache, are not this service's.
    env = {"KVSTASH_WORKERS": "2", "KVSTASH_CACHE_DIR": "/tmp/c", "KVSTASH_FUZZ_EXAMPLES": "9"}
    assert settings.parse_args(make_parser(), "cache", [], env).num_blocks == 8


def test_a_service_refuses_a_variable_that_names_no_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTASH_CACHE_MEMORY_BUDGE", "48MiB")
    try:
        cache = start_service("cache", "cache_svc", ["--listen", "127.0.0.1:0"], tmp_path,
                              timeout_s=60)
    except RuntimeError as exc:
        assert "cache exited with code 2" in str(exc)
        assert "KVSTASH_CACHE_MEMORY_BUDGE: no flag of this service" in str(exc)
    else:
        cache.stop()
        pytest.fail("the cache started, its memory budget left at the default")
