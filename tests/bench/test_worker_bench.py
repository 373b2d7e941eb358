"""bench.worker_bench end to end on the tiny model, on the CPU: each mode's
row says how its steps ran, the kernel counts and the top ops are there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.worker_bench import dense_forward, main
from gpu_worker import model as model_module
from gpu_worker.config import tiny_model_config
from gpu_worker.model import build_tiny_model


def test_the_bench_reports_each_modes_steps_kernels_and_top_ops(tmp_path: Path) -> None:
    out = tmp_path / "w.json"
    main(["--model", "tiny", "--device", "cpu", "--batches", "2", "--modes",
          "batched,batched-fast", "--steps", "1", "--repeat", "1", "--count-ops",
          "--top-ops", "3", "--json", str(out)])
    summary = json.loads(out.read_text())
    rows = summary["rows"]
    # Whole where the start-up check passes on this BLAS, tiles where it fails.
    assert rows["2 batched"]["steps"] in ("whole", "tiles 16")
    assert rows["2 batched-fast"]["steps"] == "plain"
    assert all(row["decode"] > 0 and row["decode_ops"] > 0 for row in rows.values())
    assert summary["prefill_chunk_ops"] > 0
    tops = summary["top_ops"]
    assert set(tops) == {"decode step, batch 2", "prefill chunk, 1024 tokens"}
    for found in tops.values():
        ops = found["host"]  # no device on the CPU
        assert set(found) == {"host"} and 0 < len(ops) <= 3
        assert all(name.startswith("aten::") and us > 0 for name, us in ops)


def test_the_dense_ceiling_multiplies_the_stacked_weights_as_the_step_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """q, k, v in one product and gate, up in one, as the worker's step: seven
    separate products a layer made the ceiling lower than it is."""
    calls = {"fused": 0, "linear": 0}
    real_linear, real_fused = model_module.Linear.forward, model_module.Fused.__call__

    def linear(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls["linear"] += 1
        return real_linear(self, *args, **kwargs)

    def fused(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls["fused"] += 1
        return real_fused(self, *args, **kwargs)

    monkeypatch.setattr(model_module.Linear, "forward", linear)
    monkeypatch.setattr(model_module.Fused, "__call__", fused)
    cfg = tiny_model_config()
    model = build_tiny_model(cfg, 0, torch.float32, torch.device("cpu"))
    dense_forward(model, [[1] * 8, [2] * 8])
    # qkv and gate_up; o_proj and down_proj, then the head
    assert calls == {"fused": 2 * cfg.num_layers, "linear": 2 * cfg.num_layers + 1}
