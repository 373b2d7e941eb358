"""`kvstash sim` and `kvstash calibrate`, which the `kvstash` command runs as
`python -m kvstash.sim sim|calibrate ...`: the launcher imports no service
code, and these run the scheduler's own (see tests/test_boundaries.py)."""

from __future__ import annotations

import argparse
import sys

from kvstash.sim import compiled


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
    from kvstash.sim import calibrate, cli

    parser = argparse.ArgumentParser(prog="kvstash")
    commands = parser.add_subparsers(dest="command", required=True)
    sim = cli.add_parser(commands)
    calibrate.add_parser(commands)
    args = parser.parse_args(argv)
    try:
        if args.command == "sim":
            return cli.run(args, sim)
        return calibrate.run(args)
    except (ValueError, RuntimeError) as exc:  # a bad setting, or a service that failed
        print(f"kvstash {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
