"""Flags from the environment: the one place any service reads it.

Every flag `--some-flag` of service `worker` may also come from the variable
`KVSTASH_WORKER_SOME_FLAG` (scheduler: `KVSTASH_SCHEDULER_`, cache:
`KVSTASH_CACHE_`), read once when the arguments are parsed. A flag on the
command line wins over the variable; the variable wins over the built-in
default. That is how a container (and the Helm chart) configures a service.
A variable with the service's prefix that names no flag (a typo, a flag
another service has) stops it too: ignored, it would leave the setting at
its default without a word. So does one named after a flag's other spelling
(KVSTASH_WORKER_NO_CACHE_ARENA, for --no-cache-arena): each setting is read
from one variable, that of its first spelling (KVSTASH_WORKER_CACHE_ARENA=false).
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Mapping, Sequence

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# Variables that share a service's prefix but are no flag of it.
_NOT_FLAGS = frozenset({"KVSTASH_CACHE_DIR"})  # kvstash.sim.compiled's build cache


def env_name(service: str, option: str) -> str:
    """("worker", "--num-blocks") -> "KVSTASH_WORKER_NUM_BLOCKS"."""
    return f"KVSTASH_{service}_{option.lstrip('-')}".upper().replace("-", "_")


def parse_args(
    parser: argparse.ArgumentParser,
    service: str,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """`parser.parse_args(argv)` with defaults taken from KVSTASH_<SERVICE>_* variables.

    A variable's value is parsed like the flag's own text (its `type` applies),
    so a bad value fails at start-up with the flag named."""
    environ = os.environ if environ is None else environ
    defaults: dict[str, object] = {}
    known: dict[str, str] = {}  # variable -> the flag it sets
    # The variable of a flag's other spelling -> the one read, and whether
    # that spelling negates it (--no-x of --x/--no-x).
    spellings: dict[str, tuple[str, bool]] = {}
    for action in parser._actions:  # argparse offers no public view of its options
        long_options = [o for o in action.option_strings if o.startswith("--")]
        if not long_options:
            continue
        variable = env_name(service, long_options[0])
        known[variable] = long_options[0]
        for option in long_options[1:]:
            negated = (isinstance(action, argparse.BooleanOptionalAction)
                       and option.startswith("--no-"))
            spellings[env_name(service, option)] = (variable, negated)
    prefix = env_name(service, "")
    for name in sorted(environ):
        if not name.startswith(prefix) or name in known or name in _NOT_FLAGS:
            continue
        if name in spellings:
            variable, negated = spellings[name]
            if negated:  # NO_X=1 is X=false, NO_X=0 is X=true
                variable += "=true" if environ[name].lower() in _FALSE else "=false"
            parser.error(f"{name}: not read; set {variable} instead")
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}, for {known[close[0]]}?)" if close else ""
        parser.error(f"{name}: no flag of this service takes it{hint}")
    for action in parser._actions:
        long_options = [o for o in action.option_strings if o.startswith("--")]
        if not long_options or action.dest == "help":
            continue
        name = env_name(service, long_options[0])
        value = environ.get(name)
        if value is None:
            continue
        if action.nargs == 0:  # a switch: store_true / store_false / --x/--no-x
            if value.lower() not in (*_TRUE, *_FALSE):
                parser.error(f"{name}={value!r}: use one of {', '.join(_TRUE + _FALSE)}")
            defaults[action.dest] = value.lower() in _TRUE
        else:
            try:
                defaults[action.dest] = action.type(value) if action.type else value  # type: ignore[operator]
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{name}={value!r}: {exc}")
            if action.choices is not None and defaults[action.dest] not in action.choices:
                parser.error(f"{name}={value!r}: choose from "
                             f"{', '.join(map(str, action.choices))}")
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)
