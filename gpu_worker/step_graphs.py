"""CUDA graphs of a whole step's token-wise work: a step of Llama-3.2-1B
replays 17 graphs and runs 16 attention calls where it launched 660 kernels
one by one (196 launches in all; on an H100 a lone decode 2.9x as fast).

A whole step (batched.py) runs, per layer, token-wise pieces whose shapes
follow only the padded row count, and between them the cache write and paged
attention, whose shapes follow the sequences' lengths. The first are graphs,
the second run as they are:

    graph 0        embed, rotary rows, layer 0: norm -> q, k, v -> rotary
    eager          layer 0: write k, v into their slots; attention -> attended
    graph i        layer i-1: o_proj + residual -> norm -> MLP + residual,
                   layer i: norm -> q, k, v -> rotary
    ...
    graph L        layer L-1's rest: the step's hidden rows

A row count's graphs are captured the first time a step of that size runs
(tens of ms), up to `max_rows` (longer steps are bound by their kernels, not
by launching them), from static buffers the step's token ids and positions
are copied into; a row count whose capture fails (out of memory, say, or
no CUDA at all) runs op by op from then on, with one warning. All sets
share one memory pool: they replay one after the other on one stream, so
what one frees the next may reuse. A set keeps its
inputs, one layer's q, k, v and attention output, and its hidden rows:
about 15 KiB a row at Llama-3.2-1B's shapes in bf16.
A replay runs the eager step's kernels on the eager step's shapes, so every
real row's bits are the eager step's (tests/gpu_worker/test_worker_gpu.py;
padding rows may keep an earlier step's attention output, where the eager
flash path zeroes them: they are never read).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gpu_worker.attention import StepKeys
from gpu_worker.model import CausalLM
from gpu_worker.step_inputs import DeviceStep

log = logging.getLogger(__name__)

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Pieces(Protocol):
    """A whole step's parts, captured (embed, qkv, rest) or run between the
    graphs (attend): batched.BatchedForward."""

    model: CausalLM

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def qkv(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> QKV: ...
    def attend(self, cache: torch.Tensor, step: DeviceStep, keys: StepKeys, qkv: QKV,
               out: torch.Tensor | None = None) -> torch.Tensor: ...
    def rest(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class _GraphSet:
    """One row count's graphs and the static tensors they read and write."""

    token_ids: torch.Tensor  # [rows] inputs, copied in before a replay
    positions: torch.Tensor
    qkv: QKV  # the layer's q, k, v: graph i's output, the cache write's and attention's input
    attended: torch.Tensor  # [rows, heads, d] attention's output, graph i + 1's input
    graphs: list[torch.cuda.CUDAGraph]  # num_layers + 1
    hidden: torch.Tensor  # the last graph's output
    rotary: tuple[torch.Tensor, torch.Tensor]  # graph 0's, read by the others: kept alive


class StepGraphs:
    def __init__(self, forward: Pieces, max_rows: int) -> None:
        self._forward = forward
        self.max_rows = max_rows
        self._sets: dict[tuple[int, int], _GraphSet] = {}
        self.failed: set[tuple[int, int]] = set()  # (rows, layers) whose capture failed
        self._pool: Any = None  # torch's pool handle, made by the first capture

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(rows, layers) of every set captured so far."""
        return sorted(self._sets)

    def hidden(self, step: DeviceStep, flat: torch.Tensor, keys: StepKeys
               ) -> torch.Tensor | None:
        """BatchedForward.hidden's result for `step` over the layers of `flat`
        ([layers, 2, slots, kv_heads, d]), `step` at most `max_rows` rows: the
        set's own output buffer, which the next step's replays (of any set:
        they share a pool) overwrite, so read it before then. None where this
        row count's graphs could not be captured: the caller runs the step op
        by op (a failed capture ran on the static buffers alone, so the
        cache and the step's inputs are as they were)."""
        key = (step.host.num_rows, flat.shape[0])
        graphs = self._sets.get(key)
        if graphs is None:
            if key in self.failed:
                return None
            device = self._forward.model.device
            stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
            try:
                graphs = self._capture(*key)
            except (RuntimeError, ValueError) as exc:  # torch's, out of memory included
                if stream is not None:  # a capture that fails in capture_end keeps its stream
                    torch.cuda.set_stream(stream)
                self.failed.add(key)
                log.warning("no CUDA graphs for steps of %d rows: they run op by op (%s)",
                            key[0], exc)
                return None
        graphs.token_ids.copy_(step.token_ids)
        graphs.positions.copy_(step.positions)
        for i, graph in enumerate(graphs.graphs[:-1]):
            graph.replay()
            self._forward.attend(flat[i], step, keys, graphs.qkv, out=graphs.attended)
        graphs.graphs[-1].replay()
        return graphs.hidden

    def _capture(self, rows: int, num_layers: int) -> _GraphSet:
        started = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        f, device, dtype = self._forward, self._forward.model.device, self._forward.model.dtype
        cfg = f.model.config
        token_ids = torch.zeros(rows, dtype=torch.long, device=device)
        positions = torch.zeros(rows, dtype=torch.long, device=device)
        q, k, v = (torch.zeros(rows, heads, cfg.head_dim, dtype=dtype, device=device)
                   for heads in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads))
        attended = torch.zeros_like(q)
        flat_attended = attended.view(rows, -1)

        def layer_qkv(i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
            # Into buffers every layer shares: a set keeps one layer's q, k,
            # v, not all of them (the pool reuses whatever else it frees).
            for static, value in zip((q, k, v), f.qkv(i, x, cos, sin), strict=True):
                static.copy_(value)

        # Warm-up off the capture (Triton compiles a kernel on its first launch).
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            x, cos, sin = f.embed(token_ids, positions)
            for i in range(num_layers):
                layer_qkv(i, x, cos, sin)
                x = f.rest(i, x, flat_attended)
        torch.cuda.current_stream(device).wait_stream(side)
        graphs = [torch.cuda.CUDAGraph() for _ in range(num_layers + 1)]
        with torch.cuda.graph(graphs[0], pool=self._pool):
            x, cos, sin = f.embed(token_ids, positions)
            layer_qkv(0, x, cos, sin)
        for i, graph in enumerate(graphs[1:], start=1):
            with torch.cuda.graph(graph, pool=self._pool):
                x = f.rest(i - 1, x, flat_attended)
                if i < num_layers:
                    layer_qkv(i, x, cos, sin)
        captured = _GraphSet(token_ids, positions, (q, k, v), attended, graphs, x, (cos, sin))
        self._sets[rows, num_layers] = captured
        log.info("captured CUDA graphs for steps of %d rows in %.0f ms (%d row counts so far)",
                 rows, (time.perf_counter() - started) * 1e3, len(self._sets))
        return captured
