"""What `kvstash generate` prints of a model's text: everything a terminal
would act on (escape sequences, carriage return, DEL, C1 controls) escaped."""

from __future__ import annotations

import pytest

from kvstash.launch import cli


@pytest.mark.parametrize(("text", "shown"), [
    ("plain text, ünïcode 🙂 and \\ kept", "plain text, ünïcode 🙂 and \\ kept"),
    ("lines\nand\ttabs stay", "lines\nand\ttabs stay"),
    ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),
    ("del\x7f gs\x1d bel\x07 cr\r nul\x00", "del\\x7f gs\\x1d bel\\x07 cr\\x0d nul\\x00"),
    ("c1 csi\x9b2J", "c1 csi\\x9b2J"),
])
def test_generate_escapes_what_a_terminal_would_act_on(text: str, shown: str) -> None:
    assert cli.terminal_safe(text) == shown
