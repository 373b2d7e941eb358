"""`kvstash sim` and `kvstash calibrate`, which the `kvstash` command runs as
`python -m kvstash.sim sim|calibrate ...`: the launcher imports no service
code, and these run the scheduler's own (see tests/test_boundaries.py)."""

from __future__ import annotations

import argparse
import sys

from kvstash.sim import calibrate, cli


def main(argv: list[str] | None = None) -> int:
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
