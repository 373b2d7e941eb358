"""`python -m scheduler_svc`: the scheduler as its own process.

It binds first (health NOT_SERVING), then asks the worker for its model and KV
layout (GetInfo, waiting while the worker starts or loads), sizes the block
pool from the answer, and serves kvstash.v1.Scheduler and VllmEngine on that
one port (serving.py); it prints `KVSTASH_READY scheduler host:port` once it
does."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import logging
import sys
from pathlib import Path

import grpc

from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common import rpc_connections, rpc_server, security, settings, telemetry
from kvstash.common.binding import BindError
from kvstash.common.layout import Layout
from kvstash.common.metrics import DEFAULT_METRICS_HOST, listen_host
from kvstash.common.tokenizer import load_tokenizer, tokenizer_files
from kvstash.common.wire import layout_from_proto
from kvstash.v1 import worker_pb2, worker_pb2_grpc
from scheduler_svc.backend import Backend
from scheduler_svc.cache_link import CacheLink
from scheduler_svc.core.config import (
    PreemptionMode,
    PrefixWrite,
    ReservationPolicy,
    Role,
    SchedulerConfig,
)
from scheduler_svc.core.pd import HANDOFF_WAIT_S
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.decode_peers import DecodePeers
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.kv_event_hub import KvEventHub
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.recording import RecordingScheduler
from scheduler_svc.serving import create_scheduler_server
from scheduler_svc.worker_link import WORKER_CHANNEL_OPTIONS, WorkerLink

log = logging.getLogger("scheduler_svc")

# Defaults come from the config dataclasses, never restated here.
_CORE = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)
         if f.default is not dataclasses.MISSING}
_ENGINE = EngineConfig()


# 256 tokens, as LMCache's chunks: one read per segment, and a hit needs a
# whole segment in common.
DEFAULT_SEGMENT_TOKENS = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scheduler_svc", description=__doc__,
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
    p.add_argument("--check-integrity", action="store_true",
                   help="check the scheduler's invariants whenever it goes idle; exit with "
                        "code 70 on a broken one (for tests: O(pool + requests) each time)")
    p.add_argument("--record-decisions", type=Path, default=None,
                   help="write every call into the scheduler core, with its clock, to this "
                        "JSONL file, for `kvstash sim --replay`")
    p.add_argument("--worker-wait", type=float, default=120.0,
                   help="seconds to wait for the worker at start")
    p.add_argument("--worker-reconnect", type=float, default=_ENGINE.worker_reconnect_s,
                   help="seconds requests that need nothing from a lost worker (waiting, or "
                        "offloaded to the cache) wait for it to come back before they fail "
                        "UNAVAILABLE; 0 = fail them with it")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port; 0 = off")
    p.add_argument("--metrics-host", type=listen_host, default=DEFAULT_METRICS_HOST,
                   help="address /metrics listens on; 0.0.0.0 = every interface")
    p.add_argument("--log-level", default="info")
    # --token-file: what a prefill instance sends its decode instances.
    security.add_flags(p, accepts_tokens=True, sends_token=True)
    rpc_connections.add_connection_flags(p)
    return settings.parse_args(p, "scheduler", argv)


async def fetch_worker_info(channel: grpc.aio.Channel, wait_s: float) -> worker_pb2.WorkerInfo:
    """The worker's info, waiting up to `wait_s` for it to start (until then
    its address refuses connections: UNAVAILABLE) and load its model (its
    GetInfo answers once the model is loaded)."""
    stub = worker_pb2_grpc.WorkerStub(channel)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            return await stub.GetInfo(worker_pb2.GetInfoRequest(), wait_for_ready=True,
                                      timeout=max(deadline - loop.time(), 0.0))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or loop.time() + 1 > deadline:
                raise
        await asyncio.sleep(1)


def build_config(
    args: argparse.Namespace, info: worker_pb2.WorkerInfo, layout: Layout
) -> SchedulerConfig:
    """The core's config: the flags, and the worker's model and KV `layout`."""
    if args.num_blocks < 0 or args.num_blocks > info.num_blocks:
        raise ValueError(f"--num-blocks must be in 0..{info.num_blocks} (the worker's), "
                         f"got {args.num_blocks}")
    segment_blocks, salt = prefix_tier(args, info, layout)
    return SchedulerConfig(
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


def prefix_tier(
    args: argparse.Namespace, info: worker_pb2.WorkerInfo, layout: Layout
) -> tuple[int, str]:
    """Blocks per prefix-tier segment (--prefix-segment-tokens; 0: no tier,
    as without a cache) and the salt of its ids: all that decides a block's
    bytes."""
    tokens = args.prefix_segment_tokens
    if tokens < 0 or tokens % layout.block_size:
        raise ValueError(f"--prefix-segment-tokens must be 0 or a multiple of the block size "
                         f"{layout.block_size}, got {tokens}")
    if not tokens or not args.cache_address or args.record_decisions is not None:
        return 0, ""
    salt = "|".join((info.model_name, info.model_type, *info.architectures, layout.dtype,
                     str(layout.num_layers), str(layout.block_size), str(layout.num_kv_heads),
                     str(layout.head_dim)))
    return tokens // layout.block_size, salt


async def serve(args: argparse.Namespace, secured: security.Security,
                tracing: bool = False) -> None:
    # Whatever fails on the way up (no worker in time, a bad setting, a metrics
    # port in use) still stops and closes what was started before it.
    async with contextlib.AsyncExitStack() as cleanup:
        scheduler = await create_scheduler_server(args.listen, secured,
                                                  rpc_connections.connections_from_args(args))
        server, port = scheduler.server, scheduler.port
        cleanup.push_async_callback(server.stop, None)
        # The token is for decode instances only: the worker and cache ask none.
        internal = dataclasses.replace(secured, token=None)
        worker_channel = rpc_connections.channel(args.worker_address, internal,
                                                 WORKER_CHANNEL_OPTIONS)
        cleanup.push_async_callback(worker_channel.close)
        log.info("listening on port %d (NOT_SERVING); waiting for the worker at %s",
                 port, args.worker_address)
        info = await fetch_worker_info(worker_channel, args.worker_wait)
        layout = layout_from_proto(info.kv_layout)
        config = build_config(args, info, layout)
        tokenizer = load_tokenizer(info.tokenizer_json, info.vocab_size,
                                   tuple(info.eos_token_ids))
        engine_config = EngineConfig(transfer_timeout_s=args.transfer_timeout, tracing=tracing,
                                     check_integrity=args.check_integrity,
                                     worker_reconnect_s=args.worker_reconnect)
        cache: CacheLink | None = None
        if args.cache_address:
            client = CacheClient(args.cache_address, security=internal)
            cleanup.push_async_callback(client.close)
            cache = CacheLink(client)
        peers: DecodePeers | None = None
        if config.role is Role.PREFILL:
            peers = DecodePeers(args.decode_address.split(","), layout, secured,
                                wait_s=args.handoff_wait)
            cleanup.push_async_callback(peers.close)
        worker = WorkerLink(worker_channel, info)
        if args.record_decisions is None:
            core = Scheduler(config)
        else:
            core = RecordingScheduler(config, args.record_decisions)
            cleanup.callback(core.close)
        metrics = SchedulerMetrics(core, asyncio.get_running_loop())
        kv_events = KvEventHub(config.block_size)
        engine = Engine(core, worker, cache, engine_config, metrics=metrics,
                        on_worker_change=scheduler.set_serving,
                        decode_peers=peers, kv_events=kv_events.publish)
        scheduler.attach(Backend(
            engine, tokenizer, metrics, info.model_name,
            tokenizer_files(info.tokenizer_json.decode(), info.tokenizer_config_json.decode(),
                            info.eos_token_ids), kv_events,
            model_type=info.model_type, architectures=tuple(info.architectures)))
        await engine.start()
        cleanup.push_async_callback(engine.close)
        async with asyncio.timeout(args.worker_wait):
            await engine.wait_until_worker_up()  # READY means SERVING
        if args.metrics_port:
            cleanup.callback(metrics.serve(args.metrics_port, args.metrics_host).stop)
        log.info("serving %s (%d KV blocks of %d tokens) on port %d, role %s",
                 info.model_name, config.num_blocks, config.block_size, port, args.role)
        # Everything built so far lives as long as the process: keep it out of
        # the collector's generations so full collections stay short under load.
        gc.freeze()
        rpc_server.announce_ready("scheduler", args.listen.rsplit(":", 1)[0], port)
        await rpc_server.run_until_signalled(server)


def check_role(args: argparse.Namespace) -> None:
    """P/D flags that contradict each other fail at start, not at the first request."""
    addresses = [a for a in args.decode_address.split(",") if a]
    if args.role == "prefill":
        if not addresses:
            raise ValueError("--role prefill needs --decode-address")
        for address in addresses:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--decode-address {address!r} is not host:port")
        if args.handoff_wait < 0:
            raise ValueError(f"--handoff-wait must be >= 0, got {args.handoff_wait}")
    elif addresses:
        raise ValueError(f"--decode-address is for --role prefill, not {args.role}")
    if args.role != "mixed" and not args.cache_address:
        raise ValueError(f"--role {args.role} needs --cache-address: the KV handoff goes "
                         "through the cache service")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rpc_server.setup_logging(args.log_level)
    try:
        # The public port takes clients without certificates (the token,
        # if any, identifies them); the worker and cache demand one of us.
        secured = security.from_args(args, require_client_cert=False)
        security.check_listen(args.listen, secured)
        check_role(args)
        EngineConfig(worker_reconnect_s=args.worker_reconnect)  # its checks, before any start
    except ValueError as exc:
        sys.exit(f"scheduler_svc: {exc}")
    with telemetry.tracing_for(telemetry.SCHEDULER_SERVICE) as tracing:
        try:
            asyncio.run(serve(args, secured, tracing=tracing is not None))
        except BindError as exc:  # its port (or its metrics port) is taken
            sys.exit(f"scheduler_svc: {exc}")


if __name__ == "__main__":
    main()
