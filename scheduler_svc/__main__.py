"""`python -m scheduler_svc`: the scheduler as its own process.

It binds first (health NOT_SERVING), then asks the worker for its model and KV
layout (GetInfo, waiting while the worker starts or loads), sizes the block
pool from the answer, and serves kvstash.v1.Scheduler and VllmEngine on that
one port (serving.py); it prints `KVSTASH_READY scheduler host:port` once it
does. A bug that breaks its step loop ends every request and the process
(exit status 1), for its supervisor to restart it. SIGINT or SIGTERM stops
it gracefully once it serves; a SIGINT before (waiting for the worker) ends
it with one line and exit status 130."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import logging
import sys

import grpc

from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common import rpc_connections, rpc_server, security, telemetry
from kvstash.common.binding import BindError
from kvstash.common.tokenizer import load_tokenizer, tokenizer_files
from kvstash.common.wire import layout_from_proto
from kvstash.v1 import worker_pb2, worker_pb2_grpc
from scheduler_svc.backend import Backend
from scheduler_svc.cache_link import CacheLink
from scheduler_svc.core.config import (
    Role,
)
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.decode_peers import DecodePeers
from scheduler_svc.engine import Engine
from scheduler_svc.flags import (
    build_config,
    build_engine_config,
    check_flags,
    check_role,
    parse_args,
)
from scheduler_svc.kv_event_hub import KvEventHub
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.recording import RecordingScheduler
from scheduler_svc.serving import create_scheduler_server
from scheduler_svc.worker_link import WORKER_CHANNEL_OPTIONS, WorkerLink

log = logging.getLogger("scheduler_svc")

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


async def serve(args: argparse.Namespace, secured: security.Security,
                tracing: bool = False) -> str | None:
    """Serves until signalled (None), or until a bug breaks the step loop:
    then what broke it, for the process to exit with; so is why it could
    not start (no worker in time, a flag that does not fit the worker)."""
    # Whatever fails on the way up (no worker in time, a bad setting, a metrics
    # port in use) still stops and closes what was started before it.
    async with contextlib.AsyncExitStack() as cleanup:
        cleanup.enter_context(rpc_server.signals_wake_the_loop())  # Ctrl-C while it waits
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
        try:
            info = await fetch_worker_info(worker_channel, args.worker_wait)
        except grpc.aio.AioRpcError as exc:
            return _no_worker_info(args, exc)
        layout = layout_from_proto(info.kv_layout)
        try:
            config = build_config(args, info, layout)
        except ValueError as exc:  # a flag that does not fit this worker
            return str(exc)
        tokenizer = load_tokenizer(info.tokenizer_json, info.vocab_size,
                                   tuple(info.eos_token_ids))
        engine_config = build_engine_config(args, tracing)
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
        worker = WorkerLink(worker_channel, info, step_timeout_s=engine_config.step_timeout_s)
        if args.record_decisions is None:
            core = Scheduler(config)
        else:
            try:
                core = RecordingScheduler(config, args.record_decisions)
            except OSError as exc:  # no such directory, not writable, a directory
                return f"--record-decisions {args.record_decisions}: {exc.strerror or exc}"
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
            model_type=info.model_type, architectures=tuple(info.architectures),
            kv_layout=layout))
        await engine.start()
        cleanup.push_async_callback(engine.close)
        try:
            async with asyncio.timeout(args.worker_wait):
                await engine.wait_until_worker_up()  # READY means SERVING
        except TimeoutError:
            return (f"the worker at {args.worker_address} answered GetInfo, but no Execute "
                    f"stream to it opened within --worker-wait {args.worker_wait:g} s")
        if args.metrics_port:
            cleanup.callback(metrics.serve(args.metrics_port, args.metrics_host).stop)
        log.info("serving %s (%d KV blocks of %d tokens) on port %d, role %s",
                 info.model_name, config.num_blocks, config.block_size, port, args.role)
        # Everything built so far lives as long as the process: keep it out of
        # the collector's generations so full collections stay short under load.
        gc.freeze()
        rpc_server.announce_ready("scheduler", args.listen.rsplit(":", 1)[0], port)
        await rpc_server.run_until_signalled(server, until=engine.wait_failed())
        return None if engine.failure is None else f"the step loop failed: {engine.failure!r}"


def _no_worker_info(args: argparse.Namespace, exc: grpc.aio.AioRpcError) -> str:
    """Why there is no worker info, naming the worker's address."""
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return (f"no worker answered at {args.worker_address} within --worker-wait "
                f"{args.worker_wait:g} s ({exc.code().name}: {exc.details()})")
    return (f"the worker at {args.worker_address} refused GetInfo: {exc.code().name}: "
            f"{exc.details()}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__)
    rpc_server.setup_logging(args.log_level)
    try:
        # The public port takes clients without certificates (the token,
        # if any, identifies them); the worker and cache demand one of us.
        secured = security.from_args(args, require_client_cert=False)
        security.check_listen(args.listen, secured)
        check_role(args, secured)
        check_flags(args)  # not to wait for the worker only to refuse them
        build_engine_config(args)  # its checks, before any start
    except ValueError as exc:
        sys.exit(f"scheduler_svc: {exc}")
    with telemetry.tracing_for(telemetry.SCHEDULER_SERVICE) as tracing:
        try:
            failure = asyncio.run(serve(args, secured, tracing=tracing is not None))
        except BindError as exc:  # its port (or its metrics port) is taken
            failure = str(exc)
        except KeyboardInterrupt:  # Ctrl-C before it served (then it stops gracefully)
            print("scheduler_svc: interrupted while starting", file=sys.stderr)
            sys.exit(rpc_server.INTERRUPTED_EXIT)
        if failure is not None:
            sys.exit(f"scheduler_svc: {failure}")


if __name__ == "__main__":
    main()
