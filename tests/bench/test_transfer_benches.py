"""The two benchmarks `make bench-gpu` reads figures from as JSON
(offload-vs-recompute and the KV transfer paths) run end to end here, on the
tiny model and real cache (and worker) processes, and write what they print."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import kv_transfer_bench, offload_vs_recompute


def test_offload_vs_recompute_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "offload.json"
    # No decodes beside: a recompute is then its chunks' whole steps, never a
    # difference of steps that a loaded machine can make negative.
    offload_vs_recompute.main(["--lengths", "16,64,4096", "--repeat", "1", "--decodes", "0",
                               "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["device"] == "cpu" and figures["block_size"] == 16
    # 4096 is beyond the tiny model's max_model_len: skipped, not a row.
    assert [(r["tokens"], r["blocks"]) for r in figures["rows"]] == [(16, 1), (64, 4)]
    for row in figures["rows"]:
        assert row["copy_s"] == pytest.approx(row["offload_s"] + row["restore_s"])
        assert row["recompute_s"] > 0 and row["copy_s"] > 0
        assert row["faster"] == ("offload" if row["copy_s"] < row["recompute_s"]
                                 else "recompute")
        assert row["auto_picks"] in ("offload", "recompute")


def test_kv_transfer_bench_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    assert kv_transfer_bench.main(["--shapes", "tiny", "--tokens", "40", "--rounds", "1",
                                   "--device", "cpu", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())
    assert (row["device"], row["shape"], row["tokens"]) == ("cpu", "tiny", 40)
    layers, heads, dim, _ = kv_transfer_bench.SHAPES["tiny"]
    # 3 blocks of 16 tokens, K and V, float32.
    assert row["mib"] * 2**20 == 3 * 16 * layers * heads * dim * 2 * torch.float32.itemsize
    for path in kv_transfer_bench.PATHS:
        assert row[f"{path}_s"] > 0
    assert row["arena_ratio"] > 0 and row["grpc_ratio"] > 0
