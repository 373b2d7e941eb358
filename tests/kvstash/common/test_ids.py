"""The id rules every service applies: request ids as gateways make them,
and the snapshot ids made from them, valid whatever the request id holds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstash.common.ids import check_request_id, check_snapshot_id, snapshot_id_for
from kvstash.errors import InvalidArgument

VISIBLE_ASCII = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
REQUEST_IDS = st.text(VISIBLE_ASCII, min_size=1, max_size=256)


@pytest.mark.parametrize("request_id", [
    "r", "x" * 256, "cmpl-0192f3a1-7c1e-7d2a-9b3e-4f5a6b7c8d9e", "user/42=+b64==",
    "../etc/passwd", ".hidden", "!~\"#$%&'()*,;<>?@[\\]^`{|}",
])
def test_any_visible_ascii_up_to_256_chars_is_a_request_id(request_id: str) -> None:
    check_request_id(request_id)


@pytest.mark.parametrize("request_id", [
    "", "x" * 257, "a b", "tab\t", "line\nbreak", "nul\x00", "del\x7f", "caf\u00e9", "\u200b",
])
def test_anything_else_is_refused_with_the_rule(request_id: str) -> None:
    with pytest.raises(InvalidArgument, match=r"1-256 visible ASCII characters \(0x21-0x7E\)"):
        check_request_id(request_id)


@given(REQUEST_IDS, st.integers(0, 2**64 - 1))
def test_every_request_id_makes_a_valid_snapshot_id(request_id: str, serial: int) -> None:
    check_request_id(request_id)
    snapshot_id = snapshot_id_for("0a1b2c3d4e5f" * 2 + "abcdefgh", request_id, serial)
    assert check_snapshot_id(snapshot_id) == snapshot_id
    assert snapshot_id.endswith(f".{serial}")


def test_nasty_request_ids_make_readable_snapshot_ids() -> None:
    assert snapshot_id_for("p", "../../etc/passwd", 3) == "p..._.._etc_passwd.3"
    assert snapshot_id_for("p", "a/b=c+d:0", 0) == "p.a_b_c_d_0.0"
    assert snapshot_id_for("p", "." * 256, 1) == f"p.{'.' * 64}.1"
