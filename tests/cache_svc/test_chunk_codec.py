"""kvstash.cache_sdk.chunk_codec writes exactly protobuf's bytes for a Chunk and reads
back whatever protobuf writes; the server gets it without the client, and
both sides hold chunks to its one set of rules."""

from __future__ import annotations

import subprocess
import sys

import pytest
import xxhash
from cache_helpers import MIB, REPO, make_header, make_layout
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_svc.snapshot import SnapshotMeta
from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.cache_sdk.chunk_codec import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    RawChunk,
    checksum,
    decode_get_response,
    decode_put_request,
    encode_chunk,
    encode_message,
)
from kvstash.common.layout import Layout
from kvstash.v1 import cache_pb2

CASES = [(0, b"", 0), (1, b"x" * 300, 2**64 - 1), (2**32 - 1, bytes(range(256)) * 8, 12345)]


@pytest.mark.parametrize(("index", "data", "checksum"), CASES)
def test_encoding_matches_protobuf(index: int, data: bytes, checksum: int) -> None:
    chunk = cache_pb2.Chunk(index=index, data=data, checksum=checksum)
    for message_type in (cache_pb2.PutSnapshotRequest, cache_pb2.GetSnapshotResponse):
        expected = message_type(chunk=chunk).SerializeToString()
        # protobuf leaves zero fields out; the codec always writes them, and
        # protobuf reads both the same way.
        encoded = encode_chunk(index, memoryview(data), checksum)
        assert message_type.FromString(encoded).chunk == chunk
        if index and data and checksum:
            assert encoded == expected
        for decode in (decode_put_request, decode_get_response):
            for wire in (encoded, expected):
                raw = decode(wire)
                assert isinstance(raw, RawChunk)
                assert (raw.index, raw.data.tobytes(), raw.checksum) == (index, data, checksum)


def test_headers_go_through_protobuf() -> None:
    header = make_header("snap", make_layout(), 4)
    request = cache_pb2.PutSnapshotRequest(header=header)
    assert encode_message(request) == request.SerializeToString()
    assert decode_put_request(request.SerializeToString()) == header
    response = cache_pb2.GetSnapshotResponse(header=header)
    assert decode_get_response(response.SerializeToString()) == header


VALID = [encode_chunk(3, b"x" * 300, 7),
         cache_pb2.PutSnapshotRequest(header=make_header("snap", make_layout(), 4))
         .SerializeToString()]


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64),
                 st.tuples(st.sampled_from(VALID), st.integers(0, 400), st.binary(max_size=8))
                 .map(lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + len(t[2]):])))
def test_garbage_is_decoded_or_refused_with_decode_error(message: bytes) -> None:
    # The server's interceptor turns exactly this exception into
    # INVALID_ARGUMENT; anything else would reach the client as UNKNOWN.
    for decode in (decode_put_request, decode_get_response):
        try:
            result = decode(message)
        except DecodeError:
            continue
        assert isinstance(result, RawChunk | cache_pb2.SnapshotHeader)


def test_server_does_not_import_the_client() -> None:
    client = [f"kvstash.cache_sdk.{m}" for m in ("cache_client", "arena_calls", "streamed_calls")]
    code = ("import sys, cache_svc.server; "
            f"sys.exit(sorted(set({client!r}) & sys.modules.keys()) or None)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_the_codec_imports_neither_grpc_nor_torch() -> None:
    code = ("import sys, kvstash.cache_sdk.chunk_codec; "
            "sys.exit(sorted({'grpc', 'torch'} & sys.modules.keys()) or None)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_checksum_is_xxh3_64_with_seed_0() -> None:
    # What cache.proto promises for CHECKSUM_ALGORITHM_XXH3_64; both sides use it.
    assert checksum(b"") == 0x2D06800538D394C2
    assert checksum(memoryview(b"kvstash")) == xxhash.xxh3_64_intdigest(b"kvstash", seed=0)


@pytest.mark.parametrize("chunk_bytes", [MIN_CHUNK_BYTES - 1, MIN_CHUNK_BYTES,
                                         DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES,
                                         MAX_CHUNK_BYTES + 1])
async def test_client_and_server_accept_the_same_chunk_sizes(chunk_bytes: int) -> None:
    layout = Layout(1, 16, 1, 64, "float16")  # 4 KiB blocks
    try:
        SnapshotMeta("s", layout, 1024, 0, 4 * MIB, chunk_bytes, pinned=True, ttl_s=60)
        server = "ok"
    except errors.InvalidArgument as exc:
        server = str(exc)
    try:
        client = CacheClient("127.0.0.1:1", chunk_bytes=chunk_bytes)
    except errors.InvalidArgument as exc:
        assert str(exc) == server
    else:
        await client.close()
        assert server == "ok"
    assert (server == "ok") == (MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES)
