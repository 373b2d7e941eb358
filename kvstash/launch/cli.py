"""The `kvstash` command: up, generate, stats, demo, tokenizer export, sim, calibrate.

Why one file over 300 lines: the subcommands share one parser, its flag
types and one way of turning errors and signals into exit codes; what each
runs lives elsewhere (stack.py, demo.py, tokenizer_export.py, kvstash.sim).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from pathlib import Path

from kvstash import errors
from kvstash.client import Client
from kvstash.common import flag_types, security
from kvstash.common.binding import split_address
from kvstash.launch import tokenizer_export
from kvstash.launch.gateway import POLICIES
from kvstash.launch.stack import Stack, StackConfig, start_stack, worker_threads
from kvstash.launch.terminal import print_delta, reader_gone

DEFAULT_ADDRESS = "127.0.0.1:50051"
SIM_COMMANDS = {"sim": "simulate instances serving a trace, in virtual time (kvstash.sim)",
                "calibrate": "measure a cost profile for kvstash sim on this machine"}


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default to its help, except where there is none
    worth showing (None: the help says what happens; a switch: off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def _add_stack_flags(p: argparse.ArgumentParser, defaults: StackConfig) -> None:
    p.add_argument("--model", default=defaults.model, help="'tiny' or a checkpoint directory")
    p.add_argument("--dtype", default=defaults.dtype,
                   help="auto: a checkpoint's own dtype, float64 for the tiny model")
    p.add_argument("--device", default=defaults.device,
                   help="auto: cuda where there is one, else cpu")
    p.add_argument("--num-blocks", type=int, default=defaults.num_blocks,
                   help="KV-cache blocks on each worker")
    p.add_argument("--block-size", type=int, default=defaults.block_size,
                   help="tokens per KV-cache block")
    p.add_argument("--preemption-mode", default=defaults.preemption_mode,
                   choices=["auto", "offload", "recompute"],
                   help="what a preempted request's KV becomes: auto weighs offload "
                        "against recompute by their measured costs")
    p.add_argument("--cache-memory-budget", type=flag_types.byte_size_text,
                   default=defaults.cache_memory_budget, help="the cache service's memory tier")
    p.add_argument("--cache-disk-budget", type=flag_types.byte_size_text,
                   default=defaults.cache_disk_budget,
                   help="the cache service's disk tier (0: none)")
    p.add_argument("--cache-disk-dir", default=None,
                   help="the disk tier's directory (default: a temporary one, removed at stop)")
    p.add_argument("--pd", action="store_true",
                   help="P/D disaggregation: a prefill and a decode instance (each a scheduler "
                        "and its worker) sharing the cache; clients call the prefill instance")
    p.add_argument("--instances", type=int, default=defaults.instances,
                   help="instances clients call (each a scheduler and its worker; prefill "
                        "instances with --pd), sharing the cache")
    p.add_argument("--gateway", action="store_true",
                   help="smg (the Shepherd Model Gateway, pip install 'kvstash[gateway]') in "
                        "front of the instances: OpenAI HTTP, cache-aware routing")
    p.add_argument("--gateway-policy", default=defaults.gateway_policy, choices=POLICIES,
                   help="smg's routing policy")
    p.add_argument("--worker-threads", type=int, default=defaults.worker_threads,
                   help="torch threads of each worker; default: the CPUs this process may "
                        "use (affinity mask, cgroup CPU quota), less one for the schedulers "
                        "and cache, shared among the workers")
    p.add_argument("--start-timeout", type=flag_types.positive_duration,
                   default=defaults.start_timeout_s, metavar="SECONDS",
                   help="how long each service (and smg) may take to be ready, e.g. 600 or "
                        "10m for a worker loading a large checkpoint")


def _stack_config(args: argparse.Namespace, **extra: object) -> StackConfig:
    return StackConfig(
        model=args.model, dtype=args.dtype, device=args.device, num_blocks=args.num_blocks,
        block_size=args.block_size, preemption_mode=args.preemption_mode,
        cache_memory_budget=args.cache_memory_budget, cache_disk_budget=args.cache_disk_budget,
        cache_disk_dir=args.cache_disk_dir, pd=args.pd, instances=args.instances,
        gateway=args.gateway, gateway_policy=args.gateway_policy,
        worker_threads=args.worker_threads, start_timeout_s=args.start_timeout,
        **extra,  # type: ignore[arg-type]
    )


class _Stop(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived: stop everything."""


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def _stop_on_signals() -> None:
    """Ctrl-C, a service manager's SIGTERM, a closed terminal's SIGHUP: each
    must stop the services too, not orphan them. SIGINT explicitly: a shell
    script that starts us in the background (`kvstash up &`) hands it down
    ignored, and Python then leaves it ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stop)


def cmd_up(args: argparse.Namespace) -> int:
    host, port = split_address(args.listen)  # "::1", not "[::1]"
    config = _stack_config(args, host=host, scheduler_port=port, plaintext=args.plaintext,
                           gateway_port=args.gateway_port, metrics=args.metrics)
    _stop_on_signals()
    # Kept after stop: the user reads them when something went wrong.
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvstash-logs-"))
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file there, no permission
        raise OSError(f"--log-dir {log_dir}: {exc.strerror}") from None
    try:
        stack = start_stack(config, log_dir)
    except _Stop as exc:  # start_stack stopped what had started
        _say(f"stopped while starting ({exc}); logs kept in {log_dir}")
        return 0
    except BaseException:
        if args.log_dir is None:  # ours, and empty when nothing started (a port in use)
            with contextlib.suppress(OSError):
                log_dir.rmdir()
        raise
    try:
        _print_stack(stack, args.listen, worker_threads(config))
        failed = stack.wait_for_exit()
    except _Stop as exc:
        _stop_undisturbed(stack, f"\nstopping ({exc})")
        _say(f"stopped; logs kept in {log_dir}")
        return 0
    except BaseException:
        _stop_undisturbed(stack)
        raise
    _stop_undisturbed(stack, f"{failed.name} exited with code {failed.process.returncode}; "
                             f"stopping the others. Its log: {failed.log_path}")
    _say(f"stopped; logs kept in {log_dir}")
    return 1


def _print_stack(stack: Stack, listen: str, threads: tuple[int, str]) -> None:
    """Each service's address and pid, the URLs, the workers' torch threads
    (how many, and why), where the logs go."""
    for service in stack.services:
        print(f"{service.name:<20} {service.address:<22} pid {service.process.pid}")
    if stack.gateway is not None:
        gateway = stack.gateway
        print(f"{gateway.name:<20} {gateway.address:<22} pid {gateway.process.pid}\n"
              f"OpenAI HTTP (smg) at {gateway.url}/v1, e.g. {gateway.url}/v1/models\n"
              f"Prometheus (smg) at {gateway.metrics_url}")
    urls = [f"Prometheus ({s.name}) at {s.metrics_url}" for s in stack.services if s.metrics_url]
    print("\n".join(urls) or "Prometheus (scheduler, worker, cache): off; kvstash up "
          "--metrics serves each one's /metrics (README: Observability)")
    reach = ("loopback only" if security.is_loopback(listen)
             else "anyone who can reach this host")
    print(f"plaintext gRPC, {reach} (TLS: start the services with --tls-*)")
    print(f"torch threads per worker: {threads[0]} ({threads[1]})")
    print(f"logs in {stack.log_dir}; Ctrl-C stops everything", flush=True)


def _stop_undisturbed(stack: Stack, why: str = "") -> None:
    """Says `why`, then stops the stack with further stop signals ignored: a
    second SIGTERM (or Ctrl-C) must not cut the stopping short and orphan a
    service."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if why:
        _say(why)
    stack.stop()


def _say(line: str) -> None:
    """A line on stderr, if anyone still reads it: a closed terminal (SIGHUP)
    or a parent gone fails the write, and stopping must go on regardless."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


async def _generate(args: argparse.Namespace) -> int:
    async with Client(args.address, security.from_args(args)) as client:
        async for delta in client.generate(
            args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        ):
            print_delta(delta)
    return 0


async def _stats(args: argparse.Namespace) -> int:
    async with Client(args.address, security.from_args(args)) as client:
        print(await client.stats(), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SIM_COMMANDS:
        # The simulator runs the scheduler's own code; the launcher imports none.
        # Exec'd, not a child: a SIGTERM must reach what stops calibrate's
        # services (a child outlived it, running on), and Ctrl-C must not
        # SIGKILL it 0.25 s later (subprocess.run's way), mid-cleanup.
        os.execv(sys.executable, [sys.executable, "-m", "kvstash.sim", *argv])
    parser = argparse.ArgumentParser(prog="kvstash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = StackConfig()

    up = sub.add_parser("up", help="start cache, worker and scheduler on this machine",
                        formatter_class=_ShowDefaults)
    up.add_argument("--listen", type=flag_types.host_port, default=DEFAULT_ADDRESS,
                    help="the scheduler's address; the others listen on its host")
    up.add_argument("--plaintext", action="store_true",
                    help="allow a non-loopback --listen: every service then serves plaintext "
                         "gRPC to anyone who can reach that host")
    up.add_argument("--gateway-port", type=flag_types.port, default=8000,
                    help="with --gateway: smg's HTTP port, on --listen's host (0: a free one)")
    up.add_argument("--metrics", action="store_true", help="every service serves Prometheus "
                    "/metrics on a free port of --listen's host (printed at start)")
    up.add_argument("--log-dir", default=None,
                    help="where each service writes its log, kept after stop (default: a new "
                         "temporary directory, printed at start and at stop)")
    _add_stack_flags(up, defaults)

    gen = sub.add_parser("generate", help="stream a completion", formatter_class=_ShowDefaults)
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--address", type=flag_types.target, default=DEFAULT_ADDRESS,
                     help="a scheduler (kvstash up's --listen)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="sample from the smallest set of tokens this likely (1: all)")
    gen.add_argument("--top-k", type=int, default=0,
                     help="sample from the k likeliest tokens (0: all)")
    gen.add_argument("--seed", type=int, default=None,
                     help="makes sampling repeatable (default: none)")
    security.add_flags(gen, server=False, sends_token=True)

    stats = sub.add_parser("stats", help="print the scheduler's stats",
                           formatter_class=_ShowDefaults)
    stats.add_argument("--address", type=flag_types.target, default=DEFAULT_ADDRESS,
                       help="a scheduler (kvstash up's --listen)")
    security.add_flags(stats, server=False, sends_token=True)

    tokenizer_export.add_parser(sub)
    for name, text in SIM_COMMANDS.items():  # listed here, parsed by kvstash.sim
        sub.add_parser(name, help=text, add_help=False)

    demo = sub.add_parser("demo", help="start a stack, run a pressured workload, summarize",
                          formatter_class=_ShowDefaults)
    demo.add_argument("--requests", type=flag_types.positive_int, default=32,
                      help="requests sent at once")
    demo.add_argument("--max-tokens", type=flag_types.positive_int, default=96,
                      help="tokens each generates")
    _add_stack_flags(demo, StackConfig(num_blocks=96))

    args = parser.parse_args(argv)
    if args.command == "up" and not args.plaintext and not security.is_loopback(args.listen):
        # Refused here, before anything starts, in words for this command
        # (the cache service would refuse it too, pointing at --tls-* flags
        # kvstash up does not have).
        up.error(f"argument --listen: {args.listen} is not a loopback address and kvstash up "
                 "serves plaintext gRPC: add --plaintext to let anyone who reaches it call "
                 "every service")
    if (args.command == "up" and args.gateway and args.gateway_port
            and args.gateway_port == split_address(args.listen)[1]):
        # Both free until the scheduler takes it: smg would fail only then.
        up.error(f"argument --gateway-port: {args.gateway_port} is --listen's port too (the "
                 "scheduler's); smg needs a port of its own")
    try:
        code = _run(args)
        sys.stdout.flush()  # a reader gone fails here, not at exit
        return code
    except BrokenPipeError:  # `kvstash generate ... | head -c 5`
        return reader_gone()
    except errors.KvstashError as exc:  # a call failed
        # The client names the call ("generate: ..."): once is enough.
        text = str(exc).removeprefix(f"{args.command}: ")
        print(f"kvstash {args.command}: {text}{_hint(exc, args)}",
              file=sys.stderr)
        return 2
    except (ValueError, OSError, RuntimeError) as exc:
        # Bad input, smg missing, a port in use (BindError), a --log-dir that
        # cannot be one, or a service (or smg) that did not start.
        print(f"kvstash {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C in generate or stats: no traceback
        return 130


def _run(args: argparse.Namespace) -> int:
    if args.command == "up":
        return cmd_up(args)
    if args.command == "generate":
        return asyncio.run(_generate(args))
    if args.command == "stats":
        return asyncio.run(_stats(args))
    if args.command == "tokenizer":
        return tokenizer_export.run(args)
    from kvstash.launch.demo import run_demo

    _stop_on_signals()
    try:
        return run_demo(_stack_config(args), args.requests, args.max_tokens,
                        stop=_stop_undisturbed)
    except _Stop as exc:  # run_demo stopped the stack (start_stack, what had started)
        _say(f"stopped ({exc})")
        return 1


def _hint(exc: errors.KvstashError, args: argparse.Namespace) -> str:
    """What to do when no call got through to `--address` (gRPC's own words
    for a connection that failed; a scheduler's UNAVAILABLE says something
    else): TLS that failed is not a missing stack."""
    text = str(exc)
    if exc.code != "UNAVAILABLE" or not ("failed to connect" in text
                                         or "DNS resolution failed" in text):
        return ""
    if "handshake" in text.lower():  # "Tls handshake failed", "... security handshaker"
        return (" (TLS failed: does the scheduler serve TLS, and is --tls-ca the CA that "
                "signed its certificate?)")
    if "Socket closed" in text and getattr(args, "tls_ca", None) is None:
        return " (the scheduler closed the connection: does it serve TLS? give --tls-ca)"
    return f" (no kvstash stack at {getattr(args, 'address', '')}? start one with `kvstash up`)"


if __name__ == "__main__":
    raise SystemExit(main())
