"""Loading a local Llama / Qwen2 checkpoint directory written by the test itself."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from gpu_worker.checkpoint import load_checkpoint, tokenizer_config
from gpu_worker.config import WorkerConfig
from gpu_worker.hf_config import parse_model_config
from gpu_worker.model import CausalLM, fill_random, parameter_shapes
from gpu_worker.runner import SeqWork, build_runner
from gpu_worker.server import info_proto
from kvstash.common.tokenizer import load_tokenizer
from tests.gpu_worker.oracle import reference_forward

WORDS = ["[UNK]", "<eos>", "hello", "world", "the", "cache", "stash", "kv", "blocks"]

QWEN2 = {
    "model_type": "qwen2", "vocab_size": 40, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 256,
    "tie_word_embeddings": True, "eos_token_id": [1, 2], "torch_dtype": "bfloat16",
}
LLAMA = {
    "model_type": "llama", "vocab_size": 40, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 24,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 512,
    "tie_word_embeddings": False, "attention_bias": False, "eos_token_id": 1,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


def tokenizer_json() -> str:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def write_checkpoint(directory: Path, raw: dict[str, Any], shards: int = 2,
                     edit: dict[str, torch.Tensor | None] | None = None,
                     dtype: torch.dtype = torch.float32) -> CausalLM:
    """Writes config.json, model-*.safetensors (tensors in `dtype`) and
    tokenizer.json; returns the model whose tensors were written (`edit`
    replaces or, with None, drops some)."""
    source = CausalLM(parse_model_config(raw), torch.float32)
    fill_random(source, seed=5)
    tensors = {n: p.detach().to(dtype).contiguous() for n, p in source.named_parameters()}
    for name, value in (edit or {}).items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    names = sorted(tensors)
    for i in range(shards):
        save_file({n: tensors[n] for n in names[i::shards]},
                  str(directory / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    (directory / "config.json").write_text(json.dumps(raw))
    (directory / "tokenizer.json").write_text(tokenizer_json())
    return source


@pytest.mark.parametrize("raw", [QWEN2, LLAMA], ids=["qwen2", "llama"])
def test_loaded_checkpoint_matches_model_built_from_same_tensors(
        tmp_path: Path, raw: dict[str, Any]) -> None:
    source = write_checkpoint(tmp_path, raw)
    loaded = load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))
    cfg = loaded.model.config
    assert cfg.attention_bias == (raw["model_type"] == "qwen2")
    assert cfg.head_dim == raw.get("head_dim", 16)
    assert loaded.model.model.layers[0].self_attn.k_proj.weight.shape[0] == (
        raw["num_key_value_heads"] * cfg.head_dim)
    tokens = torch.tensor([2, 3, 4, 5, 6, 7, 8, 3, 2, 30, 31])
    assert torch.equal(reference_forward(loaded.model, tokens), reference_forward(source, tokens))


def test_worker_config_directory_gives_runner_and_tokenizer(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, QWEN2, shards=1)
    runner = build_runner(WorkerConfig(model=str(tmp_path), block_size=4, num_blocks=8))
    assert runner.name == tmp_path.name
    info = info_proto(runner)  # what the scheduler tells gateways the model is
    assert (info.model_type, list(info.architectures)) == ("qwen2", ["Qwen2ForCausalLM"])
    assert runner.model_config.eos_token_ids == (1, 2)
    assert runner.max_model_len == 256
    tok = load_tokenizer(runner.tokenizer_json, runner.model_config.vocab_size,
                         runner.model_config.eos_token_ids)
    ids = tok.encode("hello the kv cache")
    assert ids == [2, 4, 7, 5]
    assert tok.decode(ids) == "hello the kv cache"
    [token] = runner.execute([SeqWork("r", ids, 0, [0], sample=True)])
    assert token is not None and 0 <= token < 40


@pytest.mark.parametrize("relative", [".", "./", "sub/.."])
def test_a_relative_directory_is_named_after_the_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, relative: str) -> None:
    """`kvstash up --model .` served a model named "." (what clients had to send)."""
    write_checkpoint(tmp_path, QWEN2, shards=1)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_checkpoint(Path(relative), torch.float32, torch.device("cpu")).name == (
        tmp_path.name)


@pytest.mark.parametrize(("repo", "name"), [("models--acme--Tiny-Llama-1B", "acme/Tiny-Llama-1B"),
                                             ("models--gpt2", "gpt2")], ids=["org", "no org"])
def test_a_hub_cache_snapshot_is_named_by_its_repo_not_its_revision(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repo: str, name: str) -> None:
    """`--model ~/.cache/huggingface/hub/models--ORG--NAME/snapshots/<hash>`
    served a model named by the hash (what /v1/models listed and clients had
    to send); it is ORG/NAME, as the Hub names it. Its files link to
    ../../blobs, as the Hub writes them."""
    blobs, snapshot = tmp_path / repo / "blobs", tmp_path / repo / "snapshots" / ("9f" * 20)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    write_checkpoint(blobs, QWEN2, shards=1)
    for blob in blobs.iterdir():
        (snapshot / blob.name).symlink_to(Path("../../blobs") / blob.name)
    runner = build_runner(WorkerConfig(model=str(snapshot), block_size=4, num_blocks=8))
    assert info_proto(runner).model_name == name
    monkeypatch.chdir(snapshot)
    assert load_checkpoint(Path("."), torch.float32, torch.device("cpu")).name == name
    assert load_checkpoint(blobs, torch.float32, torch.device("cpu")).name == "blobs"


def test_bfloat16_load_casts(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, LLAMA)
    loaded = load_checkpoint(tmp_path, torch.bfloat16, torch.device("cpu"))
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16
    logits = reference_forward(loaded.model, torch.tensor([2, 3, 4]))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"model.norm.weight": None}, r"missing tensor model.norm.weight \(want shape \[64\]\)"),
        ({"model.layers.1.self_attn.k_proj.weight": torch.zeros(64, 64)},
         r"tensor model.layers.1.self_attn.k_proj.weight has shape \[64, 64\], want \[24, 64\]"),
        ({"model.layers.0.mlp.extra.weight": torch.zeros(3)},
         r"unexpected tensor model.layers.0.mlp.extra.weight \(shape \[3\]\)"),
        # Quantized codes under the plain names, no quantization_config: never
        # cast to floats and served.
        ({"model.layers.0.mlp.up_proj.weight": torch.ones(96, 64, dtype=torch.int8)},
         r"quantized weights are not supported\): model.layers.0.mlp.up_proj.weight is I8"),
        ({"lm_head.weight": torch.ones(40, 64).to(torch.float8_e4m3fn)},
         r"lm_head.weight is F8_E4M3"),
    ],
)
def test_mismatched_tensors_are_named(tmp_path: Path, edit: dict[str, torch.Tensor | None],
                                      message: str) -> None:
    write_checkpoint(tmp_path, LLAMA, edit=edit)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))


def write_index(directory: Path) -> None:
    """model.safetensors.index.json for the shards in `directory`, as transformers writes it."""
    weight_map = {}
    for shard in sorted(directory.glob("model-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            weight_map |= dict.fromkeys(f.keys(), shard.name)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def test_the_index_names_the_shards_that_are_read(tmp_path: Path) -> None:
    """A stale single-file export beside the shards (vLLM and transformers
    load the directory) was refused: each tensor "is in both"."""
    source = write_checkpoint(tmp_path, LLAMA, shards=3)
    write_index(tmp_path)
    stale = CausalLM(parse_model_config(LLAMA), torch.float32)
    fill_random(stale, seed=9)
    save_file({n: p.detach().contiguous() for n, p in stale.named_parameters()},
              str(tmp_path / "model.safetensors"))
    loaded = load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))
    tokens = torch.tensor([2, 3, 4, 5, 6, 7, 8])
    assert torch.equal(reference_forward(loaded.model, tokens), reference_forward(source, tokens))


def test_a_shard_the_index_lists_but_the_directory_lacks_is_named(tmp_path: Path) -> None:
    """An interrupted download: the shard is named, not each tensor it held."""
    write_checkpoint(tmp_path, LLAMA, shards=3)
    write_index(tmp_path)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model.safetensors.index.json lists shards that .* "
                                         r"lacks: model-00002-of-00003.safetensors$"):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ["a"]}')
    with pytest.raises(ValueError, match="has no weight_map of tensor names to file names"):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))


def test_truncated_safetensors_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, LLAMA, shards=1)
    shard = next(tmp_path.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])  # an interrupted download
    with pytest.raises(ValueError, match=f"{shard.name} is not a readable safetensors file"):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))


def test_a_shard_larger_than_memory_is_a_value_error_naming_it(tmp_path: Path) -> None:
    """torch maps a shard privately, which the kernel refuses past RAM + swap
    (a transformers 5 shard holds up to 50 GB): was a RuntimeError traceback.
    Sparse: nothing is written but the header."""
    write_checkpoint(tmp_path, LLAMA, shards=1)
    size = max(2**41, 4 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    header = json.dumps({"x": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}})
    shard = tmp_path / "model-00001-of-00001.safetensors"
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.truncate(8 + len(header) + size)
    # Where the kernel always overcommits (vm.overcommit_memory 1) it maps,
    # and is refused for what it holds.
    refused = f"{shard.name} is not a readable safetensors file|the checkpoint has 0 layers"
    with pytest.raises(ValueError, match=refused):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # config.json of another (bigger) model beside these weights
        ({"vocab_size": 2**60}, r"model.embed_tokens.weight has shape \[40, 64\], "
                                r"want \[1152921504606846976, 64\]"),
        ({"num_hidden_layers": 2**40}, "num_hidden_layers is 1099511627776, the checkpoint "
                                       "has 2 layers"),
    ],
)
def test_config_larger_than_its_checkpoint_is_named_before_allocating(
        tmp_path: Path, edit: dict[str, int], message: str) -> None:
    write_checkpoint(tmp_path, LLAMA, shards=1)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **edit}))
    with pytest.raises(ValueError, match=f"does not match config.json: .*{message}"):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("raw", [QWEN2, LLAMA, {**LLAMA, "tie_word_embeddings": True}],
                         ids=["qwen2", "llama", "tied"])
def test_parameter_shapes_are_those_of_the_model(raw: dict[str, Any]) -> None:
    cfg = parse_model_config(raw)
    model = CausalLM(cfg, torch.float32, torch.device("meta"))
    assert parameter_shapes(cfg) == {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_absurd_max_position_embeddings_is_a_clear_error(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, {**LLAMA, "max_position_embeddings": 2**62}, shards=1)
    config = WorkerConfig(model=str(tmp_path), block_size=4, num_blocks=8, device="cpu")
    with pytest.raises(ValueError, match=r"max_position_embeddings 4611686018427387904 is more "
                                         r"than the 16777216 positions .* --max-model-len"):
        build_runner(config)
    config = WorkerConfig(model=str(tmp_path), block_size=4, num_blocks=8, device="cpu",
                          max_model_len=64)
    assert build_runner(config).max_model_len == 64


def test_stale_rotary_tables_are_ignored(tmp_path: Path) -> None:
    # A stored (here: all-zero) rotary table is neither refused as an unknown
    # tensor nor used: RoPE comes from the config, as without the table.
    stale = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(12)}
    source = write_checkpoint(tmp_path, LLAMA, edit=stale)
    loaded = load_checkpoint(tmp_path, torch.float32, torch.device("cpu")).model
    tokens = torch.tensor([2, 3, 4, 5, 6, 7, 8])
    torch.testing.assert_close(reference_forward(loaded, tokens), reference_forward(source, tokens))


def test_directory_problems_are_explained(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, LLAMA)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not one of"):
        parse_model_config({**LLAMA, "model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"config\.json lacks 'hidden_size'"):
        parse_model_config({k: v for k, v in LLAMA.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        parse_model_config({**LLAMA, "rope_scaling": {"type": "yarn", "factor": 2.0}})


@pytest.mark.parametrize("name", ["config.json", "generation_config.json",
                                  "tokenizer_config.json"])
def test_unparsable_json_names_its_file(tmp_path: Path, name: str) -> None:
    """Not only "Expecting value: line 1 column 1": which of the files is it?"""
    write_checkpoint(tmp_path, QWEN2, shards=1)
    (tmp_path / name).write_bytes(b"\xff{")
    with pytest.raises(ValueError, match=rf"{name} is not valid JSON"):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))


def test_a_broken_symlink_is_named_as_one(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, QWEN2, shards=1)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").symlink_to(Path("../../blobs/0123abcd"))
    with pytest.raises(ValueError, match=r"has no config\.json \(a broken symlink\)"):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("content", [b"{not json", b'{"model": {"type": "BPE"}}', b"\xff\xfe"],
                         ids=["not-json", "no-vocab", "not-utf8"])
def test_an_unreadable_tokenizer_is_refused_at_load(tmp_path: Path, content: bytes) -> None:
    """Not served: the scheduler, which parses it only once this worker is up,
    failed there with a traceback."""
    write_checkpoint(tmp_path, QWEN2, shards=1)
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a tokenizer"):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(("num_words", "added"), [(41, []), (40, ["<pad>"])],
                         ids=["vocabulary", "added token"])
def test_a_tokenizer_with_ids_past_the_vocab_size_is_refused_at_load(
        tmp_path: Path, num_words: int, added: list[str]) -> None:
    """Served, a prompt holding such a token (id 40 of a vocab_size of 40)
    was refused mid-serving: outside the model's vocabulary."""
    write_checkpoint(tmp_path, QWEN2, shards=1)  # vocab_size 40
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(num_words)}, unk_token="w0"))
    tok.add_special_tokens(added)
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    with pytest.raises(ValueError, match=r"tokenizer\.json: token ids up to 40, config\.json's "
                                         r"vocab_size 40$"):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias=True is not supported"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
         "rope_type='dynamic' is not supported: only default, llama3"),
        ({"rope_scaling": None, "rope_parameters": {"rope_type": "default",
                                                    "partial_rotary_factor": 0.5}},
         "partial_rotary_factor=0.5 is not supported"),
        ({"partial_rotary_factor": 0.25}, "partial_rotary_factor=0.25 is not supported"),
        ({"rope_scaling": None, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
         "rope_parameters.full_attention=.* per-layer-type RoPE"),
        ({"layer_types": ["full_attention", "sliding_attention"]},
         "layer_types='sliding_attention' is not supported"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096},
         "use_sliding_window=True is not supported"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}},
         "quantization_config='awq' is not supported"),
        ({"head_dim": None, "num_attention_heads": 3},
         "hidden_size=64 is not supported: not a multiple of num_attention_heads 3"),
    ],
)
def test_unsupported_math_is_refused_by_name(edit: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_model_config({**LLAMA, **edit})


def test_a_null_tie_word_embeddings_is_untied_as_transformers_reads_it() -> None:
    assert not parse_model_config({**LLAMA, "tie_word_embeddings": None}).tie_word_embeddings


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"num_attention_heads": None}, "num_attention_heads=None: expected a positive integer"),
        ({"vocab_size": None}, "vocab_size=None: expected a positive integer"),
        ({"max_position_embeddings": None}, "max_position_embeddings=None: expected a positive"),
        ({"hidden_size": 64.0}, "hidden_size=64.0: expected a positive integer"),
        ({"num_hidden_layers": True}, "num_hidden_layers=True: expected a positive integer"),
        ({"num_key_value_heads": 0}, "num_key_value_heads=0: expected a positive integer"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps='1e-5': expected a finite number"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false': expected true or false"),
        ({"eos_token_id": 1.0}, r"eos_token_id=1.0: expected a token id or a list of them"),
        ({"eos_token_id": [1, "2"]}, r"eos_token_id=\[1, '2'\]: expected a token id"),
        ({"layer_types": 3}, "layer_types=3: expected a list"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": None, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0}},
         "rope_parameters.factor=None: expected a finite number"),
        ({"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0}}, "lacks 'rope_parameters.factor'"),
        ({"rope_theta": [5e5]}, r"rope_theta=\[500000.0\]: expected a finite number"),
        # transformers warns and runs; here it divided rotary speeds by 0: NaN logits
        ({"rope_scaling": {"rope_type": "llama3", "factor": 0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0}},
         r"rope_parameters.factor=0.0 is not supported: a Llama 3 factor must be > 0"),
        # Each divided by (a ZeroDivisionError at start), or their difference.
        *[({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": low,
                             "high_freq_factor": high}},
           f"low_freq_factor={low:.1f} is not supported: a Llama 3 scaling needs 0 < "
           rf"low_freq_factor < high_freq_factor \({high:.1f}\)")
          for low, high in ((0, 4), (1, 0), (2, 2), (4, 1), (-1, 4))],
    ],
)
def test_malformed_config_values_are_value_errors(edit: dict[str, Any], message: str) -> None:
    """Not a TypeError: the CLI reports a ValueError as a message and exit 2."""
    with pytest.raises(ValueError, match=message):
        parse_model_config({**LLAMA, **edit})


def test_both_rope_layouts_and_defaults() -> None:
    new_layout = {k: v for k, v in LLAMA.items() if k not in ("rope_theta", "rope_scaling")}
    new_layout["rope_parameters"] = {**LLAMA["rope_scaling"], "rope_theta": 500000.0}
    assert parse_model_config(new_layout) == parse_model_config(LLAMA)
    cfg = parse_model_config(new_layout)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is not None
    assert cfg.rope_scaling.factor == 8.0
    qwen = parse_model_config({**QWEN2, "rope_parameters": {"rope_type": "default",
                                                            "rope_theta": 1e6}})
    assert qwen.rope_theta == 1e6 and qwen.rope_scaling is None
    # Both dicts present, theta only in rope_parameters: it is still read.
    both = {**new_layout, "rope_scaling": LLAMA["rope_scaling"]}
    assert parse_model_config(both).rope_theta == 500000.0
    bare = parse_model_config({k: v for k, v in QWEN2.items() if k != "rope_theta"})
    assert bare.rope_theta == 10000.0  # transformers' own default
    # A Qwen2 export that names a window it does not use loads as full attention.
    assert parse_model_config({**QWEN2, "sliding_window": 131072, "use_sliding_window": False,
                               "layer_types": ["full_attention"] * 2}).attention_bias


def test_eos_ids_merge_generation_config(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, LLAMA)  # config.json: eos 1
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1, 2]}))
    loaded = load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))
    assert loaded.model.config.eos_token_ids == (1, 3, 2)
    assert parse_model_config({**QWEN2, "eos_token_id": None}, {"eos_token_id": 7}
                              ).eos_token_ids == (7,)


@pytest.mark.parametrize(
    ("fields", "want"),
    [({"dtype": "float16"}, torch.float16), ({"torch_dtype": "bfloat16"}, torch.bfloat16),
     ({}, torch.float16)],  # none declared: the stored tensors' own (float16 here)
    ids=["dtype", "torch_dtype", "stored"],
)
def test_auto_dtype_reads_the_checkpoint(tmp_path: Path, fields: dict[str, str],
                                         want: torch.dtype) -> None:
    write_checkpoint(tmp_path, {**LLAMA, **fields}, shards=1, dtype=torch.float16)
    runner = build_runner(WorkerConfig(model=str(tmp_path), block_size=4, num_blocks=8))
    assert runner.dtype == want and runner.layout.dtype == str(want).removeprefix("torch.")


def test_auto_dtype_refuses_an_unknown_one_and_tiny_is_float64(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, {**LLAMA, "dtype": "float8_e4m3fn"}, shards=1)
    with pytest.raises(ValueError, match=r"dtype='float8_e4m3fn' is not supported.*--dtype"):
        load_checkpoint(tmp_path, None, torch.device("cpu"))
    assert load_checkpoint(tmp_path, torch.float32, torch.device("cpu")).model.dtype == (
        torch.float32)  # an explicit --dtype wins
    assert build_runner(WorkerConfig(num_blocks=4)).dtype == torch.float64
    assert build_runner(WorkerConfig(num_blocks=4, dtype="float32")).dtype == torch.float32


def test_the_tokenizer_config_and_chat_template_are_passed_on(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, QWEN2, shards=1)
    assert tokenizer_config(tmp_path) == ""  # neither file
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert json.loads(tokenizer_config(tmp_path)) == {
        "chat_template": "{{ messages[0].content }}"}
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    runner = build_runner(WorkerConfig(model=str(tmp_path), block_size=4, num_blocks=8))
    assert json.loads(runner.tokenizer_config_json) == {
        "eos_token": "<eos>", "chat_template": "{{ messages[0].content }}"}
    # The config's own template wins over the file beside it.
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "own"}')
    assert json.loads(tokenizer_config(tmp_path))["chat_template"] == "own"
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json holds a JSON list"):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))


def test_weights_of_one_name_and_shape_are_told_apart(tmp_path: Path) -> None:
    """A fine-tune mounted where its base was (the chart's /models) must not
    share prefix-tier segments with it: the weights id, which salts their
    ids, follows the tensors' bytes, not the directory's name."""
    base, tuned = tmp_path / "a" / "models", tmp_path / "b" / "models"
    base.mkdir(parents=True)
    tuned.mkdir(parents=True)
    source = write_checkpoint(base, LLAMA)
    weight = source.model.layers[1].mlp.down_proj.weight.detach()
    nudged = weight.contiguous().clone()
    nudged[-1, -1] += 1e-3  # one element, at the tensor's end
    write_checkpoint(tuned, LLAMA, edit={"model.layers.1.mlp.down_proj.weight": nudged})
    ids = [build_runner(WorkerConfig(model=str(d), block_size=4, num_blocks=8)).weights_id
           for d in (base, base, tuned)]
    assert ids[0] == ids[1] != ids[2]
    assert info_proto(build_runner(WorkerConfig(model=str(base), block_size=4, num_blocks=8))
                      ).weights_id == ids[0]
    tiny = [build_runner(WorkerConfig(num_blocks=4, seed=seed)).weights_id for seed in (0, 1)]
    assert tiny[0] != tiny[1]
