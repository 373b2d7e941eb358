"""`kvstash sim` and `kvstash calibrate`, which the `kvstash` command runs as
`python -m kvstash.sim sim|calibrate ...`: the launcher imports no service
code, and these run the scheduler's own (see tests/test_boundaries.py)."""

from __future__ import annotations

import argparse
import signal
import sys

from kvstash.errors import KvstashError
from kvstash.sim import compiled
from kvstash.workload.flags import probe_writable


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `sim --core`, before anything imports the core it swaps.
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--core", default="auto")
    if argv[:1] == ["sim"]:
        try:
            compiled.activate(early.parse_known_args(argv)[0].core)
        except (ValueError, RuntimeError) as exc:
            print(f"kvstash sim: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # its build's directory cannot be made or written
            print(f"kvstash sim: --core compiled: cannot build into {compiled.cache_dir()} "
                  f"({exc.strerror or exc}; KVSTASH_CACHE_DIR names another)", file=sys.stderr)
            return 2
    from kvstash.launch.terminal import reader_gone
    from kvstash.sim import calibrate, cli

    parser = argparse.ArgumentParser(prog="kvstash")
    commands = parser.add_subparsers(dest="command", required=True)
    sim = cli.add_parser(commands)
    calibrate.add_parser(commands)
    args = parser.parse_args(argv)
    if (wrong := _unwritable(args)) is not None:
        print(f"kvstash {args.command}: {wrong}", file=sys.stderr)
        return 2
    try:
        code = cli.run(args, sim) if args.command == "sim" else calibrate.run(args)
        sys.stdout.flush()  # a reader gone fails here, not at exit
        return code
    except BrokenPipeError:  # `kvstash sim ... | head -3`
        return reader_gone()
    except (ValueError, RuntimeError, OSError, KvstashError) as exc:  # a bad setting, a
        # service that failed or refused a call, or an output that could not be written
        print(f"kvstash {args.command}: {exc}", file=sys.stderr)
        return 2


def _unwritable(args: argparse.Namespace) -> str | None:
    """What keeps a command from writing its outputs, found before it runs:
    found after, a simulation's or a calibration's minutes ended in a
    traceback, and nothing written."""
    for flag, path in (("--json ", getattr(args, "json", None)), ("", getattr(args, "out", None))):
        if path is None:
            continue
        if path.is_dir():
            return f"{flag}{path} is a directory: a file is written there"
        if not path.parent.is_dir():
            return f"{flag}{path}: no directory {path.parent} to write it in"
        try:
            probe_writable(path.parent)
        except OSError as exc:
            return f"{flag}{path}: cannot write in {path.parent} ({exc.strerror or exc})"
    if (plots := getattr(args, "plots", None)) is not None:
        try:
            plots.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file there, or in its way
            return f"--plots {plots}: not a directory ({exc.strerror or exc})"
        try:
            probe_writable(plots)
        except OSError as exc:
            return f"--plots {plots}: cannot write in it ({exc.strerror or exc})"
    return None


def _stop_as_ctrl_c() -> None:
    """SIGTERM and SIGHUP (a service manager, `timeout`, a closed terminal)
    stop a run as Ctrl-C does, so calibrate stops the cache and worker it
    started (killed outright, it left them running); SIGINT explicitly, as a
    background job (`kvstash calibrate &`) inherits it ignored. A SIGHUP
    inherited ignored (`nohup`) stays ignored."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda *_: signal.raise_signal(signal.SIGINT))


if __name__ == "__main__":
    _stop_as_ctrl_c()
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # what it started is stopped: no traceback
        print(f"kvstash {' '.join(sys.argv[1:2])}: stopped", file=sys.stderr)
        sys.exit(130)
