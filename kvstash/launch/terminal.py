"""What `kvstash generate` prints: a stream's text, safe for a terminal, and
its usage line; and how every command ends when its reader goes away."""

from __future__ import annotations

import os
import sys
import unicodedata

from kvstash.client import TokenDelta

_KEPT_CONTROLS = frozenset("\n\t")


def terminal_safe(text: str) -> str:
    """`text` with every control character a terminal would act on (ESC, CR,
    BEL, DEL, the C1 controls) written as an escape like repr's, `\\x1b`;
    newline and tab stay as they are."""
    return "".join(f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc"
                   and c not in _KEPT_CONTROLS else c for c in text)


def print_delta(delta: TokenDelta) -> None:
    """One streamed delta: its text on stdout (terminal-safe), and on stderr
    the usage line of the last one."""
    print(terminal_safe(delta.text), end="", flush=True)
    if delta.usage is not None:
        u = delta.usage
        print(f"\n[{delta.finish_reason}] {u.prompt_tokens} prompt + "
              f"{u.completion_tokens} completion tokens, ttft {u.ttft_s * 1000:.1f} ms, "
              f"{u.num_preemptions} preemptions", file=sys.stderr)


def reader_gone() -> int:
    """What a command whose stdout's reader went away (`| head`) does, as
    Python's docs recommend (signal module, "Note on SIGPIPE"): stdout onto
    /dev/null, so that the flush at exit fails no more, and exit status 1;
    nothing said."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1
