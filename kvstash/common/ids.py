"""Rules for ids that cross service boundaries: request ids and snapshot ids.

Request ids are any visible ASCII (0x21-0x7E), so that a gateway's ids
(smg's "<x-request-id>-<uuid7>", a client's own) pass as they are; no space,
control or non-ASCII character, so a log line that names one stays one line.
Every service and both APIs apply the same rule: a request's id reaches its
worker unchanged (a decode instance knows a hand-off by its snapshot id,
itself a valid request id, unique in the shared cache). Snapshot ids also name
files, so they keep a stricter alphabet; `snapshot_id_for` makes one from any
request id. Errors echo at most a short prefix of what was sent.
"""

from __future__ import annotations

import re

from kvstash.errors import MAX_ID_CHARS, InvalidArgument, preview

MAX_REQUEST_ID_CHARS = 256
# Most snapshot ids one FindSnapshots takes (the cache refuses more): a
# 1M-token prompt in 256-token segments.
MAX_FIND_IDS = 4096
_REQUEST_ID = re.compile(f"[\\x21-\\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")
SNAPSHOT_ID_CHARS = "A-Za-z0-9._-"
_SNAPSHOT_ID = re.compile(f"[{SNAPSHOT_ID_CHARS}]+")
_NOT_SNAPSHOT_CHAR = re.compile(f"[^{SNAPSHOT_ID_CHARS}]")
# Longest piece of a request id kept inside a snapshot id.
_SNAPSHOT_REQUEST_PART = 64


def check_request_id(request_id: str) -> None:
    if not _REQUEST_ID.fullmatch(request_id):
        raise InvalidArgument(
            f"request_id must be 1-{MAX_REQUEST_ID_CHARS} visible ASCII characters "
            f"(0x21-0x7E), got {preview(request_id)}")


def check_snapshot_id(snapshot_id: str) -> str:
    """Returns the id unchanged; it never starts with "." (no hidden files on disk)."""
    if not snapshot_id:
        raise InvalidArgument(
            f"snapshot id is empty; need 1-{MAX_ID_CHARS} chars of [{SNAPSHOT_ID_CHARS}]")
    if len(snapshot_id) > MAX_ID_CHARS:
        raise InvalidArgument(
            f"snapshot id has {len(snapshot_id)} chars, at most {MAX_ID_CHARS} allowed")
    if not _SNAPSHOT_ID.fullmatch(snapshot_id):
        raise InvalidArgument(
            f"snapshot id {preview(snapshot_id)} has characters outside [{SNAPSHOT_ID_CHARS}]")
    if snapshot_id.startswith("."):
        raise InvalidArgument(f"snapshot id {preview(snapshot_id)} must not start with '.'")
    return snapshot_id


def snapshot_id_for(prefix: str, request_id: str, serial: int) -> str:
    """`prefix.request.serial`: unique per (prefix, serial), readable in the cache's
    listings and on disk, and always a valid snapshot id (the request id's
    other characters become "_", its first 64 kept)."""
    part = _NOT_SNAPSHOT_CHAR.sub("_", request_id)[:_SNAPSHOT_REQUEST_PART]
    return check_snapshot_id(f"{prefix}.{part}.{serial}")
