"""The scheduler's command line: its flags (each also a KVSTASH_SCHEDULER_*
variable), the checks that need no peer (`check_role`, `check_flags`), the
core's config built from them and the worker's model and KV layout
(`build_config`; a bad setting's ValueError names its flag), and the
engine's (`build_engine_config`)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from pathlib import Path

from kvstash.common import flag_types, rpc_connections, rpc_server, security, settings
from kvstash.common.binding import MAX_PORT, port_past_range
from kvstash.common.layout import Layout
from kvstash.common.metrics import DEFAULT_METRICS_HOST, listen_host
from kvstash.common.rpc_connections import MAX_STEP_PLAN_BYTES
from kvstash.common.units import MIB
from kvstash.v1 import worker_pb2
from scheduler_svc.core.config import (
    PreemptionMode,
    PrefixWrite,
    ReservationPolicy,
    Role,
    SchedulerConfig,
)
from scheduler_svc.core.pd import HANDOFF_WAIT_S
from scheduler_svc.engine import EngineConfig
from scheduler_svc.worker_link import largest_plan_bytes

# Defaults come from the config dataclasses, never restated here.
_CORE = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)
         if f.default is not dataclasses.MISSING}
_ENGINE = EngineConfig()


# 256 tokens, as LMCache's chunks: one read per segment, and a hit needs a
# whole segment in common.
DEFAULT_SEGMENT_TOKENS = 256


def parse_args(argv: list[str] | None = None,
               description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scheduler_svc", description=description,
        epilog="Every flag may also be set as KVSTASH_SCHEDULER_<FLAG> (e.g. "
               "KVSTASH_SCHEDULER_MAX_NUM_SEQS=128); the command line wins.")
    p.add_argument("--listen", default="127.0.0.1:50051", help="host:port; port 0 = any free")
    p.add_argument("--worker-address", default="127.0.0.1:50061")
    p.add_argument("--cache-address", default="", help="KV cache service; empty = no offload")
    p.add_argument("--role", choices=[r.value for r in Role], default=Role.MIXED.value,
                   help="P/D disaggregation: a prefill instance hands each prefilled request "
                        "to a decode instance (both need the same --cache-address)")
    p.add_argument("--decode-address", default="",
                   help="prefill role: decode instances, comma-separated host:port; a name "
                        "that resolves to several addresses counts as each")
    p.add_argument("--handoff-wait", type=float, default=HANDOFF_WAIT_S,
                   help="prefill role: seconds to retry decode instances that refuse before "
                        "decoding the request here")
    p.add_argument("--reservation-timeout", type=float,
                   default=_CORE["reservation_timeout_s"],
                   help="decode role: seconds a block reservation waits for its KV")
    p.add_argument("--num-blocks", type=int, default=0,
                   help="use at most this many of the worker's KV blocks (0 = all)")
    p.add_argument("--max-num-seqs", type=int, default=_CORE["max_num_seqs"])
    p.add_argument("--max-num-waiting", type=int, default=_CORE["max_num_waiting"],
                   help="requests queued for admission at most; beyond, RESOURCE_EXHAUSTED")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=_CORE["max_num_batched_tokens"])
    p.add_argument("--preemption-mode", choices=[m.value for m in PreemptionMode],
                   default=_CORE["preemption_mode"].value)
    p.add_argument("--min-cost-samples", type=int, default=_CORE["min_cost_samples"],
                   help="offloads, restores and prefill steps timed before auto preemption "
                        "weighs offload against recompute (until then it offloads)")
    p.add_argument("--reservation", choices=[r.value for r in ReservationPolicy],
                   default=_CORE["reservation_policy"].value)
    p.add_argument("--fixed-blocks-per-decode", type=int,
                   default=_CORE["fixed_blocks_per_decode"])
    p.add_argument("--init-new-token-ratio", type=float, default=_CORE["init_new_token_ratio"])
    p.add_argument("--min-new-token-ratio-factor", type=float,
                   default=_CORE["min_new_token_ratio_factor"],
                   help="the ratio decays to this times its initial value")
    p.add_argument("--new-token-ratio-decay-steps", type=int,
                   default=_CORE["new_token_ratio_decay_steps"])
    p.add_argument("--clip-max-new-tokens", type=int, default=_CORE["clip_max_new_tokens"],
                   help="reserve for at most this many remaining tokens per request")
    p.add_argument("--retract-steps", type=int, default=_CORE["retract_steps"],
                   help="steps of progress credited per decode request after a preemption")
    p.add_argument("--resume-headroom", type=int, default=_CORE["resume_headroom"],
                   help="free blocks per running decode request kept before a resume")
    p.add_argument("--prefix-segment-tokens", type=int, default=DEFAULT_SEGMENT_TOKENS,
                   help="the prefix tier: prompts' KV kept in the cache service in segments "
                        "of this many tokens (a multiple of the block size), read by every "
                        "instance sharing it; 0 = off. Needs --cache-address; off while "
                        "--record-decisions is set (replay does not model it yet)")
    p.add_argument("--prefix-write", choices=[w.value for w in PrefixWrite],
                   default=_CORE["prefix_write"].value,
                   help="when the prefix tier stores a prompt's segments: once it is prefilled "
                        "(through: other instances can read it at once), or when this pool is "
                        "about to evict them (back: fewer copies, later reuse elsewhere)")
    p.add_argument("--transfer-timeout", type=float, default=_ENGINE.transfer_timeout_s,
                   help="seconds one offload or restore may take, end to end")
    p.add_argument("--prefix-copy-timeout", type=float, default=_ENGINE.prefix_copy_timeout_s,
                   help="seconds one prefix-tier save, or a load's reads, may take (a load "
                        "also as long as the prefill it saves is predicted to); the request "
                        "prefills what did not load")
    p.add_argument("--check-integrity", action="store_true",
                   help="check the scheduler's invariants whenever it goes idle; exit with "
                        "code 70 on a broken one (for tests: O(pool + requests) each time)")
    p.add_argument("--record-decisions", type=Path, default=None,
                   help="write every call into the scheduler core, with its clock, to this "
                        "JSONL file (created 0600: it holds prompts and outputs), for "
                        "`kvstash sim --replay`")
    p.add_argument("--worker-wait", type=float, default=120.0,
                   help="seconds to wait for the worker at start")
    p.add_argument("--step-timeout", type=float, default=_ENGINE.step_timeout_s,
                   help="seconds one step (or opening a stream) may take before the worker "
                        "counts as lost: a hung device or compute thread whose gRPC server "
                        "still answers")
    p.add_argument("--worker-reconnect", type=float, default=_ENGINE.worker_reconnect_s,
                   help="seconds requests that need nothing from a lost worker (waiting, or "
                        "offloaded to the cache) wait for it to come back before they fail "
                        "UNAVAILABLE; 0 = fail them with it")
    p.add_argument("--metrics-port", type=flag_types.port, default=0,
                   help="Prometheus port; 0 = off")
    p.add_argument("--metrics-host", type=listen_host, default=DEFAULT_METRICS_HOST,
                   help="address /metrics listens on; 0.0.0.0 = every interface")
    p.add_argument("--log-level", default="info", choices=rpc_server.LOG_LEVELS)
    # --token-file: what a prefill instance sends its decode instances.
    security.add_flags(p, accepts_tokens=True, sends_token=True)
    rpc_connections.add_connection_flags(p)
    return settings.parse_args(p, "scheduler", argv)


def check_flags(args: argparse.Namespace) -> None:
    """What build_config checks of the flags alone, before the worker
    answers: build_config with a stand-in worker that any flag fits (blocks
    of one token, as many as --num-blocks asks)."""
    info = worker_pb2.WorkerInfo(num_blocks=max(args.num_blocks, 1), max_model_len=1,
                                 vocab_size=1)
    build_config(args, info, Layout(num_layers=1, block_size=1, num_kv_heads=1, head_dim=1,
                                    dtype="float32"))


# The flag of each SchedulerConfig field set from one, for its errors.
_FLAG_OF = {"reservation_policy": "--reservation",
            "reservation_timeout_s": "--reservation-timeout",
            **{name: "--" + name.replace("_", "-") for name in (
                "max_num_seqs", "max_num_waiting", "max_num_batched_tokens", "preemption_mode",
                "min_cost_samples", "fixed_blocks_per_decode", "init_new_token_ratio",
                "min_new_token_ratio_factor", "new_token_ratio_decay_steps",
                "clip_max_new_tokens", "retract_steps", "resume_headroom", "role",
                "prefix_write")}}
_FIELD = re.compile(r"\b(?:" + "|".join(_FLAG_OF) + r")\b")


def build_config(
    args: argparse.Namespace, info: worker_pb2.WorkerInfo, layout: Layout
) -> SchedulerConfig:
    """The core's config: the flags, and the worker's model and KV `layout`."""
    if not 0 < args.worker_wait < math.inf:  # else GetInfo's deadline had passed at once
        raise ValueError(f"--worker-wait must be a finite number of seconds > 0, "
                         f"got {args.worker_wait}")
    if args.num_blocks < 0:
        raise ValueError(f"--num-blocks must be >= 0 (0: all the worker's), "
                         f"got {args.num_blocks}")
    if args.num_blocks > info.num_blocks:
        raise ValueError(f"--num-blocks must be at most the worker's {info.num_blocks}, "
                         f"got {args.num_blocks}")
    segment_blocks, salt = prefix_tier(args, info, layout)
    try:
        config = SchedulerConfig(
            num_blocks=args.num_blocks or info.num_blocks,
            block_size=layout.block_size,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=tuple(info.eos_token_ids),
            max_num_seqs=args.max_num_seqs,
            max_num_waiting=args.max_num_waiting,
            max_num_batched_tokens=args.max_num_batched_tokens,
            preemption_mode=PreemptionMode(args.preemption_mode),
            min_cost_samples=args.min_cost_samples,
            reservation_policy=ReservationPolicy(args.reservation),
            fixed_blocks_per_decode=args.fixed_blocks_per_decode,
            init_new_token_ratio=args.init_new_token_ratio,
            min_new_token_ratio_factor=args.min_new_token_ratio_factor,
            new_token_ratio_decay_steps=args.new_token_ratio_decay_steps,
            clip_max_new_tokens=args.clip_max_new_tokens,
            retract_steps=args.retract_steps,
            resume_headroom=args.resume_headroom,
            role=Role(args.role),
            reservation_timeout_s=args.reservation_timeout,
            bytes_per_block=layout.bytes_per_block,
            prefix_segment_blocks=segment_blocks,
            prefix_tier_salt=salt,
            prefix_write=PrefixWrite(args.prefix_write),
        )
    except ValueError as exc:  # SchedulerConfig names its fields: say which flag
        raise ValueError(_FIELD.sub(lambda found: _FLAG_OF[found[0]], str(exc))) from None
    if (plan := largest_plan_bytes(config)) > MAX_STEP_PLAN_BYTES:
        raise ValueError(
            f"--max-num-seqs {config.max_num_seqs} at the longest sequence served, "
            f"{config.max_servable_len} tokens (blocks of {config.block_size}), makes step "
            f"plans of up to {plan / MIB:.0f} MiB (each sequence's whole block table), more "
            f"than the {MAX_STEP_PLAN_BYTES // MIB} MiB a worker takes: lower --max-num-seqs")
    return config


def build_engine_config(args: argparse.Namespace, tracing: bool = False) -> EngineConfig:
    return EngineConfig(transfer_timeout_s=args.transfer_timeout,
                        prefix_copy_timeout_s=args.prefix_copy_timeout, tracing=tracing,
                        check_integrity=args.check_integrity,
                        worker_reconnect_s=args.worker_reconnect,
                        step_timeout_s=args.step_timeout)


def prefix_tier(
    args: argparse.Namespace, info: worker_pb2.WorkerInfo, layout: Layout
) -> tuple[int, str]:
    """Blocks per prefix-tier segment (--prefix-segment-tokens; 0: no tier,
    as without a cache) and the salt of its ids: all that decides a block's
    bytes (the worker's numerics too: a GPU of another kind, or a step that
    is not batch-invariant, writes other bits for the same tokens)."""
    tokens = args.prefix_segment_tokens
    if tokens < 0:
        raise ValueError(f"--prefix-segment-tokens must be >= 0 (0: off), got {tokens}")
    if tokens % layout.block_size:
        raise ValueError(f"--prefix-segment-tokens must be a multiple of the worker's block "
                         f"size {layout.block_size}, got {tokens}")
    if not tokens or not args.cache_address or args.record_decisions is not None:
        return 0, ""
    salt = "|".join((info.model_name, info.weights_id, info.model_type, *info.architectures,
                     layout.dtype, str(layout.num_layers), str(layout.block_size),
                     str(layout.num_kv_heads), str(layout.head_dim), info.numerics))
    return tokens // layout.block_size, salt


def check_role(args: argparse.Namespace, secured: security.Security) -> None:
    """P/D or offload flags that contradict each other, a token for decode instances
    that would go in plaintext (security.check_send), or a peer's port that
    gRPC would wrap around, fail at start, not at the first request."""
    _check_port("--worker-address", args.worker_address)
    _check_port("--cache-address", args.cache_address)
    addresses = [a for a in args.decode_address.split(",") if a]
    if args.role == "prefill":
        if not addresses:
            raise ValueError("--role prefill needs --decode-address")
        for address in addresses:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--decode-address {address!r} is not host:port")
            _check_port("--decode-address", address)
            security.check_send(address, secured)
        if not 0 <= args.handoff_wait < math.inf:  # a NaN retried refusing peers forever
            raise ValueError(f"--handoff-wait must be a finite number of seconds >= 0, "
                             f"got {args.handoff_wait}")
    elif addresses:
        raise ValueError(f"--decode-address is for --role prefill, not {args.role}")
    if args.role != "mixed" and not args.cache_address:
        raise ValueError(f"--role {args.role} needs --cache-address: the KV handoff goes "
                         "through the cache service")
    if args.preemption_mode == PreemptionMode.OFFLOAD.value and not args.cache_address:
        raise ValueError("--preemption-mode offload needs --cache-address: without one there "
                         "is no offload (auto and recompute recompute), and no snapshot "
                         "would ever be deleted")


def _check_port(flag: str, address: str) -> None:
    if port_past_range(address):
        raise ValueError(f"{flag} {address!r}: port {address.rpartition(':')[2]} "
                         f"is past {MAX_PORT}")
