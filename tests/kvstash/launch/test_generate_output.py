"""What `kvstash generate` prints of a model's text: everything a terminal
would act on (escape sequences, carriage return, DEL, C1 controls) escaped."""

from __future__ import annotations

import pytest

from kvstash.client import TokenDelta, Usage
from kvstash.launch import terminal


@pytest.mark.parametrize(("text", "shown"), [
    ("plain text, ünïcode 🙂 and \\ kept", "plain text, ünïcode 🙂 and \\ kept"),
    ("lines\nand\ttabs stay", "lines\nand\ttabs stay"),
    ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),
    ("del\x7f gs\x1d bel\x07 cr\r nul\x00", "del\\x7f gs\\x1d bel\\x07 cr\\x0d nul\\x00"),
    ("c1 csi\x9b2J", "c1 csi\\x9b2J"),
])
def test_generate_escapes_what_a_terminal_would_act_on(text: str, shown: str) -> None:
    assert terminal.terminal_safe(text) == shown


def test_generate_prints_each_delta_escaped_and_usage_on_stderr(
        capsys: pytest.CaptureFixture[str]) -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=4, num_preemptions=0,
                  num_recomputed_tokens=0, bytes_offloaded=0, ttft_s=0.0125)
    terminal.print_delta(TokenDelta("r", [27, 91], "ok\x1b["))
    terminal.print_delta(TokenDelta("r", [127, 10], "\x7f\n", "length", usage))
    out, err = capsys.readouterr()
    assert out == "ok\\x1b[\\x7f\n"
    assert err == "\n[length] 3 prompt + 4 completion tokens, ttft 12.5 ms, 0 preemptions\n"
