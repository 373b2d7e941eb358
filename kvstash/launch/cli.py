"""The `kvstash` command: up, generate, stats, demo."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from kvstash import errors
from kvstash.client import Client
from kvstash.common import security
from kvstash.launch.gateway import POLICIES
from kvstash.launch.stack import Stack, StackConfig, start_stack, worker_threads

DEFAULT_ADDRESS = "127.0.0.1:50051"


def _add_stack_flags(p: argparse.ArgumentParser, defaults: StackConfig) -> None:
    p.add_argument("--model", default=defaults.model, help="'tiny' or a checkpoint directory")
    p.add_argument("--dtype", default=defaults.dtype)
    p.add_argument("--device", default=defaults.device)
    p.add_argument("--num-blocks", type=int, default=defaults.num_blocks,
                   help="KV-cache blocks on the worker")
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--preemption-mode", default=defaults.preemption_mode,
                   choices=["auto", "offload", "recompute"])
    p.add_argument("--cache-memory-budget", default=defaults.cache_memory_budget)
    p.add_argument("--cache-disk-budget", default=defaults.cache_disk_budget)
    p.add_argument("--cache-disk-dir", default=None, help="default: a temporary directory")
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


def _stack_config(args: argparse.Namespace, **extra: object) -> StackConfig:
    return StackConfig(
        model=args.model, dtype=args.dtype, device=args.device, num_blocks=args.num_blocks,
        block_size=args.block_size, preemption_mode=args.preemption_mode,
        cache_memory_budget=args.cache_memory_budget, cache_disk_budget=args.cache_disk_budget,
        cache_disk_dir=args.cache_disk_dir, pd=args.pd, instances=args.instances,
        gateway=args.gateway, gateway_policy=args.gateway_policy,
        worker_threads=args.worker_threads, **extra,  # type: ignore[arg-type]
    )


class _Stop(Exception):
    """SIGTERM or SIGHUP arrived: stop like Ctrl-C does."""


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def cmd_up(args: argparse.Namespace) -> int:
    port = int(args.listen.rsplit(":", 1)[1])
    host = args.listen.rsplit(":", 1)[0]
    config = _stack_config(args, host=host, scheduler_port=port, plaintext=args.plaintext,
                           gateway_port=args.gateway_port)
    # A service manager stops us with SIGTERM, a closed terminal with SIGHUP:
    # either must stop the services too, not orphan them.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    stack = start_stack(config)
    try:
        for service in stack.services:
            print(f"{service.name:<20} {service.address:<22} pid {service.process.pid}")
        if stack.gateway is not None:
            gateway = stack.gateway
            print(f"{gateway.name:<20} {gateway.address:<22} pid {gateway.process.pid}\n"
                  f"OpenAI HTTP (smg) at {gateway.url}/v1, e.g. {gateway.url}/v1/models")
        reach = ("loopback only" if security.is_loopback(args.listen)
                 else "anyone who can reach this host")
        print(f"plaintext gRPC, {reach} (TLS: start the services with --tls-*)")
        threads, why = worker_threads(config)
        print(f"torch threads per worker: {threads} ({why})")
        print(f"logs in {stack.log_dir}; Ctrl-C stops everything", flush=True)
        failed = stack.wait_for_exit()
    except (KeyboardInterrupt, _Stop) as exc:
        print(f"\nstopping ({exc or 'interrupted'})", file=sys.stderr)
        _stop_undisturbed(stack)
        return 0
    except BaseException:
        _stop_undisturbed(stack)
        raise
    # Keep every log: the others may say why this one died.
    print(f"{failed.name} exited with code {failed.process.returncode}; stopping the others. "
          f"Its log: {failed.log_path}", file=sys.stderr)
    _stop_undisturbed(stack, keep_logs=True)
    return 1


def _stop_undisturbed(stack: Stack, keep_logs: bool = False) -> None:
    """Stops the stack with further stop signals ignored: a second SIGTERM
    (or Ctrl-C) must not cut the stopping short and orphan a service."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    stack.stop(keep_logs)


async def _generate(args: argparse.Namespace) -> int:
    async with Client(args.address, security.from_args(args)) as client:
        async for delta in client.generate(
            args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        ):
            print(delta.text, end="", flush=True)
            if delta.usage is not None:
                u = delta.usage
                print(f"\n[{delta.finish_reason}] {u.prompt_tokens} prompt + "
                      f"{u.completion_tokens} completion tokens, ttft {u.ttft_s * 1000:.1f} ms, "
                      f"{u.num_preemptions} preemptions", file=sys.stderr)
    return 0


async def _stats(args: argparse.Namespace) -> int:
    async with Client(args.address, security.from_args(args)) as client:
        print(await client.stats(), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = StackConfig()

    up = sub.add_parser("up", help="start cache, worker and scheduler on this machine")
    up.add_argument("--listen", default=DEFAULT_ADDRESS,
                    help="the scheduler's address; the others listen on its host")
    up.add_argument("--plaintext", action="store_true",
                    help="allow a non-loopback --listen: every service then serves plaintext "
                         "gRPC to anyone who can reach that host")
    up.add_argument("--gateway-port", type=int, default=8000,
                    help="with --gateway: smg's HTTP port, on --listen's host")
    _add_stack_flags(up, defaults)

    gen = sub.add_parser("generate", help="stream a completion")
    gen.add_argument("prompt")
    gen.add_argument("--address", default=DEFAULT_ADDRESS)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    security.add_flags(gen, server=False, sends_token=True)

    stats = sub.add_parser("stats", help="print the scheduler's stats")
    stats.add_argument("--address", default=DEFAULT_ADDRESS)
    security.add_flags(stats, server=False, sends_token=True)

    demo = sub.add_parser("demo", help="start a stack, run a pressured workload, summarize")
    demo.add_argument("--requests", type=int, default=32)
    demo.add_argument("--max-tokens", type=int, default=96)
    _add_stack_flags(demo, StackConfig(num_blocks=96))

    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            return cmd_up(args)
        if args.command == "generate":
            return asyncio.run(_generate(args))
        if args.command == "stats":
            return asyncio.run(_stats(args))
        from kvstash.launch.demo import run_demo

        return run_demo(_stack_config(args), args.requests, args.max_tokens)
    except (errors.KvstashError, ValueError, FileNotFoundError, RuntimeError) as exc:
        # Bad input, smg missing, or a service (or smg) that did not start.
        print(f"kvstash {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
