"""Loading a model: the built-in tiny one, or a local Llama / Qwen2 directory.

A checkpoint directory holds `config.json`, one or more `*.safetensors` files
with Hugging Face tensor names (those `model.safetensors.index.json` lists,
where there is one), and `tokenizer.json`. Nothing is downloaded.
Tensor names, shapes and dtypes, as the files' headers give them, are checked
against config.json before the model is allocated, so a wrong checkpoint fails
with every problem named instead of half-loading (or, where config.json is far
larger than its weights, failing to allocate).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from gpu_worker.config import AUTO_DTYPE, TINY_MODEL, ModelConfig, WorkerConfig, tiny_model_config
from gpu_worker.hf_config import checkpoint_dtype, parse_model_config, served_name
from gpu_worker.model import CausalLM, build_tiny_model, parameter_shapes

# Older Llama exports store the rotary table; it is recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Bytes of each end of each tensor that weights_id reads.
_SAMPLED_BYTES = 4096


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str
    model: CausalLM
    # What tells its weights from any other's (`weights_id`): two checkpoints
    # of one name and shape (a fine-tune beside its base, both mounted at
    # /models) must never read each other's KV from the prefix tier.
    weights_id: str
    tokenizer_json: str  # "" = the byte-level tokenizer of the tiny model
    # The checkpoint's tokenizer_config.json with its chat template; "" = none.
    tokenizer_config_json: str = ""


TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# safetensors' names for the same dtypes.
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
                       "BF16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {list(TORCH_DTYPES)}, got {name!r}")
    return TORCH_DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """`cuda:N` also becomes the current CUDA device: Triton's kernels
    (fixed_gemm) and CUDA graph capture (step_graphs) run on the current
    device, not on the one their tensors name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but torch sees no CUDA device")
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} requested but torch sees "
                             f"{torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(device)
    return device


def load_model(config: WorkerConfig) -> LoadedModel:
    """dtype auto: the checkpoint's own; for the tiny model float64, the dtype in
    which greedy outputs are the exact oracle the tests compare against."""
    device = resolve_device(config.device)
    auto = config.dtype == AUTO_DTYPE
    if config.model == TINY_MODEL:
        dtype = torch.float64 if auto else torch_dtype(config.dtype)
        model = build_tiny_model(tiny_model_config(), config.seed, dtype, device)
        return LoadedModel(TINY_MODEL, model, f"{TINY_MODEL}-seed-{config.seed}", "")
    return load_checkpoint(Path(config.model), None if auto else torch_dtype(config.dtype),
                           device)


class _Stored(NamedTuple):
    """Where and how a checkpoint stores one tensor."""

    path: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "I8", "F8_E4M3", ...


@contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """safe_open, a truncated, corrupt or unreadable file (an interrupted download,
    a broken symlink) a ValueError naming it; so is one torch cannot map (a
    RuntimeError: larger than RAM + swap), and only at the open."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None
    with handle as f:
        yield f


def _weight_files(directory: Path) -> list[Path]:
    """The shards `model.safetensors.index.json` names, as vLLM reads them (a
    stale single-file export beside them is no part of the model); without an
    index, every *.safetensors file."""
    index_path = directory / "model.safetensors.index.json"
    if not index_path.is_file():
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {directory}")
        return files
    weight_map = _read_json(index_path).get("weight_map")
    if (not isinstance(weight_map, dict) or not weight_map
            or any(type(f) is not str for f in weight_map.values())):
        raise ValueError(f"{index_path} has no weight_map of tensor names to file names")
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:  # an interrupted download: named, not as every tensor it holds
        raise ValueError(f"{index_path.name} lists shards that {directory} lacks: "
                         f"{', '.join(missing)}")
    return [directory / n for n in names]


def _tensor_index(directory: Path) -> dict[str, _Stored]:
    """Every tensor name in the checkpoint's safetensors files -> where and how stored."""
    index: dict[str, _Stored] = {}
    for path in _weight_files(directory):
        with _opened(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in index:
                    raise ValueError(f"tensor {name} is in both {index[name].path} and {path}")
                stored = f.get_slice(name)
                index[name] = _Stored(path, tuple(stored.get_shape()), stored.get_dtype())
    return index


def check_tensors(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]],
                  optional: set[str]) -> None:
    """Raises ValueError listing every missing, unexpected and mis-shaped tensor."""
    problems = [f"missing tensor {n} (want shape {list(s)})"
                for n, s in expected.items() if n not in found]
    problems += [f"unexpected tensor {n} (shape {list(s)})" for n, s in found.items()
                 if n not in expected and n not in optional
                 and not n.endswith(_IGNORED_SUFFIXES)]
    problems += [f"tensor {n} has shape {list(found[n])}, want {list(s)}"
                 for n, s in expected.items() if n in found and found[n] != s]
    if problems:
        raise ValueError("checkpoint does not match config.json: " + "; ".join(problems))


def check_checkpoint(cfg: ModelConfig, index: dict[str, _Stored]) -> None:
    """Raises ValueError naming every tensor of `index` that a model of `cfg` would not take."""
    # Counted first: parameter_shapes lists each layer config.json names, however many.
    layers = {n.split(".")[2] for n in index if n.startswith("model.layers.")}
    if len(layers) != cfg.num_layers:
        raise ValueError(f"checkpoint does not match config.json: num_hidden_layers is "
                         f"{cfg.num_layers}, the checkpoint has {len(layers)} layers")
    expected = parameter_shapes(cfg)  # a tied lm_head appears once, as the embedding
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    check_tensors(expected, {n: stored.shape for n, stored in index.items()}, optional)
    # copy_ would cast integer or float8 codes to floats without a word: the
    # weights of a quantized export whose config.json names no quantization.
    not_float = [f"{n} is {index[n].dtype}" for n in expected
                 if index[n].dtype not in _SAFETENSORS_DTYPES]
    if not_float:
        raise ValueError(f"checkpoint tensors must be one of {sorted(_SAFETENSORS_DTYPES)} "
                         f"(quantized weights are not supported): {'; '.join(not_float[:8])}")


@torch.no_grad()
def load_weights(model: CausalLM, index: dict[str, _Stored]) -> None:
    """Copies the tensors of an index that check_checkpoint passed into `model`."""
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(index[name].path, []).append(name)
    for path, names in by_file.items():
        with _opened(path) as f:
            for name in names:
                params[name].copy_(f.get_tensor(name))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as exc:  # the JSON or UTF-8 error alone would not name the file
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if isinstance(data, dict):
        return data
    raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object")


def _read_tokenizer(path: Path, vocab_size: int) -> str:
    """tokenizer.json's text, checked here: the scheduler loads it only once this
    worker serves (a traceback there), and a prompt with an id past vocab_size fails."""
    try:
        text = path.read_text(encoding="utf-8")
        top = max(Tokenizer.from_str(text).get_vocab(with_added_tokens=True).values(), default=0)
    except Exception as exc:  # tokenizers raises a bare Exception
        raise ValueError(f"{path} is not a tokenizer the tokenizers library reads: {exc}") from None
    if top >= vocab_size:  # an added token's id too
        raise ValueError(f"{path}: token ids up to {top}, config.json's vocab_size {vocab_size}")
    return text


def _stored_dtype(index: dict[str, _Stored]) -> torch.dtype:
    """The dtype of the first floating-point tensor as stored on disk."""
    for _, stored in sorted(index.items()):
        if stored.dtype in _SAFETENSORS_DTYPES:
            return _SAFETENSORS_DTYPES[stored.dtype]
    raise ValueError(f"checkpoint holds no tensor of dtype {sorted(_SAFETENSORS_DTYPES)}; "
                     "pass --dtype")


def load_checkpoint(directory: Path, dtype: torch.dtype | None,
                    device: torch.device) -> LoadedModel:
    """dtype None = the checkpoint's own: config.json's `dtype` / `torch_dtype`,
    else that of its stored tensors. Any problem is a ValueError (the CLI's
    message and exit 2), an unreadable file's too."""
    try:
        return _load_checkpoint(directory, dtype, device)
    except OSError as exc:  # its message names the file
        raise ValueError(f"cannot read checkpoint {directory}: {exc}") from None


def _load_checkpoint(directory: Path, dtype: torch.dtype | None,
                     device: torch.device) -> LoadedModel:
    config_path, tokenizer_path = directory / "config.json", directory / "tokenizer.json"
    for required in (config_path, tokenizer_path):
        if not required.is_file():
            # A Hub snapshot copied without -L: its files link to ../../blobs.
            broken = " (a broken symlink)" if required.is_symlink() else ""
            raise ValueError(f"checkpoint directory {directory} has no {required.name}{broken}")
    generation_path = directory / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else None
    raw = _read_json(config_path)
    cfg = parse_model_config(raw, generation)
    index = _tensor_index(directory)
    if dtype is None:
        declared = checkpoint_dtype(raw)
        dtype = torch_dtype(declared) if declared is not None else _stored_dtype(index)
    tokenizer = _read_tokenizer(tokenizer_path, cfg.vocab_size)
    config = tokenizer_config(directory)  # a bad one fails before the weights load
    check_checkpoint(cfg, index)
    model = CausalLM(cfg, dtype, device)
    load_weights(model, index)
    return LoadedModel(served_name(directory), model.eval(), weights_id(directory), tokenizer,
                       config)


def weights_id(directory: Path) -> str:
    """A digest of config.json and of each weight file's header (each
    tensor's name, dtype, shape and place) and each tensor's first and last
    bytes: a fine-tune changes every element of what it tunes, and reading
    only these keeps it to milliseconds where hashing all of an 8B model's
    16 GB would take tens of seconds a start."""
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for path in _weight_files(directory):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = f.read(header_len)
            digest.update(header)
            for name, meta in sorted(json.loads(header).items()):
                if name == "__metadata__":
                    continue
                begin, end = meta["data_offsets"]
                for offset in sorted({begin, max(begin, end - _SAMPLED_BYTES)}):
                    f.seek(8 + header_len + offset)
                    digest.update(f.read(min(_SAMPLED_BYTES, end - offset)))
    return digest.hexdigest()[:32]


def tokenizer_config(directory: Path) -> str:
    """The directory's tokenizer_config.json, with the chat template of a
    chat_template.jinja beside it (where newer exports keep it) folded in;
    "" when it has neither."""
    path, template = directory / "tokenizer_config.json", directory / "chat_template.jinja"
    config = _read_json(path) if path.is_file() else {}
    if template.is_file() and "chat_template" not in config:
        config["chat_template"] = template.read_text(encoding="utf-8")
    return json.dumps(config) if config else ""
