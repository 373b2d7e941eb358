"""`kvstash tokenizer export DIR`: the serving model's tokenizer as the files
load tools read.

guidellm (`--processor DIR`) and aiperf (`--tokenizer DIR`) count tokens with
Hugging Face's `AutoTokenizer.from_pretrained(DIR)`; given only a model name,
they look it up on the hub. This writes a directory they load offline:

    DIR/tokenizer.json          the tokenizer itself (tokenizers' format)
    DIR/tokenizer_config.json   its class, special tokens and chat template
    DIR/config.json             the EOS ids

With `--address`, the files are those a running instance hands a gateway
(VllmEngine GetTokenizer on its scheduler's port), checked against the SHA-256
on the last chunk; without, the built-in tiny model's, the same files a tiny
instance serves. Nothing is overwritten unless `--force` says so.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import os
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path

import grpc
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from tokenizers import Tokenizer

from kvstash import errors
from kvstash.common import flag_types, rpc_connections, rpc_errors, security
from kvstash.common.security import Security
from kvstash.common.tokenizer import BYTE_EOS_ID, tokenizer_files

# A real tokenizer.json is 2-40 MB; a bigger archive is no tokenizer.
MAX_TOKENIZER_BYTES = 256 * 1024 * 1024
# Flat file names only: nothing a server sends may land outside DIR.
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TIMEOUT_S = 60.0


def builtin_tokenizer_files() -> dict[str, bytes]:
    """The tiny model's files, as a tiny instance's GetTokenizer zips them."""
    return {name: text.encode()
            for name, text in tokenizer_files("", "", [BYTE_EOS_ID]).items()}


async def fetch_tokenizer_files(address: str, secured: Security) -> dict[str, bytes]:
    """The files of the instance at `address` (GetTokenizer). Unavailable when
    it cannot be reached; DataLoss when what it sent is no tokenizer archive."""
    async with rpc_connections.channel(address, secured) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        data, digest = bytearray(), ""
        try:
            async for chunk in stub.GetTokenizer(common_pb2.GetTokenizerRequest(),
                                                 timeout=_TIMEOUT_S):
                data += chunk.data
                digest = chunk.sha256 or digest
                if len(data) > MAX_TOKENIZER_BYTES:
                    raise errors.DataLoss(f"GetTokenizer at {address} sent over "
                                          f"{MAX_TOKENIZER_BYTES} bytes")
        except grpc.aio.AioRpcError as exc:
            raise rpc_errors.error_from_rpc(exc, f"GetTokenizer at {address}") from None
    if digest != hashlib.sha256(data).hexdigest():
        raise errors.DataLoss(f"GetTokenizer at {address}: the archive's SHA-256 "
                              f"({digest or 'none sent'}) does not match its bytes")
    return unzip_tokenizer(bytes(data))


def unzip_tokenizer(data: bytes) -> dict[str, bytes]:
    """The files of a GetTokenizer archive, checked: flat names, a bounded
    size, a tokenizer.json that `tokenizers` loads. DataLoss otherwise."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = [e for e in archive.infolist() if not e.is_dir()]
            bad = [e.filename for e in entries if not _FILE_NAME.fullmatch(e.filename)]
            if bad:
                raise errors.DataLoss(f"tokenizer archive holds names that are not plain "
                                      f"file names: {bad[:4]}")
            if sum(e.file_size for e in entries) > MAX_TOKENIZER_BYTES:
                raise errors.DataLoss(f"tokenizer archive unpacks to over "
                                      f"{MAX_TOKENIZER_BYTES} bytes")
            files = {e.filename: archive.read(e) for e in entries}
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError) as exc:
        raise errors.DataLoss(f"tokenizer archive is no zip file: {exc}") from None
    if "tokenizer.json" not in files:
        raise errors.DataLoss(f"tokenizer archive has no tokenizer.json (has {sorted(files)})")
    try:
        Tokenizer.from_str(files["tokenizer.json"].decode())
    except Exception as exc:  # tokenizers raises plain Exception, decode UnicodeDecodeError
        raise errors.DataLoss(f"tokenizer.json does not load: {exc}") from None
    return files


def write_tokenizer_files(files: Mapping[str, bytes], directory: Path,
                          force: bool = False) -> list[Path]:
    """Writes `files` into `directory` (made if missing); ValueError naming
    the files already there unless `force`. Each file appears whole or not at
    all (written beside, then renamed)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot make {directory}: {exc.strerror or exc}") from None
    paths = [directory / name for name in sorted(files)]
    existing = [p.name for p in paths if p.exists()]
    if existing and not force:
        raise ValueError(f"{directory} already holds {', '.join(existing)} "
                         f"(--force overwrites)")
    for path in paths:
        partial = path.with_name(f".{path.name}.partial")
        try:
            partial.write_bytes(files[path.name])
            os.replace(partial, path)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from None
    return paths


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`kvstash tokenizer export` (a group, so more tokenizer commands fit beside)."""
    group = commands.add_parser("tokenizer", help="the serving model's tokenizer files")
    actions = group.add_subparsers(dest="tokenizer_command", required=True)
    export = actions.add_parser(
        "export", help="write tokenizer.json, tokenizer_config.json and config.json to a "
                       "directory, as load tools (guidellm, aiperf) and transformers load them")
    export.add_argument("directory", type=Path, help="where to write (made if missing)")
    export.add_argument("--address", type=flag_types.target, default=None,
                        help="a running instance's scheduler (host:port) whose model's "
                             "tokenizer to fetch; default: the built-in tiny model's")
    export.add_argument("--force", action="store_true", help="overwrite files already there")
    security.add_flags(export, server=False, sends_token=True)


def run(args: argparse.Namespace) -> int:
    """Fetches (or builds) the files, writes them, names what it wrote."""
    if args.address is None:
        used = [flag for flag, value in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert),
                                         ("--tls-key", args.tls_key),
                                         ("--token-file", args.token_file)) if value]
        if used:
            raise ValueError(f"{', '.join(used)} need --address (the built-in tokenizer "
                             f"is fetched from nowhere)")
        files, source = builtin_tokenizer_files(), "the built-in tiny model"
    else:
        secured = security.from_args(args)
        files = asyncio.run(fetch_tokenizer_files(args.address, secured))
        source = args.address
    for path in write_tokenizer_files(files, args.directory, args.force):
        print(path)
    print(f"tokenizer of {source}; load it with "
          f"transformers.AutoTokenizer.from_pretrained({str(args.directory)!r})")
    return 0
