"""`kvstash tokenizer export`'s parts: the built-in files as transformers and
tokenizers load them, the checks on what a server sends (over a real gRPC
server on loopback), and writing without losing what is there."""

from __future__ import annotations

import hashlib
import io
import json
import socket
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from tokenizers import Tokenizer

from kvstash import errors
from kvstash.common.security import PLAINTEXT
from kvstash.common.tokenizer import ByteTokenizer, byte_tokenizer_json
from kvstash.launch import cli
from kvstash.launch.tokenizer_export import (
    builtin_tokenizer_files,
    fetch_tokenizer_files,
    unzip_tokenizer,
    write_tokenizer_files,
)

TEXTS = ["hello kv", "héllo 🙂 日本語", "  two  spaces\n\ttab", "<|user|>\nhi\n"]


def zipped(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def test_builtin_files_load_in_transformers_and_tokenizers_as_the_byte_tokenizer(
        tmp_path: Path) -> None:
    import transformers  # slow to import: only here
    write_tokenizer_files(builtin_tokenizer_files(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "tokenizer.json", "tokenizer_config.json"]
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    plain = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        ids = ByteTokenizer().encode(text)
        assert auto(text).input_ids == plain.encode(text).ids == ids
        assert auto.decode(ids) == text
    assert auto.eos_token_id == 257
    assert json.loads((tmp_path / "config.json").read_text()) == {"eos_token_id": [257]}


def test_existing_files_are_kept_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("mine")
    with pytest.raises(ValueError, match=r"already holds tokenizer.json .*--force"):
        write_tokenizer_files(builtin_tokenizer_files(), tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"]
    write_tokenizer_files(builtin_tokenizer_files(), tmp_path, force=True)
    assert (tmp_path / "tokenizer.json").read_text() == byte_tokenizer_json()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_directory_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("")
    with pytest.raises(ValueError, match=r"cannot make .*taken"):
        write_tokenizer_files(builtin_tokenizer_files(), tmp_path / "taken")


@pytest.mark.parametrize(("files", "message"), [
    ({"../evil.json": b"{}", "tokenizer.json": b"{}"}, "not plain file names"),
    ({"sub/tokenizer.json": b"{}"}, "not plain file names"),
    ({".hidden": b"", "tokenizer.json": b"{}"}, "not plain file names"),
    ({"tokenizer_config.json": b"{}"}, "no tokenizer.json"),
    ({"tokenizer.json": b"not json"}, "tokenizer.json does not load"),
    ({"tokenizer.json": b"\xff\xfe"}, "tokenizer.json does not load"),
])
def test_archives_that_are_no_tokenizer_are_refused(files: dict[str, bytes],
                                                    message: str) -> None:
    with pytest.raises(errors.DataLoss, match=message):
        unzip_tokenizer(zipped(files))


def test_bytes_that_are_no_zip_are_refused() -> None:
    with pytest.raises(errors.DataLoss, match="no zip file"):
        unzip_tokenizer(b"PK not really")


class Tokenizers(vllm_engine_pb2_grpc.VllmEngineServicer):
    """GetTokenizer answering with whatever chunks a test sets."""

    def __init__(self) -> None:
        self.chunks: list[common_pb2.GetTokenizerChunk] = []
        self.code: grpc.StatusCode | None = None

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext,
                           ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        if self.code is not None:
            await context.abort(self.code, "no tokenizer here")
        for chunk in self.chunks:
            yield chunk


@pytest.fixture
async def served() -> AsyncIterator[tuple[Tokenizers, str]]:
    servicer = Tokenizers()
    server = grpc.aio.server()
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(None)


def chunks_of(data: bytes, digest: str) -> list[common_pb2.GetTokenizerChunk]:
    half = len(data) // 2
    return [common_pb2.GetTokenizerChunk(data=data[:half]),
            common_pb2.GetTokenizerChunk(data=data[half:], sha256=digest)]


async def test_fetch_reassembles_and_checks_the_chunks(
        served: tuple[Tokenizers, str]) -> None:
    servicer, address = served
    data = zipped(builtin_tokenizer_files())
    servicer.chunks = chunks_of(data, hashlib.sha256(data).hexdigest())
    assert await fetch_tokenizer_files(address, PLAINTEXT) == builtin_tokenizer_files()


@pytest.mark.parametrize("digest", ["", "0" * 64])
async def test_fetch_refuses_a_missing_or_wrong_digest(
        served: tuple[Tokenizers, str], digest: str) -> None:
    servicer, address = served
    servicer.chunks = chunks_of(zipped(builtin_tokenizer_files()), digest)
    with pytest.raises(errors.DataLoss, match=r"SHA-256 .* does not match"):
        await fetch_tokenizer_files(address, PLAINTEXT)


async def test_fetch_keeps_the_servers_status_and_message(
        served: tuple[Tokenizers, str]) -> None:
    servicer, address = served
    servicer.code = grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(errors.Unimplemented, match=f"GetTokenizer at {address}: no tokenizer"):
        await fetch_tokenizer_files(address, PLAINTEXT)


def free_address() -> str:
    """A loopback port that was free a moment ago and is closed again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_cli_names_an_address_nobody_serves(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    address = free_address()
    code = cli.main(["tokenizer", "export", str(tmp_path / "out"), "--address", address])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"kvstash tokenizer: GetTokenizer at {address}")
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_cli_without_an_address_writes_the_builtin_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["tokenizer", "export", str(tmp_path / "tiny")]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "tiny" / "tokenizer.json") in out
    written = {p.name: p.read_bytes() for p in (tmp_path / "tiny").iterdir()}
    assert written == builtin_tokenizer_files()
    assert cli.main(["tokenizer", "export", str(tmp_path / "tiny")]) == 2
    assert "--force" in capsys.readouterr().err


def test_cli_refuses_security_flags_without_an_address(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    code = cli.main(["tokenizer", "export", str(tmp_path / "out"), "--token-file", str(token)])
    assert code == 2 and "--token-file need --address" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
