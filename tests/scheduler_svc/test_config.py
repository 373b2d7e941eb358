from __future__ import annotations

import contextlib
import dataclasses
import re
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from kvstash.common import security
from kvstash.common.layout import Layout
from kvstash.common.rpc_connections import MAX_STEP_PLAN_BYTES
from kvstash.common.rpc_server import INTERRUPTED_EXIT
from kvstash.common.units import MIB
from kvstash.common.wire import layout_to_proto
from kvstash.v1 import worker_pb2, worker_pb2_grpc
from scheduler_svc.__main__ import main as scheduler_main
from scheduler_svc.__main__ import serve
from scheduler_svc.core.config import PreemptionMode, ReservationPolicy, Role, SchedulerConfig
from scheduler_svc.flags import build_config, check_flags, check_role, parse_args
from scheduler_svc.worker_link import largest_plan_bytes
from tests.process_helpers import interrupt_once
from tests.scheduler_svc.factories import make_config


def test_defaults_and_derived_values() -> None:
    # Only the fields the worker supplies are given: the rest are the defaults.
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=256, vocab_size=100)
    assert config.max_num_seqs == 64
    assert config.max_num_batched_tokens == 512
    assert config.eos_token_ids == ()
    assert config.reservation_policy is ReservationPolicy.NEW_TOKEN_RATIO
    assert config.preemption_mode is PreemptionMode.AUTO
    assert config.init_new_token_ratio == 0.7
    assert config.min_new_token_ratio == pytest.approx(0.7 * 0.14)
    assert config.new_token_ratio_decay == pytest.approx((0.7 - 0.098) / 600)
    assert config.clip_max_new_tokens == 4096
    assert config.role is Role.MIXED


def test_enum_values_given_as_strings_are_coerced() -> None:
    config = make_config(preemption_mode="offload", reservation_policy="fixed_blocks",
                         role="prefill")
    assert config.preemption_mode is PreemptionMode.OFFLOAD
    assert config.reservation_policy is ReservationPolicy.FIXED_BLOCKS
    assert config.role is Role.PREFILL


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_blocks": 0}, "num_blocks must be >= 1, got 0"),
        ({"block_size": True}, "block_size must be an int, got True"),
        ({"max_num_seqs": 16, "max_num_batched_tokens": 8}, "max_num_batched_tokens must be >= 16"),
        ({"init_new_token_ratio": 1.5}, "init_new_token_ratio must be in [1e-09, 1.0], got 1.5"),
        ({"min_new_token_ratio_factor": -0.1}, "got -0.1"),
        ({"new_token_ratio_decay_steps": 0}, "new_token_ratio_decay_steps must be >= 1, got 0"),
        ({"eos_token_ids": (100,)}, "eos token id 100 is outside vocab_size 100"),
        ({"preemption_mode": "swap"}, "preemption_mode must be one of auto, offload, recompute"),
        ({"bytes_per_block": -1}, "bytes_per_block must be >= 0, got -1"),
        ({"role": "both"}, "role must be one of mixed, prefill, decode, got 'both'"),
    ],
)
def test_invalid_values_are_named(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        make_config(**overrides)
    assert message in str(excinfo.value)


def test_config_is_frozen() -> None:
    config = make_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_blocks = 1  # type: ignore[misc]


def test_snapshot_ids_are_unique_per_scheduler() -> None:
    assert make_config().snapshot_id_prefix != make_config().snapshot_id_prefix
    with pytest.raises(ValueError, match="snapshot_id_prefix"):
        make_config(snapshot_id_prefix="../x")


@pytest.mark.parametrize(("extra", "message"), [
    ((), "refusing to send the bearer token in plaintext to decode.svc:50051"),
    (("--plaintext",), None),
    (("--decode-address", "127.0.0.1:50051"), None),
])
def test_a_prefill_instance_checks_its_decode_token_at_start(
    tmp_path: Path, extra: tuple[str, ...], message: str | None,
) -> None:
    """The token for decode instances would go in plaintext: refused at start
    (scheduler_svc's main), not at the first hand-off."""
    token = tmp_path / "token"
    token.write_text("secret\n")
    args = parse_args(["--role", "prefill", "--cache-address", "127.0.0.1:1",
                       "--decode-address", "decode.svc:50051", "--token-file", str(token),
                       *extra])
    secured = security.from_args(args, require_client_cert=False)
    if message is None:
        check_role(args, secured)
        return
    with pytest.raises(ValueError, match=message):
        check_role(args, secured)


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--max-num-seqs", "16", "--max-num-batched-tokens", "8"],
     "--max-num-batched-tokens must be >= 16, got 8"),
    (["--init-new-token-ratio", "5"], "--init-new-token-ratio must be in [1e-09, 1.0], got 5.0"),
    (["--reservation-timeout", "0"], "--reservation-timeout must be in [0.001, 86400.0]"),
    (["--num-blocks", "-1"], "--num-blocks must be >= 0 (0: all the worker's), got -1"),
    (["--prefix-segment-tokens", "-16"], "--prefix-segment-tokens must be >= 0 (0: off)"),
])
def test_a_bad_setting_is_one_line_naming_its_flag_before_any_worker_is_asked(
    argv: list[str], message: str,
) -> None:
    """Not a traceback once the worker has answered (which may take minutes
    of model loading): no worker listens at this --worker-address."""
    with pytest.raises(ValueError, match=re.escape(message)):
        check_flags(parse_args(argv))
    with pytest.raises(SystemExit) as done:
        scheduler_main([*argv, "--worker-address", "127.0.0.1:1", "--worker-wait", "1"])
    assert str(done.value.code).startswith(f"scheduler_svc: {message}")


@pytest.mark.parametrize(("argv", "message"), [
    (["--worker-address", "127.0.0.1:99999"],
     "--worker-address '127.0.0.1:99999': port 99999 is past 65535"),
    (["--cache-address", "cache.svc:70000"],
     "--cache-address 'cache.svc:70000': port 70000 is past 65535"),
    (["--role", "prefill", "--cache-address", "127.0.0.1:1",
      "--decode-address", "127.0.0.1:2,decode.svc:65537"],
     "--decode-address 'decode.svc:65537': port 65537 is past 65535"),
])
def test_a_peer_port_past_65535_is_refused_not_wrapped_around(
    argv: list[str], message: str,
) -> None:
    """gRPC's client reached port 99999 - 65536 = 34463: whatever listens there."""
    with pytest.raises(SystemExit) as done:
        scheduler_main(["--worker-address", "127.0.0.1:1", "--worker-wait", "1", *argv])
    assert done.value.code == f"scheduler_svc: {message}"


def test_forced_offload_without_a_cache_address_is_refused_at_start() -> None:
    """The help says an empty --cache-address means no offload, yet offload
    mode offloaded through the worker's cache, and with no cache to call the
    scheduler never deleted a snapshot (an aborted request's stayed pinned
    until its TTL)."""
    with pytest.raises(SystemExit) as done:
        scheduler_main(["--worker-address", "127.0.0.1:1", "--worker-wait", "1",
                        "--preemption-mode", "offload"])
    assert str(done.value.code).startswith(
        "scheduler_svc: --preemption-mode offload needs --cache-address")
    check_role(parse_args(["--preemption-mode", "offload", "--cache-address", "127.0.0.1:1"]),
               security.PLAINTEXT)
    check_role(parse_args([]), security.PLAINTEXT)  # auto recomputes without a cache


@pytest.mark.parametrize(("argv", "message"), [
    # A worker that answered at once was "no worker answered within --worker-wait nan s".
    (["--worker-wait", "nan"], "--worker-wait must be a finite number of seconds > 0, got nan"),
    (["--worker-wait", "inf"], "--worker-wait must be a finite number of seconds > 0, got inf"),
    (["--worker-wait=-1"], "--worker-wait must be a finite number of seconds > 0, got -1.0"),
    # A NaN deadline never passed: a hand-off retried busy decode instances forever.
    (["--role", "prefill", "--cache-address", "127.0.0.1:1", "--decode-address",
      "127.0.0.1:2", "--handoff-wait", "nan"],
     "--handoff-wait must be a finite number of seconds >= 0, got nan"),
])
def test_a_wait_that_is_no_finite_number_of_seconds_is_refused_at_start(
    argv: list[str], message: str,
) -> None:
    with pytest.raises(SystemExit) as done:
        scheduler_main(["--worker-address", "127.0.0.1:1", *argv])
    assert done.value.code == f"scheduler_svc: {message}"


@pytest.mark.parametrize(("argv", "message"), [
    (["--metrics-port", "99999"], "argument --metrics-port: not a port (0-65535): '99999'"),
    (["--log-level", "verbose"], "argument --log-level: invalid choice: 'verbose'"),
])
def test_a_bad_flag_value_is_refused_as_it_is_parsed(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


class _Worker(worker_pb2_grpc.WorkerServicer):
    """Answers GetInfo: 32 blocks of 16 tokens."""

    async def GetInfo(self, request: object, context: object) -> worker_pb2.WorkerInfo:
        layout = Layout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=8,
                        dtype="float32")
        return worker_pb2.WorkerInfo(model_name="tiny", vocab_size=64, max_model_len=256,
                                     num_blocks=32, kv_layout=layout_to_proto(layout))


@contextlib.asynccontextmanager
async def fake_worker() -> AsyncIterator[int]:
    """A real gRPC server answering GetInfo as _Worker does; yields its port."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(_Worker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-blocks", "64"], "--num-blocks must be at most the worker's 32, got 64"),
    (["--prefix-segment-tokens", "10", "--cache-address", "127.0.0.1:1"],
     "--prefix-segment-tokens must be a multiple of the worker's block size 16, got 10"),
    # Seats whose plans a worker would refuse: every step would fail as a lost worker.
    (["--max-num-seqs", "200000", "--max-num-batched-tokens", "200000"],
     "--max-num-seqs 200000 at the longest sequence served, 256 tokens (blocks of 16), "
     "makes step plans of up to 111 MiB (each sequence's whole block table), more than "
     "the 64 MiB a worker takes: lower --max-num-seqs"),
])
async def test_a_setting_the_worker_cannot_meet_is_one_line_naming_its_flag(
    argv: list[str], message: str,
) -> None:
    async with fake_worker() as port:
        args = parse_args(["--listen", "127.0.0.1:0", "--worker-address",
                           f"127.0.0.1:{port}", *argv])
        assert await serve(args, security.from_args(args)) == message


async def test_a_record_file_that_cannot_be_written_is_one_line_naming_its_flag(
    tmp_path: Path,
) -> None:
    """It was an OSError traceback once the worker had answered."""
    async with fake_worker() as port:
        for path, reason in ((tmp_path / "no" / "r.jsonl", "No such file or directory"),
                             (tmp_path, "Is a directory")):
            args = parse_args(["--listen", "127.0.0.1:0", "--worker-address",
                               f"127.0.0.1:{port}", "--record-decisions", str(path)])
            assert await serve(args, security.from_args(args)) == (
                f"--record-decisions {path}: {reason}")


def test_step_plans_are_bounded_by_the_longest_sequence_the_pool_serves() -> None:
    """A 1M-token context on a 320k-token pool: no block table passes the
    pool, so 512 seats fit (the bound taken at max_model_len refused them)."""
    layout = Layout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=8, dtype="float32")
    info = worker_pb2.WorkerInfo(model_name="m", vocab_size=152_064, max_model_len=1_048_576,
                                 num_blocks=20_000, kv_layout=layout_to_proto(layout))
    args = parse_args(["--worker-address", "127.0.0.1:1", "--max-num-seqs", "512",
                       "--max-num-batched-tokens", "8192"])
    config = build_config(args, info, layout)
    assert config.max_servable_len == 320_000
    assert 16 * MIB < largest_plan_bytes(config) <= MAX_STEP_PLAN_BYTES


async def test_no_worker_in_time_is_one_line_naming_its_address() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    args = parse_args(["--listen", "127.0.0.1:0", "--worker-address", address,
                       "--worker-wait", "1"])
    failure = await serve(args, security.from_args(args))
    assert failure is not None
    assert failure.startswith(f"no worker answered at {address} within --worker-wait 1 s ")


def test_ctrl_c_while_waiting_for_the_worker_is_one_line_and_status_130() -> None:
    """SIGINT before the scheduler serves (here: waiting for a worker nobody
    runs) ends it with one line, no traceback, and 130, as Ctrl-C ends the
    other services' starts and the kvstash commands."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    status, stderr = interrupt_once(
        [sys.executable, "-m", "scheduler_svc", "--listen", "127.0.0.1:0", "--worker-address",
         address, "--worker-wait", "600"], Path(__file__).resolve().parents[2],
        when="waiting for the worker")
    assert "Traceback" not in stderr, stderr
    assert stderr.rstrip().splitlines()[-1] == "scheduler_svc: interrupted while starting"
    assert status == INTERRUPTED_EXIT == 130
