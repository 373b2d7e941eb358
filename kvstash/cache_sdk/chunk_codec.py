"""Wire codec for snapshot chunks, shared by the cache server and CacheClient.

PutSnapshotRequest and GetSnapshotResponse both carry `Chunk chunk = 2` in
their oneof. Going through protobuf costs three copies of every payload per
side (bytes() of the slice, into the message, out of it again), each a fresh
multi-MiB allocation. These functions produce and read the same wire bytes
directly:

  0x12 len | 0x08 index | 0x12 len  data ...  | 0x18 checksum
  chunk=2  | index=1    | data=2              | checksum=3

Encoding copies the payload once; decoding copies nothing (`data` is a view
into the received message). Anything else (a header, or a chunk encoded
differently by another client) goes through protobuf, so every valid
message is understood.

The chunking rules both sides check (chunk sizes, the checksum) live here
too. No grpc and no torch: the cache server, CacheClient and tests share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

from kvstash.common.units import MIB
from kvstash.common.wire import layout_from_proto
from kvstash.errors import DataLoss, InvalidArgument
from kvstash.v1 import cache_pb2

# Every chunk but a snapshot's last carries exactly the header's chunk_bytes,
# which must lie in [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES].
MIN_CHUNK_BYTES = 1 * MIB
MAX_CHUNK_BYTES = 4 * MIB
# 2 MiB, not 4: puts and gets run faster with it in bench/cache_bench.py.
DEFAULT_CHUNK_BYTES = 2 * MIB
# The one checksum algorithm (cache.proto CHECKSUM_ALGORITHM_XXH3_64), by name.
CHECKSUM_XXH3_64 = "xxh3_64"
# Initial-metadata key the server sends once a put's room is reserved; the
# client streams no payload before it.
ADMITTED_KEY = "kvstash-put-admitted"


def checksum(data: bytes | memoryview) -> int:
    """The CHECKSUM_XXH3_64 of one chunk's payload (xxHash3, 64-bit, seed 0)."""
    return xxhash.xxh3_64_intdigest(data)


def check_chunk_bytes(chunk_bytes: int) -> None:
    """Raises InvalidArgument (a ValueError) unless `chunk_bytes` is a valid
    header chunk size."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise InvalidArgument(
            f"chunk_bytes is {chunk_bytes}, must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}] "
            f"({MIN_CHUNK_BYTES // MIB}-{MAX_CHUNK_BYTES // MIB} MiB)"
        )


def check_received_header(header: cache_pb2.SnapshotHeader, what: str) -> None:
    """Raises DataLoss naming `what` unless a header the cache sent is one a
    put could have made: chunks of a valid size, and total_bytes those of its
    blocks in its layout (no buffer is sized by that number alone)."""
    try:
        check_chunk_bytes(header.chunk_bytes)
        layout = layout_from_proto(header.layout)
    except InvalidArgument as exc:
        raise DataLoss(f"{what}: the cache sent a bad header: {exc}") from None
    expected = header.num_blocks * layout.bytes_per_block
    if header.num_blocks <= 0 or header.total_bytes != expected:
        raise DataLoss(f"{what}: the cache sent a header of {header.total_bytes} bytes for "
                       f"{header.num_blocks} blocks of {layout.bytes_per_block}")


@dataclass(frozen=True, slots=True)
class RawChunk:
    """A received Chunk; `data` is a view into the message bytes."""

    index: int
    data: memoryview
    checksum: int


def encode_chunk(index: int, data: bytes | memoryview, checksum: int) -> bytes:
    """Wire bytes of a PutSnapshotRequest/GetSnapshotResponse holding one chunk."""
    size = memoryview(data).nbytes
    head = b"\x08" + _varint(index) + b"\x12" + _varint(size)
    tail = b"\x18" + _varint(checksum)
    return b"".join((b"\x12", _varint(len(head) + size + len(tail)), head, data, tail))


def encode_message(message: bytes | Any) -> bytes:
    """Serializer: bytes from `encode_chunk` pass through; messages are serialized."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def decode_chunk_or_header(message: bytes, message_type: Any) -> RawChunk | Any:
    """Deserializer for PutSnapshotRequest/GetSnapshotResponse bytes: a RawChunk,
    or the SnapshotHeader message. Raises protobuf's DecodeError on garbage."""
    try:
        chunk = _parse_chunk(message)
    except IndexError:  # truncated: let protobuf say what is wrong
        chunk = None
    if chunk is not None:
        return chunk
    parsed = message_type.FromString(message)
    if parsed.WhichOneof("kind") == "header":
        return parsed.header
    c = parsed.chunk  # also an empty message: chunk 0 without data, refused later
    return RawChunk(c.index, memoryview(c.data), c.checksum)


def decode_put_request(message: bytes) -> RawChunk | Any:
    """The server's PutSnapshot request deserializer."""
    return decode_chunk_or_header(message, cache_pb2.PutSnapshotRequest)


def decode_get_response(message: bytes) -> RawChunk | Any:
    """The client's GetSnapshot response deserializer."""
    return decode_chunk_or_header(message, cache_pb2.GetSnapshotResponse)


def _parse_chunk(message: bytes) -> RawChunk | None:
    """The fast path: None unless `message` is exactly one chunk field whose
    fields are all known (protobuf handles everything else)."""
    if message[:1] != b"\x12":
        return None
    length, pos = _read_varint(message, 1)
    if pos + length != len(message):
        return None
    index = checksum = 0
    data = memoryview(b"")
    while pos < len(message):
        tag = message[pos]
        if tag == 0x08:
            index, pos = _read_varint(message, pos + 1)
        elif tag == 0x12:
            size, pos = _read_varint(message, pos + 1)
            if pos + size > len(message):
                return None
            data = memoryview(message)[pos : pos + size]
            pos += size
        elif tag == 0x18:
            checksum, pos = _read_varint(message, pos + 1)
        else:
            return None
    if index >= 1 << 32 or checksum >= 1 << 64:
        return None
    return RawChunk(index, data, checksum)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint longer than 10 bytes")
