"""Worker step throughput: the per-sequence path vs the batched one, side by side.

For each batch size: decode tokens/s (every sequence one token per step, with
`--context` tokens already cached) and prefill tokens/s (every sequence's
`--prompt-len` prompt, packed into steps of at most `--max-step-tokens`).
Modes: `per-seq` (one forward and one sync per sequence: the old path, now
the tests' oracle, tests/gpu_worker/oracle.py),
`batched` (one forward per step, batch-invariant), `batched-tiles` (the
same, made to run in row tiles: the fallback, and the GPU's path before
fixed_gemm), `batched-eager` (the default step without CUDA graphs; on the
CPU the same as `batched`), `batched-fast` (one forward, no row tiles: not
invariant).
Also the prefill FLOP/s of a plain batched torch forward of the same shapes
(dense, no paging) and, on CUDA, the share of decode step wall time the GPU
is busy.

`--count-ops` adds the kernels of one decode step at each batch size and of
one 1,024-token prefill chunk: on the CPU leaf torch ops (views left out),
on a GPU the device's own. `--top-ops N` prints the N ops such a step and
chunk spend most time in, host and device. `--compare REV` runs this same script against git
revision REV's worker (a worktree) and this tree's, one after the other in
fresh processes, and prints both side by side.

Models are random-weight checkpoints written by `write_checkpoint` (nothing is
downloaded) and loaded through the worker's own loader: `llama-1b` has
Llama-3.2-1B's shapes, `llama-small` a shape a 2-core CPU runs in seconds, and
`tiny` is the built-in model.
Run: python -m bench.worker_bench [--model tiny] [--device auto] [--batches 1,16,64,256]
                                  [--count-ops] [--top-ops N] [--compare REV] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from gpu_worker.batched import default_row_tile
from gpu_worker.checkpoint import load_checkpoint, resolve_device
from gpu_worker.config import tiny_model_config
from gpu_worker.model import CausalLM, DecoderLayer, apply_rotary, build_tiny_model, fill_random
from gpu_worker.runner import ModelRunner, SeqWork
from kvstash.common.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, byte_tokenizer_json
from tests.gpu_worker.oracle import execute_per_sequence

SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                 "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 64, "tie_word_embeddings": True, "max_position_embeddings": 131072,
                 "rope_theta": 500000.0,
                 "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}},
    "llama-small": {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
                    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                    "head_dim": 64, "tie_word_embeddings": True, "max_position_embeddings": 4096,
                    "rope_theta": 500000.0},
}
MODES = ("per-seq", "batched", "batched-eager", "batched-tiles", "batched-fast")
DEFAULT_MODES = "per-seq,batched,batched-fast"


def write_checkpoint(directory: Path, shape: str, dtype: str = "bfloat16", seed: int = 0,
                     max_positions: int | None = None) -> None:
    """config.json, model.safetensors (fixed-seed random weights) and the
    tiny model's byte-level tokenizer.json (so a prompt sent as ASCII text,
    through smg, encodes to the same ids as sent as ids), as a Hugging Face
    Llama export lays them out;
    `max_positions` overrides the shape's max_position_embeddings (RoPE has
    no weights: the same weights serve longer sequences)."""
    from gpu_worker.hf_config import parse_model_config

    raw = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "bos_token_id": BYTE_BOS_ID, "eos_token_id": BYTE_EOS_ID,
           "dtype": dtype,
           **SHAPES[shape]}
    if max_positions is not None:
        raw["max_position_embeddings"] = max_positions
    model = CausalLM(parse_model_config(raw), getattr(torch, dtype), "cpu")
    fill_random(model, seed, std=0.02)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({n: p.contiguous() for n, p in model.named_parameters()},
              str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(raw, indent=1))
    (directory / "tokenizer.json").write_text(byte_tokenizer_json())


def load(model: str, dtype: torch.dtype, device: torch.device, workdir: Path) -> CausalLM:
    if model == "tiny":
        return build_tiny_model(tiny_model_config(), 0, dtype, device)
    write_checkpoint(workdir / model, model, str(dtype).removeprefix("torch."))
    return load_checkpoint(workdir / model, dtype, device).model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device: torch.device, fn: Callable[[], object], repeat: int = 1) -> float:
    """Best of `repeat` runs: on a shared machine the best is the least disturbed."""
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[(i * 7919 + j * 104729 + 3) % vocab for j in range(length)] for i in range(batch)]


def make_runner(model: CausalLM, mode: str, batch: int, tokens: int,
                row_tile: int | None = None) -> ModelRunner:
    per_seq = -(-tokens // 16)
    if mode == "batched-tiles":
        row_tile = row_tile or default_row_tile(model.device)
    return ModelRunner(model, block_size=16, num_blocks=batch * per_seq + 1,
                       batch_invariant=mode != "batched-fast", row_tile=row_tile,
                       cuda_graph_rows=0 if mode == "batched-eager" else None)


def tables(batch: int, tokens: int) -> list[list[int]]:
    per_seq = -(-tokens // 16)
    return [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]


def execute(runner: ModelRunner, seqs: list[SeqWork], batched: bool) -> list[int | None]:
    """One step: the runner's batched step, or the oracle's one forward per sequence."""
    return runner.execute(seqs) if batched else execute_per_sequence(runner, seqs)


def prefill(runner: ModelRunner, ids: list[list[int]], blocks: list[list[int]],
            max_step_tokens: int, batched: bool) -> None:
    """Whole prompts, as many per step as fit (one prompt may fill a step alone)."""
    step: list[SeqWork] = []
    for i, prompt in enumerate(ids):
        if step and sum(len(s.token_ids) for s in step) + len(prompt) > max_step_tokens:
            execute(runner, step, batched)
            step = []
        step.append(SeqWork(f"r{i}", prompt, 0, blocks[i], True))
    execute(runner, step, batched)


def decode(runner: ModelRunner, batch: int, context: int, blocks: list[list[int]],
           steps: int, batched: bool) -> None:
    last = [1] * batch
    for s in range(steps):
        seqs = [SeqWork(f"r{i}", [last[i]], context + s, blocks[i], True) for i in range(batch)]
        last = [t or 1 for t in execute(runner, seqs, batched)]


def dense_forward(model: CausalLM, ids: list[list[int]]) -> None:
    """The plain batched torch forward of the same shapes: every linear over all
    tokens at once, SDPA over [batch, heads, length], no paging, no tiles."""
    cfg = model.config
    tokens = torch.tensor(ids, device=model.device)
    batch, length = tokens.shape
    positions = torch.arange(length, device=model.device).repeat(batch)
    cos, sin = model.rotary(positions)

    def heads(t: torch.Tensor, n: int, rotate: bool) -> torch.Tensor:
        t = t.view(batch * length, n, cfg.head_dim)
        t = apply_rotary(t, cos, sin) if rotate else t
        return t.view(batch, length, n, cfg.head_dim).transpose(1, 2)

    with torch.inference_mode():
        x = model.model.embed_tokens(tokens.view(-1))
        for layer in model.model.layers:
            assert isinstance(layer, DecoderLayer)
            attn, mlp, h = layer.self_attn, layer.mlp, layer.input_layernorm(x)
            # One product each for q, k, v and for gate, up, as the worker's step.
            q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            q, k, v = attn.qkv(h).split((q_size, kv_size, kv_size), dim=-1)
            q, k = heads(q, cfg.num_heads, True), heads(k, cfg.num_kv_heads, True)
            v = heads(v, cfg.num_kv_heads, False)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch * length, -1))
            gate, up = mlp.gate_up(layer.post_attention_layernorm(x)).chunk(2, dim=-1)
            x = x + mlp.down_proj(F.silu(gate) * up)
        model.lm_head(model.model.norm(x.view(batch, length, -1)[:, -1]))


def prefill_flops(model: CausalLM, batch: int, length: int) -> float:
    """Matmul FLOPs of a prefill: 2 per weight per token, causal attention
    (QK and PV, half the square), the output head on the last token only."""
    cfg = model.config
    per_layer = (2 * cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                 + 2 * cfg.num_heads * cfg.head_dim * cfg.hidden_size
                 + 6 * cfg.hidden_size * cfg.intermediate_size)
    attention = 2 * 2 * cfg.num_heads * cfg.head_dim * length * (length + 1) / 2
    head = 2 * cfg.hidden_size * cfg.vocab_size
    return batch * (cfg.num_layers * (per_layer * length + attention) + head)


def gpu_busy(device: torch.device, fn: Callable[[], object]) -> float | None:
    """Kernel time over wall time while `fn` runs (CUDA only)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = timed(device, fn)
    busy_us = sum(e.self_device_time_total for e in prof.key_averages())
    return busy_us / 1e6 / wall


VIEWS = frozenset(f"aten::{op}" for op in (
    "view", "as_strided", "slice", "select", "transpose", "t", "permute", "unsqueeze", "squeeze",
    "expand", "_reshape_alias", "alias", "detach", "unbind", "split", "narrow", "reshape",
    "view_as", "empty", "empty_strided", "lift_fresh", "to", "result_type", "resolve_conj",
    "resolve_neg", "chunk", "contiguous"))


# The host's calls that put work on a CUDA stream: a graph's replay is one.
LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync"}


def kernels(device: torch.device, fn: Callable[[], object]) -> tuple[int, int | None]:
    """Kernels `fn` runs and, on CUDA, the host's launches: the device's own
    kernels (copies included; the CPU profiler's op count came out at 71 per
    decode step on an H200 for 16 layers, which cannot be) and the launch
    calls (LAUNCH_CALLS: a CUDA graph runs many kernels from one); on the
    CPU leaf torch ops, views and allocations left out, and no launches."""
    from torch.profiler import ProfilerActivity, profile

    if device.type == "cuda":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = prof.events()
        return (sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CPU
                    and e.name in LAUNCH_CALLS))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events()
               if e.name.startswith("aten::") and not e.cpu_children and e.name not in VIEWS), None


def bench_batch(model: CausalLM, mode: str, batch: int, args: argparse.Namespace
                ) -> dict[str, Any]:
    device, batched = model.device, mode != "per-seq"
    total = max(args.prompt_len, args.context) + args.steps + 1
    runner = make_runner(model, mode, batch, total, args.row_tile)
    blocks = tables(batch, total)
    ids = prompts(batch, args.prompt_len, model.config.vocab_size)
    prefill(runner, ids, blocks, args.max_step_tokens, batched)  # warm-up
    prefill_s = timed(device, lambda: prefill(runner, ids, blocks, args.max_step_tokens, batched),
                      args.repeat)
    ctx_ids = prompts(batch, args.context, model.config.vocab_size)
    prefill(runner, ctx_ids, blocks, args.max_step_tokens, True)
    decode(runner, batch, args.context, blocks, 1, batched)  # warm-up
    decode_s = timed(device, lambda: decode(runner, batch, args.context, blocks, args.steps,
                                            batched), args.repeat)
    busy = gpu_busy(device, lambda: decode(runner, batch, args.context, blocks, 2, batched))
    ops, launches = (kernels(device, lambda: decode(runner, batch, args.context, blocks, 1,
                                                    batched))
                     if args.count_ops else (None, None))
    return {"steps": steps_layout(runner, mode),
            "decode": batch * args.steps / decode_s, "prefill": batch * args.prompt_len / prefill_s,
            "prefill_tflops": prefill_flops(model, batch, args.prompt_len) / prefill_s / 1e12,
            "busy": busy, "decode_ops": ops, "decode_launches": launches}


def top_ops(device: torch.device, fn: Callable[[], object], n: int
            ) -> dict[str, list[tuple[str, float]]]:
    """Where `fn`'s time goes: the `n` torch ops with the most self time on the
    host and, on CUDA, the `n` with the most on the device (microseconds)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    averages = prof.key_averages()
    where = {"host": "self_cpu_time_total"}
    if device.type == "cuda":
        where["device"] = "self_device_time_total"
    return {side: [(e.key, getattr(e, attr)) for e in sorted(
                averages, key=lambda e: getattr(e, attr), reverse=True)[:n]
                   if getattr(e, attr) > 0]
            for side, attr in where.items()}


def print_top_ops(title: str, tops: dict[str, list[tuple[str, float]]]) -> None:
    for side, ops in tops.items():
        total = sum(us for _, us in ops)
        print(f"{title}, {side} time, top {len(ops)} ops ({total / 1e3:.2f} ms):")
        for name, us in ops:
            print(f"  {us / 1e3:9.3f} ms  {name}")


def steps_layout(runner: ModelRunner, mode: str) -> str:
    """How the mode's steps ran: whole (invariant), in row tiles (invariant,
    the fallback where the start-up check failed), plain (not invariant)."""
    if mode == "per-seq":
        return "per seq"
    if runner.batched.row_tile is None:
        return "plain"
    if not runner.batched.whole:
        return f"tiles {runner.batched.row_tile}"
    return "whole" if runner.batched.graphs is None else "graphs"


def prefill_chunk_ops(model: CausalLM, mode: str, length: int = 1024) -> int:
    """Kernels of one step prefilling `length` tokens of one sequence."""
    length = min(length, model.config.max_model_len)
    runner = make_runner(model, mode, 1, length)
    ids = prompts(1, length, model.config.vocab_size)
    prefill(runner, ids, tables(1, length), length, mode != "per-seq")  # warm-up
    return kernels(model.device,
                   lambda: prefill(runner, ids, tables(1, length), length, mode != "per-seq"))[0]


def compare(rev: str, argv: list[str]) -> None:
    """This script against REV's worker and this tree's, each in a fresh process."""
    here = Path(__file__).resolve().parent.parent
    script = Path(__file__).resolve()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), rev], cwd=here,
                       check=True)
        try:
            for name, tree in ((rev, base), ("this tree", here)):
                out = Path(tmp) / f"{len(results)}.json"
                print(f"--- {name}", flush=True)
                subprocess.run([sys.executable, str(script), *argv, "--json", str(out)], cwd=tree,
                               env={**os.environ, "PYTHONPATH": str(tree)}, check=True)
                results[name] = json.loads(out.read_text())
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=here,
                           check=True)
    old, new = results[rev], results["this tree"]
    print(f"\nside by side ({rev} -> this tree); prefill as a share of the dense ceiling")
    print(f"{'batch':>5} {'mode':<13} {'decode tok/s':>22} {'prefill tok/s':>24} "
          f"{'vs dense':>13} {'decode kernels':>15}")
    for key, row in new["rows"].items():
        was = old["rows"].get(key, {})

        def pair(field: str, fmt: str, row: dict[str, Any] = row, was: dict[str, Any] = was
                 ) -> str:
            a, b = was.get(field), row.get(field)
            return " -> ".join("-" if v is None else format(v, fmt) for v in (a, b))

        batch, mode = key.split(" ", 1)
        print(f"{batch:>5} {mode:<13} {pair('decode', '.0f'):>22} {pair('prefill', '.0f'):>24} "
              f"{pair('vs_dense', '.0%'):>13} {pair('decode_ops', 'd'):>15}")
    if "prefill_chunk_ops" in new:
        print(f"kernels per {new['chunk']}-token prefill chunk (batched): "
              f"{old.get('prefill_chunk_ops')} -> {new['prefill_chunk_ops']}")


def where_time_goes(model: CausalLM, batch: int, args: argparse.Namespace
                    ) -> dict[str, dict[str, list[tuple[str, float]]]]:
    """--top-ops: one batched decode step of `batch` rows and one prefill
    chunk of up to 1,024 tokens, each warmed up and then profiled."""
    device, length = model.device, min(1024, model.config.max_model_len)
    total = max(length, args.context) + 2
    runner = make_runner(model, "batched", batch, total, args.row_tile)
    blocks = tables(batch, total)
    prefill(runner, prompts(batch, args.context, model.config.vocab_size), blocks,
            args.max_step_tokens, True)
    decode(runner, batch, args.context, blocks, 1, True)  # warm-up
    chunk_runner = make_runner(model, "batched", 1, length, args.row_tile)
    ids, chunk_blocks = prompts(1, length, model.config.vocab_size), tables(1, length)
    prefill(chunk_runner, ids, chunk_blocks, length, True)  # warm-up
    tops = {f"decode step, batch {batch}": top_ops(
                device, lambda: decode(runner, batch, args.context, blocks, 1, True),
                args.top_ops),
            f"prefill chunk, {length} tokens": top_ops(
                device, lambda: prefill(chunk_runner, ids, chunk_blocks, length, True),
                args.top_ops)}
    for title, found in tops.items():
        print_top_ops(title, found)
    return tops


def tune_malloc_as_the_worker_does() -> None:
    """The worker's malloc settings (its main, then build_runner); a revision
    from before keep_large_tensors (--compare) ran without it."""
    from kvstash.common import malloc_tuning

    malloc_tuning.tune_malloc()
    if hasattr(malloc_tuning, "keep_large_tensors"):
        malloc_tuning.keep_large_tensors()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", *SHAPES], default="tiny")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (tiny: float32)")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps")
    parser.add_argument("--max-step-tokens", type=int, default=8192)
    parser.add_argument("--row-tile", type=int, default=None,
                        help="rows per tile in batched mode (default: the device's)")
    parser.add_argument("--repeat", type=int, default=3, help="timings keep the best of these")
    parser.add_argument("--write-checkpoint", type=Path, default=None,
                        help="only write the --model checkpoint into this directory")
    parser.add_argument("--top-ops", type=int, default=0, metavar="N",
                        help="also print the N ops a batched decode step (at the first batch "
                             "size) and a 1,024-token prefill chunk spend most time in, on the "
                             "host and on the device")
    parser.add_argument("--count-ops", action="store_true",
                        help="also count the kernels of a decode step and a 1,024-token chunk")
    parser.add_argument("--compare", metavar="REV", help="also run against git revision REV")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"unknown --modes {sorted(unknown)}: choose from {', '.join(MODES)}")
    if args.compare:
        rest = list(sys.argv[1:] if argv is None else argv)
        at = rest.index("--compare")
        compare(args.compare, rest[:at] + rest[at + 2:])
        return
    if args.write_checkpoint is not None:
        write_checkpoint(args.write_checkpoint, args.model, args.dtype or "bfloat16")
        return
    device = resolve_device(args.device)
    if device.type == "cpu":
        tune_malloc_as_the_worker_does()
    dtype = getattr(torch, args.dtype or ("float32" if args.model == "tiny" else "bfloat16"))
    with tempfile.TemporaryDirectory() as workdir:
        model = load(args.model, dtype, device, Path(workdir))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.model} {str(dtype).removeprefix('torch.')} on {name} "
          f"({torch.get_num_threads()} threads); prompt {args.prompt_len}, decode at context "
          f"{args.context}, {args.steps} timed decode steps")
    print(f"{'batch':>5} {'mode':<13} {'steps':<9} {'decode tok/s':>13} {'prefill tok/s':>14} "
          f"{'prefill TFLOP/s':>16} {'vs dense':>9} {'GPU busy':>9}"
          + (f" {'kernels':>8} {'launches':>8}" if args.count_ops else ""))
    rows: dict[str, dict[str, Any]] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        ids = prompts(batch, args.prompt_len, model.config.vocab_size)
        per_step = max(1, args.max_step_tokens // args.prompt_len)
        groups = [ids[i:i + per_step] for i in range(0, batch, per_step)]

        def dense(groups: list[list[list[int]]] = groups) -> None:
            for group in groups:
                dense_forward(model, group)

        dense()
        dense_tflops = (prefill_flops(model, batch, args.prompt_len)
                        / timed(device, dense, args.repeat) / 1e12)
        print(f"{batch:>5} {'dense torch':<13} {'':<9} {'':>13} {'':>14} {dense_tflops:>16.3f}")
        for mode in args.modes.split(","):
            r = bench_batch(model, mode, batch, args)
            busy = "n/a" if r["busy"] is None else f"{r['busy']:.0%}"
            ratio = (r["prefill_tflops"] or 0.0) / dense_tflops
            ops = ("" if r["decode_ops"] is None
                   else f" {r['decode_ops']:>8} {r['decode_launches'] or '-':>8}")
            print(f"{batch:>5} {mode:<13} {r['steps']:<9} {r['decode']:>13.1f} "
                  f"{r['prefill']:>14.1f} {r['prefill_tflops']:>16.3f} {ratio:>9.0%} "
                  f"{busy:>9}{ops}", flush=True)
            rows[f"{batch} {mode}"] = {**r, "vs_dense": ratio}
    summary: dict[str, Any] = {"model": args.model, "prompt_len": args.prompt_len, "rows": rows}
    if args.count_ops:
        summary["chunk"] = min(1024, model.config.max_model_len)
        summary["prefill_chunk_ops"] = prefill_chunk_ops(model, "batched")
        print(f"kernels per {summary['chunk']}-token prefill chunk (batched): "
              f"{summary['prefill_chunk_ops']}")
    if args.top_ops > 0:
        summary["top_ops"] = where_time_goes(model, int(args.batches.split(",")[0]), args)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
