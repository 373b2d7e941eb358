"""`python -m gpu_worker`: load the model, serve the Worker service until a signal.

Binds first and answers health NOT_SERVING while the model loads; prints
`KVSTASH_READY worker host:port` once the model is loaded and Worker calls are
served (with --listen host:0 the port is the one actually bound).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from gpu_worker.config import DTYPES, MAX_CUDA_GRAPH_ROWS, TINY_MODEL, WorkerConfig
from kvstash.common import security, settings, telemetry
from kvstash.common.binding import BindError
from kvstash.common.malloc_tuning import tune_malloc
from kvstash.common.rpc_connections import add_connection_flags, connections_from_args
from kvstash.common.rpc_server import (
    INTERRUPTED_EXIT,
    announce_ready,
    run_until_signalled,
    setup_logging,
    signals_wake_the_loop,
)
from kvstash.common.units import parse_bytes

log = logging.getLogger("gpu_worker")
_DEFAULTS = WorkerConfig()


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, WorkerConfig]:
    p = argparse.ArgumentParser(
        prog="python -m gpu_worker", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Every flag may also be set as KVSTASH_WORKER_<FLAG> (e.g. "
               "KVSTASH_WORKER_NUM_BLOCKS=4096); the command line wins.")
    p.add_argument("--listen", default="127.0.0.1:50061",
                   help="host:port to serve on; port 0 = any")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--model", default=_DEFAULTS.model,
                   help=f"{TINY_MODEL!r} or a local directory with config.json, "
                        "*.safetensors and tokenizer.json")
    p.add_argument("--dtype", default=_DEFAULTS.dtype, choices=DTYPES,
                   help="auto = the checkpoint's own (config.json dtype / torch_dtype), "
                        "float64 for the tiny model")
    p.add_argument("--device", default=_DEFAULTS.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--block-size", type=int, default=_DEFAULTS.block_size,
                   help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=_DEFAULTS.num_blocks,
                   help="blocks in the KV-cache tensor")
    p.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len,
                   help="cap on prompt + output tokens, at most the model's own "
                        "(max_position_embeddings); unset = the model's own")
    p.add_argument("--cache-address", default=_DEFAULTS.cache_address,
                   help="KV cache service host:port; empty = offload unavailable")
    p.add_argument("--cache-timeout-s", type=float, default=_DEFAULTS.cache_timeout_s,
                   help="deadline of an offload or restore whose caller sent none")
    p.add_argument("--cache-arena", action=argparse.BooleanOptionalAction,
                   default=_DEFAULTS.cache_arena,
                   help="move KV through the cache's shared-memory arena when it can be "
                        "mapped here; --no-cache-arena always streams over gRPC")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed,
                   help="tiny-model weights and unseeded sampling")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                   default=_DEFAULTS.batch_invariant,
                   help="compute each row independently of its step (outputs identical under "
                        "preemption); --no-batch-invariant skips the row padding")
    p.add_argument("--row-tile", type=int, default=_DEFAULTS.row_tile,
                   help="run batch-invariant steps in tiles of this many rows; unset = 128 on "
                        "CUDA, whole steps on CPU (tiles of 16 where its start-up check fails)")
    p.add_argument("--cuda-graph-rows", type=int, default=_DEFAULTS.cuda_graph_rows,
                   help=f"on CUDA, batch-invariant steps of at most this many rows (up to "
                        f"{MAX_CUDA_GRAPH_ROWS}) replay CUDA graphs, captured per padded row "
                        f"count; 0 = off")
    p.add_argument("--num-threads", type=int, default=_DEFAULTS.num_threads,
                   help="torch intra-op threads; 0 = the CPUs this process may use (its "
                        "affinity mask, bounded by its cgroup's CPU quota)")
    p.add_argument("--host-pool", type=parse_bytes, default=_DEFAULTS.host_pool_bytes,
                   help="idle host buffers kept for offload/restore (pinned on CUDA)")
    p.add_argument("--metrics-port", type=int, default=_DEFAULTS.metrics_port,
                   help="Prometheus /metrics port; 0 = off")
    p.add_argument("--metrics-host", default=_DEFAULTS.metrics_host,
                   help="address /metrics listens on; 0.0.0.0 = every interface")
    security.add_flags(p)
    add_connection_flags(p)
    args = settings.parse_args(p, "worker", argv)
    try:
        config = WorkerConfig(
            model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
            num_blocks=args.num_blocks, max_model_len=args.max_model_len,
            cache_address=args.cache_address, cache_timeout_s=args.cache_timeout_s,
            cache_arena=args.cache_arena,
            seed=args.seed, batch_invariant=args.batch_invariant, row_tile=args.row_tile,
            cuda_graph_rows=args.cuda_graph_rows,
            host_pool_bytes=args.host_pool, num_threads=args.num_threads,
            metrics_port=args.metrics_port, metrics_host=args.metrics_host,
            security=security.from_args(args, require_client_cert=True),
            connections=connections_from_args(args),
        )
        security.check_listen(args.listen, config.security)
    except ValueError as exc:
        p.error(str(exc))
    return args, config


async def serve(listen: str, config: WorkerConfig) -> None:
    # Deferred: torch is slow to import, and --help should not pay for it.
    from gpu_worker.server import create_worker_server

    with signals_wake_the_loop():  # a Ctrl-C while the model loads ends it at once
        worker = await create_worker_server(config, listen)
        host = listen.rsplit(":", 1)[0]
        log.info("worker listening on %s:%d (NOT_SERVING), loading %s", host, worker.port,
                 config.model)
        if worker.metrics_server is not None:
            log.info("metrics on http://%s:%d/metrics", config.metrics_host,
                     worker.metrics_server.port)
        try:
            await worker.loaded
        except BaseException:
            await worker.server.stop(None)
            await worker.close()
            raise
    announce_ready("worker", host, worker.port)
    await run_until_signalled(worker.server, on_stop=worker.close)


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    setup_logging(args.log_level)
    tune_malloc()  # the worker streams snapshots to and from the cache service
    with telemetry.tracing_for(telemetry.WORKER_SERVICE):
        try:
            asyncio.run(serve(args.listen, config))
        except ValueError as exc:  # a checkpoint that does not match its config, ...
            log.error("%s", exc)
            return 2
        except BindError as exc:  # its port (or its metrics port) is taken
            print(f"gpu_worker: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C before it served (then it stops gracefully)
            print("gpu_worker: interrupted while starting", file=sys.stderr, flush=True)
            # Not a plain exit: that would wait for a model still loading on the
            # compute thread (minutes, for a large checkpoint).
            os._exit(INTERRUPTED_EXIT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
